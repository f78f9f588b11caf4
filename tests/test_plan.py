"""The rig plan over a table of rigs and models: GPUs, version gates, memory, resolved arguments,
and the `llamarig plan` command. Model headers are real GGUF files written with `gguf`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest

from llamarig.config import load_inventory
from llamarig.model.gguf import read_gguf_header_file
from llamarig.operations import server_flags
from llamarig.planner.plan import compare_gpus, plan_host
from llamarig.planner.render import RENAMED_FLAGS
from llamarig.tables.hardware import gpus_from_pci
from llamarig.tables.llama_args import GUARDED_FLAGS, option_name
from tests.conftest import PROJECT, offline, pyinfra_env
from tests.ggufmodels import Qwen35Shape, write_llama, write_qwen35

RTX_5080 = {"name": "NVIDIA GeForce RTX 5080", "vram_mib": 16303, "compute_capability": "12.0"}
RTX_3090 = {"name": "NVIDIA GeForce RTX 3090", "vram_mib": 24576, "compute_capability": "8.6"}
RTX_4070 = {"name": "NVIDIA GeForce RTX 4070", "vram_mib": 12282, "compute_capability": "8.9"}


@pytest.fixture(scope="module")
def qwen_header(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "qwen36-27b-q8_0.gguf"
    write_qwen35(path, Qwen35Shape(), "q8_0")
    return read_gguf_header_file(path)


@pytest.fixture(scope="module")
def llama_8b_header(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "llama-8b-q8_0.gguf"
    write_llama(path, 32, 4096, 14336, 32, 8, 128256, 131072, "q8_0")
    return read_gguf_header_file(path)


@pytest.fixture
def seed() -> dict:
    data = load_inventory(PROJECT / "inventory" / "example-5080-3090.yml").hosts["rig1"].data
    return copy.deepcopy(data)


def test_seed_rig_fits_with_its_own_split(seed, qwen_header):
    plan = plan_host("rig1", seed, qwen_header)
    assert plan.fits, plan.report()
    assert plan.cuda_architectures == "86-real;120a-real"
    document = plan.to_json()
    assert document["tensor_split"] == [2, 3] and document["ctx"] == 229376
    assert [d["name"] for d in document["devices"]] == [RTX_5080["name"], RTX_3090["name"]]
    for device in document["devices"]:
        assert device["planned_mib"] <= device["vram_total_mib"]
        assert device["planned_mib"] == (
            device["weights_mib"] + device["kv_mib"] + device["compute_mib"] + device["reserve_mib"]
        )
    args = document["server_args"]
    assert args[args.index("-ts") + 1] == "2,3" and "-fit" in args
    assert set(document) == {
        "fits", "provisional", "errors", "warnings", "cuda_architectures", "split_mode",
        "split_mode_reason", "tensor_split", "ctx", "devices", "server_args", "cmake_args",
    }  # fmt: skip
    assert document["provisional"] == []


def test_seed_rig_auto_split_is_near_two_to_three(seed, qwen_header):
    seed["server"]["tensor_split"] = "auto"
    seed["server"]["spec"] = {"type": [], "draft_max": None}
    plan = plan_host("rig1", seed, qwen_header)
    assert plan.fits, plan.report()
    share_5080 = plan.resolved["server"]["tensor_split"][0]
    assert 0.37 <= share_5080 <= 0.43
    args = plan.server_args
    assert args[args.index("-ts") + 1] == ",".join(
        map(str, plan.resolved["server"]["tensor_split"])
    )


def test_single_gpu_mode_plans_the_first_card_without_a_split(seed, llama_8b_header):
    seed["server"].update(split_mode="none", tensor_split="auto", ctx=8192)
    seed["server"]["spec"] = {"type": [], "draft_max": None}
    plan = plan_host("rig1", seed, llama_8b_header)
    assert plan.fits, plan.report()
    assert plan.resolved["server"]["tensor_split"] is None
    assert [d.name for d in plan.memory.devices] == [RTX_5080["name"]]
    args = plan.server_args
    assert "-ts" not in args and args[args.index("-dev") + 1] == "CUDA1"


def test_default_margin_refuses_the_seed_with_mtp_and_says_what_fits(seed, qwen_header):
    seed["planner"]["margin_mib"] = 1024
    plan = plan_host("rig1", seed, qwen_header)
    assert not plan.fits
    (error,) = plan.errors
    assert "does not fit" in error and "deficit" in error
    assert "RTX 5080" in error and "would fit: -c " in error


def test_small_card_gets_the_smaller_share(seed, llama_8b_header):
    seed["gpus"] = [RTX_4070, RTX_3090]
    seed["server"].update(
        tensor_split="auto", ctx=65536, spec={"type": [], "draft_max": None}, kv_unified=True
    )
    plan = plan_host("rig1", seed, llama_8b_header)
    assert plan.fits, plan.report()
    share_4070, share_3090 = plan.resolved["server"]["tensor_split"]
    assert share_4070 < 0.45 < share_3090
    fills = [d.fill for d in plan.memory.devices]
    assert abs(fills[0] - fills[1]) < 0.1


def test_too_large_is_refused_with_a_table(seed, qwen_header):
    seed["gpus"] = [RTX_4070, RTX_4070]
    seed["server"].update(tensor_split="auto", spec={"type": [], "draft_max": None})
    plan = plan_host("rig1", seed, qwen_header)
    assert not plan.fits
    assert any("need" in e and "have" in e and "deficit" in e for e in plan.errors)


def test_ctx_auto_is_the_largest_multiple_of_256_that_fits(seed, qwen_header):
    seed["server"].update(ctx="auto", spec={"type": [], "draft_max": None})
    seed["gpus"] = [RTX_4070, RTX_3090]
    seed["server"]["tensor_split"] = "auto"
    plan = plan_host("rig1", seed, qwen_header)
    ctx = plan.resolved["server"]["ctx"]
    assert ctx % 256 == 0 and 0 < ctx <= 262144
    assert plan.fits, plan.report()
    bigger = copy.deepcopy(seed)
    bigger["server"]["ctx"] = ctx + 256
    assert ctx == 262144 or not plan_host("rig1", bigger, qwen_header).fits


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d["cuda"].update(version="12.4"), "needs CUDA >= 12.8"),
        (lambda d: d["driver"].update(open=False), "open kernel modules"),
        (
            lambda d: d["gpus"].append(
                {"name": "Tesla V100", "vram_mib": 32768, "compute_capability": "7.0"}
            ),
            "dropped compute capability below 7.5",
        ),
        (lambda d: d["driver"].update(source="distro"), "Blackwell"),
    ],
)
def test_version_gates(seed, change, words):
    change(seed)
    seed["server"]["tensor_split"] = None
    plan = plan_host("rig1", seed, None)
    assert any(words in error for error in plan.errors), plan.errors


def test_driver_too_old_for_the_toolkit(seed):
    probed = [
        {**RTX_5080, "bus_id": "00000000:07:00.0"},
        {**RTX_3090, "bus_id": "00000000:01:00.0"},
    ]
    plan = plan_host("rig1", seed, None, probed_gpus=probed, driver_version="575.51.03")
    assert any("too old for CUDA 13.0" in error for error in plan.errors), plan.errors


def test_probed_gpus_are_checked_against_the_declaration(seed):
    probed = [
        {**RTX_4070, "bus_id": "00000000:01:00.0"},
        {**RTX_5080, "bus_id": "00000000:07:00.0"},
    ]
    problems = compare_gpus(seed["gpus"], probed, "nvidia-smi")
    assert problems == [
        "GPU at 00000000:01:00.0 is 'NVIDIA GeForce RTX 4070', declared 'NVIDIA GeForce RTX 3090'",
        "GPU at 00000000:01:00.0 has compute capability 8.9, declared 8.6",
        "GPU at 00000000:01:00.0 has 12282 MiB, declared 24576 MiB",
    ]
    assert "but nvidia-smi shows 1" in compare_gpus(seed["gpus"], probed[:1], "nvidia-smi")[0]


def test_undeclared_gpus_come_from_the_probe(seed):
    seed["gpus"] = []
    seed["server"]["tensor_split"] = None
    probed, warnings = gpus_from_pci(
        [
            {"bus_id": "0000:01:00.0", "device_id": "0x2204", "class": "0x030000"},
            {"bus_id": "0000:07:00.0", "device_id": "0x2c02", "class": "0x030000"},
            {"bus_id": "0000:09:00.0", "device_id": "0x0001", "class": "0x030000"},
        ]
    )
    assert len(warnings) == 1 and "10de:0001" in warnings[0]
    plan = plan_host("rig1", seed, None, probed_gpus=probed, gpu_source="PCI ids")
    assert plan.gpu_source == "PCI ids"
    assert plan.cuda_architectures == "86-real;120a-real"
    assert "-dev" in plan.server_args


def test_mtp_on_a_model_without_mtp_layers_is_refused(seed, llama_8b_header):
    seed["server"]["tensor_split"] = "auto"
    seed["server"]["ctx"] = 8192
    plan = plan_host("rig1", seed, llama_8b_header)
    assert any("no MTP layers" in error for error in plan.errors)


def test_renamed_flags_are_translated_with_a_warning(seed):
    seed["server"]["extra_args"] = ["--draft-min", "2", "--temp", "0.7"]
    plan = plan_host("rig1", seed, None)
    assert plan.resolved["server"]["extra_args"] == ["--spec-draft-n-min", "2", "--temp", "0.7"]
    assert any("--draft-min is gone" in warning for warning in plan.warnings)


def test_no_renamed_flag_translates_into_a_planned_one():
    for old, new in RENAMED_FLAGS.items():
        assert old not in GUARDED_FLAGS, old
        assert not [arg for arg in new if option_name(arg) in GUARDED_FLAGS], (old, new)


def test_server_flags_are_option_names_only():
    args = ["bin", "-m", "/m.gguf", "--seed", "-1", "--chat-template-kwargs={}", "-ts", "2,3"]
    assert server_flags(args) == ["--chat-template-kwargs", "--seed", "-m", "-ts"]


def test_server_flags_are_looked_up_as_llama_cpp_does():
    """llama.cpp reads `--top_k` as `--top-k` (common/arg.cpp), so `--help`, which lists
    `--top-k`, must be searched for that spelling or the deploy refuses a valid argument."""
    assert server_flags(["bin", "--top_k", "40", "--min_p", "0.1"]) == ["--min-p", "--top-k"]


def test_plan_command_json_and_exit_status(tmp_path, qwen_header):
    model = tmp_path / "qwen.gguf"
    write_qwen35(model, Qwen35Shape(), "q8_0")

    def plan(*extra):
        return subprocess.run(
            offline(
                [sys.executable, "-m", "llamarig.cli", "plan", "--json", "--model", str(model)]
                + list(extra)
            ),
            cwd=PROJECT,
            env=pyinfra_env(RIG_INVENTORY="inventory/example-5080-3090.yml"),
            capture_output=True,
            text=True,
        )

    result = plan()
    assert result.returncode == 0, result.stderr
    host = json.loads(result.stdout)["hosts"]["rig1"]
    assert host["fits"] and host["split_mode"] == "tensor" and host["ctx"] == 229376
    assert host["cuda_architectures"] == "86-real;120a-real"
    assert len(host["devices"]) == 2 and host["devices"][0]["kv_mib"] > 0

    inventory = (PROJECT / "inventory" / "example-5080-3090.yml").read_text()
    (tmp_path / "rig.yml").write_text(inventory.replace("margin_mib: 256", "margin_mib: 4096"))
    result = subprocess.run(
        offline([sys.executable, "-m", "llamarig.cli", "plan", "--model", str(model)]),
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY=str(tmp_path / "rig.yml")),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1
    assert "REFUSED" in result.stdout and "deficit" in result.stdout


def test_zero_share_gpu_is_planned_out(seed, llama_8b_header):
    seed["gpus"] = [RTX_3090, RTX_5080]
    seed["server"].update(tensor_split=[1, 0], ctx=32768, spec={"type": [], "draft_max": None})
    plan = plan_host("rig1", seed, llama_8b_header)
    assert plan.fits, plan.report()
    document = plan.to_json()
    assert [d["name"] for d in document["devices"]] == [RTX_3090["name"]]
    assert any("zero share" in note for note in plan.notes)


def test_ctx_above_the_trained_context_is_refused(seed, llama_8b_header):
    seed["server"].update(split_mode="none", tensor_split=None, ctx=262144, kv_unified=True)
    plan = plan_host("rig1", seed, llama_8b_header)
    assert any(
        "server.ctx 262144 gives the slot 262144 tokens, above the model's trained context of "
        "131072 (llama.context_length)"
        in error
        and "`server.ctx: 131072` or less" in error
        and "server.allow_ctx_beyond_trained: true" in error
        for error in plan.errors
    ), plan.errors


def test_ctx_above_the_trained_context_is_a_warning_when_allowed(seed, llama_8b_header):
    seed["server"].update(split_mode="none", tensor_split=None, ctx=262144, kv_unified=True)
    seed["server"]["allow_ctx_beyond_trained"] = True
    plan = plan_host("rig1", seed, llama_8b_header)
    assert not [e for e in plan.errors if "trained context" in e], plan.errors
    assert any("262144 tokens, above" in warning for warning in plan.warnings)
    assert plan.memory.ctx == 262144


def test_ctx_is_compared_per_slot(seed, llama_8b_header):
    """Four slots of a 262144 context hold 65536 tokens each: within the trained 131072."""
    seed["server"].update(split_mode="none", tensor_split=None, ctx=262144)
    seed["server"].update(kv_unified=False, parallel=4)
    plan = plan_host("rig1", seed, llama_8b_header)
    assert not [e for e in plan.errors if "trained context" in e], plan.errors


def test_a_gpu_layers_count_is_planned_as_a_partial_offload(seed, llama_8b_header):
    seed["server"].update(split_mode="none", tensor_split=None, ctx=8192)
    full = plan_host("rig1", seed, llama_8b_header).memory
    seed["server"]["gpu_layers"] = 17
    plan = plan_host("rig1", seed, llama_8b_header)
    partial = plan.memory
    assert partial.devices[0].kv_mib * 2 == full.devices[0].kv_mib  # 16 of 32 layers
    assert partial.devices[0].weights_mib < full.devices[0].weights_mib
    assert partial.host_weights_mib > full.host_weights_mib
    assert plan.server_args[plan.server_args.index("-ngl") + 1] == "17"
