"""A temporary llama-server of the deployed build for `llamarig tune`, on loopback on a port
beside the service's, started outside the unit and stopped after: the throughput sweep loads it
with clients, and with speculative decoding (``server.spec``) each draft length is served on it
and asked the same short prompts, greedy (llama-bench does not draft); the median decode speed
of the prompts is the draft length's."""

from __future__ import annotations

import copy
import json
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from llamarig import hostpaths, render, throughput

DRAFT_MAX_VALUES = (1, 2, 3, 4)
DRAFT_TOKENS = 128
DRAFT_PROMPTS = (
    "List the numbers from 1 to 40, separated by commas.",
    "Write a Python function that returns the sum of a list of integers, with a docstring.",
    "Repeat this sentence five times: the quick brown fox jumps over the lazy dog.",
)
PORT_OFFSET = 1000
START_SECONDS = 600


@dataclass
class DraftMeasured:
    draft_max: int
    tps: float | None = None  # the median of the prompts' decode speeds
    low: float | None = None  # the slowest and fastest prompt
    high: float | None = None
    skipped: str = ""


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


def draft_server_data(data: dict, draft_max: int) -> dict:
    """The temporary server of ``data`` (the rig with the tuned settings) with ``draft_max``."""
    served = temporary_server(data)
    served["server"]["spec"] = {**served["server"]["spec"], "draft_max": draft_max}
    return served


def starter(run: Callable[[str, float], tuple[int, str, str]]):
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


def draft_request_command(data: dict, prompt: str) -> str:
    """One greedy completion of exactly DRAFT_TOKENS tokens (past an end-of-text token, so a
    short answer does not count as a speed; no prompt cache between the runs)."""
    body = json.dumps(
        {
            "prompt": prompt,
            "n_predict": DRAFT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        }
    )
    url = shlex.quote(f"{render.base_url(data)}/completion")
    return (
        f"curl -sS -f -m 300 {hostpaths.CURL_AUTH} -H 'Content-Type: application/json' "
        f"--data-binary {shlex.quote(body)} -- {url}"
    )


def stop_command(pid: int) -> str:
    return (
        f"kill {pid} 2>/dev/null; i=0; while kill -0 {pid} 2>/dev/null && [ $i -lt 60 ]; do "
        f"sleep 0.5; i=$((i+1)); done; kill -9 {pid} 2>/dev/null; true"
    )


def _served_speeds(data: dict, run: Callable[[str, float], tuple[int, str, str]]) -> list[float]:
    """Start one temporary server, decode DRAFT_PROMPTS, stop it; raises ValueError."""
    start, stop = starter(run)
    pid = start(data)
    try:
        speeds = []
        for prompt in DRAFT_PROMPTS:
            status, output, error = run(draft_request_command(data, prompt), 360)
            if status:
                raise ValueError(error.strip() or "the completion failed")
            timings = json.loads(output)["timings"]
            if timings["predicted_n"] != DRAFT_TOKENS:
                raise ValueError(f"decoded {timings['predicted_n']} of {DRAFT_TOKENS} tokens")
            speeds.append(float(timings["predicted_per_second"]))
        return speeds
    finally:
        stop(pid)


def draft_sweep(
    data: dict,
    label: str,
    run: Callable[[str, float], tuple[int, str, str]],
    saved: dict,
    save: Callable[[dict], None],
    deadline: float,
    say: Callable[[str], None],
) -> list[DraftMeasured]:
    """Serve ``data`` (the rig with the chosen settings, ``label``) with each draft length in
    DRAFT_MAX_VALUES until ``deadline``, reusing what ``saved`` holds (the sweep file's
    results) and handing each new result to ``save``."""
    results = []
    for draft_max in DRAFT_MAX_VALUES:
        result = DraftMeasured(draft_max)
        results.append(result)
        name = f"{label}, draft_max {draft_max}"
        if isinstance(saved.get(name), list):
            result.tps, result.low, result.high = saved[name]
            say(f"  {name}: {result.tps:.1f} t/s served (measured before)")
            continue
        if time.monotonic() > deadline:
            result.skipped = throughput.TIME_BOUND_NOTE
            continue
        say(f"  {name}: measuring through llama-server")
        try:
            speeds = _served_speeds(draft_server_data(data, draft_max), run)
        except (ValueError, KeyError) as problem:
            result.skipped = f"llama-server failed: {problem}"
            continue
        result.tps = statistics.median(speeds)
        result.low, result.high = min(speeds), max(speeds)
        saved[name] = [result.tps, result.low, result.high]
        save(saved)
    return results


def draft_table(results: list[DraftMeasured], chosen: DraftMeasured | None, types: str) -> str:
    lines = [
        f"served decode with --spec-type {types} ({len(DRAFT_PROMPTS)} prompts, "
        f"{DRAFT_TOKENS} tokens, greedy; median and range):",
        f"{'draft_max':<32}{'decode t/s':>11}{'range':>19}  note",
    ]
    for result in results:
        speed = (
            f"{result.tps:>11.1f}{f'{result.low:.1f}-{result.high:.1f}':>19}"
            if result.tps
            else f"{'-':>11}{'':>19}"
        )
        note = result.skipped or ("<- tuned" if result is chosen else "")
        lines.append(f"{result.draft_max:<32}{speed}  {note}")
    return "\n".join(lines)
