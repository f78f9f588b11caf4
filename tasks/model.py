"""Model: download resumably and checksummed into the models directory, or use a file that is
already on the host."""

from pyinfra import host
from pyinfra.operations import files

from llamarig import operations, render, stage

rig = stage.rig()
model = rig["model"]

if rig["role"] == "rpc-worker":
    host.noop("rpc-worker: the head holds the model and sends the worker its tensors")
elif model["path"]:
    operations.check_file(
        name=f"Model file {model['path']} on the host", path=model["path"], sha256=model["sha256"]
    )
else:
    files.directory(name="Models directory", path=rig["paths"]["models"], mode="755")
    stage.record(
        "server",
        operations.fetch_checked(
            name=f"Model {render.layout(rig)['model']} (sha256 checked)",
            url=model["url"],
            dest=render.layout(rig)["model"],
            sha256=model["sha256"],
        ),
    )
