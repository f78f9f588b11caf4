"""The NVIDIA driver and its kernel module: the firmware's Secure Boot state, DKMS signing and the
MOK, the loaded module, a failed driver build."""

from __future__ import annotations

import shlex

from pyinfra.api import FactBase

from llamarig.onhost import driver_build
from llamarig.onhost.hostpaths import DRIVER_BUILD_FAILURE_PATH, MOK_CERTIFICATE, MOK_KEY


class FirmwareBoot(FactBase):
    """Boot mode and Secure Boot state: {"uefi": bool, "secure_boot": True|False|None}."""

    # The SecureBoot EFI variable: 4 attribute bytes, then one data byte (1 = enabled).
    EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"

    def command(self) -> str:
        # mokutil --sb-state answers where the variable cannot be read (an efivarfs that
        # hides it), and says "SecureBoot enabled" / "SecureBoot disabled".
        return (
            "if [ -d /sys/firmware/efi ]; then echo uefi; else echo bios; fi; "
            f"if [ -r {self.EFIVAR} ]; then od -An -t u1 -j 4 -N 1 {self.EFIVAR}; "
            "elif command -v mokutil >/dev/null 2>&1; then "
            "mokutil --sb-state 2>/dev/null | grep -o -m1 'SecureBoot [a-z]*' || echo unknown; "
            "else echo unknown; fi"
        )

    def process(self, output):
        lines = [line.strip() for line in output]
        state = lines[1] if len(lines) > 1 else "unknown"
        states = {"1": True, "0": False, "SecureBoot enabled": True, "SecureBoot disabled": False}
        secure_boot = states.get(state)
        return {"uefi": lines[0] == "uefi", "secure_boot": secure_boot}


class DkmsSigning(FactBase):
    """How DKMS signs the modules it builds: the key pair its configuration names
    (``mok_signing_key``/``mok_certificate`` in /etc/dkms/framework.conf and framework.conf.d,
    the last one wins; /var/lib/dkms/mok.key and mok.pub by default), whether they exist, and
    whether the certificate is enrolled as a Machine Owner Key (``mokutil --test-key``).

    .. code:: python

        {"key": "/var/lib/dkms/mok.key", "certificate": "/var/lib/dkms/mok.pub",
         "key_exists": True, "certificate_exists": True, "enrollment": "pending"}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self) -> str:
        # The assignments only, not the files sourced: they are shell that dkms itself runs.
        return (
            "for f in /etc/dkms/framework.conf /etc/dkms/framework.conf.d/*.conf; do "
            '[ -f "$f" ] && grep -h -E "^[[:space:]]*(mok_signing_key|mok_certificate)=" "$f"; '
            "done; true"
        )

    def process(self, output):
        values = {"mok_signing_key": MOK_KEY, "mok_certificate": MOK_CERTIFICATE}
        for line in output:
            name, _, value = line.strip().partition("=")
            values[name] = value.split("#", 1)[0].strip().strip("\"'")
        return {"key": values["mok_signing_key"], "certificate": values["mok_certificate"]}


class MokKeyState(FactBase):
    """Whether the key pair exists (the key's mode too: it must be root's alone) and what
    ``mokutil --test-key`` says of the certificate: enrolled, pending (queued by
    ``mokutil --import``, not yet confirmed at the console), not-enrolled, or unknown (no
    mokutil, no certificate, or no EFI variables).

    .. code:: python

        {"key_exists": True, "key_mode": "600", "certificate_exists": True,
         "enrollment": "not-enrolled"}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self, key: str, certificate: str) -> str:
        key, certificate = shlex.quote(key), shlex.quote(certificate)
        return (
            f"if [ -f {key} ]; then echo key $(stat -c %a {key}); else echo key -; fi; "
            f"if [ -f {certificate} ]; then echo certificate yes; else echo certificate -; fi; "
            f"if [ -f {certificate} ] && command -v mokutil >/dev/null 2>&1; then "
            f"echo test $(mokutil --test-key {certificate} 2>&1 | head -1); fi; true"
        )

    def process(self, output):
        fields = dict(line.strip().split(" ", 1) for line in output if " " in line.strip())
        answer = fields.get("test", "")
        if "already enrolled" in answer:
            enrollment = "enrolled"
        elif "enrollment request" in answer:
            enrollment = "pending"
        elif "not enrolled" in answer:
            enrollment = "not-enrolled"
        else:
            enrollment = "unknown"
        key_mode = fields.get("key", "-")
        return {
            "key_exists": key_mode != "-",
            "key_mode": None if key_mode == "-" else key_mode,
            "certificate_exists": fields.get("certificate") == "yes",
            "enrollment": enrollment,
        }


NVIDIA_MODULE_NAMES = ("nvidia", "nvidia-current", "nvidia-current-open")


class NvidiaModule(FactBase):
    """The nvidia kernel module: whether one is installed for the running kernel, its signer
    (``modinfo -F signer``, empty when unsigned) and whether it is loaded.

    .. code:: python

        {"present": True, "signer": "llamarig DKMS module signing key", "loaded": False}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self) -> str:
        # Debian's packages name the module nvidia-current, its open one nvidia-current-open.
        names = " ".join(NVIDIA_MODULE_NAMES)
        loaded = " || ".join(
            f"[ -d /sys/module/{name.replace('-', '_')} ]" for name in NVIDIA_MODULE_NAMES
        )
        return (
            f"for m in {names}; do "
            "modinfo -F filename $m >/dev/null 2>&1 || continue; echo present; "
            "echo signer=$(modinfo -F signer $m 2>/dev/null); break; done; "
            f"{{ {loaded}; }} && echo loaded; true"
        )

    def process(self, output):
        lines = [line.strip() for line in output]
        signer = next((line[7:] for line in lines if line.startswith("signer=")), "")
        return {"present": "present" in lines, "signer": signer, "loaded": "loaded" in lines}


class DriverBuildFailure(FactBase):
    """The NVIDIA driver's DKMS build that failed on an earlier deploy (driver_build.py), None
    where none is recorded.

    .. code:: python

        BuildFailure(package="nvidia-open-kernel-dkms", version="550.163.01-2",
                     kernel="6.12.57+deb13-amd64", kernels="6.12.57+deb13-amd64",
                     error="nv-pci.c:212:14: error: too few arguments to function ...")
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return None

    def command(self) -> str:
        return f"cat {DRIVER_BUILD_FAILURE_PATH} 2>/dev/null; true"

    def process(self, output):
        return driver_build.parse_record(output)
