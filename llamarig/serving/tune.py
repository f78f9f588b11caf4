"""`llamarig tune`: measure, on the target with the deployed build, the configurations that fit,
and write the fastest to a tuned-settings file beside the inventory.

The sweep is a bounded list of llama-bench runs, each a decode (the speed a chat user feels)
and a prompt (what the micro-batch size changes) of a candidate (llama_bench.py):
split modes, the planned ratio and its neighbours and micro-batch sizes on a GPU rig; threads
and micro-batch sizes on a CPU rig. Each candidate is planned first (the memory plan refuses
what would not fit) and measured once per run of the command; results are kept in a sweep file
next to the tuned file, so a run cut short by its time bound resumes where it stopped; a
llama-bench run far slower than the quickest is cut on the host and kept as slower. The
winner is the fastest decode; among decodes within ``KEEP_WITHIN`` of it, the fastest prompt
processing; the planned configuration stays unless clearly beaten, so a re-run does not flip
between equals. With speculative decoding (``server.spec.type``), each draft length is then
served by a temporary llama-server on loopback, since llama-bench does not draft
(draft_tune.py); `--for throughput` runs throughput.py's load sweep instead. The sweep file and
the tuned file are tuned_files.py's.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import yaml

from llamarig.config import HostConfig
from llamarig.config.inventory import tuned_path
from llamarig.config.lock import resolved
from llamarig.model.catalog import is_router
from llamarig.model.reference import HubError
from llamarig.onhost import hostpaths
from llamarig.planner import render
from llamarig.planner.gather import plan_for, run_on_host, shell_reader
from llamarig.planner.host_plan import HostPlan
from llamarig.planner.plan import plan_host, roofline_tps
from llamarig.serving import throughput
from llamarig.serving.choice import kept_or_best, table_row, tuned_note
from llamarig.serving.draft_tune import DraftMeasured, draft_sweep, draft_table, draft_winner
from llamarig.serving.llama_bench import (
    Candidate,
    Measured,
    bench_command,
    bench_speeds,
    candidates,
    planned_candidate,
    with_candidate,
)
from llamarig.serving.tuned_files import (
    SweepRecord,
    overridden,
    write_tuned,
    write_tuned_throughput,
)
from llamarig.tables.text import printable

# llama-bench's spread between repetitions is about 1%: a candidate must beat the planned
# configuration by more than this to replace it, so a re-run does not flip between equals.
KEEP_WITHIN = 0.02
# Every llama-bench run does the same work, so one that takes CUT_AFTER times as long as the
# quickest so far (never less than CUT_FLOOR_SECONDS, a model load's share) is slower than it:
# the host cuts it there (coreutils' timeout) instead of holding the sweep for minutes. Two
# threads of which one shares its CPU with a busy process decode about 100-fold slower.
CUT_AFTER = 5
CUT_FLOOR_SECONDS = 60
RUN_SECONDS = 600
TIMED_OUT = 124  # coreutils timeout's status for a command it stopped


class TuneError(Exception):
    """Why tune refuses to run, worded for the user."""


def winner(results: list[Measured], planned: Candidate) -> Measured:
    """The fastest decode; among the decodes equal to it the fastest prompt; the planned
    configuration whenever it is among those and within KEEP_WITHIN of that prompt speed."""
    measured = [r for r in results if r.tps]
    if not measured:
        raise TuneError("no configuration could be measured")
    fastest = max(measured, key=lambda r: r.tps)
    # Equal decodes: within KEEP_WITHIN, or within each other's spread (a busy host's runs
    # scatter more than llama-bench's usual 1%).
    equals = [
        r
        for r in measured
        if r.tps >= fastest.tps * (1 - KEEP_WITHIN)
        or r.tps + r.spread >= fastest.tps - fastest.spread
    ]
    return kept_or_best(
        equals, lambda r: r.prompt_tps, lambda r: r.candidate == planned, keep_within=KEEP_WITHIN
    )


def table(results: list[Measured], chosen: Measured, roofline: float | None) -> str:
    lines = [f"{'configuration':<32}{'decode t/s':>11}{'+-':>7}{'prompt t/s':>12}  note"]
    for result in results:
        cells = f"{result.tps:>11.1f}{result.spread:>7.1f}{result.prompt_tps:>12.1f}"
        note = tuned_note(result.skipped, result is chosen)
        if result.tps and roofline:
            note = f"{result.tps / roofline:.0%} of roofline {note}".strip()
        blank = f"{'-':>11}{'':>7}{'-':>12}"
        lines.append(table_row(result.candidate.label, cells if result.tps else None, blank, note))
    if roofline:
        lines.append(f"memory-bandwidth roofline of the planned split: {roofline:.1f} t/s")
    return "\n".join(lines)


def plot(
    results: list[Measured],
    chosen: Measured,
    roofline: float | None,
    path: Path,
    drafts: list[DraftMeasured] = (),
    draft: DraftMeasured | None = None,
) -> bool:
    """A bar chart of the sweep with the roofline, and of the served draft lengths beside it;
    False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    measured = [r for r in results if r.tps]
    served = [r for r in drafts if r.tps]
    height = 0.4 * len(measured) + 1.5
    if not served:
        figure, axes = plt.subplots(figsize=(8, height))
    else:
        figure, (axes, draft_axes) = plt.subplots(
            1, 2, figsize=(12, height), gridspec_kw={"width_ratios": [2, 1]}
        )
        draft_axes.barh(
            [f"draft_max {r.draft_max}" for r in served],
            [r.tps for r in served],
            color=["tab:green" if r is draft else "tab:blue" for r in served],
        )
        draft_axes.set_xlabel("served decode tokens/s (llama-server, median)")
        draft_axes.invert_yaxis()
    colours = ["tab:green" if r is chosen else "tab:blue" for r in measured]
    axes.barh([r.candidate.label for r in measured], [r.tps for r in measured], color=colours)
    if roofline:
        axes.axvline(roofline, color="tab:red", label=f"roofline {roofline:.0f} t/s")
        axes.legend()
    axes.set_xlabel("decode tokens/s (llama-bench)")
    axes.invert_yaxis()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return True


def sweep(
    plan: HostPlan,
    header_inputs: dict,
    run: Callable[[str, float], tuple[int, str, str]],
    cpu_count: int,
    record: SweepRecord,
    deadline: float,
    say: Callable[[str], None],
) -> list[Measured]:
    """Plan and measure every candidate until ``deadline`` (time.monotonic), reusing what
    ``record`` holds for the same build and model."""
    saved = record.read()
    results = []
    quickest = None  # seconds of the quickest run so far
    for candidate in candidates(plan, cpu_count):
        result = Measured(candidate)
        results.append(result)
        if candidate.label in saved:
            kept = saved[candidate.label]
            if isinstance(kept, str):  # cut as slower: its run would be cut again
                result.skipped = kept
                say(f"  {candidate.label}: {kept} (measured before)")
                continue
            result.tps, result.spread, result.prompt_tps = kept
            say(f"  {candidate.label}: {result.tps:.1f} t/s (measured before)")
            continue
        trial = plan_host(plan.host, with_candidate(plan.resolved, candidate), **header_inputs)
        if not trial.fits:
            result.skipped = "does not fit: " + (trial.errors or ["memory"])[0].splitlines()[0]
            continue
        if time.monotonic() > deadline:
            result.skipped = throughput.TIME_BOUND_NOTE
            continue
        say(f"  {candidate.label}: measuring")
        cut = RUN_SECONDS if quickest is None else max(CUT_FLOOR_SECONDS, CUT_AFTER * quickest)
        remaining = deadline - time.monotonic()
        limit = max(1, round(min(cut, remaining)))
        started = time.monotonic()
        command = f"timeout -k 5 {limit} {bench_command(plan, candidate)}"
        status, output, error = run(command, limit + 30)
        seconds = time.monotonic() - started
        if status == TIMED_OUT:
            if remaining < cut:
                result.skipped = throughput.TIME_BOUND_NOTE
            elif quickest is None:
                result.skipped = f"cut after {limit} s"
            else:
                result.skipped = f"cut after {limit} s (the quickest run took {quickest:.0f} s)"
                saved[candidate.label] = result.skipped
                record.save(saved)
            continue
        try:
            if status:
                raise ValueError(error.strip().splitlines()[-1] if error.strip() else "failed")
            result.tps, result.spread, result.prompt_tps = bench_speeds(output)
        except ValueError as problem:
            result.skipped = f"llama-bench failed: {problem}"
            continue
        quickest = seconds if quickest is None else min(quickest, seconds)
        saved[candidate.label] = [result.tps, result.spread, result.prompt_tps]
        record.save(saved)
    return results


def _slots_busy(data: dict, run: throughput.Run) -> bool | None:
    """Whether any slot of the running server is processing a request (None: no answer)."""
    slots = shlex.quote(f"{render.base_url(data)}/slots")
    status, output, _ = run(f"curl -sS -f -m 5 {hostpaths.CURL_AUTH} -- {slots}", 30)
    if status:
        return None
    try:
        return any(slot.get("is_processing") for slot in json.loads(output))
    except (ValueError, AttributeError):
        return None


@contextmanager
def _service_stopped(data: dict, run: throughput.Run, force: bool, say: Callable[[str], None]):
    """The host's llama-server unit stopped for the sweep (it holds the memory and the cores
    llama-bench measures) and started again afterwards; refused while it serves a request."""
    service = f"{data['server']['service']}.service"
    unit = shlex.quote(service)
    active = (
        data["server"]["supervisor"] == "systemd"
        and not run(f"systemctl is-active --quiet -- {unit}", 120)[0]
    )
    if active and _slots_busy(data, run) and not force:
        raise TuneError(
            f"{service} is serving a request now; tune stops it for the sweep: try again when "
            "it is idle, or pass --force"
        )
    if active:
        say(f"  stopping {service} for the sweep")
        run(f"systemctl stop -- {unit}", 120)
    try:
        yield
    finally:
        if active:
            say(f"  starting {service} again")
            run(f"systemctl start -- {unit}", 120)


def _tune_throughput(plan: HostPlan, inputs: dict, run, files, deadline, say) -> Path:
    """The load sweep of `throughput` on ``plan``'s host; writes and returns the tuned file."""
    tuned_file, record, inventory = files
    data = throughput.temporary_server(plan.resolved)  # the clients load it
    start, stop = throughput.starter(run)
    tuned_server = (yaml.safe_load(tuned_file.read_text()) or {}) if tuned_file.is_file() else {}
    if (tuned_server.get("server") or {}).get("spec", {}).get("type") == throughput.SPEC_OFF:
        say(
            f"{plan.host}: speculative decoding is off in {tuned_file} (an earlier tune for "
            "throughput): delete server.spec.type there to weigh the rig's types again"
        )

    def fitting_start(candidate_data: dict) -> int:
        trial = plan_host(plan.host, candidate_data, **inputs)
        if not trial.fits:
            raise ValueError("does not fit: " + (trial.errors or ["memory"])[0].splitlines()[0])
        return start(trial.resolved)

    results, chosen, bound = throughput.sweep(
        data,
        run,
        fitting_start,
        stop,
        record.read(),
        record.save,
        deadline,
        say,
        data["tune"]["max_p95_ms"],
    )
    say(throughput.table(results, chosen, bound))
    if not bound:
        alone = next(r for r in results if r.candidate.parallel == 1)
        raise TuneError(
            f"{plan.host}: one client alone could not be measured, which sets the p95 gap "
            f"bound (tune.max_p95_ms: null): {alone.skipped}"
        )
    if chosen is None:
        raise TuneError(
            f"{plan.host}: no configuration was measured within the p95 gap bound of "
            f"{bound:.1f} ms (tune.max_p95_ms)"
        )
    write_tuned_throughput(tuned_file, plan.host, chosen, bound, record.identity)
    say(f"{plan.host}: tuned settings written to {tuned_file} ({chosen.candidate.label})")
    for line in overridden(inventory, plan.host, chosen.candidate.settings()):
        say(line)
    return tuned_file


# How long the host has to run `true` before tune says it does not answer.
REACH_TIMEOUT_S = 60


def _where(data: dict) -> str:
    return "this machine" if data["ssh"].get("local") else data["ssh"]["host"]


def _last_line(stderr: str, status: int) -> str:
    """What a command that failed said last (escaped), or its exit status."""
    return printable((stderr.strip().splitlines() or [f"exit status {status}"])[-1])


def _answers(name: str, data: dict) -> None:
    """Nothing when the host runs a command; else a TuneError naming the host and what
    failed (a host that does not answer is not one without llama-server)."""
    try:
        result = run_on_host(data, "true", timeout=REACH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise TuneError(
            f"{name}: {_where(data)} did not answer within {REACH_TIMEOUT_S} s; nothing was "
            "measured"
        ) from None
    if result.returncode != 0:
        raise TuneError(
            f"{name}: {_where(data)} did not answer "
            f"({_last_line(result.stderr, result.returncode)}); nothing was measured"
        )


def tune_host(
    host_config: HostConfig,
    inventory: Path,
    minutes: float,
    force: bool,
    say=print,
    goal: str = "decode",
) -> Path:
    """Sweep one host for ``goal`` (``decode``: one stream's speed, with llama-bench;
    ``throughput``: many clients at once, through llama-server) and write its tuned file;
    returns the file. Raises TuneError."""
    name = host_config.name
    if host_config.data["role"] == "gateway":
        rigs = sorted(
            {
                server["name"]
                for b in host_config.data["gateway"]["backends"]
                for server in b["servers"]
            }
        )
        raise TuneError(
            f"{name} is a gateway: it serves no model; tune the rigs it fronts ({', '.join(rigs)})"
        )
    if host_config.data["role"] == "builder":
        raise TuneError(f"{name} is a builder: it serves no model; tune the rigs it builds for")
    if is_router(host_config.data):
        raise TuneError(
            f"{name} serves several models (`models:`): tune measures one model's server; "
            "tune a rig of that model alone, then copy the settings into its entry"
        )
    if host_config.data["role"] == "rpc-worker":
        raise TuneError(f"{name} is an rpc-worker: tune its head, which runs the model")
    if goal == "decode" and "llama-bench" not in host_config.data["llama_cpp"]["targets"]:
        raise TuneError(
            f"{name}: llama_cpp.targets lacks llama-bench, which tune measures with: add it "
            "(e.g. [llama-server, llama-bench]) and deploy"
        )
    try:
        data = resolved(host_config.data)  # a Hugging Face reference as the deploy fetched it
    except HubError as error:
        raise TuneError(f"{name}: {'.'.join(error.key_path)}: {error.message}") from None
    _answers(name, data)  # else every probe below reads as "nothing there"
    plan, gathered = plan_for(name, data, shell_reader(data))
    inputs = gathered.plan_inputs()
    if not plan.fits:
        raise TuneError(f"{name}: the plan does not fit:\n" + "\n".join(plan.errors))

    def run(command: str, timeout: float) -> tuple[int, str, str]:
        result = run_on_host(data, command, timeout=timeout)
        return result.returncode, result.stdout, result.stderr

    binary = "llama-bench" if goal == "decode" else "llama-server"
    bench = f"{render.layout(plan.resolved)['current']}/bin/{binary}"
    there, _, said = run(f"test -x {shlex.quote(bench)}", 120)
    if there == 1:
        raise TuneError(f"{name}: {bench} is not there: deploy with {binary} in the targets")
    if there:
        raise TuneError(
            f"{name}: cannot run a command on {_where(data)}: {_last_line(said, there)}"
        )
    cpu_count = int(run("nproc", 120)[1].strip() or 1)
    tuned_file = tuned_path(inventory, name)
    identity = f"build {render.build_id(plan.resolved)}, model {render.layout(data)['model']}"
    record = SweepRecord(tuned_file.with_name(f".{name}.sweep.json"), identity)

    say(f"{name}: tuning for {goal}, for at most {minutes:g} minutes ({identity})")
    deadline = time.monotonic() + minutes * 60
    if goal == "throughput":
        with _service_stopped(data, run, force, say):
            files = (tuned_file, record, inventory)
            return _tune_throughput(plan, inputs, run, files, deadline, say)
    spec = plan.resolved["server"]["spec"]
    drafts, draft = [], None
    with _service_stopped(data, run, force, say):
        results = sweep(plan, inputs, run, cpu_count, record, deadline, say)
        chosen = winner(results, planned_candidate(plan))
        if spec["type"]:
            # Each draft length served with the chosen settings, resuming from the record.
            data = with_candidate(plan.resolved, chosen.candidate)
            label = chosen.candidate.label
            drafts = draft_sweep(data, label, run, record.read(), record.save, deadline, say)
            draft = draft_winner(drafts, spec["draft_max"])
    roofline = roofline_tps(plan)
    say(table(results, chosen, roofline))
    if spec["type"]:
        say(draft_table(drafts, draft, ",".join(spec["type"])))
    write_tuned(tuned_file, name, chosen, identity, draft)
    tuned_label = chosen.candidate.label + (f", draft_max {draft.draft_max}" if draft else "")
    say(f"{name}: tuned settings written to {tuned_file} ({tuned_label})")
    tuned = {k: v for k, v in chosen.candidate.settings().items() if v is not None}
    for line in overridden(inventory, name, tuned):
        say(line)
    picture = tuned_file.with_suffix(".png")
    if plot(results, chosen, roofline, picture, drafts, draft):
        say(f"{name}: plot {picture}")
    else:
        say(f"{name}: no plot (pip install matplotlib for one)")
    return tuned_file
