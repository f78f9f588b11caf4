"""The restart command every llamarig restart runs (``operations.restart_command``), run by bash
against a stand-in `systemctl` and `journalctl` on PATH that record their calls: a start that
systemd refuses for want of a resource is tried once more, saying so; any other failure stands."""

from __future__ import annotations

import subprocess

import pytest

from llamarig import operations

SERVICE = "llama-server.service"

# Fails `restart` as many times as the file `failures` says (then succeeds), and answers
# `show -P Result` with the content of `result`; every call is appended to `calls`.
SYSTEMCTL = """#!/bin/sh
echo "systemctl $*" >> "$STANDIN/calls"
case "$1" in
  restart)
    left=$(cat "$STANDIN/failures")
    if [ "$left" -gt 0 ]; then
      echo $((left - 1)) > "$STANDIN/failures"
      echo "Job for $3 failed because of unavailable resources or another system error." >&2
      exit 1
    fi;;
  show) cat "$STANDIN/result";;
esac
exit 0
"""
JOURNALCTL = """#!/bin/sh
echo "journalctl $*" >> "$STANDIN/calls"
echo "llama-server.service: a journal line"
"""


def restart(tmp_path, failures: int, result: str) -> tuple[subprocess.CompletedProcess, list]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in (("systemctl", SYSTEMCTL), ("journalctl", JOURNALCTL)):
        (bin_dir / name).write_text(script)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "failures").write_text(f"{failures}\n")
    (tmp_path / "result").write_text(f"{result}\n")
    (tmp_path / "calls").write_text("")
    run = subprocess.run(
        ["bash", "-c", operations.restart_command(SERVICE)],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "STANDIN": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return run, (tmp_path / "calls").read_text().splitlines()


def restarts(calls: list[str]) -> int:
    return sum(call.startswith("systemctl restart") for call in calls)


def test_a_restart_that_starts_runs_once(tmp_path):
    run, calls = restart(tmp_path, failures=0, result="success")
    assert run.returncode == 0
    assert calls == [f"systemctl reset-failed -- {SERVICE}", f"systemctl restart -- {SERVICE}"]
    assert run.stderr == ""


def test_a_start_refused_for_resources_is_tried_once_more_saying_so(tmp_path):
    run, calls = restart(tmp_path, failures=1, result="resources")
    assert run.returncode == 0, run.stderr
    assert restarts(calls) == 2
    assert calls.index(f"systemctl reset-failed -- {SERVICE}", 2) > calls.index(
        f"systemctl show -P Result -- {SERVICE}"
    )
    assert f"llamarig: systemd could not start {SERVICE} (unavailable resources" in run.stderr
    assert "a journal line" in run.stderr


def test_a_second_refusal_fails_the_restart(tmp_path):
    run, calls = restart(tmp_path, failures=2, result="resources")
    assert run.returncode != 0
    assert restarts(calls) == 2


@pytest.mark.parametrize("result", ["exit-code", "start-limit-hit", "timeout"])
def test_any_other_failure_stands(tmp_path, result):
    run, calls = restart(tmp_path, failures=1, result=result)
    assert run.returncode != 0
    assert restarts(calls) == 1
    assert "trying once more" not in run.stderr
