"""systemd units: running and enabled, a restart that first drains the requests in flight,
and the checks `llamarig verify` shares."""

from __future__ import annotations

import shlex
import time

from pyinfra import host, logger
from pyinfra.api import (
    FunctionCommand,
    StringCommand,
    operation,
)

from llamarig.facts.cache import known
from llamarig.facts.server import parse_slot_counts, slot_counts_command
from llamarig.facts.systemd import UnitState
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.operations.host import connected_host, fail

# How often a drain polls the slots, and how often it says what it waits for.
DRAIN_POLL_S = 1
DRAIN_REPORT_S = 10


def drain(
    host,
    base_url: str,
    service: str,
    timeout: int,
    timeouts: HttpTimeouts,
    server_host=None,
    restarting: str = "it",
    models: tuple[str, ...] = (),
) -> None:
    """Wait until no slot of the llama-server at ``base_url`` processes a request, at most
    ``timeout`` seconds, saying what it waits for; llama-server has no graceful stop (SIGTERM
    ends the requests in flight), so this is the drain. Returns at once when ``timeout`` is 0
    (server.drain_timeout: do not wait), when nothing is busy or when /slots does not answer (a
    server that is down or hung has nothing to finish). ``timeouts``: the server's
    server.http_timeouts, which bound each look at /slots. ``server_host``: the host the server
    runs on, where /slots is asked (default ``host``); ``restarting``: what restarts after;
    ``models``: a router's model names (the slots of each loaded one)."""
    if timeout <= 0:
        return
    server_host = server_host or host
    started = time.monotonic()
    reported = None
    while True:
        _, output = server_host.run_shell_command(
            StringCommand(slot_counts_command(base_url, timeouts, models))
        )
        lines = output.stdout_lines
        total, busy = parse_slot_counts(lines[-1] if lines else "")
        waited = time.monotonic() - started
        if busy == 0:
            if reported is not None:
                host.log(
                    f"llamarig: the requests in flight on {service} finished after "
                    f"{waited:.0f} s: restarting {restarting}"
                )
            return
        if waited >= timeout:
            host.log_styled(
                f"llamarig: {busy} of {total} slots of {service} still busy after {timeout} s "
                f"(server.drain_timeout): restarting {restarting} anyway, cutting {busy} "
                "request(s)",
                fg="yellow",
                log_func=logger.warning,
            )
            return
        if reported is None or waited - reported >= DRAIN_REPORT_S:
            host.log(
                f"llamarig: waiting for {busy} of {total} slots of {service} to finish their "
                f"requests before restarting {restarting} ({timeout - waited:.0f} s left of "
                "server.drain_timeout)"
            )
            reported = waited
        time.sleep(DRAIN_POLL_S)


@operation(is_idempotent=False)
def restart_service(
    service: str,
    drain_url: str | None = None,
    drain_timeout: int = 0,
    drain_bounds: HttpTimeouts | None = None,
    drain_host: str | None = None,
    drain_service: str | None = None,
    drain_models: tuple[str, ...] = (),
):
    """
    Restart a systemd service on purpose: its start rate limit (meant for crash loops) is
    reset first, so a run of deliberate deploys is never refused with "start request repeated
    too quickly". Guard it with ``_if=``: it always restarts.

    + service: unit name, e.g. ``llama-server.service``
    + drain_url, drain_timeout: a llama-server's base URL and the most seconds to wait for
      its requests in flight to finish before the restart (``drain``); none: no wait
    + drain_bounds: that server's server.http_timeouts (each look at its /slots); required
      with ``drain_url``
    + drain_host, drain_service: the inventory host that llama-server runs on and its unit,
      when it is not this host's ``service`` (an RPC worker drains its head's server, whose
      requests end when the worker goes away); reached over its own connection
    + drain_models: a router's model names, whose loaded ones' slots the drain waits for

    **Example:**

    .. code:: python

        restart_service(
            service="llama-server.service",
            drain_url="http://127.0.0.1:8080",
            drain_timeout=120,
            drain_bounds=HttpTimeouts.of(rig),
        )
    """
    if drain_url:

        def drained(state, host) -> bool:
            if not drain_host:
                drain(host, drain_url, service, drain_timeout, drain_bounds, models=drain_models)
                return True
            server_host = connected_host(
                state, drain_host, f"to drain it before {service} restarts"
            )
            if not server_host:
                host.log_styled(
                    f"llamarig: {drain_host} is not reachable, so its requests in flight on "
                    f"{drain_service} were not waited for: restarting {service}",
                    fg="yellow",
                    log_func=logger.warning,
                )
                return True
            label = f"{drain_service} on {drain_host}"
            drain(
                host, drain_url, label, drain_timeout, drain_bounds, server_host, restarting=service
            )
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
