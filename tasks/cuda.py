"""CUDA toolkit: the versioned toolkit package from the chosen source; nvcc's path goes into
the build's CMake options (render.nvcc_path)."""

from pyinfra import host
from pyinfra.facts.files import File
from pyinfra.operations import apt

from llamarig import render, stage

rig = stage.rig()
cuda = rig["cuda"]
nvcc = render.nvcc_path(rig)

if cuda["source"] == "none":
    host.noop("no CUDA toolkit wanted (CPU-only rig)")
elif cuda["source"] == "preinstalled":
    if not host.get_fact(File, path=nvcc):
        stage.refuse(
            [
                f"cuda.source is `preinstalled` but {nvcc} does not exist; install the toolkit "
                "or set cuda.nvcc to the nvcc of the installed toolkit"
            ]
        )
    host.noop(f"preinstalled CUDA toolkit at {nvcc}")
elif cuda["source"] == "nvidia-repo":
    apt.packages(
        name=f"CUDA toolkit {cuda['version']} (nvcc {nvcc})",
        packages=[f"cuda-toolkit-{cuda['version'].replace('.', '-')}"],
        no_recommends=True,
    )
else:
    apt.packages(
        name=f"CUDA toolkit (distribution, nvcc {nvcc})",
        packages=["nvidia-cuda-toolkit"],
        no_recommends=True,
    )
