"""`llamarig tune`: measure, on the target with the deployed build, the configurations that fit,
and write the fastest to a tuned-settings file beside the inventory.

The sweep is a bounded list of llama-bench runs, each a decode (the speed a chat user feels)
and a prompt of PROMPT_TOKENS (what the micro-batch size changes):
split modes, the planned ratio and its neighbours and micro-batch sizes on a GPU rig; threads
and micro-batch sizes on a CPU rig. Each candidate is planned first (the memory plan refuses
what would not fit) and measured once per run of the command; results are kept in a sweep file
next to the tuned file, so a run cut short by its time bound resumes where it stopped; a
llama-bench run far slower than the quickest is cut on the host and kept as slower. The
winner is the fastest decode; among decodes within ``KEEP_WITHIN`` of it, the fastest prompt
processing; the planned configuration stays unless clearly beaten, so a re-run does not flip
between equals. With speculative decoding (``server.spec.type``), each draft length is then
served by a temporary llama-server on loopback, since llama-bench does not draft.
"""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import yaml

from llamarig.config import HostConfig
from llamarig.config.inventory import load_inventory, tuned_path
from llamarig.config.lock import resolved
from llamarig.model.catalog import is_router
from llamarig.model.reference import HubError
from llamarig.onhost import hostpaths
from llamarig.planner import render
from llamarig.planner.gather import plan_for, run_on_host, shell_reader
from llamarig.planner.plan import HostPlan, plan_host, roofline_tps
from llamarig.serving import throughput
from llamarig.tables.text import printable

UBATCH_SIZES = (256, 512, 1024)
RATIO_STEP = 0.05
DECODE_TOKENS = 64
PROMPT_TOKENS = 512
REPETITIONS = 3
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


@dataclass(frozen=True)
class Candidate:
    split_mode: str
    tensor_split: tuple[float, ...] | None
    ubatch: int
    threads: int | None

    @property
    def label(self) -> str:
        parts = [self.split_mode]
        if self.tensor_split:
            parts.append(":".join(f"{share:g}" for share in self.tensor_split))
        parts.append(f"ub {self.ubatch}")
        if self.threads:
            parts.append(f"t {self.threads}")
        return " ".join(parts)

    def settings(self) -> dict:
        """The server settings this candidate stands for, as the tuned file writes them."""
        return {
            "split_mode": self.split_mode,
            "tensor_split": list(self.tensor_split) if self.tensor_split else None,
            "ubatch": self.ubatch,
            "threads": self.threads,
        }


def planned_candidate(plan: HostPlan) -> Candidate:
    server = plan.resolved["server"]
    split = server["tensor_split"]
    return Candidate(
        server["split_mode"],
        tuple(round(share, 3) for share in split) if isinstance(split, list) else None,
        server["ubatch"],
        server["threads"],
    )


def _neighbour_ratios(ratio: tuple[float, ...]) -> list[tuple[float, ...]]:
    """The ratio and, for two GPUs, a step to either side (shares of the first card)."""
    if len(ratio) != 2:
        return [ratio]
    first = ratio[0]
    shares = [first - RATIO_STEP, first, first + RATIO_STEP]
    return [(round(s, 3), round(1 - s, 3)) for s in shares if 0 < s < 1]


def candidates(plan: HostPlan, cpu_count: int) -> list[Candidate]:
    """The configurations worth measuring on this rig, the planned one first."""
    data = plan.resolved
    server = data["server"]
    planned = planned_candidate(plan)
    ubatches = sorted({u for u in (*UBATCH_SIZES, server["ubatch"]) if u <= server["batch"]})
    found = [planned]
    if data["llama_cpp"]["backend"] != "cuda":
        threads = sorted({t for t in (cpu_count // 2, cpu_count, server["threads"]) if t})
        found += [Candidate("none", None, u, t) for t in threads for u in ubatches]
    else:
        ratio = planned.tensor_split or (
            tuple(round(s, 3) for s in plan.memory.ratio) if plan.memory else None
        )
        if len(plan.used_gpus) >= 2 and ratio:
            splits = [(mode, r) for mode in ("tensor", "layer") for r in _neighbour_ratios(ratio)]
        else:
            splits = [(planned.split_mode, planned.tensor_split)]
        found += [Candidate(m, r, u, planned.threads) for m, r in splits for u in ubatches]
    return list(dict.fromkeys(found))


def with_candidate(data: dict, candidate: Candidate) -> dict:
    changed = copy.deepcopy(data)
    changed["server"].update(candidate.settings())
    return changed


def bench_command(plan: HostPlan, candidate: Candidate) -> str:
    """The llama-bench command line for one candidate (decode only, JSON on stdout)."""
    data = with_candidate(plan.resolved, candidate)
    server = data["server"]
    paths = render.layout(data)
    flash_attn = "on" if candidate.split_mode == "tensor" else server["flash_attn"]
    args = [
        f"{paths['current']}/bin/llama-bench",
        "-m",
        paths["model"],
        "-p",
        str(PROMPT_TOKENS),
        "-n",
        str(DECODE_TOKENS),
        "-r",
        str(REPETITIONS),
        "-o",
        "json",
        "-b",
        str(server["batch"]),
        "-ub",
        str(candidate.ubatch),
        "-ctk",
        server["cache_type_k"],
        "-ctv",
        server["cache_type_v"],
        "-fa",
        flash_attn,
    ]
    if data["llama_cpp"]["backend"] == "cuda":
        layers = server["gpu_layers"]
        devices = render.cuda_device_names(data["gpus"])[: len(plan.used_gpus) or 1]
        args += ["-ngl", str(layers if isinstance(layers, int) else 999), "-sm"]
        args.append(candidate.split_mode)
        if candidate.split_mode == "none":
            devices = devices[:1]
        args += ["-dev", "/".join(devices)]
        if candidate.tensor_split and candidate.split_mode != "none":
            args += ["-ts", "/".join(f"{share:g}" for share in candidate.tensor_split)]
    if candidate.threads:
        args += ["-t", str(candidate.threads)]
    return render.shell_join(args)


def bench_speeds(output: str) -> tuple[float, float, float]:
    """Decode tokens/s, its spread and prompt tokens/s from llama-bench's JSON output."""
    rows = json.loads(output)
    decode = [row for row in rows if row.get("n_gen")]
    prompt = [row for row in rows if row.get("n_prompt") and not row.get("n_gen")]
    if not decode or not prompt:
        raise ValueError("llama-bench printed no decode and prompt results")
    return float(decode[0]["avg_ts"]), float(decode[0]["stddev_ts"]), float(prompt[0]["avg_ts"])


@dataclass
class Measured:
    candidate: Candidate
    tps: float | None = None  # decode
    spread: float | None = None
    prompt_tps: float | None = None
    skipped: str = ""  # why it was not measured: does not fit, failed, time bound


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
    best = max(equals, key=lambda r: r.prompt_tps)
    current = next((r for r in equals if r.candidate == planned), None)
    if current and current.prompt_tps >= best.prompt_tps * (1 - KEEP_WITHIN):
        return current
    return best


def _note(result: Measured | throughput.DraftMeasured, chosen: object) -> str:
    """A table row's note: why it was not measured, or that it is the one tuned."""
    return result.skipped or ("<- tuned" if result is chosen else "")


def table(results: list[Measured], chosen: Measured, roofline: float | None) -> str:
    lines = [f"{'configuration':<32}{'decode t/s':>11}{'+-':>7}{'prompt t/s':>12}  note"]
    for result in results:
        speed = (
            f"{result.tps:>11.1f}{result.spread:>7.1f}{result.prompt_tps:>12.1f}"
            if result.tps
            else f"{'-':>11}{'':>7}{'-':>12}"
        )
        note = _note(result, chosen)
        if result.tps and roofline:
            note = f"{result.tps / roofline:.0%} of roofline {note}".strip()
        lines.append(f"{result.candidate.label:<32}{speed}  {note}")
    if roofline:
        lines.append(f"memory-bandwidth roofline of the planned split: {roofline:.1f} t/s")
    return "\n".join(lines)


def draft_table(
    results: list[throughput.DraftMeasured], chosen: throughput.DraftMeasured | None, types: str
) -> str:
    lines = [
        f"served decode with --spec-type {types} ({len(throughput.DRAFT_PROMPTS)} prompts, "
        f"{throughput.DRAFT_TOKENS} tokens, greedy; median and range):",
        f"{'draft_max':<32}{'decode t/s':>11}{'range':>19}  note",
    ]
    for result in results:
        speed = (
            f"{result.tps:>11.1f}{f'{result.low:.1f}-{result.high:.1f}':>19}"
            if result.tps
            else f"{'-':>11}{'':>19}"
        )
        note = _note(result, chosen)
        lines.append(f"{result.draft_max:<32}{speed}  {note}")
    return "\n".join(lines)


def plot(
    results: list[Measured],
    chosen: Measured,
    roofline: float | None,
    path: Path,
    drafts: list[throughput.DraftMeasured] = (),
    draft: throughput.DraftMeasured | None = None,
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


def write_tuned(
    path: Path,
    host: str,
    chosen: Measured,
    identity: str,
    draft: throughput.DraftMeasured | None = None,
) -> None:
    settings = {k: v for k, v in chosen.candidate.settings().items() if v is not None}
    served = ""
    if draft:
        settings["spec"] = {"draft_max": draft.draft_max}
        served = (
            f"# draft_max {draft.draft_max} served at {draft.tps:.1f} t/s (median of "
            f"{len(throughput.DRAFT_PROMPTS)} greedy prompts of "
            f"{throughput.DRAFT_TOKENS} tokens).\n"
        )
    header = (
        f"# Written by `llamarig tune` for {host} on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC:\n"
        f"# {chosen.candidate.label} decoded at {chosen.tps:.1f} t/s, prompt at "
        f"{chosen.prompt_tps:.1f} t/s (llama-bench -n {DECODE_TOKENS} -p {PROMPT_TOKENS}, "
        f"{REPETITIONS} repetitions; {identity}).\n"
        f"{served}"
    )
    _write_tuned_file(path, header, settings)


def _write_tuned_file(path: Path, header: str, settings: dict) -> None:
    """A tuned file: what was measured as comment lines, then the settings under `server:`."""
    note = "# The loader merges it under the host's own settings; commit it like any other.\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + note + yaml.safe_dump({"server": settings}, sort_keys=False))


def sweep(
    plan: HostPlan,
    header_inputs: dict,
    run: Callable[[str, float], tuple[int, str, str]],
    cpu_count: int,
    sweep_file: Path,
    identity: str,
    deadline: float,
    say: Callable[[str], None],
) -> list[Measured]:
    """Plan and measure every candidate until ``deadline`` (time.monotonic), reusing what
    ``sweep_file`` holds for the same build and model (``identity``)."""
    saved = _saved(sweep_file, identity)
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
                _save(sweep_file, identity, saved)
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
        _save(sweep_file, identity, saved)
    return results


def _saved(sweep_file: Path, identity: str) -> dict:
    """What the sweep file holds for this build and model (empty for another): each result
    three numbers, or why a run was cut. The file is only a cache: one that cannot be read, or
    an entry of another shape (a damaged or edited file), is measured afresh."""
    try:
        document = json.loads(sweep_file.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(document, dict) or document.get("identity") != identity:
        return {}
    results = document.get("results")
    if not isinstance(results, dict):
        return {}
    return {key: value for key, value in results.items() if _result_shape(value)}


def _result_shape(value: object) -> bool:
    numbers = isinstance(value, list) and len(value) == 3
    return isinstance(value, str) or (
        numbers and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value)
    )


def _save(sweep_file: Path, identity: str, saved: dict) -> None:
    sweep_file.parent.mkdir(parents=True, exist_ok=True)
    sweep_file.write_text(json.dumps({"identity": identity, "results": saved}, indent=1))


def draft_sweep(
    plan: HostPlan,
    chosen: Candidate,
    run: Callable[[str, float], tuple[int, str, str]],
    sweep_file: Path,
    identity: str,
    deadline: float,
    say: Callable[[str], None],
) -> list[throughput.DraftMeasured]:
    """Each draft length served with ``chosen`` (``throughput.draft_sweep``) until
    ``deadline``, reusing what the sweep file holds."""
    return throughput.draft_sweep(
        with_candidate(plan.resolved, chosen),
        chosen.label,
        run,
        _saved(sweep_file, identity),
        lambda saved: _save(sweep_file, identity, saved),
        deadline,
        say,
    )


def draft_winner(
    results: list[throughput.DraftMeasured], planned: int | None
) -> throughput.DraftMeasured | None:
    """The fastest draft length; the planned one while within KEEP_WITHIN of it; None when
    none was measured."""
    measured = [r for r in results if r.tps]
    if not measured:
        return None
    fastest = max(measured, key=lambda r: r.tps)
    current = next((r for r in measured if r.draft_max == planned), None)
    if current and current.tps >= fastest.tps * (1 - KEEP_WITHIN):
        return current
    return fastest


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


def write_tuned_throughput(
    path: Path, host: str, chosen: throughput.LoadMeasured, bound: float, identity: str
) -> None:
    """Adds the load settings to the host's tuned file, keeping what an earlier tune for
    decode wrote there."""
    settings = {}
    if path.is_file():
        settings = (yaml.safe_load(path.read_text()) or {}).get("server") or {}
    load_settings = chosen.candidate.settings()
    # Drafting on again (or never varied) drops an earlier "off"; a decode draft_max stays.
    spec = {k: v for k, v in settings.pop("spec", {}).items() if k != "type"}
    spec |= load_settings.pop("spec", {})
    settings |= load_settings | ({"spec": spec} if spec else {})
    header = (
        f"# Written by `llamarig tune --for throughput` for {host} on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC:\n"
        f"# {chosen.candidate.label} served {chosen.tps:.1f} tokens/s with "
        f"{chosen.candidate.parallel} client(s) at once ({throughput.LOAD_TOKENS} tokens each, "
        f"median of {throughput.ROUNDS} rounds), gaps between tokens p50 "
        f"{chosen.gap_p50_ms:.1f} ms, p95 {chosen.gap_p95_ms:.1f} ms (bound {bound:.1f} ms; "
        f"{identity}).\n"
    )
    _write_tuned_file(path, header, settings)


def _tune_throughput(plan: HostPlan, inputs: dict, run, files, deadline, say) -> Path:
    """The load sweep of `throughput` on ``plan``'s host; writes and returns the tuned file."""
    tuned_file, sweep_file, identity, inventory = files
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
        _saved(sweep_file, identity),
        lambda saved: _save(sweep_file, identity, saved),
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
    write_tuned_throughput(tuned_file, plan.host, chosen, bound, identity)
    say(f"{plan.host}: tuned settings written to {tuned_file} ({chosen.candidate.label})")
    for line in overridden(inventory, plan.host, chosen.candidate.settings()):
        say(line)
    return tuned_file


def overridden(inventory: Path, host: str, settings: dict) -> list[str]:
    """The tuned ``settings`` that the host's own settings replace (they win over a tuned
    file), each naming the file that sets it."""
    loaded = load_inventory(inventory).hosts[host]
    lines = []
    for path, value in _leaves(settings, ("server",)):
        served = loaded.data
        for key in path:
            served = served[key]
        if served != value:
            lines.append(
                f"{host}: {'.'.join(path)} is {served!r} in {loaded.origins[path]}, which "
                f"wins over the tuned {value!r}: remove it there to serve the tuned value"
            )
    return lines


def _leaves(settings: dict, prefix: tuple) -> list[tuple[tuple, object]]:
    """(key path, value) of every value of nested ``settings`` that is not a mapping."""
    found = []
    for key, value in settings.items():
        if isinstance(value, dict):
            found += _leaves(value, (*prefix, key))
        else:
            found.append(((*prefix, key), value))
    return found


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
    sweep_file = tuned_file.with_name(f".{name}.sweep.json")
    identity = f"build {render.build_id(plan.resolved)}, model {render.layout(data)['model']}"

    say(f"{name}: tuning for {goal}, for at most {minutes:g} minutes ({identity})")
    deadline = time.monotonic() + minutes * 60
    if goal == "throughput":
        with _service_stopped(data, run, force, say):
            files = (tuned_file, sweep_file, identity, inventory)
            return _tune_throughput(plan, inputs, run, files, deadline, say)
    spec = plan.resolved["server"]["spec"]
    drafts, draft = [], None
    with _service_stopped(data, run, force, say):
        results = sweep(plan, inputs, run, cpu_count, sweep_file, identity, deadline, say)
        chosen = winner(results, planned_candidate(plan))
        if spec["type"]:
            drafts = draft_sweep(plan, chosen.candidate, run, sweep_file, identity, deadline, say)
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
