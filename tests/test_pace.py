"""The decode-speed check after a (re)start (`llamarig.serving.pace`): the speed from llama-server's
replies, the verdict against the last good version, and the request the host sends.
tests/test_sandbox_slowdown.py shows the rollback on the sandbox."""

from __future__ import annotations

import json
import shlex

import pytest

from llamarig.serving import pace
from tests.conftest import default_http_timeouts


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
    command = pace.decode_command("http://127.0.0.1:8080", default_http_timeouts())
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


class FakeHost:
    """The host `keep_pace` acts on, without one: the version serving now (``"new"`` at the
    start) decodes at the next speed of its list; what was done is kept in order."""

    def __init__(self, new: list[float | None], last: list[float | None]) -> None:
        self.speeds = {"new": list(new), "last": list(last)}
        self.serving = "new"
        self.done: list[str] = []
        self.said: list[str] = []
        self.errors: list[str] = []

    def versions(self) -> pace.Versions:
        def measure(best: float) -> float | None:
            self.done.append(f"measure {self.serving}")
            speed = self.speeds[self.serving].pop(0)
            return None if speed is None else max(best, speed)

        def switch_to(version: str) -> bool:
            self.done.append(f"switch to {version}")
            self.serving = version
            return True

        def roll_back() -> None:
            self.done.append("roll back")
            self.serving = "last"

        return pace.Versions(
            measure=measure,
            stash_new=lambda: self.done.append("stash new") is None,
            switch_to=switch_to,
            roll_back=roll_back,
            say=self.said.append,
            error=self.errors.append,
        )


def test_a_version_as_fast_as_the_record_is_kept_after_one_look():
    host = FakeHost(new=[101.0], last=[])
    assert pace.keep_pace(host.versions(), 100.0, 0.1, "llama-server") == 101.0
    assert host.done == ["measure new"] and not host.errors
    assert host.said == ["decodes at 101.0 tokens/s (last good 100.0)"]


def test_a_slow_look_is_looked_at_again_then_measured_in_turns_and_kept():
    """Slower than a record from a quieter moment, as fast as the last version side by side."""
    host = FakeHost(new=[60.0, 70.0, 71.0, 72.0], last=[72.0, 73.0])
    assert pace.keep_pace(host.versions(), 100.0, 0.1, "llama-server") == 72.0
    assert host.done == [
        "measure new", "measure new", "stash new",
        "switch to last", "measure last", "switch to new", "measure new",
        "switch to last", "measure last", "switch to new", "measure new",
    ]  # fmt: skip
    assert "roll back" not in host.done and not host.errors
    assert any("measuring the last version that served again" in line for line in host.said)
    assert host.said[-1] == "decodes at 72.0 tokens/s (last good 100.0)"


def test_a_version_slower_side_by_side_is_rolled_back_after_every_look():
    host = FakeHost(new=[50.0, 50.0] + [50.0] * pace.ROUNDS, last=[100.0] * pace.ROUNDS)
    assert pace.keep_pace(host.versions(), 100.0, 0.1, "llama-server") is None
    assert host.done.count("measure last") == pace.ROUNDS and host.done[-1] == "roll back"
    assert host.errors and host.errors[0].startswith("the new version of llama-server decodes")


def test_a_look_without_timings_rolls_back():
    host = FakeHost(new=[50.0, 50.0], last=[None])
    assert pace.keep_pace(host.versions(), 100.0, 0.1, "llama-server") is None
    assert host.done[-2:] == ["measure last", "roll back"]
    first = FakeHost(new=[None], last=[])
    assert pace.keep_pace(first.versions(), 100.0, 0.1, "llama-server") is None
    assert first.done == ["measure new"], "nothing switched for an unmeasured first look"
