"""Decode speed after a (re)start, against the last version that served: an upgrade of
llama.cpp or a config change that decodes markedly slower is rolled back like one that fails.

The speed is llama-server's own `timings.predicted_per_second` over a fixed greedy completion
of DECODE_TOKENS (end-of-sequence ignored, so every version decodes the same number), the best
of RUNS (other work on the host only ever slows a run down, so the best is the least disturbed),
kept as `decode-tps` beside the last-good copies of the unit with the model it was measured on:
another model is not compared (a larger one is meant to be slower). A version that looks slower
than the record is measured RUNS times more; if it still does, the last version is put back and
measured again, then the new one once more, so the verdict rests on speeds measured side by
side, not on a record taken at a quieter moment of the host, nor on one busy spell (on a shared
2-core machine the same build measured 15% apart, and six runs in a row 14% slow)."""

from __future__ import annotations

import json
import shlex

from llamarig.render import CURL_AUTH

DECODE_TOKENS = 200
RUNS = 3
PROMPT = "Write a long story about a llama who travels the world."
SPEED_FILE = "decode-tps"


def decode_command(base_url: str) -> str:
    """One greedy completion of DECODE_TOKENS; prints the reply (key: the root-only header)."""
    body = {
        "prompt": PROMPT,
        "n_predict": DECODE_TOKENS,
        "temperature": 0,
        "seed": 42,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    return (
        f"printf '%s' {shlex.quote(json.dumps(body))} | curl -sS -f --max-time 600 {CURL_AUTH} "
        f"-H 'Content-Type: application/json' --data-binary @- "
        f"-- {shlex.quote(base_url + '/completion')}"
    )


def decode_speed(replies: list[str]) -> float:
    """The best tokens/s of the replies (ValueError when one has no timings)."""
    speeds = []
    for reply in replies:
        try:
            speeds.append(float(json.loads(reply)["timings"]["predicted_per_second"]))
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"no decode timings in the reply: {reply[:200]!r}") from error
    return max(speeds)


def recorded_speed(lines: list[str], model: str) -> float | None:
    """The last good version's speed from the `decode-tps` file's lines (speed, model), or
    None when there is none for ``model``."""
    if len(lines) < 2 or lines[1] != model:
        return None
    try:
        return float(lines[0]) or None
    except ValueError:
        return None


def slowdown(speed: float, last: float | None, max_slowdown: float) -> str | None:
    """Why ``speed`` is refused against the last good version's ``last``, or None."""
    if not last or speed >= last * (1 - max_slowdown):
        return None
    return (
        f"decodes at {speed:.1f} tokens/s, {1 - speed / last:.0%} slower than the last version "
        f"that served ({last:.1f} tokens/s; server.max_slowdown is {max_slowdown:.0%})"
    )


def slowdown_side_by_side(
    speed: float, then: float, recorded: float | None, max_slowdown: float
) -> str | None:
    """Why ``speed`` is refused against the last good version measured again just after it
    (``then``; ``recorded``: what its record said), or None."""
    if speed >= then * (1 - max_slowdown):
        return None
    measured = f"{then:.1f} tokens/s measured between two looks at it" + (
        f", {recorded:.1f} recorded" if recorded else ""
    )
    return (
        f"decodes at {speed:.1f} tokens/s, {1 - speed / then:.0%} slower than the last version "
        f"that served ({measured}; server.max_slowdown is {max_slowdown:.0%})"
    )
