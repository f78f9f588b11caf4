import math
from dataclasses import replace

import pytest

from llamarig.model.gguf import read_gguf_header_file
from llamarig.planner.memory import MIB, Device, plan_memory
from llamarig.planner.placement import (
    ON_HOST,
    compute_buffer_bytes,
    kv_cache_bytes,
    kv_cells,
    layer_devices,
    split_units,
)
from tests.ggufmodels import (
    Qwen35Shape,
    llama_metadata,
    llama_tensors,
    write_gguf,
    write_llama,
    write_qwen35,
)

RTX_5080 = Device("RTX 5080", 16303, 512)
RTX_3090 = Device("RTX 3090", 24576, 512)
RTX_4070 = Device("RTX 4070", 12282, 512)
SEED_RIG = [RTX_5080, RTX_3090]  # CUDA order: the 5080 is device 0 (GUIDE §1)
SEED_CTX = 229376


@pytest.fixture(scope="module")
def qwen36(tmp_path_factory):
    """Qwen3.6-27B Q8_0 as GUIDE §4 describes it (64 + 1 MTP blocks, 16 with attention)."""
    return read_gguf_header_file(write_qwen35(tmp_path_factory.mktemp("m") / "qwen36.gguf"))


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "llama8b.gguf"
    return read_gguf_header_file(write_llama(path, 32, 4096, 14336, 32, 8, 128256, 131072, "q8_0"))


def test_kv_cells_follow_llama_context():
    assert kv_cells(1000, 1, True) == (1024, 1)  # padded to 256
    assert kv_cells(1000, 3, False) == (512, 3)  # 1024 // 3 = 341, padded per stream
    assert kv_cells(SEED_CTX, 4, False) == (57344, 4)


def test_kv_formula_by_hand(tmp_path):
    header = read_gguf_header_file(
        write_llama(tmp_path / "l.gguf", n_layer=4, n_embd=256, n_ff=512, n_head=8, n_head_kv=2)
    )
    # head size 32, 2 KV heads: 64 values per row of K and of V
    f16_row, q8_row = 64 * 2, 2 * 34
    assert kv_cache_bytes(header, 1000) == 4 * 2 * f16_row * 1024
    assert kv_cache_bytes(header, 1000, type_k="q8_0", type_v="q8_0") == 4 * 2 * q8_row * 1024
    assert kv_cache_bytes(header, 1000, 3, False, "q8_0", "q4_0") == 4 * (q8_row + 2 * 18) * 1536


def test_only_full_attention_layers_hold_kv(qwen36):
    # 16 of 64 layers; q8_0 rows of 4 heads x 256; llama.cpp logged 7616.00 MiB for this
    assert kv_cache_bytes(qwen36, SEED_CTX, type_k="q8_0", type_v="q8_0") == 7616 * MIB


def test_split_units_rounds_and_rotates_like_llama_cpp():
    assert split_units(4, [0.4, 0.6], 0) == [1, 3]
    assert split_units(4, [0.4, 0.6], 1) == [2, 2]
    assert split_units(136, [1, 1], 0) == [68, 68]
    assert split_units(16, [0.2, 0.8], 1) == [4, 12]


def test_layer_devices_follow_load_tensors():
    # 65 blocks + output: upper_bound(cumulative split, il / 66)
    devices = layer_devices(65, [2, 3])
    assert devices.count(0) == 27 and devices[-1] == 1
    assert layer_devices(3, [1, 1]) == [0, 0, 1, 1]


def test_seed_rig_matches_llama_cpp_allocation(qwen36):
    """-sm tensor -ts 2,3 -c 229376 q8_0 KV on two H200s at the pinned commit logged, for the
    larger device: model 15578.93, KV 4760.01, RS 88.84, compute 1200.28 MiB."""
    plan = plan_memory(qwen36, SEED_RIG, "tensor", [2, 3], SEED_CTX, 1, True, "q8_0", "q8_0", 512)
    big = plan.devices[1]
    assert (big.weights_mib, big.kv_mib, big.state_mib, big.compute_mib) == (15579, 4760, 89, 1200)
    small = plan.devices[0]
    assert (small.weights_mib, small.kv_mib, small.state_mib) == (10396, 2856, 61)
    assert plan.host_weights_mib == 1289  # token_embd stays on the CPU


def test_seed_rig_auto_ratio_fits(qwen36):
    plan = plan_memory(qwen36, SEED_RIG, "tensor", "auto", SEED_CTX, 1, True, "q8_0", "q8_0", 512)
    assert plan.fits and plan.suggestions == []
    assert plan.ctx == SEED_CTX
    assert abs(plan.ratio[0] - 0.4) < 0.03  # close to the 16:24 (2:3) weighting
    fills = [d.fill for d in plan.devices]
    assert abs(fills[0] - fills[1]) < 0.01


def test_uneven_pair_gets_uneven_ratio(llama8b):
    plan = plan_memory(
        llama8b, [RTX_4070, RTX_3090], "tensor", "auto", 65536, 1, True, "q8_0", "q8_0"
    )
    assert plan.fits
    assert plan.ratio[0] < 0.35 < 0.65 < plan.ratio[1]
    assert abs(plan.devices[0].fill - plan.devices[1].fill) < 0.01


def test_auto_ratio_is_planned_as_llama_cpp_receives_it(tmp_path):
    """The balanced ratio is planned at the three decimals -ts gets: llama.cpp draws the unit
    boundaries from that number. Measured on two H200s capped to 24576 + 16303 MiB (bench/,
    a 32.5B Q8_0 with 8 KV heads): planning at the unrounded 0.6249 put 4 of the 8 KV heads of
    every other layer on the small card where llama.cpp, given 0.625, put 3 - 430 MiB more on
    the large card than planned; at the rendered ratio the plan is within 0.3% of nvidia-smi."""
    path = write_llama(tmp_path / "l32.gguf", 64, 5120, 27648, 40, 8, 128256, 131072, "q8_0")
    header = read_gguf_header_file(path)
    devices = [Device("H200 capped", 24576, 2048), Device("H200 capped", 16303, 2048)]
    plan = plan_memory(
        header, devices, tensor_split="auto", ctx=19456, type_k="q8_0", type_v="q8_0",
        margin_mib=512,
    )  # fmt: skip
    assert all(round(share, 3) == share for share in plan.ratio)
    again = plan_memory(
        header, devices, tensor_split=plan.ratio, ctx=19456, type_k="q8_0", type_v="q8_0",
        margin_mib=512,
    )  # fmt: skip
    assert [d.planned_mib for d in again.devices] == [d.planned_mib for d in plan.devices]
    # Measured with -ts 0.625,0.375 at this context: 23969 and 15251 MiB.
    assert plan.ratio == (0.625, 0.375)
    for device, measured in zip(plan.devices, (23969, 15251), strict=True):
        assert abs(device.planned_mib - measured) / measured < 0.01


def test_model_too_large_is_refused_with_table(tmp_path):
    header = read_gguf_header_file(write_qwen35(tmp_path / "f16.gguf", weight_type="f16"))
    plan = plan_memory(header, SEED_RIG, "tensor", "auto", SEED_CTX, 1, True, "q8_0", "q8_0")
    assert not plan.fits
    table = plan.table()
    assert "need" in table and "have" in table and "deficit" in table
    for device in plan.devices:
        assert device.name in table
        assert device.need_mib > device.vram_mib
    assert len(plan.suggestions) == 1 and plan.suggestions[0].startswith("nothing fits")


def test_suggestions_for_a_config_that_does_not_fit(qwen36):
    plan = plan_memory(qwen36, SEED_RIG, "tensor", [2, 3], SEED_CTX, 1, True, "f16", "f16")
    assert not plan.fits
    assert plan.devices[1].need_mib > plan.devices[1].vram_mib  # the 3090 overflows
    assert (
        plan.suggestions[0].startswith("-c ") and "largest multiple of 256" in plan.suggestions[0]
    )
    assert f"-ctk q8_0 -ctv q8_0 fits at -c {SEED_CTX}" in plan.suggestions


def test_suggests_another_ratio(qwen36):
    plan = plan_memory(qwen36, SEED_RIG, "tensor", [1, 1], SEED_CTX, 1, True, "q8_0", "q8_0")
    assert not plan.fits
    assert plan.devices[0].need_mib > plan.devices[0].vram_mib  # an even split over-fills the 5080
    assert any(
        s.startswith("-ts 0.3") and s.endswith(f"fits at -c {SEED_CTX}") for s in plan.suggestions
    )


def test_row_mode_is_refused(qwen36):
    with pytest.raises(
        ValueError, match="fails with 'does not support split buffers'; use 'tensor' or 'layer'"
    ):
        plan_memory(qwen36, SEED_RIG, "row")


def test_ctx_auto_is_the_largest_fitting_multiple_of_256(llama8b):
    devices = [RTX_4070, Device("RTX 3060", 12288, 512)]
    plan = plan_memory(llama8b, devices, "tensor", "auto", "auto")  # f16 KV
    assert plan.fits
    assert plan.ctx % 256 == 0 and 32768 < plan.ctx < llama8b.context_length
    bigger = plan_memory(llama8b, devices, "tensor", "auto", plan.ctx + 256)
    assert not bigger.fits


def test_ctx_auto_is_capped_at_the_model_context(qwen36):
    h200s = [Device("H200", 143771, 1500)] * 2
    plan = plan_memory(qwen36, h200s, "tensor", "auto", "auto", type_k="q8_0", type_v="q8_0")
    assert plan.ctx == qwen36.context_length


def test_layer_mode_matches_llama_cpp_estimate(qwen36):
    # llama-fit-params --fit-print -sm layer -ts 2,3 -c 32768 q8_0 at the pinned commit:
    # CUDA0 10422 model + 473 context, CUDA1 15550 + 764 (MiB)
    plan = plan_memory(qwen36, SEED_RIG, "layer", [2, 3], 32768, type_k="q8_0", type_v="q8_0")
    got = [(d.weights_mib, d.kv_mib + d.state_mib) for d in plan.devices]
    expected = [(10422, 473), (15550, 764)]  # llama.cpp rounds MiB down, the plan up
    for (weights, context), (want_weights, want_context) in zip(got, expected, strict=True):
        assert 0 <= weights - want_weights <= 1 and 0 <= context - want_context <= 1


def test_layer_mode_keeps_pipeline_copies(qwen36):
    settings = dict(ctx=SEED_CTX, type_k="q8_0", type_v="q8_0", tensor_split=[2, 3])
    layer = plan_memory(qwen36, SEED_RIG, "layer", **settings)
    tensor = plan_memory(qwen36, SEED_RIG, "tensor", **settings)
    # four copies of the 224 MiB mask: llama.cpp estimated 1913 MiB per device
    assert layer.devices[0].compute_mib == 1912
    assert layer.devices[0].compute_mib > tensor.devices[0].compute_mib


def test_none_mode_uses_the_first_device(llama8b):
    plan = plan_memory(
        llama8b, [RTX_3090, RTX_4070], "none", ctx=32768, type_k="q8_0", type_v="q8_0"
    )
    assert plan.devices[1].planned_mib == 0 and plan.devices[1].fits
    # llama-fit-params: 7605 model, 2176 context
    assert plan.devices[0].weights_mib - 7605 in (0, 1) and plan.devices[0].kv_mib == 2176


def test_mtp_drafting_costs_memory(qwen36):
    base = plan_memory(qwen36, SEED_RIG, "tensor", [2, 3], SEED_CTX, type_k="q8_0", type_v="q8_0")
    mtp = plan_memory(
        qwen36,
        SEED_RIG,
        "tensor",
        [2, 3],
        SEED_CTX,
        type_k="q8_0",
        type_v="q8_0",
        mtp_draft_n_max=3,
    )
    for without, with_mtp in zip(base.devices, mtp.devices, strict=True):
        assert with_mtp.weights_mib > without.weights_mib  # the MTP block loads
        assert with_mtp.kv_mib > without.kv_mib  # the draft context's f16 cache
        assert with_mtp.state_mib == 4 * without.state_mib  # 3 rollback snapshots + 1
        assert with_mtp.compute_mib > without.compute_mib  # the draft context's buffer


def test_compute_buffer_fits_llama_cpp_estimates():
    """llama-fit-params --fit-print (512 outputs) on an H200 at the pinned commit, in MiB."""

    def mib(*args, **kwargs):
        return round(compute_buffer_bytes(*args, **kwargs) / MIB)

    qwen = dict(n_vocab=248320, n_embd=5120, kv_f16_copy_per_cell=4096)
    assert (
        mib(n_ubatch=512, n_outputs=512, kv_cells_per_stream=32768, kv_cells_total=32768, **qwen)
        == 527
    )
    assert (
        mib(n_ubatch=1024, n_outputs=1024, kv_cells_per_stream=32768, kv_cells_total=32768, **qwen)
        == 1054
    )
    assert (
        mib(n_ubatch=512, n_outputs=512, kv_cells_per_stream=131072, kv_cells_total=131072, **qwen)
        == 720
    )
    assert (
        mib(n_ubatch=512, n_outputs=512, kv_cells_per_stream=229376, kv_cells_total=229376, **qwen)
        == 1200
    )
    # four non-unified streams of 57344 cells: 1032
    assert (
        mib(n_ubatch=512, n_outputs=512, kv_cells_per_stream=57344, kv_cells_total=229376, **qwen)
        == 1032
    )
    llama = dict(n_vocab=128256, n_embd=4096, kv_f16_copy_per_cell=4096)
    # 258 and 672 measured: dense models come out a little high
    assert (
        258
        <= mib(
            n_ubatch=512, n_outputs=512, kv_cells_per_stream=32768, kv_cells_total=32768, **llama
        )
        <= 300
    )
    assert (
        672
        <= mib(
            n_ubatch=512, n_outputs=512, kv_cells_per_stream=131072, kv_cells_total=131072, **llama
        )
        <= 710
    )


def test_quantized_kv_needs_divisible_head_size(tmp_path):
    header = read_gguf_header_file(
        write_llama(tmp_path / "l.gguf", n_layer=2, n_embd=80, n_ff=160, n_head=4, n_head_kv=4)
    )
    with pytest.raises(ValueError, match="does not divide the head size 20"):
        plan_memory(header, SEED_RIG, "layer", ctx=4096, type_k="q8_0", type_v="q8_0")


def test_tensor_mode_refuses_unsupported_architectures(tmp_path):
    metadata = {
        key.replace("llama.", "deepseek2."): value
        for key, value in llama_metadata(2, 128, 256, 2, 2, 100, 4096).items()
    }
    path = write_gguf(
        tmp_path / "d.gguf", "deepseek2", metadata, llama_tensors(2, 128, 256, 2, 2, 100)
    )
    with pytest.raises(ValueError, match="deepseek2 cannot use -sm tensor"):
        plan_memory(read_gguf_header_file(path), SEED_RIG, "tensor", ctx=4096)


def test_explicit_ratio_must_match_devices(qwen36):
    with pytest.raises(ValueError, match="2 devices"):
        plan_memory(qwen36, SEED_RIG, "tensor", [1, 1, 1], 4096)


def test_ctx_auto_reaches_a_small_models_context(tmp_path):
    header = read_gguf_header_file(
        write_qwen35(tmp_path / "s.gguf", replace(Qwen35Shape(), n_layer=8, context_length=32768))
    )
    plan = plan_memory(header, SEED_RIG, "tensor", "auto", "auto", type_k="q8_0", type_v="q8_0")
    assert plan.ctx == 32768 and plan.fits


def test_layer_devices_leave_the_first_blocks_on_the_host_under_ngl():
    # -ngl 3 of 4 blocks + output: i_gpu_start = 5 - 3 = 2; the 3 offloaded split at 1/2
    assert layer_devices(4, [1, 1], n_gpu_layers=3) == [ON_HOST, ON_HOST, 0, 0, 1]
    assert layer_devices(4, [1, 1], n_gpu_layers=0) == [ON_HOST] * 5
    assert layer_devices(4, [1, 1], n_gpu_layers=99) == layer_devices(4, [1, 1])


def _block(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def test_partial_offload_keeps_the_first_layers_in_host_memory(llama8b):
    """-ngl 17 of 32 blocks + output: blocks 0-15 stay on the host with their KV cache; the
    GPU holds blocks 16-31 and the output layer, and half the KV cache."""
    h200 = [Device("H200", 143771, 512)]
    args = dict(split_mode="none", ctx=8192, type_k="q8_0", type_v="q8_0")
    full = plan_memory(llama8b, h200, **args)
    partial = plan_memory(llama8b, h200, **args, n_gpu_layers=17)
    on_gpu = [t for t in llama8b.tensors if t.name != "token_embd.weight"]
    on_gpu = [t for t in on_gpu if _block(t.name) is None or _block(t.name) >= 16]
    host = [t for t in llama8b.tensors if t not in on_gpu]
    gpu, full_gpu = partial.devices[0], full.devices[0]
    assert gpu.weights_mib == math.ceil(sum(t.n_bytes for t in on_gpu) / MIB)
    assert partial.host_weights_mib == math.ceil(sum(t.n_bytes for t in host) / MIB)
    assert gpu.kv_mib == math.ceil(kv_cache_bytes(llama8b, 8192, 1, True, "q8_0", "q8_0") / 2 / MIB)
    assert gpu.weights_mib < full_gpu.weights_mib and gpu.kv_mib < full_gpu.kv_mib
    assert gpu.planned_mib < full_gpu.planned_mib
    # llama.cpp's -ngl counts the output layer: 33 is everything, as is no count at all
    assert plan_memory(llama8b, h200, **args, n_gpu_layers=33).devices == full.devices


def test_partial_offload_in_layer_mode_shrinks_each_gpu(llama8b):
    args = dict(split_mode="layer", tensor_split=[1, 1], ctx=8192)
    full = plan_memory(llama8b, [RTX_3090, RTX_3090], **args)
    partial = plan_memory(llama8b, [RTX_3090, RTX_3090], **args, n_gpu_layers=9)
    # All 33: blocks 0-16 on GPU 0, 17-31 and the output on GPU 1 (il / 33 against 1/2).
    # 9 offloaded: blocks 24-31 and the output; (il - 24) / 9 puts 24-28 on GPU 0, 29-31 on 1.
    per_layer = full.devices[0].kv_mib // 17
    assert [d.kv_mib for d in full.devices] == [17 * per_layer, 15 * per_layer]
    assert [d.kv_mib for d in partial.devices] == [5 * per_layer, 3 * per_layer]
    pairs = zip(partial.devices, full.devices, strict=True)
    assert all(p.weights_mib < f.weights_mib for p, f in pairs)
    assert partial.host_weights_mib > full.host_weights_mib
