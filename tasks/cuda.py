"""CUDA toolkit: the versioned toolkit package from the chosen source; nvcc's path goes into
the build's CMake options (render.nvcc_path)."""

from pyinfra import api, host
from pyinfra.facts.files import File

from llamarig import operations
from llamarig.converge import stage
from llamarig.facts.cache import known
from llamarig.planner import render
from llamarig.tables.packages import cuda_toolkit_package


@api.deploy("tasks/cuda.py")
def deploy() -> None:
    if stage.gateway_only():
        host.noop("gateway: no CUDA toolkit here")
        return
    rig = stage.rig()
    cuda = rig["cuda"]
    nvcc = render.nvcc_path(rig)

    if cuda["source"] == "none":
        host.noop("no CUDA toolkit wanted (CPU-only rig)")
    elif cuda["source"] == "preinstalled":
        if not known(File, path=nvcc):
            stage.refuse(
                [
                    f"cuda.source is `preinstalled` but {nvcc} does not exist; install the "
                    "toolkit or set cuda.nvcc to the nvcc of the installed toolkit"
                ]
            )
        host.noop(f"preinstalled CUDA toolkit at {nvcc}")
    else:
        operations.apt_packages(
            name=(
                f"CUDA toolkit {cuda['version']} (nvcc {nvcc})"
                if cuda["source"] == "nvidia-repo"
                else f"CUDA toolkit (distribution, nvcc {nvcc})"
            ),
            packages=[cuda_toolkit_package(cuda["source"], cuda["version"])],
            no_recommends=True,
        )
