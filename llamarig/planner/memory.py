"""The planner's memory model: what llama-server at the pinned commit allocates per GPU.

Pure: it reads a GGUF header (llamarig.model.gguf) and a device list, nothing else. Source lines
named below are in the pinned llama.cpp tree (GUIDE §1).

Per device, in bytes:
- weights: the tensor table, placed as llama.cpp places it. ``token_embd`` stays on the host
  (llama-model.cpp load_tensors: "there is very little benefit to offloading the input layer").
  ``layer`` mode gives whole blocks to devices (the ``upper_bound`` over the cumulative ``-ts``
  split in load_tensors, the output layer counting as block ``n_layer_all``); ``tensor`` mode cuts
  every block's tensors into whole units (KV-head groups, K-head groups of the delta net, FFN row
  blocks of lcm(block size, 128)) with the rounding and per-layer rotation of
  llama_meta_device_get_split_state, and mirrors what it cannot cut (norms).
- KV cache (llama-kv-cache.cpp constructor): per attention layer
  ``row_size(type_k, n_embd_k_gqa) * kv_size * n_stream`` plus the same for V, where
  ``n_ctx = pad(ctx, 256)``; unified: one stream of ``n_ctx`` cells; otherwise ``n_parallel``
  streams of ``pad(n_ctx / n_parallel, 256)`` cells (llama-context.cpp constructor).
- recurrent state (llama-memory-recurrent.cpp): per recurrent layer f32 rows of
  ``n_embd_r = (d_conv - 1) * (d_inner + 2 * n_group * d_state)`` and
  ``n_embd_s = d_state * d_inner`` (llama-hparams.cpp), ``max(1, n_parallel) * (1 + n_rs_seq)``
  rows; ``n_rs_seq`` is the draft length when MTP drafting keeps rollback snapshots
  (common.h need_n_rs_seq).
- compute buffer: see ``compute_buffer_bytes``.
"""

import bisect
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from llamarig.model.gguf import GgufHeader, ggml_type, row_size

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

_BLOCK = re.compile(r"blk\.(\d+)\.(.+)$")
_ATTENTION_SPLIT = re.compile(
    r"attn_(q|k|v|qkv)\.(weight|bias)|attn_output\.weight|attn_gate\.weight|attn_sinks\.weight"
)
_RECURRENT_SPLIT = re.compile(
    r"(attn_qkv|attn_gate|ssm_conv1d|ssm_out|ssm_ba|ssm_alpha|ssm_beta)\.weight|ssm_dt\.bias|ssm_a"
)
_FFN_SPLIT = re.compile(r"ffn_(up|gate|down|gate_up)(_exps|_shexp)?\.weight")


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


@dataclass(frozen=True)
class Device:
    """A GPU as the planner sees it.

    ``reserve_mib`` is what the model cannot see: the CUDA context, cuBLAS and NCCL workspaces,
    a display (``default_reserve_mib`` gives the measured values).
    """

    name: str
    vram_mib: int
    reserve_mib: int = 0


@dataclass(frozen=True)
class DevicePlan:
    name: str
    vram_mib: int
    reserve_mib: int
    weights_mib: int
    kv_mib: int
    state_mib: int  # recurrent state (delta-net / SSM layers)
    compute_mib: int
    planned_mib: int
    margin_mib: int

    @property
    def need_mib(self) -> int:
        return self.planned_mib + self.margin_mib

    @property
    def fits(self) -> bool:
        return self.need_mib <= self.vram_mib

    @property
    def fill(self) -> float:
        usable = self.vram_mib - self.margin_mib
        return self.planned_mib / usable if usable > 0 else math.inf


@dataclass(frozen=True, kw_only=True)
class ServerSettings:
    """The llama-server settings a plan is made for (-sm, -c, -np, -kvu, -ctk, -ctv, -ub and
    --spec-draft-n-max)."""

    split_mode: SplitMode
    ctx: int
    n_parallel: int
    kv_unified: bool
    type_k: str
    type_v: str
    n_ubatch: int
    mtp_draft_n_max: int


@dataclass(frozen=True, kw_only=True)
class MemoryPlan(ServerSettings):
    devices: list[DevicePlan]
    ratio: tuple[float, ...]
    margin_mib: int
    host_weights_mib: int
    suggestions: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(d.fits for d in self.devices)

    def table(self) -> str:
        """Per-GPU MiB: what is planned, what it needs with the margin, what it has."""
        width = max([len("GPU"), *(len(d.name) for d in self.devices)]) + 2
        header = (
            f"{'GPU':<{width}}{'weights':>9}{'KV':>8}{'state':>7}{'compute':>9}{'reserve':>9}"
            f"{'planned':>9}{'need':>8}{'have':>8}{'deficit':>9}"
        )
        lines = [header]
        for d in self.devices:
            deficit = max(0, d.need_mib - d.vram_mib)
            lines.append(
                f"{d.name:<{width}}{d.weights_mib:>9}{d.kv_mib:>8}{d.state_mib:>7}"
                f"{d.compute_mib:>9}{d.reserve_mib:>9}{d.planned_mib:>9}{d.need_mib:>8}"
                f"{d.vram_mib:>8}{deficit:>9}"
            )
        return "\n".join(lines)


# --- model structure -------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layers:
    n_all: int  # blocks, MTP blocks included
    n_main: int  # blocks of the main pass
    recurrent: tuple[bool, ...]  # per block
    attention: tuple[bool, ...]  # per block: has a KV cache (in its own context)


def _layers(header: GgufHeader) -> _Layers:
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
    return _Layers(n_all, n_main, recurrent, attention)


def kv_cells(ctx: int, n_parallel: int, kv_unified: bool) -> tuple[int, int]:
    """(cells per stream, streams) as llama-context.cpp sizes the KV cache."""
    n_ctx = -(-ctx // CTX_PAD) * CTX_PAD
    if kv_unified:
        return n_ctx, 1
    per_stream = -(-(n_ctx // n_parallel) // CTX_PAD) * CTX_PAD
    return per_stream, n_parallel


def _kv_layer_bytes(header: GgufHeader, layer: int, cells: int, type_k: str, type_v: str) -> int:
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
    layers = _layers(header)
    per_stream, n_stream = kv_cells(ctx, n_parallel, kv_unified)
    return sum(
        _kv_layer_bytes(header, il, per_stream * n_stream, type_k, type_v)
        for il in range(layers.n_main)
        if layers.attention[il]
    )


def _recurrent_row_bytes(header: GgufHeader) -> int:
    d_conv, d_inner = header.ssm_conv_kernel, header.ssm_inner_size
    d_state, n_group = header.ssm_state_size, header.ssm_group_count
    n_embd_r = max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state)
    n_embd_s = d_state * d_inner
    return (n_embd_r + n_embd_s) * F32_BYTES


# --- placement -------------------------------------------------------------------------------


def split_units(units: int, ratio: Sequence[float], rotation: int) -> list[int]:
    """Whole units per device, as llama_meta_device_get_split_state rounds a tensor-mode split.

    Split points are the cumulative ratio (rotated by ``rotation`` devices, so that rounding
    alternates between layers) rounded down; the last device in rotated order takes the rest.
    """
    n = len(ratio)
    rotated = [ratio[(j + rotation) % n] for j in range(n)]
    total = sum(rotated)
    shares = [0] * n
    low, cumulative = 0, 0.0
    for j in range(n - 1):
        cumulative += rotated[j]
        high = units * (j + 1) // n if total == 0 else int(units * cumulative / total)
        shares[(j + rotation) % n] = high - low
        low = high
    shares[(n - 1 + rotation) % n] = units - low
    return shares


def first_offloaded(n_layer_all: int, n_gpu_layers: int | None) -> int:
    """The first block on a GPU (load_tensors' i_gpu_start): `-ngl N` offloads the last N of
    the blocks and the output layer (block ``n_layer_all``); the ones before stay on the host.
    None: all of them (`-ngl all`)."""
    if n_gpu_layers is None:
        return 0
    return max(n_layer_all + 1 - n_gpu_layers, 0)


def layer_devices(
    n_layer_all: int, ratio: Sequence[float], n_gpu_layers: int | None = None
) -> list[int]:
    """Device of each block and, last, of the output layer in layer mode (load_tensors);
    ON_HOST for a block `-ngl` leaves on the host."""
    total = sum(ratio)
    splits, cumulative = [], 0.0
    for r in ratio:
        cumulative += r
        splits.append(cumulative / total)
    start = first_offloaded(n_layer_all, n_gpu_layers)
    n_offloaded = n_layer_all + 1 - start
    return [
        ON_HOST
        if il < start
        else min(bisect.bisect_right(splits, (il - start) / n_offloaded), len(ratio) - 1)
        for il in range(n_layer_all + 1)
    ]


class _Placement:
    """Bytes per device by kind, and the weights kept on the host."""

    def __init__(self, n_devices: int) -> None:
        self.weights = [0.0] * n_devices
        self.kv = [0.0] * n_devices
        self.state = [0.0] * n_devices
        self.compute = [0.0] * n_devices
        self.host_weights = 0


class _Placer:
    def __init__(
        self,
        header: GgufHeader,
        layers: _Layers,
        mode: SplitMode,
        ratio: Sequence[float],
        n_gpu_layers: int | None = None,
    ):
        self.header, self.layers, self.mode, self.ratio = header, layers, mode, list(ratio)
        self.n = len(ratio)
        self.gpu_start = first_offloaded(layers.n_all, n_gpu_layers)
        self.block_device = (
            layer_devices(layers.n_all, ratio, n_gpu_layers) if mode == "layer" else []
        )
        # get_il_eff: a block's rotation counts only earlier blocks of its own kind
        self.block_rotation = []
        seen = {True: 0, False: 0}
        for recurrent in layers.recurrent:
            self.block_rotation.append(seen[recurrent] % self.n)
            seen[recurrent] += 1

    def on_host(self, layer: int | None) -> bool:
        """Whether `-ngl` leaves block ``layer`` (None: the output layer) on the host."""
        return (self.layers.n_all if layer is None else layer) < self.gpu_start

    def rotation(self, layer: int | None) -> int:
        return self.layers.n_main % self.n if layer is None else self.block_rotation[layer]

    def place(self, target: list[float], n_bytes: int, layer: int | None, units: int) -> None:
        """Put ``n_bytes`` of block ``layer`` (None: the output layer) on the devices.

        ``units`` is how many whole slices tensor mode may cut it into; 0 mirrors it.
        """
        if self.mode == "none":
            target[0] += n_bytes
        elif self.mode == "layer":
            index = self.layers.n_all if layer is None else layer
            target[self.block_device[index]] += n_bytes
        elif units == 0:
            for d in range(self.n):
                target[d] += n_bytes
        else:
            for d, share in enumerate(split_units(units, self.ratio, self.rotation(layer))):
                target[d] += n_bytes * share / units


def _tensor_units(
    header: GgufHeader, layers: _Layers, name: str, shape: tuple[int, ...], type_id: int
) -> tuple[int | None, int]:
    """(block or None for the output layer, tensor-mode units; 0 = mirrored)."""
    match = _BLOCK.match(name)
    if match is None:
        return None, shape[1] if name == "output.weight" else 0
    layer, rest = int(match.group(1)), match.group(2)
    if layers.recurrent[layer] and _RECURRENT_SPLIT.fullmatch(rest):
        return layer, max(header.ssm_group_count, 1)
    if not layers.recurrent[layer] and _ATTENTION_SPLIT.fullmatch(rest):
        return layer, max(header.head_count_kv_at(layer), 1)
    ffn = _FFN_SPLIT.fullmatch(rest)
    if ffn:
        rows = shape[0] if ffn.group(1) == "down" else shape[1]
        if ffn.group(1) == "gate_up":
            rows //= 2
        granularity = math.lcm(ggml_type(type_id).block_size, TENSOR_SPLIT_FFN_BLOCK)
        return layer, max(rows // granularity, 1)
    return layer, 0


def _place_weights(placer: _Placer, placement: _Placement, mtp_loaded: bool) -> None:
    header, layers = placer.header, placer.layers
    tied = header.tensor("output.weight") is None
    for t in header.tensors:
        if t.name == "token_embd.weight":
            placement.host_weights += t.n_bytes
            if tied and placer.on_host(None):
                placement.host_weights += t.n_bytes
            elif tied:  # the output layer gets its own copy (TENSOR_DUPLICATED)
                placer.place(placement.weights, t.n_bytes, None, t.shape[1])
            continue
        layer, units = _tensor_units(header, layers, t.name, t.shape, t.ggml_type)
        if layer is not None and layer >= layers.n_main and not mtp_loaded:
            continue  # MTP blocks are skipped unless a draft-mtp context loads them
        if placer.on_host(layer):
            placement.host_weights += t.n_bytes
        else:
            placer.place(placement.weights, t.n_bytes, layer, units)


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


def _f16_copy_bytes_per_cell(
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


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Config(ServerSettings):
    draft_type_k: str = "f16"
    draft_type_v: str = "f16"
    n_gpu_layers: int | None = None  # None: every layer (-ngl all)


def _place_all(
    header: GgufHeader, layers: _Layers, cfg: _Config, ratio: Sequence[float]
) -> _Placement:
    n = len(ratio)
    placer = _Placer(header, layers, cfg.split_mode, ratio, cfg.n_gpu_layers)
    placement = _Placement(n)
    mtp = cfg.mtp_draft_n_max > 0 and layers.n_all > layers.n_main
    _place_weights(placer, placement, mtp)

    per_stream, n_stream = kv_cells(cfg.ctx, cfg.n_parallel, cfg.kv_unified)
    cells = per_stream * n_stream
    for il in range(layers.n_all):
        if not layers.attention[il] or (il >= layers.n_main and not mtp) or placer.on_host(il):
            continue  # a layer left on the host keeps its KV cache there (offload_kqv)
        # the MTP draft context keeps its cache in the draft types (-ctkd/-ctvd, default f16)
        kv_type = (
            (cfg.type_k, cfg.type_v) if il < layers.n_main else (cfg.draft_type_k, cfg.draft_type_v)
        )
        n_bytes = _kv_layer_bytes(header, il, cells, *kv_type)
        placer.place(placement.kv, n_bytes, il, header.head_count_kv_at(il))

    n_rs_seq = cfg.mtp_draft_n_max if header.architecture in RS_ROLLBACK_ARCHS else 0
    rows = max(1, cfg.n_parallel) * (1 + n_rs_seq)
    state_row = _recurrent_row_bytes(header)
    for il in range(layers.n_main):
        if layers.recurrent[il] and not placer.on_host(il):
            placer.place(placement.state, state_row * rows, il, max(header.ssm_group_count, 1))

    _place_compute(header, layers, cfg, placer, placement, per_stream, cells, mtp)
    return placement


def _place_compute(
    header: GgufHeader,
    layers: _Layers,
    cfg: _Config,
    placer: _Placer,
    placement: _Placement,
    per_stream: int,
    cells: int,
    mtp: bool,
) -> None:
    n = placer.n
    # llama-server caps the outputs of a batch at n_parallel * (1 + draft) (server_output_limits)
    n_outputs = min(cfg.n_ubatch, cfg.n_parallel * (1 + cfg.mtp_draft_n_max))
    common = dict(
        n_vocab=header.vocab_size,
        n_embd=header.embedding_length,
        n_ubatch=min(cfg.n_ubatch, cells),
        kv_cells_per_stream=per_stream,
        kv_cells_total=cells,
    )
    main_layers = [il for il in range(layers.n_main) if layers.attention[il]]
    mtp_layers = [il for il in range(layers.n_main, layers.n_all) if layers.attention[il]]
    contexts = [(main_layers, n_outputs, cfg.type_k, cfg.type_v)]
    if mtp:  # the draft context: same cells and ubatch, one output per sequence
        contexts.append((mtp_layers, cfg.n_parallel, cfg.draft_type_k, cfg.draft_type_v))
    for ctx_layers, outputs, type_k, type_v in contexts:
        if cfg.split_mode == "layer" and n > 1:
            output_device = placer.block_device[layers.n_all]
            for d in range(n):
                own = [il for il in ctx_layers if placer.block_device[il] == d]
                holds_output = d == output_device
                if not own and not holds_output:
                    continue
                placement.compute[d] += compute_buffer_bytes(
                    n_outputs=outputs,
                    kv_f16_copy_per_cell=_f16_copy_bytes_per_cell(header, own, type_k, type_v),
                    pipeline_copies=PIPELINE_COPIES,
                    holds_output=holds_output,
                    holds_attention=bool(own),
                    **common,
                )
        else:
            # tensor mode sizes every node of the graph at full size on each GPU
            # (ggml_backend_meta_buffer_type_get_alloc_size takes the max over devices)
            n_bytes = compute_buffer_bytes(
                n_outputs=outputs,
                kv_f16_copy_per_cell=_f16_copy_bytes_per_cell(header, ctx_layers, type_k, type_v),
                **common,
            )
            for d in range(n if cfg.split_mode == "tensor" else 1):
                placement.compute[d] += n_bytes


def _mib(n_bytes: float) -> int:
    return math.ceil(n_bytes / MIB)


def _device_plans(
    devices: Sequence[Device], placement: _Placement, margin_mib: int
) -> list[DevicePlan]:
    plans = []
    for d, dev in enumerate(devices):
        weights, kv = _mib(placement.weights[d]), _mib(placement.kv[d])
        state, compute = _mib(placement.state[d]), _mib(placement.compute[d])
        used = weights + kv + state + compute
        reserve = dev.reserve_mib if used else 0
        plans.append(
            DevicePlan(
                dev.name,
                dev.vram_mib,
                reserve,
                weights,
                kv,
                state,
                compute,
                used + reserve,
                margin_mib,
            )
        )
    return plans


def _evaluate(
    header: GgufHeader,
    layers: _Layers,
    cfg: _Config,
    devices: Sequence[Device],
    ratio: Sequence[float],
    margin_mib: int,
) -> list[DevicePlan]:
    return _device_plans(devices, _place_all(header, layers, cfg, ratio), margin_mib)


def _balanced_ratio(
    header: GgufHeader, layers: _Layers, cfg: _Config, devices: Sequence[Device], margin_mib: int
) -> tuple[float, ...]:
    """The ratio that gives every GPU the same fill (planned / (VRAM - margin)).

    Planned memory is about ``fixed_d + r_d * S`` per device (S: what follows the ratio). Each
    round solves equal fill for that line at the current plan; whole units and whole layers make
    it a staircase, so the round with the lowest worst fill wins. Each round is evaluated at the
    ratio as -ts gets it (SPLIT_DECIMALS), where llama.cpp draws its unit boundaries.
    """
    n = len(devices)
    usable = [max(dev.vram_mib - margin_mib, 1) for dev in devices]
    ratio = [u / sum(usable) for u in usable]
    best: tuple[float, list[float]] = (math.inf, [])
    for _ in range(12):
        rendered = [round(r, SPLIT_DECIMALS) for r in ratio]
        plans = _evaluate(header, layers, cfg, devices, rendered, margin_mib)
        worst = max(p.planned_mib / u for p, u in zip(plans, usable, strict=True))
        if worst < best[0]:
            best = (worst, rendered)
        planned = [p.planned_mib for p in plans]
        fixed = [
            p.reserve_mib + (p.compute_mib if cfg.split_mode == "tensor" else 0) for p in plans
        ]
        following = sum(planned) - sum(fixed)
        if following <= 0:
            break
        fill = sum(planned) / sum(usable)
        step = [max(ratio[d] + (fill * usable[d] - planned[d]) / following, 0.0) for d in range(n)]
        new = [r / sum(step) for r in step]
        if max(abs(a - b) for a, b in zip(new, ratio, strict=True)) < 1e-4:
            break
        ratio = new
    return tuple(best[1])


def _normalized(ratio: Sequence[float], n: int) -> tuple[float, ...]:
    if len(ratio) != n:
        raise ValueError(f"tensor_split has {len(ratio)} entries for {n} devices")
    if any(r < 0 for r in ratio) or sum(ratio) <= 0:
        raise ValueError(f"tensor_split {list(ratio)} must be non-negative with a positive sum")
    total = sum(ratio)
    return tuple(r / total for r in ratio)


def _validate(
    header: GgufHeader, split_mode: str, type_k: str, type_v: str, n_devices: int
) -> None:
    if split_mode == "row":
        raise ValueError(ROW_SPLIT_REFUSED)
    if split_mode not in ("none", "layer", "tensor"):
        raise ValueError(f"unknown split mode {split_mode!r}: none, layer or tensor")
    if n_devices < 1:
        raise ValueError("no devices to plan for")
    arch = header.architecture
    if split_mode == "tensor":
        if arch in TENSOR_SPLIT_UNSUPPORTED:
            raise ValueError(
                f"architecture {arch} cannot use -sm tensor at the pinned commit; use layer"
            )
    for label, type_name, head in (
        ("K", type_k, header.key_length),
        ("V", type_v, header.value_length),
    ):
        block = ggml_type(type_name).block_size
        if head % block:
            raise ValueError(
                f"{label} cache type {type_name} with block size {block} does not divide the "
                f"head size {head}: llama.cpp refuses to create the context"
            )


class _Planner:
    """Evaluates one model on one set of devices under variations of the settings."""

    def __init__(
        self, header: GgufHeader, devices: Sequence[Device], cfg: _Config, margin_mib: int
    ):
        self.header, self.devices, self.cfg, self.margin_mib = header, devices, cfg, margin_mib
        self.layers = _layers(header)
        self.max_ctx = header.context_length // CTX_PAD * CTX_PAD

    def solve(
        self,
        ctx: int,
        kv_type: tuple[str, str] | None = None,
        split: Sequence[float] | str = "auto",
    ) -> tuple[tuple[float, ...], list[DevicePlan]]:
        type_k, type_v = kv_type or (self.cfg.type_k, self.cfg.type_v)
        cfg = replace(self.cfg, ctx=ctx, type_k=type_k, type_v=type_v)
        n = len(self.devices)
        if cfg.split_mode == "none":
            ratio = tuple(1.0 if d == 0 else 0.0 for d in range(n))
        elif split == "auto":
            ratio = _balanced_ratio(self.header, self.layers, cfg, self.devices, self.margin_mib)
        else:
            ratio = _normalized(split, n)  # type: ignore[arg-type]
        return ratio, _evaluate(self.header, self.layers, cfg, self.devices, ratio, self.margin_mib)

    def fits(
        self,
        ctx: int,
        kv_type: tuple[str, str] | None = None,
        split: Sequence[float] | str = "auto",
    ) -> bool:
        return all(p.fits for p in self.solve(ctx, kv_type, split)[1])

    def largest_fitting_ctx(self, split: Sequence[float] | str) -> int | None:
        """Binary search over multiples of 256 (fit shrinks monotonically with the context)."""
        low, high = 0, self.max_ctx // CTX_PAD
        while low < high:
            mid = (low + high + 1) // 2
            if self.fits(mid * CTX_PAD, split=split):
                low = mid
            else:
                high = mid - 1
        return low * CTX_PAD if low else None

    def suggestions(
        self, ctx: int, split: Sequence[float] | str, plans: list[DevicePlan]
    ) -> list[str]:
        found = []
        best_ctx = self.largest_fitting_ctx(split)
        if best_ctx:
            found.append(f"-c {best_ctx} fits (the largest multiple of 256 with these settings)")
        current = _bytes_per_value(self.cfg.type_k) + _bytes_per_value(self.cfg.type_v)
        heads = (self.header.key_length, self.header.value_length)
        lighter = sorted(
            (
                t
                for t in FA_TYPE_PAIRS
                if 2 * _bytes_per_value(t) < current
                # llama.cpp refuses a KV type whose blocks do not divide the head size
                and not any(head % ggml_type(t).block_size for head in heads)
            ),
            key=_bytes_per_value,
            reverse=True,
        )
        for kv_type in lighter:
            if self.fits(ctx, (kv_type, kv_type), split):
                found.append(f"-ctk {kv_type} -ctv {kv_type} fits at -c {ctx}")
                break
        if self.cfg.split_mode != "none" and split != "auto":
            ratio, auto_plans = self.solve(ctx, split="auto")
            if all(p.fits for p in auto_plans):
                found.append(f"-ts {','.join(f'{r:.3f}' for r in ratio)} fits at -c {ctx}")
        if not found:
            short = sum(max(0, p.need_mib - p.vram_mib) for p in plans)
            found.append(
                f"nothing fits at -c {ctx} ({short} MiB short in all): a smaller quantization, "
                "more GPU memory or a shorter context is needed"
            )
        return found


def _bytes_per_value(type_name: str) -> float:
    t = ggml_type(type_name)
    return t.type_size / t.block_size


def plan_memory(
    header: GgufHeader,
    devices: Sequence[Device],
    split_mode: str = "tensor",
    tensor_split: Sequence[float] | Literal["auto"] = "auto",
    ctx: int | Literal["auto"] = "auto",
    n_parallel: int = 1,
    kv_unified: bool = True,
    type_k: str = "f16",
    type_v: str = "f16",
    n_ubatch: int = 512,
    margin_mib: int = 1024,
    *,
    mtp_draft_n_max: int = 0,
    draft_type_k: str = "f16",
    draft_type_v: str = "f16",
    n_gpu_layers: int | None = None,
) -> MemoryPlan:
    """Plan a llama-server's memory on ``devices`` (in the order llama.cpp numbers them).

    ``tensor_split="auto"`` balances fill across the GPUs; ``ctx="auto"`` takes the largest
    multiple of 256 that fits, up to the model's context length. ``mtp_draft_n_max`` > 0 plans
    ``--spec-type ...draft-mtp --spec-draft-n-max N``: the MTP blocks load, a draft context with
    its own KV cache (``draft_type_k/v``: ``-ctkd/-ctvd``, f16 unless given) and compute buffer
    is created, and hybrids keep N recurrent snapshots. ``n_gpu_layers`` (``-ngl N``; None:
    all) offloads only the last N blocks, the output layer counted: the others keep their
    weights, KV cache and state in host memory (the compute buffers are planned as for a full
    offload, an upper bound). Flash attention is assumed (tensor mode
    forces it; CUDA's auto picks it). A plan that does not fit carries suggestions.
    """
    header.check_shape()  # a corrupt header is a GgufError naming the file, not an IndexError
    type_k, type_v = type_k.lower(), type_v.lower()
    draft_type_k, draft_type_v = draft_type_k.lower(), draft_type_v.lower()
    _validate(header, split_mode, type_k, type_v, len(devices))
    if mtp_draft_n_max:
        _validate(header, split_mode, draft_type_k, draft_type_v, len(devices))
    if n_parallel < 1 or n_ubatch < 1:
        raise ValueError("n_parallel and n_ubatch must be at least 1")
    mode: SplitMode = split_mode  # type: ignore[assignment]
    cfg = _Config(
        split_mode=mode,
        ctx=0,
        n_parallel=n_parallel,
        kv_unified=kv_unified,
        type_k=type_k,
        type_v=type_v,
        n_ubatch=n_ubatch,
        mtp_draft_n_max=mtp_draft_n_max,
        draft_type_k=draft_type_k,
        draft_type_v=draft_type_v,
        n_gpu_layers=n_gpu_layers,
    )
    planner = _Planner(header, devices, cfg, margin_mib)

    if ctx == "auto":
        chosen_ctx = planner.largest_fitting_ctx(tensor_split) or CTX_PAD
    elif ctx < 1:
        raise ValueError(f"context {ctx} must be positive")
    else:
        chosen_ctx = ctx
    ratio, plans = planner.solve(chosen_ctx, split=tensor_split)
    chosen = replace(cfg, ctx=chosen_ctx)
    host = _place_all(header, planner.layers, chosen, ratio).host_weights
    fits = all(p.fits for p in plans)
    return MemoryPlan(
        **{setting.name: getattr(chosen, setting.name) for setting in fields(ServerSettings)},
        devices=plans,
        ratio=ratio,
        margin_mib=margin_mib,
        host_weights_mib=_mib(host),
        suggestions=[] if fits else planner.suggestions(chosen_ctx, tensor_split, plans),
    )
