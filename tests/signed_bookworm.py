"""The Debian bookworm rig that test_sandbox_bookworm and test_sandbox_secureboot share: one
sandbox, one DKMS build of Debian's open NVIDIA driver, checked by both modules.

The sandbox boots with Secure Boot faked on (a tmpfs over /sys/firmware holding the SecureBoot
EFI variable, which the preflight reads exactly as on a machine) and its first converge takes
`driver.secure_boot: sign`: the Machine Owner Key is generated, DKMS is configured to sign with
it, and the driver's DKMS build signs the module it builds. The changed blacklist then reboots
the sandbox (`reboot: if-needed`), which drops the tmpfs and so the variable: from then on the
host has no Secure Boot state to read (as one booted without EFI) and is the plain `distro` rig
that test_sandbox_bookworm checks (a second converge changes nothing, verify, the blacklist).
Until 2026-12-06 each module booted its own bookworm sandbox and ran the same DKMS build (192
objects and the driver's conftest compiles, which ccache does not keep): 186 s of the Secure
Boot module's 200 in a warm CI run.

The enrollment is only queued and recorded, never confirmed: confirming it takes the
firmware's MOK manager at the console on the next boot, which no container has. mokutil itself
needs a real efivarfs (it checks the file system's type; a tmpfs is not one), so a stand-in
that records its arguments and stdin is put first on PATH, labelled as such in
/usr/local/sbin/mokutil and here.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from llamarig.facts.driver import FirmwareBoot
from tests.conftest import PROJECT
from tests.sandboxes import deploy, fresh_sandbox, in_sandbox

BASE_INVENTORY = PROJECT / "inventory" / "sandbox-bookworm.yml"
NAME = "sandbox-bookworm"
SSH_PORT = 2223
MOKUTIL_LOG = "/var/lib/llamarig-test/mokutil.log"

# A recorded stand-in for mokutil (no firmware here): it answers --sb-state from the faked
# variable as the real one reads the firmware's (without one, as on a machine booted without
# EFI), records each call's arguments and stdin, and answers --test-key from what it recorded.
MOKUTIL_STANDIN = f"""#!/bin/sh
# STAND-IN for mokutil, installed by tests/signed_bookworm.py: this container has no UEFI
# firmware, so an import is recorded here, never confirmed.
mkdir -p {os.path.dirname(MOKUTIL_LOG)}
case "$1" in
  --sb-state)
    case "$(od -An -t u1 -j 4 -N 1 {FirmwareBoot.EFIVAR} 2>/dev/null | tr -d ' ')" in
      1) echo "SecureBoot enabled";;
      0) echo "SecureBoot disabled";;
      *) echo "EFI variables are not supported on this system" >&2; exit 1;;
    esac
    exit 0;;
  --test-key)
    if grep -q -- "--import $2" {MOKUTIL_LOG} 2>/dev/null; then
      echo "$2 is already in the enrollment request"; exit 0
    fi
    echo "$2 is not enrolled"; exit 0;;
  --import)
    echo "argv: $*" >> {MOKUTIL_LOG}
    while IFS= read -r line; do echo "stdin: $line" >> {MOKUTIL_LOG}; done
    exit 0;;
esac
echo "stand-in mokutil: $* not recorded" >&2; exit 1
"""


@dataclass(frozen=True)
class SignedBookworm:
    """The shared rig: its sandbox, its inventory and what its first converge left."""

    info: object  # llamarig_sandbox.sshaccess.SandboxInfo
    inventory: Path
    first_converge: subprocess.CompletedProcess  # `pyinfra --json`: results on stdout
    boot_before: str  # the boot id before the first converge


def fake_secure_boot_on(info) -> None:
    variable = FirmwareBoot.EFIVAR
    in_sandbox(
        info,
        "mountpoint -q /sys/firmware || mount -t tmpfs -o size=64k llamarig-fake-efi "
        f"/sys/firmware; mkdir -p {os.path.dirname(variable)}; "
        f"printf '\\006\\000\\000\\000\\001' > {variable}",
    )


def boot_id(info) -> str:
    return in_sandbox(info, "cat /proc/sys/kernel/random/boot_id")


def sandbox_run(info, command: str) -> str:
    """Run a command that may fail; its stdout and stderr together."""
    from llamarig_sandbox import sshaccess

    result = sshaccess.ssh(info, command, timeout=300)
    return result.stdout + result.stderr


def install_mokutil_standin(info) -> None:
    in_sandbox(
        info,
        f"cat > /usr/local/sbin/mokutil <<'EOF'\n{MOKUTIL_STANDIN}EOF\n"
        "chmod 755 /usr/local/sbin/mokutil",
    )


def signing_inventory(directory: Path) -> Path:
    """inventory/sandbox-bookworm.yml with `driver.secure_boot: sign`."""
    data = yaml.safe_load(BASE_INVENTORY.read_text())
    data["all"]["children"]["sandbox"]["hosts"][NAME]["driver"]["secure_boot"] = "sign"
    path = directory / "sandbox-bookworm-sign.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def converged(directory: Path):
    """Boot the bookworm sandbox with Secure Boot faked on and converge it once in `sign`
    mode; a generator for a session fixture (the sandbox goes down after the session)."""
    for info in fresh_sandbox(NAME, "bookworm", SSH_PORT):
        fake_secure_boot_on(info)
        install_mokutil_standin(info)
        inventory = signing_inventory(directory)
        before = boot_id(info)
        yield SignedBookworm(info, inventory, deploy(inventory, "--json"), before)
