"""Server: the systemd unit and environment file rendered from files/, restarted only when they,
the build or the model changed (or the running process predates them), then a bounded wait
until it serves, rolling back to the last version that served otherwise. An RPC worker gets its
ggml-rpc-server unit instead; a head checks its workers before any (re)start."""

import os
import shlex
from io import StringIO

from pyinfra import host
from pyinfra.facts.files import File, FileContents
from pyinfra.operations import files, systemd
from pyinfra.operations import server as server_ops
from pyinfra.operations.util import any_changed

from llamarig import operations, render, stage
from llamarig.facts import RunningService

# The plan's data: ctx and tensor_split resolved from the GPUs and the model header.
rig = stage.plan().resolved
server = rig["server"]
paths = render.layout(rig)
service = f"{server['service']}.service"

if rig["role"] == "rpc-worker":
    # Workers come first in this file, so pyinfra runs their operations before any head's:
    # a head restarts only once its workers answer.
    rpc_service = f"{rig['rpc']['service']}.service"
    rpc_unit = operations.atomic_file(
        name=f"Unit {rpc_service} (RPC worker on {rig['rpc']['host']}:{rig['rpc']['port']})",
        src=StringIO(render.render_rpc_unit(rig)),
        dest=paths["rpc_unit"],
        mode="644",
    )
    systemd.daemon_reload(name="Reload systemd (the worker unit changed)", _if=rpc_unit.did_change)
    worker_inputs = [rpc_unit, *stage.recorded("server")]
    worker_started, worker_restarted = stage.service_running(
        rpc_service, any_changed(*worker_inputs), "unit or build changed"
    )
    stage.record("serving", *worker_inputs, worker_started)
    operations.wait_for_port(
        name=f"Wait until {rpc_service} accepts connections",
        endpoint=f"{rig['rpc']['host']}:{rig['rpc']['port']}",
        service=rpc_service,
        timeout=60,
        _if=any_changed(worker_started, worker_restarted),
    )
else:
    if server["api_key_file"]:
        api_key = operations.secret_file(
            name="API key (root only; the service reads it as a credential)",
            src=os.path.expanduser(server["api_key_file"]),
            dest=render.API_KEY_PATH,
        )
        if api_key.will_change or not host.get_fact(File, path=render.API_KEY_HEADER_PATH):
            header = render.API_KEY_HEADER_PATH
            server_ops.shell(
                name="curl header file for the deploy's own checks (root only)",
                # printf is a shell builtin: the key never appears in a process's arguments.
                # Renamed into place: a truncated header would survive every later run.
                commands=[
                    f"umask 077; printf 'Authorization: Bearer %s\\n' "
                    f'"$(head -n1 {render.API_KEY_PATH})" > {header}{operations.ATOMIC_SUFFIX} '
                    f"&& {operations.rename_into_place(header, '600')}"
                ],
            )
        stage.record("server", api_key)
    else:
        for path in (render.API_KEY_PATH, render.API_KEY_HEADER_PATH):
            files.file(name=f"No API key file {path}", path=path, present=False)

    def put_launcher():
        return operations.atomic_file(
            name=f"Launcher {paths['launcher']} (`llamarig run`)",
            src=StringIO(render.render_launcher(rig)),
            dest=paths["launcher"],
            mode="755",
        )

    if server["supervisor"] == "none":
        launcher = put_launcher()
        inputs = [launcher, *stage.recorded("server")]
        stage.record("serving", *inputs)
        host.noop(
            f"server.supervisor is none: nothing runs {paths['launcher']}; start it with "
            "`llamarig run`"
            + (
                " (the command line, build or model changed)"
                if any(i.will_change for i in inputs)
                else ""
            )
        )
    else:
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
        # A run cut short after writing the unit, environment, link or model but before the
        # restart leaves the old process running: compare it with what it should run.
        running = host.get_fact(RunningService, service=service, model=paths["model"])
        stale = render.running_differs(rig, running) if running else []
        if stale:
            host.noop(f"{service} (pid {running['pid']}) is out of date: {'; '.join(stale)}")
        needs_reload = bool(running and running["need_daemon_reload"])
        systemd.daemon_reload(
            name="Reload systemd (the unit changed)",
            _if=lambda: unit.did_change() or needs_reload,
        )
        inputs = [unit, env_file, *stage.recorded("server")]

        def out_of_date() -> bool:
            return any_changed(*inputs)() or bool(stale)

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
                commands=[f"systemctl reset-failed -- {shlex.quote(service)} 2>/dev/null || true"],
            )
        started, restarted = stage.service_running(
            service, out_of_date, "unit, environment, build or model changed, or out of date"
        )
        stage.record("serving", *inputs, started)
        operations.serve_or_roll_back(
            name=f"Wait until {service} serves (else roll back to the last version that served)",
            base_url=render.base_url(rig),
            service=service,
            timeout=server["start_timeout"],
            unit=paths["unit"],
            env_file=paths["env_file"],
            current=paths["current"],
            last_good=paths["last_good"],
            _if=any_changed(started, restarted),
        )
        # After the wait: a version that was rolled back leaves the launcher of the one that serves.
        put_launcher()

operations.prune_builds(
    name=f"Keep the newest {rig['llama_cpp']['keep_builds']} builds",
    builds=paths["builds"],
    keep=rig["llama_cpp"]["keep_builds"],
    current=paths["build"],
    last_good=(host.get_fact(FileContents, path=f"{paths['last_good']}/current") or [None])[0],
)
