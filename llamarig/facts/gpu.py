"""GPUs as the host shows them: NVIDIA devices on the PCI bus, nvidia-smi's list, and the memory
overheads measured on this host."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase


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
            bus_id, device_id, device_class, driver = line.split()
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
    values = [value.strip() for value in line.split(",")]
    record = dict(zip(NVIDIA_SMI_FIELDS, values, strict=True))
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
