"""`split_mode: auto`, the default: the planner picks the fastest mode the rig can run and says
why, over a table of rigs and architectures. Model headers are real GGUF files written with
`gguf`; the rigs are the project's own inventories with `split_mode` left at its default."""

from __future__ import annotations

import copy

import pytest

from llamarig.config import ConfigError, defaults, load_inventory, rig_data
from llamarig.model.gguf import read_gguf_header_file
from llamarig.planner.plan import choose_split_mode, plan_host
from tests.conftest import PROJECT
from tests.ggufmodels import Qwen35Shape, llama_metadata, llama_tensors, write_gguf, write_qwen35


def _inventory_host(file: str, host: str) -> dict:
    return copy.deepcopy(load_inventory(PROJECT / "inventory" / file).hosts[host].data)


def _llama_like(path, arch: str = "llama", n_head_kv: int = 8):
    """A llama-shaped 8B header under any architecture name (the shape keys take its prefix)."""
    shape = (32, 4096, 14336, 32, n_head_kv, 128256)
    metadata = {
        key.replace("llama.", f"{arch}.", 1): value
        for key, value in llama_metadata(*shape, 131072).items()
    }
    tensors = llama_tensors(*shape, "q8_0")
    return read_gguf_header_file(write_gguf(path, arch, metadata, tensors))


@pytest.fixture(scope="module")
def headers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    return {
        "llama": _llama_like(folder / "llama-8b.gguf"),
        "olmo2": _llama_like(folder / "olmo2-8b.gguf", "olmo2"),
        "qwen35": read_gguf_header_file(
            write_qwen35(folder / "qwen36-27b-q8_0.gguf", Qwen35Shape(), "q8_0")
        ),
    }


@pytest.fixture
def seed() -> dict:
    """The seed rig (RTX 5080 + RTX 3090, Qwen3.6-27B Q8_0) as its example inventory has it:
    no split_mode, so the default `auto`."""
    return _inventory_host("example-5080-3090.yml", "rig1")


@pytest.fixture
def h200_pair() -> dict:
    data = _inventory_host("gpu-h200x2.yml", "h200x2")
    data["server"]["split_mode"] = "auto"
    return data


def test_auto_is_the_default_and_the_seed_inventory_leaves_it(seed):
    assert defaults()["server"]["split_mode"] == "auto"
    assert seed["server"]["split_mode"] == "auto"


def test_the_seed_rig_plans_tensor_with_its_reason(seed, headers):
    plan = plan_host("rig1", seed, headers["qwen35"])
    assert plan.fits, plan.report()
    document = plan.to_json()
    assert document["split_mode"] == "tensor"
    assert "two GPUs" in document["split_mode_reason"]
    # The seed builds without NCCL (no P2P between its generations): the reason says so.
    assert "without NCCL" in document["split_mode_reason"]
    args = document["server_args"]
    assert args[args.index("-sm") + 1] == "tensor" and args[args.index("-fa") + 1] == "on"
    assert args[args.index("-ts") + 1] == "2,3"
    assert "split mode tensor: two GPUs" in plan.report()


def test_two_h200s_plan_tensor(h200_pair, headers):
    plan = plan_host("h200x2", h200_pair, headers["llama"])
    assert plan.fits, plan.report()
    assert plan.resolved["server"]["split_mode"] == "tensor"
    assert "without NCCL" not in plan.split_mode_reason  # this rig builds with NCCL
    args = plan.server_args
    assert args[args.index("-sm") + 1] == "tensor" and "-fit" in args


def test_one_gpu_plans_none(h200_pair, headers):
    h200_pair["gpus"] = h200_pair["gpus"][:1]
    plan = plan_host("h200", h200_pair, headers["llama"])
    assert plan.fits, plan.report()
    assert (plan.resolved["server"]["split_mode"], plan.split_mode_reason) == ("none", "one GPU")
    assert plan.server_args[plan.server_args.index("-sm") + 1] == "none"


def test_a_zero_share_leaves_one_gpu_and_plans_none(h200_pair, headers):
    h200_pair["server"]["tensor_split"] = [1, 0]
    plan = plan_host("h200x2", h200_pair, headers["llama"])
    assert plan.resolved["server"]["split_mode"] == "none", plan.report()


def test_a_tensor_refused_architecture_plans_layer(h200_pair, headers):
    plan = plan_host("h200x2", h200_pair, headers["olmo2"])
    assert plan.resolved["server"]["split_mode"] == "layer", plan.report()
    assert "olmo2 is refused by -sm tensor" in plan.split_mode_reason
    assert "llm_arch_supports_sm_tensor" in plan.split_mode_reason


def test_an_rpc_head_plans_layer():
    inventory = load_inventory(PROJECT / "inventory" / "sandbox-rpc.yml")
    head = next(h.data for h in inventory.hosts.values() if h.data["role"] == "rpc-head")
    head = copy.deepcopy(head)
    head["server"]["split_mode"] = "auto"
    plan = plan_host("head", head, None)
    assert plan.resolved["server"]["split_mode"] == "layer"
    assert plan.split_mode_reason == "an rpc-head: RPC devices take whole layers"
    assert plan.server_args[plan.server_args.index("-sm") + 1] == "layer"


def test_an_rpc_head_may_say_auto_but_not_tensor():
    inventory = load_inventory(PROJECT / "inventory" / "sandbox-rpc.yml")
    data = next(h.data for h in inventory.hosts.values() if h.data["role"] == "rpc-head")
    for mode, refused in (("auto", False), ("tensor", True)):
        changed = copy.deepcopy(data)
        changed["server"]["split_mode"] = mode
        changed["rpc"].pop("endpoints", None)
        changed["rpc"].pop("worker_gpus", None)
        if refused:
            with pytest.raises(ConfigError, match="does not span hosts"):
                rig_data(changed)
        else:
            rig_data(changed)


@pytest.mark.parametrize(
    ("change", "gpus", "mode", "words"),
    [
        ({"server": {"flash_attn": "off"}}, 2, "layer", "flash_attn is off"),
        ({"server": {"cache_type_k": "iq4_nl"}}, 2, "layer", "KV type iq4_nl"),
        ({}, 3, "layer", "#26837"),
        ({}, 4, "layer", "set `split_mode: tensor` to try it"),
        ({"llama_cpp": {"backend": "cpu"}}, 0, "none", "a cpu build"),
        ({}, None, "layer", "GPUs are not known"),
        ({"server": {"split_mode": "layer"}}, 2, "layer", "set in server.split_mode"),
        ({"server": {"split_mode": "tensor"}}, 3, "tensor", "set in server.split_mode"),
    ],
)
def test_auto_over_a_table_of_rigs(h200_pair, headers, change, gpus, mode, words):
    for section, values in change.items():
        h200_pair[section].update(values)
    chosen, reason = choose_split_mode(h200_pair, gpus, headers["llama"])
    assert chosen == mode and words in reason, reason


def test_without_a_header_auto_stays_with_layer(h200_pair):
    assert choose_split_mode(h200_pair, 2, None) == (
        "layer",
        "the model's architecture is not known yet (no GGUF header)",
    )


def test_tensor_that_does_not_fit_falls_back_to_layer_that_does(h200_pair, tmp_path):
    """A small card beside a large one and a model with two KV heads: tensor mode still puts
    the small card's share of every layer's buffers on it (about 2 GiB at a zero share) and
    does not fit, layer mode does. Auto takes layer and says why; an explicit tensor is
    refused instead."""
    header = _llama_like(tmp_path / "llama-8b-2kv.gguf", n_head_kv=2)
    h200_pair["server"].update(ctx=8192, tensor_split="auto")
    h200_pair["gpus"][0]["vram_mib"], h200_pair["gpus"][1]["vram_mib"] = 3000, 20000
    plan = plan_host("h200x2", h200_pair, header)
    assert plan.fits, plan.report()
    assert plan.resolved["server"]["split_mode"] == "layer"
    assert plan.split_mode_reason == (
        "tensor mode does not fit these GPUs' memory and layer mode does"
    )
    h200_pair["server"]["split_mode"] = "tensor"
    refused = plan_host("h200x2", h200_pair, header)
    assert not refused.fits and "does not fit in GPU memory" in refused.errors[0]


@pytest.mark.parametrize(
    ("mode", "nccl", "reserve"),
    [("tensor", True, 2048), ("layer", True, 1100), ("none", True, 1100)]
    + [(mode, False, 600) for mode in ("tensor", "layer", "none")],
)
def test_the_auto_reserve_follows_the_mode_and_nccl(h200_pair, headers, mode, nccl, reserve):
    """`planner.reserve_mib: auto` (the default) takes what nvidia-smi showed beyond llama.cpp's
    buffers on H200s for this split mode and build, and the plan says where it came from."""
    h200_pair["planner"]["reserve_mib"] = "auto"
    h200_pair["server"]["split_mode"] = mode
    h200_pair["llama_cpp"]["cmake_options"]["GGML_CUDA_NCCL"] = nccl
    plan = plan_host("h200x2", h200_pair, headers["llama"])
    assert plan.fits, plan.report()
    assert {device.reserve_mib for device in plan.memory.devices} == {reserve}
    with_nccl = "with" if nccl else "without"
    assert (
        f"reserve {reserve} MiB per GPU beyond llama.cpp's buffers: measured on H200s for {mode} "
        f"mode {with_nccl} NCCL (planner.reserve_mib: auto; the deploy measures this rig after "
        "its first start)"
    ) in plan.notes


def test_an_explicit_reserve_is_kept(h200_pair, headers):
    assert h200_pair["planner"]["reserve_mib"] == 2048  # the inventory's own measurement
    plan = plan_host("h200x2", h200_pair, headers["llama"])
    assert {device.reserve_mib for device in plan.memory.devices} == {2048}
    assert "reserve 2048 MiB per GPU beyond llama.cpp's buffers: planner.reserve_mib" in plan.notes


def test_the_fallback_to_layer_plans_with_the_layer_reserve(h200_pair, tmp_path):
    """With NCCL, tensor mode reserves 2048 MiB a card and layer mode 1100: auto compares the
    two modes each with its own reserve."""
    header = _llama_like(tmp_path / "llama-8b.gguf")
    h200_pair["planner"]["reserve_mib"] = "auto"
    h200_pair["server"].update(ctx=8192, tensor_split=None)
    probe = copy.deepcopy(h200_pair)
    probe["server"]["split_mode"] = "layer"
    layered = plan_host("h200x2", probe, header).memory
    need = max(device.need_mib for device in layered.devices)
    for gpu in h200_pair["gpus"]:
        gpu["vram_mib"] = need + 16
    plan = plan_host("h200x2", h200_pair, header)
    assert plan.fits, plan.report()
    assert plan.resolved["server"]["split_mode"] == "layer", plan.split_mode_reason
    assert {device.reserve_mib for device in plan.memory.devices} == {1100}
