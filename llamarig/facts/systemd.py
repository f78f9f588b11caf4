"""systemd units: their state as ``systemctl show`` gives it."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

UNIT_PROPERTIES = ("Id", "ActiveState", "SubState", "UnitFileState", "NeedDaemonReload")


class UnitState(FactBase):
    """One systemd unit's state (``systemctl show -p ...`` of that unit only, not of ``*``).

    + unit: the unit name, e.g. ``llama-server.service``

    .. code:: python

        {"active": True, "sub_state": "running", "enabled": True, "need_daemon_reload": False}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self, unit: str) -> str:
        properties = " ".join(f"-p {name}" for name in UNIT_PROPERTIES)
        return f"systemctl show {properties} -- {shlex.quote(unit)} 2>/dev/null; true"

    def process(self, output: list[str]) -> dict:
        values = dict(line.strip().split("=", 1) for line in output if "=" in line)
        sub_state = values.get("SubState", "")
        return {
            # pyinfra's SystemdStatus counts these sub-states as running.
            "active": sub_state in ("running", "waiting", "exited", "listening", "mounted"),
            "sub_state": sub_state,
            "enabled": values.get("UnitFileState", "") in ("enabled", "static"),
            "need_daemon_reload": values.get("NeedDaemonReload") == "yes",
        }
