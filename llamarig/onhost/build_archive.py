"""A llama.cpp build shipped from the rig that built it to the others of its build key: the
archive of its `bin/` (a tar of regular files and links within it), the manifest beside it in
the control machine's cache (the key, each file's sha256, the CUDA architectures the build's
options name and those its binary holds code for, the archive's sha256), and the checks each
side makes of them.

The cache is on the control machine, under ``$LLAMARIG_BUILD_CACHE`` (else
``$XDG_CACHE_HOME/llamarig/builds``, else ``~/.cache/llamarig/builds``): one directory per key,
the newest CACHE_KEEP kept. It holds binaries only: a build directory holds no secret (keys and
tokens live under /etc/llamarig), and only `bin/` is packed.

A cached build is untrusted input: its manifest is read into a fixed shape, every member of the
archive must be a file or link under `bin/` whose digest (or target) the manifest lists, and
nothing else; one byte changed anywhere refuses it before it reaches a rig."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

ARCHIVE = "build.tar"
MANIFEST = "manifest.json"
SUMS = "SHA256SUMS"
CACHE_KEEP = 8
# 2: the architectures of the binary's own code (cuobjdump --list-elf) recorded.
MANIFEST_VERSION = 2
_KEY = re.compile(r"[0-9a-f]{12}-[0-9a-f]{10}-[0-9a-f]{12}")
_MEMBER = re.compile(r"bin/[A-Za-z0-9._+-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# An architecture of device code: cuobjdump names each cubin NAME.N.sm_XY[a|f].cubin.
_SM = re.compile(r"sm_[0-9]{2,3}[af]?")
_CUBIN = re.compile(r"ELF file\s+\d+:\s+\S*\.(sm_[0-9]{2,3}[af]?)\.cubin\s*$")


class CachedBuildError(Exception):
    """A cached build that may not be shipped; the message says what is wrong with it."""


def cache_root() -> Path:
    """The control machine's build cache (module docstring)."""
    explicit = os.environ.get("LLAMARIG_BUILD_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llamarig" / "builds"


def entry(key: str) -> Path:
    """The cache directory of ``key`` (refused unless the key has its shape)."""
    if not _KEY.fullmatch(key):
        raise CachedBuildError(f"not a build key: {key!r}")
    return cache_root() / key


@dataclass(frozen=True)
class Manifest:
    """What a cached build is: its key, build directory name, platform, the CUDA architectures
    its options name and those its binary holds code for (``sm_86``; none for a CPU build),
    each file's sha256 and each link's target (paths under bin/), and the archive's sha256.

    **Example**::

        Manifest(key="0c1e57098bba-f86f2a2133-3b1f0e9a7c2d", build_id="0c1e57098bba-f86f2a2133",
                 platform="debian 13 x86_64", cuda_architectures="",
                 files={"bin/llama-server": "9f…"}, links={"bin/libllama.so": "libllama.so.0"},
                 archive_sha256="4c…", binary_architectures=[])
    """

    key: str
    build_id: str
    platform: str
    cuda_architectures: str
    files: dict[str, str]
    links: dict[str, str]
    archive_sha256: str
    binary_architectures: list[str]

    def to_json(self) -> str:
        return json.dumps({"version": MANIFEST_VERSION, **self.__dict__}, indent=2, sort_keys=True)

    def sums(self) -> str:
        """The files' digests as `sha256sum -c` reads them."""
        return "".join(f"{digest}  {name}\n" for name, digest in sorted(self.files.items()))


def read_manifest(text: str) -> Manifest:
    """A manifest from its JSON, every field checked for its shape."""
    try:
        raw = json.loads(text)
    except ValueError as error:
        raise CachedBuildError(f"{MANIFEST} is not JSON ({error})") from None
    fields = ("key", "build_id", "platform", "cuda_architectures", "archive_sha256")
    if not isinstance(raw, dict) or raw.get("version") != MANIFEST_VERSION:
        raise CachedBuildError(f"{MANIFEST} is not a version {MANIFEST_VERSION} manifest")
    if not all(isinstance(raw.get(name), str) for name in fields):
        raise CachedBuildError(f"{MANIFEST} lacks one of {', '.join(fields)}")
    files, links = raw.get("files"), raw.get("links")
    if not isinstance(files, dict) or not isinstance(links, dict) or not files:
        raise CachedBuildError(f"{MANIFEST} lists no files")
    for name, digest in files.items():
        if (
            not _MEMBER.fullmatch(name)
            or not isinstance(digest, str)
            or not _SHA256.fullmatch(digest)
        ):
            raise CachedBuildError(f"{MANIFEST} lists a file it may not: {name!r}")
    for name, target in links.items():
        if not _MEMBER.fullmatch(name) or not isinstance(target, str):
            raise CachedBuildError(f"{MANIFEST} lists a link it may not: {name!r}")
        if not _MEMBER.fullmatch(f"bin/{target}") or f"bin/{target}" not in {**files, **links}:
            raise CachedBuildError(f"{MANIFEST}: link {name} points outside the build: {target!r}")
    if not _SHA256.fullmatch(raw["archive_sha256"]) or not _KEY.fullmatch(raw["key"]):
        raise CachedBuildError(f"{MANIFEST} has a malformed key or archive digest")
    binary = raw.get("binary_architectures")
    if not isinstance(binary, list) or not all(
        isinstance(sm, str) and _SM.fullmatch(sm) for sm in binary
    ):
        raise CachedBuildError(f"{MANIFEST} has malformed binary_architectures")
    return Manifest(
        **{name: raw[name] for name in fields},
        files=files,
        links=links,
        binary_architectures=binary,
    )


def elf_architectures(listing: str) -> list[str]:
    """The architectures of the device code in `cuobjdump --list-elf`'s ``listing`` (each
    ``sm_XY``, once, lowest first); lines of another shape are not read."""
    found = {match[1] for line in listing.splitlines() if (match := _CUBIN.match(line.strip()))}
    return sorted(found, key=lambda sm: (int(re.sub(r"\D", "", sm)), sm))


def unbuilt_architectures(configured: str, binary: list[str]) -> list[str]:
    """The entries of the options' CMAKE_CUDA_ARCHITECTURES list (``configured``) with real
    code (not ``-virtual``) whose ``sm_`` the binary lacks; llama.cpp builds a plain 12X as
    12Xa."""
    missing = []
    for entry_ in filter(None, configured.split(";")):
        number, _, kind = entry_.partition("-")
        if kind == "virtual":
            continue
        if re.fullmatch(r"12[0-9]", number):
            number += "a"
        if f"sm_{number}" not in binary:
            missing.append(f"sm_{number}")
    return missing


def _sha256_stream(stream) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: stream.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def _sha256_file(path: Path) -> str:
    with path.open("rb") as stream:
        return _sha256_stream(stream)


def archive_members(archive: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The archive's files (name -> sha256) and links (name -> target); refused if it holds
    anything else, or a name outside bin/."""
    files: dict[str, str] = {}
    links: dict[str, str] = {}
    try:
        with tarfile.open(archive, "r:") as tar:
            for member in tar:
                name = member.name.removeprefix("./")
                if member.isdir() and name in ("", ".", "bin"):
                    continue
                if not _MEMBER.fullmatch(name) or name in files or name in links:
                    raise CachedBuildError(f"the archive holds {name!r}, outside bin/ or twice")
                if member.isfile():
                    files[name] = _sha256_stream(tar.extractfile(member))
                elif member.issym():
                    links[name] = member.linkname
                else:
                    raise CachedBuildError(f"the archive holds {name!r}, neither file nor link")
    except (tarfile.TarError, OSError) as error:
        raise CachedBuildError(f"the archive cannot be read ({error})") from None
    return files, links


def verified(key: str) -> Manifest:
    """The manifest of the cached build of ``key``, once its archive matches it in every
    byte; CachedBuildError (saying what differs) otherwise, also when there is none."""
    directory = entry(key)
    archive, manifest_path = directory / ARCHIVE, directory / MANIFEST
    if not archive.is_file() or not manifest_path.is_file():
        raise CachedBuildError(f"no cached build of {key} in {directory}")
    manifest = read_manifest(manifest_path.read_text(errors="replace"))
    if manifest.key != key:
        raise CachedBuildError(f"{manifest_path} is the manifest of another key")
    if _sha256_file(archive) != manifest.archive_sha256:
        raise CachedBuildError(f"{archive} is not the archive its manifest names (sha256 differs)")
    files, links = archive_members(archive)
    for name in sorted(set(files) | set(manifest.files)):
        if files.get(name) != manifest.files.get(name):
            raise CachedBuildError(f"{name} in {archive} differs from its manifest")
    if links != manifest.links:
        raise CachedBuildError(f"the links in {archive} differ from its manifest")
    return manifest


def store(
    key: str,
    archive: Path,
    sums: str,
    build_id: str,
    platform: str,
    cuda_architectures: str,
    elf_listing: str | None = None,
) -> Manifest:
    """Put a fetched archive into the cache as ``key``'s build: its members must be exactly
    the files ``sums`` (the builder's `sha256sum` of them) lists, and for a CUDA build its
    binary (``elf_listing``: `cuobjdump --list-elf` of its libggml-cuda) must hold code for
    every architecture its options name. The entry appears whole or not at all; the oldest
    beyond CACHE_KEEP are removed."""
    listed: dict[str, str] = {}
    for line in sums.splitlines():
        digest, _, name = line.partition("  ")
        listed[name.removeprefix("./")] = digest
    files, links = archive_members(archive)
    if files != listed:
        raise CachedBuildError(f"the archive fetched for {key} differs from the builder's files")
    binary = elf_architectures(elf_listing) if elf_listing is not None else []
    if cuda_architectures:
        missing = unbuilt_architectures(cuda_architectures, binary)
        if missing:
            raise CachedBuildError(
                f"its libggml-cuda holds code for {', '.join(binary) or 'no architecture'} "
                f"(cuobjdump --list-elf), not for {', '.join(missing)}, which its options "
                f"name ({cuda_architectures})"
            )
    manifest = Manifest(
        key, build_id, platform, cuda_architectures, files, links, _sha256_file(archive), binary
    )
    read_manifest(manifest.to_json())  # the shape every later reader checks
    final = entry(key)
    final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    staging = final.parent / f".{key}.{os.getpid()}.{time.monotonic_ns()}"
    staging.mkdir(mode=0o700)
    shutil.move(str(archive), staging / ARCHIVE)
    (staging / MANIFEST).write_text(manifest.to_json() + "\n")
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    _evict(final.parent)
    return manifest


def _evict(root: Path) -> None:
    entries = sorted(
        (path for path in root.iterdir() if path.is_dir() and _KEY.fullmatch(path.name)),
        key=lambda path: path.stat().st_mtime,
        reverse=True,
    )
    for stale in entries[CACHE_KEEP:]:
        shutil.rmtree(stale, ignore_errors=True)


def pack_command(
    build_dir: str, archive: str, sums: str, cuobjdump: str | None = None, elf: str = ""
) -> str:
    """The builder's shell command: `bin/` of ``build_dir`` into the tar ``archive`` and its
    files' sha256 into ``sums``; for a CUDA build (``cuobjdump``: the toolkit's) the device
    code its libggml-cuda holds into ``elf``."""
    build, tar, listing = shlex.quote(build_dir), shlex.quote(archive), shlex.quote(sums)
    command = (
        f"cd {build} && tar --sort=name --owner=0 --group=0 --numeric-owner -cf {tar} bin && "
        f"find bin -type f -print0 | sort -z | xargs -0 sha256sum > {listing}"
    )
    if cuobjdump is None:
        return command
    return (
        f"{command} && library=$(find bin -name 'libggml-cuda.so*' -type f | sort | head -n 1) "
        '&& { [ -n "$library" ] || { echo "llamarig: no libggml-cuda.so in '
        f'{build_dir}/bin: not a CUDA build" >&2; false; }}; }} '
        f'&& LC_ALL=C {shlex.quote(cuobjdump)} --list-elf "$library" > {shlex.quote(elf)}'
    )


def unpack_command(build_dir: str, archive: str, sums: str, marker: str, marker_text: str) -> str:
    """The receiving rig's shell command: the archive unpacked beside ``build_dir``, each file
    checked against ``sums``, then moved into place (unless ``build_dir`` holds those very
    files already); its libraries must all resolve (the
    binaries' RUNPATH names ``build_dir``, so only there), else it is removed again; the
    completion marker last."""
    build = shlex.quote(build_dir)
    staging = shlex.quote(f"{build_dir}.shipped")
    missing = (
        f'missing=$(for f in {build}/bin/*; do [ -f "$f" ] && [ -x "$f" ] && ldd "$f"; '
        "done 2>/dev/null | awk '/not found/ {print $1}' | sort -u | tr '\\n' ' ')"
    )
    return " && ".join(
        [
            f"rm -rf {staging} && mkdir -p {staging}",
            f"tar -xf {shlex.quote(archive)} -C {staging} --no-same-owner --no-same-permissions "
            "--delay-directory-restore",
            f"chmod -R u+rwX,go+rX,go-w {staging}",
            f"(cd {staging} && sha256sum --quiet --strict -c {shlex.quote(sums)})",
            # The same bytes in place already (a marker lost): kept, so a server running
            # them runs files that still exist; else replaced whole.
            f"if [ -d {build}/bin ] && (cd {build} && sha256sum --quiet --strict -c "
            f"{shlex.quote(sums)}) >/dev/null 2>&1; then rm -rf {staging}; "
            f"else rm -rf {build} && mv {staging} {build}; fi",
            missing,
            f'{{ [ -z "$missing" ] || {{ echo "llamarig: the shipped build needs libraries '
            f'this rig lacks: $missing" >&2; rm -rf {build}; false; }}; }}',
            f"printf '%s\\n' {shlex.quote(marker_text)} > {shlex.quote(marker)}",
            f"rm -f {shlex.quote(archive)} {shlex.quote(sums)}",
        ]
    )


def marker_text(manifest: dict) -> str:
    """The completion marker's text for a build's manifest (as the build writes it)."""
    return json.dumps(manifest, indent=2, sort_keys=True)
