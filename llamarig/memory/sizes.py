"""What llama-server at the pinned commit allocates per item, from a GGUF header: the
architectures the model covers, the layers with a KV cache or a recurrent state, the KV cache
and recurrent rows, the compute buffer, and the reserve beside them (see llamarig.memory)."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from llamarig.gguf_header import GgufHeader, ggml_type, row_size

SplitMode = Literal["none", "layer", "tensor"]

MIB = 1 << 20
ON_HOST = -1  # layer_devices' device of a block that `-ngl` leaves on the host
CTX_PAD = 256  # GGML_PAD(n_ctx, 256) in llama-context.cpp
PIPELINE_COPIES = 4  # GGML_SCHED_MAX_COPIES, used when layer mode spans several GPUs
# Decimals of a planned tensor split, as -ts gets it: the plan is evaluated at exactly the
# ratio llama.cpp receives (a rounding can move a whole KV head from one GPU to the other).
SPLIT_DECIMALS = 3
TENSOR_SPLIT_FFN_BLOCK = 128  # get_split_granularity: lcm(block size, 128) rows for the FFN
# FLASH_ATTN_EXT's alloc size in ggml-cuda (fattn.cu ggml_cuda_flash_attn_ext_get_alloc_size)
# includes F16 copies of a non-F16 K and V for the batched kernels.
F16_BYTES = ggml_type("f16").type_size
F32_BYTES = ggml_type("f32").type_size
# Per-token f32 activations of the widest layer, in units of n_embd: fitted to llama.cpp's own
# estimate (llama-fit-params --fit-print, CUDA, pinned commit) for a qwen35 27B shape; a dense
# llama 8B shape needs about half of it, so dense models come out slightly high.
ACTIVATION_ROWS = 8
# Extra f32 rows of n_embd per token on the output device in layer mode (the pipeline's
# output staging), fitted to the same estimates.
LAYER_MODE_OUTPUT_ROWS = 6
# GGML_CUDA_FA_QUANTS default: the K/V type pairs a default CUDA build has kernels for.
FA_TYPE_PAIRS = ("f16", "q8_0", "q4_0", "bf16")
# KV cache types the CUDA backend has a flash-attention kernel for at the pinned llama.cpp
# (ggml_cuda_fattn_kv_type_supported in ggml-cuda/fattn.cu; f32 is converted to f16): tensor
# mode forces flash attention on, so it needs one of these.
CUDA_FA_KV_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")

ROW_SPLIT_REFUSED = (
    "split mode 'row' no longer works with CUDA at the pinned llama.cpp commit: loading fails "
    "with 'does not support split buffers'; use 'tensor' or 'layer'"
)
# llm_arch_supports_sm_tensor() == false in src/llama-arch.cpp.
TENSOR_SPLIT_UNSUPPORTED = frozenset(
    "grok mpt plamo2 minicpm3 gemma3n mamba mamba2 jamba falcon-h1 olmo2 olmoe deepseek2 "
    "deepseek32 hy_v4 dots3note glm-dsa bitnet t5 nemotron_h nemotron_h_moe granitehybrid "
    "minimax-01 minimax-m2 minimax-m3 mistral4 kimi-linear bailingmoe3 kimi-k3 glm5-next "
    "qwen3tts qwen4exp".split()
)
# Hybrids whose recurrent layers follow %s.full_attention_interval (default 4) unless
# %s.attention.recurrent_layers lists them (src/models/qwen35.cpp load_arch_hparams).
INTERVAL_HYBRIDS = frozenset({"qwen3next", "qwen35", "qwen35moe", "qwen4exp"})
RECURRENT_ARCHS = frozenset({"mamba", "mamba2"})
UNMODELLED_ARCHS = frozenset({"rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# llm_arch_supports_rs_rollback(): only these keep recurrent snapshots for draft rollback.
RS_ROLLBACK_ARCHS = frozenset(
    "kimi-k3 qwen35 qwen35moe qwen4exp deepseek4 glm5-next nemotron_h nemotron_h_moe lfm2 lfm2moe "
    "bailingmoe3".split()
)


# What nvidia-smi showed per GPU beyond llama.cpp's own buffers (bench/RESULTS.md, H200s,
# CUDA 13): 1907-1967 MiB in tensor mode with NCCL (about 770 MiB of it NCCL's, 529 MiB the bare
# CUDA context); 1093 MiB on one GPU of a build with NCCL; 569 MiB on one GPU without NCCL.
# Rounded up; tensor or layer mode without NCCL was not measured and takes the one-GPU value.
RESERVE_TENSOR_NCCL_MIB = 2048
RESERVE_NCCL_MIB = 1100
RESERVE_MIB = 600


def default_reserve_mib(split_mode: str, nccl: bool) -> int:
    """``planner.reserve_mib: auto``: the measured overhead for this split mode and build."""
    if not nccl:
        return RESERVE_MIB
    return RESERVE_TENSOR_NCCL_MIB if split_mode == "tensor" else RESERVE_NCCL_MIB


# --- model structure -------------------------------------------------------------------------


@dataclass(frozen=True)
class Layers:
    n_all: int  # blocks, MTP blocks included
    n_main: int  # blocks of the main pass
    recurrent: tuple[bool, ...]  # per block
    attention: tuple[bool, ...]  # per block: has a KV cache (in its own context)


def model_layers(header: GgufHeader) -> Layers:
    arch = header.architecture
    if arch in UNMODELLED_ARCHS:
        raise ValueError(
            f"architecture {arch}: the memory model covers transformers and SSM hybrids"
        )
    n_all, n_main = header.block_count, header.main_layer_count
    if arch in INTERVAL_HYBRIDS:
        flags = header.recurrent_layers
        if flags is None:
            interval = header.full_attention_interval or 4
            flags = [i < n_main and (i + 1) % interval != 0 for i in range(n_all)]
        recurrent = tuple(flags[i] if i < n_main else False for i in range(n_all))
        attention = tuple(not r for r in recurrent)
    elif arch in RECURRENT_ARCHS:
        recurrent = tuple(True for _ in range(n_all))
        attention = tuple(False for _ in range(n_all))
    else:
        # per-layer KV head counts of 0 mark layers without attention (SSM hybrids)
        attention = tuple(header.head_count_kv_at(i) > 0 for i in range(n_all))
        has_ssm = header.ssm_state_size > 0
        recurrent = tuple(has_ssm and not a for a in attention)
    return Layers(n_all, n_main, recurrent, attention)


def kv_cells(ctx: int, n_parallel: int, kv_unified: bool) -> tuple[int, int]:
    """(cells per stream, streams) as llama-context.cpp sizes the KV cache."""
    n_ctx = -(-ctx // CTX_PAD) * CTX_PAD
    if kv_unified:
        return n_ctx, 1
    per_stream = -(-(n_ctx // n_parallel) // CTX_PAD) * CTX_PAD
    return per_stream, n_parallel


def kv_layer_bytes(header: GgufHeader, layer: int, cells: int, type_k: str, type_v: str) -> int:
    heads = header.head_count_kv_at(layer)
    return (
        row_size(type_k, header.key_length * heads) + row_size(type_v, header.value_length * heads)
    ) * cells


def kv_cache_bytes(
    header: GgufHeader,
    ctx: int,
    n_parallel: int = 1,
    kv_unified: bool = True,
    type_k: str = "f16",
    type_v: str = "f16",
) -> int:
    """Bytes of the main context's KV cache (all attention layers of the main pass)."""
    header.check_shape()
    layers = model_layers(header)
    per_stream, n_stream = kv_cells(ctx, n_parallel, kv_unified)
    return sum(
        kv_layer_bytes(header, il, per_stream * n_stream, type_k, type_v)
        for il in range(layers.n_main)
        if layers.attention[il]
    )


def recurrent_row_bytes(header: GgufHeader) -> int:
    d_conv, d_inner = header.ssm_conv_kernel, header.ssm_inner_size
    d_state, n_group = header.ssm_state_size, header.ssm_group_count
    n_embd_r = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    n_embd_s = d_state * d_inner
    return (n_embd_r + n_embd_s) * F32_BYTES


def compute_buffer_bytes(
    n_vocab: int,
    n_embd: int,
    n_ubatch: int,
    n_outputs: int,
    kv_cells_per_stream: int,
    kv_cells_total: int,
    kv_f16_copy_per_cell: int,
    pipeline_copies: int = 1,
    holds_output: bool = True,
    holds_attention: bool = True,
) -> int:
    """One device's compute buffer for the worst-case batch (sched_reserve in llama-context.cpp).

    An approximation fitted to llama.cpp's own reservation (llama-fit-params --fit-print on
    H200s at the pinned commit: qwen35 27B and llama 8B shapes, ubatch 256-2048, context
    32k-229k, none/tensor/layer modes, within about 40 MiB) and made of the buffers that
    dominate it:
    - mask: the F16 KQ mask, ``cells per stream * n_ubatch * 2`` (llama-graph.cpp);
    - the flash-attention node's F16 copies of a quantized K/V: ``total cells * (n_embd_k_gqa +
      n_embd_v_gqa) * 2`` (the largest layer's; fattn.cu ggml_cuda_flash_attn_ext_get_alloc_size);
    - activations: ``ACTIVATION_ROWS * n_embd * n_ubatch * 4``;
    - logits: ``n_vocab * n_outputs * 4`` on the device of the output layer.
    The peak is the larger of the attention layer's and the output layer's sets. With several
    GPUs in layer mode the scheduler keeps ``pipeline_copies`` (GGML_SCHED_MAX_COPIES = 4) of
    each device's inputs (mask and incoming activations), which is why layer mode needs more
    (GUIDE §7.7).
    """
    rows = n_embd * n_ubatch * F32_BYTES
    mask = kv_cells_per_stream * n_ubatch * F16_BYTES if holds_attention else 0
    attention = (
        kv_cells_total * kv_f16_copy_per_cell if holds_attention else 0
    ) + ACTIVATION_ROWS * rows
    logits = n_vocab * n_outputs * F32_BYTES
    if pipeline_copies > 1:
        inputs = pipeline_copies * (mask + rows)
        if holds_output:
            return inputs + max(attention, logits + LAYER_MODE_OUTPUT_ROWS * rows)
        return inputs + attention
    output = logits + rows + mask if holds_output else 0
    return max(mask + attention, output)


def f16_copy_bytes_per_cell(
    header: GgufHeader, layers: Sequence[int], type_k: str, type_v: str
) -> int:
    """Bytes per KV cell of the flash-attention F16 copies for the widest of ``layers``."""
    widest = 0
    for il in layers:
        heads = header.head_count_kv_at(il)
        k = header.key_length * heads if type_k != "f16" else 0
        v = header.value_length * heads if type_v != "f16" else 0
        widest = max(widest, k + v)
    return widest * F16_BYTES
