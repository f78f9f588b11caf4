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
from llamarig.plan import HostPlan, plan_host
from llamarig.remote import gather

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
        gathered = gather(data, host.get_fact, gpus=data["llama_cpp"]["backend"] == "cuda")
        for warning in gathered.warnings:
            host.noop(warning)
        _plans[host.name] = plan_host(host.name, data, **gathered.plan_inputs())
    return _plans[host.name]


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
