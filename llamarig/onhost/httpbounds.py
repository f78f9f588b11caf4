"""The bounds of every HTTP request llamarig sends to a llama-server (``server.http_timeouts``):
a hung server fails a check, naming the endpoint and the bound, instead of hanging the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["probe", "answer", "generation"]


@dataclass(frozen=True)
class HttpTimeouts:
    """Seconds to connect (every request) and in all, per kind of request: ``probe`` (/health,
    /slots, a 4-token completion), ``answer`` (an expect.answers question,
    verify's requests), ``generation`` (the speed measurement, ``llamarig complete``). A
    router's presets reload and the completion after a (re)start take their time from
    server.start_timeout.

    .. code:: python

        HttpTimeouts.of(rig).curl("probe")
        # 'curl -s --connect-timeout 5 --max-time 15'
    """

    connect: int
    probe: int
    answer: int
    generation: int

    @classmethod
    def of(cls, rig: dict) -> HttpTimeouts:
        """The bounds of a host's rig data (its server.http_timeouts)."""
        return cls(**{key: int(value) for key, value in rig["server"]["http_timeouts"].items()})

    def curl(self, kind: Kind) -> str:
        """``curl -s`` bounded to connect and, in all, for a request of ``kind``."""
        return f"curl -s {self.options(kind)}"

    def options(self, kind: Kind) -> str:
        """curl's options bounding a request of ``kind``."""
        return f"--connect-timeout {self.connect} --max-time {getattr(self, kind)}"

    def said(self, kind: Kind) -> str:
        """The bound of ``kind`` in words, for a message about a request that ran past it."""
        return f"{getattr(self, kind)} s (connect {self.connect} s; server.http_timeouts.{kind})"
