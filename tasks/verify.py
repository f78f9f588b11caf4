"""Verify: the end-of-run check that the service is active, healthy and completes a prompt.

After a (re)start the server stage's wait already checked health and a completion; on a run
that touched nothing, the running server is probed here (no change is made either way). The
checks are operations, so they read the host when they run, not while the deploy is planned."""

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta
from pyinfra.operations.util import any_changed

from llamarig import operations
from llamarig.converge import stage
from llamarig.facts.server import ServerProbe
from llamarig.model.catalog import model_views
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.planner import render


@api.deploy("tasks/verify.py")
def deploy(serving: list[OperationMeta]) -> None:
    """``serving``: what (re)starts the service in this run; when any of it changed, the
    server or rpc_worker stage's wait has checked the service already."""
    # A gateway's stage waits until every model has a rig up; a builds-only run serves nothing.
    if stage.serves_no_model() or stage.builds_only():
        return
    rig = stage.rig()
    restarted = any_changed(*serving)

    if rig["role"] == "rpc-worker":
        operations.check_unit_active(
            name="Verify the RPC worker (unless the rpc_worker stage just started it)",
            unit=f"{rig['rpc']['service']}.service",
            what=f"on {rig['rpc']['host']}:{rig['rpc']['port']}",
            _if=lambda: not restarted(),
        )
    elif rig["server"]["supervisor"] == "none":
        probe = host.get_fact(
            ServerProbe, base_url=render.base_url(rig), timeouts=HttpTimeouts.of(rig)
        )
        host.noop(
            f"{render.base_url(rig)} answers /health {probe['health']}"
            if probe["health"] == 200
            else f"no server at {render.base_url(rig)} yet "
            "(supervisor none: `llamarig run` starts it)"
        )
    else:
        operations.check_serving(
            name="Verify the rig (unless the server stage's wait just checked it)",
            unit=f"{rig['server']['service']}.service",
            base_url=render.base_url(rig),
            http_timeouts=HttpTimeouts.of(rig),
            models=tuple(view.name for view in model_views(rig)),
            _if=lambda: not restarted(),
        )
