"""RPC worker: the ggml-rpc-server unit of a host that lends its GPUs to a head, restarted when
it or the build changed (after the head's requests in flight), then a bounded wait until it
accepts connections, then the head restarted, which a worker's restart leaves unable to serve."""

from io import StringIO

from pyinfra import api
from pyinfra.api.operation import OperationMeta
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from llamarig import operations
from llamarig.converge import stage
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.planner import render


@api.deploy("tasks/rpc_worker.py")
def deploy(restart_on: list[OperationMeta]) -> list[OperationMeta]:
    """``restart_on``: the earlier operations whose change must restart the worker (the build's
    link). Returns what (re)starts the worker, for the verify stage."""
    if stage.serves_no_model() or stage.builds_only():
        return []
    rig = stage.plan().resolved
    serving = _worker(rig, restart_on) if rig["role"] == "rpc-worker" else []
    if rig["role"] != "standalone":
        # pyinfra runs the hosts' operations interleaved, by their position in each host's
        # list; one operation that workers and heads both call here orders every worker
        # operation above before any head operation of the server stage: a head restarts
        # only once its workers answer.
        operations.barrier(name="RPC workers converged before any head (re)starts")
    return serving


def _worker(rig: dict, restart_on: list[OperationMeta]) -> list[OperationMeta]:
    paths = render.layout(rig)
    rpc_service = f"{rig['rpc']['service']}.service"
    rpc_unit = operations.atomic_file(
        name=f"Unit {rpc_service} (RPC worker on {rig['rpc']['host']}:{rig['rpc']['port']})",
        src=StringIO(render.render_rpc_unit(rig)),
        dest=paths["rpc_unit"],
        mode="644",
    )
    systemd.daemon_reload(name="Reload systemd (the worker unit changed)", _if=rpc_unit.did_change)
    inputs = [rpc_unit, *restart_on]
    head = rig["rpc"].get("head")  # none: a worker no head of this inventory uses
    head_bounds = head and HttpTimeouts(**head["http_timeouts"])
    head_server = (
        operations.Drain(
            url=head["url"],
            timeout=head["drain_timeout"],
            bounds=head_bounds,
            host=head["name"],
            service=head["service"],
        )
        if head
        else None
    )
    started, restarted = stage.service_running(
        rpc_service, any_changed(*inputs), "unit or build changed", head_server
    )
    operations.wait_for_port(
        name=f"Wait until {rpc_service} accepts connections",
        endpoint=f"{rig['rpc']['host']}:{rig['rpc']['port']}",
        service=rpc_service,
        timeout=60,
        _if=any_changed(started, restarted),
    )
    if head:
        operations.restart_rpc_head(
            name=f"Restart {head['service']} on {head['name']} (its RPC worker restarted)",
            head=head["name"],
            service=head["service"],
            base_url=head["url"],
            timeout=head["start_timeout"],
            http_timeouts=head_bounds,
            worker=rpc_service,
            _if=any_changed(started, restarted),
        )
    stage.prune_builds(rig)
    return [*inputs, started]
