"""What a no-op converge costs against a bare connection, on the sandbox, by model size (issue 19).

For each model size (GiB, ``--sizes``) the sandbox's CPU rig is converged onto a model file
already on the host (``model.path``): SmolLM2 padded with a sparse tail of zeros to that size
(llamarig_sandbox/bigmodel.py), so it really loads and answers. Then, on the converged rig:

- one checked no-op (``--json --debug``, not timed): nothing may change; pyinfra's debug log
  gives the commands it sends and how many name ``sha256sum``;
- ``--runs`` pairs, alternated (A B, B A, A B, ...): A = ``pyinfra -y inventory.py deploy.py``,
  B = ``pyinfra -y inventory.py exec -- true``, the same host and inventory; medians and their
  ratio, which issue 19 wants at or below 2x for every size.

During every no-op an inotify watch counts the opens of the sandbox's ``sha256sum`` binary (an
exec opens it: fs/exec.c calls fsnotify_open) and of the model file: what ran, not what a
command's text names (a record-aware check names ``sha256sum`` in a branch it does not take).

Writes ``bench/runs/converge/results.json``, ``RESULTS.md``, ``logs/`` (each size's commands)
and the section between the converge markers of ``bench/RESULTS.md``; prints one summary line
and exits 0 when every ratio is at most 2x, 1 when one is not, 2 when the run failed. Takes the
sandbox ``sandbox-bench`` (ssh 127.0.0.1:2236, server port 8096) up and down. Run it as root,
under the sandbox lock:

    flock /tmp/llamarig-sandbox.lock .venv/bin/python -m bench.converge --sizes 0.1,4,16 --runs 5
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

PROJECT = Path(__file__).resolve().parent.parent
OUT_DIR = PROJECT / "bench" / "runs" / "converge"
RESULTS_MD = PROJECT / "bench" / "RESULTS.md"
SECTION_BEGIN = "<!-- bench/converge.py: begin -->"
SECTION_END = "<!-- bench/converge.py: end -->"

NAME, RELEASE, SSH_PORT, SERVER_PORT = "sandbox-bench", "trixie", 2236, 8096
MODEL_DIR = "/srv/llamarig-bench"
MAX_RATIO = 2.0
DEFAULT_SIZES = (0.1, 4.0, 16.0)
DEFAULT_RUNS = 5
CONVERGE_TIMEOUT_S = 3600
NOOP_TIMEOUT_S = 1800

# --- pure parts (tests/test_bench_converge.py) -------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# pyinfra's connectors log each command they run at debug level (connectors/ssh.py
# run_shell_command; the CLI prefixes the module: "[pyinfra.connectors.ssh] ").
_RECORD_START = re.compile(r"^\s*\[pyinfra[\w.]*\] ", re.MULTILINE)
_COMMAND = re.compile(r"\[pyinfra\.connectors\.\w+\] Running command on (\S+?): \(pty=\w+\) ")
_UPLOAD = re.compile(r"\[pyinfra\.connectors\.\w+\] Attempting upload of ")
_SHA256SUM = re.compile(r"\bsha256sum\b")


def parse_sizes(text: str) -> list[float]:
    """``"0.1,4,16"`` -> [0.1, 4.0, 16.0]: sizes in GiB, each above zero."""
    try:
        sizes = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: give GiB like 0.1,4,16") from None
    if not sizes or any(size <= 0 for size in sizes):
        raise argparse.ArgumentTypeError(f"--sizes {text!r}: give GiB above 0, like 0.1,4,16")
    return sizes


def size_bytes(gib: float) -> int:
    return round(gib * 2**30)


def size_label(gib: float) -> str:
    return f"{gib:g} GiB"


def alternation(runs: int) -> list[tuple[str, str]]:
    """The order of each pair: ("noop", "bare") and ("bare", "noop") in turn, so neither
    always runs first (after the other warmed the connection or the caches)."""
    return [("noop", "bare") if index % 2 == 0 else ("bare", "noop") for index in range(runs)]


def ratio(noop_s: list[float], bare_s: list[float]) -> float:
    """Median no-op converge over median bare connection."""
    return statistics.median(noop_s) / statistics.median(bare_s)


@dataclass(frozen=True)
class CommandCount:
    commands: int  # shell commands sent (facts and operations alike)
    uploads: int
    naming_sha256sum: int  # commands whose text holds `sha256sum` (taken or not)
    command_lines: tuple[str, ...]  # each command, first line, for the log


def count_commands(debug_output: str) -> CommandCount:
    """What one pyinfra run sent, from its ``--debug`` log (stderr)."""
    text = _ANSI.sub("", debug_output)
    starts = [match.start() for match in _RECORD_START.finditer(text)] + [len(text)]
    commands: list[str] = []
    uploads = 0
    for begin, end in zip(starts, starts[1:], strict=False):
        record = text[begin:end].strip()
        command = _COMMAND.search(record)
        if command:
            commands.append(record[command.end() :])
        elif _UPLOAD.search(record):
            uploads += 1
    return CommandCount(
        commands=len(commands),
        uploads=uploads,
        naming_sha256sum=sum(1 for command in commands if _SHA256SUM.search(command)),
        command_lines=tuple(command.splitlines()[0] for command in commands),
    )


def size_row(measured: dict) -> dict:
    """One table row from one size's measurements."""
    noop_s, bare_s = measured["noop_s"], measured["bare_s"]
    size_ratio = ratio(noop_s, bare_s)
    return {
        "size": size_label(measured["size_gib"]),
        "noop_median_s": round(statistics.median(noop_s), 2),
        "bare_median_s": round(statistics.median(bare_s), 2),
        "ratio": round(size_ratio, 2),
        "within": size_ratio <= MAX_RATIO,
        "commands": measured["commands"],
        "bare_commands": measured["bare_commands"],
        "naming_sha256sum": measured["naming_sha256sum"],
        "sha256sum_runs": measured["sha256sum_runs"],
        "model_opens": measured["model_opens"],
    }


def markdown_table(rows: list[dict]) -> str:
    header = (
        "| model file | no-op converge, median s | `exec -- true`, median s | ratio | <= 2x |"
        " commands sent (no-op / bare) | commands naming `sha256sum` |"
        " `sha256sum` runs per no-op | model file opens per no-op |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {row['size']} | {row['noop_median_s']:.2f} | {row['bare_median_s']:.2f} |"
        f" {row['ratio']:.2f}x | {'yes' if row['within'] else 'NO'} |"
        f" {row['commands']} / {row['bare_commands']} | {row['naming_sha256sum']} |"
        f" {row['sha256sum_runs']} | {row['model_opens']} |"
        for row in rows
    ]
    return header + "\n".join(lines) + "\n"


def summary_line(rows: list[dict]) -> str:
    """One line: each size's ratio, and whether all are at most 2x."""
    parts = ", ".join(f"{row['size']} {row['ratio']:.2f}x" for row in rows)
    verdict = "all within" if all(row["within"] for row in rows) else "NOT all within"
    return f"no-op converge / bare connection: {parts}: {verdict} {MAX_RATIO:g}x"


def markdown(results: dict) -> str:
    """The section for bench/RESULTS.md (and runs/converge/RESULTS.md)."""
    meta = results["meta"]
    rows = [size_row(measured) for measured in results["sizes"]]
    runs = results["runs"]
    raw = "\n".join(
        f"- {size_label(m['size_gib'])}: no-op {', '.join(f'{s:.2f}' for s in m['noop_s'])} s;"
        f" bare {', '.join(f'{s:.2f}' for s in m['bare_s'])} s; first converge onto it"
        f" {m['converge_s']:.1f} s; {m['allocated_mib']} MiB on disk"
        for m in results["sizes"]
    )
    return (
        "## No-op converge against a bare connection, by model size (issue 19)\n\n"
        f"`bench/converge.py`, {meta['started']} - {meta['finished']}, commit"
        f" `{meta['commit']}`, {meta['machine']}; {meta['versions']}.\n\n"
        f"The sandbox's CPU rig (`{NAME}`, Debian {RELEASE}, loopback SSH) converged onto"
        " SmolLM2-135M Q4_1 padded with a sparse tail to each size (`model.path`, served and"
        f" answering), then {runs} pairs alternated (no-op first, then bare first, ...): no-op ="
        " `pyinfra -y inventory.py deploy.py` on the converged rig, bare ="
        " `pyinfra -y inventory.py exec -- true`. Medians of"
        f" {runs}; commands from one checked no-op's `--debug` log (0 operations changed);"
        " `sha256sum` runs and model file opens counted by inotify in the sandbox during the"
        " no-ops (their median).\n\n"
        + markdown_table(rows)
        + f"\n{summary_line(rows)}.\n\nEach run, in seconds:\n\n{raw}\n"
    )


def replace_section(
    document: str, section: str, begin: str = SECTION_BEGIN, end: str = SECTION_END
) -> str:
    """``document`` with the text between the markers ``begin`` and ``end`` (the converge
    bench's by default) replaced by ``section`` (appended with the markers when they are not
    there yet)."""
    block = f"{begin}\n{section.rstrip()}\n{end}"
    if begin in document and end in document:
        before, rest = document.split(begin, 1)
        return before + block + rest.split(end, 1)[1]
    return document.rstrip("\n") + "\n\n" + block + "\n"


# --- inotify: what ran in the sandbox ----------------------------------------------------------

IN_ACCESS, IN_CLOSE_NOWRITE, IN_OPEN, IN_Q_OVERFLOW = 0x1, 0x10, 0x20, 0x4000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_EVENT = struct.Struct("iIII")


class OpenCounter:
    """Counts the opens of files through inotify. Access and close events are watched too, so
    two opens in a row are never merged into one event (inotify merges identical events)."""

    def __init__(self, paths: dict[str, Path]):
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._labels: dict[int, str] = {}
        for label, path in paths.items():
            watch = self._libc.inotify_add_watch(
                self._fd, os.fsencode(path), IN_OPEN | IN_ACCESS | IN_CLOSE_NOWRITE
            )
            if watch < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
            self._labels[watch] = label

    def take(self) -> dict[str, int]:
        """Opens per label since the last call."""
        counts = dict.fromkeys(self._labels.values(), 0)
        while True:
            try:
                data = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return counts
            position = 0
            while position < len(data):
                watch, mask, _cookie, length = _EVENT.unpack_from(data, position)
                position += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:
                    raise RuntimeError("inotify queue overflowed: opens were not counted")
                if mask & IN_OPEN and watch in self._labels:
                    counts[self._labels[watch]] += 1

    def close(self) -> None:
        os.close(self._fd)


# --- the sandbox run ---------------------------------------------------------------------------


class BenchError(Exception):
    """The benchmark could not measure (a converge failed, the no-op changed something)."""


def _say(message: str) -> None:
    print(f"converge bench: {message}", file=sys.stderr, flush=True)


def pyinfra(inventory: Path, *args: str, timeout: int) -> tuple[float, subprocess.CompletedProcess]:
    """Run ``pyinfra -y ARGS...`` for the inventory; (seconds, result)."""
    env = dict(os.environ, RIG_INVENTORY=str(inventory))
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", *args],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return time.perf_counter() - started, result


def _must_succeed(result: subprocess.CompletedProcess, what: str) -> None:
    if result.returncode != 0:
        raise BenchError(f"{what} failed (exit {result.returncode}):\n{result.stderr[-4000:]}")


def write_inventory(directory: Path, known_hosts: str, model_path: str, sha256: str) -> Path:
    """The demo rig (inventory/hosts.yml's sandbox) on the bench sandbox, serving the model
    file at ``model_path`` on the host."""
    document = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    rig = document["all"]["children"]["sandbox"]["hosts"].pop("sandbox")
    rig["ssh"].update(port=SSH_PORT, known_hosts=known_hosts)
    rig["server"].update(port=SERVER_PORT)
    rig["model"] = {"path": model_path, "sha256": sha256}
    document["all"]["children"]["sandbox"]["hosts"][NAME] = rig
    path = directory / f"{Path(model_path).stem}.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def answers(port: int) -> str:
    """The served model's answer to the rig's question, asked from this machine (loopback)."""
    question = {
        "messages": [
            {"role": "user", "content": "What is the capital of France? Answer in one word."}
        ],
        "max_tokens": 8,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(question).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["choices"][0]["message"]["content"].strip()


def measure_size(info, size_gib: float, runs: int, directory: Path, logs: Path) -> dict:
    from llamarig_sandbox import bigmodel, layout, realmodel

    size = size_bytes(size_gib)
    source = layout.DOWNLOADS_DIR / realmodel.NAME
    model_path = f"{MODEL_DIR}/smollm2-135m-q4_1-padded-{size}.gguf"
    on_host = Path(info.root_dir) / model_path.lstrip("/")
    _say(f"{size_label(size_gib)}: sha256 of the padded file")
    digest = bigmodel.padded_sha256(source, size)
    bigmodel.place_padded(source, on_host, size)
    inventory = write_inventory(directory, info.known_hosts_path, model_path, digest)

    _say(f"{size_label(size_gib)}: converging onto {model_path}")
    converge_s, result = pyinfra(inventory, "inventory.py", "deploy.py", timeout=CONVERGE_TIMEOUT_S)
    _must_succeed(result, f"the converge onto {model_path}")
    reply = answers(SERVER_PORT)
    if "paris" not in reply.lower():
        raise BenchError(f"the rig on {model_path} answered {reply!r}, not Paris")
    for earlier in on_host.parent.glob("*.gguf"):  # the last size's, no longer served
        if earlier != on_host:
            earlier.unlink()

    counter = OpenCounter(
        {"sha256sum": Path(info.root_dir) / "usr/bin/sha256sum", "model": on_host}
    )
    try:
        _say(f"{size_label(size_gib)}: checked no-op (--json --debug)")
        _, checked = pyinfra(
            inventory, "--json", "--debug", "inventory.py", "deploy.py", timeout=NOOP_TIMEOUT_S
        )
        _must_succeed(checked, "the checked no-op converge")
        changed = [
            op["name"]
            for op in json.loads(checked.stdout)["results"]["operations"]
            if op["success"]
        ]
        if changed:
            raise BenchError(f"the no-op converge on {model_path} changed: {changed}")
        counted = count_commands(checked.stderr)
        opens = [counter.take()]
        _, bare_debug = pyinfra(
            inventory, "--debug", "inventory.py", "exec", "--", "true", timeout=NOOP_TIMEOUT_S
        )
        _must_succeed(bare_debug, "the bare connection")
        bare_count = count_commands(bare_debug.stderr)
        counter.take()
        (logs / f"commands-{size}.txt").write_text("\n".join(counted.command_lines) + "\n")

        times: dict[str, list[float]] = {"noop": [], "bare": []}
        argv = {
            "noop": ("inventory.py", "deploy.py"),
            "bare": ("inventory.py", "exec", "--", "true"),
        }
        for index, pair in enumerate(alternation(runs)):
            for kind in pair:
                seconds, result = pyinfra(inventory, *argv[kind], timeout=NOOP_TIMEOUT_S)
                _must_succeed(result, f"{kind} run {index + 1}")
                times[kind].append(seconds)
                taken = counter.take()
                if kind == "noop":
                    opens.append(taken)
            _say(
                f"{size_label(size_gib)}: pair {index + 1}/{runs}: no-op {times['noop'][-1]:.2f} s,"
                f" bare {times['bare'][-1]:.2f} s"
            )
    finally:
        counter.close()
    allocated = bigmodel.allocated_bytes(on_host)
    return {
        "size_gib": size_gib,
        "size_bytes": size,
        "allocated_mib": round(allocated / 2**20),
        "model_path": model_path,
        "sha256": digest,
        "answer": reply,
        "converge_s": round(converge_s, 2),
        "noop_s": [round(s, 3) for s in times["noop"]],
        "bare_s": [round(s, 3) for s in times["bare"]],
        "commands": counted.commands,
        "uploads": counted.uploads,
        "bare_commands": bare_count.commands,
        "naming_sha256sum": counted.naming_sha256sum,
        "sha256sum_runs": round(statistics.median(o["sha256sum"] for o in opens)),
        "model_opens": round(statistics.median(o["model"] for o in opens)),
        "opens_per_noop": opens,
    }


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=PROJECT, capture_output=True, text=True, check=False
    ).stdout.strip()


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    return f"{os.cpu_count()} x {cpu}, {memory_kib / 2**20:.0f} GiB, Linux {platform.release()}"


def versions(info) -> str:
    from llamarig.config import defaults
    from llamarig_sandbox import sshaccess

    coreutils = sshaccess.ssh(info, "sha256sum --version | head -n1", timeout=60).stdout.strip()
    return (
        f"Python {platform.python_version()}, pyinfra {metadata.version('pyinfra')},"
        f" paramiko {metadata.version('paramiko')}, llama.cpp"
        f" `{defaults()['llama_cpp']['commit'][:12]}` (CPU), sandbox: {coreutils}"
    )


def run(sizes: list[float], runs: int) -> dict:
    from llamarig_sandbox import sandbox

    dirty = (
        " (with uncommitted changes)"
        if _git("status", "--porcelain", "--untracked-files=no")
        else ""
    )
    meta = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short=12", "HEAD") + dirty,
        "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
        "machine": machine(),
    }
    logs = OUT_DIR / "logs"
    shutil.rmtree(logs, ignore_errors=True)  # an earlier run's sizes
    logs.mkdir(parents=True)
    measured = []
    sandbox.down(NAME)
    info = sandbox.up(release=RELEASE, name=NAME, ssh_port=SSH_PORT)
    try:
        meta["versions"] = versions(info)
        with tempfile.TemporaryDirectory(prefix="converge-bench-") as directory:
            for size_gib in sizes:
                measured.append(measure_size(info, size_gib, runs, Path(directory), logs))
    finally:
        sandbox.down(NAME)
    meta["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"meta": meta, "runs": runs, "max_ratio": MAX_RATIO, "sizes": measured}


def write(results: dict) -> list[dict]:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    section = markdown(results)
    (OUT_DIR / "RESULTS.md").write_text(section)
    RESULTS_MD.write_text(replace_section(RESULTS_MD.read_text(), section))
    return [size_row(measured) for measured in results["sizes"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/converge.py", description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=parse_sizes, default=list(DEFAULT_SIZES), help="GiB")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="alternated pairs")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if os.geteuid() != 0:
        parser.error("the sandbox needs root (systemd-nspawn)")
    from llamarig_sandbox.processes import SandboxError

    try:
        results = run(args.sizes, args.runs)
    except (BenchError, SandboxError, subprocess.TimeoutExpired) as error:
        print(f"converge bench: failed: {error}", file=sys.stderr)
        return 2
    rows = write(results)
    print(markdown_table(rows), end="")
    print(summary_line(rows))
    return 0 if all(row["within"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
