"""systemd units: running and enabled, a restart that first drains the requests in flight
(``drain``), and the checks `llamarig verify` shares."""

from __future__ import annotations

import shlex

from pyinfra import host
from pyinfra.api import FunctionCommand, operation

from llamarig.facts.cache import known
from llamarig.facts.systemd import UnitState
from llamarig.operations.drain import Drain, drain_before_restart
from llamarig.operations.host import fail
from llamarig.operations.rotation import Rotation, out_of_rotation
from llamarig.operations.rotation import callback as rotation_callback


@operation(is_idempotent=False)
def restart_service(
    service: str, drain_first: Drain | None = None, rotation: Rotation | None = None
):
    """
    Restart a systemd service on purpose: its start rate limit (meant for crash loops) is
    reset first, so a run of deliberate deploys is never refused with "start request repeated
    too quickly". Guard it with ``_if=``: it always restarts.

    + service: unit name, e.g. ``llama-server.service``
    + drain_first: the llama-server whose requests in flight to wait for before the restart
      (``Drain``: on this host, or on another one over its own connection); None: no wait
    + rotation: the gateways in front of this rig (``Rotation``): it is taken out of their
      rotation first (``serve_or_roll_back`` puts it back once checked); None: no gateway

    **Example:**

    .. code:: python

        restart_service(
            service="llama-server.service",
            drain_first=Drain(
                url="http://127.0.0.1:8080",
                timeout=120,
                bounds=HttpTimeouts.of(rig),
                service="llama-server.service",
            ),
        )
    """
    if rotation:
        yield rotation_callback(out_of_rotation, rotation)
    if drain_first:

        def drained(state, host) -> bool:
            drain_before_restart(state, host, drain_first, service)
            return True

        yield FunctionCommand(drained, (), {})
    yield restart_command(service)


def restart_command(service: str) -> str:
    """Restart ``service`` on purpose: its start rate limit (meant for crash loops) reset first.

    A start that systemd fails for want of a resource (the unit's result `resources`:
    "unavailable resources or another system error") is tried once more a second later, saying
    so with the unit's last journal lines: in two CI runs (2026-12-05 and 2026-12-06, systemd
    257) a start right after the unit had stopped or failed was refused so, once leaving a
    rolled-back rig down; 105 such failures and starts on purpose, quiet and under load, did not
    repeat it. Any other failure stands."""
    quoted = shlex.quote(service)
    again = shlex.quote(
        f"llamarig: systemd could not start {service} (unavailable resources or another system "
        "error): trying once more; its journal:"
    )
    return (
        f"{reset_failed_command(service)}; systemctl restart -- {quoted} || "
        f'{{ [ "$(systemctl show -P Result -- {quoted})" = resources ] && {{ echo {again} >&2; '
        f"journalctl -u {quoted} -n 5 --no-pager -o cat >&2; sleep 1; "
        f"{reset_failed_command(service)}; systemctl restart -- {quoted}; }}; }}"
    )


def reset_failed_command(service: str) -> str:
    """Clear ``service``'s failed state and start rate limit (a no-op when it has none)."""
    return f"systemctl reset-failed -- {shlex.quote(service)} 2>/dev/null || true"


def journal_tail_command(service: str, lines: int) -> str:
    """The last ``lines`` lines of ``service``'s journal, messages only."""
    return f"journalctl -u {shlex.quote(service)} -n {int(lines)} --no-pager -o cat"


@operation()
def unit_running(unit: str, enabled: bool = True):
    """
    Start a systemd unit that is not running and enable it at boot, as pyinfra's
    ``systemd.service(running=True, enabled=True)``; reads only this unit's state.

    + unit: the unit name, e.g. ``llama-server.service``
    + enabled: enable it at boot too

    **Example:**

    .. code:: python

        unit_running(unit="llama-server.service")
    """
    current = known(UnitState, unit=unit)
    quoted = shlex.quote(unit)
    if current["active"]:
        host.noop(f"{unit} is running")
    else:
        yield f"systemctl start -- {quoted}"
    if enabled and not current["enabled"]:
        yield f"systemctl enable -- {quoted}"


@operation(is_idempotent=False)
def check_unit_active(unit: str, what: str):
    """
    Fail unless a systemd unit is active; changes nothing.

    + unit: the unit name, e.g. ``ggml-rpc-server.service``
    + what: how the success note names it, e.g. ``on 10.0.0.12:50052``

    **Example:**

    .. code:: python

        check_unit_active(unit="ggml-rpc-server.service", what="on 10.0.0.12:50052")
    """
    if known(UnitState, unit=unit)["active"]:
        host.noop(f"{unit} active {what}")
        return
    yield from fail._inner(f"{unit} is not active (systemctl status {unit})")
