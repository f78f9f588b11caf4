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

Who builds a key: a host of the `builders` group (`role: builder`: it serves nothing) that can
make it, the first of them in the inventory's order, else the first rig of the key. A builder
makes a key when the key it computes for that rig's build on itself is the rig's own (same
distribution release, architecture and, for a `-march=native` build, CPU flags) and, for a
CUDA build, its own CUDA toolkit is the rig's (`llama_cpp.backend: cuda`, the same `cuda`
source and version): it installs no toolkit but its own.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from llamarig.planner import render
from llamarig.tables.platform import os_key

# Set to 1, the deploy makes and keeps the builds and changes nothing that serves: the first
# step of `llamarig rollout`, so that each rig's own step gets its key's build shipped.
BUILDS_ONLY_ENV = "LLAMARIG_BUILDS_ONLY"


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


@dataclass(frozen=True)
class Builder:
    """A host of the `builders` group as the keys it can make depend on it: its LinuxDistribution
    fact, architecture, CPU flags, and its CUDA toolkit (source, version; None without one)."""

    name: str
    distribution: dict
    arch: str
    cpu_flags: list[str]
    cuda: tuple[str, str] | None


def builder(name: str, data: dict, distribution: dict, arch: str, cpu_flags: list[str]) -> Builder:
    """The Builder of host ``name`` (its validated data, its facts)."""
    cuda = data["cuda"]
    toolkit = (cuda["source"], cuda["version"]) if data["llama_cpp"]["backend"] == "cuda" else None
    return Builder(name, distribution, arch, list(cpu_flags), toolkit)


def makes(maker: Builder, data: dict, key: BuildKey) -> bool:
    """Whether builder ``maker`` can make the build of key ``key`` (a rig's, planned from
    ``data``): the same key on the builder, with the rig's CUDA toolkit for a CUDA build."""
    if not key.shared:
        return False
    if data["llama_cpp"]["backend"] == "cuda":
        if maker.cuda != (data["cuda"]["source"], data["cuda"]["version"]):
            return False
    made = build_key(data, maker.distribution, maker.arch, maker.cpu_flags, maker.name)
    return made.key == key.key


def cuda_architectures(data: dict) -> str:
    """The CUDA architectures a build's options name ("" for a CPU build): what its binary
    carries, as the build records it."""
    return str(render.cmake_options(data).get("CMAKE_CUDA_ARCHITECTURES", ""))


def builds_native(data: dict) -> bool:
    """Whether the build targets the building CPU (GGML_NATIVE, on unless the options say
    OFF; llamarig turns it off for CUDA builds)."""
    return render.cmake_options(data).get("GGML_NATIVE", "ON") != "OFF"


def sources(
    keys: dict[str, BuildKey],
    rigs: dict[str, dict] | None = None,
    builders: list[Builder] = (),
) -> dict[str, str]:
    """Where each rig's build comes from, the rigs (``keys``, their planned data ``rigs``) and
    ``builders`` in the inventory's order (the deploy's rule, converge/builds.py): the first
    builder that makes its key, else the first rig of the key; "" for a rig that builds."""
    first: dict[str, str] = {}
    found = {}
    for name, key in keys.items():
        if key.shared and key.key not in first:
            makers = (m.name for m in builders if rigs and makes(m, rigs[name], key))
            first[key.key] = next(makers, name)
        source = first[key.key] if key.shared else name
        found[name] = "" if source == name else source
    return found


def builds_of(builder_name: str, keys: dict[str, BuildKey], found: dict[str, str]) -> dict:
    """The keys builder ``builder_name`` makes, by ``sources``' answer ``found``: each key's
    first rig (whose planned data it builds with) and every rig of it."""
    made: dict[str, list[str]] = {}
    for name, source in found.items():
        if source == builder_name:
            made.setdefault(keys[name].key, []).append(name)
    return made


def build_line(key: BuildKey | None, build_id: str, source: str) -> str:
    """A rig's build as `llamarig plan` shows it."""
    if key is None:
        return f"  build {build_id}: its key (distribution, CPU) is read with --probe"
    if not key.shared:
        return f"  build {key.key} ({key.platform}): built here, for itself ({key.why_alone})"
    if source:
        return f"  build {key.key} ({key.platform}): shipped from {source}, no compiler here"
    return f"  build {key.key} ({key.platform}): built here (or from the control machine's cache)"


def builder_lines(name: str, made: dict[str, list[str]] | None) -> list[str]:
    """A builder as `llamarig plan` shows it: the keys it makes and their rigs (``made``;
    None when its facts were not read)."""
    lines = [f"== {name}: builder (serves no model)"]
    if made is None:
        lines.append("  builds: what it makes is read with --probe")
    elif not made:
        lines.append(
            "  builds nothing: no rig has a build key it makes (distribution, "
            "architecture, CPU for a native build, CUDA toolkit)"
        )
    for key, rigs in made.items() if made else ():
        lines.append(f"  builds {key} for {', '.join(rigs)}")
    return lines
