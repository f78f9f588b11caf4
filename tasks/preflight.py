"""Preflight: refuse an unsupported host before anything is changed; report what is there."""

from pyinfra import host
from pyinfra.facts.server import Arch, KernelVersion, LinuxDistribution

from llamarig import stage
from llamarig.facts import FirmwareBoot, NvidiaPciDevices, NvidiaSmiGpus
from llamarig.platform import os_problems

rig = stage.rig()
distribution = host.get_fact(LinuxDistribution)
problems = os_problems(distribution, host.get_fact(Arch))

pci_gpus = host.get_fact(NvidiaPciDevices)
driver_gpus = host.get_fact(NvidiaSmiGpus)
firmware = host.get_fact(FirmwareBoot)

# A container may hide the PCI bus from sysfs while its driver answers: either is evidence.
if rig["llama_cpp"]["backend"] == "cuda" and not pci_gpus and not driver_gpus:
    problems.append(
        "no NVIDIA GPU on the PCI bus (sysfs vendor 0x10de) and no nvidia-smi answer; set "
        "llama_cpp.backend: cpu and driver/cuda source: none for a CPU-only rig"
    )
if problems:
    stage.refuse(problems)
# The plan checks the GPUs against the declaration, the version floors and the memory.
plan = stage.plan()
if plan.errors:
    stage.refuse(plan.errors)
for warning in plan.warnings:
    host.noop(f"warning: {warning}")

secure_boot = {True: "on", False: "off", None: "unknown"}[firmware["secure_boot"]]
gpu_summary = (
    ", ".join(f"{gpu['name']} ({gpu['bus_id']})" for gpu in driver_gpus)
    if driver_gpus
    else ", ".join(f"{gpu['device_id']} at {gpu['bus_id']}" for gpu in pci_gpus) or "none"
)
host.noop(
    f"{distribution['release_meta'].get('PRETTY_NAME')}, kernel {host.get_fact(KernelVersion)}, "
    f"{'UEFI' if firmware['uefi'] else 'BIOS'} boot, secure boot {secure_boot}; GPUs: {gpu_summary}"
)
if firmware["secure_boot"] and rig["driver"]["source"] in ("nvidia-repo", "distro"):
    host.noop(
        "secure boot is on: the DKMS-built nvidia modules load only once their signing key "
        "is enrolled (mokutil --import /var/lib/dkms/mok.pub, then confirm at the next boot)"
    )
