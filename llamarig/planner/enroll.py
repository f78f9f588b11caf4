"""`llamarig init`: probe a box and write its inventory entry, so nobody types bus ids by hand.

The probe reads what the deploy's own facts read (nvidia-smi, else the PCI ids before a driver
exists; /etc/*-release; the toolkit's nvcc); the entry is the Ansible-style YAML of one host:
its ssh settings, the GPUs in PCI bus order with names, memory, compute capability and bus ids,
and a suggested driver and CUDA source. With a model the entry gets it too, and the split the
planner chose for these GPUs. The result is loaded as an inventory before it is written.

What the box prints is untrusted input: every value that goes into the entry is checked for its
shape first (a GPU's name printable text, its memory a whole number of MiB, bus ids, compute
capability and driver version as nvidia-smi writes them), and one that is not (`[N/A]`, a name
with a comma that splits nvidia-smi's CSV line, an escape sequence) is a `ProbeError` naming the
field, its value shown escaped (`llamarig.tables.text.printable`). What is only shown (the release's
name, warnings) is written escaped.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pyinfra.facts.server import LinuxDistribution

from llamarig.config.shapes import SHA256_HEX, address_problem, url_problem
from llamarig.config.ssh_trust import _host_key_known
from llamarig.facts.build import NvccVersion
from llamarig.facts.cache import Reader
from llamarig.facts.gpu import HostOutputError, NvidiaPciDevices, NvidiaSmiGpus
from llamarig.tables import platform
from llamarig.tables.hardware import gpus_from_pci, pci_sort_key
from llamarig.tables.text import printable


class ProbeError(Exception):
    """What the box printed that cannot go into an entry: the field named, the value escaped."""


# The shapes of what goes into the entry (llamarig/schema.json's `gpus` items, tighter).
COMPUTE_CAPABILITY = re.compile(r"^[0-9]{1,2}\.[0-9]$")
DRIVER_VERSION = re.compile(r"^[0-9]{1,4}(\.[0-9]{1,4}){1,3}$")
PCI_DEVICE_ID = re.compile(r"^0x[0-9A-Fa-f]{4}$")
MAX_NAME_CHARACTERS = 96
MAX_GPUS = 64
MAX_VRAM_MIB = 2**31 - 1


def _shown(value: object) -> str:
    """A value from the box as a message shows it: quoted, control characters escaped."""
    return f"'{printable(value)}'"


# Errors a fact's parser raises on output it does not expect beyond what the GPU facts name
# themselves (HostOutputError): output that is not UTF-8, a release file named `..`.
_PARSE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError)


def _read(reader: Reader, fact: type, what: str):
    """``fact`` read, or a ProbeError saying that ``what`` could not be read and why."""
    try:
        return reader(fact)
    except HostOutputError as error:  # the GPU facts name the field and show it escaped
        raise ProbeError(
            f"{error} (where the box cannot tell, write the GPU's entry by hand: "
            "docs/inventory.md, `gpus`)"
        ) from None
    except (*_PARSE_ERRORS, OSError) as error:
        raise ProbeError(f"{what} could not be read: {printable(error)}") from None


def _checked_gpus(gpus: list[dict], source: str) -> list[dict]:
    """``gpus`` (from nvidia-smi or the PCI ids) if every field that goes into the entry has
    its shape; else a ProbeError naming the GPU, the field and its value."""
    if len(gpus) > MAX_GPUS:
        raise ProbeError(f"{source} lists {len(gpus)} GPUs; one box holds at most {MAX_GPUS}")
    for number, gpu in enumerate(gpus, 1):
        where = f"{source}, GPU {number}"
        name, vram = gpu.get("name"), gpu.get("vram_mib")
        if not isinstance(name, str) or not name.strip() or not name.isprintable():
            raise ProbeError(
                f"{where}: name {_shown(name)} is not a GPU's name (printable text without "
                "control characters)"
            )
        if len(name) > MAX_NAME_CHARACTERS:
            raise ProbeError(
                f"{where}: name {_shown(name[:40])}... is longer than {MAX_NAME_CHARACTERS} "
                "characters"
            )
        if not isinstance(vram, int) or not 0 < vram <= MAX_VRAM_MIB:
            raise ProbeError(f"{where}: memory.total {_shown(vram)} is not a number of MiB")
        if not COMPUTE_CAPABILITY.fullmatch(str(gpu.get("compute_capability"))):
            raise ProbeError(
                f"{where}: compute_cap {_shown(gpu.get('compute_capability'))} is not a compute "
                "capability such as 8.6"
            )
        driver = gpu.get("driver_version")
        if source == "nvidia-smi" and not DRIVER_VERSION.fullmatch(str(driver)):
            raise ProbeError(
                f"{where}: driver_version {_shown(driver)} is not a driver version such as "
                "580.95.05"
            )
    return gpus


def _pci_devices(reader: Reader) -> list[dict]:
    """The NVIDIA devices on the PCI bus, each device id of its shape (the fact checks the bus
    ids)."""
    devices = _read(reader, NvidiaPciDevices, "the PCI device list (/sys/bus/pci)") or []
    for number, device in enumerate(devices, 1):
        if not PCI_DEVICE_ID.fullmatch(str(device.get("device_id"))):
            raise ProbeError(
                f"the PCI device list (/sys/bus/pci), device {number}: device id "
                f"{_shown(device.get('device_id'))} is not a PCI device id"
            )
    return devices


@dataclass
class Probe:
    gpus: list[dict]  # name, vram_mib, compute_capability, bus_id
    gpu_source: str  # nvidia-smi | PCI ids | none
    driver_version: str | None
    distribution: dict
    nvcc_version: str | None
    warnings: list[str]


def probe(reader: Reader) -> Probe:
    """What the box has, read through ``reader`` (pyinfra facts or ssh). Raises ProbeError
    when what it printed cannot go into an entry."""
    warnings: list[str] = []
    smi = _read(reader, NvidiaSmiGpus, "nvidia-smi's GPU list (--query-gpu)")
    if smi:
        gpus, source = _checked_gpus(smi, "nvidia-smi"), "nvidia-smi"
        driver = smi[0]["driver_version"]
    else:
        gpus, warnings = gpus_from_pci(_pci_devices(reader))
        gpus = _checked_gpus(gpus, "the PCI ids")
        source, driver = ("PCI ids" if gpus else "none"), None
    distribution = _read(reader, LinuxDistribution, "the release files (/etc/*-release)") or {}
    warnings += platform.os_problems(distribution, "x86_64")
    nvcc = _read(reader, NvccVersion, "the CUDA toolkit's version (nvcc --version)")
    by_bus = sorted(gpus, key=lambda gpu: pci_sort_key(gpu.get("bus_id") or "0:0:0.0"))
    return Probe(by_bus, source, driver, distribution, nvcc, warnings)


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
    # What the box said is shown escaped: a line break cannot end the comment, an escape
    # sequence cannot reach the terminal that shows the file.
    release = (found.distribution.get("release_meta") or {}).get("PRETTY_NAME", "unknown OS")
    lines = [
        f"# Written by `llamarig init` for {name}: {printable(release)}; GPUs from "
        f"{found.gpu_source}"
        + (f" (driver {printable(found.driver_version)})" if found.driver_version else "")
        + (
            f"; CUDA {printable(found.nvcc_version)} at /usr/local/cuda"
            if found.nvcc_version
            else ""
        )
        + ".",
        *(f"# warning: {printable(warning)}" for warning in found.warnings),
    ]
    body = yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
    return "\n".join(lines) + "\n" + body


# A login name as the loader takes `ssh.user` (llamarig/config/shapes.py): never an ssh option.
LOGIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def argument_problems(args) -> list[str]:
    """What is wrong with `llamarig init`'s own arguments (its parsed ``args``), found before
    the box is contacted."""
    problems = []
    address = address_problem(args.address, "--port", "--user") if args.address else None
    if address:
        problems.append(f"--address: {address}")
    elif not args.address and not args.local:
        problems.append("give the box's address (--address HOST) or --local")
    if not 0 < args.port < 65536:
        problems.append(f"--port: {args.port} is not a TCP port (1-65535)")
    if "@" in args.user:
        problems.append(f"--user: '{printable(args.user)}' holds an address: give it in --address")
    elif not LOGIN_NAME.fullmatch(args.user):
        problems.append(
            f"--user: '{printable(args.user)}' is not a login name (letters, digits, `_`, `.`, "
            "`-`; not starting with `-`), e.g. root"
        )
    for flag, value in (("--key", args.key), ("--known-hosts", args.known_hosts)):
        if value and not Path(os.path.expanduser(value)).is_file():
            problems.append(f"{flag}: there is no file {printable(value)}")
    known_hosts = os.path.expanduser(args.known_hosts or "")
    if args.address and not address and 0 < args.port < 65536 and os.path.isfile(known_hosts):
        # ssh checks the key strictly: a file without it would fail only after the connection.
        known = _host_key_known(known_hosts, args.address, args.port)
        if known is False:
            name = args.address if args.port == 22 else f"[{args.address}]:{args.port}"
            problems.append(
                f"--known-hosts: {printable(args.known_hosts)} has no key for {name}, and init "
                "checks host keys strictly: add the box's key first (docs/inventory.md, Enrolling "
                f"a new box: `ssh-keyscan -p {args.port} {args.address}`, and compare the "
                "fingerprint with the box's console)"
            )
    if args.model and (model := url_problem(args.model, ("http", "https"), "download over https")):
        problems.append(f"--model: {model}")
    if args.model and not args.sha256:
        problems.append("--model needs --sha256: the model file's sha256 (sha256sum FILE)")
    if args.sha256 and not SHA256_HEX.fullmatch(args.sha256):
        problems.append(
            f"--sha256: {args.sha256!r} is not a sha256: 64 lowercase hex digits (sha256sum FILE)"
        )
    if args.sha256 and not args.model:
        problems.append("--sha256 without --model: give the model's URL with --model")
    if args.output:
        target = Path(args.output)
        if target.is_dir():
            problems.append(
                f"--output: {printable(target)} is a directory: give a file, e.g. "
                f"{printable(target)}/rig.yml"
            )
        elif not target.parent.is_dir():
            problems.append(
                f"--output: there is no directory {printable(target.parent)} to write it in"
            )
        elif target.exists() and not args.force:
            problems.append(f"--output: {printable(target)} exists (pass --force to replace it)")
    return problems
