"""Builds shared across the fleet, without a host: the build key (what decides a binary, and
what keeps a rig to itself), the cached build's checks (a changed byte, a hostile manifest or
archive refused before anything is shipped), the cache's bound, and the shell commands that
pack and unpack, run here on a directory shaped like a build."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from llamarig.config import load_inventory
from llamarig.onhost import build_archive
from llamarig.onhost.build_archive import CachedBuildError
from llamarig.operations import shipping
from llamarig.planner import fleet
from tests.conftest import PROJECT

TRIXIE = {"name": "Debian", "release_meta": {"ID": "debian", "VERSION_ID": "13"}}
BOOKWORM = {"name": "Debian", "release_meta": {"ID": "debian", "VERSION_ID": "12"}}
FLAGS = ["avx", "avx2", "fma"]


def cpu_rig(**llama_cpp) -> dict:
    """The demo's CPU rig (inventory/hosts.yml), its llama_cpp settings changed."""
    data = copy.deepcopy(load_inventory(PROJECT / "inventory" / "hosts.yml").hosts["sandbox"].data)
    data["llama_cpp"].update(llama_cpp)
    return data


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LLAMARIG_BUILD_CACHE", str(root))
    return root


def test_rigs_alike_share_a_key_and_each_difference_parts_them():
    rig = cpu_rig()
    key = fleet.build_key(rig, TRIXIE, "x86_64", FLAGS, "rig-1")
    assert key.shared and key == fleet.build_key(rig, TRIXIE, "x86_64", FLAGS, "rig-2")
    assert key.key.startswith(key.build_id + "-") and key.platform == "debian 13 x86_64"
    others = {
        "another release": fleet.build_key(rig, BOOKWORM, "x86_64", FLAGS, "rig-2"),
        "another CPU (-march=native)": fleet.build_key(rig, TRIXIE, "x86_64", ["avx"], "rig-2"),
        "another commit": fleet.build_key(
            cpu_rig(commit="1" * 40), TRIXIE, "x86_64", FLAGS, "rig-2"
        ),
        "other options": fleet.build_key(
            cpu_rig(cmake_options={"GGML_AVX512": True}), TRIXIE, "x86_64", FLAGS, "rig-2"
        ),
    }
    prefixed = copy.deepcopy(rig)
    prefixed["paths"]["prefix"] = "/srv/llamarig"
    others["another prefix (RUNPATH)"] = fleet.build_key(prefixed, TRIXIE, "x86_64", FLAGS, "r")
    for why, other in others.items():
        assert other.key != key.key, why


def test_a_portable_cpu_build_ignores_the_cpu_and_a_cuda_build_is_portable():
    portable = cpu_rig(cmake_options={"GGML_NATIVE": False})
    assert not fleet.builds_native(portable)
    assert (
        fleet.build_key(portable, TRIXIE, "x86_64", ["avx"], "a").key
        == fleet.build_key(portable, TRIXIE, "x86_64", FLAGS, "b").key
    )
    assert fleet.builds_native(cpu_rig())


@pytest.mark.parametrize(
    ("settings", "why"),
    [
        ({"share_builds": False}, "share_builds is false"),
        ({"build_dependencies": "preinstalled"}, "its compilers are its own"),
    ],
)
def test_a_rig_that_may_not_share_is_keyed_to_itself(settings, why):
    rig = cpu_rig(**settings)
    one = fleet.build_key(rig, TRIXIE, "x86_64", FLAGS, "rig-1")
    assert not one.shared and why in one.why_alone
    assert one.key != fleet.build_key(rig, TRIXIE, "x86_64", FLAGS, "rig-2").key


def fake_build(directory: Path) -> Path:
    """A directory shaped like a build: bin/ with a binary, a library and links to it."""
    binaries = directory / "bin"
    binaries.mkdir(parents=True)
    (binaries / "llama-server").write_bytes(b"\x7fELF server " * 100)
    (binaries / "llama-server").chmod(0o755)
    (binaries / "libllama.so.0.5.0").write_bytes(b"\x7fELF library " * 100)
    (binaries / "libllama.so.0").symlink_to("libllama.so.0.5.0")
    (binaries / "libllama.so").symlink_to("libllama.so.0")
    (directory / "CMakeCache.txt").write_text("not shipped\n")
    return directory


KEY = "0c1e57098bba-f86f2a2133-3b1f0e9a7c2d"


def packed(tmp_path: Path) -> tuple[Path, str]:
    """The fake build packed by the builder's own command: (archive, sums)."""
    build = fake_build(tmp_path / "builds" / "0c1e57098bba-f86f2a2133")
    archive, sums = tmp_path / "b.tar", tmp_path / "b.sha256"
    subprocess.run(
        ["sh", "-c", build_archive.pack_command(str(build), str(archive), str(sums))], check=True
    )
    return archive, sums.read_text()


def stored(tmp_path: Path) -> build_archive.Manifest:
    archive, sums = packed(tmp_path)
    return build_archive.store(KEY, archive, sums, "0c1e57098bba-f86f2a2133", "debian 13", "")


def test_a_stored_build_is_verified_and_holds_bin_only(tmp_path, cache):
    manifest = stored(tmp_path)
    assert set(manifest.files) == {"bin/llama-server", "bin/libllama.so.0.5.0"}
    assert manifest.links == {"bin/libllama.so.0": "libllama.so.0.5.0",
                              "bin/libllama.so": "libllama.so.0"}  # fmt: skip
    assert build_archive.verified(KEY) == manifest
    assert (cache / KEY).stat().st_mode & 0o077 == 0 and cache.stat().st_mode & 0o077 == 0


def _rewrite(archive: Path, change) -> None:
    """The archive with each member passed through ``change(info, data) -> (info, data)``."""
    members = []
    with tarfile.open(archive) as tar:
        for info in tar:
            data = tar.extractfile(info).read() if info.isfile() else None
            members.append(change(info, data))
    with tarfile.open(archive, "w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def test_one_changed_byte_of_the_binary_is_refused(tmp_path, cache):
    stored(tmp_path)
    archive = cache / KEY / build_archive.ARCHIVE
    raw = bytearray(archive.read_bytes())
    at = raw.index(b"ELF server") + 4
    raw[at] ^= 0x01
    archive.write_bytes(bytes(raw))
    with pytest.raises(CachedBuildError, match="sha256 differs"):
        build_archive.verified(KEY)


def test_a_changed_file_with_a_manifest_that_names_the_new_archive_is_refused(tmp_path, cache):
    """Who can write the archive can write its manifest's archive digest: each file is
    checked against its own digest too."""
    stored(tmp_path)
    archive, manifest_path = cache / KEY / build_archive.ARCHIVE, cache / KEY / "manifest.json"

    def patched(info, data):
        if info.name == "bin/llama-server":
            data = data.replace(b"server", b"sErver", 1)
        return info, data

    _rewrite(archive, patched)
    manifest = json.loads(manifest_path.read_text())
    manifest["archive_sha256"] = hashlib.sha256(archive.read_bytes()).hexdigest()
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CachedBuildError, match="bin/llama-server .* differs from its manifest"):
        build_archive.verified(KEY)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda m: m.update(version=1), "not a version 2 manifest"),
        (lambda m: m.update(binary_architectures=["sm_86; rm -rf /"]), "binary_architectures"),
        (lambda m: m.update(binary_architectures="sm_86"), "binary_architectures"),
        (lambda m: m.update(files={}), "lists no files"),
        (lambda m: m["files"].update({"../etc/passwd": "0" * 64}), "lists a file it may not"),
        (lambda m: m["files"].update({"bin/x\nrm -rf /": "0" * 64}), "lists a file it may not"),
        (lambda m: m["files"].update({"bin/x": "not-hex"}), "lists a file it may not"),
        (lambda m: m["links"].update({"bin/evil": "/etc/shadow"}), "points outside the build"),
        (lambda m: m["links"].update({"bin/evil": "../../etc"}), "points outside the build"),
        (lambda m: m.update(key="../../x"), "malformed key"),
        (lambda m: m.update(platform=None), "lacks one of"),
    ],
)
def test_a_hostile_manifest_is_refused(tmp_path, cache, change, refusal):
    stored(tmp_path)
    manifest_path = cache / KEY / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    change(manifest)
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CachedBuildError, match=refusal):
        build_archive.verified(KEY)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("../escape", tarfile.REGTYPE), ("/etc/cron.d/x", tarfile.REGTYPE),
     ("bin/dev", tarfile.CHRTYPE), ("bin/hard", tarfile.LNKTYPE),
     ("CMakeCache.txt", tarfile.REGTYPE)],
)  # fmt: skip
def test_an_archive_with_anything_but_files_and_links_under_bin_is_refused(tmp_path, name, kind):
    archive = tmp_path / "hostile.tar"
    with tarfile.open(archive, "w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        info.linkname = "bin/llama-server" if kind == tarfile.LNKTYPE else ""
        tar.addfile(info, io.BytesIO(b"") if kind == tarfile.REGTYPE else None)
    with pytest.raises(CachedBuildError, match="outside bin/|neither file nor link"):
        build_archive.archive_members(archive)


def test_an_archive_unlike_the_builders_files_is_not_stored(tmp_path, cache):
    archive, sums = packed(tmp_path)
    with pytest.raises(CachedBuildError, match="differs from the builder's files"):
        build_archive.store(KEY, archive, sums.replace("  bin/llama-server", "  bin/other"), "b",
                            "p", "")  # fmt: skip
    assert not (cache / KEY).exists()


def test_no_key_of_another_shape_names_a_cache_path(cache):
    for key in ("../../etc", "0c1e57098bba-f86f2a2133", "X" * 36, KEY + "/.."):
        with pytest.raises(CachedBuildError, match="not a build key"):
            build_archive.entry(key)


def test_the_cache_keeps_the_newest_builds(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(build_archive, "CACHE_KEEP", 2)
    keys = [f"{i:012x}-f86f2a2133-3b1f0e9a7c2d" for i in range(3)]
    for number, key in enumerate(keys):
        archive, sums = packed(tmp_path / str(number))
        build_archive.store(key, archive, sums, "b", "p", "")
    assert sorted(path.name for path in cache.iterdir()) == keys[1:]


def test_the_unpack_command_checks_each_file_and_writes_the_marker_last(tmp_path, cache):
    manifest = stored(tmp_path)
    target = tmp_path / "rig" / "builds" / "0c1e57098bba-f86f2a2133"
    target.parent.mkdir(parents=True)
    archive, sums = tmp_path / "rig" / "b.tar", tmp_path / "rig" / "b.sha256"

    def unpack() -> subprocess.CompletedProcess:
        archive.write_bytes((cache / KEY / build_archive.ARCHIVE).read_bytes())
        sums.write_text(manifest.sums())
        command = build_archive.unpack_command(
            str(target), str(archive), str(sums), str(target / ".marker"), '{"commit": "c"}'
        )
        return subprocess.run(["sh", "-c", command], capture_output=True, text=True)

    result = unpack()
    assert result.returncode == 0, result.stderr
    assert (target / "bin" / "llama-server").read_bytes() == b"\x7fELF server " * 100
    assert (target / "bin" / "libllama.so").resolve().name == "libllama.so.0.5.0"
    assert json.loads((target / ".marker").read_text()) == {"commit": "c"}
    assert not archive.exists() and not (target / "CMakeCache.txt").exists()
    # The marker lost, the same bytes shipped again: the files in place stay (a server running
    # them keeps running files that exist).
    inode = (target / "bin" / "llama-server").stat().st_ino
    (target / ".marker").unlink()
    assert unpack().returncode == 0
    assert (target / "bin" / "llama-server").stat().st_ino == inode
    assert (target / ".marker").exists() and not Path(f"{target}.shipped").exists()
    # A file changed on the way: refused before it is moved into place, no marker.
    (target / ".marker").unlink()
    sums.write_text(manifest.sums().replace(manifest.files["bin/llama-server"], "0" * 64))
    command = build_archive.unpack_command(
        str(target), str(archive), str(sums), str(target / ".marker"), "{}"
    )
    archive.write_bytes((cache / KEY / build_archive.ARCHIVE).read_bytes())
    failed = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert failed.returncode != 0 and "FAILED" in failed.stdout + failed.stderr
    assert not (target / ".marker").exists()


def test_plan_says_which_rig_builds_each_key_and_which_get_it_shipped():
    rig = cpu_rig()
    alone = cpu_rig(share_builds=False)
    keys = {
        "rig-a": fleet.build_key(rig, TRIXIE, "x86_64", FLAGS, "rig-a"),
        "rig-b": fleet.build_key(rig, TRIXIE, "x86_64", FLAGS, "rig-b"),
        "old": fleet.build_key(rig, BOOKWORM, "x86_64", FLAGS, "old"),
        "own": fleet.build_key(alone, TRIXIE, "x86_64", FLAGS, "own"),
        "rig-c": fleet.build_key(rig, TRIXIE, "x86_64", FLAGS, "rig-c"),
    }
    sources = fleet.sources(keys)
    assert sources == {"rig-a": "", "rig-b": "rig-a", "old": "", "own": "", "rig-c": "rig-a"}
    lines = {name: fleet.build_line(key, key.build_id, sources[name]) for name, key in keys.items()}
    assert "shipped from rig-a, no compiler here" in lines["rig-b"]
    assert "built here" in lines["rig-a"] and "debian 12" in lines["old"]
    assert "for itself (llama_cpp.share_builds is false)" in lines["own"]
    assert "read with --probe" in fleet.build_line(None, "0c1e57098bba-f86f2a2133", "")


# --- the device code of a CUDA build ----------------------------------------------------------

# `cuobjdump --list-elf` of libggml-cuda.so built for "86-real;90-real;120a-real" on the H200
# machine (bench/runs/multiarch/results.json, 2026-11-30): one cubin per kernel file and arch.
MULTIARCH = PROJECT / "bench" / "runs" / "multiarch" / "results.json"


def recorded_listing() -> str:
    return "\n".join(json.loads(MULTIARCH.read_text())["build"]["cuobjdump"])


def test_the_device_code_of_a_real_build_is_read_from_cuobjdump():
    listing = recorded_listing()
    assert listing.count("ELF file") > 3  # the record is the whole listing, not a summary
    assert build_archive.elf_architectures(listing) == ["sm_86", "sm_90", "sm_120a"]
    assert build_archive.elf_architectures("garbage\nELF file 1: x.sm_86.ptx\n") == []
    assert build_archive.unbuilt_architectures("86-real;90-real;120a-real", ["sm_86", "sm_90",
                                               "sm_120a"]) == []  # fmt: skip
    # llama.cpp builds a plain 120 as 120a; PTX alone (-virtual) is not device code to check.
    assert build_archive.unbuilt_architectures("86;120-real;75-virtual", ["sm_86", "sm_120a"]) == []
    assert build_archive.unbuilt_architectures("86-real;89-real", ["sm_86"]) == ["sm_89"]


def test_a_cuda_build_is_kept_only_with_code_for_every_architecture_it_names(tmp_path, cache):
    archive, sums = packed(tmp_path)
    manifest = build_archive.store(KEY, archive, sums, "0c1e57098bba-f86f2a2133", "debian 13",
                                   "86-real;90-real;120a-real", recorded_listing())  # fmt: skip
    assert manifest.binary_architectures == ["sm_86", "sm_90", "sm_120a"]
    assert build_archive.verified(KEY).binary_architectures == ["sm_86", "sm_90", "sm_120a"]
    archive, sums = packed(tmp_path / "again")
    only_86 = "\n".join(line for line in recorded_listing().splitlines() if "sm_86" in line)
    with pytest.raises(CachedBuildError, match=r"code for sm_86 .*not for sm_90, sm_120a"):
        build_archive.store(KEY, archive, sums, "0c1e57098bba-f86f2a2133", "debian 13",
                            "86-real;90-real;120a-real", only_86)  # fmt: skip
    with pytest.raises(CachedBuildError, match="no architecture"):
        build_archive.store(
            KEY, archive, sums, "0c1e57098bba-f86f2a2133", "debian 13", "90-real", ""
        )


def test_a_rig_gets_a_cuda_build_only_with_code_for_each_of_its_gpus():
    binary = ["sm_86", "sm_90"]
    assert shipping.without_code(binary, ["8.6", "9.0"]) == []
    assert shipping.without_code(binary, ["8.9"]) == []  # sm_86 SASS runs on 8.9
    assert shipping.without_code(binary, ["12.0", "8.0"]) == ["12.0", "8.0"]
    assert shipping.without_code(["sm_120a"], ["12.0", "12.1"]) == ["12.1"]  # arch-specific


def test_the_pack_command_lists_the_device_code_with_the_toolkits_cuobjdump(tmp_path):
    """The command as the builder runs it, here with a cuobjdump stand-in that prints the
    recorded listing (no toolkit on this machine): the listing lands beside the archive, and a
    build without libggml-cuda is refused."""
    build = fake_build(tmp_path / "builds" / "b")
    stand_in = tmp_path / "cuobjdump"
    stand_in.write_text(
        f'#!/bin/sh\n[ "$1" = --list-elf ] && [ -f "$2" ] && cat {tmp_path}/listing\n'
    )
    stand_in.chmod(0o755)
    (tmp_path / "listing").write_text(recorded_listing() + "\n")
    archive, sums, elf = (tmp_path / name for name in ("b.tar", "b.sha256", "b.elf"))
    command = build_archive.pack_command(
        str(build), str(archive), str(sums), str(stand_in), str(elf)
    )
    missing = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert missing.returncode != 0 and "no libggml-cuda.so" in missing.stderr
    (build / "bin" / "libggml-cuda.so.0.9.0").write_bytes(b"\x7fELF cuda")
    (build / "bin" / "libggml-cuda.so").symlink_to("libggml-cuda.so.0.9.0")
    subprocess.run(["sh", "-c", command], check=True)
    assert build_archive.elf_architectures(elf.read_text()) == ["sm_86", "sm_90", "sm_120a"]
