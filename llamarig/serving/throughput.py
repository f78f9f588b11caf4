"""`llamarig tune`'s measurements through a temporary llama-server of the deployed build, on
loopback on a port beside the service's, started outside the unit and stopped after: the load
sweep of `llamarig tune --for throughput`, and the temporary server that draft_tune.py serves
each draft length of speculative decoding with (llama-bench does not draft).

`llamarig tune --for throughput`: the server settings that serve a team best, measured on the
host with the deployed build: the most output tokens per second with as many clients at once as
the rig has slots, as long as the gap between two tokens of one client stays under a bound.

The sweep serves each candidate with a temporary llama-server on loopback (the rig's command
line, a port beside the service's) and sends it PARALLEL clients at once from
the host itself (curl, streamed, each prompt opening with its own line so no slot reuses another
slot's cached prompt), ROUNDS rounds of LOAD_TOKENS tokens each. The aggregate is the clients'
tokens over the round's wall time (the median round); the gaps between tokens are the server's
own timestamps (``timings_per_token``: ``predicted_ms`` grows with each token), so the network
between here and the host is not in them.

Stages, each from the best so far: ``parallel`` (1, 2, 4, ... up to what the context holds;
where the rig sets ``server.spec.type``, each value with speculative decoding on and off, since
drafting that wins one stream can lose under parallel load), then backend sampling (``-bs``) on
or off, then a unified KV cache (``-kvu``) on or off, then the logical and physical batch sizes
(``-b``/``-ub``, BATCH_PAIRS within the context). The bound on the p95 gap is
``tune.max_p95_ms``; null means P95_FACTOR times the median gap of one client alone (parallel 1,
measured first).
"""

from __future__ import annotations

import copy
import json
import math
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from llamarig.onhost import hostpaths
from llamarig.planner import render
from llamarig.serving.choice import kept_or_best

PARALLEL_VALUES = (1, 2, 4, 8, 16)
# (batch, ubatch): many clients' prompts arrive at once, so a larger physical batch may pay.
BATCH_PAIRS = ((2048, 256), (2048, 512), (2048, 1024), (4096, 1024), (4096, 2048))
# How speculative decoding is turned off under load (a type list, as `server.spec.type`).
SPEC_OFF = ["none"]
STAGES = 4
LOAD_TOKENS = 64
PROMPT_WORDS = 60
ROUNDS = 2
P95_FACTOR = 3
# Context each slot needs: the prompt (about 1.5 tokens a word) and the tokens, with room.
SLOT_TOKENS = 2 * (PROMPT_WORDS * 2 + LOAD_TOKENS)
# A candidate must beat the current settings by more than this to replace them.
KEEP_WITHIN = 0.05
REQUEST_SECONDS = 600
SECTION = "@@llamarig-load "
PROMPT_TEXT = (
    "Write a detailed travel guide about the mountains, rivers, villages, markets, food, music "
    "and history of a country you invent, with advice for each season of the year."
)

Run = Callable[[str, float], tuple[int, str, str]]


# What a sweep says of a configuration its time bound left unmeasured (tune resumes there).
TIME_BOUND_NOTE = "not measured (time bound; run tune again to resume)"


@dataclass(frozen=True)
class LoadCandidate:
    parallel: int
    backend_sampling: bool
    kv_unified: bool
    batch: int
    ubatch: int
    # The rig's speculative decoding on (True) or off (False); None: the rig sets none.
    spec: bool | None = None

    @property
    def label(self) -> str:
        spec = {True: "spec", False: "no spec", None: ""}[self.spec]
        flags = ("-bs" if self.backend_sampling else "", "-kvu" if self.kv_unified else "")
        batches = f"-b {self.batch} -ub {self.ubatch}"
        return " ".join(
            part for part in (f"parallel {self.parallel}", spec, *flags, batches) if part
        )

    def settings(self) -> dict:
        """The server settings of this candidate (``spec`` only where it turns drafting off)."""
        settings = {
            "parallel": self.parallel,
            "backend_sampling": self.backend_sampling,
            "kv_unified": self.kv_unified,
            "batch": self.batch,
            "ubatch": self.ubatch,
        }
        if self.spec is False:
            settings["spec"] = {"type": SPEC_OFF}
        return settings


@dataclass
class LoadMeasured:
    candidate: LoadCandidate
    tps: float | None = None  # aggregate output tokens/s, median round
    gap_p50_ms: float | None = None
    gap_p95_ms: float | None = None
    skipped: str = ""


def current(data: dict) -> LoadCandidate:
    server = data["server"]
    drafting = server["spec"]["type"] not in ([], SPEC_OFF)
    return LoadCandidate(
        server["parallel"],
        server["backend_sampling"],
        server["kv_unified"],
        server["batch"],
        server["ubatch"],
        True if drafting else None,
    )


def parallel_values(data: dict) -> list[int]:
    """The slot counts worth trying: those whose share of the context holds a request."""
    fitting = [p for p in PARALLEL_VALUES if data["server"]["ctx"] // p >= SLOT_TOKENS]
    return sorted({1, *fitting, data["server"]["parallel"]})


def batch_pairs(data: dict) -> list[tuple[int, int]]:
    """The (batch, ubatch) pairs worth trying: a batch beyond the context is the context."""
    server = data["server"]
    fitting = [(b, u) for b, u in BATCH_PAIRS if b <= server["ctx"]]
    return sorted({*fitting, (server["batch"], server["ubatch"])})


def with_load_candidate(data: dict, candidate: LoadCandidate) -> dict:
    changed = copy.deepcopy(data)
    settings = candidate.settings()
    spec = settings.pop("spec", {})
    changed["server"].update(settings)
    changed["server"]["spec"] = {**changed["server"]["spec"], **spec}
    return changed


def percentile(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def load_command(data: dict, clients: int, round_number: int) -> str:
    """``clients`` streamed completions started at once on the host, each to its own file;
    prints the round's start and end (the host's clock) and every reply."""
    url = shlex.quote(f"{render.base_url(data)}/completion")
    requests = []
    for client in range(clients):
        body = {
            "prompt": f"Request {round_number}-{client}.\n{PROMPT_TEXT}",
            "n_predict": LOAD_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "timings_per_token": True,
        }
        requests.append(
            f"curl -sS -N -f -m {REQUEST_SECONDS} {hostpaths.CURL_AUTH} "
            f"-H 'Content-Type: application/json' --data-binary {shlex.quote(json.dumps(body))} "
            f'-- {url} > "$d/{client}" 2>&1 &'
        )
    return "\n".join(
        [
            "d=$(mktemp -d) || exit 1; trap 'rm -rf \"$d\"' EXIT",
            "start=$(date +%s.%N)",
            *requests,
            "wait",
            f'echo "{SECTION}wall $start $(date +%s.%N)"',
            f'for f in "$d"/*; do echo "{SECTION}reply"; cat "$f"; echo; done',
        ]
    )


def parse_round(output: str, clients: int) -> tuple[float, list[float]]:
    """(aggregate tokens/s, the gaps between tokens in ms) of one round; ValueError when a
    reply is missing, failed or short."""
    wall, replies = None, []
    for block in output.split(SECTION)[1:]:
        kind, _, rest = block.partition(" " if block.startswith("wall") else "\n")
        if kind == "wall":
            start, end = (float(value) for value in rest.split()[:2])
            wall = end - start
        elif kind == "reply":
            replies.append(rest)
    if wall is None or wall <= 0 or len(replies) != clients:
        raise ValueError(f"{len(replies)} of {clients} replies came back")
    gaps, tokens = [], 0
    for reply in replies:
        stamps = []
        for line in reply.splitlines():
            if line.startswith("data: {"):
                timings = json.loads(line[len("data: ") :]).get("timings") or {}
                if timings.get("predicted_n"):
                    stamps.append((timings["predicted_n"], timings["predicted_ms"]))
        if not stamps or stamps[-1][0] != LOAD_TOKENS:
            last = reply.strip().splitlines()[-1:] or ["nothing"]
            raise ValueError(f"a reply ended before {LOAD_TOKENS} tokens: {last[0][:200]}")
        tokens += stamps[-1][0]
        # One timestamp per token count (a final chunk repeats the last).
        by_count = dict(stamps)
        times = [by_count[count] for count in sorted(by_count)]
        gaps += [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    return tokens / wall, gaps


def measure(data: dict, run: Run, start: Callable[[dict], int], stop: Callable[[int], None]):
    """Serve ``data`` with a temporary server and load it with ``parallel`` clients for ROUNDS
    rounds: (median aggregate tokens/s, p50 and p95 gap in ms)."""
    clients = data["server"]["parallel"]
    pid = start(data)
    try:
        rates, gaps = [], []
        for round_number in range(ROUNDS):
            status, output, error = run(load_command(data, clients, round_number), 900)
            if status:
                raise ValueError(error.strip() or "the load round failed")
            rate, round_gaps = parse_round(output, clients)
            rates.append(rate)
            gaps += round_gaps
    finally:
        stop(pid)
    if not gaps:
        raise ValueError("no gap between tokens was measured")
    return statistics.median(rates), percentile(gaps, 0.5), percentile(gaps, 0.95)


def winner(
    results: list[LoadMeasured], planned: LoadCandidate, bound_ms: float
) -> LoadMeasured | None:
    """The highest aggregate whose p95 gap is within ``bound_ms``; the current settings while
    within KEEP_WITHIN of it; None when none qualifies."""
    eligible = [r for r in results if r.tps and r.gap_p95_ms <= bound_ms]
    if not eligible:
        return None
    return kept_or_best(
        eligible, lambda r: r.tps, lambda r: r.candidate == planned, keep_within=KEEP_WITHIN
    )


def stages(data: dict, best: LoadCandidate, stage: int) -> list[LoadCandidate]:
    """The candidates of one stage, from the best so far."""
    if stage == 0:
        drafting = (True, False) if best.spec is not None else (None,)
        values = parallel_values(data)
        return [replace(best, parallel=p, spec=s) for p in values for s in drafting]
    if stage == 1:
        return [replace(best, backend_sampling=flag) for flag in (False, True)]
    if stage == 2:
        return [replace(best, kv_unified=flag) for flag in (False, True)]
    return [replace(best, batch=b, ubatch=u) for b, u in batch_pairs(data)]


def sweep(
    data: dict,
    run: Run,
    start: Callable[[dict], int],
    stop: Callable[[int], None],
    saved: dict,
    save: Callable[[dict], None],
    deadline: float,
    say: Callable[[str], None],
    max_p95_ms: float | None,
) -> tuple[list[LoadMeasured], LoadMeasured | None, float]:
    """Every stage until ``deadline``, reusing ``saved`` (label -> [tps, p50, p95]); returns
    the results, the winner and the p95 bound used."""
    planned = current(data)
    results: dict[LoadCandidate, LoadMeasured] = {}
    best, bound = planned, max_p95_ms
    for stage in range(STAGES):
        for candidate in stages(data, best, stage):
            if candidate in results:
                continue
            result = results[candidate] = LoadMeasured(candidate)
            key = f"load: {candidate.label}"
            if isinstance(saved.get(key), list):
                result.tps, result.gap_p50_ms, result.gap_p95_ms = saved[key]
                say(f"  {candidate.label}: {result.tps:.1f} t/s (measured before)")
            elif time.monotonic() > deadline:
                result.skipped = TIME_BOUND_NOTE
                continue
            else:
                say(f"  {candidate.label}: {candidate.parallel} client(s) at once")
                try:
                    measured = measure(with_load_candidate(data, candidate), run, start, stop)
                except (ValueError, KeyError) as problem:
                    result.skipped = f"failed: {problem}"
                    continue
                result.tps, result.gap_p50_ms, result.gap_p95_ms = measured
                saved[key] = list(measured)
                save(saved)
            if bound is None and candidate.parallel == 1 and result.gap_p50_ms:
                bound = P95_FACTOR * result.gap_p50_ms
        if bound is None:
            break  # one client alone could not be measured: no bound to judge by
        chosen = winner(list(results.values()), planned, bound)
        best = chosen.candidate if chosen else best
    chosen = winner(list(results.values()), planned, bound) if bound else None
    return list(results.values()), chosen, bound or 0.0


def table(results: list[LoadMeasured], chosen: LoadMeasured | None, bound: float) -> str:
    lines = [
        f"served with as many clients as slots, {LOAD_TOKENS} tokens each, {ROUNDS} rounds; "
        f"p95 gap bound {bound:.1f} ms:",
        f"{'configuration':<48}{'tokens/s':>10}{'gap p50 ms':>12}{'gap p95 ms':>12}  note",
    ]
    for result in results:
        if result.tps:
            numbers = f"{result.tps:>10.1f}{result.gap_p50_ms:>12.1f}{result.gap_p95_ms:>12.1f}"
            note = "<- tuned" if result is chosen else ""
            if result.gap_p95_ms > bound:
                # Two decimals: over a bound of 14.91, 14.93 would read as equal at one.
                note = f"p95 gap over the bound ({result.gap_p95_ms:.2f} > {bound:.2f} ms)"
        else:
            numbers, note = f"{'-':>10}{'':>12}{'':>12}", result.skipped
        lines.append(f"{result.candidate.label:<48}{numbers}  {note}")
    return "\n".join(lines)


# --- the temporary server ---

PORT_OFFSET = 1000
START_SECONDS = 600


def port_beside_service(data: dict) -> int:
    """The temporary server's port: beside the service's, never the service's own."""
    port = data["server"]["port"]
    return port + PORT_OFFSET if port + PORT_OFFSET <= 65535 else port - PORT_OFFSET


def temporary_server(data: dict) -> dict:
    """The rig data of a temporary server: ``data`` bound to loopback only, on a port beside
    the service's."""
    changed = copy.deepcopy(data)
    changed["server"]["port"] = port_beside_service(data)
    changed["server"]["host"] = "127.0.0.1"
    return changed


def starter(run: Run):
    """Functions that start a temporary server for some rig data (returning its pid, once it
    serves; ValueError with why when it does not) and stop it."""

    def start(data: dict) -> int:
        status, output, error = run(start_command(data), 60)
        if status:
            raise ValueError(error.strip() or "could not start llama-server")
        pid = int(output.strip().splitlines()[-1])
        status, _, error = run(wait_command(data, pid), START_SECONDS + 60)
        if status:
            stop(pid)
            raise ValueError(" / ".join(error.strip().splitlines()[-3:]) or "did not start")
        return pid

    def stop(pid: int) -> None:
        run(stop_command(pid), 60)

    return start, stop


def start_command(data: dict) -> str:
    """Start the planned llama-server outside the unit, detached from the ssh session, with
    the launcher's environment; prints its pid. Refuses a port something answers on."""
    environment = render.service_environment(data)
    home = shlex.quote(environment["HOME"])
    health = shlex.quote(f"{render.base_url(data)}/health")
    port = data["server"]["port"]
    return "; ".join(
        [
            *(f"export {key}={shlex.quote(value)}" for key, value in environment.items()),
            f"mkdir -p {home} && cd {home} || exit 1",
            # curl's 7: nothing listens there (connection refused).
            f"curl -s -o /dev/null -m 5 -- {health}; [ $? -eq 7 ] || "
            f"{{ echo 'port {port} is in use on the host' >&2; exit 3; }}",
            f"setsid {render.shell_join(render.foreground_args(data))} "
            "</dev/null >tune-draft.log 2>&1 & echo $!",
        ]
    )


def wait_command(data: dict, pid: int) -> str:
    """Wait for /health 200; fail with the log's last lines if the server exits first."""
    health = shlex.quote(f"{render.base_url(data)}/health")
    log = shlex.quote(f"{render.service_environment(data)['HOME']}/tune-draft.log")
    return (
        f"i=0; while [ $i -lt {START_SECONDS * 2} ]; do "
        f"curl -s -f -o /dev/null -m 5 -- {health} && exit 0; "
        f"kill -0 {pid} 2>/dev/null || {{ tail -n 5 {log} >&2; exit 1; }}; "
        "sleep 0.5; i=$((i+1)); done; echo 'not ready in time' >&2; exit 1"
    )


def stop_command(pid: int) -> str:
    return (
        f"kill {pid} 2>/dev/null; i=0; while kill -0 {pid} 2>/dev/null && [ $i -lt 60 ]; do "
        f"sleep 0.5; i=$((i+1)); done; kill -9 {pid} 2>/dev/null; true"
    )
