"""Upgrades may not get slower, on the sandbox for real: the rig serves the random-weight test
model (ctx 2048), then a config with ctx 1024 is deployed and made markedly slower (below). It
starts and answers, but decodes markedly slower than the version that served, measured in turns
with it (pace.ROUNDS looks at each), so the deploy rolls it back and fails with both speeds and
their spread; the rig converges again without a change. Then the record of the version that
served is inflated fivefold (as a record taken at a quiet moment of a busy host looks): a
version just as fast (without `--metrics`, and without the API key of the last one) is measured
side by side with the last one, which starts again with its key, and stays; then the key files
go. Last, the new version is slowed while it is measured, until the last version is measured
again (a busy spell, as failed a CI run): its look after the last version's finds it as fast,
and it stays.

The test model, not SmolLM2: the guard's looks are completions of pace.DECODE_TOKENS, so this
module's time is mostly decoding. On one thread SmolLM2 decodes at 76-79 tokens/s on the 2-core
CI machine of 2026-12-06 and the test model at 1,365-1,434 (best of 3 completions of 200
tokens each, side by side in one sandbox): the module took 380 s with SmolLM2 and 98 s with
the test model, quiet; 140 s beside the unit tests pinned to CPU 0, as CI runs it.

How slow is imposed, the same on any machine: the test stops the new version's llama-server
(SIGSTOP from the host, which sees the sandbox's processes) for 35 ms of every 40 ms, an eighth
of its speed. With a busy loop pinned to CPU 0 beside the unit tests pinned there, 190.2 tokens/s
at best against the last version's 2,035.1 (91% slower; the refusal bound, max_slowdown plus the
looks' spread, was 21%). Stopped for 30 ms of every 40 (a quarter) it was 408.6 against 1,545.5
(74%) with a bound of 64% there: a look is 3 completions of 0.1-1 s, so a scheduler's whim moves
it more than it moved SmolLM2's 2.5 s ones, and the margin is kept wide. The periods are short
for the same reason: with the 50 of every 100 ms used for SmolLM2 a completion would see one or
two. One thread against two is no reliable slowdown (122.5 against 156.4 tokens/s, 106.9
against 111.1 in a CI run, within the noise). Every version decodes on one thread: with a busy
loop pinned to one of the two CPUs (issue 24's CI under load), two spinning threads of which one
shares that CPU decode about 100-fold slower (0.98-1.57 tokens/s; the first converge's look did
not end in 5 minutes, 2026-12-03), while one thread runs on the other CPU.

A sandbox of its own (trixie, CPU rig, ssh port 2233, server port 8099), `max_slowdown` at its
default (10%).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from llamarig.serving.pace import ROUNDS
from tests import sandboxes
from tests.halting import SERVICE, halted_most_of_the_time, option
from tests.sandboxes import changed_operations, fresh_sandbox, in_sandbox

# `alone`: its verdicts rest on speeds measured on this machine, so the tiers run it after the
# other scenarios, by itself (scripts/test_tiers.sh).
pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy, pytest.mark.alone]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

NAME, SSH_PORT, SERVER_PORT = "sandbox-slow", 2233, 8099
BUSY_MAX_SLOWDOWN = 0.25
THREADS = 1


class Rig(NamedTuple):
    info: Any  # the sandbox's SandboxInfo
    directory: Path


def inventory(
    rig: Rig,
    ctx: int,
    metrics: bool = True,
    max_slowdown: float = 0.1,
    api_key_file: Path | None = None,
    drain_timeout: int = 120,
) -> Path:
    """The demo rig on this module's sandbox serving the random-weight test model (no answer
    to check) with ``ctx``, decoding on one thread (THREADS)."""
    keyed = {"api_key_file": str(api_key_file)} if api_key_file else {}

    def edit(host: dict) -> None:
        sandboxes.serving_the_random_model(host, rig.info)
        host["server"].update(
            port=SERVER_PORT,
            ctx=ctx,
            threads=THREADS,
            metrics=metrics,
            max_slowdown=max_slowdown,
            drain_timeout=drain_timeout,
            **keyed,
        )

    return sandboxes.demo_rig_inventory(
        rig.directory / f"ctx-{ctx}{'' if metrics else '-no-metrics'}-{max_slowdown}"
        f"{'-keyed' if keyed else ''}-drain-{drain_timeout}.yml",
        NAME,
        SSH_PORT,
        edit,
    )


@pytest.fixture(scope="module")
def rig(tmp_path_factory) -> Iterator[Rig]:
    sandbox = fresh_sandbox(NAME, "trixie", SSH_PORT)
    yield Rig(next(sandbox), tmp_path_factory.mktemp("slow"))
    next(sandbox, None)  # takes the sandbox down


def argv_running(info) -> list[str]:
    line = in_sandbox(info, f"systemctl show -P ExecStart {SERVICE}")
    return shlex.split(line.split("argv[]=", 1)[1].split(" ;", 1)[0])


def ctx_running(info) -> str:
    return option(argv_running(info), "-c")


def test_a_slower_version_is_rolled_back_with_both_speeds(rig):
    info = rig.info
    fast = inventory(rig, ctx=2048)
    sandboxes.converge(fast)
    recorded = in_sandbox(info, f"head -n1 /var/lib/llamarig/last-good/{SERVICE}/decode-tps")
    print(f"ctx 2048: {recorded} tokens/s recorded with the version that served")
    assert float(recorded) > 0 and ctx_running(info) == "2048"

    with halted_most_of_the_time(SERVER_PORT, lambda argv: option(argv, "-c") == "1024"):
        result = sandboxes.deploy(inventory(rig, ctx=1024))
    output = result.stdout + result.stderr
    print("\n".join(line for line in output.splitlines() if "decodes at" in line))
    assert result.returncode != 0, f"a markedly slower version must fail the run:\n{output[-3000:]}"
    slower = re.search(
        r"decodes at ([0-9.]+) tokens/s at best, (\d+)% slower than the last version's best, "
        r"([0-9.]+) tokens/s, ([0-9.]+) recorded, side by side: more than server.max_slowdown "
        r"10% plus the looks' spread: \d+% \((\d+) looks at the new version, [^;]+; (\d+) "
        r"looks at the last version",
        output,
    )
    assert slower, output[-4000:]
    print(f"ctx 1024, halted: {slower[1]} tokens/s against {slower[3]} ({slower[2]}% slower)")
    assert float(slower[4]) == float(recorded)
    assert (int(slower[5]), int(slower[6])) == (ROUNDS + 1, ROUNDS), "looks at each, in turns"
    assert float(slower[1]) < 0.9 * float(slower[3])
    assert re.search(r"rolled back: .* serves again after \d+ s", output), output[-4000:]
    assert ctx_running(info) == "2048"
    assert in_sandbox(info, f"systemctl is-active {SERVICE}") == "active"
    assert changed_operations(sandboxes.converge(fast)) == []


def test_a_record_from_a_quieter_moment_does_not_refuse_an_equal_version(rig):
    # The version that served holds an API key; the new one has none. Side by side, the last
    # version is started again with its key (loaded as a credential), so the key files may go
    # only once the new version is kept: measured without its key, it would answer 401.
    info, directory = rig
    key, key_file = sandboxes.new_api_key(directory)
    record = f"/var/lib/llamarig/last-good/{SERVICE}/decode-tps"
    sandboxes.converge(inventory(rig, ctx=2048, api_key_file=key_file))
    measured = float(in_sandbox(info, f"head -n1 {record}"))
    in_sandbox(info, f"sed -i '1s/.*/{measured * 5:.1f}/' {record}")

    result = sandboxes.deploy(inventory(rig, ctx=2048, metrics=False))
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"an equally fast version must serve:\n{output[-4000:]}"
    assert key not in output
    assert in_sandbox(info, "ls /etc/llamarig") == "llama-server.env", "the key files stay"
    print("\n".join(line for line in output.splitlines() if "decodes at" in line))
    assert "measuring the last version that served again, side by side" in output
    # Measured in turns, the two are as fast: the new version reaches the last one's best (or,
    # where load spread the looks, the host is too busy to call it slower) and stays.
    assert re.search(r"the new version decodes at [0-9.]+ tokens/s at best, .*: it stays", output)
    assert "look 1: the last version decodes at" in output, output[-4000:]
    assert "--metrics" not in argv_running(info) and ctx_running(info) == "2048"
    kept = float(in_sandbox(info, f"head -n1 {record}"))
    assert 0 < kept < measured * 5, "the record is the new version's own speed"
    assert changed_operations(sandboxes.converge(inventory(rig, ctx=2048, metrics=False))) == []


def test_a_busy_spell_while_the_new_version_is_measured_refuses_nothing(rig):
    # What failed a CI run: a server setting that changes no speed (ctx 2048 -> 1024: 136.1
    # against 134.9 tokens/s side by side, medians of 4 alternated runs) was refused, all six
    # runs of the new version 14% slow, the last version's right after them not. Here the new
    # version (no --metrics) is halted most of the time from the deploy's start until it says it
    # measures the last version again: an eighth of its speed, beyond BUSY_MAX_SLOWDOWN, and no
    # longer than that. The wider bound keeps noise from looking like a second busy spell: in
    # one CI run the same build decoded 105.4 on the second look against 120.1 (12% apart).
    info = rig.info
    record = f"/var/lib/llamarig/last-good/{SERVICE}/decode-tps"
    sandboxes.converge(inventory(rig, ctx=2048, max_slowdown=BUSY_MAX_SLOWDOWN))
    with halted_most_of_the_time(SERVER_PORT, lambda argv: "--metrics" not in argv) as busy_spell:

        def quiet_when_the_last_version_is_measured(line: str) -> None:
            if "measuring the last version that served again, side by side" in line:
                busy_spell.set()

        returncode, output = sandboxes.deploy_watched(
            inventory(rig, ctx=2048, metrics=False, max_slowdown=BUSY_MAX_SLOWDOWN),
            quiet_when_the_last_version_is_measured,
        )
    print("\n".join(line for line in output.splitlines() if "decodes at" in line))
    assert returncode == 0, f"an equally fast version must serve:\n{output[-4000:]}"
    assert "measuring the last version that served again, side by side" in output, output[-4000:]
    assert re.search(r"the new version decodes at [0-9.]+ tokens/s at best, .*: it stays", output)
    assert "--metrics" not in argv_running(info) and ctx_running(info) == "2048"
    assert in_sandbox(info, f"systemctl is-active {SERVICE}") == "active"
    kept = float(in_sandbox(info, f"head -n1 {record}"))
    assert kept > 0
    assert (
        changed_operations(
            sandboxes.converge(
                inventory(rig, ctx=2048, metrics=False, max_slowdown=BUSY_MAX_SLOWDOWN)
            )
        )
        == []
    )


@contextmanager
def busy_cpus() -> Iterator[None]:
    """One busy loop pinned to each CPU of this machine (``taskset -c N yes``), throughout."""
    loops = [
        subprocess.Popen(["taskset", "-c", str(cpu), "yes"], stdout=subprocess.DEVNULL)
        for cpu in sorted(os.sched_getaffinity(0))
    ]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


@contextmanager
def users_streaming(count: int, tokens: int) -> Iterator[list[tuple[str, bool]]]:
    """``count`` users, each streaming chat completions of ``tokens`` tokens one after another
    until the block ends; yields the endings so far: (HTTP status, ended with [DONE])."""
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Tell a long story about a llama."}],
            "max_tokens": tokens,
            "ignore_eos": True,
            "stream": True,
        }
    )
    argv = ["curl", "-sN", "--max-time", "300", "-w", "\nHTTP %{http_code}\n"]
    argv += ["-H", "Content-Type: application/json", "-d", body]
    argv += [f"http://127.0.0.1:{SERVER_PORT}/v1/chat/completions"]
    endings: list[tuple[str, bool]] = []
    stop = threading.Event()

    def user() -> None:
        while not stop.is_set():
            output = subprocess.run(argv, capture_output=True, text=True).stdout
            endings.append((output.rsplit("HTTP ", 1)[-1].strip(), "data: [DONE]" in output))

    users = [threading.Thread(target=user, daemon=True) for _ in range(count)]
    for thread in users:
        thread.start()
    try:
        yield endings
    finally:
        stop.set()
        for thread in users:
            thread.join(timeout=330)


# `soak`: 13 min 22 s here (2026-12-04), three deploys of 5 looks each under load: more than
# CI's whole alone phase, so it runs in its own tier (make test-soak), by itself.
@pytest.mark.soak
def test_a_ctx_change_with_users_and_every_cpu_busy_is_kept_three_times(rig):
    """A change that makes nothing slower (ctx) is kept while 4 users stream and a
    busy loop is pinned to each CPU, three times in a row: the new and the last version are
    measured in turns under the same load, so the load cannot fake a slowdown. The drain is
    bounded at 5 s (the users never stop), so each restart cuts what runs then; the users go
    on against the next version."""
    info = rig.info
    sandboxes.converge(inventory(rig, ctx=2048, drain_timeout=5))
    verdicts = []
    with busy_cpus(), users_streaming(4, tokens=64) as endings:
        for ctx in (1024, 2048, 1024):
            started = time.monotonic()
            result = sandboxes.deploy(inventory(rig, ctx=ctx, drain_timeout=5))
            output = result.stdout + result.stderr
            assert result.returncode == 0, f"ctx {ctx} must be kept:\n{output[-4000:]}"
            kept = re.search(r"the new version decodes at [0-9.]+ tokens/s at best, .*", output)
            verdicts.append((ctx, round(time.monotonic() - started), kept and kept[0]))
            assert ctx_running(info) == str(ctx)
        served = len(endings)
    print("\n".join(f"ctx {ctx} ({seconds} s): {verdict}" for ctx, seconds, verdict in verdicts))
    print(
        f"{served} user requests ended during the three deploys, {sum(d for _, d in endings)} whole"
    )
    # The users were served throughout, by every version (cut requests are the drain's bound).
    assert sum(1 for status, done in endings if status == "200" and done) >= 3 * 4, endings
    assert in_sandbox(info, f"systemctl is-active {SERVICE}") == "active"
    assert changed_operations(sandboxes.converge(inventory(rig, ctx=1024, drain_timeout=5))) == []
