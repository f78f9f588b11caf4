"""What `llamarig tune`'s decode sweep measures: the configurations worth measuring on a rig
(split modes, the planned ratio and its neighbours, micro-batch sizes, threads), the llama-bench
command line of each (a decode of DECODE_TOKENS and a prompt of PROMPT_TOKENS, REPETITIONS
times) and what llama-bench prints.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from llamarig.planner import render
from llamarig.planner.host_plan import HostPlan

UBATCH_SIZES = (256, 512, 1024)
RATIO_STEP = 0.05
DECODE_TOKENS = 64
PROMPT_TOKENS = 512
REPETITIONS = 3


@dataclass(frozen=True)
class Candidate:
    split_mode: str
    tensor_split: tuple[float, ...] | None
    ubatch: int
    threads: int | None

    @property
    def label(self) -> str:
        parts = [self.split_mode]
        if self.tensor_split:
            parts.append(":".join(f"{share:g}" for share in self.tensor_split))
        parts.append(f"ub {self.ubatch}")
        if self.threads:
            parts.append(f"t {self.threads}")
        return " ".join(parts)

    def settings(self) -> dict:
        """The server settings this candidate stands for, as the tuned file writes them."""
        return {
            "split_mode": self.split_mode,
            "tensor_split": list(self.tensor_split) if self.tensor_split else None,
            "ubatch": self.ubatch,
            "threads": self.threads,
        }


def planned_candidate(plan: HostPlan) -> Candidate:
    server = plan.resolved["server"]
    split = server["tensor_split"]
    return Candidate(
        server["split_mode"],
        tuple(round(share, 3) for share in split) if isinstance(split, list) else None,
        server["ubatch"],
        server["threads"],
    )


def _neighbour_ratios(ratio: tuple[float, ...]) -> list[tuple[float, ...]]:
    """The ratio and, for two GPUs, a step to either side (shares of the first card)."""
    if len(ratio) != 2:
        return [ratio]
    first = ratio[0]
    shares = [first - RATIO_STEP, first, first + RATIO_STEP]
    return [(round(s, 3), round(1 - s, 3)) for s in shares if 0 < s < 1]


def candidates(plan: HostPlan, cpu_count: int) -> list[Candidate]:
    """The configurations worth measuring on this rig, the planned one first."""
    data = plan.resolved
    server = data["server"]
    planned = planned_candidate(plan)
    ubatches = sorted({u for u in (*UBATCH_SIZES, server["ubatch"]) if u <= server["batch"]})
    found = [planned]
    if data["llama_cpp"]["backend"] != "cuda":
        threads = sorted({t for t in (cpu_count // 2, cpu_count, server["threads"]) if t})
        found += [Candidate("none", None, u, t) for t in threads for u in ubatches]
    else:
        ratio = planned.tensor_split or (
            tuple(round(s, 3) for s in plan.memory.ratio) if plan.memory else None
        )
        if len(plan.used_gpus) >= 2 and ratio:
            splits = [(mode, r) for mode in ("tensor", "layer") for r in _neighbour_ratios(ratio)]
        else:
            splits = [(planned.split_mode, planned.tensor_split)]
        found += [Candidate(m, r, u, planned.threads) for m, r in splits for u in ubatches]
    return list(dict.fromkeys(found))


def with_candidate(data: dict, candidate: Candidate) -> dict:
    changed = copy.deepcopy(data)
    changed["server"].update(candidate.settings())
    return changed


def bench_command(plan: HostPlan, candidate: Candidate) -> str:
    """The llama-bench command line for one candidate (decode only, JSON on stdout)."""
    data = with_candidate(plan.resolved, candidate)
    server = data["server"]
    paths = render.layout(data)
    flash_attn = "on" if candidate.split_mode == "tensor" else server["flash_attn"]
    args = [
        f"{paths['current']}/bin/llama-bench",
        "-m",
        paths["model"],
        "-p",
        str(PROMPT_TOKENS),
        "-n",
        str(DECODE_TOKENS),
        "-r",
        str(REPETITIONS),
        "-o",
        "json",
        "-b",
        str(server["batch"]),
        "-ub",
        str(candidate.ubatch),
        "-ctk",
        server["cache_type_k"],
        "-ctv",
        server["cache_type_v"],
        "-fa",
        flash_attn,
    ]
    if data["llama_cpp"]["backend"] == "cuda":
        layers = server["gpu_layers"]
        devices = render.cuda_device_names(data["gpus"])[: len(plan.used_gpus) or 1]
        args += ["-ngl", str(layers if isinstance(layers, int) else 999), "-sm"]
        args.append(candidate.split_mode)
        if candidate.split_mode == "none":
            devices = devices[:1]
        args += ["-dev", "/".join(devices)]
        if candidate.tensor_split and candidate.split_mode != "none":
            args += ["-ts", "/".join(f"{share:g}" for share in candidate.tensor_split)]
    if candidate.threads:
        args += ["-t", str(candidate.threads)]
    return render.shell_join(args)


def bench_speeds(output: str) -> tuple[float, float, float]:
    """Decode tokens/s, its spread and prompt tokens/s from llama-bench's JSON output."""
    rows = json.loads(output)
    decode = [row for row in rows if row.get("n_gen")]
    prompt = [row for row in rows if row.get("n_prompt") and not row.get("n_gen")]
    if not decode or not prompt:
        raise ValueError("llama-bench printed no decode and prompt results")
    return float(decode[0]["avg_ts"]), float(decode[0]["stddev_ts"]), float(prompt[0]["avg_ts"])


@dataclass
class Measured:
    candidate: Candidate
    tps: float | None = None  # decode
    spread: float | None = None
    prompt_tps: float | None = None
    skipped: str = ""  # why it was not measured: does not fit, failed, time bound
