"""The planner's memory model: what llama-server at the pinned commit allocates per GPU, and
the plan that fits a model on the GPUs (the split ratio balanced, the largest context that fits,
what would fit when nothing does).

Pure: it reads a GGUF header (llamarig.model.gguf) and a device list, nothing else. What each
buffer weighs and on which device llama.cpp puts it is placement.py's; this module adds what
the model cannot see (a reserve per GPU, a margin) and searches the settings.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Literal

from llamarig.model.gguf import GgufHeader, ggml_type
from llamarig.planner.placement import (
    CTX_PAD,
    Layers,
    Placement,
    PlacementSettings,
    ServerSettings,
    SplitMode,
    model_layers,
    place,
)

MIB = 1 << 20
# Decimals of a planned tensor split, as -ts gets it: the plan is evaluated at exactly the
# ratio llama.cpp receives (a rounding can move a whole KV head from one GPU to the other).
SPLIT_DECIMALS = 3
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
    cfg: PlacementSettings,
    devices: Sequence[Device],
    ratio: Sequence[float],
    margin_mib: int,
) -> list[DevicePlan]:
    return _device_plans(devices, place(header, layers, cfg, ratio), margin_mib)


def _balanced_ratio(
    header: GgufHeader,
    layers: Layers,
    cfg: PlacementSettings,
    devices: Sequence[Device],
    margin_mib: int,
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
        self, header: GgufHeader, devices: Sequence[Device], cfg: PlacementSettings, margin_mib: int
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
    cfg = PlacementSettings(
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
    host = place(header, planner.layers, chosen, ratio).host_weights
    fits = all(p.fits for p in plans)
    return MemoryPlan(
        **{setting.name: getattr(chosen, setting.name) for setting in fields(ServerSettings)},
        devices=plans,
        ratio=ratio,
        margin_mib=margin_mib,
        host_weights_mib=_mib(host),
        suggestions=[] if fits else planner.suggestions(chosen_ctx, tensor_split, plans),
    )
