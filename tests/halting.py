"""A llama-server made markedly slower on any machine, for the slowdown guard's scenarios: the
host sees the sandboxes' processes, so it stops the chosen server (SIGSTOP) most of the time.
Why these periods and this priority: test_sandbox_slowdown's docstring."""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.synchronize
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from llamarig_sandbox.processes import signal_all

SERVICE = "llama-server"
HALTED_S, RUNNING_S = 0.035, 0.005


def option(argv: list[str], name: str) -> str | None:
    """The value that follows ``name`` in ``argv``, or None."""
    return next((value for flag, value in zip(argv, argv[1:], strict=False) if flag == name), None)


def server_processes(port: int, matches: Callable[[list[str]], bool]) -> list[int]:
    """PIDs of the llama-server processes listening on ``port`` (by their argv) whose argv
    ``matches``."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or (entry / "comm").read_text().strip() != SERVICE:
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue  # gone meanwhile
        if option(argv, "--port") == str(port) and matches(argv):
            pids.append(int(entry.name))
    return pids


@contextmanager
def halted_most_of_the_time(
    port: int, matches: Callable[[list[str]], bool]
) -> Iterator[multiprocessing.synchronize.Event]:
    """While inside, the servers on ``port`` whose argv ``matches`` are stopped for HALTED_S of
    every HALTED_S + RUNNING_S; setting the event yielded ends it early. Every process on the
    port is continued on the way out.

    The same slowness under any load: the servers are found afresh (a restart makes a new
    process) while the ones known are stopped, so a slow look through /proc lengthens a halt,
    never a run; and the signals come from a process of their own at a real-time priority, so
    neither a busy CPU nor this process's other threads delay a stop or a continue. Before, it
    looked through /proc while the servers ran: beside the unit tests' burst of interpreters a
    look of the halved version decoded at 70.3 tokens/s against 44-45 in the looks before it,
    and the rollback test_sandbox_slowdown proves did not happen (a CI run here, 2026-12-05).
    And it was a thread: beside 3 streaming clients' threads in the test's process and a burst
    of interpreters, it waited for the interpreter's lock while the halted server ran, and its
    third and fourth looks decoded at 262 and 658 tokens/s against 24-36 (2026-12-07)."""
    context = multiprocessing.get_context("fork")  # the matcher goes with it, unpickled
    done = context.Event()
    worker = context.Process(target=_stutter, args=(port, matches, done), daemon=True)
    worker.start()
    try:
        yield done
    finally:
        done.set()
        worker.join(timeout=10)
        if worker.is_alive():
            worker.kill()
        signal_all(server_processes(port, lambda argv: True), signal.SIGCONT)


def _stutter(
    port: int, matches: Callable[[list[str]], bool], done: multiprocessing.synchronize.Event
) -> None:
    with contextlib.suppress(OSError):  # without it, as a normal process
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    stopped: list[int] = []
    while not done.is_set():
        halt_ends = time.monotonic() + HALTED_S
        signal_all(stopped, signal.SIGSTOP)
        found = server_processes(port, matches)
        signal_all([pid for pid in found if pid not in stopped], signal.SIGSTOP)
        stopped = found
        time.sleep(max(0.0, halt_ends - time.monotonic()))
        signal_all(stopped, signal.SIGCONT)
        done.wait(RUNNING_S)
