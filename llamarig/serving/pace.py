"""Decode speed after a (re)start, against the last version that served: an upgrade of
llama.cpp or a config change that decodes markedly slower is rolled back like one that fails.

The speed is llama-server's own `timings.predicted_per_second` over a fixed greedy completion
of DECODE_TOKENS (end-of-sequence ignored, so every version decodes the same number), the best
of RUNS (other work on the host only ever slows a run down, so the best is the least disturbed),
kept as `decode-tps` beside the last-good copies of the unit with the model it was measured on:
another model is not compared (a larger one is meant to be slower). A version that looks slower
than the record is measured RUNS times more; if it still does, the last version is put back and
the two are measured in turns, side by side (SideBySide), so the verdict rests on speeds
measured under the same conditions and is refused only where the difference is larger than the
spread of the looks: on a shared 2-core machine the same build measured 15% apart, six runs in
a row 14% slow, and up to 20-fold slower while another process was busy."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field

from llamarig.onhost.hostpaths import CURL_AUTH
from llamarig.onhost.httpbounds import HttpTimeouts

DECODE_TOKENS = 200
RUNS = 3
# Looks at each version, side by side: at least MIN_ROUNDS before the new one is kept (one
# look at the last version may be a disturbed one), ROUNDS before it is refused.
MIN_ROUNDS = 2
ROUNDS = 4
PROMPT = "Write a long story about a llama who travels the world."
SPEED_FILE = "decode-tps"


def decode_command(base_url: str, timeouts: HttpTimeouts, model: str | None = None) -> str:
    """One greedy completion of DECODE_TOKENS (of ``model``, on a router), bounded by
    ``timeouts``' generation bound; prints the reply (key: the root-only header)."""
    body = {
        **({"model": model} if model else {}),
        "prompt": PROMPT,
        "n_predict": DECODE_TOKENS,
        "temperature": 0,
        "seed": 42,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    return (
        f"printf '%s' {shlex.quote(json.dumps(body))} | "
        f"curl -sS -f {timeouts.options('generation')} {CURL_AUTH} "
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


def spread(speeds: list[float]) -> float:
    """How far a typical look falls below the best one: 1 - median / best (0 when they agree;
    load on the host widens it)."""
    ordered = sorted(speeds)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return 1 - median / ordered[-1]


@dataclass
class SideBySide:
    """Looks at the new and the last version taken in turns (new, then last and new, ...),
    each the best of RUNS completions, and the verdict they support.

    Load on the host only slows a look down, and it comes and goes, so a version's best look is
    its speed and the spread of its looks (``spread``) is what load did to it. After at least
    MIN_ROUNDS looks at each, the new version is kept as soon as its best reaches the last
    one's best within ``max_slowdown``. It is refused only after ROUNDS looks at each, when its
    best is slower than the last one's by more than ``max_slowdown`` plus both spreads: on a
    quiet host that is max_slowdown and a few percent, while a host busy enough to spread the
    looks widely refuses nothing (too spread to call it slower: kept, and said so). One look
    disturbed out of ROUNDS moves neither best nor median."""

    max_slowdown: float
    new: list[float] = field(default_factory=list)
    last: list[float] = field(default_factory=list)

    def kept(self) -> bool:
        return len(self.last) >= MIN_ROUNDS and max(self.new) >= max(self.last) * (
            1 - self.max_slowdown
        )

    def done(self) -> bool:
        return self.kept() or len(self.last) >= ROUNDS

    def refusal_bound(self) -> float:
        """The share by which the new version's best must fall below the last one's best to
        be refused: max_slowdown plus the spread of each version's looks."""
        return self.max_slowdown + spread(self.new) + spread(self.last)

    def refused(self) -> bool:
        return (
            len(self.last) >= ROUNDS
            and not self.kept()
            and max(self.new) < max(self.last) * (1 - self.refusal_bound())
        )

    def looks(self) -> str:
        """How many looks at each, their range and spread."""
        return (
            "; ".join(
                f"{len(speeds)} look{'s' if len(speeds) > 1 else ''} at the {which} version, "
                f"{min(speeds):.1f}-{max(speeds):.1f} tokens/s, spread {spread(speeds):.0%}"
                for which, speeds in (("new", self.new), ("last", self.last))
            )
            + f"; each look the best of {RUNS} completions"
        )

    def verdict(self, recorded: float | None) -> str:
        """The verdict in words, once ``done()``."""
        best_new, best_last = max(self.new), max(self.last)
        slower = (
            f"{1 - best_new / best_last:.0%} slower than the last version's best, {best_last:.1f}"
        )
        if self.kept():
            return (
                f"decodes at {best_new:.1f} tokens/s at best, within server.max_slowdown of the "
                f"last version's best, {best_last:.1f}, side by side ({self.looks()}): it stays"
            )
        record = f", {recorded:.1f} recorded" if recorded else ""
        bound = (
            f"server.max_slowdown {self.max_slowdown:.0%} plus the looks' spread: "
            f"{self.refusal_bound():.0%}"
        )
        if self.refused():
            return (
                f"decodes at {best_new:.1f} tokens/s at best, {slower} tokens/s{record}, side by "
                f"side: more than {bound} ({self.looks()})"
            )
        return (
            f"decodes at {best_new:.1f} tokens/s at best, {slower} tokens/s{record}, side by "
            f"side: within {bound}, the host too busy to call it slower ({self.looks()}): it "
            "stays"
        )


@dataclass
class Versions:
    """What `keep_pace` does to the host, as the serving operation gives it: measure the
    version serving now (the best of RUNS completions, or ``best`` when higher; None when a
    reply had no timings), stash the new version beside the last one, switch to one of them
    (``"last"`` or ``"new"``: drain, switch, wait until it serves; False when it does not),
    roll back to the last version, and say a line (``error`` for a refusal)."""

    measure: Callable[[float], float | None]
    stash_new: Callable[[], bool]
    switch_to: Callable[[str], bool]
    roll_back: Callable[[], None]
    say: Callable[[str], None]
    error: Callable[[str], None]


def keep_pace(
    versions: Versions, last: float | None, max_slowdown: float, service: str
) -> float | None:
    """The new version's decode speed if it keeps pace with the last version that served
    (``last``: its recorded speed, None when there is none for this model), else None: it
    was rolled back (or could not be measured), and said why.

    A look slower than the record is looked at again; if still slower, the two versions are
    measured in turns (SideBySide) and the verdict rests on those looks, not on the record."""
    speed = versions.measure(0.0)
    if speed is not None and slowdown(speed, last, max_slowdown):
        speed = versions.measure(speed)  # a second look before a rollback
    if speed is None:
        return None
    against_record = slowdown(speed, last, max_slowdown)
    if against_record:
        # The record may come from a quieter moment of the host: the two versions are measured
        # in turns now, so the verdict rests on speeds measured side by side.
        versions.say(
            f"the new version {against_record}; measuring the last version that served again, "
            f"side by side, in turns with the new one (up to {ROUNDS} looks at each)"
        )
        if not versions.stash_new():
            return None
        looks = SideBySide(max_slowdown, new=[speed])
        while not looks.done():
            for version, speeds in (("last", looks.last), ("new", looks.new)):
                if not versions.switch_to(version):
                    return None
                look = versions.measure(0.0)
                if look is None:
                    versions.roll_back()
                    return None
                speeds.append(look)
            versions.say(
                f"look {len(looks.last)}: the last version decodes at {looks.last[-1]:.1f} "
                f"tokens/s, the new one at {looks.new[-1]:.1f}"
            )
        if looks.refused():
            versions.error(f"the new version of {service} {looks.verdict(last)}")
            versions.roll_back()
            return None
        versions.say(f"the new version {looks.verdict(last)}")
        speed = max(looks.new)
    versions.say(f"decodes at {speed:.1f} tokens/s" + (f" (last good {last:.1f})" if last else ""))
    return speed
