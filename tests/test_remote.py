"""llamarig.remote: one host's SSH settings rendered for pyinfra, for the ssh command line and
for testinfra's ssh_config, which must agree; and `gather`, the GPUs and the model header read
through whichever client the caller has (pyinfra facts in the deploy, sh or ssh in the CLI)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.context import ctx_host, ctx_state

from llamarig.config import load_inventory
from llamarig.config.ssh import SshTarget, pyinfra_host, ssh_alias
from llamarig.converge import stage
from llamarig.facts.files import FileHead, FileIdentity
from llamarig.facts.gpu import NvidiaPciDevices, NvidiaSmiGpus
from llamarig.planner.gather import gather, run_on_host, shell_reader
from llamarig.planner.host_plan import HostPlan
from llamarig.planner.plan import plan_host
from tests.ggufmodels import write_qwen35


def openssh_view(*argv: str) -> dict[str, list[str]]:
    """What OpenSSH makes of a command line (``ssh -G``: it resolves, never connects)."""
    result = subprocess.run(
        ["ssh", "-G", *argv], capture_output=True, text=True, check=True, timeout=10
    )
    view: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        view.setdefault(key, []).append(value)
    return view


SETTINGS = [
    {"host": "192.0.2.1"},
    {"host": "192.0.2.1", "host_key_checking": "accept-new"},
    {
        "host": "192.0.2.7",
        "port": 2200,
        "user": "deploy",
        "key": "~/keys/rig key",
        "known_hosts": "~/.ssh/rig%known",
        "host_key_checking": "strict",
    },
]


@pytest.mark.parametrize("ssh", SETTINGS)
def test_the_three_renderings_agree(ssh, home, tmp_path):
    target = SshTarget.of(ssh)
    pyinfra = target.pyinfra_data()
    from_argv = openssh_view(*target.argv()[1:])
    config = tmp_path / "ssh_config"
    config.write_text(target.ssh_config(ssh_alias("rig 1")))
    from_config = openssh_view("-F", str(config), ssh_alias("rig 1"))

    assert pyinfra["ssh_hostname"] == ssh["host"] == from_argv["hostname"][0]
    assert pyinfra["ssh_port"] == ssh.get("port", 22) == int(from_argv["port"][0])
    checking = "accept-new" if ssh.get("host_key_checking") == "accept-new" else "yes"
    assert pyinfra["ssh_strict_host_key_checking"] == checking
    # ssh -G spells StrictHostKeyChecking=yes as "true".
    assert from_argv["stricthostkeychecking"] == [{"yes": "true"}.get(checking, checking)]
    assert from_argv["batchmode"] == ["yes"]
    if "user" in ssh:
        assert pyinfra["ssh_user"] == ssh["user"] == from_argv["user"][0]
    else:
        assert "ssh_user" not in pyinfra
    if "key" in ssh:
        key = str(home / "keys" / "rig key")
        assert pyinfra["ssh_key"] == key
        # ssh -G shows identity files before their %-tokens are expanded.
        assert key in from_argv["identityfile"]
    else:
        assert "ssh_key" not in pyinfra
    if "known_hosts" in ssh:
        known_hosts = str(home / ".ssh" / "rig%known")
        assert pyinfra["ssh_known_hosts_file"] == known_hosts
        assert from_argv["userknownhostsfile"] == [known_hosts]
    else:
        assert "ssh_known_hosts_file" not in pyinfra
    for key in ("hostname", "port", "user", "identityfile", "userknownhostsfile", "batchmode"):
        assert from_config.get(key) == from_argv.get(key), key
    assert from_config["stricthostkeychecking"] == from_argv["stricthostkeychecking"]


def test_the_destination_follows_the_end_of_options():
    argv = SshTarget.of({"host": "192.0.2.1", "user": "root", "key": "/k"}).argv("-t")
    assert argv[-3:] == ["-t", "--", "root@192.0.2.1"]
    assert "-i" not in argv and "IdentityFile=/k" in argv


def test_run_hands_the_command_to_ssh_after_the_destination(tmp_path, monkeypatch):
    """A stand-in `ssh` first on PATH prints the arguments it was given, one a line."""
    shim = tmp_path / "bin" / "ssh"
    shim.parent.mkdir()
    shim.write_text('#!/bin/sh\nfor arg in "$@"; do echo "$arg"; done\n')
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:/usr/bin:/bin")
    target = SshTarget.of({"host": "192.0.2.1", "port": 2222})
    result = target.run("echo 'a b'")
    assert result.stdout.splitlines() == [*target.argv()[1:], "echo 'a b'"]


def test_a_local_host_runs_the_command_with_sh():
    result = run_on_host({"ssh": {"local": True}}, "echo $((6 * 7)); exit 3")
    assert (result.returncode, result.stdout) == (3, "42\n")


def facts_reader(answers: dict):
    """A reader answering from ``answers`` (fact class -> value), as pyinfra facts would, and
    recording what it was asked."""
    asked = []

    def read(fact_class, **arguments):
        asked.append((fact_class, arguments))
        return answers.get(fact_class, fact_class.default())

    return read, asked


LOCAL_RIG = """
all:
  hosts:
    here:
      ssh: {{local: true}}
      gpus: [{{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}}]
      model: {{path: {model}}}
"""


def local_rig(write_inventory, model: Path) -> dict:
    return load_inventory(write_inventory(LOCAL_RIG.format(model=model))).hosts["here"].data


SMI_GPU = {"index": 0, "bus_id": "00000000:01:00.0", "name": "NVIDIA GeForce RTX 3090",
           "vram_mib": 24576, "compute_capability": "8.6", "pcie_gen": "4", "pcie_width": "16",
           "driver_version": "580.95.05"}  # fmt: skip


def test_nvidia_smi_wins_and_names_the_driver(write_inventory, tmp_path):
    data = local_rig(write_inventory, tmp_path / "m.gguf")
    reader, asked = facts_reader({NvidiaSmiGpus: [SMI_GPU]})
    gathered = gather(data, reader)
    assert gathered.probed_gpus == [SMI_GPU] and gathered.gpu_source == "nvidia-smi"
    assert gathered.driver_version == "580.95.05"
    assert NvidiaPciDevices not in [fact for fact, _ in asked]


def test_pci_ids_when_nvidia_smi_cannot_answer(write_inventory, tmp_path):
    data = local_rig(write_inventory, tmp_path / "m.gguf")
    pci = [
        {"bus_id": "0000:01:00.0", "device_id": "0x2204", "class": "0x030000", "driver": None},
        {"bus_id": "0000:02:00.0", "device_id": "0xffff", "class": "0x030000", "driver": None},
    ]
    reader, _ = facts_reader({NvidiaSmiGpus: None, NvidiaPciDevices: pci})
    gathered = gather(data, reader)
    assert gathered.gpu_source == "PCI ids" and gathered.driver_version is None
    assert [gpu["name"] for gpu in gathered.probed_gpus] == ["GeForce RTX 3090"]
    assert len(gathered.warnings) == 1 and "10de:ffff at 0000:02:00.0" in gathered.warnings[0]

    reader, _ = facts_reader({})  # no NVIDIA device at all
    assert gather(data, reader).probed_gpus is None


def test_the_model_header_comes_from_the_host_file(write_inventory, tmp_path):
    model = tmp_path / "m.gguf"
    write_qwen35(model)
    data = local_rig(write_inventory, model)
    reader, asked = facts_reader({FileHead: model.read_bytes()})
    gathered = gather(data, reader, gpus=False)
    assert gathered.header is not None and gathered.header_note == ""
    # No sha256 in the rig: the file's identity keys its kept header (none here: read it).
    assert asked == [
        (FileIdentity, {"path": str(model)}),
        (FileHead, {"path": str(model), "size": 1 << 20}),
    ]
    # The same through sh on this (local) host, reading the real file.
    assert gather(data, shell_reader(data), gpus=False).header.architecture == (
        gathered.header.architecture
    )


def test_without_a_reader_the_host_is_not_contacted(write_inventory, tmp_path):
    data = local_rig(write_inventory, tmp_path / "m.gguf")
    gathered = gather(data, None)
    assert gathered.probed_gpus is None and gathered.header is None
    assert "the model is a file on the host" in gathered.header_note


def test_a_missing_host_file_says_so(write_inventory, tmp_path):
    data = local_rig(write_inventory, tmp_path / "absent.gguf")
    gathered = gather(data, shell_reader(data), gpus=False)
    assert gathered.header is None
    assert f"{tmp_path}/absent.gguf is not on the host yet" in gathered.header_note


def deploy_plan(path: Path, monkeypatch) -> HostPlan:
    """The plan the deploy makes (stage.plan, pyinfra facts on @local) for the one host of the
    inventory at ``path``, which RIG_INVENTORY names (the lock goes beside it)."""
    monkeypatch.setenv("RIG_INVENTORY", str(path))
    host_config = load_inventory(path).hosts["here"]
    inventory = Inventory(([pyinfra_host(host_config)], {}))
    state = State(inventory, Config())
    connect_all(state)
    for cache in ("_rigs", "_plans", "_headers_read"):
        monkeypatch.setattr(stage, cache, {})
    with ctx_state.use(state), ctx_host.use(inventory.get_host("@local")):
        return stage.plan()


def test_the_deploy_and_the_cli_read_the_same(write_inventory, tmp_path, monkeypatch):
    """The deploy's plan (pyinfra facts on @local) equals the CLI's (sh on the same host)."""
    model = tmp_path / "m.gguf"
    write_qwen35(model)
    path = write_inventory(LOCAL_RIG.format(model=model))
    deployed = deploy_plan(path, monkeypatch)
    data = load_inventory(path).hosts["here"].data
    planned = plan_host("@local", data, **gather(data, shell_reader(data)).plan_inputs())
    assert "GPU memory" in deployed.errors[0]  # the header was read: its weights do not fit
    assert deployed.errors == planned.errors and deployed.resolved == planned.resolved


def test_the_deploy_says_a_provisional_plan_without_verbose(
    write_inventory, tmp_path, monkeypatch, caplog
):
    """A deploy whose plan had no header (the file is not on the host, no URL, no record) says
    so at warning level, which pyinfra prints without -v, and records nothing."""
    path = write_inventory(LOCAL_RIG.format(model=tmp_path / "absent.gguf"))
    with caplog.at_level("WARNING"):
        deployed = deploy_plan(path, monkeypatch)
    assert deployed.blind == ["memory per GPU"]
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any(
        "provisional: memory per GPU chosen without the model's GGUF header" in s for s in said
    ), said
    assert not (tmp_path / "models.lock.yml").exists()
