"""A builder for real: a trixie box in the `builders` group (`role: builder`) and two trixie
CPU rigs, one serving SmolLM2 and one the random-weight test model with the same build options.
One `pyinfra inventory.py deploy.py`: the builder compiles the rigs' build (the rigs' key, made
on it) and runs nothing else (no model, no server); both rigs get its `bin/` shipped through
the control machine's cache, with no compiler ever installed on either, check every file's
sha256 and serve with the builder's bytes; SmolLM2's rig answers. `llamarig plan --probe` shows
the builder making the key for both rigs; the next converge changes nothing.

Stand-ins as in test_sandbox_fleet_build (the model from the loopback file server, llama.cpp
from a git daemon mirror); the control machine's cache is the scenario's own. Needs root,
systemd-nspawn and mmdebstrap.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from llamarig import CACHE_DIR
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

BUILDER, RIG_1, RIG_2 = "sandbox-bd", "sandbox-bd-1", "sandbox-bd-2"
SSH_PORTS = {BUILDER: 2263, RIG_1: 2264, RIG_2: 2265}
SERVER_PORTS = {RIG_1: 8134, RIG_2: 8135}


def inventory(path: Path, infos: dict) -> Path:
    """The demo rig's settings on the two rigs (one thread, speed unmeasured); the builder with
    the demo's llama.cpp settings and nothing of a server."""
    demo = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    base = demo["all"]["children"]["sandbox"]["hosts"]["sandbox"]

    def ssh(name: str) -> dict:
        return {
            **base["ssh"],
            "port": SSH_PORTS[name],
            "known_hosts": str(infos[name].known_hosts_path),
            "key": str(CACHE_DIR / "sandbox" / "id_ed25519"),
        }

    rigs = {}
    for name in (RIG_1, RIG_2):
        rig = sandboxes.lane_rig(yaml.safe_load(yaml.safe_dump(base)))
        rig["ssh"] = ssh(name)
        rig["server"]["port"] = SERVER_PORTS[name]
        rigs[name] = rig
    sandboxes.serving_the_random_model(rigs[RIG_2], infos[RIG_2])
    builder = {
        "role": "builder",
        "ssh": ssh(BUILDER),
        **{section: base[section] for section in ("driver", "cuda", "llama_cpp")},
    }
    document = {
        "all": {
            "children": {
                "rigs": {"hosts": rigs},
                "builders": {"hosts": {BUILDER: builder}},
            }
        }
    }
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    directory = tmp_path_factory.mktemp("builder")
    sandboxes_up = fresh_sandboxes({name: ("trixie", port) for name, port in SSH_PORTS.items()})
    infos = next(sandboxes_up)
    try:
        path = inventory(directory / "team.yml", infos)
        result = sandboxes.deploy(path)
        assert result.returncode == 0, sandboxes.failure_lines(result)
        yield {"infos": infos, "path": path, "first": result}
    finally:
        next(sandboxes_up, None)  # takes them down


def test_the_builder_compiles_and_both_rigs_get_its_bytes_without_a_compiler(team):
    infos = team["infos"]
    output = team["first"].stdout + team["first"].stderr
    kept = re.search(rf"\[{BUILDER}\]\s+llamarig: build (\S+) kept in ", output)
    assert kept, output[-6000:]
    key = kept[1]
    for rig in (RIG_1, RIG_2):
        assert re.search(rf"\[{rig}\]\s+llamarig: build {key} shipped from {BUILDER} ", output)
        assert compilers(infos[rig]) == "", (rig, compilers(infos[rig]))
        assert in_sandbox(infos[rig], "test -e /opt/llamarig/current/CMakeCache.txt "
                          "&& echo compiled || echo shipped") == "shipped"  # fmt: skip
    assert "/usr/bin/gcc" in compilers(infos[BUILDER])
    build_dir = in_sandbox(infos[BUILDER], "ls -d /opt/llamarig/builds/*/")
    assert in_sandbox(infos[BUILDER], f"test -e {build_dir}/CMakeCache.txt && echo y") == "y"
    built = build_files(infos[BUILDER], build_dir)
    assert "llama-server" in built
    for rig in (RIG_1, RIG_2):
        assert build_files(infos[rig]) == built, rig
    cache = sandboxes.build_cache(team["path"])
    assert [entry.name for entry in cache.iterdir() if not entry.name.startswith(".")] == [key]


def test_the_builder_serves_nothing(team):
    builder = team["infos"][BUILDER]
    units = in_sandbox(builder, "systemctl list-units --all --no-legend 'llama*' | wc -l")
    assert units == "0", in_sandbox(builder, "systemctl list-units --all 'llama*'")
    assert in_sandbox(builder, "test -e /opt/llamarig/current && echo y || echo n") == "n"
    assert in_sandbox(builder, "ls /opt/llamarig/models 2>/dev/null | wc -l") == "0"


def test_the_shipped_build_answers(team):
    info = team["infos"][RIG_1]
    reply = in_sandbox(
        info,
        f"curl -sf --max-time 120 http://127.0.0.1:{SERVER_PORTS[RIG_1]}/v1/chat/completions "
        "-H 'Content-Type: application/json' -d '"
        + json.dumps({"messages": [{"role": "user", "content": "What is the capital of "
                      "France? Answer in one word."}], "max_tokens": 8, "temperature": 0})
        + "'",
    )  # fmt: skip
    assert "Paris" in json.loads(reply)["choices"][0]["message"]["content"], reply
    health = in_sandbox(
        team["infos"][RIG_2],
        f"curl -sf --max-time 30 http://127.0.0.1:{SERVER_PORTS[RIG_2]}/health",
    )
    assert json.loads(health)["status"] == "ok", health


def test_plan_shows_the_builder_making_the_rigs_key(team):
    shown = sandboxes.llamarig(team["path"], "plan", "--probe")
    assert shown.returncode == 0, shown.stdout + shown.stderr
    made = re.search(rf"== {BUILDER}: builder \(serves no model\)\n  builds (\S+) for (.+)\n",
                     shown.stdout)  # fmt: skip
    assert made and made[2] == f"{RIG_1}, {RIG_2}", shown.stdout
    shipped = rf"build {re.escape(made[1])} \(debian 13 x86_64\): shipped from {BUILDER}, "
    assert len(re.findall(shipped + "no compiler here", shown.stdout)) == 2, shown.stdout


def test_verify_skips_the_rig_checks_on_the_builder_saying_why(team):
    from llamarig.checks.conftest import BUILDER_ONLY

    result = sandboxes.llamarig(team["path"], "verify", "--host", BUILDER, "--", "-v", "-rs")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert re.search(r"test_os_is_supported\[[^\]]*\] PASSED", output), output[-6000:]
    assert BUILDER_ONLY in output, output[-6000:]
    assert " FAILED" not in output


def test_a_builds_only_run_changes_nothing_and_a_careless_switch_is_refused(team):
    """`LLAMARIG_BUILDS_ONLY=1` with every build made changes nothing; a value that is neither
    1 nor 0 stops the run before any host changes (a whole deploy where builds only were meant
    would restart the rigs)."""
    assert changed_operations(sandboxes.converge(team["path"], {"LLAMARIG_BUILDS_ONLY": "1"})) == []
    refused = sandboxes.deploy(team["path"], env={"LLAMARIG_BUILDS_ONLY": "yes"})
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0, output[-4000:]
    assert "LLAMARIG_BUILDS_ONLY is 'yes': set it to 1" in output, output[-4000:]
    assert "Beginning operation run" not in output  # refused while the run was prepared


def test_the_next_converge_changes_nothing(team):
    assert changed_operations(sandboxes.converge(team["path"])) == []
