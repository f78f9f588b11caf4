"""The planner's memory model: what llama-server at the pinned commit allocates per GPU.

Pure: it reads a GGUF header (llamarig.gguf_header) and a device list, nothing else. Source lines
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

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from llamarig.gguf_header import GgufHeader, ggml_type
from llamarig.memory.placement import Placement, Placer, place_weights
from llamarig.memory.sizes import (
    CTX_PAD,
    FA_TYPE_PAIRS,
    MIB,
    PIPELINE_COPIES,
    ROW_SPLIT_REFUSED,
    RS_ROLLBACK_ARCHS,
    SPLIT_DECIMALS,
    TENSOR_SPLIT_UNSUPPORTED,
    Layers,
    SplitMode,
    compute_buffer_bytes,
    f16_copy_bytes_per_cell,
    kv_cells,
    kv_layer_bytes,
    model_layers,
    recurrent_row_bytes,
)


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


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Config(ServerSettings):
    draft_type_k: str = "f16"
    draft_type_v: str = "f16"
    n_gpu_layers: int | None = None  # None: every layer (-ngl all)


def _place_all(
    header: GgufHeader, layers: Layers, cfg: _Config, ratio: Sequence[float]
) -> Placement:
    n = len(ratio)
    placer = Placer(header, layers, cfg.split_mode, ratio, cfg.n_gpu_layers)
    placement = Placement(n)
    mtp = cfg.mtp_draft_n_max > 0 and layers.n_all > layers.n_main
    place_weights(placer, placement, mtp)

    per_stream, n_stream = kv_cells(cfg.ctx, cfg.n_parallel, cfg.kv_unified)
    cells = per_stream * n_stream
    for il in range(layers.n_all):
        if not layers.attention[il] or (il >= layers.n_main and not mtp) or placer.on_host(il):
            continue  # a layer left on the host keeps its KV cache there (offload_kqv)
        # the MTP draft context keeps its cache in the draft types (-ctkd/-ctvd, default f16)
        kv_type = (
            (cfg.type_k, cfg.type_v) if il < layers.n_main else (cfg.draft_type_k, cfg.draft_type_v)
        )
        n_bytes = kv_layer_bytes(header, il, cells, *kv_type)
        placer.place(placement.kv, n_bytes, il, header.head_count_kv_at(il))

    n_rs_seq = cfg.mtp_draft_n_max if header.architecture in RS_ROLLBACK_ARCHS else 0
    rows = max(1, cfg.n_parallel) * (1 + n_rs_seq)
    state_row = recurrent_row_bytes(header)
    for il in range(layers.n_main):
        if layers.recurrent[il] and not placer.on_host(il):
            placer.place(placement.state, state_row * rows, il, max(header.ssm_group_count, 1))

    _place_compute(header, layers, cfg, placer, placement, per_stream, cells, mtp)
    return placement


def _place_compute(
    header: GgufHeader,
    layers: Layers,
    cfg: _Config,
    placer: Placer,
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
                    kv_f16_copy_per_cell=f16_copy_bytes_per_cell(header, own, type_k, type_v),
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
                kv_f16_copy_per_cell=f16_copy_bytes_per_cell(header, ctx_layers, type_k, type_v),
                **common,
            )
            for d in range(n if cfg.split_mode == "tensor" else 1):
                placement.compute[d] += n_bytes


def _mib(n_bytes: float) -> int:
    return math.ceil(n_bytes / MIB)


def _device_plans(
    devices: Sequence[Device], placement: Placement, margin_mib: int
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
    layers: Layers,
    cfg: _Config,
    devices: Sequence[Device],
    ratio: Sequence[float],
    margin_mib: int,
) -> list[DevicePlan]:
    return _device_plans(devices, _place_all(header, layers, cfg, ratio), margin_mib)


def _balanced_ratio(
    header: GgufHeader, layers: Layers, cfg: _Config, devices: Sequence[Device], margin_mib: int
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
        self.layers = model_layers(header)
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
