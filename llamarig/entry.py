"""`llamarig init`: probe a box and write its inventory entry, so nobody types bus ids by hand.

The probe reads what the deploy's own facts read (nvidia-smi, else the PCI ids before a driver
exists; /etc/*-release; the toolkit's nvcc); the entry is the Ansible-style YAML of one host:
its ssh settings, the GPUs in PCI bus order with names, memory, compute capability and bus ids,
and a suggested driver and CUDA source. With a model the entry gets it too, and the split the
planner chose for these GPUs. The result is loaded as an inventory before it is written.
"""

from __future__ import annotations

from dataclasses import dataclass

import yaml
from pyinfra.facts.server import LinuxDistribution

from llamarig import platform, render
from llamarig.facts import NvccVersion, NvidiaPciDevices, NvidiaSmiGpus, Reader
from llamarig.hardware import gpus_from_pci


@dataclass
class Probe:
    gpus: list[dict]  # name, vram_mib, compute_capability, bus_id
    gpu_source: str  # nvidia-smi | PCI ids | none
    driver_version: str | None
    distribution: dict
    nvcc_version: str | None
    warnings: list[str]


def probe(reader: Reader) -> Probe:
    """What the box has, read through ``reader`` (pyinfra facts or ssh)."""
    warnings: list[str] = []
    smi = reader(NvidiaSmiGpus)
    if smi:
        gpus, source, driver = smi, "nvidia-smi", smi[0]["driver_version"]
    else:
        gpus, warnings = gpus_from_pci(reader(NvidiaPciDevices) or [])
        source, driver = ("PCI ids" if gpus else "none"), None
    distribution = reader(LinuxDistribution) or {}
    warnings += platform.os_problems(distribution, "x86_64")
    by_bus = sorted(gpus, key=lambda gpu: render.pci_sort_key(gpu.get("bus_id") or "0:0:0.0"))
    return Probe(by_bus, source, driver, distribution, reader(NvccVersion), warnings)


def host_entry(ssh: dict, found: Probe) -> dict:
    """The host's settings: ssh, gpus in bus order, and the suggested sources."""
    settings: dict = {"ssh": ssh}
    if not found.gpus:
        settings.update(
            driver={"source": "none"},
            cuda={"source": "none"},
            llama_cpp={"backend": "cpu"},
            server={"split_mode": "none"},
        )
        return settings
    settings["gpus"] = [
        {
            "name": gpu["name"],
            "vram_mib": gpu["vram_mib"],
            "compute_capability": gpu["compute_capability"],
            "pci_bus_id": gpu["bus_id"],
        }
        for gpu in found.gpus
    ]
    # A driver that already answers is kept; otherwise NVIDIA's repository, branch-pinned.
    settings["driver"] = {"source": "preinstalled" if found.driver_version else "nvidia-repo"}
    settings["cuda"] = (
        {"source": "preinstalled", "version": found.nvcc_version}
        if found.nvcc_version
        else {"source": "nvidia-repo"}
    )
    return settings


def inventory_document(name: str, settings: dict) -> dict:
    return {"all": {"children": {"rigs": {"hosts": {name: settings}}}}}


def render_entry(name: str, found: Probe, document: dict) -> str:
    """The inventory as YAML, with what was probed said in comments at the top."""
    release = (found.distribution.get("release_meta") or {}).get("PRETTY_NAME", "unknown OS")
    lines = [
        f"# Written by `llamarig init` for {name}: {release}; GPUs from {found.gpu_source}"
        + (f" (driver {found.driver_version})" if found.driver_version else "")
        + (f"; CUDA {found.nvcc_version} at /usr/local/cuda" if found.nvcc_version else "")
        + ".",
        *(f"# warning: {warning}" for warning in found.warnings),
    ]
    body = yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body
