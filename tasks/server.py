"""Server: the systemd unit and environment file rendered from files/, restarted only when they,
the build or the model changed, then a bounded wait until it serves."""

import os
from io import StringIO

from pyinfra import host
from pyinfra.facts.files import File
from pyinfra.operations import files, systemd
from pyinfra.operations import server as server_ops
from pyinfra.operations.util import any_changed

from llamarig import operations, render, stage

# The plan's data: ctx and tensor_split resolved from the GPUs and the model header.
rig = stage.plan().resolved
server = rig["server"]
paths = render.layout(rig)
service = f"{server['service']}.service"

if server["api_key_file"]:
    api_key = operations.secret_file(
        name="API key (root only; the service reads it as a credential)",
        src=os.path.expanduser(server["api_key_file"]),
        dest=render.API_KEY_PATH,
    )
    if api_key.will_change or not host.get_fact(File, path=render.API_KEY_HEADER_PATH):
        server_ops.shell(
            name="curl header file for the deploy's own checks (root only)",
            # printf is a shell builtin: the key never appears in a process's arguments.
            commands=[
                f"umask 077; printf 'Authorization: Bearer %s\\n' "
                f'"$(head -n1 {render.API_KEY_PATH})" > {render.API_KEY_HEADER_PATH}'
            ],
        )
    stage.record("server", api_key)
else:
    for path in (render.API_KEY_PATH, render.API_KEY_HEADER_PATH):
        files.file(name=f"No API key file {path}", path=path, present=False)

env_file = files.put(
    name="Service environment file",
    src=StringIO(render.render_env_file(rig)),
    dest=paths["env_file"],
    mode="644",
)
unit = files.put(
    name=f"Unit {service}",
    src=StringIO(render.render_unit(rig)),
    dest=paths["unit"],
    mode="644",
)
systemd.daemon_reload(name="Reload systemd (the unit changed)", _if=unit.did_change)
started = systemd.service(
    name=f"{service} enabled and running",
    service=service,
    running=True,
    enabled=True,
)
inputs = [unit, env_file, *stage.recorded("server")]
restarted = operations.restart_service(
    name=f"Restart {service} (unit, environment, build or model changed)",
    service=service,
    _if=lambda: any_changed(*inputs)() and not started.did_change(),
)
stage.record("serving", *inputs, started)
operations.wait_until_serving(
    name=f"Wait until {service} serves",
    base_url=render.base_url(rig),
    service=server["service"],
    timeout=server["start_timeout"],
    _if=any_changed(started, restarted),
)
