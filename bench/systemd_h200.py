"""The GPU measurements on the one-H200 machine, run by bench/systemd_h200.sh: the real deploy
over SSH into a systemd host with a real GPU (the root of llamarig_sandbox.systemdroot, booted
as tests/gpu boots it), then what it measures, into $OUT/results.json (written after each step)
with logs in $OUT/logs:

1. the first converge (timed: clone, CUDA build, hardened unit), the second, and NOOP_PAIRS no-op
   converges alternated with a bare `pyinfra exec -- true` (their medians and ratio),
2. decode speed through the unit, through `llamarig run` of the same launcher (the unit stopped
   first) and llama-bench of the same settings; nvidia-smi memory against the plan,
3. with BENCH_STEPS=throughput, `llamarig tune --for throughput` and the deploy that applies it.

What must hold (a second converge changes nothing, the unit's device filter, verify, a restart
without rebuild, a rollback) is tested by tests/gpu (bash bench/gpu_tests.sh).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OUT", "/srv/llamarig/out-systemd")

from bench import gpu_bench as bench  # noqa: E402
from llamarig.planner import render  # noqa: E402
from llamarig.tables.hardware import char_device_groups  # noqa: E402
from llamarig_sandbox.systemdroot import SystemdRoot  # noqa: E402

OUT = bench.OUT
LOGS = OUT / "logs"
SHIPPED_RIG = ROOT / "inventory" / "gpu-h200-systemd.yml"
HOST_NAME = "h200-systemd"
ROOT_DIR = Path("/srv/root")
# Parts of the root archive: carried with this call, or by an earlier call of the same lease.
ROOT_PARTS_DIRS = (bench.WORK / "stash", ROOT / ".carry" / "systemd-root")
ROOT_ARCHIVE = bench.WORK / "root.tar.xz"
MODEL = bench.MODELS / "llama-8b-q8_0.gguf"
MIRROR = bench.WORK / "llama.cpp.git"
# The NVIDIA nodes a CUDA process may open (the caps only exist where the driver made them).
NVIDIA_NODES = "/dev/nvidiactl /dev/nvidia[0-9]* /dev/nvidia-uvm /dev/nvidia-uvm-tools"
NVIDIA_NODES += " /dev/nvidia-caps/*"
LLAMA_BENCH_REPETITIONS = 5
NOOP_PAIRS = 5
# BENCH_STEPS=converge: stop after the converges (a short call when device time is short);
# throughput: after them, `llamarig tune --for throughput` and the deploys that apply it.
STEPS = os.environ.get("BENCH_STEPS", "all")
THROUGHPUT_MINUTES = 8

results: dict = {"started": bench.now()}
host_yaml = yaml.safe_load(SHIPPED_RIG.read_text())["all"]["children"]["gpu"]["hosts"][HOST_NAME]
SSH = host_yaml["ssh"]
# The rig as deployed: the shipped file plus an API key, kept on this machine (the control side).
# A shipped inventory loads on any machine, so it cannot name a key file only this one has.
API_KEY_FILE = bench.WORK / "api-key"
RIG = bench.WORK / f"{HOST_NAME}.yml"
TUNED = RIG.parent / "tuned" / f"{HOST_NAME}.yml"
SERVICE = "llama-server"
UNIT = f"{SERVICE}.service"
# The host: the root booted with systemd as PID 1, sshd on the rig's port.
BOX = SystemdRoot(ROOT_DIR, HOST_NAME, SSH, (bench.MODELS, MIRROR))


def save() -> None:
    (OUT / "results.json").write_text(json.dumps(results, indent=2, default=str))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def check(name: str, ok: bool, detail: object = None) -> bool:
    """One pass/fail line of the run, kept in results["checks"]."""
    results.setdefault("checks", []).append({"check": name, "ok": bool(ok), "detail": detail})
    log(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail is not None else ""))
    save()
    return bool(ok)


# --- the container --------------------------------------------------------------------------


# --- the deploy and the service -------------------------------------------------------------


def deploy(inventory: Path, log_name: str) -> tuple[dict, str]:
    """`pyinfra -y --json inventory.py deploy.py` with RIG_INVENTORY; its record and output."""
    run = bench.run_deploy(inventory, LOGS / log_name)
    entry: dict = {"seconds": run.seconds, "rc": run.rc}
    if run.changed_ops is not None:
        entry.update(changed_ops=run.changed_ops, changed=len(run.changed_ops))
    return entry, run.output


def main_pid() -> int:
    return int(BOX.run(f"systemctl show -P MainPID {UNIT}").stdout.strip())


def cmdline(pid: int) -> str:
    return BOX.run(f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout


def api_key() -> str:
    return API_KEY_FILE.read_text().strip()


def wait_healthy(base: str, process: subprocess.Popen | None = None, timeout: float = 600) -> float:
    start = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); see its log")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return round(time.monotonic() - start, 1)
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"{base}/health not 200 after {timeout} s")
        time.sleep(0.5)


def decode(base: str) -> dict:
    speeds = bench.decode_speeds(base, api_key())
    entry = {f"tps_{sampling}": values for sampling, values in speeds.items()}
    entry.update({f"median_{s}": round(statistics.median(v), 2) for s, v in speeds.items()})
    return entry


@contextlib.contextmanager
def launcher_serving(inventory: Path, base: str, log_path: Path):
    """`llamarig run` (ssh -t into the container, the deploy's launcher in the foreground),
    under a pseudo-terminal as at a user's terminal; stopped with Ctrl-C, which ssh passes on."""
    master, slave = os.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "llamarig.cli", "run"],
        cwd=ROOT,
        env=bench.env_for(inventory),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    log_file = open(log_path, "wb")

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            log_file.write(chunk)
            log_file.flush()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    stopped: dict = {}
    try:
        yield wait_healthy(base, process), stopped
    finally:
        with contextlib.suppress(OSError):
            os.write(master, b"\x03")
        try:
            process.wait(60)
            stopped["by"] = "ctrl-c"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(30)
            stopped["by"] = "sigterm"
        # The unit is stopped: a llama-server left in the container is this launcher's.
        left = BOX.run("pgrep -x llama-server", check_rc=False).stdout.split()
        stopped["left_running"] = left
        for pid in left:
            BOX.run(f"kill {int(pid)}", check_rc=False)
        reader.join(5)
        os.close(master)
        log_file.close()
        bench.wait_gpus_idle()


# --- the steps ------------------------------------------------------------------------------


def machine_facts() -> dict:
    def output(command: str) -> str:
        return subprocess.run(command, shell=True, capture_output=True, text=True).stdout.strip()

    return {
        "gpu": output(
            "nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,pci.bus_id "
            "--format=csv,noheader"
        ),
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "nvcc": output("/usr/local/cuda/bin/nvcc --version | tail -1"),
        "proc_devices_nvidia": [
            f"{major} {name}"
            for name, majors in char_device_groups(Path("/proc/devices").read_text()).items()
            for major in sorted(majors)
            if name.startswith("nvidia")
        ],
        "nvidia_nodes": output(f"ls -l {NVIDIA_NODES}").splitlines(),
    }


def prepare() -> dict:
    timings: dict = {}
    API_KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
    if not API_KEY_FILE.exists():
        API_KEY_FILE.write_text(secrets.token_hex(32) + "\n")
        API_KEY_FILE.chmod(0o600)
    overrides = bench.this_card_rig(host_yaml)  # the lease may lend an H100
    overrides["server"] = {"api_key_file": str(API_KEY_FILE)}
    bench.derived_inventory(SHIPPED_RIG, HOST_NAME, overrides)  # writes RIG
    model_written = bench.write_model_beside("llama-8b", MODEL)
    start = time.monotonic()
    if not BOX.unpacked():
        timings["root"] = BOX.unpack(ROOT_PARTS_DIRS, ROOT_ARCHIVE)
    BOX.configure()
    timings["unpack_configure_seconds"] = round(time.monotonic() - start, 1)
    timings["ssh_client"] = BOX.ssh_client(bench.WORK / "bin")
    timings["boot_seconds"] = BOX.boot(ROOT_ARCHIVE, LOGS / "boot.log")
    timings["ssh_seconds"] = BOX.wait_for_ssh()
    timings["model_write_seconds"] = model_written()
    container = {
        "systemd": BOX.run("systemctl --version | head -1").stdout.strip(),
        "state": BOX.run("systemctl is-system-running", check_rc=False).stdout.strip(),
        "failed_units": BOX.run("systemctl --failed --no-legend --plain").stdout.split("\n"),
        "os": BOX.run(". /etc/os-release; echo $PRETTY_NAME").stdout.strip(),
    }
    timings["container"] = container
    return timings


def run_tune(
    key: str, log_name: str, arguments: list[str], timeout: float
) -> subprocess.CompletedProcess:
    """`llamarig tune ARGUMENTS` against the rig: its output in LOGS/log_name, and
    results[key] with its exit status, seconds, output and the tuned file it wrote."""
    start = time.monotonic()
    tune = subprocess.run(
        [sys.executable, "-m", "llamarig.cli", "tune", *arguments],
        cwd=ROOT, env=bench.env_for(RIG), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    (LOGS / log_name).write_text(tune.stdout + tune.stderr)
    results[key] = {
        "rc": tune.returncode,
        "seconds": round(time.monotonic() - start, 1),
        "output": tune.stdout[-6000:],
        "tuned": TUNED.read_text() if TUNED.exists() else None,
    }
    save()
    return tune


def deploy_tuned(key: str, log_stem: str) -> tuple[dict, dict]:
    """The deploy that applies the tuned file and the one after it, recorded in results[key]."""
    applied, _ = deploy(RIG, f"{log_stem}.log")
    again, _ = deploy(RIG, f"{log_stem}-again.log")
    results[key].update(applied=applied, again=again)
    return applied, again


def tune_for_throughput() -> None:
    """Issue 29 on the GPU: `llamarig tune --for throughput` loads temporary servers of the
    rig's build and model with as many clients as slots, writes the winner, the next deploy
    serves it and the one after changes nothing. The shipped rig sets server.parallel (one
    stream, for the decode steps), which would win over the tuned value: dropped here first."""
    rig = yaml.safe_load(RIG.read_text())
    rig["all"]["children"]["gpu"]["hosts"][HOST_NAME]["server"].pop("parallel", None)
    RIG.write_text(yaml.safe_dump(rig))
    tune = run_tune(
        "tune_throughput",
        "tune-throughput.log",
        ["--for", "throughput", "--minutes", str(THROUGHPUT_MINUTES)],
        timeout=THROUGHPUT_MINUTES * 60 + 300,
    )
    if not check(
        "llamarig tune --for throughput writes a tuned file",
        tune.returncode == 0 and TUNED.exists(),
        (tune.stdout + tune.stderr)[-1500:],
    ):
        return
    applied, again = deploy_tuned("tune_throughput", "converge-throughput")
    served = cmdline(main_pid())
    results["tune_throughput"]["cmdline"] = served
    slots = yaml.safe_load(TUNED.read_text())["server"]["parallel"]
    check(
        "the deploy serves the tuned slots and the next one changes nothing",
        applied["rc"] == 0
        and again["rc"] == 0
        and again.get("changed") == 0
        and f" -np {slots} " in served,
        {"applied": applied.get("changed_ops"), "again": again.get("changed_ops"), "argv": served},
    )


def measure(data: dict, base: str) -> None:
    """Decode through the unit, memory against the plan; then the launcher; then llama-bench."""
    plan = bench.plan_for(data, MODEL)
    device = plan.memory.devices[0]
    entry: dict = {"unit": decode(base)}
    used = bench.memory_used()[0]
    entry["memory"] = {
        "planned_mib": device.planned_mib,
        "reserve_mib": device.reserve_mib,
        "buffers_mib": device.planned_mib - device.reserve_mib,
        "used_mib": used,
        "error_pct": round(100 * (device.planned_mib - used) / used, 2),
        "overhead_mib": used - (device.planned_mib - device.reserve_mib),
    }
    results["measure"] = entry
    save()
    log(f"unit: {entry['unit']['median_greedy']} t/s greedy; memory {entry['memory']}")
    BOX.run(f"systemctl stop {UNIT}")
    bench.wait_gpus_idle()
    with launcher_serving(RIG, base, LOGS / "launcher.log") as (seconds, stopped):
        entry["launcher"] = {"load_seconds": seconds, **decode(base)}
    entry["launcher"]["stopped"] = stopped
    save()
    log(f"launcher: {entry['launcher']['median_greedy']} t/s greedy")
    binary = f"{render.layout(data)['current']}/bin/llama-bench"
    command = [binary, "-m", str(MODEL), "-ngl", "99", *bench.BENCH_FLAGS, "-o", "json"]
    command[command.index("-r") + 1] = str(LLAMA_BENCH_REPETITIONS)
    run = BOX.run("CUDA_DEVICE_ORDER=PCI_BUS_ID " + shlex.join(command), check_rc=False)
    (LOGS / "llama-bench.log").write_text(
        f"# in the container\n$ {shlex.join(command)}\n{run.stderr}\n{run.stdout}"
    )
    if run.returncode == 0:
        (record,) = json.loads(run.stdout)
        entry["llama_bench"] = {
            "samples_ts": record["samples_ts"],
            "median_ts": round(statistics.median(record["samples_ts"]), 2),
            "avg_ts": record["avg_ts"],
            "stddev_ts": record["stddev_ts"],
        }
    else:
        entry["llama_bench"] = {"error": run.stderr.strip().splitlines()[-3:]}
    save()
    bench.wait_gpus_idle()
    BOX.run(f"systemctl start {UNIT}")
    entry["unit_restart_seconds"] = wait_healthy(base)
    # The unit once more: the spread between two measurements of the same thing.
    entry["unit_again"] = decode(base)
    save()


def bare_connection(inventory: Path) -> float:
    """Seconds of `pyinfra -y inventory.py exec -- true`: what any run pays to connect."""
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", "inventory.py", "exec", "--", "true"],
        cwd=ROOT,
        env=bench.env_for(inventory),
        capture_output=True,
        check=True,
        timeout=300,
    )
    return round(time.monotonic() - start, 2)


def noop_against_bare(inventory: Path) -> None:
    """NOOP_PAIRS no-op converges and bare connections, alternating which goes first."""
    noop, bare, changed = [], [], []
    for index in range(NOOP_PAIRS):
        for kind in ("noop", "bare") if index % 2 == 0 else ("bare", "noop"):
            if kind == "bare":
                bare.append(bare_connection(inventory))
                continue
            entry, _ = deploy(inventory, f"converge-noop-{index}.log")
            noop.append(entry["seconds"])
            changed.append(entry.get("changed"))
    record = {
        "noop_seconds": noop,
        "bare_seconds": bare,
        "noop_median": statistics.median(noop),
        "bare_median": statistics.median(bare),
        "changed": changed,
    }
    record["ratio"] = round(record["noop_median"] / record["bare_median"], 2)
    results["noop_against_bare"] = record
    check(
        f"no-op converge <= 2x a bare connection (median of {NOOP_PAIRS}, alternated), 0 changes",
        record["ratio"] <= 2 and changed == [0] * NOOP_PAIRS,
        {key: record[key] for key in ("noop_median", "bare_median", "ratio", "changed")},
    )


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    results["machine"] = machine_facts()
    save()
    results["prepare"] = prepare()
    save()
    log(f"container up: {results['prepare']}")
    data = bench.host_data(RIG)
    base = render.base_url(data)

    first, _ = deploy(RIG, "converge-first.log")
    results["converge_first"] = first
    if not check("first converge succeeds", first["rc"] == 0, first["seconds"]):
        return 1
    pid = main_pid()
    second, _ = deploy(RIG, "converge-second.log")
    second.update(pid_before=pid, pid_after=main_pid())
    results["converge_second"] = second
    check(
        "second converge: 0 changes, same MainPID",
        second["rc"] == 0 and second.get("changed") == 0 and second["pid_after"] == pid,
        {"seconds": second["seconds"], "changed": second.get("changed_ops"), "pid": pid},
    )
    noop_against_bare(RIG)
    save()
    if STEPS == "converge":
        return finish()
    if STEPS == "throughput":
        tune_for_throughput()
        return finish()
    build = BOX.run("cat /opt/llamarig/current/.llamarig-build.json").stdout
    cache = "/opt/llamarig/current/CMakeCache.txt"
    marker = "/opt/llamarig/current/.llamarig-build.json"
    seconds = BOX.run(f"echo $(( $(stat -c %Y {marker}) - $(stat -c %Y {cache}) ))").stdout
    results["build"] = {"manifest": json.loads(build), "seconds": int(seconds)}
    save()
    measure(data, base)
    return finish()


def finish() -> int:
    results["finished"] = bench.now()
    save()
    failed = [c["check"] for c in results["checks"] if not c["ok"]]
    log(f"done: {len(results['checks']) - len(failed)} checks passed, failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
