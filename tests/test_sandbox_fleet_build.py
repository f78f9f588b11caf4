"""One build for the fleet, for real: two CPU rigs of one distribution and the same options
(trixie, SmolLM2) and a third of another (bookworm, the random-weight test model). One
`pyinfra inventory.py deploy.py`: the first trixie rig compiles; its `bin/` goes to the control
machine's build cache and on to the second, which installs no compiler (none is on it to
run), checks every file's sha256 and serves with the same bytes; the bookworm rig has another
build key and compiles its own. Both trixie rigs answer; the next converge changes nothing. A
cached build with one byte changed is refused before it reaches a rig, and packed again from
the rig that has it.

Stand-ins as in test_sandbox_converge (the model from the loopback file server, llama.cpp from
a git daemon mirror); the control machine's cache is the scenario's own
(tests/sandboxes.build_cache). Needs root, systemd-nspawn and mmdebstrap.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from llamarig import CACHE_DIR
from llamarig.onhost import build_archive
from tests import sandboxes
from tests.conftest import PROJECT
from tests.sandboxes import (
    build_files,
    changed_operations,
    compilers,
    fresh_sandboxes,
    in_sandbox,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

BUILDER, RECEIVER, OTHER = "sandbox-fb-1", "sandbox-fb-2", "sandbox-fb-bw"
RELEASES = {BUILDER: "trixie", RECEIVER: "trixie", OTHER: "bookworm"}
SSH_PORTS = {BUILDER: 2260, RECEIVER: 2261, OTHER: 2262}
SERVER_PORTS = {BUILDER: 8131, RECEIVER: 8132, OTHER: 8133}


def inventory(path: Path, infos: dict) -> Path:
    """The demo rig's settings on the three sandboxes (one thread, speed unmeasured)."""
    demo = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    base = demo["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    rigs = {}
    for name in (BUILDER, RECEIVER, OTHER):
        rig = sandboxes.lane_rig(yaml.safe_load(yaml.safe_dump(base)))
        rig["ssh"].update(
            port=SSH_PORTS[name],
            known_hosts=str(infos[name].known_hosts_path),
            key=str(CACHE_DIR / "sandbox" / "id_ed25519"),
        )
        rig["server"]["port"] = SERVER_PORTS[name]
        rigs[name] = rig
    sandboxes.serving_the_random_model(rigs[OTHER], infos[OTHER])
    path.write_text(yaml.safe_dump({"all": {"children": {"rigs": {"hosts": rigs}}}}))
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    directory = tmp_path_factory.mktemp("fleet-build")
    hosts = {name: (release, SSH_PORTS[name]) for name, release in RELEASES.items()}
    sandboxes_up = fresh_sandboxes(hosts)
    infos = next(sandboxes_up)
    try:
        path = inventory(directory / "fleet.yml", infos)
        result = sandboxes.deploy(path)
        assert result.returncode == 0, sandboxes.failure_lines(result)
        yield {"infos": infos, "path": path, "first": result}
    finally:
        next(sandboxes_up, None)  # takes them down


def has_cmake_tree(info) -> bool:
    """Whether the running build was compiled here (CMake left its cache beside bin/)."""
    return in_sandbox(info, "test -e /opt/llamarig/current/CMakeCache.txt && echo y || true") == "y"


def test_one_rig_compiles_the_other_gets_its_bytes_and_another_release_builds_its_own(
    fleet, monkeypatch
):
    infos = fleet["infos"]
    output = fleet["first"].stdout + fleet["first"].stderr
    shipped = re.search(rf"\[{RECEIVER}\]\s+llamarig: build (\S+) shipped from {BUILDER} ", output)
    assert shipped, output[-6000:]
    key = shipped[1]
    assert re.search(rf"\[{BUILDER}\]\s+llamarig: build {key} kept in ", output), output[-6000:]
    # The receiver never had a compiler to run; the builder and the other release compiled.
    assert compilers(infos[RECEIVER]) == "", compilers(infos[RECEIVER])
    assert not has_cmake_tree(infos[RECEIVER])
    assert has_cmake_tree(infos[BUILDER]) and has_cmake_tree(infos[OTHER])
    assert "/usr/bin/gcc" in compilers(infos[BUILDER])
    # The same bytes on both trixie rigs; bookworm's are its own (another compiler, libraries).
    builder, receiver, other = (build_files(infos[name]) for name in (BUILDER, RECEIVER, OTHER))
    assert builder == receiver and "llama-server" in receiver, (builder, receiver)
    assert other["llama-server"] != builder["llama-server"]
    assert not re.search(rf"\[{OTHER}\]\s+llamarig: build \S+ shipped", output)
    # Only the shared key was packed: the cache holds it and nothing of bookworm's.
    cache = sandboxes.build_cache(fleet["path"])
    assert [entry.name for entry in cache.iterdir() if not entry.name.startswith(".")] == [key]
    monkeypatch.setenv("LLAMARIG_BUILD_CACHE", str(cache))
    assert build_archive.verified(key).platform == "debian 13 x86_64"


def test_the_shipped_build_serves_and_answers(fleet):
    for name in (BUILDER, RECEIVER):
        reply = in_sandbox(
            fleet["infos"][name],
            f"curl -sf --max-time 120 http://127.0.0.1:{SERVER_PORTS[name]}/v1/chat/completions "
            "-H 'Content-Type: application/json' -d '"
            + json.dumps({"messages": [{"role": "user", "content": "What is the capital of "
                          "France? Answer in one word."}], "max_tokens": 8, "temperature": 0})
            + "'",
        )  # fmt: skip
        assert "Paris" in json.loads(reply)["choices"][0]["message"]["content"], (name, reply)
    assert in_sandbox(fleet["infos"][RECEIVER], "ldd /opt/llamarig/current/bin/llama-server "
                      "| grep -c 'not found' || true") == "0"  # fmt: skip


def test_the_next_converge_ships_nothing(fleet):
    assert changed_operations(sandboxes.converge(fleet["path"])) == []


def test_a_cached_build_with_one_byte_changed_is_refused_and_packed_again(fleet, monkeypatch):
    infos = fleet["infos"]
    cache = sandboxes.build_cache(fleet["path"])
    monkeypatch.setenv("LLAMARIG_BUILD_CACHE", str(cache))
    (key,) = [entry.name for entry in cache.iterdir() if not entry.name.startswith(".")]
    archive = cache / key / build_archive.ARCHIVE
    raw = bytearray(archive.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    archive.write_bytes(bytes(raw))
    with pytest.raises(build_archive.CachedBuildError):
        build_archive.verified(key)
    # The receiver needs the build again (its marker gone): the tampered copy must not reach it.
    marker = in_sandbox(infos[RECEIVER], "readlink -f /opt/llamarig/current")
    in_sandbox(infos[RECEIVER], f"rm {marker}/.llamarig-build.json")
    result = sandboxes.deploy(fleet["path"])
    output = result.stdout + result.stderr
    assert result.returncode == 0, sandboxes.failure_lines(result)
    refused = re.search(rf"the cached build {key} is refused: .*sha256 differs", output)
    assert refused, output[-6000:]
    kept = re.search(rf"\[{BUILDER}\]\s+llamarig: build {key} kept in ", output)
    sent = re.search(rf"\[{RECEIVER}\]\s+llamarig: build {key} shipped from {BUILDER}", output)
    assert kept and sent and kept.start() < sent.start(), output[-6000:]
    assert build_archive.verified(key).files == {
        f"bin/{name}": digest for name, digest in build_files(infos[BUILDER]).items()
    }
    assert build_files(infos[RECEIVER]) == build_files(infos[BUILDER])
    assert compilers(infos[RECEIVER]) == ""
    assert changed_operations(sandboxes.converge(fleet["path"])) == []
