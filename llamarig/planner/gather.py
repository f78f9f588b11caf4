"""What llamarig reads from a host before planning (its GPUs, the model's header),
whichever client reads it, and the one path to a plan (``plan_for``)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, replace
from typing import Any

from llamarig.config import HostConfig
from llamarig.config.lock import resolved
from llamarig.config.ssh import SshTarget
from llamarig.facts.cache import Reader
from llamarig.facts.gpu import (
    HostOutputError,
    MeasuredOverheads,
    NvidiaPciDevices,
    NvidiaSmiGpus,
)
from llamarig.model.catalog import is_router, model_views
from llamarig.onhost.hostpaths import OVERHEADS_DIR
from llamarig.planner.header import FoundHeader, find_model_header, load_header
from llamarig.planner.host_plan import HostPlan, PlannedModel
from llamarig.planner.plan import plan_host
from llamarig.planner.router_plan import plan_router
from llamarig.tables.hardware import gpus_from_pci


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
        smi = _unless_unreadable(gathered, reader, NvidiaSmiGpus, "nvidia-smi")
        if smi:
            gathered.probed_gpus, gathered.gpu_source = smi, "nvidia-smi"
            gathered.driver_version = smi[0]["driver_version"]
        else:
            devices = _unless_unreadable(gathered, reader, NvidiaPciDevices, "the PCI ids")
            found, warnings = gpus_from_pci(devices or [])
            gathered.warnings += warnings
            gathered.probed_gpus, gathered.gpu_source = found or None, "PCI ids"
    if data["llama_cpp"]["backend"] == "cuda":
        if gpus and reader is not None:  # what earlier starts measured on these GPUs
            gathered.measured_overheads = reader(MeasuredOverheads, path=OVERHEADS_DIR)
        if model:  # the user's local copy, read in place and not recorded
            gathered.header, gathered.header_note = load_header(data, model)
        else:
            find_model_header(gathered, data, reader)
    return gathered


def _unless_unreadable(gathered: Gathered, reader: Reader, fact: type, what: str):
    """``fact`` as the host tells it; None, with a warning, when the host printed what it
    cannot be read from (the plan then stands on the next source, or on the rig data)."""
    try:
        return reader(fact)
    except HostOutputError as error:
        gathered.warnings.append(f"{what} not used: {error}")
        return None


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
    (``router_plan.plan_router``)."""
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
