"""llama.cpp: build dependencies, the pinned commit, one build per (commit, options) in its own
directory, and the `current` link the service runs through. Rigs of one build key build once:
the first builds, the others get its build shipped, checked (converge/builds.py). With
LLAMARIG_BUILDS_ONLY=1 (`llamarig rollout`'s first step) the builds are made and kept, and
nothing else is done."""

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta

from llamarig import operations
from llamarig.converge import builds, stage
from llamarig.facts.build import MissingCommands
from llamarig.facts.cache import known
from llamarig.facts.files import FileState
from llamarig.model.catalog import is_router
from llamarig.planner import fleet, render
from llamarig.tables.packages import BUILD_DEPENDENCIES, SHIPPED_BUILD_RUNTIME, build_tools


@api.deploy("tasks/llama_cpp.py")
def deploy() -> OperationMeta:
    """Returns the `current` link: when it changes, whatever runs the build must restart."""
    if stage.gateway_only():
        host.noop("gateway: no llama.cpp build here")
        return None
    if stage.builder_only():  # it builds for the rigs of this run, runs none
        rig, paths, shares = None, None, builds.builder_shares(stage.rig())
        if not shares:
            host.noop("builder: no rig of this run has a build key it makes")
    else:
        # The plan's data: CUDA architectures from the probed GPUs when none are declared.
        rig = stage.plan().resolved
        paths = render.layout(rig)
        shares = [builds.share(rig)]
    done: set = set()  # a builder's builds share their dependencies and source tree
    made = [_make(share, done) for share in shares]
    # pyinfra runs each host's operations in order, not the hosts' in step: the builds and
    # their packing must be done before any rig of their key is sent its build.
    operations.barrier(name="Every build of this run made and kept before any is shipped")
    if rig is None:
        _prune_builder(shares)
        return None
    if stage.builds_only():  # a rig gets its key's build in its own run
        return None
    build = made[0] or _receive(rig, paths, shares[0])
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


def _make(share: builds.Share, done: set) -> OperationMeta | None:
    """The build of ``share`` compiled here (None when it is to be shipped here, or, on a
    builder, when the control machine's cache holds it), and kept for the other rigs of its key
    when one needs it. ``done``: what earlier builds of this host's run installed or checked out."""
    if share.how != "build":
        if stage.builder_only():
            host.noop(f"build {share.key.key}: the control machine's cache holds it")
        return None
    paths = render.layout(share.data)
    build = _build(share.data, paths, done)
    if share.source_rig:
        operations.pack_build(
            name=f"Keep build {share.key.key} for the other rigs of its key",
            build_dir=paths["build"],
            key=share.key.key,
            build_id=share.key.build_id,
            platform=share.key.platform,
            cuda_architectures=fleet.cuda_architectures(share.data),
            needed=share.needed,
            cuobjdump=render.cuobjdump_path(share.data),
        )
    return build


def _prune_builder(shares: list[builds.Share]) -> None:
    """A builder keeps this run's builds and the newest others up to its `keep_builds`."""
    made: dict[str, list[str]] = {}
    for share in shares:
        if share.how == "build":
            paths = render.layout(share.data)
            made.setdefault(paths["builds"], []).append(paths["build"])
    keep = stage.rig()["llama_cpp"]["keep_builds"]
    for directory, kept in made.items():
        operations.prune_builds(
            name=f"Keep this run's builds and the newest others, {keep} in all at least",
            builds=directory,
            keep=keep,
            current=kept[0],
            also=tuple(kept[1:]),
        )


def _build(rig: dict, paths: dict, done: set) -> OperationMeta:
    """Compile the build here: its dependencies, the source at the pinned commit, CMake (the
    dependencies and checkout only once per host's run: ``done``)."""
    llama_cpp = rig["llama_cpp"]
    if "dependencies" not in done:
        _dependencies(llama_cpp)
    done.add("dependencies")
    checkout = (paths["source"], llama_cpp["commit"])
    if checkout not in done:
        operations.git_commit(
            name=f"llama.cpp at {llama_cpp['commit'][:12]}",
            repo=llama_cpp["repo"],
            path=paths["source"],
            commit=llama_cpp["commit"],
        )
        done.add(checkout)
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
    return build


def _dependencies(llama_cpp: dict) -> None:
    """The compilers and tools of a build: from apt, or checked on the PATH."""
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


def _receive(rig: dict, paths: dict, share: builds.Share) -> OperationMeta:
    """Get the build of this rig's key shipped (no compiler, no source tree here): the
    libraries a build needs at run time, then the checked build (nothing, once it has it)."""
    if rig["llama_cpp"]["build_dependencies"] == "apt":
        operations.apt_packages(
            name="Run-time libraries of a shipped llama.cpp build",
            packages=sorted(SHIPPED_BUILD_RUNTIME),
            no_recommends=True,
        )
    return operations.install_shipped_build(
        name=f"Build {share.key.key}, shipped from {share.source}",
        key=share.key.key,
        build_dir=paths["build"],
        marker=paths["build_marker"],
        manifest=render.build_manifest(rig),
        cuda_architectures=fleet.cuda_architectures(rig),
        source=share.source,
        compute_capabilities=[gpu["compute_capability"] for gpu in rig["gpus"]],
    )
