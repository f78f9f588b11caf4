"""`llamarig init`: a box probed (nvidia-smi, else PCI ids; the release files; nvcc) becomes
an inventory entry that loads as a valid inventory, GPUs in PCI bus order with their bus ids.

The probes are recorded outputs of the seed rig (RTX 5080 + RTX 3090, GUIDE §4) and of the
H200 machine (bench/runs/systemd-h200-s6, its PCIe link fields not recorded there), parsed by
the real facts; `--local` runs the real command on this machine."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import yaml
from pyinfra.facts.server import LinuxDistribution

from llamarig.config import load_inventory
from llamarig.facts.build import NvccVersion
from llamarig.facts.gpu import NvidiaPciDevices, NvidiaSmiGpus
from llamarig.planner.enroll import host_entry, inventory_document, probe, render_entry
from llamarig.planner.plan import plan_host
from tests.conftest import PROJECT, offline, pyinfra_env

UBUNTU_2404 = [
    "/etc/os-release",
    'PRETTY_NAME="Ubuntu 24.04.3 LTS"',
    'NAME="Ubuntu"',
    'VERSION_ID="24.04"',
    "ID=ubuntu",
    "VERSION_CODENAME=noble",
    "---",
]
SEED_SMI = [  # nvidia-smi lists by bus: the 3090 at 01:00.0 before the 5080 at 07:00.0
    "0, 00000000:01:00.0, NVIDIA GeForce RTX 3090, 24576, 8.6, 4, 8, 580.95.05",
    "1, 00000000:07:00.0, NVIDIA GeForce RTX 5080, 16303, 12.0, 4, 8, 580.95.05",
]
SEED_PCI = ["0000:07:00.0 0x2c02 0x030000 -", "0000:01:00.0 0x2204 0x030000 -"]
H200_SMI = ["0, 00000000:00:06.0, NVIDIA H200, 143771, 9.0, 5, 16, 580.159.04"]


def recorded(outputs: dict):
    """A reader that parses recorded command output with the real fact classes."""

    def read(fact_class, **arguments):
        fact = fact_class()
        lines = outputs.get(fact_class)
        return fact.process(lines) if lines else fact.default()

    return read


def entry_loads(tmp_path, name: str, found, model: dict | None = None):
    settings = host_entry({"host": "192.0.2.10", "user": "root"}, found)
    settings["model"] = model or {"path": "/srv/models/model.gguf"}
    path = tmp_path / "inventory.yml"
    path.write_text(render_entry(name, found, inventory_document(name, settings)))
    return load_inventory(path).hosts[name], path


def test_the_seed_rig_with_its_driver(tmp_path):
    found = probe(recorded({NvidiaSmiGpus: SEED_SMI, LinuxDistribution: UBUNTU_2404}))
    host, path = entry_loads(tmp_path, "rig1", found)
    gpus = host.data["gpus"]
    assert [(g["name"], g["pci_bus_id"]) for g in gpus] == [
        ("NVIDIA GeForce RTX 3090", "00000000:01:00.0"),
        ("NVIDIA GeForce RTX 5080", "00000000:07:00.0"),
    ]
    assert [g["compute_capability"] for g in gpus] == ["8.6", "12.0"]
    assert host.data["driver"]["source"] == "preinstalled"
    assert host.data["cuda"]["source"] == "nvidia-repo"
    text = path.read_text()
    assert text.startswith("# Written by `llamarig init` for rig1: Ubuntu 24.04.3 LTS; GPUs from ")
    # Quoted: YAML 1.1 reads an unquoted 01:00.0 as a number in base 60.
    assert "(driver 580.95.05)" in text and "pci_bus_id: '00000000:01:00.0'" in text
    assert plan_host("rig1", host.data, None).cuda_architectures == "86-real;120a-real"


def test_the_seed_rig_before_a_driver_from_its_pci_ids(tmp_path):
    found = probe(recorded({NvidiaPciDevices: SEED_PCI, LinuxDistribution: UBUNTU_2404}))
    assert found.gpu_source == "PCI ids"
    host, _ = entry_loads(tmp_path, "rig1", found)
    assert [g["pci_bus_id"] for g in host.data["gpus"]] == ["0000:01:00.0", "0000:07:00.0"]
    assert [g["vram_mib"] for g in host.data["gpus"]] == [24576, 16303]
    assert host.data["driver"]["source"] == "nvidia-repo"


def test_the_h200_machine_with_its_toolkit(tmp_path):
    found = probe(
        recorded({NvidiaSmiGpus: H200_SMI, NvccVersion: ["13.0"], LinuxDistribution: UBUNTU_2404})
    )
    host, _ = entry_loads(tmp_path, "h200", found)
    assert host.data["gpus"][0]["name"] == "NVIDIA H200"
    assert (host.data["cuda"]["source"], host.data["cuda"]["version"]) == ("preinstalled", "13.0")
    assert host.data["server"]["split_mode"] == "auto"  # one GPU: the planner picks none


def test_an_unsupported_release_is_a_warning_in_the_entry(tmp_path):
    fedora = ["/etc/os-release", 'PRETTY_NAME="Fedora Linux 41"', "ID=fedora", 'VERSION_ID="41"']
    found = probe(recorded({NvidiaSmiGpus: H200_SMI, LinuxDistribution: [*fedora, "---"]}))
    _, path = entry_loads(tmp_path, "h200", found)
    assert "# warning: Fedora Linux 41 is not supported" in path.read_text()


def _init(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        offline([sys.executable, "-m", "llamarig.cli", "init", *arguments]),
        cwd=PROJECT,
        env=pyinfra_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_init_on_this_machine_writes_an_entry_that_loads(tmp_path):
    output = tmp_path / "here.yml"
    result = _init("here", "--local", "--output", str(output))
    assert result.returncode == 0, result.stderr
    text = output.read_text()
    assert "# Add the model under the host" in text
    document = yaml.safe_load(text)
    host = document["all"]["children"]["rigs"]["hosts"]["here"]
    host["model"] = {"path": "/srv/models/model.gguf"}
    output.write_text(yaml.safe_dump(document))
    assert load_inventory(output).hosts["here"].data["ssh"]["local"] is True
    again = _init("here", "--local", "--output", str(output))
    assert again.returncode == 2 and "exists (pass --force" in again.stderr


def test_init_refuses_a_hostile_address_before_connecting():
    result = _init("x", "--address=-oProxyCommand=touch /tmp/pwned")
    assert result.returncode == 2 and "starts with `-`" in result.stderr
    result = _init("x", "--address", "root@10.0.0.5:2222")
    assert result.returncode == 2 and "--user" in result.stderr


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [
        (["@local", "--address", "192.0.2.10"], "'@local' is not a host name"),
        (["../../tmp/evil", "--address", "192.0.2.10"], "'../../tmp/evil' is not a host name"),
        (["rig\u200b1", "--local"], "is not a host name"),
        (["rig1", "--local", "--sha256", "0123abcd"], "--sha256: '0123abcd' is not a sha256"),
        (["rig1", "--local", "--model", "http://192.0.2.10/m.gguf"], "--model needs --sha256"),
        (["rig1", "--address", "192.0.2.10", "--port", "70000"], "--port: 70000 is not"),
        (["rig1", "--address", "192.0.2.10", "--known-hosts", "/nonexistent"], "no file"),
        (["rig1", "--local", "--output", "/nonexistent/rig.yml"], "no directory /nonexistent"),
        (["rig1", "--local", "--output", "/"], "--output: / is a directory"),
    ],
)
def test_init_checks_its_own_arguments_before_contacting_the_box(tmp_path, arguments, refusal):
    result = _init(*arguments)
    assert result.returncode == 2 and refusal in result.stderr, result.stderr
    assert "cannot run a command" not in result.stderr  # refused before any connection


def test_init_that_cannot_reach_the_box_fails_and_writes_nothing(tmp_path):
    known_hosts = tmp_path / "known_hosts"
    # A key for the box, so the arguments pass and the failure is the connection's.
    known_hosts.write_text(
        "[127.0.0.1]:2299 ssh-ed25519 "
        "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n"
    )
    output = tmp_path / "rig.yml"
    # In its own network namespace: nothing listens on 127.0.0.1 there.
    result = _init(
        "rig1", "--address", "127.0.0.1", "--port", "2299", "--known-hosts", str(known_hosts),
        "--output", str(output),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "cannot run a command on 127.0.0.1" in result.stderr
    assert "nothing was written" in result.stderr and not output.exists()


def test_init_with_a_model_plans_it_and_the_entry_loads(tmp_path, file_server):
    from tests.ggufmodels import write_llama

    root, base = file_server
    model = write_llama(root / "tiny.gguf")
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    output = tmp_path / "here.yml"
    result = subprocess.run(  # not offline: the model's header comes from the loopback server
        [sys.executable, "-m", "llamarig.cli", "init", "here", "--local", "--output", str(output),
         "--model", f"{base}/tiny.gguf", "--sha256", digest],
        cwd=PROJECT, env=pyinfra_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    text = output.read_text()
    assert "# plan: " in text and "# Add the model" not in text
    host = load_inventory(output).hosts["here"]
    assert host.data["model"] == {
        **host.data["model"],
        "url": f"{base}/tiny.gguf",
        "sha256": digest,
    }
    assert host.data["server"]["split_mode"] == "none"  # this machine has no GPU
