"""Secure Boot and the NVIDIA kernel module: what the deploy does for `driver.secure_boot`
(pure decisions from the host's facts; tasks/preflight.py and tasks/driver.py act on them).

With UEFI Secure Boot on, the kernel loads a module only when it is signed by a key the
firmware trusts: Canonical's (Ubuntu's prebuilt `linux-modules-nvidia-*` packages) or a
Machine Owner Key (MOK) that a person enrolled at the console on a boot after `mokutil
--import`. A module DKMS builds is signed only when DKMS has a signing key configured.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from llamarig.onhost.hostpaths import MOK_CERTIFICATE, MOK_KEY
from llamarig.tables.packages import DKMS_SOURCES, DriverPackages, prebuilt_module_packages

MODES = ("auto", "sign", "refuse")

# A drop-in of dkms's framework.conf.d, read after /etc/dkms/framework.conf.
DKMS_SIGNING_DROPIN = "/etc/dkms/framework.conf.d/llamarig-secure-boot.conf"
MOK_COMMON_NAME = "llamarig DKMS module signing key"
# Canonical's signing certificates name the signer as "Canonical Ltd. Kernel Module Signing"
# or similar; any signer starting with this is one of Canonical's.
CANONICAL_SIGNER = "Canonical Ltd."


@dataclass(frozen=True)
class DkmsSigning:
    """DKMS's module signing as configured on the host (the DkmsSigning fact)."""

    key: str = MOK_KEY
    certificate: str = MOK_CERTIFICATE
    key_exists: bool = False
    certificate_exists: bool = False
    # mokutil --test-key on the certificate: enrolled | pending | not-enrolled | unknown
    enrollment: str = "unknown"

    @property
    def signs_with_enrolled_key(self) -> bool:
        return self.key_exists and self.certificate_exists and self.enrollment == "enrolled"


@dataclass(frozen=True)
class Decision:
    """What the driver stage does under Secure Boot.

    action: ``unchanged`` (Secure Boot off or unknown, or DKMS already signs with an enrolled
    key: the usual driver), ``prebuilt`` (Ubuntu's Canonical-signed modules, ``packages``),
    ``sign`` (generate the MOK, have DKMS sign with it, queue its enrollment), ``stop``
    (``steps`` say what a person can do).
    """

    action: str
    packages: DriverPackages | None = None
    steps: list[str] = field(default_factory=list)
    queue_enrollment: bool = False


def manual_steps(signing: DkmsSigning) -> list[str]:
    """The steps a person takes to have DKMS's module load under Secure Boot by hand."""
    return [
        "set driver.secure_boot: sign, and llamarig generates the key, configures DKMS to sign "
        "with it and queues its enrollment; a person then confirms it at the console on the "
        "next boot (MOK manager: Enroll MOK, Continue, Yes, the one-time password, Reboot)",
        "or by hand, as root: openssl req -new -x509 -nodes -days 36500 -newkey rsa:2048 "
        f"-subj '/CN={MOK_COMMON_NAME}/' -keyout {signing.key} -outform DER "
        f"-out {signing.certificate}; chmod 600 {signing.key}; "
        f"mokutil --import {signing.certificate} (choose a one-time password); reboot and "
        "confirm the enrollment at the console; then run the deploy again",
        "or turn Secure Boot off in the firmware setup",
    ]


def decide(
    mode: str,
    secure_boot: bool | None,
    source: str,
    debian: bool,
    kernel: str,
    branch: int,
    open_modules: bool,
    signing: DkmsSigning,
    apt_candidates: dict[str, str | None],
) -> Decision:
    """The driver's way under Secure Boot. ``apt_candidates`` maps the prebuilt package names
    (packages.prebuilt_module_packages) to the candidate version apt offers, None when none."""
    if secure_boot is not True or source not in DKMS_SOURCES:
        return Decision("unchanged")
    if mode == "refuse":
        return Decision(
            "stop",
            steps=[
                "secure boot is on and driver.secure_boot is `refuse`: nothing is installed; "
                "set driver.secure_boot to auto or sign, or turn Secure Boot off",
            ],
        )
    if mode == "sign":
        return Decision("sign", queue_enrollment=signing.enrollment not in ("enrolled", "pending"))
    if signing.signs_with_enrolled_key:
        return Decision("unchanged")
    prebuilt = None
    if not debian and source == "distro":
        prebuilt = prebuilt_module_packages(branch, kernel, open_modules)
        missing = [name for name in prebuilt.packages if not apt_candidates.get(name)]
        if prebuilt.packages and not missing:
            return Decision("prebuilt", packages=prebuilt)
    reason = "secure boot is on and the DKMS-built nvidia module would not load (unsigned"
    reason += f", or signed with {signing.certificate} that is not enrolled)"
    steps = [f"{reason}: nothing was installed. Choose one:"]
    if prebuilt is not None:
        wanted = prebuilt.packages[0] if prebuilt.packages else f"for kernel {kernel}"
        steps.append(
            f"Canonical's signed prebuilt modules ({wanted}) are not in the apt lists for "
            f"kernel {kernel} and branch {branch}: run `apt update`, boot a kernel Canonical "
            "builds them for, or pick a branch that has them (driver.branch)"
        )
    elif not debian:
        steps.append(
            "driver.source: distro uses Canonical's signed prebuilt modules where they exist "
            f"(linux-modules-nvidia-{branch}-open-{kernel})"
        )
    return Decision("stop", steps=steps + manual_steps(signing))


def loaded_module_problems(
    mode: str, secure_boot: bool | None, module: dict, signing: DkmsSigning
) -> list[str]:
    """After the reboot that follows a `sign` run: the nvidia module must load and be signed by
    the enrolled key. ``module`` is the NvidiaModule fact (signer, loaded, present)."""
    if secure_boot is not True or mode != "sign" or not module["present"]:
        return []
    problems = []
    if not module["signer"]:
        problems.append(
            "the nvidia module is not signed: DKMS did not sign it (rebuild it with "
            f"`dkms autoinstall --force` once {signing.key} exists)"
        )
    if signing.enrollment == "pending":
        problems.append(
            f"the key {signing.certificate} is queued but not enrolled: reboot and confirm the "
            "enrollment at the console (Enroll MOK, the one-time password), then run again"
        )
    elif signing.enrollment == "not-enrolled":
        problems.append(
            f"the key {signing.certificate} is not enrolled (the enrollment was not confirmed "
            "at the console, or was cancelled): run the deploy again to queue it, and confirm "
            "it on the next boot"
        )
    elif not module["loaded"]:
        problems.append(
            f"the nvidia module (signer {module['signer'] or 'none'}) does not load: see "
            "`dmesg | grep -i -e nvidia -e 'key was rejected'`"
        )
    return problems


def one_time_password() -> str:
    """The password a person types at the console to confirm the enrollment (mokutil accepts
    1 to 256 characters); letters and digits only, so it is typed without a keyboard layout
    surprise in the firmware's MOK manager."""
    alphabet = "abcdefghjkmnpqrstuvwxyz23456789"
    return "".join(secrets.choice(alphabet) for _ in range(12))


def dkms_signing_dropin() -> str:
    """dkms's framework.conf.d drop-in that names the MOK pair llamarig generated."""
    return (
        "# Written by llamarig (driver.secure_boot: sign): DKMS signs the modules it builds with\n"
        "# this Machine Owner Key, enrolled with mokutil --import and confirmed at the console.\n"
        f'mok_signing_key="{MOK_KEY}"\n'
        f'mok_certificate="{MOK_CERTIFICATE}"\n'
    )


def enrollment_notice(password: str, certificate: str) -> str:
    """What the run prints once, on the control machine's terminal, after queuing the import."""
    return (
        f"\n*** Secure Boot: the Machine Owner Key {certificate} is queued for enrollment.\n"
        "*** A person must confirm it at the host's console on the next boot: in the blue MOK\n"
        "*** manager choose Enroll MOK, Continue, Yes, type this one-time password, Reboot.\n"
        f"*** One-time password: {password}\n"
        "*** It is shown only here and stored nowhere; if it is lost, run\n"
        "*** `mokutil --revoke-import` on the host and deploy again.\n"
    )


def untrusted_module_problem(module: dict, sig_key: str, enrolled_listing: str) -> str | None:
    """Why a loaded nvidia module is not one Secure Boot trusts, or None: it must be signed by
    Canonical (Ubuntu's prebuilt modules) or by a key in ``mokutil --list-enrolled``'s listing
    (``sig_key``, from ``modinfo -F sig_key``, among the enrolled certificates' key ids)."""
    if not module["loaded"]:
        return (
            "secure boot is on and the nvidia module is not loaded: the kernel refuses a module "
            "without a trusted signature (dmesg: 'Key was rejected by service'); see README "
            "'Secure Boot'"
        )
    if not module["signer"]:
        return "secure boot is on and the loaded nvidia module carries no signature"
    if module["signer"].startswith(CANONICAL_SIGNER):
        return None

    def hex_only(text: str) -> str:
        return "".join(character for character in text.upper() if character in "0123456789ABCDEF")

    if sig_key.strip() and hex_only(sig_key) in hex_only(enrolled_listing):
        return None
    return (
        f"the nvidia module is signed by {module['signer']!r} (key {sig_key.strip() or '?'}), "
        "which is not among the enrolled Machine Owner Keys (mokutil --list-enrolled)"
    )
