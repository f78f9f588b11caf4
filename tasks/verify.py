"""Verify: the end-of-run check that the service is active, healthy and completes a prompt.

After a (re)start the server stage's wait already checked health and a completion; on a run
that touched nothing, the running server is probed here (no change is made either way)."""

from pyinfra import host
from pyinfra.facts.systemd import SystemdStatus

from llamarig import operations, render, stage
from llamarig.facts import ServerProbe

rig = stage.rig()
service = f"{rig['server']['service']}.service"

if rig["role"] == "rpc-worker":
    rpc_service = f"{rig['rpc']['service']}.service"
    if any(operation.will_change for operation in stage.recorded("serving")):
        host.noop(f"{rpc_service} was (re)started in this run: checked by the server stage")
    elif host.get_fact(SystemdStatus).get(rpc_service):
        host.noop(f"{rpc_service} active on {rig['rpc']['host']}:{rig['rpc']['port']}")
    else:
        operations.fail(
            name="Verify the RPC worker",
            message=f"{rpc_service} is not active (systemctl status {rpc_service})",
        )
elif rig["server"]["supervisor"] == "none":
    probe = host.get_fact(ServerProbe, base_url=render.base_url(rig))
    host.noop(
        f"{render.base_url(rig)} answers /health {probe['health']}"
        if probe["health"] == 200
        else f"no server at {render.base_url(rig)} yet (supervisor none: `llamarig run` starts it)"
    )
elif any(operation.will_change for operation in stage.recorded("serving")):
    host.noop(f"{service} was (re)started in this run: checked by the server stage's wait")
else:
    active = host.get_fact(SystemdStatus).get(service)
    probe = host.get_fact(ServerProbe, base_url=render.base_url(rig))
    problems = []
    if not active:
        problems.append(f"{service} is not active (systemctl status {service})")
    if probe["health"] != 200:
        problems.append(f"{render.base_url(rig)}/health answered {probe['health']}, not 200")
    if not probe["completion_ok"]:
        problems.append("a 4-token /completion did not succeed")
    if problems:
        operations.fail(name="Verify the rig", message="; ".join(problems))
    else:
        speed = probe["tokens_per_second"]
        host.noop(
            f"{service} active, /health 200, completion at "
            + (f"{speed:.1f} tokens/s" if speed is not None else "an unreported speed")
        )
