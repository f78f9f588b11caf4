"""GPUs as the host shows them: NVIDIA devices on the PCI bus, nvidia-smi's list, and the memory
overheads measured on this host."""

from __future__ import annotations

import re
import shlex

from pyinfra.api import FactBase

from llamarig.tables.text import printable

# A PCI bus id as nvidia-smi (8-digit domain) and sysfs (4-digit) write it.
BUS_ID = re.compile(r"(?:[0-9A-Fa-f]{4,8}:)?[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]")


class HostOutputError(ValueError):
    """What a host printed that a GPU fact cannot read (a field too many, `[N/A]` for a
    number): the command and the field named, the value shown escaped. The planner falls back
    from it as from a driver that does not answer; ``llamarig init`` names it and stops."""


class NvidiaPciDevices(FactBase):
    """NVIDIA display/3D controllers on the PCI bus, read from sysfs (works before any driver).

    .. code:: python

        [{"bus_id": "0000:01:00.0", "device_id": "0x2204", "class": "0x030000",
          "driver": "nvidia"}]
    """

    default = list

    def command(self) -> str:
        return (
            "for dev in /sys/bus/pci/devices/*; do "
            '[ "$(cat $dev/vendor 2>/dev/null)" = 0x10de ] || continue; '
            'case "$(cat $dev/class)" in 0x03*) ;; *) continue;; esac; '
            'driver=-; [ -e $dev/driver ] && driver=$(basename "$(readlink $dev/driver)"); '
            'echo "$(basename $dev) $(cat $dev/device) $(cat $dev/class) $driver"; '
            "done"
        )

    def process(self, output):
        devices = []
        for line in output:
            fields = line.split()
            if len(fields) != 4:
                raise HostOutputError(
                    f"the PCI device list (/sys/bus/pci) printed {len(fields)} fields, not 4 "
                    f"(bus id, device id, class, driver): '{printable(line)}'"
                )
            bus_id, device_id, device_class, driver = fields
            if not BUS_ID.fullmatch(bus_id):
                raise HostOutputError(f"a PCI bus id is '{printable(bus_id)}'")
            devices.append(
                {
                    "bus_id": bus_id,
                    "device_id": device_id,
                    "class": device_class,
                    "driver": None if driver == "-" else driver,
                }
            )
        return devices


NVIDIA_SMI_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "memory.total",
    "compute_cap",
    "pcie.link.gen.current",
    "pcie.link.width.current",
    "driver_version",
)


class NvidiaSmiGpus(FactBase):
    """GPUs as the loaded NVIDIA driver reports them, in nvidia-smi (PCI bus) order.

    An empty list when nvidia-smi is missing; None when it is present but cannot talk to the
    driver (not loaded, or a version mismatch after an upgrade without reboot).
    """

    default = list

    def requires_command(self) -> str:
        return "nvidia-smi"

    def command(self) -> str:
        fields = ",".join(NVIDIA_SMI_FIELDS)
        return f"nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits || echo FAILED"

    def process(self, output):
        if any(line.strip() == "FAILED" for line in output):
            return None
        return [parse_nvidia_smi_line(line) for line in output if line.strip()]


def parse_nvidia_smi_line(line: str) -> dict:
    """One GPU of nvidia-smi's CSV; a HostOutputError for a line that is not one (a comma in
    a name splits it, `[N/A]` where a number belongs)."""
    values = [value.strip() for value in line.split(",")]
    if len(values) != len(NVIDIA_SMI_FIELDS):
        raise HostOutputError(
            f"nvidia-smi --query-gpu printed {len(values)} comma-separated fields, not "
            f"{len(NVIDIA_SMI_FIELDS)} (a comma in a GPU's name?): '{printable(line)}'"
        )
    record = dict(zip(NVIDIA_SMI_FIELDS, values, strict=True))
    for field in ("index", "memory.total"):
        if not record[field].isdecimal() or not record[field].isascii():
            raise HostOutputError(
                f"nvidia-smi's {field} is '{printable(record[field])}', not a number"
            )
    if not BUS_ID.fullmatch(record["pci.bus_id"]):
        raise HostOutputError(f"nvidia-smi's pci.bus_id is '{printable(record['pci.bus_id'])}'")
    return {
        "index": int(record["index"]),
        "bus_id": record["pci.bus_id"],
        "name": record["name"],
        "vram_mib": int(record["memory.total"]),
        "compute_capability": record["compute_cap"],
        "pcie_gen": record["pcie.link.gen.current"],
        "pcie_width": record["pcie.link.width.current"],
        "driver_version": record["driver_version"],
    }


class MeasuredOverheads(FactBase):
    """The per-GPU overheads the deploy measured after starting each build in each split mode
    (files ``BUILD.MODE`` in ``path``, each the MiB beyond llama.cpp's buffers per used GPU).

    .. code:: python

        {("0c1e57098bba-1a2b3c4d5e", "tensor"): [1907, 1907]}
    """

    default = dict

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return (
            f'for f in {quoted}/*.*; do [ -f "$f" ] && echo "${{f##*/}} $(head -c 200 "$f")"; '
            "done; true"
        )

    def process(self, output: list[str]) -> dict:
        found = {}
        for line in output:
            name, _, values = line.partition(" ")
            build, _, mode = name.rpartition(".")
            try:
                found[(build, mode)] = [int(value) for value in values.split()]
            except ValueError:
                continue  # a file llamarig did not write: ignored, never trusted
        return found
