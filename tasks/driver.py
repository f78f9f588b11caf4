"""NVIDIA driver: the open kernel modules from the chosen source, or a preinstalled driver
checked against the version floors of the GPUs and the toolkit."""

from pyinfra import host
from pyinfra.facts.server import KernelVersion, LinuxDistribution

from llamarig import operations, stage
from llamarig.facts import NvidiaSmiGpus
from llamarig.hardware import check_versions
from llamarig.platform import is_debian

rig = stage.rig()
driver = rig["driver"]
driver_gpus = host.get_fact(NvidiaSmiGpus)
running_version = driver_gpus[0]["driver_version"] if driver_gpus else None
compute_capabilities = [gpu["compute_capability"] for gpu in (driver_gpus or rig["gpus"])]


def floor_problems(driver_version):
    return check_versions(
        compute_capabilities,
        cuda_version=rig["cuda"]["version"] if rig["cuda"]["source"] != "none" else None,
        driver_version=driver_version,
        open_modules=driver["open"],
        driver_source=driver["source"],
        cuda_source=rig["cuda"]["source"],
    )


if driver["source"] == "none":
    host.noop("no NVIDIA driver wanted (CPU-only rig)")
elif driver["source"] == "preinstalled":
    if driver_gpus is None or not driver_gpus:
        stage.refuse(
            [
                "driver.source is `preinstalled` but nvidia-smi does not answer; install the "
                "driver (or choose source nvidia-repo/distro) and reboot"
            ]
        )
    problems = floor_problems(running_version)
    if problems:
        stage.refuse(problems)
    host.noop(f"preinstalled driver {running_version} meets the floors of GPUs and toolkit")
elif running_version and not floor_problems(running_version):
    host.noop(
        f"driver {running_version} is already installed and meets the floors; not reinstalled"
    )
else:
    # The version gates of the GPUs and toolkit were checked by the plan in preflight.
    debian = is_debian(host.get_fact(LinuxDistribution))
    # Debian's headers meta package follows the installed kernel; DKMS builds for it.
    headers = "linux-headers-amd64" if debian else f"linux-headers-{host.get_fact(KernelVersion)}"
    if driver["source"] == "nvidia-repo":
        packages = ["nvidia-open" if driver["open"] else "cuda-drivers", headers]
        dkms_package = "nvidia-open-dkms" if driver["open"] else "nvidia-kernel-dkms"
    elif debian:
        packages = ["nvidia-open-kernel-dkms", "nvidia-driver", "firmware-nvidia-gsp", headers]
        dkms_package = "nvidia-open-kernel-dkms"
    else:
        branch = driver["branch"]
        suffix = "-open" if driver["open"] else ""
        packages = [f"nvidia-driver-{branch}{suffix}", f"nvidia-utils-{branch}", headers]
        dkms_package = f"nvidia-dkms-{branch}{suffix}"
    stage.record(
        "reboot",
        operations.driver_packages(
            name=f"NVIDIA driver ({driver['source']}, branch {driver['branch']})",
            packages=packages,
            dkms_package=dkms_package,
        ),
    )
