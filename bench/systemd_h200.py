"""Issue 16 on the one-H200 machine, run by bench/systemd_h200.sh: the real deploy over SSH into a
systemd host with a real GPU.

The machine has no systemd of its own, so it boots one: a Debian trixie root with systemd as PID
1 of a container (bench/systemd-root.sh, GUIDE §8), the driver, the CUDA toolkit, the model and
the llama.cpp mirror bound in, sshd on 127.0.0.1:2223 with a host key made for this run and
pinned in known_hosts. Then, from the machine itself, as a user would (inventory
gpu-h200-systemd.yml):

1. the first converge (timed: clone, CUDA build, hardened unit) and a second that must change
   nothing and keep the same MainPID; then NOOP_PAIRS no-op converges alternated with a bare
   `pyinfra exec -- true` (issue 19: the no-op costs at most 2x the connection),
2. what the unit may open: its DevicePolicy and DeviceAllow against /proc/devices and the
   NVIDIA nodes, the device nodes the serving process holds, and transient units with the same
   device properties (nvidia-smi works, a read of /dev/cpu/0/cpuid is refused, and is not
   without them), plus the process's identity and `systemd-analyze security`,
3. `llamarig verify` (testinfra over ssh:// with strict host keys),
4. decode speed through the unit, through `llamarig run` of the same launcher (the unit stopped
   first) and llama-bench of the same settings; nvidia-smi memory against the plan,
5. a server setting that restarts without a rebuild (ctx), a change the binary refuses at load
   (a LoRA adapter that does not exist) rolled back with the old version serving again, and a
   converge afterwards that changes nothing.

Everything lands in $OUT/results.json (written after each step) with logs in $OUT/logs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
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
from llamarig import render  # noqa: E402
from llamarig.hardware import char_device_groups, device_access_problems  # noqa: E402
from llamarig.remote import SshTarget  # noqa: E402
from llamarig_sandbox.sandbox import hosts_file, known_hosts_line, sshd_dropin  # noqa: E402

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
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The NVIDIA nodes a CUDA process may open (the caps only exist where the driver made them).
NVIDIA_NODES = "/dev/nvidiactl /dev/nvidia[0-9]* /dev/nvidia-uvm /dev/nvidia-uvm-tools"
NVIDIA_NODES += " /dev/nvidia-caps/*"
# A device outside the NVIDIA groups that root can read: the unit's device filter must refuse it.
OTHER_DEVICE = "/dev/cpu/0/cpuid"
# A change every option of which exists (the flag check passes) that llama-server refuses at
# load: the plan cannot know that a LoRA file on the host is missing.
BROKEN = ["--lora", "/srv/llamarig/models/no-such-adapter.gguf"]
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

_systemd_pid: list[int] = []


def systemd_pid() -> int:
    """PID (in the machine's namespace) of the container's systemd: the oldest `systemd`."""
    if not _systemd_pid:
        output = subprocess.check_output(["pgrep", "-xo", "systemd"], text=True)
        _systemd_pid.append(int(output.split()[0]))
    return _systemd_pid[0]


def in_container(command: str, check_rc: bool = True, timeout: float = 600):
    """A shell command as root in all of the container's namespaces."""
    result = subprocess.run(
        ["nsenter", "-t", str(systemd_pid()), "-a", "-r", "-w", "/bin/sh", "-c", command],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PATH": CONTAINER_PATH, "HOME": "/root", "LANG": "C.UTF-8"},
    )
    if check_rc and result.returncode:
        raise RuntimeError(
            f"in the container: {command} exited {result.returncode}\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    return result


def unpack_root() -> dict:
    """Join the archive's parts (checked against the packer's sha256) and unpack it."""
    parts = {
        part.name: part
        for directory in ROOT_PARTS_DIRS
        if directory.is_dir()
        for part in directory.glob("root.tar.xz.part-*")
    }
    expected = next(
        (d / "root.tar.xz.sha256").read_text().split()[0]
        for d in ROOT_PARTS_DIRS
        if (d / "root.tar.xz.sha256").is_file()
    )
    digest = hashlib.sha256()
    with open(ROOT_ARCHIVE, "wb") as archive:
        for name in sorted(parts):
            data = parts[name].read_bytes()
            digest.update(data)
            archive.write(data)
    if digest.hexdigest() != expected:
        raise RuntimeError(f"the root's parts {sorted(parts)} do not add up to its sha256")
    ROOT_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-xJf", str(ROOT_ARCHIVE), "-C", str(ROOT_DIR)], check=True)
    return {"parts": sorted(parts), "bytes": ROOT_ARCHIVE.stat().st_size}


def chroot(*command: str) -> None:
    subprocess.run(["chroot", str(ROOT_DIR), *command], check=True)


def configure_root() -> None:
    """sshd on its own loopback port with this run's host keys; root's authorized key; the
    driver's and toolkit's libraries in ld.so's path; nvidia-smi on the PATH."""
    port = SSH["port"]
    (ROOT_DIR / "etc/ssh/sshd_config.d/llamarig.conf").write_text(sshd_dropin(port))
    (ROOT_DIR / "etc/hostname").write_text(f"{HOST_NAME}\n")
    (ROOT_DIR / "etc/hosts").write_text(hosts_file(HOST_NAME))
    chroot("ssh-keygen", "-A")
    key = Path(SSH["key"])
    key.parent.mkdir(parents=True, exist_ok=True)
    if not key.exists():
        chroot("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "llamarig-h200", "-f", "/tmp/k")
        for suffix in ("", ".pub"):
            (ROOT_DIR / f"tmp/k{suffix}").rename(f"{key}{suffix}")
    ssh_dir = ROOT_DIR / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    (ssh_dir / "authorized_keys").write_text(Path(f"{key}.pub").read_text())
    (ssh_dir / "authorized_keys").chmod(0o600)
    host_key = (ROOT_DIR / "etc/ssh/ssh_host_ed25519_key.pub").read_text()
    Path(SSH["known_hosts"]).write_text(known_hosts_line(host_key, port))
    (ROOT_DIR / "etc/ld.so.conf.d/llamarig-gpu.conf").write_text(
        "/usr/local/nvidia/lib64\n/usr/local/cuda/lib64\n"
    )
    smi = ROOT_DIR / "usr/local/bin/nvidia-smi"
    if not smi.is_symlink():
        smi.symlink_to("/usr/local/nvidia/bin/nvidia-smi")


def ssh_client() -> str:
    """The machine has no OpenSSH client (testinfra's ssh:// and `llamarig run` need one): run
    the root's, with the root's own libraries."""
    found = subprocess.run(["sh", "-c", "command -v ssh"], capture_output=True, text=True)
    if found.returncode == 0:
        return found.stdout.strip()
    wrapper = bench.WORK / "bin" / "ssh"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    libs = ROOT_DIR / "usr/lib/x86_64-linux-gnu"
    wrapper.write_text(
        "#!/bin/sh\n# The container root's OpenSSH client (this machine has none).\n"
        f'exec {libs}/ld-linux-x86-64.so.2 --library-path {libs} {ROOT_DIR}/usr/bin/ssh "$@"\n'
    )
    wrapper.chmod(0o755)
    os.environ["PATH"] = f"{wrapper.parent}:{os.environ['PATH']}"
    return str(wrapper)


def boot() -> float:
    start = time.monotonic()
    with open(LOGS / "boot.log", "w") as out:
        subprocess.run(
            ["bash", "bench/systemd-root.sh", str(ROOT_ARCHIVE), str(bench.MODELS), str(MIRROR)],
            cwd=ROOT,
            env={**os.environ, "ROOT_DIR": str(ROOT_DIR)},
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )
    in_container("ldconfig")
    return round(time.monotonic() - start, 1)


def wait_for_ssh(data: dict, timeout: float = 60) -> float:
    """Until sshd answers with the pinned host key (strict checking, as the deploy does)."""
    start = time.monotonic()
    while True:
        probe = subprocess.run(
            [*SshTarget.of(data["ssh"]).argv(), "true"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode == 0:
            return round(time.monotonic() - start, 1)
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"ssh to the container failed: {probe.stderr.strip()}")
        time.sleep(1)


# --- the deploy and the service -------------------------------------------------------------


def deploy(inventory: Path, log_name: str) -> tuple[dict, str]:
    """`pyinfra -y --json inventory.py deploy.py` with RIG_INVENTORY; its record and output."""
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", "--json", "inventory.py", "deploy.py"],
        cwd=ROOT,
        env=bench.env_for(inventory),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    entry: dict = {"seconds": round(time.monotonic() - start, 1), "rc": result.returncode}
    output = result.stderr + "\n" + result.stdout
    (LOGS / log_name).write_text(
        f"$ RIG_INVENTORY={inventory} python3 -m pyinfra -y --json inventory.py deploy.py\n"
        + output
    )
    with contextlib.suppress(ValueError, KeyError):
        operations = json.loads(result.stdout)["results"]["operations"]
        entry["changed_ops"] = [
            op["name"].split(" | ", 1)[-1] for op in operations if op["success"]
        ]
        entry["changed"] = len(entry["changed_ops"])
    return entry, output


def main_pid() -> int:
    return int(in_container(f"systemctl show -P MainPID {UNIT}").stdout.strip())


def cmdline(pid: int) -> str:
    return in_container(f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout


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


def status_code(base: str, path: str, token: str | None) -> int:
    body = json.dumps({"prompt": "Hello", "n_predict": 1}).encode() if path != "/health" else None
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"{base}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


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
        left = in_container("pgrep -x llama-server", check_rc=False).stdout.split()
        stopped["left_running"] = left
        for pid in left:
            in_container(f"kill {int(pid)}", check_rc=False)
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
    api_key_rig = {"server": {"api_key_file": str(API_KEY_FILE)}}
    bench.derived_inventory(SHIPPED_RIG, HOST_NAME, api_key_rig)  # writes RIG
    model_written = bench.write_model_beside("llama-8b", MODEL)
    start = time.monotonic()
    if not (ROOT_DIR / "lib/systemd/systemd").exists():
        timings["root"] = unpack_root()
    configure_root()
    timings["unpack_configure_seconds"] = round(time.monotonic() - start, 1)
    timings["ssh_client"] = ssh_client()
    timings["boot_seconds"] = boot()
    data = bench.host_data(RIG)
    timings["ssh_seconds"] = wait_for_ssh(data)
    timings["model_write_seconds"] = model_written()
    container = {
        "systemd": in_container("systemctl --version | head -1").stdout.strip(),
        "state": in_container("systemctl is-system-running", check_rc=False).stdout.strip(),
        "failed_units": in_container("systemctl --failed --no-legend --plain").stdout.split("\n"),
        "os": in_container(". /etc/os-release; echo $PRETTY_NAME").stdout.strip(),
    }
    timings["container"] = container
    return timings


def unit_devices(data: dict) -> None:
    """What the unit may open, and proof that the filter holds in this container."""
    pid = main_pid()
    entry: dict = {"main_pid": pid}
    status = in_container(f"grep -E '^(Uid|CapEff|NoNewPrivs|Seccomp):' /proc/{pid}/status")
    entry["process"] = dict(
        (line.split(":", 1)[0], line.split(":", 1)[1].split())
        for line in status.stdout.splitlines()
    )
    score = in_container(f"systemd-analyze security {UNIT} --no-pager", check_rc=False).stdout
    found = re.search(r"Overall exposure level for \S+: ([0-9.]+)", score)
    entry["exposure"] = float(found.group(1)) if found else None
    policy = in_container(f"systemctl show -P DevicePolicy {UNIT}").stdout.strip()
    words = in_container(f"systemctl show -P DeviceAllow {UNIT}").stdout.split()
    shown = [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)]
    # systemd adds entries of its own (ProtectClock= adds `char-rtc r`): only NVIDIA's are ours.
    allowed = [value for value in shown if value.startswith("char-nvidia")]
    entry.update(device_policy=policy, device_allow_shown=shown, device_allow=allowed)
    nodes = in_container(f"stat -c '%n %t' {NVIDIA_NODES} 2>/dev/null", check_rc=False).stdout
    needed = {path: int(major, 16) for path, major in (line.split() for line in nodes.splitlines())}
    proc_devices = Path("/proc/devices").read_text()
    problems = device_access_problems(allowed, proc_devices, needed)
    entry.update(needed_nodes=needed, problems=problems)
    opened = in_container(f"ls -l /proc/{pid}/fd | grep -o ' /dev/.*' | sort | uniq -c", False)
    entry["opened_device_nodes"] = [line.strip() for line in opened.stdout.splitlines()]
    results["unit"] = entry
    save()
    check(
        "unit: DevicePolicy=closed, DeviceAllow exactly render.device_allow (no stale group)",
        policy == "closed"
        and sorted(allowed) == sorted(render.device_allow(data))
        and not problems,
        {"allowed": allowed, "problems": problems},
    )
    check(
        "unit: every NVIDIA node the server holds open is one the unit may open",
        all(
            any(line.endswith(path) for path in needed)
            for line in entry["opened_device_nodes"]
            if "/dev/nvidia" in line
        )
        and any("/dev/nvidia" in line for line in entry["opened_device_nodes"]),
        entry["opened_device_nodes"],
    )
    check(
        "unit: the process is unprivileged (dynamic uid, no capabilities, no new privileges, "
        "seccomp)",
        entry["process"]["Uid"][0] != "0"
        and int(entry["process"]["CapEff"][0], 16) == 0
        and entry["process"]["NoNewPrivs"] == ["1"]
        and entry["process"]["Seccomp"] == ["2"],
        entry["process"],
    )
    # Transient units with the unit's device properties. As root, so that only the device
    # filter can refuse a read. The probe is a character device outside the NVIDIA groups that
    # root reads outside any unit (this machine refuses reads of its block devices to everyone).
    properties = ["-p", "DevicePolicy=closed"] + [
        arg for value in allowed for arg in ("-p", f"DeviceAllow={value}")
    ]

    def transient(props: list[str], command: str) -> list:
        run = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", *props, "--"]
        done = in_container(f"{shlex.join([*run, 'sh', '-c', command])} < /dev/null", False)
        return [done.returncode, done.stdout.strip(), done.stderr.strip()]

    read = f"head -c 64 {OTHER_DEVICE} | wc -c"
    transients = {
        "nvidia_smi_with_unit_devices": transient(
            ["-p", "DynamicUser=yes", *properties], "nvidia-smi -L"
        ),
        "read_with_unit_devices": transient(properties, read),
        "read_without_device_properties": transient([], read),
        "read_outside_units": in_container(read).stdout.strip(),
    }
    results["unit"]["transient"] = transients
    smi = transients["nvidia_smi_with_unit_devices"]
    check(
        "transient unit with the unit's DeviceAllow (dynamic user) runs nvidia-smi -L",
        smi[0] == 0 and "H200" in smi[1],
        smi,
    )
    refused, control = (
        transients["read_with_unit_devices"],
        transients["read_without_device_properties"],
    )
    check(
        f"transient unit with the unit's device properties cannot read {OTHER_DEVICE}; "
        "without them it reads 64 bytes",
        refused[1] == "0" and "not permitted" in refused[2] and control[1] == "64",
        transients,
    )


def verify(inventory: Path, label: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "llamarig.cli", "verify", "--", "-q"],
        cwd=ROOT,
        env=bench.env_for(inventory),
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = result.stdout + result.stderr
    (LOGS / f"verify-{label}.log").write_text(
        f"$ RIG_INVENTORY={inventory} python3 -m llamarig.cli verify -- -q\n{text}"
    )
    counts = {
        word: int(number) for number, word in re.findall(r"(\d+) (passed|failed|skipped)", text)
    }
    return {
        "rc": result.returncode,
        "counts": counts,
        "skipped": re.findall(r"SKIPPED \[\d+\] (\S+?:\d+): (.*)", text),
        "failed": re.findall(r"FAILED (\S+)", text),
    }


def overheads_and_tune() -> None:
    """The overhead the deploy recorded after its first start and the plan that uses it; then
    `llamarig tune` on the rig, the deploy that applies its file and one that changes nothing."""
    records = in_container(
        'for f in /var/lib/llamarig/gpu-overheads/*; do echo "${f##*/} $(cat "$f")"; done',
        check_rc=False,
    ).stdout.strip()
    plan = subprocess.run(
        [sys.executable, "-m", "llamarig.cli", "plan", "--probe"],
        cwd=ROOT, env=bench.env_for(RIG), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    (LOGS / "plan-after-start.log").write_text(plan.stdout + plan.stderr)
    notes = [
        line.strip()
        for line in plan.stdout.splitlines()
        if "reserve" in line or "split mode" in line
    ]
    results["overheads"] = {"records": records, "plan": notes}
    check("the deploy recorded what the GPU holds beyond the plan", bool(records), records)
    check(
        "the next plan reserves the measured overhead",
        any("measured on this rig" in n for n in notes),
        notes,
    )
    tune = run_tune("tune", "tune.log", ["--minutes", "4"], timeout=900)
    if not check("llamarig tune writes a tuned file", tune.returncode == 0 and TUNED.exists()):
        return
    applied, again = deploy_tuned("tune", "converge-tuned")
    check(
        "the deploy applies the tuned file and the next one changes nothing",
        applied["rc"] == 0 and again["rc"] == 0 and again.get("changed") == 0,
        {"applied": applied.get("changed_ops"), "again": again.get("changed_ops")},
    )


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
    in_container(f"systemctl stop {UNIT}")
    bench.wait_gpus_idle()
    with launcher_serving(RIG, base, LOGS / "launcher.log") as (seconds, stopped):
        entry["launcher"] = {"load_seconds": seconds, **decode(base)}
    entry["launcher"]["stopped"] = stopped
    save()
    log(f"launcher: {entry['launcher']['median_greedy']} t/s greedy")
    binary = f"{render.layout(data)['current']}/bin/llama-bench"
    command = [binary, "-m", str(MODEL), "-ngl", "99", *bench.BENCH_FLAGS, "-o", "json"]
    command[command.index("-r") + 1] = str(LLAMA_BENCH_REPETITIONS)
    run = in_container("CUDA_DEVICE_ORDER=PCI_BUS_ID " + shlex.join(command), check_rc=False)
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
    in_container(f"systemctl start {UNIT}")
    entry["unit_restart_seconds"] = wait_healthy(base)
    # The unit once more: the spread between two measurements of the same thing.
    entry["unit_again"] = decode(base)
    save()


def restart_without_rebuild(base: str) -> Path:
    variant = bench.derived_inventory(RIG, "h200-systemd-ctx", {"server": {"ctx": 16384}})
    before = main_pid()
    record, _ = deploy(variant, "converge-ctx.log")
    after = main_pid()
    record.update(pid_before=before, pid_after=after)
    results["converge_ctx"] = record
    changed = record.get("changed_ops", [])
    check(
        "ctx change: the unit restarts, nothing is rebuilt, the new process runs -c 16384",
        record["rc"] == 0
        and any(name.startswith(f"Restart {UNIT}") for name in changed)
        and not any(name.startswith("Build ") for name in changed)
        and after != before
        and " -c 16384 " in cmdline(after),
        {"seconds": record["seconds"], "changed": changed},
    )
    check(
        "ctx change: the server answers with the API key",
        status_code(base, "/completion", api_key()) == 200,
    )
    return variant


def rollback(good: Path, base: str) -> None:
    variant = bench.derived_inventory(
        good, "h200-systemd-broken", {"server": {"extra_args": BROKEN}}
    )
    unit_path = render.layout(bench.host_data(good))["unit"]
    unit_before = in_container(f"cat {unit_path}").stdout
    current_before = in_container("readlink /opt/llamarig/current").stdout
    record, output = deploy(variant, "converge-broken.log")
    found = re.search(r"serves again after (\d+) s", output)
    record["rollback_seconds"] = int(found.group(1)) if found else None
    record["journal_cause"] = [line for line in output.splitlines() if "lora" in line.lower()][:5]
    results["converge_broken"] = record
    check(
        "broken change: the run fails, names the cause, and the last good version serves again",
        record["rc"] != 0
        and f"the new version of {UNIT} does not serve" in output
        and bool(record["journal_cause"])
        and found is not None,
        {"deploy_seconds": record["seconds"], "rollback_seconds": record["rollback_seconds"]},
    )
    unit_after = in_container(f"cat {unit_path}").stdout
    check(
        "broken change: the unit file and `current` are the last good version's, and it serves",
        unit_after == unit_before
        and in_container("readlink /opt/llamarig/current").stdout == current_before
        and " -c 16384 " in cmdline(main_pid())
        and status_code(base, "/completion", api_key()) == 200,
    )
    after, _ = deploy(good, "converge-after-rollback.log")
    results["converge_after_rollback"] = after
    check(
        "after the rollback the good rig converges with 0 changes",
        after["rc"] == 0 and after.get("changed") == 0,
        after.get("changed_ops"),
    )


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
    build = in_container("cat /opt/llamarig/current/.llamarig-build.json").stdout
    cache = "/opt/llamarig/current/CMakeCache.txt"
    marker = "/opt/llamarig/current/.llamarig-build.json"
    seconds = in_container(f"echo $(( $(stat -c %Y {marker}) - $(stat -c %Y {cache}) ))").stdout
    results["build"] = {"manifest": json.loads(build), "seconds": int(seconds)}
    token = api_key()
    check(
        "API key: /completion is 401 without it, 200 with it; /health is open",
        status_code(base, "/completion", None) == 401
        and status_code(base, "/completion", token) == 200
        and status_code(base, "/health", None) == 200,
    )
    try:
        unit_devices(data)
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        check("unit device checks ran", False, str(error)[-1500:])
    results["verify"] = verify(RIG, "systemd")
    save()
    check(
        "llamarig verify passes (skips only for what a container cannot have)",
        results["verify"]["rc"] == 0,
        results["verify"]["counts"],
    )
    try:
        overheads_and_tune()
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        check("overheads and tune ran", False, str(error)[-1500:])
    save()
    try:
        measure(data, base)
    except Exception as error:  # noqa: BLE001 - recorded, the run goes on
        check("decode and memory measured", False, str(error)[-1500:])
        with contextlib.suppress(Exception):
            in_container(f"systemctl start {UNIT}")
            wait_healthy(base, timeout=300)
    save()
    good = restart_without_rebuild(base)
    rollback(good, base)
    return finish()


def finish() -> int:
    results["finished"] = bench.now()
    save()
    failed = [c["check"] for c in results["checks"] if not c["ok"]]
    log(f"done: {len(results['checks']) - len(failed)} checks passed, failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
