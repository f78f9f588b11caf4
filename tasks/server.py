"""Server: the systemd unit and environment file rendered from files/, restarted only when they,
the build or the model changed (or the running process predates them), then a bounded wait
until it serves, rolling back to the last version that served otherwise. A head checks its
workers before any (re)start; an RPC worker's unit is the rpc_worker stage's."""

import os
from collections.abc import Callable
from io import BytesIO, StringIO
from typing import NamedTuple

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.files import FileContents
from pyinfra.operations import server as server_ops
from pyinfra.operations import systemd
from pyinfra.operations.util import any_changed

from llamarig import operations
from llamarig.config.gateways import read_key
from llamarig.converge import stage
from llamarig.facts.cache import known
from llamarig.facts.files import FileState
from llamarig.facts.server import RunningService
from llamarig.model.catalog import model_views
from llamarig.onhost import hostpaths
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.operations.rotation import Rotation
from llamarig.planner import render
from llamarig.planner.render import unloaded_by_reload
from llamarig.serving import answers


@api.deploy("tasks/server.py")
def deploy(restart_on: list[OperationMeta]) -> list[OperationMeta]:
    """``restart_on``: the earlier operations whose change must restart the server (the build's
    link, the model's download). Returns what (re)starts the server, for the verify stage."""
    if stage.serves_no_model():
        host.noop(f"{stage.rig()['role']}: no llama-server here")
        return []
    if stage.builds_only():
        host.noop("builds only: the server is left as it is")
        return []
    # The plan's data: ctx and tensor_split resolved from the GPUs and the model header.
    rig = stage.plan().resolved
    if rig["role"] == "rpc-worker":
        # A head that became a worker keeps no key: nothing on a worker may send it.
        _no_api_key()
        return []
    inputs = [*_api_key(rig), *restart_on]
    if rig["server"]["supervisor"] == "none":
        serving = _launcher_only(rig, inputs)
    else:
        serving = _systemd_service(rig, inputs)
    if not rig["server"]["api_key_file"]:
        # Only once the version without a key serves: until then the last version that served,
        # which a rollback or the slowdown check starts again, may need the key (its unit loads
        # it as a credential, and the deploy's checks send its header).
        _no_api_key()
    stage.prune_builds(rig)
    return serving


def _no_api_key() -> None:
    for path in (hostpaths.API_KEY_PATH, hostpaths.API_KEY_HEADER_PATH):
        operations.absent(name=f"No API key file {path}", path=path)


def _api_key(rig: dict) -> list[OperationMeta]:
    """The key file (returned: a new key must restart the server) and the curl header the
    deploy's own checks send, when the rig has a key."""
    if not rig["server"]["api_key_file"]:
        return []
    gateways = rig["server"].get("gateway_key_files", [])
    api_key = operations.secret_file(
        name="API key (root only; the service reads it as a credential)"
        + (f", and the key of the {len(gateways)} gateway(s) in front" if gateways else ""),
        src=BytesIO(_accepted_keys(rig["server"]["api_key_file"], gateways)),
        dest=hostpaths.API_KEY_PATH,
    )
    operations.curl_auth_header(
        name="curl header file for the deploy's own checks (root only)",
        key_file=hostpaths.API_KEY_PATH,
        dest=hostpaths.API_KEY_HEADER_PATH,
        rewrite=api_key.will_change,
    )
    return [api_key]


def _accepted_keys(own_key_file: str, gateway_key_files: list[str]) -> bytes:
    """llama-server's key file: the rig's own key first (the line the deploy's checks send),
    then each gateway's, one per line (it accepts any of them)."""
    with open(os.path.expanduser(own_key_file), "rb") as handle:
        keys = [handle.read().strip()]
    keys += [read_key(path).encode() for path in gateway_key_files]
    return b"\n".join(keys) + b"\n"


def _put_launcher(rig: dict) -> OperationMeta:
    paths = render.layout(rig)
    return operations.atomic_file(
        name=f"Launcher {paths['launcher']} (`llamarig run`)",
        src=StringIO(render.render_launcher(rig)),
        dest=paths["launcher"],
        mode="755",
    )


def _launcher_only(rig: dict, inputs: list[OperationMeta]) -> list[OperationMeta]:
    launcher = _put_launcher(rig)
    inputs = [launcher, *inputs]
    host.noop(
        f"server.supervisor is none: nothing runs {render.layout(rig)['launcher']}; start it "
        "with `llamarig run`"
        + (
            " (the command line, build or model changed)"
            if any(i.will_change for i in inputs)
            else ""
        )
    )
    return inputs


def _systemd_service(rig: dict, inputs: list[OperationMeta]) -> list[OperationMeta]:
    """The unit, its environment file and a router's presets; the unit running, restarted
    when they or ``inputs`` changed (after the requests in flight), or a router's presets
    reloaded; then the wait until it serves, else the rollback. Returns what (re)starts it."""
    service = f"{rig['server']['service']}.service"
    unit, env_file = _unit_files(rig, service)
    names = tuple(view.name for view in model_views(rig))
    presets = _write_presets(rig, names) if names else None
    running, stale = _running(rig, service)
    needs_reload = bool(running and running["need_daemon_reload"])
    systemd.daemon_reload(
        name="Reload systemd (the unit changed)",
        _if=lambda: unit.did_change() or needs_reload,
    )
    inputs = [unit, env_file, *inputs]

    def out_of_date() -> bool:
        return any_changed(*inputs)() or bool(stale)

    _before_the_start(rig, service, running, out_of_date)
    started, restarted = stage.service_running(
        service,
        out_of_date,
        "unit, environment, build or model changed, or out of date",
        operations.Drain(
            url=render.base_url(rig),
            timeout=rig["server"]["drain_timeout"],
            bounds=HttpTimeouts.of(rig),
            service=service,
            models=names,
        ),
        Rotation.of(rig),
    )
    checked = [started, restarted]
    if presets:
        checked.append(_reload_presets(rig, service, names, presets, started, restarted))
    _serve_or_roll_back(rig, service, names, checked)
    _record_gpu_overheads(rig, started, restarted)
    if not names:
        # A rig that served several models before: once the one model serves (a rollback may
        # still need the presets), they are gone.
        presets_path = render.layout(rig)["presets"]
        operations.absent(name=f"No model presets {presets_path}", path=presets_path)
    # After the wait: a version that was rolled back leaves the launcher of the one that serves.
    _put_launcher(rig)
    return [*inputs, *checked]


def _unit_files(rig: dict, service: str) -> tuple[OperationMeta, OperationMeta]:
    """The service's environment file and unit written; returns the unit, then the file."""
    paths = render.layout(rig)
    env_file = operations.atomic_file(
        name="Service environment file",
        src=StringIO(render.render_env_file(rig)),
        dest=paths["env_file"],
        mode="644",
    )
    unit = operations.atomic_file(
        name=f"Unit {service}",
        src=StringIO(render.render_unit(rig)),
        dest=paths["unit"],
        mode="644",
    )
    return unit, env_file


class _Presets(NamedTuple):
    """A router's presets file as written, whether the router has yet to read it (not the
    presets that last served: a run cut short before the reload) and the models its reload
    unloads."""

    written: OperationMeta
    pending: bool
    unloading: tuple[str, ...]


def _write_presets(rig: dict, names: tuple[str, ...]) -> _Presets:
    """The presets file of a router serving ``names``, written."""
    paths = render.layout(rig)
    # The router reads it as the unit's user: readable by all.
    text = render.render_presets(rig)
    written = operations.atomic_file(
        name=f"Model presets {paths['presets']} ({', '.join(names)})",
        src=StringIO(text),
        dest=paths["presets"],
        mode="644",
    )
    served = f"{paths['last_good']}/presets"
    applied = known(FileState, path=served) or {}
    return _Presets(
        written,
        pending=applied.get("sha256") != render.sha256_text(text),
        unloading=tuple(unloaded_by_reload(known(FileContents, path=served), text)),
    )


def _running(rig: dict, service: str) -> tuple[dict | None, list[str]]:
    """The service's running process (None: not running) and how it differs from what it
    should run, said when it does."""
    # A run cut short after writing the unit, environment, link or model but before the
    # restart leaves the old process running: compare it with what it should run.
    running = known(RunningService, service=service, model=render.layout(rig)["model"])
    stale = render.running_differs(rig, running) if running else []
    if stale:
        host.noop(f"{service} (pid {running['pid']}) is out of date: {'; '.join(stale)}")
    return running, stale


def _before_the_start(
    rig: dict, service: str, running: dict | None, out_of_date: Callable[[], bool]
) -> None:
    """What a (re)start needs first: a head's workers answering, and a service that is not
    running cleared of a failed state."""
    if rig["role"] == "rpc-head":
        # A head (re)started without its workers cannot load the model: check them first.
        operations.check_rpc_workers(
            name=f"RPC workers answer: {', '.join(rig['rpc']['endpoints'])}",
            endpoints=rig["rpc"]["endpoints"],
            _if=lambda: not running or out_of_date(),
        )
    if not running:
        # A unit that crash-looped into its start limit (a head whose worker went away, say)
        # would refuse the start below.
        server_ops.shell(
            name=f"Clear a failed state of {service} before starting it",
            commands=[operations.reset_failed_command(service)],
        )


def _reload_presets(
    rig: dict,
    service: str,
    names: tuple[str, ...],
    presets: _Presets,
    started: OperationMeta,
    restarted: OperationMeta,
) -> OperationMeta:
    """Only the presets changed: the router reads them again; the models whose options did
    not change keep running, and so do the requests they serve."""
    server = rig["server"]
    return operations.reload_presets(
        name=f"Reload the router's presets ({', '.join(names)}; unchanged models keep serving)",
        base_url=render.base_url(rig),
        service=service,
        timeout=server["start_timeout"],
        http_timeouts=HttpTimeouts.of(rig),
        unloading=presets.unloading,
        drain_timeout=server["drain_timeout"],
        rotation=Rotation.of(rig),
        _if=lambda: (
            (presets.written.did_change() or presets.pending)
            and not (started.did_change() or restarted.did_change())
        ),
    )


def _serve_or_roll_back(
    rig: dict, service: str, names: tuple[str, ...], checked: list[OperationMeta]
) -> None:
    """The wait until the service serves, after any of ``checked`` changed it; else the
    rollback."""
    server, paths = rig["server"], render.layout(rig)
    operations.serve_or_roll_back(
        name=f"Wait until {service} serves (else roll back to the last version that served)",
        base_url=render.base_url(rig),
        service=service,
        timeout=server["start_timeout"],
        unit=paths["unit"],
        env_file=paths["env_file"],
        current=paths["current"],
        last_good=paths["last_good"],
        http_timeouts=HttpTimeouts.of(rig),
        answers=answers.answers(rig),
        max_slowdown=server["max_slowdown"],
        drain_timeout=server["drain_timeout"],
        model=_speed_of(rig),
        presets=paths["presets"] if names else None,
        probe_model=_probe_model(rig),
        models=names,
        rotation=Rotation.of(rig),
        _if=any_changed(*checked),
    )


def _record_gpu_overheads(rig: dict, started: OperationMeta, restarted: OperationMeta) -> None:
    """After a (re)start, what the used GPUs hold beyond the plan's buffers."""
    plan = stage.plan()
    indices = plan.planned_gpu_indices
    if indices:
        operations.record_gpu_overheads(
            name="Record what the GPUs hold beyond the plan's buffers (once per build and mode)",
            directory=hostpaths.OVERHEADS_DIR,
            build=render.build_id(rig),
            split_mode=rig["server"]["split_mode"],
            gpu_indices=indices,
            buffers_mib=[d.planned_mib - d.reserve_mib for d in plan.memory.devices],
            _if=any_changed(started, restarted),
        )


def _probe_model(rig: dict) -> str | None:
    """The model a router's checks ask after a start: the first loaded at startup, else the
    first (its request loads it); None for a one-model rig."""
    views = model_views(rig)
    return next((v.name for v in views if v.load_on_startup), views[0].name) if views else None


def _speed_of(rig: dict) -> str:
    """What the decode speed is measured of (the model file and its checksum; on a router the
    probe's model), so that speeds of different models are never compared."""
    views = {view.name: view.data for view in model_views(rig)}
    served = views.get(_probe_model(rig), rig)
    return f"{render.layout(served)['model']} {served['model']['sha256']}"
