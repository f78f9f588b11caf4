"""`llamarig tune` with speculative decoding (``server.spec``): each draft length served by a
temporary llama-server of the deployed build (throughput.py starts it; llama-bench does not
draft) and asked the same short prompts, greedy; the median decode speed of the prompts is the
draft length's. The planned draft length stays unless clearly beaten.
"""

from __future__ import annotations

import json
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from llamarig.onhost import hostpaths
from llamarig.planner import render
from llamarig.serving.choice import kept_or_best, table_row, tuned_note
from llamarig.serving.throughput import TIME_BOUND_NOTE, Run, starter, temporary_server

DRAFT_MAX_VALUES = (1, 2, 3, 4)
DRAFT_TOKENS = 128
DRAFT_PROMPTS = (
    "List the numbers from 1 to 40, separated by commas.",
    "Write a Python function that returns the sum of a list of integers, with a docstring.",
    "Repeat this sentence five times: the quick brown fox jumps over the lazy dog.",
)
# A draft length must serve faster than the planned one by more than this to replace it (the
# margin of llama-bench's decode sweep, tune.KEEP_WITHIN).
KEEP_WITHIN = 0.02


@dataclass
class DraftMeasured:
    draft_max: int
    tps: float | None = None  # the median of the prompts' decode speeds
    low: float | None = None  # the slowest and fastest prompt
    high: float | None = None
    skipped: str = ""


def draft_server_data(data: dict, draft_max: int) -> dict:
    """The temporary server of ``data`` (the rig with the tuned settings) with ``draft_max``."""
    served = temporary_server(data)
    served["server"]["spec"] = {**served["server"]["spec"], "draft_max": draft_max}
    return served


def draft_request_command(data: dict, prompt: str) -> str:
    """One greedy completion of exactly DRAFT_TOKENS tokens (past an end-of-text token, so a
    short answer does not count as a speed; no prompt cache between the runs)."""
    body = json.dumps(
        {
            "prompt": prompt,
            "n_predict": DRAFT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        }
    )
    url = shlex.quote(f"{render.base_url(data)}/completion")
    return (
        f"curl -sS -f -m 300 {hostpaths.CURL_AUTH} -H 'Content-Type: application/json' "
        f"--data-binary {shlex.quote(body)} -- {url}"
    )


def _served_speeds(data: dict, run: Run) -> list[float]:
    """Start one temporary server, decode DRAFT_PROMPTS, stop it; raises ValueError."""
    start, stop = starter(run)
    pid = start(data)
    try:
        speeds = []
        for prompt in DRAFT_PROMPTS:
            status, output, error = run(draft_request_command(data, prompt), 360)
            if status:
                raise ValueError(error.strip() or "the completion failed")
            timings = json.loads(output)["timings"]
            if timings["predicted_n"] != DRAFT_TOKENS:
                raise ValueError(f"decoded {timings['predicted_n']} of {DRAFT_TOKENS} tokens")
            speeds.append(float(timings["predicted_per_second"]))
        return speeds
    finally:
        stop(pid)


def draft_sweep(
    data: dict,
    label: str,
    run: Run,
    saved: dict,
    save: Callable[[dict], None],
    deadline: float,
    say: Callable[[str], None],
) -> list[DraftMeasured]:
    """Serve ``data`` (the rig with the chosen settings, ``label``) with each draft length in
    DRAFT_MAX_VALUES until ``deadline``, reusing what ``saved`` holds (the sweep file's
    results) and handing each new result to ``save``."""
    results = []
    for draft_max in DRAFT_MAX_VALUES:
        result = DraftMeasured(draft_max)
        results.append(result)
        name = f"{label}, draft_max {draft_max}"
        if isinstance(saved.get(name), list):
            result.tps, result.low, result.high = saved[name]
            say(f"  {name}: {result.tps:.1f} t/s served (measured before)")
            continue
        if time.monotonic() > deadline:
            result.skipped = TIME_BOUND_NOTE
            continue
        say(f"  {name}: measuring through llama-server")
        try:
            speeds = _served_speeds(draft_server_data(data, draft_max), run)
        except (ValueError, KeyError) as problem:
            result.skipped = f"llama-server failed: {problem}"
            continue
        result.tps = statistics.median(speeds)
        result.low, result.high = min(speeds), max(speeds)
        saved[name] = [result.tps, result.low, result.high]
        save(saved)
    return results


def draft_winner(results: list[DraftMeasured], planned: int | None) -> DraftMeasured | None:
    """The fastest draft length; the planned one while within KEEP_WITHIN of it; None when
    none was measured."""
    measured = [r for r in results if r.tps]
    if not measured:
        return None
    return kept_or_best(
        measured, lambda r: r.tps, lambda r: r.draft_max == planned, keep_within=KEEP_WITHIN
    )


def draft_table(results: list[DraftMeasured], chosen: DraftMeasured | None, types: str) -> str:
    """Each draft length's served decode speed and its range over the prompts, the one tuned
    marked."""
    lines = [
        f"served decode with --spec-type {types} ({len(DRAFT_PROMPTS)} prompts, "
        f"{DRAFT_TOKENS} tokens, greedy; median and range):",
        f"{'draft_max':<32}{'decode t/s':>11}{'range':>19}  note",
    ]
    for result in results:
        cells = f"{result.tps:>11.1f}{f'{result.low:.1f}-{result.high:.1f}':>19}"
        note = tuned_note(result.skipped, result is chosen)
        blank = f"{'-':>11}{'':>19}"
        lines.append(table_row(result.draft_max, cells if result.tps else None, blank, note))
    return "\n".join(lines)
