"""The `builders` group without a host: who builds each key when a builder can make it (and
when it cannot: another distribution, another CPU for a native build, another CUDA toolkit),
what `llamarig plan` says of a builder, the inventory's rules for builders (each refused with
the file, the key and the fix before any host is reached), and a builder's status row.

test_sandbox_builder deploys a builder and two rigs without compilers for real."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from llamarig.config import ConfigError, load_inventory
from llamarig.planner import fleet, render
from llamarig.serving import status
from tests.conftest import PROJECT, pyinfra_env

TRIXIE = {"name": "Debian", "release_meta": {"ID": "debian", "VERSION_ID": "13"}}
BOOKWORM = {"name": "Debian", "release_meta": {"ID": "debian", "VERSION_ID": "12"}}
FLAGS = ["avx", "avx2", "fma"]
SHA = "a" * 64


def cpu_rig(**llama_cpp) -> dict:
    """The demo's CPU rig (inventory/hosts.yml), its llama_cpp settings changed."""
    data = copy.deepcopy(load_inventory(PROJECT / "inventory" / "hosts.yml").hosts["sandbox"].data)
    data["llama_cpp"].update(llama_cpp)
    return data


def cuda_rig(version: str = "12.8") -> dict:
    data = cpu_rig(backend="cuda", cuda_architectures="86-real;120a-real")
    data["cuda"].update(source="nvidia-repo", version=version)
    return data


def keyed(rigs: dict[str, tuple[dict, dict, list[str]]]) -> tuple[dict, dict]:
    """Each rig's key and data, from its (data, distribution, CPU flags)."""
    keys = {
        name: fleet.build_key(data, distribution, "x86_64", flags, name)
        for name, (data, distribution, flags) in rigs.items()
    }
    return keys, {name: rig[0] for name, rig in rigs.items()}


def test_a_builder_builds_the_keys_it_makes_and_the_first_rig_the_others():
    rig, native_rig = cpu_rig(), cpu_rig()
    keys, data = keyed(
        {
            "rig-a": (rig, TRIXIE, FLAGS),
            "rig-b": (rig, TRIXIE, FLAGS),
            "old-1": (rig, BOOKWORM, FLAGS),  # no builder of bookworm: its first rig builds
            "old-2": (rig, BOOKWORM, FLAGS),
            "other-cpu": (native_rig, TRIXIE, ["avx"]),  # -march=native on another CPU
            "own": (cpu_rig(share_builds=False), TRIXIE, FLAGS),
        }
    )
    builder = fleet.builder("bd", cpu_rig(), TRIXIE, "x86_64", FLAGS)
    second = fleet.builder("bd-2", cpu_rig(), TRIXIE, "x86_64", FLAGS)
    sources = fleet.sources(keys, data, [builder, second])
    assert sources == {
        "rig-a": "bd",
        "rig-b": "bd",
        "old-1": "",
        "old-2": "old-1",
        "other-cpu": "",
        "own": "",
    }
    assert fleet.builds_of("bd", keys, sources) == {keys["rig-a"].key: ["rig-a", "rig-b"]}
    assert fleet.builds_of("bd-2", keys, sources) == {}  # the first builder of a key builds
    lines = fleet.builder_lines("bd", fleet.builds_of("bd", keys, sources))
    assert lines == [
        "== bd: builder (serves no model)",
        f"  builds {keys['rig-a'].key} for rig-a, rig-b",
    ]
    assert "builds nothing" in fleet.builder_lines("bd-2", {})[1]
    assert "read with --probe" in fleet.builder_lines("bd-2", None)[1]
    line = fleet.build_line(keys["rig-a"], keys["rig-a"].build_id, sources["rig-a"])
    assert "shipped from bd, no compiler here" in line
    # Without builders, as before: the first rig of a key builds.
    assert fleet.sources(keys)["rig-b"] == "rig-a"


def test_a_portable_build_is_made_by_a_builder_of_another_cpu():
    portable = cpu_rig(cmake_options={"GGML_NATIVE": "OFF"})
    keys, data = keyed({"rig-a": (portable, TRIXIE, FLAGS)})
    builder = fleet.builder("bd", cpu_rig(), TRIXIE, "x86_64", ["sse2"])
    assert fleet.sources(keys, data, [builder]) == {"rig-a": "bd"}
    native_keys, native_data = keyed({"rig-a": (cpu_rig(), TRIXIE, FLAGS)})
    assert fleet.sources(native_keys, native_data, [builder]) == {"rig-a": ""}


@pytest.mark.parametrize(
    ("builder_data", "why"),
    [
        (cpu_rig, "a CPU builder has no CUDA toolkit"),
        (lambda: cuda_rig("12.9"), "another toolkit version"),
        (lambda: cuda_rig("12.8"), None),
    ],
)
def test_a_cuda_build_is_made_only_by_a_builder_with_the_rigs_toolkit(builder_data, why):
    keys, data = keyed({"gpu-1": (cuda_rig("12.8"), TRIXIE, FLAGS)})
    builder = fleet.builder("bd", builder_data(), TRIXIE, "x86_64", ["sse2"])
    expected = "" if why else "bd"
    assert fleet.sources(keys, data, [builder]) == {"gpu-1": expected}, why


def team(builder: dict | None = None, groups: str = "builders") -> dict:
    """Two CPU rigs and a builder `bd` in the group ``groups``."""
    rig = {"llama_cpp": {"backend": "cpu"}, "model": {"url": "https://x.org/m.gguf", "sha256": SHA}}
    return {
        "all": {
            "children": {
                "rigs": {
                    "hosts": {
                        "rig-a": {"ssh": {"host": "192.0.2.1"}, **copy.deepcopy(rig)},
                        "rig-b": {"ssh": {"host": "192.0.2.2"}, **copy.deepcopy(rig)},
                    }
                },
                groups: {
                    "hosts": {
                        "bd": {
                            "ssh": {"host": "192.0.2.3"},
                            "role": "builder",
                            "llama_cpp": {"backend": "cpu"},
                            **(builder or {}),
                        }
                    }
                },
            }
        }
    }


def in_gateways(document: dict) -> dict:
    """``document`` with its builder also in the `gateways` group, fronting the rigs."""
    children = document["all"]["children"]
    builder = children["builders"]["hosts"]["bd"]
    builder["gateway"] = {"host": "0.0.0.0", "fronts": "rigs"}
    children["gateways"] = {"hosts": {"bd": {}}}
    return document


def problems_of(tmp_path, document: dict) -> list[str]:
    path = tmp_path / "team.yml"
    path.write_text(yaml.safe_dump(document))
    with pytest.raises(ConfigError) as error:
        load_inventory(path)
    return error.value.problems


def test_a_builder_needs_no_model_server_or_gpu(tmp_path):
    path = tmp_path / "team.yml"
    path.write_text(yaml.safe_dump(team()))
    inventory = load_inventory(path)
    assert inventory.hosts["bd"].data["role"] == "builder"
    assert inventory.groups["builders"] == ["bd"]


@pytest.mark.parametrize(
    ("document", "key", "fix"),
    [
        (team(groups="boxes"), "bd.role", "children: builders: hosts:"),
        (
            team({"role": "standalone", "model": {"url": "https://x.org/m.gguf", "sha256": SHA}}),
            "bd.role",
            "set `role: builder`",
        ),
        (
            team({"llama_cpp": {"backend": "cpu", "build_dependencies": "preinstalled"}}),
            "bd.llama_cpp.build_dependencies",
            "set build_dependencies: apt",
        ),
        (
            team({"llama_cpp": {"backend": "cpu", "share_builds": False}}),
            "bd.llama_cpp.share_builds",
            "builds only for other rigs",
        ),
        (
            team(
                {
                    "llama_cpp": {"backend": "cuda"},
                    "cuda": {"source": "preinstalled", "nvcc": "/usr/local/cuda/bin/nvcc"},
                }
            ),
            "bd.cuda.source",
            "set cuda.source: nvidia-repo or distro",
        ),
        (team({"role": "buidler"}), "bd.role", "builder"),
        (in_gateways(team()), "bd.role", "is builder, which serves no API"),
    ],
    ids=[
        "outside-group",
        "rig-in-group",
        "preinstalled",
        "share-false",
        "cuda-own",
        "typo",
        "builder-in-gateways",
    ],
)
def test_a_careless_builder_is_refused_naming_the_file_key_and_fix(tmp_path, document, key, fix):
    found = problems_of(tmp_path, document)
    assert any("team.yml" in p and key in p and fix in p for p in found), found


def test_a_builder_status_row_says_it_serves_nothing():
    data = cpu_rig()
    data["role"] = "builder"
    command = status.probe_command(data, 0.5)
    assert "llama-server" not in command and "/proc/uptime" in command
    row = status.parse("bd", data, "")
    assert row.role == "builder" and status.healthy(row)
    assert status.report(row).splitlines()[0] == "bd: builder (no llama-server)"


def test_plan_without_probe_shows_the_builder(tmp_path):
    path = tmp_path / "team.yml"
    path.write_text(yaml.safe_dump(team()))
    shown = subprocess.run(
        [sys.executable, "-m", "llamarig.cli", "plan", "--host", "bd"],
        capture_output=True, text=True, env=pyinfra_env(RIG_INVENTORY=str(path)), timeout=120,
    )  # fmt: skip
    assert "== bd: builder (serves no model)" in shown.stdout, shown.stdout + shown.stderr
    assert "what it makes is read with --probe" in shown.stdout
    assert shown.returncode == 0, shown.stderr


# --- cuda_architectures: fleet ---------------------------------------------------------------

RTX_3090 = {"name": "NVIDIA GeForce RTX 3090", "vram_mib": 24576, "compute_capability": "8.6"}
RTX_5080 = {"name": "NVIDIA GeForce RTX 5080", "vram_mib": 16303, "compute_capability": "12.0"}
H100 = {"name": "NVIDIA H100 80GB HBM3", "vram_mib": 81559, "compute_capability": "9.0"}


def gpu_rig(address: str, gpus: list[dict], architectures: str) -> dict:
    return {
        "ssh": {"host": address},
        "driver": {"source": "nvidia-repo", "branch": 580, "open": True},
        "cuda": {"source": "nvidia-repo", "version": "13.0"},
        "gpus": gpus,
        "llama_cpp": {"cuda_architectures": architectures},
        "model": {"url": "https://x.org/m.gguf", "sha256": SHA},
    }


def gpu_team(tmp_path, **rigs) -> dict:
    path = tmp_path / "gpus.yml"
    path.write_text(yaml.safe_dump({"all": {"children": {"rigs": {"hosts": rigs}}}}))
    return load_inventory(path).hosts


def test_fleet_gives_rigs_of_different_gpus_one_list_and_one_build(tmp_path):
    hosts = gpu_team(
        tmp_path,
        ampere=gpu_rig("192.0.2.1", [RTX_3090], "fleet"),
        blackwell=gpu_rig("192.0.2.2", [RTX_5080], "fleet"),
        hopper=gpu_rig("192.0.2.3", [H100], "auto"),  # its own list, its own build
    )
    lists = {name: host.data["llama_cpp"]["cuda_architectures"] for name, host in hosts.items()}
    assert lists == {"ampere": "86-real;120a-real", "blackwell": "86-real;120a-real",
                     "hopper": "auto"}  # fmt: skip
    assert fleet.cuda_architectures(hosts["hopper"].data) == "90-real"
    keys = {
        name: fleet.build_key(host.data, TRIXIE, "x86_64", FLAGS, name)
        for name, host in hosts.items()
    }
    assert keys["ampere"] == keys["blackwell"] != keys["hopper"]
    assert fleet.cuda_architectures(hosts["blackwell"].data) == "86-real;120a-real"
    sources = fleet.sources(keys, {name: host.data for name, host in hosts.items()})
    assert sources == {"ampere": "", "blackwell": "ampere", "hopper": ""}
    # Each rig alone with `auto`: two lists, two keys, two compiles.
    alone = gpu_team(
        tmp_path,
        ampere=gpu_rig("192.0.2.1", [RTX_3090], "auto"),
        blackwell=gpu_rig("192.0.2.2", [RTX_5080], "auto"),
    )
    auto_keys = [fleet.build_key(h.data, TRIXIE, "x86_64", FLAGS, n) for n, h in alone.items()]
    assert auto_keys[0].key != auto_keys[1].key


def test_fleet_without_declared_gpus_is_refused_naming_the_key(tmp_path):
    document = {"rigs": {"hosts": {"r": gpu_rig("192.0.2.1", [], "fleet")}}}
    found = problems_of(tmp_path, {"all": {"children": document}})
    assert any(
        "team.yml" in p and "hosts.r.llama_cpp.cuda_architectures" in p and "`fleet` needs" in p
        for p in found
    ), found


def test_fleet_outside_the_inventory_is_the_rigs_own_gpus():
    data = cuda_rig()
    data["llama_cpp"]["cuda_architectures"] = "fleet"
    data["gpus"] = [RTX_5080]
    assert render.cuda_arch_list(data) == "120a-real"
