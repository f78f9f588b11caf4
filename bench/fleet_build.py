"""One build for the fleet against each rig compiling: the first converge of two fresh CPU rigs.

Two trixie sandboxes (``sandbox-fbb-1``, ``sandbox-fbb-2``; ssh 127.0.0.1:2270/2271, server
ports 8141/8142) get the demo rig (inventory/hosts.yml: llama-server at -O1, one decode thread,
speed unmeasured) serving the random-weight test model, with ``llama_cpp.ccache: false`` so that
every compile is a real one (the sandboxes share a ccache directory). Two arms:

- ``shared``: ``llama_cpp.share_builds: true`` (the default): the rigs share a build key, so
  the first compiles (both of its CPUs), its ``bin/`` is kept in the control machine's build
  cache and shipped to the second, which installs no compiler;
- ``each``: ``llama_cpp.share_builds: false``: each rig compiles its own, both at once.

``--rounds`` pairs, alternated (shared first, then each first, ...). Before every arm both
sandboxes are taken down and booted again (not timed), so every converge is a real first
converge, and the deploy gets a fresh, empty ``LLAMARIG_BUILD_CACHE``. Timed: the wall time of
``pyinfra -y inventory.py deploy.py``. Recorded beside it: each rig's build time (the deploy's
``built in`` line), the CPU seconds each rig's compile took (its configure and build, sampled
from this machine every half second: the subtree of the build's ``flock``, its own time and its
reaped children's) and each whole sandbox used during the converge, the machine's busy CPU
time, and what else ran. After each converge both servers must answer ``/health``, and the arm
must have done what it says: one rig built and kept its build, the other got it shipped
(``shared``); no build shipped and both built (``each``).

Writes ``bench/runs/fleet-build/results.json``, ``RESULTS.md`` and ``logs/`` (each converge's
pyinfra output) and the section between the ``bench/fleet_build.py`` markers of
``bench/RESULTS.md``. Exit status 0 when every converge succeeded, 2 when one failed (or the
sandboxes could not be booted). As root, under the sandbox lock:

    flock /tmp/llamarig-sandbox.lock .venv/bin/python -m bench.fleet_build --rounds 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

from bench import converge

PROJECT = Path(__file__).resolve().parent.parent
OUT_DIR = PROJECT / "bench" / "runs" / "fleet-build"
RESULTS_MD = PROJECT / "bench" / "RESULTS.md"
SECTION_BEGIN = "<!-- bench/fleet_build.py: begin -->"
SECTION_END = "<!-- bench/fleet_build.py: end -->"

BUILDER, RECEIVER = "sandbox-fbb-1", "sandbox-fbb-2"
NAMES = (BUILDER, RECEIVER)  # the inventory's order: the first of a key builds it
RELEASE = "trixie"
SSH_PORTS = {BUILDER: 2270, RECEIVER: 2271}
SERVER_PORTS = {BUILDER: 8141, RECEIVER: 8142}
ARMS = ("shared", "each")
ARM_LABELS = {
    "shared": "one build, shipped (share_builds: true)",
    "each": "each rig compiles (share_builds: false)",
}
CONVERGE_TIMEOUT_S = 3600
SAMPLE_S = 0.5
HEALTH_TIMEOUT_S = 120

# --- pure parts (tests/test_bench_fleet_build.py) ----------------------------------------------


def order(pair: int) -> tuple[str, str]:
    """The arms of pair ``pair``: shared first in even pairs, each-compiles first in odd ones."""
    return ARMS if pair % 2 == 0 else ARMS[::-1]


def plan(rounds: int) -> list[tuple[int, str]]:
    """Every converge of the run in order: (pair, arm)."""
    return [(pair, arm) for pair in range(rounds) for arm in order(pair)]


def rig(base: dict, name: str, info, share: bool) -> dict:
    """The demo rig ``base`` (inventory/hosts.yml's, not changed) on sandbox ``name``: its SSH
    port, key and known_hosts, its server port, one decode thread and its speed unmeasured, the
    random-weight test model (no answer to check), no ccache, builds shared or not."""
    data = yaml.safe_load(yaml.safe_dump(base))  # a deep copy
    data["ssh"].update(
        port=SSH_PORTS[name], key=str(info.key_path), known_hosts=str(info.known_hosts_path)
    )
    data["server"].update(port=SERVER_PORTS[name], threads=1, max_slowdown=None)
    data["model"] = {"url": info.test_model_url, "sha256": info.test_model_sha256}
    data.pop("expect", None)
    data["llama_cpp"].update(ccache=False, share_builds=share)
    return data


def write_inventory(path: Path, infos: dict, share: bool) -> Path:
    """The two rigs (``infos``: each sandbox's SandboxInfo by name), in NAMES' order."""
    demo = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    base = demo["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    hosts = {name: rig(base, name, infos[name], share) for name in NAMES}
    path.write_text(
        yaml.safe_dump({"all": {"children": {"rigs": {"hosts": hosts}}}}, sort_keys=False)
    )
    return path


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_DURATION = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?(\d+)s")
_BUILT = re.compile(r"\[(?P<host>[\w.-]+)\].*\bbuilt in (?P<time>(?:\d+h)?(?:\d+m)?\d+s)")
_KEPT = re.compile(
    r"\[(?P<host>[\w.-]+)\]\s+llamarig: build (?P<key>\S+) kept in \S+ \((?P<files>\d+) files,"
    r" (?P<mib>[\d.]+) MiB, (?P<seconds>[\d.]+) s\)"
)
_SHIPPED = re.compile(
    r"\[(?P<host>[\w.-]+)\]\s+llamarig: build (?P<key>\S+) shipped from (?P<source>\S+)"
    r" \((?P<files>\d+) files checked, (?P<seconds>[\d.]+) s\)"
)


def duration_s(text: str) -> int:
    """llamarig's durations (onhost/progress.format_duration): ``7s``, ``1m05s``, ``1h02m05s``."""
    match = _DURATION.fullmatch(text)
    if not match:
        raise ValueError(f"not a duration: {text!r}")
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def deploy_facts(output: str) -> dict:
    """What a deploy's output says of its builds: each rig's build time (``built in``), the
    build kept in the control machine's cache and the builds shipped."""
    text = _ANSI.sub("", output)
    built = {match["host"]: duration_s(match["time"]) for match in _BUILT.finditer(text)}
    kept = [
        {
            "host": match["host"],
            "key": match["key"],
            "files": int(match["files"]),
            "mib": float(match["mib"]),
            "seconds": float(match["seconds"]),
        }
        for match in _KEPT.finditer(text)
    ]
    shipped = [
        {
            "host": match["host"],
            "key": match["key"],
            "source": match["source"],
            "files": int(match["files"]),
            "seconds": float(match["seconds"]),
        }
        for match in _SHIPPED.finditer(text)
    ]
    return {"built_s": built, "kept": kept, "shipped": shipped}


def arm_problem(arm: str, facts: dict) -> str | None:
    """Why a converge did not do what its arm says (None when it did): ``shared``, the first
    rig built and kept its build and the second got it shipped from the first, without
    compiling; ``each``, both compiled and nothing was shipped."""
    built, kept, shipped = facts["built_s"], facts["kept"], facts["shipped"]
    if arm == "shared":
        if sorted(built) != [BUILDER]:
            return f"shared: expected only {BUILDER} to build, built: {sorted(built)}"
        if [entry["host"] for entry in kept] != [BUILDER]:
            return f"shared: expected {BUILDER} to keep its build, kept: {kept}"
        if [(entry["host"], entry["source"]) for entry in shipped] != [(RECEIVER, BUILDER)]:
            return f"shared: expected {RECEIVER} to get {BUILDER}'s build, shipped: {shipped}"
        if shipped[0]["key"] != kept[0]["key"]:
            return f"shared: kept {kept[0]['key']}, shipped {shipped[0]['key']}"
        return None
    if sorted(built) != sorted(NAMES):
        return f"each: expected both rigs to build, built: {sorted(built)}"
    if kept or shipped:
        return f"each: expected nothing kept or shipped, kept: {kept}, shipped: {shipped}"
    return None


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 1) if values else None


def summarize(records: list[dict]) -> dict:
    """Per arm the wall times and their median (and the medians of the build and CPU figures);
    the ratio of the medians (shared / each) and each pair's ratio."""
    arms = {}
    for arm in ARMS:
        mine = [record for record in records if record["arm"] == arm]
        walls = [record["wall_s"] for record in mine]
        compile_cpu = [
            sum(record["compile_cpu_s"].values())
            for record in mine
            if record.get("compile_cpu_s") is not None
        ]
        sandbox_cpu = [
            sum(record["sandbox_cpu_s"].values())
            for record in mine
            if record.get("sandbox_cpu_s") is not None
        ]
        builds = [max(record["built_s"].values()) for record in mine if record.get("built_s")]
        arms[arm] = {
            "runs": len(mine),
            "wall_s": walls,
            "wall_median_s": _median(walls),
            "longest_build_median_s": _median(builds),
            "compile_cpu_median_s": _median(compile_cpu),
            "sandbox_cpu_median_s": _median(sandbox_cpu),
        }
    shared, each = arms["shared"]["wall_median_s"], arms["each"]["wall_median_s"]
    by_pair: dict[int, dict[str, float]] = {}
    for record in records:
        by_pair.setdefault(record["pair"], {})[record["arm"]] = record["wall_s"]
    pair_ratios = [
        round(sides["shared"] / sides["each"], 3)
        for _, sides in sorted(by_pair.items())
        if "shared" in sides and "each" in sides
    ]
    return {
        "arms": arms,
        "ratio": round(shared / each, 3) if shared and each else None,
        "pair_ratios": pair_ratios,
    }


def _num(value: float | None, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def markdown_table(summary: dict) -> str:
    header = (
        "| arm | converges | wall s, each run | wall s, median | longest build s, median |"
        " compile CPU-s (both rigs), median | sandbox CPU-s (both rigs), median |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for arm in ARMS:
        row = summary["arms"][arm]
        lines.append(
            f"| {ARM_LABELS[arm]} | {row['runs']} |"
            f" {', '.join(_num(value) for value in row['wall_s']) or '-'} |"
            f" {_num(row['wall_median_s'])} | {_num(row['longest_build_median_s'])} |"
            f" {_num(row['compile_cpu_median_s'])} | {_num(row['sandbox_cpu_median_s'])} |"
        )
    return header + "\n".join(lines) + "\n"


def summary_line(summary: dict) -> str:
    shared, each = (summary["arms"][arm]["wall_median_s"] for arm in ARMS)
    ratio = summary["ratio"]
    saved = f", {(1 - ratio):.0%} less wall time" if ratio is not None else ""
    return (
        f"first converge of two rigs: shared build {_num(shared)} s, each compiles"
        f" {_num(each)} s (medians): shared / each {_num(ratio, 3)}{saved}"
    )


def markdown(results: dict) -> str:
    """The section for bench/RESULTS.md (and runs/fleet-build/RESULTS.md)."""
    meta, summary = results["meta"], results["summary"]
    pairs = ", ".join(_num(value, 3) for value in summary["pair_ratios"]) or "-"
    runs = "\n".join(
        f"- pair {record['pair'] + 1}, {record['arm']}: {record['wall_s']:.1f} s;"
        f" built: {_builds(record)}; compile CPU-s: {_per_host(record.get('compile_cpu_s'))};"
        f" sandbox CPU-s: {_per_host(record.get('sandbox_cpu_s'))}; machine busy"
        f" {_num(record['machine_busy_cpu_s'])} of {_num(record['machine_capacity_cpu_s'])}"
        f" CPU-s; {_moved(record)}; other sandbox tests: {len(record['others_sandbox_tests'])}"
        for record in results["runs"]
    )
    return (
        "## One build for the fleet: the first converge of two rigs\n\n"
        f"`bench/fleet_build.py`, {meta['started']} - {meta['finished']}, commit"
        f" `{meta['commit']}`, {meta['nproc']} x {meta['cpu_model']} ({meta['machine']});"
        f" llama.cpp `{meta['llama_cpp']}` (CPU, -O1, `llama-server`).\n\n"
        f"Two fresh Debian {RELEASE} sandboxes (`{BUILDER}`, `{RECEIVER}`, 2 CPUs shared with"
        " the machine) converged from nothing by one `pyinfra -y inventory.py deploy.py`: the"
        " demo rig serving the random-weight test model, `llama_cpp.ccache: false` in both arms"
        " (every compile a real one), a fresh empty `LLAMARIG_BUILD_CACHE` each time. Shared:"
        f" `{BUILDER}` compiles with both CPUs, its `bin/` is kept on the control machine and"
        f" shipped to `{RECEIVER}` (no compiler there); each compiles: `share_builds: false`,"
        f" both compile at once. {meta['rounds']} pair(s) alternated (shared first, then each"
        " first, ...), the sandboxes booted afresh before every converge (not timed). Wall"
        " time of the deploy; compile CPU-s: the configure and build of each rig, sampled"
        f" every {SAMPLE_S:g} s from the host; sandbox CPU-s: every process of each sandbox"
        " during the converge.\n\n"
        + markdown_table(summary)
        + f"\n{summary_line(summary)}; per pair: {pairs}.\n\nEach converge:\n\n{runs}\n"
    )


def _per_host(values: dict | None) -> str:
    if values is None:
        return "-"
    return " + ".join(f"{values[name]:.0f}" for name in NAMES if name in values)


def _builds(record: dict) -> str:
    built = record.get("built_s") or {}
    return ", ".join(f"{name} {built[name]} s" for name in NAMES if name in built) or "none"


def _moved(record: dict) -> str:
    parts = [
        f"kept by {entry['host']} ({entry['mib']:.1f} MiB, {entry['seconds']:.1f} s)"
        for entry in record.get("kept", [])
    ]
    parts += [
        f"shipped to {entry['host']} ({entry['seconds']:.1f} s)"
        for entry in record.get("shipped", [])
    ]
    return ", ".join(parts) or "nothing shipped"


def replace_section(document: str, section: str) -> str:
    """``document`` with the text between this bench's markers replaced by ``section``
    (appended with the markers when they are not there yet)."""
    return converge.replace_section(document, section, SECTION_BEGIN, SECTION_END)


# --- CPU time, read from this machine's /proc --------------------------------------------------


def process_table() -> dict[int, tuple[int, float]]:
    """Every process: pid -> (parent pid, CPU seconds of its own and of its reaped children)."""
    ticks = os.sysconf("SC_CLK_TCK")
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        # after the name: state ppid ... utime stime cutime cstime (fields 14-17 of proc(5))
        total = sum(int(value) for value in fields[11:15]) / ticks
        table[int(entry.name)] = (int(fields[1]), total)
    return table


def descendants(table: dict[int, tuple[int, float]], root: int) -> set[int]:
    """The processes below ``root`` (not ``root`` itself)."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, todo = set(), list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def tree_cpu_s(table: dict[int, tuple[int, float]], pids: set[int]) -> float:
    """CPU seconds of live processes, each with its reaped children's: a process reaped by a
    parent counts in the parent's, so none is counted twice."""
    return sum(table[pid][1] for pid in pids if pid in table)


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def nspawn_pid(name: str) -> int | None:
    """The host pid of sandbox ``name``'s systemd-nspawn."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        argv = _cmdline(int(entry.name))
        if argv and Path(argv[0]).name == "systemd-nspawn" and f"--machine={name}" in argv:
            return int(entry.name)
    return None


def is_build_lock(argv: list[str]) -> bool:
    """Whether a command line is one of cmake_build's: ``flock <build>/.llamarig-build.lock
    cmake ...`` (its configure, then its build)."""
    return (
        len(argv) > 2
        and Path(argv[0]).name == "flock"
        and argv[1].endswith("/.llamarig-build.lock")
        and Path(argv[2]).name == "cmake"
    )


class CompileSampler:
    """Samples, every SAMPLE_S, the CPU time of each sandbox's build commands (the subtree of
    each ``flock ... cmake`` of cmake_build); keeps each command's largest, which misses at most
    its last half second."""

    def __init__(self, roots: dict[str, int]):
        self.roots = roots
        self.seen: dict[tuple[str, int], float] = {}
        self.commands: dict[tuple[str, int], str] = {}
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> CompileSampler:
        self.thread.start()
        return self

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(SAMPLE_S)

    def sample(self) -> None:
        table = process_table()
        for name, root in self.roots.items():
            for pid in descendants(table, root):
                key = (name, pid)
                if key not in self.commands:
                    argv = _cmdline(pid)
                    if not is_build_lock(argv):
                        continue
                    self.commands[key] = " ".join(argv[2:4])
                below = descendants(table, pid) | {pid}
                self.seen[key] = max(self.seen.get(key, 0.0), tree_cpu_s(table, below))

    def stop(self) -> dict[str, float]:
        self.stop_event.set()
        self.thread.join()
        totals = dict.fromkeys(self.roots, 0.0)
        for (name, _pid), seconds in self.seen.items():
            totals[name] += seconds
        return {name: round(seconds, 1) for name, seconds in totals.items()}


def sandbox_cpu(roots: dict[str, int]) -> dict[str, float]:
    """CPU seconds every process of each sandbox has used so far (below its systemd-nspawn)."""
    table = process_table()
    return {name: tree_cpu_s(table, descendants(table, root)) for name, root in roots.items()}


# --- the sandbox run ---------------------------------------------------------------------------


class BenchError(Exception):
    """The benchmark could not measure (a boot or converge failed, an arm did not do what it
    says)."""


def _say(message: str) -> None:
    print(f"fleet-build bench: {message}", file=sys.stderr, flush=True)


def failure_lines(output: str, most: int = 60) -> str:
    """The lines of a failed deploy's output that name an error (its tail is pyinfra's table)."""
    lines = _ANSI.sub("", output).splitlines()
    said = [line for line in lines if re.search(r"rror|llamarig:|Traceback|xception", line)]
    return "\n".join(said[-most:])


def deploy(inventory: Path, cache: Path, log: Path) -> tuple[float, int, str]:
    """``pyinfra -y inventory.py deploy.py`` with the inventory and a build cache, its output
    written to ``log`` as it comes; (seconds, exit status, output)."""
    env = dict(
        os.environ,
        RIG_INVENTORY=str(inventory),
        LLAMARIG_BUILD_CACHE=str(cache),
        PYTHONUNBUFFERED="1",
    )
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    with log.open("w") as out:
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "pyinfra", "-y", "inventory.py", "deploy.py"],
            cwd=PROJECT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=CONVERGE_TIMEOUT_S,
            check=False,
        )
        seconds = time.perf_counter() - started
    return seconds, result.returncode, log.read_text(errors="replace")


def healthy(port: int) -> str:
    """The server's /health answer (loopback: the sandboxes share this machine's network)."""
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as reply:
                return reply.read().decode().strip()
        except OSError as error:
            if time.monotonic() > deadline:
                raise BenchError(f"no /health answer on port {port}: {error}") from None
            time.sleep(1)


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of all CPUs since boot (/proc/stat)."""
    ticks = os.sysconf("SC_CLK_TCK")
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _down_all() -> None:
    from llamarig_sandbox import sandbox

    for name in NAMES:
        try:
            sandbox.down(name)
        except Exception as error:  # noqa: BLE001 - say it, take the other down too
            _say(f"could not take {name} down: {error}")


def converge_arm(pair: int, arm: str, directory: Path, logs: Path) -> dict:
    """Boot both sandboxes afresh, converge them once for ``arm``; the record of that run."""
    from bench.gateway import others, sandbox_tests
    from llamarig_sandbox import sandbox

    _down_all()
    infos = {}
    try:
        for name in NAMES:
            _say(f"pair {pair + 1}, {arm}: booting {name}")
            infos[name] = sandbox.up(release=RELEASE, name=name, ssh_port=SSH_PORTS[name])
        roots = {name: nspawn_pid(name) for name in NAMES}
        if None in roots.values():
            raise BenchError(f"no systemd-nspawn found for a sandbox: {roots}")
        inventory = write_inventory(directory / f"{pair}-{arm}.yml", infos, arm == "shared")
        cache = directory / f"build-cache-{pair}-{arm}"
        cache.mkdir()
        log = logs / f"pair{pair + 1}-{arm}.log"
        record = {
            "pair": pair,
            "arm": arm,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_average_before": [round(value, 2) for value in os.getloadavg()],
            "others_sandbox_tests": sandbox_tests(),
            "others_busy": others(set(NAMES)),
        }
        _say(f"pair {pair + 1}, {arm}: converging (log: {log.relative_to(PROJECT)})")
        sandbox_before = sandbox_cpu(roots)
        busy_before, total_before = machine_busy()
        sampler = CompileSampler(roots).start()
        try:
            seconds, status, output = deploy(inventory, cache, log)
        finally:
            compile_cpu = sampler.stop()
        busy_after, total_after = machine_busy()
        sandbox_after = sandbox_cpu(roots)
        if status != 0:
            raise BenchError(
                f"pair {pair + 1}, {arm}: the deploy failed (exit {status}), see {log}:\n"
                + failure_lines(output)
            )
        facts = deploy_facts(output)
        problem = arm_problem(arm, facts)
        if problem:
            raise BenchError(f"pair {pair + 1}, {arm}: {problem} (see {log})")
        health = {name: healthy(SERVER_PORTS[name]) for name in NAMES}
        record.update(
            wall_s=round(seconds, 2),
            **facts,
            compile_cpu_s=compile_cpu,
            sandbox_cpu_s={
                name: round(sandbox_after[name] - sandbox_before[name], 1) for name in NAMES
            },
            machine_busy_cpu_s=round(busy_after - busy_before, 1),
            machine_capacity_cpu_s=round(total_after - total_before, 1),
            load_average_after=[round(value, 2) for value in os.getloadavg()],
            cache_entries=sorted(
                entry.name for entry in cache.iterdir() if not entry.name.startswith(".")
            ),
            health=health,
            log=str(log.relative_to(PROJECT)),
        )
        _say(
            f"pair {pair + 1}, {arm}: {seconds:.1f} s; built {facts['built_s']};"
            f" compile CPU-s {compile_cpu}; sandbox CPU-s {record['sandbox_cpu_s']}"
        )
        return record
    finally:
        _down_all()


def _git(*args: str) -> str:
    # Read only: no optional locks, so `git status` never refreshes the index.
    return subprocess.run(
        ["git", "--no-optional-locks", *args],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()


def run(rounds: int) -> dict:
    from llamarig.config import defaults

    dirty = (
        " (with uncommitted changes)"
        if _git("status", "--porcelain", "--untracked-files=no")
        else ""
    )
    memory_kib = int(Path("/proc/meminfo").read_text().split()[1])
    meta = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short=12", "HEAD") + dirty,
        "nproc": os.cpu_count(),
        "cpu_model": cpu_model(),
        "machine": f"{memory_kib / 2**20:.0f} GiB, Linux {platform.release()}",
        "llama_cpp": defaults()["llama_cpp"]["commit"][:12],
        "rounds": rounds,
        "python": platform.python_version(),
    }
    logs = OUT_DIR / "logs"
    shutil.rmtree(logs, ignore_errors=True)  # an earlier run's converges
    logs.mkdir(parents=True)
    records = []
    with tempfile.TemporaryDirectory(prefix="fleet-build-bench-") as name:
        for pair, arm in plan(rounds):
            records.append(converge_arm(pair, arm, Path(name), logs))
    meta["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return {"meta": meta, "summary": summarize(records), "runs": records}


def write(results: dict) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    section = markdown(results)
    (OUT_DIR / "RESULTS.md").write_text(section)
    RESULTS_MD.write_text(replace_section(RESULTS_MD.read_text(), section))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet_build", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternated pairs of converges (shared, each)"
    )
    args = parser.parse_args(argv)
    if not 1 <= args.rounds <= 20:
        parser.error("--rounds: 1..20")
    if os.geteuid() != 0:
        parser.error("the sandboxes need root (systemd-nspawn)")
    from llamarig_sandbox.processes import SandboxError

    try:
        results = run(args.rounds)
    except (BenchError, SandboxError, subprocess.TimeoutExpired) as error:
        print(f"fleet-build bench: failed: {error}", file=sys.stderr)
        return 2
    write(results)
    print(markdown_table(results["summary"]), end="")
    print(summary_line(results["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
