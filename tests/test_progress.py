"""Progress of the long jobs: the parsers and formatters of llamarig.onhost.progress, the host-side
shell of a detached job (llamarig.onhost.hostjob) run for real here, and the progress lines pyinfra
prints for a throttled download and a build through the real operations on @local."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from llamarig.onhost import progress
from llamarig.onhost.hostjob import HostJob
from llamarig_sandbox.fileserver import make_server
from tests.test_operations import run_deploy

# --- parsers ------------------------------------------------------------------------------


def test_last_build_step_reads_ninja_and_make_counters():
    log = (
        "-- Configuring done\n[1/120] Building C object a.o\nwarning: [3/4] not at line start\n"
        "[57/120] Building CXX object ggml/src/ggml.cpp.o\nIn file included from x.h:3:\n"
    )
    assert progress.last_build_step(log) == progress.BuildStep(57, 120)
    assert progress.last_build_step(log).percent == 47
    make = "[  5%] Building C object a.o\n[ 42%] Building C object b.o\n"
    assert progress.last_build_step(make) == progress.BuildStep(42, 100, unit="%")
    assert progress.last_build_step("-- The C compiler identification is GNU\n") is None


def test_last_phase_is_the_last_mark():
    log = "llamarig-phase: download\nHTTP/1.1 200 OK\nllamarig-phase: sha256\n"
    assert progress.last_phase(log) == "sha256"
    assert progress.last_phase("HTTP/1.1 200 OK\n") is None


REDIRECT_THEN_RANGE = """llamarig-phase: download
HTTP/1.1 302 Found
Location: https://cdn.example/blob
Content-Length: 0

HTTP/2 206
content-range: bytes 1000-4999/5000
content-length: 4000

"""


@pytest.mark.parametrize(
    "headers, size",
    [
        ("HTTP/1.1 200 OK\r\nContent-Length: 30000000\r\n\r\n", 30_000_000),
        (REDIRECT_THEN_RANGE, 5000),
        ("HTTP/1.1 206 Partial Content\nContent-Range: bytes 0-9/*\n\n", None),
        ("HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n", None),
        ("HTTP/1.1 302 Found\nContent-Length: 0\n\n", None),
        ("llamarig-phase: download\n", None),
    ],
)
def test_expected_size_from_the_last_response(headers, size):
    assert progress.expected_size(headers) == size


def test_rate_meter_follows_the_recent_rate():
    meter = progress.RateMeter(window=10)
    assert meter.rate() is None
    for second in range(0, 21):
        # 1 MB/s for 10 s, then 3 MB/s.
        meter.add(
            second, second * 1_000_000 if second <= 10 else 10_000_000 + (second - 10) * 3_000_000
        )
    assert meter.rate() == pytest.approx(3_000_000)
    assert len(meter.samples) <= 12


def test_parse_poll_reads_each_state():
    running = progress.parse_poll("state running 42\nprobe 1024\n--- log\n[1/9] cc a.o\n")
    assert running == progress.JobPoll("running", None, 42, "1024", "[1/9] cc a.o\n")
    done = progress.parse_poll("state done 1 75\nprobe \n--- log\nerror: x\n")
    assert (done.state, done.exit_status, done.seconds, done.probe) == ("done", 1, 75, "")
    assert progress.parse_poll("state gone\nprobe \n--- log\n").state == "gone"
    # A truncated or empty answer is not taken for success.
    assert progress.parse_poll("").state == "gone"
    assert progress.parse_poll("state done\n--- log\n").state == "gone"


# --- formatters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),
        (30_000_000, "28.6 MiB"),
        (1000 * 2**20, "1000 MiB"),
        (31 * 2**30 + 2**29, "31.5 GiB"),
        (2000 * 2**30, "1.95 TiB"),
        (3 * 2**40, "3 TiB"),
    ],
)
def test_format_bytes(size, text):
    assert progress.format_bytes(size) == text


@pytest.mark.parametrize(
    "seconds, text", [(0, "0s"), (7.4, "7s"), (59.6, "1m00s"), (65, "1m05s"), (3725, "1h02m05s")]
)
def test_format_duration(seconds, text):
    assert progress.format_duration(seconds) == text


def test_download_line_has_bytes_rate_eta_and_elapsed():
    line = progress.download_line(2**30, 4 * 2**30, 64 * 2**20, 16)
    assert line == "1 GiB of 4 GiB (25%), 64 MiB/s, ETA 48s, 16s elapsed"
    assert progress.download_line(2**20, None, None, 3) == "1 MiB, -- B/s, 3s elapsed"
    assert "ETA --" in progress.download_line(0, 100, None, 1)


def test_build_line():
    assert progress.build_line(None, 12) == "configuring, 12s elapsed"
    assert progress.build_line(progress.BuildStep(123, 456), 123) == "[123/456] 26%, 2m03s elapsed"
    assert progress.build_line(progress.BuildStep(42, 100, "%"), 5) == "42%, 5s elapsed"


# --- the detached job's shell, run here ------------------------------------------------------


def sh(command: str) -> str:
    return subprocess.run(["sh", "-c", command], check=True, capture_output=True, text=True).stdout


def poll_until(job: HostJob, state: str, timeout: float = 20) -> progress.JobPoll:
    deadline = time.monotonic() + timeout
    while True:
        poll = progress.parse_poll(sh(job.poll_command()))
        if poll.state == state or time.monotonic() > deadline:
            return poll
        time.sleep(0.1)


def test_a_job_runs_detached_reports_and_ends_with_its_status(tmp_path):
    flag = tmp_path / "go"
    size_file = tmp_path / "size"
    script = (
        f"echo '[1/2] first'; printf 7 > {size_file}; while [ ! -f {flag} ]; do sleep 0.05; done\n"
    )
    script += "echo '[2/2] second'; exit 3"
    job = HostJob(str(tmp_path / "job"), script, probe=f"cat {size_file}")
    assert sh(job.start_command()).strip() == "started"
    poll = poll_until(job, "running")
    assert poll.state == "running" and poll.seconds is not None
    # A second start while it runs attaches instead of starting a copy.
    assert sh(job.start_command()).strip() == "attached"
    # One poll reads the probe before the log's tail: the line may show before the size does.
    deadline = time.monotonic() + 10
    while ("first" not in poll.log_tail or poll.probe != "7") and time.monotonic() < deadline:
        poll = poll_until(job, "running")
    assert poll.probe == "7" and progress.last_build_step(poll.log_tail) == progress.BuildStep(1, 2)
    flag.touch()
    poll = poll_until(job, "done")
    # `exit` in the script ends the script, not the wrapper that records the status.
    assert (poll.state, poll.exit_status) == ("done", 3)
    assert progress.last_build_step(poll.log_tail) == progress.BuildStep(2, 2)
    # Done, a start runs the job anew.
    flag.unlink()
    assert sh(job.start_command()).strip() == "started"
    flag.touch()
    assert poll_until(job, "done").exit_status == 3
    sh(job.cleanup_command())
    assert not (tmp_path / "job").exists()


def test_a_killed_job_is_gone_and_restarts(tmp_path):
    job = HostJob(str(tmp_path / "job"), "sleep 60")
    sh(job.start_command())
    assert poll_until(job, "running").state == "running"
    pid = (tmp_path / "job" / "pid").read_text().strip()
    sh(f"kill -9 {pid}")
    assert poll_until(job, "gone").state == "gone"
    assert sh(job.start_command()).strip() == "started"
    new_pid = (tmp_path / "job" / "pid").read_text().strip()
    assert new_pid != pid and poll_until(job, "running").state == "running"
    sh(f"kill -9 {new_pid}")


def test_another_script_does_not_attach(tmp_path):
    first = HostJob(str(tmp_path / "job"), "sleep 60")
    sh(first.start_command())
    pid = (tmp_path / "job" / "pid").read_text().strip()
    # Same directory, another recipe: a job of its own (the operation's lock orders them).
    second = HostJob(str(tmp_path / "job"), "exit 0")
    assert sh(second.start_command()).strip() == "started"
    assert poll_until(second, "done").exit_status == 0
    sh(f"kill -9 {pid}")


# --- through the real operations on @local ---------------------------------------------------

PROGRESS_LINE = re.compile(r"\[@local\] download: .*, \d+s elapsed")
DOWNLOAD_LINE = re.compile(
    r"\[@local\] download: ([\d.]+) (B|KiB|MiB) of 8 MiB \(\d+%\), [\d.]+ (KiB|MiB)/s, "
    r"ETA \d+s, \d+s elapsed"
)


@pytest.fixture
def trickling_server(tmp_path):
    """A loopback file server that sends 128 KiB every 0.125 s (1 MiB/s)."""
    root = tmp_path / "www"
    root.mkdir()
    server = make_server(root, 0)
    server.RequestHandlerClass.chunk_bytes = 128 << 10
    server.RequestHandlerClass.chunk_pause = 0.125
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_slow_download_shows_growing_progress_and_its_duration(tmp_path, trickling_server):
    www, url = trickling_server
    content = bytes(range(256)) * (8 * 4096)  # 8 MiB: about 8 s at 1 MiB/s
    (www / "m.gguf").write_bytes(content)
    dest = tmp_path / "m.gguf"
    digest = hashlib.sha256(content).hexdigest()
    body = (
        f"operations.fetch_checked(url='{url}/m.gguf', dest='{dest}', sha256='{digest}', "
        f"records='{tmp_path}/records')"
    )
    code, _, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    # A line every 3 s from the start.
    assert len(PROGRESS_LINE.findall(stderr)) >= 3, stderr
    lines = DOWNLOAD_LINE.findall(stderr)
    assert len(lines) >= 2, stderr
    factor = {"B": 1, "KiB": 1024, "MiB": 2**20}
    sizes = [float(number) * factor[unit] for number, unit, _ in lines]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0], stderr
    finished = re.search(r"download: downloaded 8 MiB in (\d+)s \(([\d.]+) (KiB|MiB)/s\)", stderr)
    assert finished, stderr
    assert 6 <= int(finished.group(1)) <= 40
    assert dest.read_bytes() == content
    assert not Path(f"{dest}.llamarig-job").exists()
    # Up to date: no job, no progress.
    code, results, stderr = run_deploy(tmp_path, body)
    assert (code, results["totals"]["success"]) == (0, 0)
    assert "download:" not in stderr


@pytest.mark.skipif(not shutil.which("ninja"), reason="needs ninja")
def test_a_build_shows_ninja_steps_and_its_duration(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    names = [f"f{number}.c" for number in range(40)]
    for number, name in enumerate(names):
        (source / name).write_text(f"int f{number}(void) {{ return {number}; }}\n")
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(p C)\n"
        f"add_library(l STATIC {' '.join(names)})\n"
    )
    # A compiler that takes its time, so the build outlasts a few polls.
    slow = tmp_path / "slowcc"
    slow.write_text('#!/bin/sh\nsleep 0.5\nexec "$@"\n')
    slow.chmod(0o755)
    build = tmp_path / "build"
    body = f"""
    operations.cmake_build(
        source='{source}', build_dir='{build}',
        configure=['cmake', '-S', '{source}', '-B', '{build}', '-G', 'Ninja',
                   '-DCMAKE_C_COMPILER_LAUNCHER={slow}'],
        build=['cmake', '--build', '{build}', '--parallel', '2'],
        manifest={{'recipe': 1}}, marker='{build}/.done.json',
    )
    """
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    steps = [
        (int(done), int(total))
        for done, total in re.findall(
            r"\[@local\] build: \[(\d+)/(\d+)\] \d+%, \d+s elapsed", stderr
        )
    ]
    assert len(steps) >= 3, stderr
    assert [done for done, _ in steps] == sorted(done for done, _ in steps)
    assert {total for _, total in steps} == {41}
    assert re.search(r"build: built in \d+s \(41 steps\)", stderr), stderr
    code, results, stderr = run_deploy(tmp_path, body)
    assert (code, results["totals"]["success"]) == (0, 0) and "build:" not in stderr


@pytest.mark.parametrize(
    "kib, shown", [(999.4, "999 KiB"), (999.7, "1000 KiB"), (1023, "1023 KiB")]
)
def test_sizes_just_under_a_thousand_units_are_written_out(kib, shown):
    # A download at 1018-1023 KiB/s was shown as "1e+03 KiB/s" (seen in a CI-like run).
    assert progress.format_bytes(kib * 1024) == shown
