"""Server: the systemd unit and environment file rendered from files/, restarted only when they,
the build or the model changed, then a bounded wait until it serves."""

from io import StringIO

from pyinfra.operations import files, systemd
from pyinfra.operations.util import any_changed

from llamarig import operations, render, stage

# The plan's data: ctx and tensor_split resolved from the GPUs and the model header.
rig = stage.plan().resolved
server = rig["server"]
paths = render.layout(rig)
service = f"{server['service']}.service"

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
