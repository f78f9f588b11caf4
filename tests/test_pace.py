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


@pytest.mark.parametrize(
    ("speed", "then", "refused"),
    [(95.0, 100.0, False), (90.0, 100.0, False), (89.0, 100.0, True), (110.0, 100.0, False)],
)  # fmt: skip
def test_the_verdict_side_by_side_rests_on_the_speed_measured_now(speed, then, refused):
    """A record from a quieter moment (500 tokens/s) refuses nothing the last version, measured
    again between two looks at the new one, does not."""
    why = pace.slowdown_side_by_side(speed, then, 500.0, 0.1)
    assert bool(why) == refused
    if refused:
        assert f"({then:.1f} tokens/s measured between two looks at it, 500.0 recorded;" in why
        assert f"{1 - speed / then:.0%} slower" in why
    assert pace.slowdown(speed, 500.0, 0.1), "against the record alone it would be refused"
