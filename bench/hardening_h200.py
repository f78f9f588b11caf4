"""Issue 27 (item 5) on the one-H200 machine, run by bench/hardening_h200.sh: which of the
settings NixOS's services.llama-cpp adds beyond files/unit-hardening.j2 a CUDA llama-server
tolerates, and what they do to `systemd-analyze security` and to decode speed.

The container is bench/systemd_h200.py's (a Debian trixie root with systemd as PID 1, the
driver, the CUDA toolkit, the model and the llama.cpp mirror bound in; its helpers are imported).
llama-server is built inside it with the rig's cmake options (inventory/gpu-h200-systemd.yml:
90-real, Release, no NCCL), only that target. Then, per variant, one unit whose [Service] holds
the rig's command line (no API key) and the rendered files/unit-hardening.j2 plus the
variant's lines: the baseline (today's block), each candidate alone, the candidates that served
without slowing decode together, and the baseline again (the spread of two measurements of the
same thing). Per variant: does it serve on the GPU (the journal's `CUDA0 model buffer size`
line, the process's memory in nvidia-smi), its decode speed (greedy, n_predict 128,
ignore_eos, no prompt cache: median and best of DECODE_RUNS after one warm-up), and
`systemd-analyze security`'s exposure.

Everything lands in $OUT/results.json (written after each variant), logs in $OUT/logs.
"""

from __future__ import annotations

import json
import re
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import gpu_bench as bench  # noqa: E402
from bench import systemd_h200 as box  # noqa: E402
from llamarig.planner import render  # noqa: E402

OUT = bench.OUT
LOGS = OUT / "logs"
RIG = box.SHIPPED_RIG
MODEL = box.MODEL
SERVICE = "llama-server"
UNIT = f"{SERVICE}.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT}"
DECODE_RUNS = 5
# Decode may lose at most this share of the baseline's median for a setting to be kept.
DECODE_TOLERANCE = 0.02
# Seconds a variant may take to answer /health 200 (the 8B loads from the page cache in a few).
SERVE_TIMEOUT = 90
# llama.cpp's own INFO lines (`load_tensors: CUDA0 model buffer size = ...`) are logged from
# verbosity 4 (common_log_get_verbosity); the server's default, 3, shows only its own. A first
# run without it decoded the baseline at 206.29 t/s (median of 5); with it 207.17 and 209.47.
LOG_ARGS = ["-lv", "4"]
CANDIDATES = {
    "syscall-filter-privileged": ["SystemCallFilter=~@privileged"],
    "private-users": ["PrivateUsers=yes"],
    "private-mounts": ["PrivateMounts=yes"],
    "memory-deny-write-execute": ["MemoryDenyWriteExecute=yes"],
}
EVIDENCE = re.compile(r"CUDA0 model buffer size\s*=\s*[0-9.]+ MiB")
EXPOSURE = re.compile(r"Overall exposure level for \S+: ([0-9.]+)")
ITEM_EXPOSURE = re.compile(r"\s[0-9]+\.[0-9]+$")
ERROR_WORDS = re.compile(r"error|fail|denied|not permitted|cannot|unable|abort", re.IGNORECASE)

results: dict = {"started": bench.now(), "variants": []}


def save() -> None:
    (OUT / "results.json").write_text(json.dumps(results, indent=2, default=str))


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def prepare_root() -> dict:
    """The root of bench/systemd_h200.py, without its sshd (the unit needs none): the driver's
    and toolkit's libraries in ld.so's path."""
    entry: dict = {}
    if not box.BOX.unpacked():
        entry["root"] = box.BOX.unpack(box.ROOT_PARTS_DIRS, box.ROOT_ARCHIVE)
    box.BOX.library_paths()
    (box.BOX.root_dir / "etc/hostname").write_text("h200-hardening\n")
    for unit in ("ssh.service", "ssh.socket"):
        masked = box.BOX.root_dir / "etc/systemd/system" / unit
        if not masked.is_symlink():
            masked.symlink_to("/dev/null")
    return entry


def build(data: dict) -> dict:
    """Clone the pinned commit from the bound mirror and build llama-server in the container,
    as the deploy does (render's cmake commands); `current` points at the build."""
    paths = render.layout(data)
    commit = data["llama_cpp"]["commit"]
    binary = f"{paths['current']}/bin/llama-server"
    if box.BOX.run(f"test -x {binary}", check_rc=False).returncode == 0:
        return {"seconds": 0, "commit": commit, "note": f"{binary} kept from an earlier run"}
    script = " && ".join(
        [
            f"rm -rf {paths['source']}",
            f"git clone -q {box.MIRROR} {paths['source']}",
            f"git -C {paths['source']} checkout -q {commit}",
            shlex.join(render.cmake_configure_command(data)),
            shlex.join(render.cmake_build_command(data)),
            f"ln -sfn {paths['build']} {paths['current']}",
            "chmod -R a+rX /opt/llamarig",
        ]
    )
    start = time.monotonic()
    done = box.BOX.run(f"({script}) 2>&1", check_rc=False, timeout=900)
    seconds = round(time.monotonic() - start, 1)
    (LOGS / "build.log").write_text(f"$ {script}\n{done.stdout}{done.stderr}")
    if done.returncode:
        raise RuntimeError(f"the build failed ({done.returncode}): {done.stdout[-2000:]}")
    return {"seconds": seconds, "commit": commit, "options": render.cmake_options(data)}


def unit_text(data: dict, name: str, extra: list[str]) -> str:
    """The variant's unit: the rig's command line, the rendered hardening block, its lines."""
    plan = bench.plan_for(data, MODEL)
    args = [*render.server_args(plan.resolved), *LOG_ARGS]
    command = " ".join(render.systemd_quote(arg) for arg in args)
    hardening = (
        render._templates()
        .get_template("unit-hardening.j2")
        .render(service=SERVICE, device_allow=render.device_allow(data))
    )
    lines = [
        f"# bench/hardening_h200.py, variant {name}",
        "[Unit]",
        f"Description=llama-server under llamarig's hardening, variant {name}",
        "",
        "[Service]",
        "Type=exec",
        f"ExecStart={command}",
        "TimeoutStopSec=30",
        "",
        hardening.rstrip("\n"),
    ]
    if extra:
        lines += ["# The variant's settings.", *extra]
    return "\n".join(lines) + "\n"


def journal_cursor() -> str:
    shown = box.BOX.run("journalctl -n 1 --show-cursor --no-pager", check_rc=False).stdout
    found = re.search(r"-- cursor: (\S+)", shown)
    return found.group(1) if found else ""


def journal_since(cursor: str) -> str:
    after = f"--after-cursor='{cursor}' " if cursor else ""
    command = f"journalctl {after}-u {UNIT} -o short-monotonic --no-pager"
    return box.BOX.run(command, check_rc=False).stdout


def serve(base: str) -> tuple[bool, float, str]:
    """Until /health answers 200 (True), the unit is no longer active, or SERVE_TIMEOUT."""
    start = time.monotonic()
    while time.monotonic() - start < SERVE_TIMEOUT:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                if response.status == 200:
                    return True, round(time.monotonic() - start, 1), "healthy"
        except OSError:
            pass
        state = box.BOX.run(f"systemctl is-active {UNIT}", check_rc=False).stdout.strip()
        if state not in ("active", "activating", "reloading"):
            return False, round(time.monotonic() - start, 1), f"unit {state}"
        time.sleep(0.5)
    return False, float(SERVE_TIMEOUT), f"/health not 200 after {SERVE_TIMEOUT} s"


def gpu_processes() -> list[dict]:
    """nvidia-smi's compute processes (this machine's PIDs), each with its PID in the
    container (the last NSpid) and its name."""
    shown = subprocess.run(
        [
            "nvidia-smi",
            "--query-compute-apps=pid,process_name,used_memory",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
    ).stdout
    processes = []
    for line in shown.splitlines():
        pid, name, used = (field.strip() for field in line.split(","))
        entry = {"pid": int(pid), "name": name, "used_mib": int(used) if used.isdigit() else used}
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            nspid = re.search(r"^NSpid:\s+(.*)$", status, re.MULTILINE)
            entry["container_pid"] = int(nspid.group(1).split()[-1]) if nspid else None
        except OSError:
            entry["container_pid"] = None
        processes.append(entry)
    return processes


def process_facts(pid: int) -> dict:
    status = box.BOX.run(
        f"grep -E '^(Uid|CapEff|NoNewPrivs|Seccomp|Seccomp_filters):' /proc/{pid}/status",
        check_rc=False,
    ).stdout
    facts = {
        line.split(":", 1)[0]: " ".join(line.split(":", 1)[1].split())
        for line in status.splitlines()
    }
    uid_map = box.BOX.run(f"cat /proc/{pid}/uid_map", check_rc=False).stdout
    facts["uid_map"] = [" ".join(line.split()) for line in uid_map.splitlines()]
    return facts


def decode(base: str) -> dict:
    bench.completion(base, "greedy")
    speeds = [
        bench.completion(base, "greedy")["timings"]["predicted_per_second"]
        for _ in range(DECODE_RUNS)
    ]
    return {
        "tps": [round(value, 2) for value in speeds],
        "median": round(statistics.median(speeds), 2),
        "best": round(max(speeds), 2),
    }


def exposure(name: str) -> tuple[float | None, list[str]]:
    """`systemd-analyze security`'s overall number and the items it counts against the unit."""
    shown = box.BOX.run(f"systemd-analyze security {UNIT} --no-pager", check_rc=False)
    text = shown.stdout + shown.stderr
    (LOGS / f"security-{name}.txt").write_text(text)
    found = EXPOSURE.search(text)
    # The items that add to the exposure: a number at the end of their line.
    failing = [
        " ".join(line.split()[1:])
        for line in text.splitlines()
        if ITEM_EXPOSURE.search(line) and not EXPOSURE.search(line)
    ]
    return (float(found.group(1)) if found else None), failing


def run_variant(data: dict, base: str, name: str, extra: list[str]) -> dict:
    log(f"variant {name}: {extra or 'today'}")
    entry: dict = {"variant": name, "extra": extra}
    box.BOX.run(f"systemctl stop {UNIT}; systemctl reset-failed {UNIT}", check_rc=False)
    bench.wait_gpus_idle()
    text = unit_text(data, name, extra)
    Path(f"{box.BOX.root_dir}{UNIT_PATH}").write_text(text)
    (LOGS / f"unit-{name}.service").write_text(text)
    box.BOX.run("systemctl daemon-reload")
    entry["exposure"], failing = exposure(name)
    entry["security_failing"] = failing
    cursor = journal_cursor()
    started = box.BOX.run(f"systemctl start {UNIT}", check_rc=False)
    entry["start_rc"] = started.returncode
    ok, seconds, how = serve(base)
    entry.update(serves=ok, serve_seconds=seconds, serve_result=how)
    if ok:
        pid = box.main_pid()
        entry["main_pid"] = pid
        entry["process"] = process_facts(pid)
        entry["decode"] = decode(base)
        processes = gpu_processes()
        entry["gpu_processes"] = processes
        # By its PID in the container, else by name (the only llama-server on this machine).
        entry["gpu_mib"] = next(
            (p["used_mib"] for p in processes if p.get("container_pid") == pid),
            next((p["used_mib"] for p in processes if SERVICE in p["name"]), None),
        )
        entry["memory_used_mib"] = bench.memory_used()
    journal = journal_since(cursor)
    (LOGS / f"journal-{name}.log").write_text(journal)
    found = EVIDENCE.search(journal)
    entry["evidence"] = found.group(0) if found else None
    entry["on_gpu"] = bool(ok and found and entry.get("gpu_mib"))
    if not ok:
        entry["unit_state"] = box.BOX.run(
            f"systemctl show -p Result -p ExecMainStatus -p ExecMainCode {UNIT}", check_rc=False
        ).stdout.split()
        entry["journal_errors"] = [
            line for line in journal.splitlines() if ERROR_WORDS.search(line)
        ][:20]
        entry["journal_tail"] = journal.splitlines()[-25:]
    box.BOX.run(f"systemctl stop {UNIT}", check_rc=False)
    results["variants"].append(entry)
    save()
    log(
        f"variant {name}: serves {ok} ({how}), on GPU {entry['on_gpu']} "
        f"({entry['evidence']}, {entry.get('gpu_mib')} MiB), "
        f"decode {entry.get('decode', {}).get('median')} t/s, exposure {entry['exposure']}"
    )
    return entry


def tolerated(entry: dict, baseline: dict) -> bool:
    """Serves on the GPU and decodes within DECODE_TOLERANCE of the baseline's median."""
    if not entry["on_gpu"] or "decode" not in entry:
        return False
    return entry["decode"]["median"] >= (1 - DECODE_TOLERANCE) * baseline["decode"]["median"]


def main() -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    results["machine"] = box.machine_facts()
    save()
    model_written = bench.write_model_beside("llama-8b", MODEL)
    start = time.monotonic()
    results["root"] = prepare_root()
    results["root"]["boot_seconds"] = box.BOX.boot(box.ROOT_ARCHIVE, LOGS / "boot.log")
    results["root"]["prepare_seconds"] = round(time.monotonic() - start, 1)
    results["container"] = {
        "systemd": box.BOX.run("systemctl --version | head -1").stdout.strip(),
        "state": box.BOX.run("systemctl is-system-running", check_rc=False).stdout.strip(),
        "os": box.BOX.run(". /etc/os-release; echo $PRETTY_NAME").stdout.strip(),
    }
    save()
    log(f"container up: {results['container']}")
    data = bench.host_data(RIG)
    data["llama_cpp"]["targets"] = ["llama-server"]
    results["build"] = build(data)
    save()
    log(f"built in {results['build']['seconds']} s")
    results["model"] = {"path": str(MODEL), "write_seconds": model_written()}
    base = render.base_url(data)

    baseline = run_variant(data, base, "baseline", [])
    if not baseline["on_gpu"]:
        log("the baseline does not serve on the GPU: stopping")
        return 1
    kept = []
    for name, extra in CANDIDATES.items():
        entry = run_variant(data, base, name, extra)
        entry["tolerated"] = tolerated(entry, baseline)
        save()
        if entry["tolerated"]:
            kept += extra
    if kept:
        combined = run_variant(data, base, "combined", kept)
        combined["tolerated"] = tolerated(combined, baseline)
    again = run_variant(data, base, "baseline-again", [])
    if "decode" in again:
        results["baseline_spread_pct"] = round(
            100 * (again["decode"]["median"] / baseline["decode"]["median"] - 1), 2
        )
    results["finished"] = bench.now()
    save()
    for entry in results["variants"]:
        log(
            f"{entry['variant']:<28} on GPU {entry['on_gpu']!s:<5} "
            f"decode {entry.get('decode', {}).get('median')} / "
            f"{entry.get('decode', {}).get('best')} t/s  exposure {entry['exposure']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
