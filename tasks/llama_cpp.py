"""llama.cpp: build dependencies, the pinned commit, one build per (commit, options) in its own
directory, and the `current` link the service runs through."""

from pyinfra import host
from pyinfra.operations import apt, files

from llamarig import operations, render, stage
from llamarig.facts import FileSha256, MissingCommands

# The plan's data: CUDA architectures from the probed GPUs when none are declared.
rig = stage.plan().resolved
paths = render.layout(rig)
llama_cpp = rig["llama_cpp"]

if llama_cpp["build_dependencies"] == "apt":
    apt.packages(
        name="Build dependencies of llama.cpp",
        packages=[
            "build-essential",
            "cmake",
            "ninja-build",
            "git",
            "ccache",
            "pkg-config",
            "libssl-dev",
            "curl",
            "ca-certificates",
        ],
        no_recommends=True,
    )
else:
    tools = ["cc", "c++", "cmake", "ninja", "git"] + (["ccache"] if llama_cpp["ccache"] else [])
    missing = host.get_fact(MissingCommands, commands=tools)
    if missing:
        stage.refuse(
            [
                f"llama_cpp.build_dependencies is `preinstalled` but {', '.join(missing)} "
                "is not on the PATH; install it, or set build_dependencies: apt"
                + (" (or llama_cpp.ccache: false)" if missing == ["ccache"] else "")
            ]
        )
    host.noop(f"build tools present: {', '.join(tools)}")
operations.git_commit(
    name=f"llama.cpp at {llama_cpp['commit'][:12]}",
    repo=llama_cpp["repo"],
    path=paths["source"],
    commit=llama_cpp["commit"],
)
build = operations.cmake_build(
    name=f"Build {', '.join(llama_cpp['targets'])} ({render.build_id(rig)})",
    source=paths["source"],
    build_dir=paths["build"],
    configure=render.cmake_configure_command(rig),
    build=render.cmake_build_command(rig),
    manifest=render.build_manifest(rig),
    marker=paths["build_marker"],
    ccache_dir=rig["paths"]["ccache"] if llama_cpp["ccache"] else None,
    ccache_basedir=rig["paths"]["prefix"],
)
# A command line the binary does not know must stop the run before the link and unit change.
# The file that carries the command line: the unit, or the launcher where no systemd runs it.
command_file, command_text = (
    (paths["unit"], render.render_unit(rig))
    if rig["server"]["supervisor"] == "systemd"
    else (paths["launcher"], render.render_launcher(rig))
)
command_differs = host.get_fact(FileSha256, path=command_file) != render.sha256_text(command_text)
if rig["role"] != "rpc-worker" and (build.will_change or command_differs):
    operations.check_server_flags(
        name="llama-server knows every option of the command line",
        binary=f"{paths['build']}/bin/llama-server",
        args=render.server_args(rig),
    )
stage.record(
    "server",
    files.link(
        name="Point `current` at this build",
        path=paths["current"],
        target=paths["build"],
    ),
)
