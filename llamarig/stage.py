"""Shared helpers of the deploy stages in tasks/: the host's rig data and cross-stage changes.

pyinfra prepares each host by running deploy.py for it; stages record the operations whose
change must restart the server here, keyed by host, so a later stage can guard on them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from pyinfra import host
from pyinfra.api.exceptions import DeployError
from pyinfra.api.operation import OperationMeta
from pyinfra.connectors.local import LocalConnector
from pyinfra.operations import systemd

from llamarig import operations
from llamarig.config import ConfigError, rig_data
from llamarig.facts import FileHead, NvidiaPciDevices, NvidiaSmiGpus
from llamarig.plan import (
    HOST_HEADER_READ,
    HostPlan,
    gpus_from_pci,
    header_from_host,
    load_header,
    plan_host,
)
from llamarig.render import layout

_rigs: dict[str, dict] = {}
_plans: dict[str, HostPlan] = {}
_recorded: dict[str, dict[str, list[OperationMeta]]] = defaultdict(lambda: defaultdict(list))


def rig() -> dict:
    """The validated rig data of the host being prepared."""
    if host.name not in _rigs:
        try:
            _rigs[host.name] = rig_data(host.data.dict())
        except ConfigError as error:
            refuse(error.problems)
    return _rigs[host.name]


def plan() -> HostPlan:
    """The plan of the host being prepared: its GPUs (nvidia-smi, else PCI ids) and the model's
    GGUF header (read from the model's URL, else from the file on the host)."""
    if host.name not in _plans:
        data = rig()
        probed, source, driver_version = None, "probed", None
        header, note = None, ""
        if data["llama_cpp"]["backend"] == "cuda":
            probed, source, driver_version = _probe_gpus()
            header, note = _model_header(data)
        _plans[host.name] = plan_host(host.name, data, header, note, probed, source, driver_version)
    return _plans[host.name]


def _probe_gpus() -> tuple[list[dict] | None, str, str | None]:
    smi = host.get_fact(NvidiaSmiGpus)
    if smi:
        return smi, "nvidia-smi", smi[0]["driver_version"]
    pci = host.get_fact(NvidiaPciDevices)
    if not pci:
        return None, "PCI ids", None
    gpus, warnings = gpus_from_pci(pci)
    for warning in warnings:
        host.noop(warning)
    return gpus, "PCI ids", None


def _model_header(data: dict):
    """The header from the model's URL (before anything is on the host), else the host's file."""
    header, reason = load_header(data)
    if header is not None:
        return header, ""
    path = layout(data)["model"]
    return header_from_host(host.get_fact(FileHead, path=path, size=HOST_HEADER_READ), path, reason)


def refuse(problems: list[str]) -> None:
    """Stop before anything is changed, with every problem on its own line."""
    raise DeployError("\n".join(f"{host.name}: {problem}" for problem in problems))


def record(kind: str, *operations: OperationMeta) -> None:
    _recorded[host.name][kind].extend(operations)


def recorded(kind: str) -> list[OperationMeta]:
    return list(_recorded[host.name][kind])


def is_local() -> bool:
    """True for pyinfra's @local host, which llamarig never reboots."""
    return issubclass(host.connector_cls, LocalConnector)


def service_running(
    service: str, out_of_date: Callable[[], bool], why: str
) -> tuple[OperationMeta, OperationMeta]:
    """The unit enabled and running, restarted when ``out_of_date()`` (``why`` names the
    inputs) unless this run just started it; returns the start and the restart."""
    started = systemd.service(
        name=f"{service} enabled and running", service=service, running=True, enabled=True
    )
    restarted = operations.restart_service(
        name=f"Restart {service} ({why})",
        service=service,
        _if=lambda: out_of_date() and not started.did_change(),
    )
    return started, restarted
