"""Reaching a host: its SSH settings rendered once for each client (pyinfra, ssh, testinfra),
and what llamarig reads from it before planning (GPUs, the model's header), whichever client
reads it."""

from __future__ import annotations

import copy
import re
import subprocess
from dataclasses import dataclass, replace
from typing import Any

from llamarig.config import HostConfig, expand_path, strict_host_key_checking
from llamarig.facts import MeasuredOverheads, NvidiaPciDevices, NvidiaSmiGpus, Reader
from llamarig.hardware import gpus_from_pci
from llamarig.hostpaths import OVERHEADS_DIR
from llamarig.model.catalog import is_router, model_views
from llamarig.model.header import FoundHeader, find_model_header, load_header
from llamarig.model.lock import resolved
from llamarig.plan import HostPlan, PlannedModel, plan_host, plan_router


@dataclass(frozen=True)
class SshTarget:
    """One host's SSH settings (`ssh` of the rig data, paths with ``~`` expanded), rendered
    for pyinfra, for the ssh command line and for testinfra's ssh_config alike."""

    host: str
    port: int = 22
    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None
    # OpenSSH's StrictHostKeyChecking value: yes, or accept-new where the user opted in.
    checking: str = "yes"

    @classmethod
    def of(cls, ssh: dict) -> SshTarget:
        return cls(
            host=ssh["host"],
            port=ssh.get("port", 22),
            user=ssh.get("user"),
            key=expand_path(ssh["key"]) if "key" in ssh else None,
            known_hosts=expand_path(ssh["known_hosts"]) if "known_hosts" in ssh else None,
            checking=strict_host_key_checking(ssh),
        )

    def pyinfra_data(self) -> dict:
        """pyinfra's connector data for the host."""
        connection = {
            "ssh_hostname": self.host,
            "ssh_port": self.port,
            # Host keys are always checked: a rig holds API keys and model files. pyinfra's own
            # default is accept-new; only the user's `ssh.host_key_checking` chooses it here.
            "ssh_strict_host_key_checking": self.checking,
        }
        if self.user is not None:
            connection["ssh_user"] = self.user
        if self.key is not None:
            connection["ssh_key"] = self.key
        if self.known_hosts is not None:
            connection["ssh_known_hosts_file"] = self.known_hosts
        return connection

    def argv(self, *options: str) -> list[str]:
        """An ssh command line for the host (``options`` added), with the same host-key
        checking as the deploy.

        `--` ends the options: the destination is never read as one (`-oProxyCommand=...`
        would run a command here), though the loader refuses such a host already."""
        command = ["ssh", "-o", f"StrictHostKeyChecking={self.checking}", "-o", "BatchMode=yes"]
        if self.known_hosts is not None:
            command += ["-o", f"UserKnownHostsFile={ssh_config_value(self.known_hosts)}"]
        if self.key is not None:
            # As an option, not -i: ssh checks an -i path before it expands %-tokens in it, so
            # no spelling of a path with `%` would work there.
            command += ["-o", f"IdentityFile={ssh_config_value(self.key)}"]
        command += ["-p", str(self.port), *options]
        user = f"{self.user}@" if self.user is not None else ""
        return [*command, "--", f"{user}{self.host}"]

    def ssh_config(self, alias: str) -> str:
        """An ssh_config block for testinfra's ssh backend (never paramiko://, which does not
        check host keys), under the name ``alias`` (see `ssh_alias`)."""
        lines = [
            f"Host {alias}",
            f"  HostName {self.host}",
            f"  Port {self.port}",
            f"  StrictHostKeyChecking {self.checking}",
            "  BatchMode yes",
        ]
        if self.user is not None:
            lines.append(f"  User {self.user}")
        if self.key is not None:
            lines += [f"  IdentityFile {ssh_config_value(self.key)}", "  IdentitiesOnly yes"]
        if self.known_hosts is not None:
            lines.append(f"  UserKnownHostsFile {ssh_config_value(self.known_hosts)}")
        return "\n".join(lines) + "\n"

    def run(self, command: str, timeout: float | None = 120) -> subprocess.CompletedProcess:
        """``command`` run by the host's shell over ssh, its output captured as text."""
        return subprocess.run(
            [*self.argv(), command], capture_output=True, text=True, timeout=timeout
        )


def ssh_config_value(value: str) -> str:
    """``value`` as one argument of an ssh_config line (or ``ssh -o``): %-tokens escaped, and
    quoted (ssh splits arguments at spaces, honouring double quotes and backslashes)."""
    value = value.replace("%", "%%")
    if value and not any(ch in value for ch in " \t\"'\\#"):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ssh_alias(name: str) -> str:
    """The ssh_config alias of an inventory host: one word whatever the host's name holds."""
    return "llamarig-" + re.sub(r"[^A-Za-z0-9._-]", "_", name)


def pyinfra_host(host_config: HostConfig) -> tuple[str, dict]:
    """The (name, data) pair pyinfra's inventory expects, with SSH settings mapped."""
    data = copy.deepcopy(host_config.data)
    ssh = data.get("ssh") or {}
    if ssh.get("local"):
        return "@local", data
    return host_config.name, {**data, **SshTarget.of(ssh).pyinfra_data()}


def run_on_host(data: dict, command: str, timeout: float | None = 120):
    """``command`` run by the host's shell: ``sh -c`` on a local host, else over ssh."""
    if data["ssh"].get("local"):
        return subprocess.run(
            ["sh", "-c", command], capture_output=True, text=True, timeout=timeout
        )
    return SshTarget.of(data["ssh"]).run(command, timeout)


def shell_reader(data: dict) -> Reader:
    """A reader that runs each fact's command with `run_on_host` and parses its output the way
    pyinfra does: the fact's default when the command fails or prints nothing."""

    def read(fact_class: type, **arguments: Any) -> Any:
        fact = fact_class()
        result = run_on_host(data, fact.command(**arguments))
        lines = result.stdout.splitlines()
        return fact.process(lines) if result.returncode == 0 and lines else fact.default()

    return read


@dataclass
class Gathered(FoundHeader):
    """What a plan takes from the host (`plan.plan_host`'s inputs besides the rig data): the
    model's header (`FoundHeader`; its ``warnings`` also name PCI ids not in llamarig's
    table) and the GPUs."""

    probed_gpus: list[dict] | None = None
    gpu_source: str = "probed"
    driver_version: str | None = None
    measured_overheads: dict | None = None  # what the deploy measured after earlier starts

    def plan_inputs(self) -> dict:
        return {
            "header": self.header,
            "header_note": self.header_note,
            "probed_gpus": self.probed_gpus,
            "gpu_source": self.gpu_source,
            "driver_version": self.driver_version,
            "measured_overheads": self.measured_overheads,
            "header_declared": self.header_declared,
        }


def gather(
    data: dict, reader: Reader | None, *, gpus: bool = True, model: str | None = None
) -> Gathered:
    """The host's GPUs (nvidia-smi, else PCI ids; only with ``gpus``) and, for the CUDA
    backend, the model's GGUF header: ``model`` (a local copy), the model's URL, else the file
    on the host. ``reader`` None: the host is not contacted (no GPUs, no host file)."""
    gathered = Gathered()
    if gpus and reader is not None:
        smi = reader(NvidiaSmiGpus)
        if smi:
            gathered.probed_gpus, gathered.gpu_source = smi, "nvidia-smi"
            gathered.driver_version = smi[0]["driver_version"]
        else:
            found, gathered.warnings = gpus_from_pci(reader(NvidiaPciDevices) or [])
            gathered.probed_gpus, gathered.gpu_source = found or None, "PCI ids"
    if data["llama_cpp"]["backend"] == "cuda":
        if gpus and reader is not None:  # what earlier starts measured on these GPUs
            gathered.measured_overheads = reader(MeasuredOverheads, path=OVERHEADS_DIR)
        if model:  # the user's local copy, read in place and not recorded
            gathered.header, gathered.header_note = load_header(data, model)
        else:
            find_model_header(gathered, data, reader)
    return gathered


def plan_for(
    name: str,
    data: dict,
    reader: Reader | None,
    *,
    gpus: bool | None = None,
    model: str | None = None,
) -> tuple[HostPlan, Gathered]:
    """The one path from a host's rig data (a Hugging Face reference already resolved) to its
    plan, for the deploy, `plan`, `init`, `tune` and `verify` alike: what the host tells,
    gathered through ``reader`` (None: the host is not contacted), then the plan. ``gpus``:
    probe the GPUs (default: for the CUDA backend); ``model``: a local copy of the model."""
    if gpus is None:
        gpus = data["llama_cpp"]["backend"] == "cuda"
    if is_router(data):
        return _plan_router(name, data, reader, gpus)
    gathered = gather(data, reader, gpus=gpus, model=model)
    return plan_host(name, data, **gathered.plan_inputs()), gathered


def _plan_router(
    name: str, data: dict, reader: Reader | None, gpus: bool
) -> tuple[HostPlan, Gathered]:
    """The plan of a rig of several models: each planned as a one-model rig, then together
    (``plan.plan_router``)."""
    planned, together = [], Gathered()
    for view in model_views(data):
        plan, gathered = plan_for(name, view.data, reader, gpus=gpus)
        planned.append(PlannedModel(replace(view, data=plan.resolved), plan))
        together.read += gathered.read
        together.superseded += gathered.superseded
        together.warnings += [w for w in gathered.warnings if w not in together.warnings]
    return plan_router(name, data, planned), together


def host_plan(host_config: HostConfig) -> HostPlan:
    """The plan of a deployed host as its deploy made it, read over SSH: a Hugging Face
    reference resolved through models.lock.yml, the host's GPUs (for the CUDA backend) and the
    model's header. Raises HubError for a reference the lock cannot resolve."""
    data = resolved(host_config.data)
    return plan_for(host_config.name, data, shell_reader(data))[0]
