"""Every HTTP request llamarig sends to a llama-server carries the rig's server.http_timeouts:
each command is run with a curl that records its argv, from rig data with distinctive bounds."""

from __future__ import annotations

import yaml

from llamarig import operations
from llamarig.config import load_inventory
from llamarig.facts.server import ServerProbe, slot_counts_command
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.serving import answers, pace, status
from tests.test_shell_boundary import Shims

BASE_URL = "http://127.0.0.1:8080"
BOUNDS = {"connect": 3, "probe": 7, "answer": 11, "generation": 13}


def rig_data(tmp_path) -> dict:
    """A CPU rig whose server.http_timeouts are BOUNDS, loaded as a deploy loads it."""
    inventory = {
        "all": {
            "hosts": {
                "rig1": {
                    "ssh": {"host": "192.0.2.1", "user": "root"},
                    "llama_cpp": {"backend": "cpu"},
                    "driver": {"source": "none"},
                    "cuda": {"source": "none"},
                    "model": {"url": "https://example.org/m.gguf", "sha256": "a" * 64},
                    "server": {"ctx": 2048, "http_timeouts": BOUNDS},
                }
            }
        }
    }
    path = tmp_path / "hosts.yml"
    path.write_text(yaml.safe_dump(inventory))
    return load_inventory(path).hosts["rig1"].data


def bounds_of(curls: list[list[str]]) -> set[tuple[str, str]]:
    """(connect, in all) of each curl call; a call without either shows as None."""
    found = set()
    for argv in curls:
        connect = argv[argv.index("--connect-timeout") + 1] if "--connect-timeout" in argv else None
        total = argv[argv.index("--max-time") + 1] if "--max-time" in argv else None
        found.add((connect, total))
    return found


def test_every_request_carries_the_rigs_bounds(tmp_path):
    data = rig_data(tmp_path)
    timeouts = HttpTimeouts.of(data)
    assert timeouts == HttpTimeouts(**BOUNDS)
    shims = Shims(tmp_path / "shims")

    def bounds(command: str) -> set[tuple[str, str]]:
        curls, _ = shims.calls_of(command, "curl")
        assert curls, command
        return bounds_of(curls)

    # The probe of a no-op converge and of verify: /health, /slots, a 4-token completion.
    probe = ServerProbe().command(BASE_URL, timeouts)
    assert bounds(probe) == {("3", "7")}
    assert bounds(ServerProbe().command(BASE_URL, timeouts, ("a", "b"))) == {("3", "7")}
    # The drain's look at /slots.
    assert bounds(slot_counts_command(BASE_URL, timeouts)) == {("3", "7")}
    # An expect.answers question; the speed measurement.
    question = answers.Answer(0, "Hi", chat=False, contains="x", matches=None, max_tokens=4)
    assert bounds(answers.check_command(BASE_URL, question, timeouts)) == {("3", "11")}
    assert bounds(pace.decode_command(BASE_URL, timeouts)) == {("3", "13")}
    # `llamarig status`: /metrics and /slots, each within the probe bound.
    assert bounds(status.probe_command(data, 0)) == {("3", "7")}
    # The wait after a restart: each look at /health within the probe bound.
    wait = "".join(
        operations.serve_or_roll_back._inner(BASE_URL, "s", 0, "/u", "/e", "/c", "/g", timeouts)
    )
    assert bounds(wait) == {("3", "7")}


def test_the_completion_after_a_start_is_bounded_by_the_start_time_left():
    """It may load a router's model, so the probe bound alone would be too short: what is left
    of server.start_timeout, never less than the probe bound."""
    timeouts = HttpTimeouts(**BOUNDS)
    check = "".join(
        operations.serve_or_roll_back._inner(BASE_URL, "s", 60, "/u", "/e", "/c", "/g", timeouts)
    )
    assert 'left=$(( deadline - $(date +%s) )); [ "$left" -ge 7 ] || left=7; ' in check
    assert '--connect-timeout 3 --max-time "$left" ' in check


def test_a_bound_is_said_with_its_key():
    timeouts = HttpTimeouts(**BOUNDS)
    assert timeouts.said("probe") == "7 s (connect 3 s; server.http_timeouts.probe)"
    assert timeouts.curl("answer") == "curl -s --connect-timeout 3 --max-time 11"
