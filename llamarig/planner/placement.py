"""Where llama-server at the pinned commit puts a model's buffers, per device, in bytes.

Pure: it reads a GGUF header (llamarig.model.gguf) and the settings, nothing else; memory.py
plans with it. Source lines named below are in the pinned llama.cpp tree (GUIDE §1).

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
from dataclasses import dataclass
from typing import Literal

from llamarig.model.gguf import GgufHeader, ggml_type, row_size

SplitMode = Literal["none", "layer", "tensor"]

ON_HOST = -1  # layer_devices' device of a block that `-ngl` leaves on the host
CTX_PAD = 256  # GGML_PAD(n_ctx, 256) in llama-context.cpp
PIPELINE_COPIES = 4  # GGML_SCHED_MAX_COPIES, used when layer mode spans several GPUs
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
class PlacementSettings(ServerSettings):
    """The settings placed: those a plan reports and those it only obeys (the draft context's
    KV types, -ctkd/-ctvd, and -ngl)."""

    draft_type_k: str = "f16"
    draft_type_v: str = "f16"
    n_gpu_layers: int | None = None  # None: every layer (-ngl all)


# --- model structure -------------------------------------------------------------------------


@dataclass(frozen=True)
class Layers:
    n_all: int  # blocks, MTP blocks included
    n_main: int  # blocks of the main pass
    recurrent: tuple[bool, ...]  # per block
    attention: tuple[bool, ...]  # per block: has a KV cache (in its own context)


def model_layers(header: GgufHeader) -> Layers:
    """Which blocks keep a KV cache and which a recurrent state; ValueError for an
    architecture the model does not cover."""
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
    layers = model_layers(header)
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


class Placement:
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
        layers: Layers,
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
    header: GgufHeader, layers: Layers, name: str, shape: tuple[int, ...], type_id: int
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


def _place_weights(placer: _Placer, placement: Placement, mtp_loaded: bool) -> None:
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


# --- every buffer ----------------------------------------------------------------------------


def place(
    header: GgufHeader, layers: Layers, cfg: PlacementSettings, ratio: Sequence[float]
) -> Placement:
    """Every buffer of the model under ``cfg`` on the devices ``ratio`` splits it over: the
    weights, the KV caches, the recurrent state and the compute buffers."""
    n = len(ratio)
    placer = _Placer(header, layers, cfg.split_mode, ratio, cfg.n_gpu_layers)
    placement = Placement(n)
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
    layers: Layers,
    cfg: PlacementSettings,
    placer: _Placer,
    placement: Placement,
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
