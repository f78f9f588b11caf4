"""GPU acceptance on one H200: the real deploy over SSH into a systemd host with a real GPU.

The rig is inventory/gpu-h200-systemd.yml with the machine's own card written in (name, memory,
architecture, the decode floor scaled by memory bandwidth: bench.gpu_bench.this_card_rig), so a
lease that lends an H100 runs the same tests.

The GPU machine has no systemd of its own, so the tests boot one (llamarig_sandbox.systemdroot,
GUIDE §8): a Debian trixie root with systemd as PID 1 of a container, the driver, the CUDA
toolkit, the model and the llama.cpp mirror bound in, sshd on a loopback port with a host key
made for this run and pinned in known_hosts. Then, from the machine itself, as a user would
(inventory/gpu-h200-systemd.yml plus an API key), in order: the first converge (CUDA build,
hardened unit) and a second that changes nothing; a no-op converge against a bare connection;
the API key; what the unit may open and who it runs as; `llamarig verify`; the overhead the
deploy measured and the plan that uses it; `llamarig tune` and the deploy that applies it; a
server setting that restarts without a rebuild; a change the binary refuses at load, rolled
back. Run on the GPU machine by `bash bench/gpu_tests.sh` (docs/testing.md); skipped anywhere
else. What only measures (decode speeds, memory against the plan, llama-bench, the throughput
sweep) is bench/systemd_h200.py's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

if not (shutil.which("nvidia-smi") and os.geteuid() == 0 and os.environ.get("LLAMARIG_GPU_TESTS")):
    pytest.skip(
        "GPU acceptance: needs an NVIDIA GPU, root and LLAMARIG_GPU_TESTS=1 "
        "(bash bench/gpu_tests.sh on the GPU machine)",
        allow_module_level=True,
    )

from bench import gpu_bench as bench  # noqa: E402
from llamarig.planner import render  # noqa: E402
from llamarig.tables.hardware import device_access_problems  # noqa: E402
from llamarig_sandbox.systemdroot import SystemdRoot  # noqa: E402

PROJECT = Path(__file__).resolve().parents[2]
SHIPPED_RIG = PROJECT / "inventory" / "gpu-h200-systemd.yml"
HOST_NAME = "h200-systemd"
SERVICE = "llama-server"
UNIT = f"{SERVICE}.service"
ROOT_DIR = Path("/srv/root")
# Parts of the root archive: carried with this call, or by an earlier call of the same lease.
ROOT_PARTS_DIRS = (bench.WORK / "stash", PROJECT / ".carry" / "systemd-root")
ROOT_ARCHIVE = bench.WORK / "root.tar.xz"
MODEL = bench.MODELS / "llama-8b-q8_0.gguf"
MIRROR = bench.WORK / "llama.cpp.git"
API_KEY_FILE = bench.WORK / "api-key"
LOGS = Path(os.environ.get("GPU_TEST_LOGS") or bench.WORK / "gpu-test-logs")
# The NVIDIA nodes a CUDA process may open (the caps only exist where the driver made them).
NVIDIA_NODES = "/dev/nvidiactl /dev/nvidia[0-9]* /dev/nvidia-uvm /dev/nvidia-uvm-tools"
NVIDIA_NODES += " /dev/nvidia-caps/*"
# A device outside the NVIDIA groups that root can read: the unit's device filter must refuse it.
OTHER_DEVICE = "/dev/cpu/0/cpuid"
# A change every option of which exists (the flag check passes) that llama-server refuses at
# load: the plan cannot know that a LoRA file on the host is missing.
BROKEN = ["--lora", "/srv/llamarig/models/no-such-adapter.gguf"]
NOOP_PAIRS = 5


@pytest.fixture(scope="module")
def box() -> SystemdRoot:
    """The booted root, the rig file (the shipped one plus an API key kept on this machine,
    the control side) written, the model beside it."""
    LOGS.mkdir(parents=True, exist_ok=True)
    if not API_KEY_FILE.exists():
        API_KEY_FILE.parent.mkdir(parents=True, exist_ok=True)
        API_KEY_FILE.write_text(secrets.token_hex(32) + "\n")
        API_KEY_FILE.chmod(0o600)
    shipped = yaml.safe_load(SHIPPED_RIG.read_text())["all"]["children"]["gpu"]["hosts"]
    overrides = bench.this_card_rig(shipped[HOST_NAME])
    overrides["server"] = {"api_key_file": str(API_KEY_FILE)}
    bench.derived_inventory(SHIPPED_RIG, HOST_NAME, overrides)
    model_written = bench.write_model_beside("llama-8b", MODEL)
    root = SystemdRoot(ROOT_DIR, HOST_NAME, bench.host_data(rig())["ssh"], (bench.MODELS, MIRROR))
    if not root.unpacked():
        root.unpack(ROOT_PARTS_DIRS, ROOT_ARCHIVE)
    root.configure()
    root.ssh_client(bench.WORK / "bin")
    root.boot(ROOT_ARCHIVE, LOGS / "boot.log")
    root.wait_for_ssh()
    model_written()
    return root


def rig() -> Path:
    return bench.WORK / f"{HOST_NAME}.yml"


def card() -> str:
    """The machine's GPU as the rig names it (nvidia-smi's name: the lease may lend an H100)."""
    return bench.host_data(rig())["gpus"][0]["name"]


def deploy(inventory: Path, log_name: str) -> tuple[int, list[str], str]:
    """`pyinfra -y --json inventory.py deploy.py` with RIG_INVENTORY: its exit status, the
    operations that changed something and its output (kept in LOGS)."""
    run = bench.run_deploy(inventory, LOGS / log_name)
    return run.rc, run.changed_ops or [], run.output


def main_pid(box: SystemdRoot) -> int:
    return int(box.run(f"systemctl show -P MainPID {UNIT}").stdout.strip())


def cmdline(box: SystemdRoot, pid: int) -> str:
    return box.run(f"tr '\\0' ' ' < /proc/{pid}/cmdline").stdout


def status_code(path: str, token: str | None) -> int:
    base = render.base_url(bench.host_data(rig()))
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


def api_key() -> str:
    return API_KEY_FILE.read_text().strip()


def cli(*arguments: str, inventory: Path | None = None, timeout: float = 600):
    return subprocess.run(
        [sys.executable, "-m", "llamarig.cli", *arguments],
        cwd=PROJECT,
        env=bench.env_for(inventory or rig()),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_first_converge_serves_and_a_second_changes_nothing(box):
    status, changed, output = deploy(rig(), "converge-first.log")
    assert status == 0, output[-4000:]
    assert any(name.startswith("Build ") for name in changed), changed
    pid = main_pid(box)
    status, changed, output = deploy(rig(), "converge-second.log")
    assert status == 0 and changed == [], (changed, output[-3000:])
    assert main_pid(box) == pid, "a converge with nothing to do restarts nothing"


def test_a_noop_converge_costs_at_most_twice_a_bare_connection(box):
    """Medians of NOOP_PAIRS each, taken in turns (which goes first alternates)."""

    def bare() -> float:
        start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "pyinfra", "-y", "inventory.py", "exec", "--", "true"],
            cwd=PROJECT, env=bench.env_for(rig()), capture_output=True, check=True, timeout=300,
        )  # fmt: skip
        return time.monotonic() - start

    def noop(index: int) -> float:
        start = time.monotonic()
        status, changed, output = deploy(rig(), f"converge-noop-{index}.log")
        assert status == 0 and changed == [], (changed, output[-2000:])
        return time.monotonic() - start

    noops, bares = [], []
    for index in range(NOOP_PAIRS):
        if index % 2:
            bares.append(bare())
            noops.append(noop(index))
        else:
            noops.append(noop(index))
            bares.append(bare())
    ratio = statistics.median(noops) / statistics.median(bares)
    print(f"no-op {statistics.median(noops):.2f} s, bare {statistics.median(bares):.2f} s")
    assert ratio <= 2, (noops, bares)


def test_the_api_key_guards_completions_and_health_stays_open(box):
    assert status_code("/completion", None) == 401
    assert status_code("/completion", api_key()) == 200
    assert status_code("/health", None) == 200


def test_the_unit_opens_only_nvidia_devices_and_runs_unprivileged(box):
    data = bench.host_data(rig())
    pid = main_pid(box)
    status = box.run(f"grep -E '^(Uid|CapEff|NoNewPrivs|Seccomp):' /proc/{pid}/status").stdout
    process = {line.split(":", 1)[0]: line.split(":", 1)[1].split() for line in status.splitlines()}
    assert process["Uid"][0] != "0" and int(process["CapEff"][0], 16) == 0, process
    assert process["NoNewPrivs"] == ["1"] and process["Seccomp"] == ["2"], process
    assert box.run(f"systemctl show -P DevicePolicy {UNIT}").stdout.strip() == "closed"
    words = box.run(f"systemctl show -P DeviceAllow {UNIT}").stdout.split()
    shown = [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)]
    # systemd adds entries of its own (ProtectClock= adds `char-rtc r`): only NVIDIA's are ours.
    allowed = [value for value in shown if value.startswith("char-nvidia")]
    assert sorted(allowed) == sorted(render.device_allow(data)), shown
    nodes = box.run(f"stat -c '%n %t' {NVIDIA_NODES} 2>/dev/null", check_rc=False).stdout
    needed = {path: int(major, 16) for path, major in (line.split() for line in nodes.splitlines())}
    assert device_access_problems(allowed, Path("/proc/devices").read_text(), needed) == []
    opened = box.run(f"ls -l /proc/{pid}/fd | grep -o ' /dev/.*' | sort -u", check_rc=False)
    held = [line.strip() for line in opened.stdout.splitlines() if "/dev/nvidia" in line]
    assert held and all(path in needed for path in held), (held, needed)
    score = box.run(f"systemd-analyze security {UNIT} --no-pager", check_rc=False).stdout
    exposure = re.search(r"Overall exposure level for \S+: ([0-9.]+)", score)
    print(f"systemd-analyze security: {exposure[1] if exposure else score[-500:]}")
    assert exposure and float(exposure[1]) <= 1.5, score[-2000:]


def test_a_unit_with_its_device_filter_runs_nvidia_smi_and_reads_no_other_device(box):
    """Transient units with the unit's device properties, as root, so that only the device
    filter can refuse the read; the control without them reads the device."""
    words = box.run(f"systemctl show -P DeviceAllow {UNIT}").stdout.split()
    shown = [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)]
    allowed = [value for value in shown if value.startswith("char-nvidia")]
    properties = ["-p", "DevicePolicy=closed"]
    properties += [arg for value in allowed for arg in ("-p", f"DeviceAllow={value}")]

    def transient(props: list[str], command: str):
        run = ["systemd-run", "--quiet", "--wait", "--pipe", "--collect", *props, "--"]
        return box.run(f"{shlex.join([*run, 'sh', '-c', command])} < /dev/null", check_rc=False)

    smi = transient(["-p", "DynamicUser=yes", *properties], "nvidia-smi -L")
    assert smi.returncode == 0 and card() in smi.stdout, (smi.stdout, smi.stderr)
    read = f"head -c 64 {OTHER_DEVICE} | wc -c"
    refused, control = transient(properties, read), transient([], read)
    assert refused.stdout.strip() == "0" and "not permitted" in refused.stderr, refused.stderr
    assert control.stdout.strip() == "64", (control.stdout, control.stderr)


def test_verify_passes(box):
    result = cli("verify", "--", "-q")
    text = result.stdout + result.stderr
    (LOGS / "verify.log").write_text(text)
    assert result.returncode == 0, text[-4000:]
    assert re.search(r"\d+ passed", text), text[-2000:]


def test_the_deploy_records_the_gpu_overhead_and_the_next_plan_reserves_it(box):
    records = box.run(
        'for f in /var/lib/llamarig/gpu-overheads/*; do echo "${f##*/} $(cat "$f")"; done',
        check_rc=False,
    ).stdout.strip()
    assert records and "No such file" not in records, records
    plan = cli("plan", "--probe", timeout=300)
    (LOGS / "plan-after-start.log").write_text(plan.stdout + plan.stderr)
    assert "measured on this rig" in plan.stdout, plan.stdout[-3000:]


def test_tune_writes_a_file_the_next_deploy_applies(box):
    tuned = rig().parent / "tuned" / f"{HOST_NAME}.yml"
    result = cli("tune", "--minutes", "4", timeout=900)
    (LOGS / "tune.log").write_text(result.stdout + result.stderr)
    assert result.returncode == 0 and tuned.exists(), (result.stdout + result.stderr)[-4000:]
    status, _, output = deploy(rig(), "converge-tuned.log")
    assert status == 0, output[-3000:]
    status, changed, output = deploy(rig(), "converge-tuned-again.log")
    assert status == 0 and changed == [], (changed, output[-2000:])


def test_a_ctx_change_restarts_without_a_rebuild(box):
    variant = bench.derived_inventory(rig(), "h200-systemd-ctx", {"server": {"ctx": 16384}})
    before = main_pid(box)
    status, changed, output = deploy(variant, "converge-ctx.log")
    assert status == 0, output[-3000:]
    assert any(name.startswith(f"Restart {UNIT}") for name in changed), changed
    assert not any(name.startswith("Build ") for name in changed), changed
    after = main_pid(box)
    assert after != before and " -c 16384 " in cmdline(box, after)
    assert status_code("/completion", api_key()) == 200


def test_a_change_refused_at_load_is_rolled_back_and_the_last_version_serves(box):
    good = bench.WORK / "h200-systemd-ctx.yml"  # what the test before deployed
    variant = bench.derived_inventory(
        good, "h200-systemd-broken", {"server": {"extra_args": BROKEN}}
    )
    unit_path = render.layout(bench.host_data(good))["unit"]
    unit_before = box.run(f"cat {unit_path}").stdout
    current_before = box.run("readlink /opt/llamarig/current").stdout
    status, _, output = deploy(variant, "converge-broken.log")
    assert status != 0, output[-3000:]
    assert f"the new version of {UNIT} does not serve" in output, output[-4000:]
    assert any("lora" in line.lower() for line in output.splitlines()), "the journal's cause"
    assert re.search(r"serves again after \d+ s", output), output[-3000:]
    assert box.run(f"cat {unit_path}").stdout == unit_before
    assert box.run("readlink /opt/llamarig/current").stdout == current_before
    assert " -c 16384 " in cmdline(box, main_pid(box))
    assert status_code("/completion", api_key()) == 200
    status, changed, output = deploy(good, "converge-after-rollback.log")
    assert status == 0 and changed == [], (changed, output[-2000:])


# A name only the host resolves (in the root's /etc/hosts, not the machine's): the control side
# cannot read a model's header from it, as a CI runner cannot reach a model hub (issue 28).
MODEL_HOST = "models.rig.invalid"


def test_a_url_only_the_host_reaches_is_planned_there_and_the_first_converge_is_final(
    box, monkeypatch, tmp_path
):
    """The rig's model moves to a URL the control side cannot resolve; its header cache is
    empty. The plan asks the host for the header (curl -r over SSH), so the first converge
    downloads the model and installs the final unit (ctx auto: planned from the header), the
    lock records the header, the next converge changes nothing, and a plan made on the
    control side afterwards, still blind to the URL, is final."""
    from llamarig_sandbox.fileserver import make_server

    # Not looked up here (the suite's guard refuses a lookup): this machine has no network,
    # so only a hosts file could name it.
    assert MODEL_HOST not in Path("/etc/hosts").read_text()
    server = make_server(bench.MODELS, 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    box.run(f"echo '127.0.0.1 {MODEL_HOST}' >> /etc/hosts")
    box.run(f"rm -f /opt/llamarig/models/{MODEL.name}")  # this model's first converge
    monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(tmp_path / "headers"))
    digest = subprocess.run(
        ["sha256sum", str(MODEL)], capture_output=True, text=True, check=True
    ).stdout.split()[0]
    document = yaml.safe_load(rig().read_text())
    rig_data = document["all"]["children"]["gpu"]["hosts"][HOST_NAME]
    url = f"http://{MODEL_HOST}:{server.server_address[1]}/{MODEL.name}"
    rig_data["model"] = {"url": url, "sha256": digest}
    rig_data["server"]["ctx"] = "auto"
    directory = bench.WORK / "url-rig"  # its own models.lock.yml
    directory.mkdir(exist_ok=True)
    (directory / "models.lock.yml").unlink(missing_ok=True)
    inventory = directory / f"{HOST_NAME}.yml"
    inventory.write_text(yaml.safe_dump(document))
    try:
        status, changed, output = deploy(inventory, "converge-url-first.log")
        assert status == 0, output[-4000:]
        assert "provisional" not in output.lower(), output[-4000:]
        assert any(name.startswith("Model ") for name in changed), changed
        lock = yaml.safe_load((directory / "models.lock.yml").read_text())
        assert [entry["file"] for entry in lock["headers"]] == [{"sha256": digest}], lock
        planned = cli("plan", "--json", inventory=inventory)
        assert planned.returncode == 0, planned.stdout + planned.stderr
        host = json.loads(planned.stdout)["hosts"][HOST_NAME]
        assert host["provisional"] == [] and host["fits"], host
        running = cmdline(box, main_pid(box))
        print(f"planned ctx {host['ctx']}; the unit runs: {running}")
        assert f" -c {host['ctx']} " in running and f" -m /opt/llamarig/models/{MODEL.name} " in (
            running
        )
        status, changed, output = deploy(inventory, "converge-url-second.log")
        assert status == 0 and changed == [], (changed, output[-3000:])
    finally:
        server.shutdown()


def plan_lines(inventory: Path) -> list[str]:
    result = cli("plan", "--probe", inventory=inventory, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.splitlines()


def test_a_router_serves_two_models_by_name_within_the_planned_memory(box):
    """Issue 30 through the deploy on the GPU: the 8B file under two names (each its own
    llama-server child with its own context), both loaded by the deploy's check; each answers
    by name through the router, the GPU holds no more than the plan's worst case with its
    margin, verify passes and the next converge changes nothing."""
    document = yaml.safe_load(rig().read_text())
    rig_data = document["all"]["children"]["gpu"]["hosts"][HOST_NAME]
    model = rig_data.pop("model")
    rig_data["models"] = [
        {"name": "llama-a", **model, "load_on_startup": True, "server": {"ctx": 16384}},
        {"name": "llama-b", **model, "server": {"ctx": 4096}},
    ]
    rig_data.pop("expect", None)
    inventory = bench.WORK / "h200-systemd-router.yml"
    inventory.write_text(yaml.safe_dump(document))
    status, changed, output = deploy(inventory, "converge-router.log")
    assert status == 0, output[-4000:]
    headers = {"Authorization": f"Bearer {api_key()}", "Content-Type": "application/json"}
    base = render.base_url(bench.host_data(inventory))
    with urllib.request.urlopen(
        urllib.request.Request(f"{base}/v1/models", headers=headers), timeout=60
    ) as reply:
        listed = sorted(entry["id"] for entry in json.load(reply)["data"])
    assert listed == ["llama-a", "llama-b"], listed
    for name in listed:
        body = json.dumps({"model": name, "prompt": "Hello", "n_predict": 8}).encode()
        request = urllib.request.Request(f"{base}/completion", body, headers)
        with urllib.request.urlopen(request, timeout=300) as reply:
            assert json.load(reply)["tokens_predicted"] == 8, name
    used = int(subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, check=True,
    ).stdout.strip())  # fmt: skip
    lines = plan_lines(inventory)
    at_once = lines.index(next(line for line in lines if "loaded at once" in line))
    row = next(line.split() for line in lines[at_once:] if line.strip().startswith(card()))
    planned, need = int(row[-4]), int(row[-3])
    print(f"both loaded: nvidia-smi {used} MiB, planned {planned} MiB, with the margin {need}")
    (LOGS / "router-memory.txt").write_text(f"used {used}\nplanned {planned}\nneed {need}\n")
    assert used <= need, (used, planned, need)
    result = cli("verify", "--", "-q", inventory=inventory)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    status, changed, output = deploy(inventory, "converge-router-again.log")
    assert status == 0 and changed == [], (changed, output[-3000:])
