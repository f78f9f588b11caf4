"""A rig in and out of its gateways' rotation: before a change stops it (a restart, a rollback,
the slowdown check's switches), each gateway in front of it stops sending it new requests (HAProxy
`maint`, through the gateway's runtime API over the gateway's own SSH connection; the admin
socket is never on the network) and its requests in flight there end; once the change is checked
it is put back (`ready`), whatever the outcome: HAProxy's health check then decides when it
serves again. Meanwhile its model's requests go to the other rigs, or wait at the gateway (the
hold).

`maint`, not `drain`: requests that waited in the model's queue when the rig left stayed there
after it came back from `drain` until the queue's timeout (a 503 after 30 s, HAProxy 2.6); a
server coming back from `maint` is UP only once its checks pass, and then takes the queue."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand

from llamarig.facts.gateway import runtime_api, stat_rows
from llamarig.operations.host import connected_host

POLL_S = 0.5


@dataclass(frozen=True)
class Rotation:
    """The gateways in front of a rig: each gateway host with the HAProxy servers
    (``BACKEND/SERVER``) that are this rig there; ``timeout``: the most seconds its requests
    in flight at a gateway are waited for (server.drain_timeout).

    **Example**::

        Rotation(gateways=(("gw", ("model_0/rig-a",)),), timeout=120)
    """

    gateways: tuple[tuple[str, tuple[str, ...]], ...]
    timeout: int

    @classmethod
    def of(cls, data: dict) -> Rotation | None:
        """The rotation of a rig's (derived) data; None for a rig no gateway fronts."""
        gateways = data["server"].get("gateways") or []
        if not gateways:
            return None
        return cls(
            tuple((entry["host"], tuple(entry["servers"])) for entry in gateways),
            data["server"]["drain_timeout"],
        )


def _at_each_gateway(state, host, rotation: Rotation, why: str, act) -> None:
    for name, servers in rotation.gateways:
        gateway = connected_host(state, name, why)
        if gateway is None:
            host.log_styled(
                f"llamarig: gateway {name} is not reachable ({why}); its health checks take "
                f"{host.name} out while it restarts",
                fg="yellow",
                log_func=logger.warning,
            )
            continue
        act(gateway, name, servers)


def out_of_rotation(state, host, rotation: Rotation) -> None:
    """Stop each gateway sending ``host`` new requests, then wait (within the bound) until
    its requests in flight there have ended."""

    def take_out(gateway, name: str, servers: tuple[str, ...]) -> None:
        commands = [f"set server {server} state maint" for server in servers]
        gateway.run_shell_command(StringCommand(runtime_api(*commands)))
        started = time.monotonic()
        while True:
            _, output = gateway.run_shell_command(StringCommand(runtime_api("show stat")))
            busy = _sessions(stat_rows(output.stdout_lines), servers)
            waited = time.monotonic() - started
            if busy == 0:
                host.log(f"llamarig: out of rotation at gateway {name} ({', '.join(servers)})")
                return
            if waited >= rotation.timeout:
                host.log_styled(
                    f"llamarig: {busy} request(s) still in flight through gateway {name} after "
                    f"{rotation.timeout} s (server.drain_timeout): going on, cutting them",
                    fg="yellow",
                    log_func=logger.warning,
                )
                return
            time.sleep(POLL_S)

    _at_each_gateway(state, host, rotation, f"to take {host.name} out of rotation", take_out)


def back_in_rotation(state, host, rotation: Rotation) -> None:
    """Let each gateway send ``host`` requests again (its health check decides when)."""

    def ready(gateway, name: str, servers: tuple[str, ...]) -> None:
        commands = [f"set server {server} state ready" for server in servers]
        gateway.run_shell_command(StringCommand(runtime_api(*commands)))
        host.log(f"llamarig: back in rotation at gateway {name} ({', '.join(servers)})")

    _at_each_gateway(state, host, rotation, f"to put {host.name} back in rotation", ready)


def _sessions(rows: list[dict[str, str]], servers: tuple[str, ...]) -> int:
    """Requests in flight on ``servers`` (``BACKEND/SERVER``) by HAProxy's ``scur``."""
    wanted = {tuple(server.split("/", 1)) for server in servers}
    total = 0
    for row in rows:
        if (row.get("pxname"), row.get("svname")) in wanted:
            value = row.get("scur", "0")
            total += int(value) if value.isdigit() else 0
    return total


def guarded(step: str | FunctionCommand, rotation: Rotation) -> FunctionCommand:
    """``step`` (a shell command or a callback of an operation) as a callback that puts the
    rig back in rotation when the step fails: a version that failed its check has been rolled
    back by the step, and the gateway's health check decides whether that one serves."""

    def run(state, host) -> bool:
        if isinstance(step, FunctionCommand):
            succeeded = step.execute(state, host, {})
        else:
            succeeded, output = host.run_shell_command(StringCommand(step))
            for line in output.output_lines:
                host.log(line, log_func=logger.info if succeeded else logger.error)
        if succeeded is False:
            back_in_rotation(state, host, rotation)
        return succeeded is not False

    return FunctionCommand(run, (), {})


def callback(act: Callable, rotation: Rotation) -> FunctionCommand:
    """``act`` (``out_of_rotation`` or ``back_in_rotation``) as an operation's command."""

    def run(state, host) -> bool:
        act(state, host, rotation)
        return True

    return FunctionCommand(run, (), {})
