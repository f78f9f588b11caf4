"""A llama.cpp build shipped between rigs of one build key (planner/fleet.py): the rig that
built it packs its `bin/` into the control machine's cache, and each other rig of the key gets
it from there, checked (onhost/build_archive.py) before it is put in place."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import time
from collections.abc import Callable
from pathlib import PurePosixPath

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, operation

from llamarig.facts.cache import known
from llamarig.facts.files import JsonFile
from llamarig.onhost import build_archive
from llamarig.onhost.build_archive import CachedBuildError
from llamarig.tables.hardware import architecture_runs_on
from llamarig.tables.text import printable


def _log_error(target, message: str) -> None:
    target.log_styled(f"llamarig: {printable(message)}", fg="red", log_func=logger.error)


@operation()
def pack_build(
    build_dir: str,
    key: str,
    build_id: str,
    platform: str,
    cuda_architectures: str,
    needed: Callable[[], bool],
    cuobjdump: str | None = None,
):
    """
    Keep this rig's build (its ``bin/``) in the control machine's cache as the build of
    ``key``, when another rig of the key needs it and the cache holds no sound copy. A CUDA
    build is kept only when its binary holds code for every architecture its options name.

    + build_dir: the finished build directory on this host
    + key: the build key (planner/fleet.py)
    + build_id, platform, cuda_architectures: what the manifest records of it
    + needed: asked when the operation runs: whether another rig of the key is to get it
      (those rigs are planned after this one, so the answer is known only then)
    + cuobjdump: the toolkit's cuobjdump, for a CUDA build (None for a CPU build): it lists
      the device code of the build's libggml-cuda

    **Example:**

    .. code:: python

        pack_build(
            build_dir="/opt/llamarig/builds/0c1e57098bba-f86f2a2133",
            key="0c1e57098bba-f86f2a2133-3b1f0e9a7c2d",
            build_id="0c1e57098bba-f86f2a2133",
            platform="debian 13 x86_64",
            cuda_architectures="",
            needed=lambda: True,
        )
    """
    if not needed():
        host.noop(f"no other rig of this run needs build {key}")
        return
    try:
        build_archive.verified(key)
    except CachedBuildError:
        pass
    else:
        host.noop(f"the control machine's cache holds build {key}")
        return
    archive, sums, elf = (f"{build_dir}.{suffix}" for suffix in ("tar", "sha256", "elf"))
    yield build_archive.pack_command(build_dir, archive, sums, cuobjdump, elf)
    made = (build_id, platform, cuda_architectures)
    yield FunctionCommand(_fetch, (key, archive, sums, elf if cuobjdump else None, made), {})
    yield f"rm -f {shlex.quote(archive)} {shlex.quote(sums)} {shlex.quote(elf)}"


def _fetch(state, host, key, archive, sums, elf, made) -> bool:  # noqa: ARG001 - pyinfra's callback signature
    root = build_archive.cache_root()
    local = root / f".{key}.{os.getpid()}.{time.monotonic_ns()}.tar"
    listing, elf_listing = io.BytesIO(), io.BytesIO()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        started = time.monotonic()
        fetched = host.get_file(archive, str(local)) and host.get_file(sums, listing)
        if not fetched or (elf and not host.get_file(elf, elf_listing)):
            _log_error(host, f"could not fetch {archive} from {host.name}")
            return False
        manifest = build_archive.store(
            key, local, listing.getvalue().decode(errors="replace"), *made,
            elf_listing=elf_listing.getvalue().decode(errors="replace") if elf else None,
        )  # fmt: skip
    except CachedBuildError as error:
        _log_error(host, f"the build fetched from {host.name} is refused: {error}")
        return False
    except OSError as error:  # the cache's directory: not writable, a file, a full disk
        _log_error(
            host,
            f"cannot keep build {key} in {root} ({error}); fix the directory, or set "
            "LLAMARIG_BUILD_CACHE to a writable one",
        )
        return False
    finally:
        with contextlib.suppress(OSError):
            local.unlink(missing_ok=True)
    size = (build_archive.entry(key) / build_archive.ARCHIVE).stat().st_size
    host.log(
        f"llamarig: build {key} kept in {build_archive.entry(key)} ({len(manifest.files)} "
        f"files, {size / 2**20:.1f} MiB, {time.monotonic() - started:.1f} s) for the other "
        "rigs of its key"
    )
    return True


@operation()
def install_shipped_build(
    key: str,
    build_dir: str,
    marker: str,
    manifest: dict,
    cuda_architectures: str,
    source: str,
    compute_capabilities: list[str] = (),
):
    """
    Put the cached build of ``key`` on this rig as ``build_dir``: every file's sha256 is
    checked on the control machine before it is sent and on the rig before it is moved into
    place, its libraries must resolve there, and the completion marker is written last.

    + key: the build key
    + build_dir: where the build goes (the same path as on the rig that built it: its
      binaries' RUNPATH names it)
    + marker, manifest: the completion marker and what it records (as ``cmake_build``)
    + cuda_architectures: what this rig's GPUs need; the cached build must carry exactly that
    + source: where the build came from, for the messages (a host, or the cache)
    + compute_capabilities: this rig's GPUs'; the binary must hold code that runs on each

    **Example:**

    .. code:: python

        install_shipped_build(
            key="0c1e57098bba-f86f2a2133-3b1f0e9a7c2d",
            build_dir="/opt/llamarig/builds/0c1e57098bba-f86f2a2133",
            marker="/opt/llamarig/builds/0c1e57098bba-f86f2a2133/.llamarig-build.json",
            manifest={"commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"},
            cuda_architectures="",
            source="rig-1",
            compute_capabilities=[],
        )
    """
    if known(JsonFile, path=marker) == manifest:
        host.noop(f"build {build_dir} is complete")
        return
    archive, sums = f"{build_dir}.tar", f"{build_dir}.sha256"
    yield f"mkdir -p {shlex.quote(str(PurePosixPath(build_dir).parent))}"
    needs = (cuda_architectures, list(compute_capabilities))
    yield FunctionCommand(_send, (key, archive, sums, needs, source), {})
    yield build_archive.unpack_command(
        build_dir, archive, sums, marker, build_archive.marker_text(manifest)
    )


def _send(state, host, key, archive, sums, needs, source) -> bool:  # noqa: ARG001
    cuda_architectures, compute_capabilities = needs
    try:
        manifest = build_archive.verified(key)
    except CachedBuildError as error:
        _log_error(host, f"build {key} (from {source}) is refused, nothing is shipped: {error}")
        return False
    if manifest.cuda_architectures != cuda_architectures:
        _log_error(
            host,
            f"build {key} carries CUDA architectures {manifest.cuda_architectures!r}, this rig "
            f"needs {cuda_architectures!r}: nothing is shipped",
        )
        return False
    unserved = without_code(manifest.binary_architectures, compute_capabilities)
    if unserved:
        _log_error(
            host,
            f"build {key} holds device code for {', '.join(manifest.binary_architectures)}, "
            f"none that runs on compute {', '.join(unserved)} of this rig: nothing is shipped",
        )
        return False
    started = time.monotonic()
    sent = host.put_file(
        str(build_archive.entry(key) / build_archive.ARCHIVE), archive
    ) and host.put_file(io.StringIO(manifest.sums()), sums)
    if not sent:
        _log_error(host, f"could not send build {key} to {host.name}")
        return False
    host.log(
        f"llamarig: build {key} shipped from {source} ({len(manifest.files)} files checked, "
        f"{time.monotonic() - started:.1f} s); no compiler runs here"
    )
    return True


def without_code(binary_architectures: list[str], compute_capabilities: list[str]) -> list[str]:
    """The compute capabilities of ``compute_capabilities`` that no device code of the binary
    (``sm_86``, as cuobjdump names it) runs on."""
    return [
        capability
        for capability in compute_capabilities
        if not any(
            architecture_runs_on(f"{sm.removeprefix('sm_')}-real", capability)
            for sm in binary_architectures
        )
    ]
