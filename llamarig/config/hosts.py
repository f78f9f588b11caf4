"""The loaded inventory: its hosts, each with merged rig data and where each key came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class HostConfig:
    """One host of the inventory with its merged, validated rig data."""

    name: str
    groups: list[str]  # every group the host is in, in the order their vars merge (`all` first)
    data: dict[str, Any]
    # key path (tuple) -> file that set it, for error messages
    origins: dict[tuple, str] = field(default_factory=dict, repr=False)


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, HostConfig]
    groups: dict[str, list[str]]
