"""Shared helpers of the deploy stages in tasks/: the host's rig data and cross-stage changes.

pyinfra prepares each host by running deploy.py for it; stages record the operations whose
change must restart the server here, keyed by host, so a later stage can guard on them.
"""

from __future__ import annotations

from collections import defaultdict

from pyinfra import host
from pyinfra.api.exceptions import DeployError
from pyinfra.api.operation import OperationMeta
from pyinfra.connectors.local import LocalConnector

from llamarig.config import ConfigError, rig_data

_rigs: dict[str, dict] = {}
_recorded: dict[str, dict[str, list[OperationMeta]]] = defaultdict(lambda: defaultdict(list))


def rig() -> dict:
    """The validated rig data of the host being prepared."""
    if host.name not in _rigs:
        try:
            _rigs[host.name] = rig_data(host.data.dict())
        except ConfigError as error:
            refuse(error.problems)
    return _rigs[host.name]


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
