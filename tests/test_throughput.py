"""`llamarig tune --for throughput` without a host: one round's replies parsed (the server's
per-token timestamps), and the staged sweep's choice against a simulated rig whose aggregate
grows with the slots while its gaps grow faster. test_sandbox_tune runs it on the sandbox."""

from __future__ import annotations

import json
import re
import time

import pytest

from llamarig.serving import throughput
from llamarig.serving.throughput import LOAD_TOKENS, SECTION, LoadCandidate


def reply(gap_ms: float, tokens: int = LOAD_TOKENS) -> str:
    """A streamed /completion reply with timings_per_token: predicted_ms grows by ``gap_ms``."""
    chunks = []
    for n in range(1, tokens + 1):
        timings = {"predicted_n": n, "predicted_ms": (n - 1) * gap_ms, "prompt_ms": 5.0}
        chunks.append("data: " + json.dumps({"content": "x", "timings": timings}))
    final = {"content": "", "stop": True, "timings": dict(timings)}  # repeats the last count
    return "\n\n".join([*chunks, "data: " + json.dumps(final)]) + "\n\n"


def round_output(clients: int, wall: float, gap_ms: float) -> str:
    parts = [f"{SECTION}wall 100.0 {100.0 + wall}"]
    parts += [f"{SECTION}reply\n{reply(gap_ms)}" for _ in range(clients)]
    return "\n".join(parts)


def test_a_round_gives_the_aggregate_and_the_servers_gaps():
    rate, gaps = throughput.parse_round(round_output(2, 4.0, 10.0), 2)
    assert rate == pytest.approx(2 * LOAD_TOKENS / 4.0)
    assert len(gaps) == 2 * (LOAD_TOKENS - 1) and set(gaps) == {10.0}


def test_a_short_or_missing_reply_is_an_error():
    short = f"{SECTION}wall 1 2\n{SECTION}reply\n{reply(5.0, tokens=10)}"
    with pytest.raises(ValueError, match=f"ended before {LOAD_TOKENS} tokens"):
        throughput.parse_round(short, 1)
    with pytest.raises(ValueError, match="1 of 2 replies came back"):
        throughput.parse_round(round_output(1, 1.0, 5.0), 2)
    failed = f"{SECTION}wall 1 2\n{SECTION}reply\ncurl: (22) The requested URL returned error: 503"
    with pytest.raises(ValueError, match="503"):
        throughput.parse_round(failed, 1)


def simulated_rig(
    gap_per_slot_ms: float, backend_sampling_gain: float, ubatch_gain=None, spec=None
):
    """start/stop/run of a rig where p clients get 100 * p ** 0.7 t/s (x the gain with -bs, x
    ``ubatch_gain[ubatch]``, x ``spec[p]`` with drafting on) and a gap of gap_per_slot_ms * p;
    -kvu halves the aggregate."""
    started: list[dict] = []

    def start(data: dict) -> int:
        started.append(data["server"])
        return len(started)

    def run(command: str, timeout: float) -> tuple[int, str, str]:
        server = started[-1]
        clients = command.count("curl ")
        assert clients == server["parallel"]
        rate = 100 * clients**0.7 * (backend_sampling_gain if server["backend_sampling"] else 1)
        rate /= 2 if server["kv_unified"] else 1
        rate *= (ubatch_gain or {}).get(server["ubatch"], 1)
        if server["spec"]["type"] not in ([], ["none"]):
            rate *= spec[clients]
        wall = clients * LOAD_TOKENS / rate
        return 0, round_output(clients, wall, gap_per_slot_ms * clients), ""

    return start, (lambda pid: None), run, started


def rig_data(parallel: int = 1, ctx: int = 8192, max_p95_ms=None, spec_type=()) -> dict:
    server = {"parallel": parallel, "ctx": ctx, "backend_sampling": False, "kv_unified": False}
    server |= {"batch": 2048, "ubatch": 512, "spec": {"type": list(spec_type), "draft_max": 3}}
    server |= {"host": "127.0.0.1", "port": 8080}
    return {"server": server, "tune": {"max_p95_ms": max_p95_ms}}


def candidate(parallel, backend_sampling=False, kv_unified=False, ubatch=512, spec=None):
    return LoadCandidate(parallel, backend_sampling, kv_unified, 2048, ubatch, spec)


def sweep(data: dict, start, stop, run, saved=None):
    saved = {} if saved is None else saved
    return throughput.sweep(
        data, run, start, stop, saved, lambda s: None, time.monotonic() + 60, print,
        data["tune"]["max_p95_ms"],
    )  # fmt: skip


def test_the_sweep_keeps_the_most_tokens_within_three_times_the_lone_gap():
    start, stop, run, started = simulated_rig(gap_per_slot_ms=10, backend_sampling_gain=1.3)
    results, chosen, bound = sweep(rig_data(), start, stop, run)
    # One client alone: a 10 ms gap, so the bound is 30 ms: 2 slots (20 ms) pass, 4 do not.
    assert bound == 30
    assert chosen.candidate == candidate(2, backend_sampling=True)
    assert [s["parallel"] for s in started][:5] == [1, 2, 4, 8, 16]
    labels = [r.candidate.label for r in results]
    assert labels == [
        "parallel 1 -b 2048 -ub 512", "parallel 2 -b 2048 -ub 512", "parallel 4 -b 2048 -ub 512",
        "parallel 8 -b 2048 -ub 512", "parallel 16 -b 2048 -ub 512",
        "parallel 2 -bs -b 2048 -ub 512", "parallel 2 -bs -kvu -b 2048 -ub 512",
        "parallel 2 -bs -b 2048 -ub 256", "parallel 2 -bs -b 2048 -ub 1024",
        "parallel 2 -bs -b 4096 -ub 1024", "parallel 2 -bs -b 4096 -ub 2048",
    ]  # fmt: skip
    table = throughput.table(results, chosen, bound)
    assert "parallel 2 -bs -b 2048 -ub 512" in table and "<- tuned" in table
    assert re.search(r"parallel 4 .* p95 gap over the bound \(\d+\.\d\d > 30\.00 ms\)", table)


def test_the_physical_batch_that_serves_more_is_kept_within_the_context():
    gains = {1024: 1.2, 2048: 1.1}
    start, stop, run, started = simulated_rig(10, 1.0, ubatch_gain=gains)
    results, chosen, _ = sweep(rig_data(parallel=2, ctx=2048), start, stop, run)
    assert chosen.candidate == candidate(2, ubatch=1024)
    # A batch beyond the 2,048-token context would be that context: not tried.
    assert max(s["batch"] for s in started) == 2048
    assert throughput.batch_pairs(rig_data(ctx=2048)) == [(2048, 256), (2048, 512), (2048, 1024)]


def test_drafting_is_weighed_per_slot_count_and_turned_off_where_it_loses():
    # Drafting wins one stream (x1.5) and loses with 2 clients (x0.7), as upstream reports.
    spec = {1: 1.5, 2: 0.7, 4: 0.6, 8: 0.5, 16: 0.5}
    start, stop, run, started = simulated_rig(10, 1.0, spec=spec)
    data = rig_data(spec_type=["ngram-mod"])
    results, chosen, bound = sweep(data, start, stop, run)
    labels = [r.candidate.label for r in results][:4]
    assert labels == [
        "parallel 1 spec -b 2048 -ub 512", "parallel 1 no spec -b 2048 -ub 512",
        "parallel 2 spec -b 2048 -ub 512", "parallel 2 no spec -b 2048 -ub 512",
    ]  # fmt: skip
    # The bound comes from one client as the rig serves it (drafting on): 30 ms.
    assert bound == 30
    assert chosen.candidate == candidate(2, spec=False)
    assert chosen.candidate.settings()["spec"] == {"type": ["none"]}
    served_off = [s for s in started if s["spec"]["type"] == ["none"]]
    assert served_off and all(s["spec"]["draft_max"] == 3 for s in served_off)


def test_a_context_too_small_for_many_slots_bounds_parallel_and_a_bound_can_be_set():
    start, stop, run, started = simulated_rig(gap_per_slot_ms=10, backend_sampling_gain=1.0)
    data = rig_data(parallel=2, ctx=2048, max_p95_ms=100)
    assert throughput.parallel_values(data) == [1, 2, 4]
    results, chosen, bound = sweep(data, start, stop, run)
    assert bound == 100 and chosen.candidate == candidate(4)


def test_equal_settings_keep_the_current_ones_and_a_resumed_sweep_measures_nothing():
    start, stop, run, started = simulated_rig(gap_per_slot_ms=10, backend_sampling_gain=1.02)
    saved: dict = {}
    _, chosen, _ = sweep(rig_data(parallel=2), start, stop, run, saved)
    assert chosen.candidate == candidate(2)  # -bs: +2%, within 5%
    count = len(started)
    _, again, _ = sweep(rig_data(parallel=2), start, stop, run, saved)
    assert len(started) == count and again.candidate == chosen.candidate


def test_a_candidate_that_fails_to_start_is_skipped_with_why():
    start, stop, run, _ = simulated_rig(gap_per_slot_ms=10, backend_sampling_gain=2.0)

    def refusing_start(data: dict) -> int:
        if data["server"]["backend_sampling"]:
            raise ValueError("error: invalid argument: -bs")
        return start(data)

    results, chosen, _ = sweep(rig_data(), refusing_start, stop, run)
    failed = next(r for r in results if r.candidate.backend_sampling)
    assert failed.skipped == "failed: error: invalid argument: -bs"
    assert not chosen.candidate.backend_sampling


def test_a_tuned_value_the_hosts_own_setting_replaces_is_named(write_inventory):
    from llamarig.serving.tuned_files import overridden

    inventory = write_inventory(
        """
all:
  hosts:
    rig1:
      ssh: {host: 127.0.0.1}
      llama_cpp: {backend: cpu}
      model: {path: /opt/models/m.gguf}
      server: {parallel: 2}
"""
    )
    settings = {"parallel": 4, "backend_sampling": False, "kv_unified": False}
    (line,) = overridden(inventory, "rig1", settings)
    assert line == (
        f"rig1: server.parallel is 2 in {inventory}, which wins over the tuned 4: remove it "
        "there to serve the tuned value"
    )
    assert overridden(inventory, "rig1", {**settings, "parallel": 2}) == []
