"""The package names a rig installs, per source and distribution (pure data; the stages install
them). A new distribution whose names differ from Debian's or Ubuntu's gets its branch here."""

from __future__ import annotations

import re
from dataclasses import dataclass

# What llama.cpp's build needs beyond a compiler: cmake with ninja, git for the pinned commit,
# ccache between builds, curl and TLS for the model download and the deploy's checks.
BUILD_DEPENDENCIES = (
    "build-essential",
    "cmake",
    "ninja-build",
    "git",
    "ccache",
    "pkg-config",
    "libssl-dev",
    "curl",
    "ca-certificates",
)

# What a shipped llama.cpp build needs at run time on a rig that installs no compiler: OpenMP
# (the CPU backend), and curl with TLS for the deploy's checks. The C++ and TLS libraries come
# with the base system and curl.
SHIPPED_BUILD_RUNTIME = ("libgomp1", "curl", "ca-certificates")


def build_tools(ccache: bool) -> list[str]:
    """The commands a build with ``build_dependencies: preinstalled`` needs on the PATH."""
    return ["cc", "c++", "cmake", "ninja", "git"] + (["ccache"] if ccache else [])


@dataclass(frozen=True)
class DriverPackages:
    packages: list[str]
    dkms_package: str | None  # the package whose DKMS build must succeed for the modules to load


def driver_packages(
    source: str, open_modules: bool, branch: str, debian: bool, kernel: str
) -> DriverPackages:
    """The NVIDIA driver from ``source`` (``nvidia-repo`` or ``distro``) with the kernel headers
    its DKMS build needs; ``kernel`` is the running kernel's release (Ubuntu's headers name it,
    Debian's meta package follows the installed kernel)."""
    headers = "linux-headers-amd64" if debian else f"linux-headers-{kernel}"
    if source == "nvidia-repo":
        return DriverPackages(
            packages=["nvidia-open" if open_modules else "cuda-drivers", headers],
            dkms_package="nvidia-open-dkms" if open_modules else "nvidia-kernel-dkms",
        )
    if source != "distro":
        raise ValueError(f"no driver packages for source {source!r}")
    if debian:
        return DriverPackages(
            packages=["nvidia-open-kernel-dkms", "nvidia-driver", "firmware-nvidia-gsp", headers],
            dkms_package="nvidia-open-kernel-dkms",
        )
    suffix = "-open" if open_modules else ""
    return DriverPackages(
        packages=[f"nvidia-driver-{branch}{suffix}", f"nvidia-utils-{branch}", headers],
        dkms_package=f"nvidia-dkms-{branch}{suffix}",
    )


def prebuilt_module_packages(branch: int, kernel: str, open_modules: bool) -> DriverPackages:
    """Ubuntu's Canonical-signed prebuilt NVIDIA modules (source linux-restricted-modules, no
    DKMS, load under Secure Boot): ``linux-modules-nvidia-580-open-6.8.0-50-generic`` for the
    running kernel, the flavour's meta package ``linux-modules-nvidia-580-open-generic`` so the
    next kernel gets its modules too, and the driver's user space (nvidia-smi, libcuda).
    No packages when ``kernel`` is not an Ubuntu release string (no flavour to name)."""
    match = re.fullmatch(r"\d+\.\d+\.\d+-\d+-([a-z0-9][a-z0-9-]*)", kernel)
    if not match:
        return DriverPackages(packages=[], dkms_package=None)
    modules = f"linux-modules-nvidia-{branch}{'-open' if open_modules else ''}"
    return DriverPackages(
        packages=[
            f"{modules}-{kernel}",
            f"{modules}-{match.group(1)}",
            f"nvidia-utils-{branch}",
            f"libnvidia-compute-{branch}",
        ],
        dkms_package=None,
    )


def cuda_toolkit_package(source: str, version: str) -> str:
    """The toolkit package: NVIDIA's versioned one, or the distribution's single one."""
    if source == "nvidia-repo":
        return f"cuda-toolkit-{version.replace('.', '-')}"
    if source == "distro":
        return "nvidia-cuda-toolkit"
    raise ValueError(f"no toolkit package for source {source!r}")


# The driver sources whose kernel module DKMS builds on the host (and signs under Secure Boot).
DKMS_SOURCES = ("nvidia-repo", "distro")
