"""One llama.cpp build per build key for the whole inventory: the key of a rig is what decides
its binary, so rigs of one key can run one build, made once and shipped to the others.

The key: the build's directory name (the commit, and a digest of the CMake options llamarig
plans, the CUDA architecture list among them, and the targets), the prefix (the binaries'
RUNPATH names the build directory), the distribution release (its compiler, C++ library and
OpenSSL), the machine architecture, the CUDA toolkit's version, and for a CPU build made with
GGML_NATIVE (`-march=native`, llama.cpp's default for CPU builds) the CPU's feature flags: such
a binary may use any instruction the builder's CPU has. A compiler or toolkit that
llamarig did not install (`build_dependencies: preinstalled`, `cuda.source: preinstalled`) is
the host's own: such a rig builds for itself, as does one with `llama_cpp.share_builds: false`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from llamarig.planner import render
from llamarig.tables.platform import os_key


@dataclass(frozen=True)
class BuildKey:
    """A rig's build key, what it is made of, and whether other rigs may share its build.

    **Example**::

        BuildKey(key="0c1e57098bba-f86f2a2133-3b1f0e9a7c2d", build_id="0c1e57098bba-f86f2a2133",
                 platform="debian 13 x86_64", shared=True)
    """

    key: str
    build_id: str
    platform: str
    shared: bool
    why_alone: str = ""


def build_key(
    data: dict, distribution: dict, arch: str, cpu_flags: list[str], host_name: str
) -> BuildKey:
    """The build key of rig ``data`` (planned: its CUDA architectures resolved) on a host whose
    LinuxDistribution fact is ``distribution``, architecture ``arch`` and CPU flags
    ``cpu_flags``."""
    llama_cpp, cuda = data["llama_cpp"], data["cuda"]
    os_id, version = os_key(distribution)
    platform = f"{os_id} {version} {arch}"
    alone = ""
    if not llama_cpp["share_builds"]:
        alone = "llama_cpp.share_builds is false"
    elif llama_cpp["build_dependencies"] == "preinstalled":
        alone = "its compilers are its own (llama_cpp.build_dependencies: preinstalled)"
    elif llama_cpp["backend"] == "cuda" and cuda["source"] == "preinstalled":
        alone = "its CUDA toolkit is its own (cuda.source: preinstalled)"
    parts = {
        "prefix": data["paths"]["prefix"],
        "platform": platform,
        "cuda": f"{cuda['source']} {cuda['version']}" if llama_cpp["backend"] == "cuda" else None,
        "cpu": " ".join(cpu_flags) if builds_native(data) else None,
        # A build nobody may share is keyed to its host, so no other rig takes it.
        "host": host_name if alone else None,
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    build_id = render.build_id(data)
    return BuildKey(f"{build_id}-{digest}", build_id, platform, not alone, alone)


def cuda_architectures(data: dict) -> str:
    """The CUDA architectures a build's options name ("" for a CPU build): what its binary
    carries, as the build records it."""
    return str(render.cmake_options(data).get("CMAKE_CUDA_ARCHITECTURES", ""))


def builds_native(data: dict) -> bool:
    """Whether the build targets the building CPU (GGML_NATIVE, on unless the options say
    OFF; llamarig turns it off for CUDA builds)."""
    return render.cmake_options(data).get("GGML_NATIVE", "ON") != "OFF"


def sources(keys: dict[str, BuildKey]) -> dict[str, str]:
    """Where each rig's build comes from, the rigs in the inventory's order (the deploy's
    rule, converge/builds.py): "" for the first rig of a key (it builds), else that rig."""
    first: dict[str, str] = {}
    found = {}
    for name, key in keys.items():
        source = first.setdefault(key.key, name) if key.shared else name
        found[name] = "" if source == name else source
    return found


def build_line(key: BuildKey | None, build_id: str, source: str) -> str:
    """A rig's build as `llamarig plan` shows it."""
    if key is None:
        return f"  build {build_id}: its key (distribution, CPU) is read with --probe"
    if not key.shared:
        return f"  build {key.key} ({key.platform}): built here, for itself ({key.why_alone})"
    if source:
        return f"  build {key.key} ({key.platform}): shipped from {source}, no compiler here"
    return f"  build {key.key} ({key.platform}): built here (or from the control machine's cache)"
