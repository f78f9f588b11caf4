"""NVIDIA driver: the open kernel modules from the chosen source, or a preinstalled driver
checked against the version floors of the GPUs and the toolkit."""

import sys
from io import StringIO

from pyinfra import api, host
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.server import KernelVersion, LinuxDistribution
from pyinfra.operations import files, python, server

from llamarig import operations
from llamarig.converge import secureboot, stage
from llamarig.facts.apt import AptCandidates, PackageVersions
from llamarig.facts.cache import known
from llamarig.facts.driver import (
    DkmsSigning,
    DriverBuildFailure,
    FirmwareBoot,
    MokKeyState,
    NvidiaModule,
)
from llamarig.facts.gpu import NvidiaSmiGpus
from llamarig.onhost import driver_build
from llamarig.tables import packages
from llamarig.tables.hardware import check_versions, chosen_versions
from llamarig.tables.platform import is_debian


def dkms_signing() -> secureboot.DkmsSigning:
    """DKMS's signing key pair on the host and whether it is enrolled."""
    configured = known(DkmsSigning)
    state = known(MokKeyState, key=configured["key"], certificate=configured["certificate"])
    return secureboot.DkmsSigning(
        key=configured["key"],
        certificate=configured["certificate"],
        key_exists=state["key_exists"],
        certificate_exists=state["certificate_exists"],
        enrollment=state["enrollment"],
    )


def secure_boot_decision(rig: dict) -> secureboot.Decision:
    """What `driver.secure_boot` makes of this host (Secure Boot off: ``unchanged``, and no
    fact beyond the firmware's is read)."""
    driver = rig["driver"]
    secure_boot = known(FirmwareBoot)["secure_boot"]
    if secure_boot is not True or driver["source"] not in secureboot.DKMS_SOURCES:
        return secureboot.Decision("unchanged")
    debian = is_debian(known(LinuxDistribution))
    kernel = known(KernelVersion)
    prebuilt = packages.prebuilt_module_packages(driver["branch"], kernel, driver["open"])
    candidates = (
        known(AptCandidates, packages=prebuilt.packages)
        if not debian and driver["source"] == "distro" and prebuilt.packages
        else {}
    )
    return secureboot.decide(
        driver["secure_boot"],
        secure_boot,
        driver["source"],
        debian=debian,
        kernel=kernel,
        branch=driver["branch"],
        open_modules=driver["open"],
        signing=dkms_signing(),
        apt_candidates=candidates,
    )


def built_packages(driver: dict) -> packages.DriverPackages:
    """The packages of the driver's DKMS build from ``driver.source``."""
    return packages.driver_packages(
        driver["source"],
        open_modules=driver["open"],
        branch=driver["branch"],
        debian=is_debian(known(LinuxDistribution)),
        kernel=known(KernelVersion),
    )


def known_build_failure(rig: dict, decision: secureboot.Decision) -> str | None:
    """Why the driver's DKMS build is not tried again: it failed on an earlier deploy for the
    package version apt would install now and the running kernel (None: nothing recorded, a
    prebuilt module, or a version or kernel that changed since)."""
    driver = rig["driver"]
    # The record is read (prefetched with the system) only where DKMS builds the module.
    if driver["source"] not in secureboot.DKMS_SOURCES or decision.action == "prebuilt":
        return None
    failure = known(DriverBuildFailure)
    if failure is None:
        return None
    package = built_packages(driver).dkms_package
    if package is None or known(PackageVersions, packages=[package]).get(package) is not None:
        return None  # installed since: nothing is built again
    candidate = known(AptCandidates, packages=[package]).get(package)
    return driver_build.refusal(failure, package, candidate, known(KernelVersion))


def loaded_module_problems(rig: dict) -> list[str]:
    """After a `sign` run and its reboot: the module's signer, its key's enrollment, its load."""
    secure_boot = known(FirmwareBoot)["secure_boot"]
    if secure_boot is not True or rig["driver"]["secure_boot"] != "sign":
        return []
    return secureboot.loaded_module_problems(
        "sign", secure_boot, known(NvidiaModule), dkms_signing()
    )


def sign_with_machine_owner_key() -> None:
    """The MOK generated on the host (root's alone), DKMS configured to sign with it; before
    the driver's installation, whose DKMS build then signs the module."""
    operations.apt_packages(
        name="mokutil and openssl for the Machine Owner Key",
        packages=["mokutil", "openssl"],
        no_recommends=True,
    )
    operations.machine_owner_key(
        name="Machine Owner Key for DKMS's module signing",
        key=secureboot.MOK_KEY,
        certificate=secureboot.MOK_CERTIFICATE,
        common_name=secureboot.MOK_COMMON_NAME,
    )
    files.directory(name="dkms configuration drop-ins", path="/etc/dkms/framework.conf.d")
    files.put(
        name="DKMS signs with the Machine Owner Key",
        src=StringIO(secureboot.dkms_signing_dropin()),
        dest=secureboot.DKMS_SIGNING_DROPIN,
        mode="644",
    )


def queue_enrollment() -> None:
    """`mokutil --import` with a one-time password: given on stdin (never in an argv another
    user could read, never in a file), printed once on this terminal after the import."""
    password = secureboot.one_time_password()
    certificate = secureboot.MOK_CERTIFICATE
    imported = server.shell(
        name="Queue the Machine Owner Key's enrollment (mokutil --import)",
        commands=[f"mokutil --import {certificate}"],
        _stdin=[password, password],
    )

    def announce() -> None:
        sys.stderr.write(secureboot.enrollment_notice(password, certificate))
        sys.stderr.flush()

    python.call(
        name="Say how to confirm the enrollment at the console",
        function=announce,
        _if=imported.did_change,
    )


@api.deploy("tasks/driver.py")
def deploy() -> list[OperationMeta]:
    """Returns the driver's installation (none when the driver is kept): a change to it needs a
    reboot to load the new modules."""
    if stage.serves_no_model():
        host.noop(f"{stage.rig()['role']}: no NVIDIA driver here")
        return []
    if stage.builds_only():
        host.noop("builds only: the driver is left as it is")
        return []
    rig = stage.rig()
    driver = rig["driver"]
    driver_gpus = known(NvidiaSmiGpus)
    running_version = driver_gpus[0]["driver_version"] if driver_gpus else None
    compute_capabilities = [gpu["compute_capability"] for gpu in (driver_gpus or rig["gpus"])]

    def floor_problems(driver_version):
        return check_versions(
            compute_capabilities, driver_version=driver_version, **chosen_versions(rig)
        )

    if driver["source"] == "none":
        host.noop("no NVIDIA driver wanted (CPU-only rig)")
        return []
    if driver["source"] == "preinstalled":
        if not driver_gpus:
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
        return []
    decision = secure_boot_decision(rig)  # a `stop` was refused in preflight
    if running_version and not floor_problems(running_version):
        host.noop(
            f"driver {running_version} is already installed and meets the floors; not reinstalled"
        )
        return []
    # The version gates of the GPUs and toolkit were checked by the plan in preflight.
    if decision.action == "prebuilt":
        wanted = decision.packages
        how = "Canonical-signed prebuilt modules"
    else:
        wanted = built_packages(driver)
        how = driver["source"]
    if decision.action == "sign":
        sign_with_machine_owner_key()
    installed = operations.driver_packages(
        name=f"NVIDIA driver ({how}, branch {driver['branch']})",
        packages=wanted.packages,
        dkms_package=wanted.dkms_package,
    )
    if decision.queue_enrollment:
        queue_enrollment()
    return [installed]
