"""Preflight: refuse an unsupported host before anything is changed; report what is there."""

from pyinfra import api, host
from pyinfra.facts.server import Arch, KernelVersion, LinuxDistribution

from llamarig.converge import stage
from llamarig.facts.cache import known
from llamarig.facts.driver import FirmwareBoot
from llamarig.facts.gpu import NvidiaPciDevices, NvidiaSmiGpus
from llamarig.tables.platform import os_problems
from tasks import driver


@api.deploy("tasks/preflight.py")
def deploy() -> None:
    """Refuse the host, or its plan, before any stage changes it."""
    rig = stage.rig()
    stage.read_system()
    distribution = known(LinuxDistribution)
    unsupported = os_problems(distribution, known(Arch))
    problems = list(unsupported)
    if stage.serves_no_model():
        if unsupported:
            stage.refuse(problems)
        stage.read_gateway_state()
        host.noop(
            f"{distribution['release_meta'].get('PRETTY_NAME')}, kernel {known(KernelVersion)}; "
            + (
                "a builder (role: builder): llama.cpp builds for the rigs only"
                if stage.builder_only()
                else "a gateway alone (role: gateway): HAProxy only"
            )
        )
        return

    pci_gpus = known(NvidiaPciDevices)
    driver_gpus = known(NvidiaSmiGpus)
    firmware = known(FirmwareBoot)

    # A container may hide the PCI bus from sysfs while its driver answers: either is evidence.
    if rig["llama_cpp"]["backend"] == "cuda" and not pci_gpus and not driver_gpus:
        problems.append(
            "no NVIDIA GPU on the PCI bus (sysfs vendor 0x10de) and no nvidia-smi answer; set "
            "llama_cpp.backend: cpu and driver/cuda source: none for a CPU-only rig"
        )
    # A rig that declares its GPUs is planned even on a host where they are missing, so that
    # one refusal names everything to fix: the missing GPUs and what the plan finds wrong.
    if unsupported or (problems and not rig["gpus"]):
        stage.refuse(problems)
    # The plan checks the GPUs against the declaration, the version floors and the memory.
    plan = stage.plan()
    if problems or plan.errors:
        stage.refuse(problems + plan.errors)
    for warning in plan.warnings:
        host.noop(f"warning: {warning}")
    stage.read_managed_state()

    secure_boot = {True: "on", False: "off", None: "unknown"}[firmware["secure_boot"]]
    gpu_summary = (
        ", ".join(f"{gpu['name']} ({gpu['bus_id']})" for gpu in driver_gpus)
        if driver_gpus
        else ", ".join(f"{gpu['device_id']} at {gpu['bus_id']}" for gpu in pci_gpus) or "none"
    )
    boot_mode = "UEFI" if firmware["uefi"] else "BIOS"
    host.noop(
        f"{distribution['release_meta'].get('PRETTY_NAME')}, "
        f"kernel {known(KernelVersion)}, "
        f"{boot_mode} boot, secure boot {secure_boot}; GPUs: {gpu_summary}"
    )
    # Secure Boot on: a module the kernel would refuse is stopped here, before any stage
    # installs anything (pyinfra prepares every stage before it runs one).
    decision = driver.secure_boot_decision(rig)
    if decision.action == "stop":
        stage.refuse(decision.steps)
    build_failure = driver.known_build_failure(rig, decision)
    if build_failure:
        stage.refuse([build_failure])
    module_problems = driver.loaded_module_problems(rig)
    if module_problems:
        stage.refuse(module_problems)
    if decision.action == "prebuilt":
        host.noop(
            "secure boot is on: Canonical's signed prebuilt modules "
            f"({', '.join(decision.packages.packages[:2])}) instead of a DKMS build"
        )
    elif decision.action == "sign":
        host.noop(
            "secure boot is on (driver.secure_boot: sign): DKMS signs the module with the "
            "Machine Owner Key in /var/lib/dkms; a person confirms its enrollment at the "
            "console on the next boot"
        )
