"""llama.cpp: build dependencies, the pinned commit, one build per (commit, options) in its own
directory, and the `current` link the service runs through."""

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta

from llamarig import operations
from llamarig.converge import stage
from llamarig.facts.build import MissingCommands
from llamarig.facts.cache import known
from llamarig.facts.files import FileState
from llamarig.model.catalog import is_router
from llamarig.planner import render
from llamarig.tables.packages import BUILD_DEPENDENCIES, build_tools


@api.deploy("tasks/llama_cpp.py")
def deploy() -> OperationMeta:
    """Returns the `current` link: when it changes, whatever runs the build must restart."""
    if stage.gateway_only():
        host.noop("gateway: no llama.cpp build here")
        return None
    # The plan's data: CUDA architectures from the probed GPUs when none are declared.
    rig = stage.plan().resolved
    paths = render.layout(rig)
    llama_cpp = rig["llama_cpp"]

    if llama_cpp["build_dependencies"] == "apt":
        operations.apt_packages(
            name="Build dependencies of llama.cpp",
            packages=sorted(BUILD_DEPENDENCIES),
            no_recommends=True,
        )
    else:
        tools = build_tools(llama_cpp["ccache"])
        missing = known(MissingCommands, commands=tools)
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
    command_files = [(command_file, command_text)]
    if is_router(rig):  # the presets carry each model's options
        command_files.append((paths["presets"], render.render_presets(rig)))
    command_differs = any(
        (known(FileState, path=path) or {}).get("sha256") != render.sha256_text(text)
        for path, text in command_files
    )
    if rig["role"] != "rpc-worker":
        operations.check_server_flags(
            name="llama-server knows every option of the command line (and of the presets)",
            binary=f"{paths['build']}/bin/llama-server",
            args=render.server_args(rig) + render.preset_flags(rig),
            _if=lambda: build.did_change() or command_differs,
        )
    return operations.symlink(
        name="Point `current` at this build",
        path=paths["current"],
        target=paths["build"],
    )
