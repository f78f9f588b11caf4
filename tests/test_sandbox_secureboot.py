"""`driver.secure_boot` on a real Debian bookworm target with the distro driver (the real DKMS
build, GUIDE §2), its Secure Boot state faked.

The test mounts a tmpfs over /sys/firmware inside the sandbox (systemd-nspawn, no firmware) and
writes the SecureBoot EFI variable there (attributes, then 1 = enabled), which the preflight
reads exactly as on a machine. `auto` must stop before anything is installed (Debian has no
Canonical-signed modules); `refuse` likewise: both on a sandbox of their own. `sign` is the
first converge of the bookworm rig that test_sandbox_bookworm checks too (tests/signed_bookworm.py,
one DKMS build for both): it must generate the Machine Owner Key (root's alone), configure DKMS
to sign with it, have the DKMS-built module signed by that key (`modinfo`, its key id against
the certificate's), and queue the enrollment with a one-time password given on stdin and
printed once. The enrollment is recorded, never confirmed (no firmware; see
tests/signed_bookworm.py for the labelled stand-in of mokutil).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from llamarig.converge import secureboot
from tests.sandboxes import changed_operations, deploy, fresh_sandbox, in_sandbox
from tests.signed_bookworm import BASE_INVENTORY, MOKUTIL_LOG, fake_secure_boot_on, sandbox_run

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

NAME = "sandbox-secureboot"
SSH_PORT = 2228


@pytest.fixture(scope="module")
def sandbox():
    yield from fresh_sandbox(NAME, "bookworm", SSH_PORT)


def inventory(tmp_path, mode: str):
    """The bookworm rig's inventory for this module's sandbox, with driver.secure_boot `mode`."""
    data = yaml.safe_load(BASE_INVENTORY.read_text())
    rig = data["all"]["children"]["sandbox"]["hosts"].pop("sandbox-bookworm")
    rig["ssh"].update(port=SSH_PORT, known_hosts=f"/var/cache/llamarig/sandbox/{NAME}/known_hosts")
    rig["driver"]["secure_boot"] = mode
    data["all"]["children"]["sandbox"]["hosts"][NAME] = rig
    path = tmp_path / f"secureboot-{mode}.yml"
    path.write_text(yaml.safe_dump(data))
    return path


def installed_packages(info) -> str:
    return in_sandbox(info, "dpkg-query -W -f '${Package} ${Version}\\n' | sort")


@pytest.mark.parametrize("mode", ["auto", "refuse"])
def test_stops_before_installing_anything(sandbox, tmp_path, mode):
    fake_secure_boot_on(sandbox)
    before = installed_packages(sandbox)
    result = deploy(inventory(tmp_path, mode))
    output = result.stdout + result.stderr
    print(output[-3000:])
    assert result.returncode != 0
    assert "secure boot is on" in output
    if mode == "auto":
        assert "nothing was installed" in output
        assert "driver.secure_boot: sign" in output
        assert "mokutil --import /var/lib/dkms/mok.pub" in output
    else:
        assert "driver.secure_boot is `refuse`" in output
    assert installed_packages(sandbox) == before


def test_sign_builds_a_signed_module_and_queues_the_enrollment(signed_bookworm):
    """Read on the shared bookworm rig (tests/signed_bookworm.py): its first converge signed."""
    sandbox, result = signed_bookworm.info, signed_bookworm.first_converge
    assert result.returncode == 0, result.stderr[-6000:]
    names = changed_operations(json.loads(result.stdout)["results"])
    for name in (
        "Machine Owner Key for DKMS's module signing",
        "DKMS signs with the Machine Owner Key",
        "NVIDIA driver (distro, branch 580)",
        "Queue the Machine Owner Key's enrollment (mokutil --import)",
    ):
        assert name in names, names

    # The key: root's alone; the certificate names llamarig's key.
    assert in_sandbox(sandbox, f"stat -c '%U %a' {secureboot.MOK_KEY}") == "root 600"
    subject = in_sandbox(
        sandbox, f"openssl x509 -inform DER -noout -subject -in {secureboot.MOK_CERTIFICATE}"
    )
    assert secureboot.MOK_COMMON_NAME in subject
    assert "mok_signing_key" in in_sandbox(sandbox, f"cat {secureboot.DKMS_SIGNING_DROPIN}")

    # Every module DKMS built for the installed kernel is signed by that key (Debian names
    # them nvidia-current-open*.ko).
    print(in_sandbox(sandbox, "dkms status; tail -3 /var/log/llamarig-driver-install.log"))
    kernel = in_sandbox(sandbox, "ls /lib/modules | grep -- '-amd64$' | sort -V | tail -1")
    modules = in_sandbox(sandbox, f"find /lib/modules/{kernel} -name 'nvidia*.ko*'").split()
    assert modules, f"no nvidia module built for {kernel}"
    # sign-file names the key by the certificate's serial (PKCS#7 issuer and serial; seen so on
    # bookworm), or by its subject key id: either identifies this certificate.
    serial, subject_key_id = in_sandbox(
        sandbox,
        f"openssl x509 -inform DER -noout -serial -in {secureboot.MOK_CERTIFICATE}; "
        f"openssl x509 -inform DER -noout -ext subjectKeyIdentifier "
        f"-in {secureboot.MOK_CERTIFICATE} | tail -1",
    ).splitlines()
    certificate_ids = (hex_digits(serial.removeprefix("serial=")), hex_digits(subject_key_id))
    for module in modules:
        signer = in_sandbox(sandbox, f"modinfo -F signer {module}")
        key_id = in_sandbox(sandbox, f"modinfo -F sig_key {module}")
        print(f"{module}: signer {signer!r}, key id {key_id}; certificate {certificate_ids}")
        assert signer == secureboot.MOK_COMMON_NAME, module
        assert hex_digits(key_id) in certificate_ids, module

    # The enrollment is queued with the password printed once, and nowhere else.
    printed = re.findall(r"One-time password: (\w+)", result.stderr)
    assert len(printed) == 1, result.stderr[-3000:]
    password = printed[0]
    assert password not in result.stdout
    assert "A person must confirm it at the host's console" in result.stderr
    recorded = in_sandbox(sandbox, f"cat {MOKUTIL_LOG}").splitlines()
    assert recorded == [
        f"argv: --import {secureboot.MOK_CERTIFICATE}",
        f"stdin: {password}",
        f"stdin: {password}",
    ]
    leaks = sandbox_run(
        sandbox,
        f"grep -rl -- {password} /var/log /etc /root /tmp /var/lib/dkms 2>/dev/null; "
        f"journalctl --no-pager 2>/dev/null | grep -c -- {password}",
    )
    assert leaks.strip() == "0", leaks


def hex_digits(text: str) -> str:
    return "".join(character for character in text.upper() if character in "0123456789ABCDEF")
