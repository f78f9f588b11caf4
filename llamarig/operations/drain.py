"""The drain before a restart: llama-server has no graceful stop (SIGTERM ends the requests in
flight), so a restart first waits, within a bound, until none of its slots processes a request;
on this host, or over its own connection on the host that server runs on."""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass

from pyinfra import logger
from pyinfra.api import StringCommand

from llamarig.facts.server import parse_slot_counts, slot_counts_command
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.operations.host import connected_host

# How often a drain polls the slots, and how often it says what it waits for.
DRAIN_POLL_S = 1
DRAIN_REPORT_S = 10


@dataclass(frozen=True)
class Drain:
    """The llama-server whose requests in flight a restart waits for first.

    ``url``: its base URL, as seen from the host it runs on; ``timeout``: the most seconds to
    wait (server.drain_timeout; 0: do not wait); ``bounds``: its server.http_timeouts, which
    bound each look at its /slots; ``host``: the inventory host it runs on when that is not the
    host that restarts (an RPC worker drains its head's server, whose requests end when the
    worker goes away), None for this host; ``service``: its unit, as the messages name it;
    ``models``: a router's model names, whose loaded ones' slots are counted. ``url``,
    ``timeout`` and ``bounds`` may be given by position, the others only by name.

    **Example** (a worker's restart waits for its head's requests)::

        Drain(
            url="http://127.0.0.1:8086",
            timeout=120,
            bounds=HttpTimeouts(connect=5, probe=15, answer=120, generation=600),
            host="gpu-head",
            service="llama-server.service",
        )
    """

    url: str
    timeout: int
    bounds: HttpTimeouts
    _: KW_ONLY
    host: str | None = None
    service: str
    models: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The server as the messages name it: its unit, on its host when not this one."""
        return f"{self.service} on {self.host}" if self.host else self.service


def drain(host, server: Drain, server_host=None, restarting: str = "it") -> None:
    """Wait until no slot of ``server`` processes a request, at most ``server.timeout``
    seconds, saying on ``host`` what it waits for. Returns at once when the timeout is 0 (do not
    wait), when nothing is busy or when /slots does not answer (a server that is down or hung
    has nothing to finish). ``server_host``: the host /slots is asked on (default ``host``);
    ``restarting``: what restarts after."""
    if server.timeout <= 0:
        return
    server_host = server_host or host
    started = time.monotonic()
    reported = None
    while True:
        _, output = server_host.run_shell_command(
            StringCommand(slot_counts_command(server.url, server.bounds, server.models))
        )
        lines = output.stdout_lines
        total, busy = parse_slot_counts(lines[-1] if lines else "")
        waited = time.monotonic() - started
        if busy == 0:
            if reported is not None:
                host.log(
                    f"llamarig: the requests in flight on {server.label} finished after "
                    f"{waited:.0f} s: restarting {restarting}"
                )
            return
        if waited >= server.timeout:
            host.log_styled(
                f"llamarig: {busy} of {total} slots of {server.label} still busy after "
                f"{server.timeout} s (server.drain_timeout): restarting {restarting} anyway, "
                f"cutting {busy} request(s)",
                fg="yellow",
                log_func=logger.warning,
            )
            return
        if reported is None or waited - reported >= DRAIN_REPORT_S:
            host.log(
                f"llamarig: waiting for {busy} of {total} slots of {server.label} to finish "
                f"their requests before restarting {restarting} "
                f"({server.timeout - waited:.0f} s left of server.drain_timeout)"
            )
            reported = waited
        time.sleep(DRAIN_POLL_S)


def drain_before_restart(state, host, server: Drain, service: str) -> None:
    """``drain`` before ``service`` restarts on ``host``: on ``host`` itself, or on
    ``server.host`` over its own connection, which when it cannot be reached is said and not
    waited for."""
    if not server.host:
        drain(host, server)
        return
    server_host = connected_host(state, server.host, f"to drain it before {service} restarts")
    if not server_host:
        host.log_styled(
            f"llamarig: {server.host} is not reachable, so its requests in flight on "
            f"{server.service} were not waited for: restarting {service}",
            fg="yellow",
            log_func=logger.warning,
        )
        return
    drain(host, server, server_host, restarting=service)
