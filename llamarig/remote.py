"""Reaching a host: its SSH settings rendered once for each client (pyinfra, ssh, testinfra),
and what llamarig reads from it before planning (GPUs, the model's header), whichever client
reads it."""

from __future__ import annotations

import copy
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from llamarig.config import HostConfig, expand_path, strict_host_key_checking
from llamarig.facts import (
    FileHead,
    FileIdentity,
    MeasuredOverheads,
    NvidiaPciDevices,
    NvidiaSmiGpus,
    UrlHead,
)
from llamarig.gguf_header import GgufError, GgufHeader, merge_split, read_gguf_header
from llamarig.hostpaths import HUB_TOKEN_HEADER_PATH, OVERHEADS_DIR
from llamarig.model import header as model_header
from llamarig.model import header_record
from llamarig.model.catalog import is_router, model_views, with_views
from llamarig.model.files import ModelFile, model_files
from llamarig.model.header import (
    HOST_HEADER_FIRST_READ,
    HOST_HEADER_READ,
    header_from_host,
    load_header,
    url_headers,
)
from llamarig.model.lock import declared_key, header_key, lock_path, recorded_header, resolved
from llamarig.plan import HostPlan, gpus_from_pci, plan_host
from llamarig.router import PlannedModel, loaded_at_once


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


# A reader answers a pyinfra fact for the host: ``reader(FactClass, **arguments)``, as
# ``pyinfra.host.get_fact`` does in a deploy.
Reader = Callable[..., Any]


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
class Gathered:
    """What a plan takes from the host (`plan.plan_host`'s inputs besides the rig data)."""

    probed_gpus: list[dict] | None = None
    gpu_source: str = "probed"
    driver_version: str | None = None
    header: GgufHeader | None = None
    header_note: str = ""
    warnings: list[str] = field(default_factory=list)  # PCI ids not in llamarig's table
    measured_overheads: dict | None = None  # what the deploy measured after earlier starts
    header_source: str = ""  # models.lock.yml when the header came from its record
    header_declared: str = ""  # where a declared header's values come from (none read)
    # headers read from the model's files that models.lock.yml does not hold: (key, header)
    read: list[tuple[dict, GgufHeader]] = field(default_factory=list)
    # declared headers (keys) that the files' own headers in ``read`` replace
    superseded: list[dict] = field(default_factory=list)

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
            _model_header(gathered, data, reader)
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
    """The plan of a rig of several models: each planned as a one-model rig, then those that
    may be loaded at once together (``router.loaded_at_once``)."""
    planned, together = [], Gathered()
    for view in model_views(data):
        plan, gathered = plan_for(name, view.data, reader, gpus=gpus)
        planned.append(PlannedModel(replace(view, data=plan.resolved), plan))
        together.read += gathered.read
        together.superseded += gathered.superseded
        together.warnings += [w for w in gathered.warnings if w not in together.warnings]
    at_once = loaded_at_once(planned, data["server"]["models_max"])

    def named(model: PlannedModel, lines: list[str]) -> list[str]:
        return [f"models[{model.view.index}] ({model.view.name}): {line}" for line in lines]

    first = planned[0].plan
    blind = [line for model in planned for line in named(model, model.plan.blind)]
    plan = HostPlan(
        host=name,
        resolved=with_views(data, [model.view for model in planned]),
        gpus=first.gpus,
        gpu_source=first.gpu_source,
        cuda_architectures=first.cuda_architectures,
        memory=None,
        errors=[e for m in planned for e in named(m, m.plan.errors)] + at_once.problems,
        warnings=[w for m in planned for w in named(m, m.plan.warnings)],
        notes=[n for m in planned for n in named(m, m.plan.notes)],
        blind=blind,
        blind_reason=next((m.plan.blind_reason for m in planned if m.plan.blind), ""),
        models=planned,
        at_once=at_once,
    )
    return plan, together


def host_plan(host_config: HostConfig) -> HostPlan:
    """The plan of a deployed host as its deploy made it, read over SSH: a Hugging Face
    reference resolved through models.lock.yml, the host's GPUs (for the CUDA backend) and the
    model's header. Raises HubError for a reference the lock cannot resolve."""
    data = resolved(host_config.data)
    return plan_for(host_config.name, data, shell_reader(data))[0]


def _model_header(gathered: Gathered, data: dict, reader: Reader | None) -> None:
    """The model's header for ``gathered``: recorded in models.lock.yml, else read from the
    model's URL, else from the file on the host. A header read from the file that the lock
    does not hold (or holds with another digest) goes to ``gathered.read``, to be recorded.
    A file with no sha256 may change on the host: with the host at hand its own header wins
    over the record."""
    files = model_files(data)
    keys = [header_key(file) for file in files]
    lock = lock_path()
    try:
        locked = [
            recorded_header(lock, key) or recorded_header(lock, declared_key(file))
            for key, file in zip(keys, files, strict=True)
        ]
    except GgufError as error:
        locked, gathered.warnings = [None] * len(files), [*gathered.warnings, str(error)]
    pinned = all(file.sha256 for file in files)
    declared = any(record is not None and not record.digest for record in locked)
    if all(locked) and not declared and (pinned or reader is None):
        gathered.header, gathered.header_source = merge_split(locked), str(lock)
        return
    headers, note = url_headers(data)
    if not headers and reader is not None:
        heads = [(host_header(reader, file), file.dest) for file in files]
        merged, note = header_from_host(heads, note)
        headers = [head for head, _ in heads] if merged else []
        if not headers and all(file.url for file in files):
            # Not on the host yet: the host may reach the URL where this machine cannot.
            from_host = [host_url_header(reader, file) for file in files]
            if all(isinstance(head, GgufHeader) for head in from_host):
                headers = from_host
    if not headers:
        if all(locked):  # not readable yet (the file is not on the host): the record plans
            gathered.header, gathered.header_source = merge_split(locked), str(lock)
            gathered.header_declared = "; ".join(
                dict.fromkeys(r.source for r in locked if not r.digest)
            )
        else:
            gathered.header_note = note
        return
    try:
        gathered.header = merge_split(headers)
    except GgufError as error:
        gathered.header_note = str(error)
        return
    for key, header, record, file in zip(keys, headers, locked, files, strict=True):
        if record is None or record.digest != header.digest:
            gathered.read.append((key, header))
        if record is None or record.digest == header.digest:
            continue
        what = next(iter(key.values()))
        if record.digest:
            gathered.warnings.append(
                f"{lock}: the recorded header of {what} is not the file's (digest "
                f"{record.digest[:12]} against {header.digest[:12]}): planned with the file's, "
                "and recorded again by a deploy or `llamarig lock`"
            )
            continue
        gathered.superseded.append(declared_key(file))
        differ = header_record.differences(record, header)
        gathered.warnings.append(
            f"{record.source}: the file's header "
            + (f"differs: {'; '.join(differ)}; planned with the file's" if differ else "agrees")
            + ", which a deploy or `llamarig lock` records in its place"
        )


def host_url_header(reader: Reader, file: ModelFile) -> GgufHeader | GgufError | None:
    """The GGUF header of a model file's URL as the host reads it (with the Hub token's header
    file where the host has one), kept on this machine by the file's sha256; None when the
    host reads nothing."""
    return _kept_or_read(
        file.sha256,
        file.url,
        lambda size: reader(UrlHead, url=file.url, size=size, header_file=HUB_TOKEN_HEADER_PATH),
    )


def host_header(reader: Reader, file: ModelFile) -> GgufHeader | GgufError | None:
    """The GGUF header of a model file on the host, the error reading it, or None when the
    file is not there: kept on this machine by the file's sha256, else by its path and
    identity (``llamarig.model.header``); else read over the connection."""
    key = file.sha256 or model_header.identity_key(file.dest, reader(FileIdentity, path=file.dest))
    return _kept_or_read(key, file.dest, lambda size: reader(FileHead, path=file.dest, size=size))


def _kept_or_read(
    key: str | None, name: str, read: Callable[[int], bytes | None]
) -> GgufHeader | GgufError | None:
    """The header kept on this machine under ``key``, else the one in the first bytes that
    ``read(size)`` gives (a small read first, the rest only for a large header), kept; the
    error reading it, or None when ``read`` gives nothing."""
    kept = model_header.cached(key, name=name)
    if kept is not None:
        return kept
    header: GgufHeader | GgufError | None = None
    for size in (HOST_HEADER_FIRST_READ, HOST_HEADER_READ):
        head = read(size)
        if not head:
            return None
        try:
            header = read_gguf_header(head, name=name)
            break
        except GgufError as error:  # truncated, or damaged: a larger read says which
            header = error
            if len(head) < size:  # the whole file was read
                break
    if isinstance(header, GgufHeader):
        model_header.keep(key, head, header)
    return header
