"""`llamarig tune` without a host: the candidates it measures, the llama-bench command lines,
the choice of the winner, the resumable sweep, the roofline, and the tuned file the loader
merges under the host's own settings. tests/test_sandbox_tune.py runs it on the sandbox."""

from __future__ import annotations

import copy
import json
import shlex
import time

import pytest
import yaml

from llamarig.config import ConfigError, load_inventory
from llamarig.config.inventory import tuned_path
from llamarig.model.gguf import read_gguf_header_file
from llamarig.planner.plan import plan_host, roofline_tps
from llamarig.serving import tune as tune_module
from llamarig.serving.draft_tune import (
    DRAFT_MAX_VALUES,
    DRAFT_PROMPTS,
    DraftMeasured,
    draft_server_data,
    draft_sweep,
    draft_winner,
)
from llamarig.serving.llama_bench import (
    Candidate,
    Measured,
    bench_command,
    bench_speeds,
    candidates,
    planned_candidate,
    with_candidate,
)
from llamarig.serving.throughput import start_command
from llamarig.serving.tune import (
    CUT_AFTER,
    CUT_FLOOR_SECONDS,
    RUN_SECONDS,
    sweep,
    winner,
)
from llamarig.serving.tuned_files import SweepRecord, write_tuned
from llamarig.tables.hardware import memory_bandwidth_gbs
from tests.conftest import PROJECT
from tests.ggufmodels import write_llama

# The shape of `llama-bench -o json` at the pinned commit (one object per test).
BENCH_JSON = json.dumps(
    [
        {"n_prompt": 512, "n_gen": 0, "avg_ts": 911.5, "stddev_ts": 8.1, "samples_ts": [905, 918]},
        {"n_prompt": 0, "n_gen": 64, "avg_ts": 41.25, "stddev_ts": 0.38, "samples_ts": [41, 41.5]},
    ]
)


@pytest.fixture(scope="module")
def header(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "llama-8b.gguf"
    return read_gguf_header_file(write_llama(path, 32, 4096, 14336, 32, 8, 128256, 131072, "q8_0"))


@pytest.fixture
def cpu_plan():
    data = load_inventory(PROJECT / "inventory" / "hosts.yml").hosts["sandbox"].data
    return plan_host("sandbox", copy.deepcopy(data), None)


@pytest.fixture
def drafting_plan():
    """The sandbox rig drafting with ngram-simple (no draft model needed)."""
    data = copy.deepcopy(load_inventory(PROJECT / "inventory" / "hosts.yml").hosts["sandbox"].data)
    data["server"]["spec"]["type"] = ["ngram-simple"]
    return plan_host("sandbox", data, None)


@pytest.fixture
def h200_plan(header):
    data = load_inventory(PROJECT / "inventory" / "gpu-h200x2.yml").hosts["h200x2"].data
    data = copy.deepcopy(data)
    data["server"]["split_mode"] = "auto"
    plan = plan_host("h200x2", data, header)
    assert plan.fits, plan.report()
    return plan


def test_cpu_candidates_sweep_threads_and_ubatch_the_planned_first(cpu_plan):
    found = candidates(cpu_plan, cpu_count=8)
    assert found[0] == planned_candidate(cpu_plan)
    assert {c.threads for c in found[1:]} == {4, 8}
    assert {c.ubatch for c in found} == {256, 512, 1024}
    assert {c.split_mode for c in found} == {"none"}
    assert len(found) == len(set(found)) == 7  # the planned one (threads unset) plus 2 x 3


def test_gpu_candidates_sweep_modes_ratios_and_ubatch(h200_plan):
    found = candidates(h200_plan, cpu_count=64)
    planned = planned_candidate(h200_plan)
    assert found[0] == planned and planned.split_mode == "tensor"
    assert planned.tensor_split == (0.5, 0.5)
    assert {c.tensor_split for c in found} == {(0.45, 0.55), (0.5, 0.5), (0.55, 0.45)}
    assert {c.split_mode for c in found} == {"tensor", "layer"}
    assert len(found) == 2 * 3 * 3


def test_bench_command_for_a_gpu_candidate(h200_plan):
    argv = shlex.split(bench_command(h200_plan, Candidate("tensor", (0.45, 0.55), 1024, None)))
    assert argv[0] == "/opt/llamarig/current/bin/llama-bench"
    pairs = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert pairs["-m"] == "/srv/llamarig/models/llama-32b-q8_0.gguf"
    assert (pairs["-sm"], pairs["-ts"], pairs["-dev"]) == ("tensor", "0.45/0.55", "CUDA0/CUDA1")
    assert (pairs["-ub"], pairs["-fa"], pairs["-o"], pairs["-p"]) == ("1024", "on", "json", "512")
    layer = shlex.split(bench_command(h200_plan, Candidate("none", None, 512, None)))
    assert layer[layer.index("-dev") + 1] == "CUDA0" and "-ts" not in layer


def test_bench_command_for_a_cpu_candidate_has_no_gpu_options(cpu_plan):
    argv = shlex.split(bench_command(cpu_plan, Candidate("none", None, 256, 2)))
    assert argv[argv.index("-t") + 1] == "2" and argv[argv.index("-ub") + 1] == "256"
    assert not {"-ngl", "-sm", "-dev", "-ts"} & set(argv)


def test_bench_speeds_reads_llama_bench_json():
    assert bench_speeds(BENCH_JSON) == (41.25, 0.38, 911.5)
    with pytest.raises(ValueError, match="no decode and prompt results"):
        bench_speeds(json.dumps([{"n_prompt": 512, "n_gen": 0, "avg_ts": 900}]))


def test_the_planned_configuration_stays_unless_clearly_beaten():
    planned, other = Candidate("none", None, 512, None), Candidate("none", None, 256, 2)
    close = [Measured(planned, 40.0, 0.4, 900), Measured(other, 40.5, 0.4, 910)]
    assert winner(close, planned).candidate == planned
    clear = [Measured(planned, 40.0, 0.4, 900), Measured(other, 45.0, 0.4, 700)]
    assert winner(clear, planned).candidate == other
    faster_prompt = [Measured(planned, 40.0, 0.4, 700), Measured(other, 40.3, 0.4, 900)]
    assert winner(faster_prompt, planned).candidate == other
    # A noisy host: 5% apart but within the fastest run's spread counts as equal decode.
    noisy = [Measured(planned, 42.0, 4.0, 700), Measured(other, 40.0, 1.0, 900)]
    assert winner(noisy, planned).candidate == other
    tight = [Measured(planned, 42.0, 0.2, 700), Measured(other, 40.0, 0.2, 900)]
    assert winner(tight, planned).candidate == planned


def test_the_sweep_stops_at_its_deadline_and_resumes(cpu_plan, tmp_path):
    """A runner standing in for the host's shell (the sandbox test runs the real one)."""
    commands = []

    def run(command: str, timeout: float):
        commands.append(command)
        return 0, BENCH_JSON, ""

    sweep_file = tmp_path / ".sandbox.sweep.json"
    args = (cpu_plan, {"header": None}, run, 2, SweepRecord(sweep_file, "build x, model y"))
    first = sweep(*args, deadline=time.monotonic() - 1, say=lambda line: None)
    assert not commands and all("time bound" in r.skipped for r in first)
    second = sweep(*args, deadline=time.monotonic() + 600, say=lambda line: None)
    assert len(commands) == len(second) and all(r.tps == 41.25 for r in second)
    assert all(r.prompt_tps == 911.5 for r in second)
    again = sweep(*args, deadline=time.monotonic() + 600, say=lambda line: None)
    assert len(commands) == len(second), "measured again instead of resuming"
    assert [r.tps for r in again] == [r.tps for r in second]
    other_build = sweep(
        cpu_plan, {"header": None}, run, 2, SweepRecord(sweep_file, "build z, model y"),
        deadline=time.monotonic() + 600, say=lambda line: None,
    )  # fmt: skip
    assert len(commands) == 2 * len(second) and len(other_build) == len(second)


class FakeClock:
    """time.monotonic for llamarig.serving.tune, moved on by the fake runner's runs."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_run_far_slower_than_the_quickest_is_cut_on_the_host(cpu_plan, tmp_path, monkeypatch):
    """A runner standing in for the host's shell: a run takes 10 s, one with two threads an
    hour (a CPU shared with a busy loop); past its `timeout` it ends as coreutils' does."""
    clock = FakeClock()
    monkeypatch.setattr(tune_module, "time", clock)
    limits = []

    def run(command: str, timeout: float):
        argv = shlex.split(command)
        assert argv[:3] == ["timeout", "-k", "5"] and timeout > int(argv[3])
        limit = int(argv[3])
        limits.append(limit)
        takes = 3600 if "-t" in argv and argv[argv.index("-t") + 1] == "2" else 10
        clock.now += min(takes, limit)
        return (124, "", "") if takes > limit else (0, BENCH_JSON, "")

    record = SweepRecord(tmp_path / "sweep.json", "build x, model y")
    args = (cpu_plan, {"header": None}, run, 2, record)
    results = sweep(*args, deadline=clock.now + 3600, say=lambda line: None)
    cut = max(CUT_FLOOR_SECONDS, CUT_AFTER * 10)
    assert limits[0] == RUN_SECONDS and set(limits[1:]) == {cut}
    two_threads = [r for r in results if r.candidate.threads == 2]
    assert two_threads and all(r.tps is None for r in two_threads)
    assert {r.skipped for r in two_threads} == {f"cut after {cut} s (the quickest run took 10 s)"}
    assert all(r.tps == 41.25 for r in results if r.candidate.threads != 2)
    assert winner(results, planned_candidate(cpu_plan)).candidate.threads != 2
    # Run again, it resumes: the cut runs are slower, not unmeasured, and are not run again.
    limits.clear()
    again = sweep(*args, deadline=clock.now + 3600, say=lambda line: None)
    assert limits == [] and [r.skipped for r in again] == [r.skipped for r in results]

    # Near the deadline a run is bounded by what is left, and named a time bound, not slower.
    limits.clear()
    other = SweepRecord(tmp_path / "other.json", "build x, model y")
    results = sweep(
        cpu_plan, {"header": None}, run, 2, other,
        deadline=clock.now + 8, say=lambda line: None,
    )  # fmt: skip
    assert limits[0] == 8
    assert results[0].skipped == "not measured (time bound; run tune again to resume)"


def test_the_roofline_uses_the_cards_bandwidth(h200_plan):
    weights = max(d.weights_mib for d in h200_plan.memory.devices) * (1 << 20)
    assert roofline_tps(h200_plan) == pytest.approx(4800e9 / weights)
    assert memory_bandwidth_gbs("NVIDIA GeForce RTX 3090 Ti") == 1008
    assert memory_bandwidth_gbs("NVIDIA GeForce RTX 3090") == 936
    assert memory_bandwidth_gbs("NVIDIA GeForce GTX 1080") is None


def _sandbox_copy(tmp_path, host_settings: str = "") -> tuple:
    text = (PROJECT / "inventory" / "hosts.yml").read_text()
    if host_settings:
        text = text.replace("          server:\n", "          server:\n" + host_settings, 1)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(text)
    return inventory, tuned_path(inventory, "sandbox")


def test_the_tuned_file_is_merged_under_the_hosts_own_settings(tmp_path):
    inventory, tuned = _sandbox_copy(tmp_path, "            threads: 1\n")
    chosen = Measured(Candidate("none", None, 256, 2), 41.2, 0.3, 900.0)
    write_tuned(tuned, "sandbox", chosen, "b, m")
    host = load_inventory(inventory).hosts["sandbox"]
    assert host.data["server"]["ubatch"] == 256
    assert host.origins[("server", "ubatch")] == str(tuned)
    # The host's own `threads: 1` wins over the tuned 2.
    assert host.data["server"]["threads"] == 1
    assert host.origins[("server", "threads")] == str(inventory)
    assert tuned.read_text().startswith("# Written by `llamarig tune` for sandbox")


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("server: {ubatch: 256, port: 9}\n", "server.port: is not a setting `llamarig tune`"),
        ("server: {ubatch: big}\n", "server.ubatch"),
        ("server: [1, 2]\n", "server: is a list"),
        (
            "server: {spec: {draft_max: 2, type: [ngram-mod]}}\n",
            "server.spec.type: is ['ngram-mod']; tune writes only ['none'] (drafting off",
        ),
        (
            "server: {spec: {draft_min: 2}}\n",
            "server.spec.draft_min: is not a setting `llamarig tune` writes (of spec only",
        ),
        ("server: {spec: 3}\n", "server.spec: is an integer; a mapping of draft_max and type"),
        ("server: {spec: {draft_max: 0}}\n", "server.spec.draft_max"),
        ("model: {url: x}\n", "must hold `server:`"),
    ],
)
def test_a_bad_tuned_file_is_refused_by_name(tmp_path, content, words):
    inventory, tuned = _sandbox_copy(tmp_path)
    tuned.parent.mkdir()
    tuned.write_text(content)
    with pytest.raises(ConfigError) as refused:
        load_inventory(inventory)
    text = "\n".join(refused.value.problems)
    assert words in text and str(tuned.parent) in text, text


def test_tune_refuses_a_build_without_llama_bench_before_contacting_the_host():
    from llamarig.serving.tune import TuneError, tune_host

    host = load_inventory(PROJECT / "inventory" / "hosts.yml").hosts["sandbox"]
    with pytest.raises(TuneError, match=r"targets lacks llama-bench.*add it"):
        tune_host(host, PROJECT / "inventory" / "hosts.yml", 1, False, say=lambda line: None)


def _started(command: str) -> list[str]:
    """The llama-server argv of a draft start command (after setsid, before the redirects)."""
    argv = shlex.split(command.split("setsid ", 1)[1].split(" </dev/null", 1)[0])
    assert argv[0] == "/opt/llamarig/current/bin/llama-server"
    return argv


def test_the_temporary_server_is_the_planned_one_on_loopback_beside_the_service(drafting_plan):
    chosen = Candidate("none", None, 256, 2)
    command = start_command(draft_server_data(with_candidate(drafting_plan.resolved, chosen), 3))
    argv = _started(command)
    pairs = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert (pairs["--host"], pairs["--port"]) == ("127.0.0.1", "9080")  # the service: 8080
    assert (pairs["--spec-type"], pairs["--spec-draft-n-max"]) == ("ngram-simple", "3")
    assert (pairs["-ub"], pairs["-t"], pairs["-c"]) == ("256", "2", "2048")
    assert "--api-key-file" not in argv
    assert "export HOME=/var/lib/llama-server;" in command
    assert "[ $? -eq 7 ] || { echo 'port 9080 is in use on the host'" in command
    # With an API key the temporary server asks for it as the service does (the same key file).
    keyed = copy.deepcopy(drafting_plan.resolved)
    keyed["server"].update(api_key_file="/home/me/key", host="0.0.0.0", port=65000)
    keyed_plan = plan_host("sandbox", keyed, None)
    served = draft_server_data(with_candidate(keyed_plan.resolved, chosen), 1)
    argv = _started(start_command(served))
    assert argv[-2:] == ["--api-key-file", "/etc/llamarig/api-key"]  # after the flag --metrics
    assert argv[argv.index("--host") + 1 : argv.index("--port") + 2] == [
        "127.0.0.1", "--port", "64000",
    ]  # fmt: skip


class FakeHost:
    """The host's shell as the draft sweep sees it: each start gets a pid, each completion
    answers with the decode speed this draft length gets (the sandbox test runs the real one)."""

    def __init__(self, speeds: dict[int, list[float]], tokens: int = 128):
        self.speeds, self.tokens, self.commands, self.stopped = speeds, tokens, [], []
        self.draft_max = self.answered = 0

    def run(self, command: str, timeout: float):
        self.commands.append(command)
        if "setsid " in command:
            argv = _started(command)
            self.draft_max = int(argv[argv.index("--spec-draft-n-max") + 1])
            self.answered = 0
            return 0, f"{4000 + self.draft_max}\n", ""
        if "/completion" in command:
            speed = self.speeds[self.draft_max][self.answered]
            self.answered += 1
            assert '"ignore_eos": true' in command
            timings = {"predicted_n": self.tokens, "predicted_per_second": speed}
            return 0, json.dumps({"content": "1, 2", "timings": timings}), ""
        if command.startswith("kill "):
            self.stopped.append(int(command.split()[1]))
        return 0, "", ""


def drafts_of(plan, run, record: SweepRecord, deadline: float) -> list:
    """The draft sweep as tune runs it: the planned settings served with each draft length,
    resuming from ``record``."""
    chosen = planned_candidate(plan)
    data = with_candidate(plan.resolved, chosen)
    quiet = lambda line: None  # noqa: E731
    return draft_sweep(data, chosen.label, run, record.read(), record.save, deadline, quiet)


def test_the_draft_sweep_serves_each_draft_max_stops_it_and_resumes(drafting_plan, tmp_path):
    host = FakeHost({1: [30, 50, 40], 2: [60, 44, 52], 3: [20, 21, 22], 4: [45, 45, 45]})
    record = SweepRecord(tmp_path / ".sandbox.sweep.json", "build x, model y")
    none = drafts_of(drafting_plan, host.run, record, deadline=time.monotonic() - 1)
    assert not host.commands and all("time bound" in r.skipped for r in none)
    results = drafts_of(drafting_plan, host.run, record, deadline=time.monotonic() + 600)
    assert [(r.draft_max, r.tps, r.low, r.high) for r in results] == [
        (1, 40, 30, 50), (2, 52, 44, 60), (3, 21, 20, 22), (4, 45, 45, 45),
    ]  # fmt: skip
    assert host.stopped == [4001, 4002, 4003, 4004]
    assert sum("/completion" in c for c in host.commands) == len(DRAFT_PROMPTS) * 4
    assert draft_winner(results, None).draft_max == 2
    again = drafts_of(drafting_plan, host.run, record, deadline=time.monotonic() + 600)
    assert len(host.stopped) == 4, "served again instead of resuming"
    assert [r.tps for r in again] == [r.tps for r in results]


def test_a_completion_cut_short_is_no_speed(drafting_plan, tmp_path):
    host = FakeHost({n: [30, 50, 40] for n in DRAFT_MAX_VALUES}, tokens=3)
    record = SweepRecord(tmp_path / "s.json", "b, m")
    results = drafts_of(drafting_plan, host.run, record, deadline=time.monotonic() + 600)
    assert all(r.skipped == "llama-server failed: decoded 3 of 128 tokens" for r in results)
    assert host.stopped == [4001, 4002, 4003, 4004] and draft_winner(results, None) is None


def test_a_draft_server_that_does_not_start_is_stopped_and_reported(drafting_plan, tmp_path):
    commands = []

    def run(command: str, timeout: float):
        commands.append(command)
        if "setsid " in command:
            return 0, "4001\n", ""
        if "/health" in command:
            return 1, "", "error: unknown speculative type\n"
        return 0, "", ""

    record = SweepRecord(tmp_path / "s.json", "b, m")
    results = drafts_of(drafting_plan, run, record, deadline=time.monotonic() + 600)
    assert all(r.skipped == "llama-server failed: error: unknown speculative type" for r in results)
    assert sum(c.startswith("kill 4001") for c in commands) == len(DRAFT_MAX_VALUES)
    assert draft_winner(results, None) is None


def test_the_planned_draft_max_stays_unless_clearly_beaten():
    close = [DraftMeasured(2, 50.0), DraftMeasured(3, 50.8), DraftMeasured(1, None)]
    assert draft_winner(close, 2).draft_max == 2
    assert draft_winner(close, None).draft_max == 3
    assert draft_winner([DraftMeasured(2, 50.0), DraftMeasured(3, 55.0)], 2).draft_max == 3
    # A planned draft_max outside the measured 1-4 (e.g. 8) gives way to the fastest measured.
    assert draft_winner(close, 8).draft_max == 3


def test_the_tuned_draft_max_is_merged_under_the_hosts_spec(tmp_path):
    inventory, tuned = _sandbox_copy(tmp_path, "            spec: {type: [ngram-simple]}\n")
    chosen = Measured(Candidate("none", None, 256, 2), 41.2, 0.3, 900.0)
    write_tuned(tuned, "sandbox", chosen, "b, m", DraftMeasured(3, 61.5, 58.0, 64.0))
    assert yaml.safe_load(tuned.read_text())["server"]["spec"] == {"draft_max": 3}
    assert "# draft_max 3 served at 61.5 t/s" in tuned.read_text()
    host = load_inventory(inventory).hosts["sandbox"]
    assert host.data["server"]["spec"] == {"type": ["ngram-simple"], "draft_max": 3}
    assert host.origins[("server", "spec", "draft_max")] == str(tuned)
    assert host.origins[("server", "spec", "type")] == str(inventory)
    # The host's own draft_max wins over the tuned one.
    (tmp_path / "own").mkdir()
    inventory, tuned = _sandbox_copy(
        tmp_path / "own", "            spec: {type: [ngram-simple], draft_max: 1}\n"
    )
    write_tuned(tuned, "sandbox", chosen, "b, m", DraftMeasured(3, 61.5, 58.0, 64.0))
    assert load_inventory(inventory).hosts["sandbox"].data["server"]["spec"]["draft_max"] == 1


def test_drafting_turned_off_for_load_keeps_the_decode_draft_length_and_comes_back(tmp_path):
    from llamarig.planner import render
    from llamarig.serving.throughput import LoadCandidate, LoadMeasured
    from llamarig.serving.tuned_files import overridden, write_tuned_throughput

    inventory, tuned = _sandbox_copy(tmp_path)
    # The rig's types come from the group `all`, under the tuned file (a host's own would win).
    group_vars = "all:\n  vars:\n    server: {spec: {type: [ngram-mod]}}\n"
    inventory.write_text(inventory.read_text().replace("all:\n", group_vars, 1))
    decode = Measured(Candidate("none", None, 256, 2), 41.2, 0.3, 900.0)
    write_tuned(tuned, "sandbox", decode, "b, m", DraftMeasured(3, 61.5, 58.0, 64.0))
    off = LoadMeasured(LoadCandidate(2, True, False, 2048, 1024, spec=False), 90.0, 20.0, 30.0)
    write_tuned_throughput(tuned, "sandbox", off, 40.0, "b, m")
    server = yaml.safe_load(tuned.read_text())["server"]
    assert server["spec"] == {"draft_max": 3, "type": ["none"]}
    assert (server["parallel"], server["batch"], server["ubatch"]) == (2, 2048, 1024)
    host = load_inventory(inventory).hosts["sandbox"]
    assert host.data["server"]["spec"]["type"] == ["none"]
    argv = render.server_args(host.data | {"server": {**host.data["server"], "split_mode": "none"}})
    assert argv[argv.index("--spec-type") + 1] == "none"
    assert overridden(inventory, "sandbox", off.candidate.settings()) == []
    # A later load sweep that keeps drafting on serves the rig's types again.
    on = LoadMeasured(LoadCandidate(1, False, False, 2048, 512, spec=True), 50.0, 10.0, 12.0)
    write_tuned_throughput(tuned, "sandbox", on, 40.0, "b, m")
    assert yaml.safe_load(tuned.read_text())["server"]["spec"] == {"draft_max": 3}
    assert load_inventory(inventory).hosts["sandbox"].data["server"]["spec"]["type"] == [
        "ngram-mod"
    ]


@pytest.mark.parametrize(
    "text",
    ["not json", "[1, 2]", '{"identity": "build x, model y", "results": [1]}',
     '{"identity": "build x, model y", "results": {"none ub 512": [1, "a", 3], "x": null}}'],
)  # fmt: skip
def test_a_damaged_sweep_file_is_measured_afresh(cpu_plan, tmp_path, text):
    """The sweep file is a cache: a damaged or edited one is no traceback."""
    sweep_file = tmp_path / ".sandbox.sweep.json"
    sweep_file.write_text(text)
    commands = []

    def run(command: str, timeout: float):
        commands.append(command)
        return 0, BENCH_JSON, ""

    results = sweep(
        cpu_plan, {"header": None}, run, 2, SweepRecord(sweep_file, "build x, model y"),
        deadline=time.monotonic() + 600, say=lambda line: None,
    )  # fmt: skip
    assert len(commands) == len(results) and all(r.tps == 41.25 for r in results)
