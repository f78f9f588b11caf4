"""The rig checklist of the seed articles, as tests. Each failure says what to do; checks that
need a GPU skip with the reason on a host without one."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import time
from pathlib import Path

import pytest

from llamarig.config.addresses import is_loopback
from llamarig.model.catalog import is_router, model_views
from llamarig.onhost import checksums
from llamarig.serving import answers
from llamarig.tables.hardware import check_versions, cuda_architecture, device_access_problems
from llamarig.tables.platform import SUPPORTED, os_key

BLACKLISTED = ("nouveau", "nova_core", "nova")
BLACKLIST_FILE = "/etc/modprobe.d/llamarig-blacklist-nouveau-nova.conf"
MEMORY_USED = "nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits"
# The NVIDIA device nodes a CUDA process opens (the caps nodes exist only where MIG made them).
NVIDIA_NODES = (
    "/dev/nvidiactl /dev/nvidia[0-9]* /dev/nvidia-uvm /dev/nvidia-uvm-tools /dev/nvidia-caps/*"
)
HARDENING = {
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "NoNewPrivileges": "yes",
    "DynamicUser": "yes",
    "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
    "DevicePolicy": "closed",
}


# --- system -------------------------------------------------------------------------------


def test_os_is_supported(host):
    release = dict(
        line.split("=", 1)
        for line in host.file("/etc/os-release").content_string.splitlines()
        if "=" in line
    )
    release = {key: value.strip('"') for key, value in release.items()}
    key = os_key({"release_meta": release})
    print(f"{release.get('PRETTY_NAME')}, kernel {host.run('uname -r').stdout.strip()}")
    assert key in SUPPORTED, f"{release.get('PRETTY_NAME')} is not a supported OS"


def test_boot_mode_and_secure_boot_reported(host, data):
    uefi = host.file("/sys/firmware/efi").is_directory
    state = host.run("mokutil --sb-state 2>/dev/null").stdout.strip() or "unknown (no mokutil)"
    print(f"boot: {'UEFI' if uefi else 'BIOS/none'}; secure boot: {state}")
    if data["expect"]["uefi"] is None:
        pytest.skip(f"expect.uefi not set; booted {'UEFI' if uefi else 'without UEFI'}")
    wanted = "UEFI" if data["expect"]["uefi"] else "legacy BIOS"
    assert uefi == data["expect"]["uefi"], (
        f"booted {'UEFI' if uefi else 'legacy BIOS'}, not {wanted}"
    )


# --- nouveau and nova ----------------------------------------------------------------------


def test_nouveau_and_nova_not_loaded(host, nvidia_rig):
    # /sys/module/NAME exists for a loaded (or built-in) module, also on kernels without
    # /proc/modules.
    if not host.file("/sys/module").is_directory:
        pytest.skip("no /sys/module on this host (a container's sandboxed kernel view)")
    bound = [name for name in BLACKLISTED if host.file(f"/sys/module/{name}").is_directory]
    assert not bound, f"{', '.join(bound)} loaded: reboot after the blacklist (llamarig deploy)"


def test_nouveau_and_nova_blacklisted(host, managed_kernel):
    config = host.run("modprobe --showconfig").stdout
    missing = [name for name in BLACKLISTED if f"blacklist {name}" not in config]
    assert not missing, (
        f"not blacklisted in the modprobe configuration: {missing}; {BLACKLIST_FILE}"
    )


def test_blacklist_in_the_initramfs(host, managed_kernel):
    kernel = host.run("uname -r").stdout.strip()
    initrd = f"/boot/initrd.img-{kernel}"
    if not host.file(initrd).exists:
        pytest.skip(f"no initramfs {initrd} (container or direct kernel boot)")
    listing = host.run(f"lsinitramfs {initrd}").stdout
    assert BLACKLIST_FILE.lstrip("/") in listing, (
        f"{BLACKLIST_FILE} is not in {initrd}: run update-initramfs -u and reboot"
    )


# --- driver and GPUs -----------------------------------------------------------------------


def test_nvidia_driver_loaded_and_recent_enough(host, nvidia_rig, gpus):
    version = gpus[0]["driver_version"]
    problems = check_versions(
        [gpu["compute_cap"] for gpu in gpus],
        cuda_version=nvidia_rig["cuda"]["version"]
        if nvidia_rig["cuda"]["source"] != "none"
        else None,
        driver_version=version,
        open_modules=nvidia_rig["driver"]["open"],
        driver_source=nvidia_rig["driver"]["source"],
        cuda_source=nvidia_rig["cuda"]["source"],
    )
    assert not problems, "; ".join(problems)
    print(f"driver {version}")


def test_open_kernel_modules(host, nvidia_rig, gpus):
    if not nvidia_rig["driver"]["open"]:
        pytest.skip("driver.open is false: the proprietary modules are wanted")
    banner = host.run("cat /proc/driver/nvidia/version 2>/dev/null").stdout
    if banner:
        assert "Open Kernel Module" in banner, f"not the open modules: {banner.splitlines()[0]}"
        return
    license_line = host.run("modinfo -F license nvidia 2>/dev/null").stdout.strip()
    if not license_line:
        pytest.skip("neither /proc/driver/nvidia/version nor modinfo here (a container)")
    assert license_line == "Dual MIT/GPL", (
        f"nvidia module license {license_line!r}: not the open modules"
    )


def test_nvidia_uvm_ready(host, nvidia_rig, gpus):
    # The device node is what CUDA opens; the module directory shows it is loaded on a host.
    assert (
        host.file("/dev/nvidia-uvm").exists or host.file("/sys/module/nvidia_uvm").is_directory
    ), "nvidia_uvm not loaded: modprobe nvidia_uvm (and keep it in /etc/modules-load.d)"


def test_gpus_match_the_declaration(nvidia_rig, gpus):
    declared = nvidia_rig["gpus"]
    if not declared:
        pytest.skip("no `gpus` declared to compare with")
    from llamarig.planner.plan import compare_gpus

    found = [
        {
            "name": gpu["name"],
            "vram_mib": int(gpu["memory.total"]),
            "compute_capability": gpu["compute_cap"],
            "bus_id": gpu["pci.bus_id"],
        }
        for gpu in gpus
    ]
    problems = compare_gpus(declared, found, "nvidia-smi")
    assert not problems, "; ".join(problems)


def test_pcie_links(nvidia_rig, gpus):
    expect = nvidia_rig["expect"]
    downgraded = []
    for gpu in gpus:
        print(
            f"GPU {gpu['index']} {gpu['name']}: PCIe gen {gpu['pcie.link.gen.current']}/"
            f"{gpu['pcie.link.gen.max']} x{gpu['pcie.link.width.current']}/"
            f"{gpu['pcie.link.width.max']} (current/max; idle links downclock)"
        )
        if expect["pcie_gen"] and int(gpu["pcie.link.gen.max"]) < expect["pcie_gen"]:
            downgraded.append(
                f"GPU {gpu['index']} gen {gpu['pcie.link.gen.max']} < {expect['pcie_gen']}"
            )
        if expect["pcie_width"] and int(gpu["pcie.link.width.max"]) < expect["pcie_width"]:
            downgraded.append(
                f"GPU {gpu['index']} x{gpu['pcie.link.width.max']} < x{expect['pcie_width']}"
            )
    assert not downgraded, (
        "downgraded PCIe links: " + "; ".join(downgraded) + " (check BIOS link mode and slots)"
    )


def test_bar1_and_p2p_reported(host, gpus):
    bar1 = host.run("nvidia-smi -q -d MEMORY | grep -A2 'BAR1'").stdout
    print(bar1 or "BAR1 size not reported")
    print(host.run("nvidia-smi topo -p2p r").stdout)
    assert bar1, "nvidia-smi does not report BAR1 memory"


# --- toolkit and build ---------------------------------------------------------------------


def test_nvcc_can_build_every_gpu(host, derived, gpus):
    nvcc = derived["nvcc"]
    if not nvcc:
        pytest.skip("cpu build: no toolkit")
    assert host.file(nvcc).exists, f"{nvcc} missing: run the deploy's cuda stage"
    out = host.run("%s --version", nvcc).stdout
    version = re.search(r"release ([0-9]+\.[0-9]+)", out).group(1)
    problems = check_versions(
        [gpu["compute_cap"] for gpu in gpus], version, None, True, "nvidia-repo", "nvidia-repo"
    )
    assert not [p for p in problems if "cannot build" in p or "dropped" in p], problems


def test_build_is_the_pinned_commit_with_the_configured_options(host, data, derived):
    manifest_path = f"{data['paths']['prefix']}/current/.llamarig-build.json"
    manifest_file = host.file(manifest_path)
    assert manifest_file.exists, f"{manifest_path} missing: the build did not finish"
    manifest = json.loads(manifest_file.content_string)
    assert manifest["commit"] == data["llama_cpp"]["commit"], (
        f"running build is {manifest['commit'][:12]}, configured {data['llama_cpp']['commit'][:12]}"
    )
    assert manifest["cmake_options"] == derived["cmake_options"], (
        "build options differ from the rig data"
    )


def test_binary_has_device_code_for_every_gpu(host, data, derived, gpus):
    library = host.run(
        "find -L %s -name 'libggml-cuda.so*' | head -1", f"{data['paths']['prefix']}/current/bin"
    )
    path = library.stdout.strip()
    assert path, "libggml-cuda.so not in the build: not a CUDA build"
    cuobjdump = f"{derived['nvcc'].rsplit('/', 1)[0]}/cuobjdump"
    elf = host.run("%s --list-elf %s", cuobjdump, path).stdout
    for gpu in gpus:
        arch = cuda_architecture(gpu["compute_cap"]).removesuffix("-real")
        assert f"sm_{arch}" in elf, f"no sm_{arch} code for {gpu['name']} in {path}"


# --- model ---------------------------------------------------------------------------------


def test_model_files_match_their_sha256(host, rig, serving_rig):
    """Each model file has its sha256: read from the deploy's checksum record while the file is
    unchanged since it was hashed, else (and with `llamarig verify --rehash`) hashed here."""
    checked = [file for file in rig["model_files"] if file["sha256"]]
    if not checked:
        pytest.skip("model.sha256 is not set: the model file on the host is not checked")
    wrong = []
    for file in checked:
        path = file["path"]
        read = checksums.read_command(path, rig["checksum_records"])
        found = checksums.trusted_sha256(host.run(read).stdout.splitlines())
        assert found is not None, f"model file {path} does not exist: run the deploy"
        digest, how = (None if rig["rehash"] else found["sha256"]), "recorded"
        if digest is None:
            result = host.run(f"sha256sum < {shlex.quote(path)}")
            assert result.rc == 0, f"cannot read model file {path}: {result.stderr.strip()}"
            digest, how = result.stdout.split(" ", 1)[0], "hashed"
        expected = file["sha256"]
        if digest != expected:
            wrong.append(f"model file {path} has sha256 {digest} ({how}), expected {expected}")
    assert not wrong, "; ".join(wrong) + (
        ": run the deploy (it downloads a model from its URL again) or replace the file"
    )


# --- service and API -----------------------------------------------------------------------


def test_service_active_enabled_and_restarting(host, systemd_rig):
    data = systemd_rig
    service = host.service(data["server"]["service"])
    assert service.is_running, (
        f"{data['server']['service']} is not running: systemctl status {data['server']['service']}"
    )
    assert service.is_enabled, (
        f"{data['server']['service']} is not enabled: it will not start at boot"
    )
    restart = host.run(f"systemctl show -P Restart {data['server']['service']}").stdout.strip()
    assert restart == "on-failure", f"Restart={restart}, expected on-failure"


def test_service_hardening(host, systemd_rig):
    data = systemd_rig
    service = data["server"]["service"]
    values = {
        key: host.run(f"systemctl show -P {key} {service}").stdout.strip() for key in HARDENING
    }
    wrong = {key: value for key, value in values.items() if value != HARDENING[key]}
    assert not wrong, f"hardening settings differ: {wrong} (expected {HARDENING})"


def test_service_may_open_the_gpus(host, systemd_rig, gpus):
    """DevicePolicy=closed: the unit opens only what its DeviceAllow= entries name. Each must be
    a group this host's driver lists in /proc/devices (systemd drops others without a word), and
    together they must cover every NVIDIA node, or CUDA fails (or falls back to the CPU)."""
    service = systemd_rig["server"]["service"]
    words = host.run(f"systemctl show -P DeviceAllow {service}").stdout.split()
    # Only the NVIDIA entries: systemd adds its own (ProtectClock= adds `char-rtc r`, a group
    # that a machine without a real-time clock does not list, harmlessly).
    pairs = [" ".join(words[i : i + 2]) for i in range(0, len(words), 2)]
    allowed = [entry for entry in pairs if entry.startswith("char-nvidia")]
    nodes = host.run(f"stat -c '%n %t' {NVIDIA_NODES} 2>/dev/null").stdout.splitlines()
    needed = {path: int(major, 16) for path, major in (line.split() for line in nodes)}
    assert needed, "no NVIDIA device nodes in /dev: is the driver loaded (nvidia-modprobe)?"
    problems = device_access_problems(allowed, host.file("/proc/devices").content_string, needed)
    print(f"DeviceAllow: {allowed}")
    assert not problems, "; ".join(problems) + " (render.NVIDIA_DEVICE_GROUPS)"


def listening_addresses(host, port: int | None) -> list[str]:
    """Addresses with a TCP socket listening on ``port`` (None: any port), from /proc/net/tcp
    and tcp6 (no ss needed, so it works in containers too)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in host.run(f"cat {table} 2>/dev/null").stdout.splitlines()[1:]:
            fields = line.split()
            address, _, port_hex = fields[1].rpartition(":")
            if fields[3] != "0A" or port not in (None, int(port_hex, 16)):  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            if len(raw) == 4:
                found.append(ipaddress.IPv4Address(raw[::-1]).compressed)
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                found.append(ipaddress.IPv6Address(words).compressed)
    return found


def test_listens_only_where_configured(host, data, derived):
    worker = data["role"] == "rpc-worker"
    # An RPC worker listens for its head; everything else serves the API.
    address, port = (
        (data["rpc"]["host"], data["rpc"]["port"])
        if worker
        else (data["server"]["host"], data["server"]["port"])
    )
    if not listening_addresses(host, None):
        pytest.skip("the kernel's socket tables list no listener at all here (a sandboxed kernel)")
    mine = listening_addresses(host, port)
    assert mine == [address], f"port {port} is listened on at {mine}, configured only {address}" + (
        " (RPC has no authentication: keep it on the private address)" if worker else ""
    )
    if not worker and not is_loopback(address):
        assert derived["api_key"], (
            f"llama-server listens on {address} (not loopback) without an API key: "
            "anyone on the network can use it; set an API key or listen on 127.0.0.1"
        )


def _first_model(data: dict) -> dict:
    """What a request names to reach a model: nothing on a one-model rig, the first model's
    name on a router (which routes by it)."""
    views = model_views(data)
    return {"model": views[0].name} if views else {}


def test_api_health_completion_metrics(api, data):
    code, body = api("/health")
    assert code == 200 and json.loads(body).get("status") == "ok", f"/health: {code} {body[:200]}"
    model = _first_model(data)
    code, body = api("/completion", {**model, "prompt": "Hello", "n_predict": 4, "temperature": 0})
    assert code == 200, f"/completion: {code} {body[:300]}"
    assert json.loads(body)["tokens_predicted"] > 0
    if data["server"]["metrics"]:
        code, body = api("/metrics" + (f"?model={model['model']}" if model else ""))
        assert code == 200 and "llamacpp:" in body, f"/metrics: {code}"


def test_api_key_is_required_when_set(api, derived):
    if not derived["api_key"]:
        pytest.skip("no API key configured (server on loopback)")
    code, _ = api("/completion", {"prompt": "Hello", "n_predict": 1}, auth=False)
    assert code == 401, f"an unauthenticated /completion got {code}, not 401"
    code, _ = api("/health", auth=False)
    assert code == 200, f"/health (for probes) answered {code} without the key"


def test_server_runs_on_the_gpus(host, data, gpus, server_pid):
    """/health is 200 even after a silent fall back to the CPU: ask the driver which GPUs hold
    the server's process (a router's: the model servers it started, it holds no model)."""
    pids = {server_pid}
    if is_router(data):
        pids = set(host.run(f"ps -o pid= --ppid {server_pid}").stdout.split())
        if not pids:
            pytest.skip("the router has no model loaded now (server.idle_unload_seconds)")
    apps = host.run(
        "nvidia-smi --query-compute-apps=pid,gpu_bus_id,used_memory --format=csv,noheader,nounits"
    ).stdout.splitlines()
    listed = {line.split(",")[0].strip() for line in apps}
    if not pids & listed and not any(host.file(f"/proc/{other}").exists for other in listed):
        # In a container the driver lists processes by the host's PIDs (or none): then the
        # memory the GPUs hold is the evidence (this host runs nothing else on them).
        used = [int(v) for v in host.run(MEMORY_USED).stdout.split()]
        wanted = used if data["server"]["split_mode"] != "none" else used[:1]
        print(f"nvidia-smi lists no process of this PID namespace; memory used {used} MiB")
        assert all(mib > 1024 for mib in wanted), (
            f"the GPUs hold {used} MiB: llama-server is not on them (fell back to the CPU?)"
        )
        return
    mine = {
        line.split(",")[1].strip(): int(line.split(",")[2])
        for line in apps
        if line.split(",")[0].strip() in pids
    }
    assert mine, (
        f"llama-server (pid {', '.join(sorted(pids))}) holds no GPU memory: it fell back to the "
        "CPU (driver older than the CUDA runtime? nvidia_uvm not ready when the unit started?)"
    )
    idle = [gpu["name"] for gpu in gpus if gpu["pci.bus_id"] not in mine]
    if data["server"]["split_mode"] != "none":
        assert not idle, f"llama-server uses no memory on {idle}"


def test_memory_follows_the_split(host, data, gpus):
    split = data["server"]["tensor_split"]
    if not split or len(gpus) < 2:
        pytest.skip("no tensor split to compare with")
    used = [int(v) for v in host.run(MEMORY_USED).stdout.split()]
    share = [u / sum(used) for u in used]
    wanted = [s / sum(split) for s in split]
    tolerance = data["expect"]["split_tolerance"]
    print(f"memory used {used} MiB, share {share}, configured {wanted}")
    assert all(abs(a - b) <= tolerance for a, b in zip(share, wanted, strict=False)), (
        f"memory split {share} differs from -ts {wanted} by more than {tolerance:.0%}"
    )


def test_decode_speed_floor(api, data):
    floor = data["expect"]["min_tokens_per_second"]
    if floor is None:
        pytest.skip("expect.min_tokens_per_second not set: speed not checked")
    code, body = api(
        "/completion",
        {
            **_first_model(data),
            "prompt": "Write a story about a llama.",
            "n_predict": 128,
            "temperature": 0,
        },
    )
    assert code == 200, f"/completion: {code}"
    speed = json.loads(body)["timings"]["predicted_per_second"]
    print(f"decode: {speed:.1f} tokens/s (floor {floor})")
    assert speed >= floor, f"decode {speed:.1f} tokens/s is below the floor {floor}"


def pytest_generate_tests(metafunc):
    # One test per entry of expect.answers, named by its index (the data is on disk before the
    # suite is collected; without it the `rig` fixture stops the run with the reason).
    if "answer" not in metafunc.fixturenames:
        return
    path = os.environ.get("LLAMARIG_VERIFY_DATA")
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"] if path else None
    found = answers.answers(data) if data else []
    ids = [f"models[{a.model_index}].answers[{a.index}]" if a.model else f"answers[{a.index}]"
           for a in found]  # fmt: skip
    metafunc.parametrize("answer", found, ids=ids)


def test_expected_answer(api, answer):
    """Greedy decoding: a rig that builds, loads and serves can still answer gibberish (a
    wrong architecture list, a bad split, a corrupt quantisation)."""
    path, body = answers.request(answer)
    started = time.monotonic()
    code, text = api(path, body)
    seconds = time.monotonic() - started
    problem = answers.verdict(answer, code, text)
    print(problem or f"{answer.name} answered right in {seconds:.1f} s")
    assert problem is None, problem


# --- RPC (several boxes) --------------------------------------------------------------------


def test_rpc_worker_unit_active(host, data):
    if data["role"] != "rpc-worker":
        pytest.skip(f"role {data['role']}: no RPC worker unit")
    service = host.service(data["rpc"]["service"])
    assert service.is_running, f"{data['rpc']['service']} is not running on this worker"
    assert service.is_enabled, f"{data['rpc']['service']} is not enabled: it will not start at boot"


def test_rpc_workers_reachable_from_the_head(host, data):
    if data["role"] != "rpc-head":
        pytest.skip(f"role {data['role']}: no RPC workers to reach")
    from llamarig.operations import tcp_probe

    down = [endpoint for endpoint in data["rpc"]["endpoints"] if host.run(tcp_probe(endpoint)).rc]
    assert not down, f"RPC workers not reachable from this head: {down} (are they converged?)"


def test_head_is_connected_to_its_workers(host, data):
    """llama-server keeps a connection to every worker whose device holds its layers."""
    if data["role"] != "rpc-head" or data["server"]["supervisor"] != "systemd":
        pytest.skip("not an rpc-head under systemd")
    if not host.exists("ss"):
        pytest.skip("no ss on this host to list the server's connections")
    missing = []
    for endpoint in data["rpc"]["endpoints"]:
        connected = host.run("ss -Htnp state established dst %s", endpoint).stdout
        if '"llama-server"' not in connected:
            missing.append(endpoint)
    assert not missing, (
        f"llama-server holds no connection to the RPC worker(s) {missing}: its layers are not "
        "there (check -ngl, and that the workers were up when it started)"
    )
