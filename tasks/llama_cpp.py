"""llama.cpp: build dependencies, the pinned commit, one build per (commit, options) in its own
directory, and the `current` link the service runs through."""

from pyinfra.operations import apt, files

from llamarig import operations, render, stage

rig = stage.rig()
paths = render.layout(rig)
llama_cpp = rig["llama_cpp"]

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
operations.git_commit(
    name=f"llama.cpp at {llama_cpp['commit'][:12]}",
    repo=llama_cpp["repo"],
    path=paths["source"],
    commit=llama_cpp["commit"],
)
operations.cmake_build(
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
stage.record(
    "server",
    files.link(
        name="Point `current` at this build",
        path=paths["current"],
        target=paths["build"],
    ),
)
