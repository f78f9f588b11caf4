"""The decode-speed check after a (re)start (`llamarig.pace`): the speed from llama-server's
replies, the verdict against the last good version, and the request the host sends.
tests/test_sandbox_slowdown.py shows the rollback on the sandbox."""

from __future__ import annotations

import json
import shlex

import pytest

from llamarig import pace


def _reply(tps: float) -> str:
    return json.dumps({"content": "...", "timings": {"predicted_per_second": tps}})


def test_the_speed_is_the_best_of_the_runs():
    """Other work on the host only slows a run down: the best run is the least disturbed."""
    assert pace.decode_speed([_reply(48.5), _reply(10.0), _reply(50.0)]) == 50.0
    with pytest.raises(ValueError, match="no decode timings"):
        pace.decode_speed([_reply(50.0), "curl: (7) Failed to connect"])


@pytest.mark.parametrize(
    ("speed", "last", "refused"),
    [(100.0, None, False), (91.0, 100.0, False), (90.0, 100.0, False), (89.9, 100.0, True),
     (40.0, 120.0, True), (130.0, 100.0, False)],
)  # fmt: skip
def test_a_version_more_than_max_slowdown_slower_is_refused(speed, last, refused):
    why = pace.slowdown(speed, last, 0.1)
    assert bool(why) == refused
    if refused:
        assert f"{speed:.1f} tokens/s" in why and f"({last:.1f} tokens/s" in why
        assert "server.max_slowdown is 10%" in why


def test_the_request_is_greedy_fixed_length_and_keyless():
    command = pace.decode_command("http://127.0.0.1:8080")
    words = shlex.split(command.replace(pace.CURL_AUTH, "AUTH"))
    body = json.loads(words[words.index("printf") + 2])
    assert body["n_predict"] == pace.DECODE_TOKENS and body["ignore_eos"] is True
    assert body["temperature"] == 0 and body["cache_prompt"] is False
    assert words[-1] == "http://127.0.0.1:8080/completion" and words[-2] == "--"


def test_a_recorded_speed_counts_only_for_its_model():
    lines = ["87.5", "/opt/llamarig/models/m.gguf 0123"]
    assert pace.recorded_speed(lines, "/opt/llamarig/models/m.gguf 0123") == 87.5
    assert pace.recorded_speed(lines, "/opt/llamarig/models/bigger.gguf 4567") is None
    assert pace.recorded_speed([], "m") is None
    assert pace.recorded_speed(["fast", "m"], "m") is None


def looked(new: list[float], last: list[float], max_slowdown: float = 0.1) -> pace.SideBySide:
    """The looks in the order the deploy takes them: new first, then last and new in turns,
    stopping where the verdict is in."""
    looks = pace.SideBySide(max_slowdown, new=[new[0]])
    for then, now in zip(last, new[1:], strict=True):
        assert not looks.done()
        looks.last.append(then)
        looks.new.append(now)
    assert looks.done()
    return looks


def test_the_spread_is_how_far_a_typical_look_falls_below_the_best():
    assert pace.spread([100.0, 100.0, 100.0]) == 0
    assert pace.spread([50.0, 100.0, 98.0, 96.0]) == pytest.approx(0.03)
    assert pace.spread([13.5, 107.0, 19.1]) == pytest.approx(1 - 19.1 / 107.0)


def test_an_equal_version_is_kept_once_the_last_one_was_looked_at_twice():
    """The record (500) came from a quieter moment; side by side the two are as fast. One look
    at the last version is not enough (it may be a disturbed one)."""
    looks = looked([60.0, 95.0, 99.0], [100.0, 104.0])
    assert looks.kept() and not looks.refused()
    why = looks.verdict(500.0)
    assert "99.0 tokens/s at best" in why and "best, 104.0" in why and why.endswith("it stays")
    assert "3 looks at the new version, 60.0-99.0 tokens/s, spread 4%" in why
    assert "2 looks at the last version, 100.0-104.0 tokens/s" in why


def test_a_busy_host_refuses_nothing():
    """What failed a CI run: every look disturbed by a build beside it, the new version's a
    little more; the looks spread far, so nothing is refused, and the message says why."""
    looks = looked([13.5, 13.0, 21.0, 12.0, 15.0], [19.1, 40.0, 14.0, 90.0])
    assert not looks.kept() and not looks.refused()
    why = looks.verdict(107.0)
    assert "77% slower than the last version's best, 90.0 tokens/s, 107.0 recorded" in why
    assert "the host too busy to call it slower" in why and why.endswith("it stays")


def test_a_halved_version_is_refused_though_one_look_at_the_last_was_disturbed():
    """Measured on the sandbox while other tests ran: the last version's first look at half its
    speed. Neither its best nor its median moves, so the halved version is refused."""
    looks = looked([72.1, 53.9, 75.0, 76.0, 74.0], [70.7, 140.0, 138.0, 142.0])
    assert looks.refused()
    why = looks.verdict(114.8)
    assert "decodes at 76.0 tokens/s at best, 46% slower than the last version's best, 142.0" in why
    assert "114.8 recorded, side by side: more than server.max_slowdown 10% plus" in why
    assert "4 looks at the last version, 70.7-142.0 tokens/s, spread 2%" in why


@pytest.mark.parametrize(
    ("new_best", "refused"), [(110.0, True), (112.0, False), (125.0, False), (136.0, False)]
)
def test_a_refusal_needs_the_difference_beyond_max_slowdown_and_the_spread(new_best, refused):
    """The last version's looks: best 140, median 137.5 (spread 1.8%); the new one's: best
    ``new_best``, median 100. 136 is kept; below that, refused only beyond the bound."""
    looks = looked([100.0, 100.0, 100.0, 100.0, new_best], [135.0, 140.0, 137.0, 138.0])
    assert looks.kept() == (new_best >= 126.0)
    bound = 0.1 + pace.spread(looks.new) + pace.spread(looks.last)
    assert looks.refused() == refused == (new_best < 140.0 * (1 - bound))
