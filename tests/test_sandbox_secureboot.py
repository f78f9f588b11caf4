"""`driver.secure_boot` on a real Debian bookworm target with the distro driver (the real DKMS
build, GUIDE §2), its Secure Boot state faked.

The sandbox (systemd-nspawn) has no firmware: the test mounts a tmpfs over /sys/firmware inside
it and writes the SecureBoot EFI variable there (attributes, then 1 = enabled), which the
preflight reads exactly as on a machine. `auto` must stop before anything is installed (Debian
has no Canonical-signed modules); `refuse` likewise; `sign` must generate the Machine Owner Key
(root's alone), configure DKMS to sign with it, have the DKMS-built module signed by that key
(`modinfo`, its key id against the certificate's), and queue the enrollment with a one-time
password given on stdin and printed once.

The enrollment is only queued and recorded, never confirmed: confirming it takes the
firmware's MOK manager at the console on the next boot, which no container has. mokutil itself
needs real efivarfs (it checks the file system's type), so where the real one cannot run on the
fake variables, a stand-in that records its arguments and stdin is put first on PATH —
labelled as such in /usr/local/sbin/mokutil and by this test.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from llamarig import secureboot
from llamarig.facts import FirmwareBoot
from tests.conftest import PROJECT
from tests.sandboxes import changed_operations, deploy, fresh_sandbox, in_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

BASE_INVENTORY = PROJECT / "inventory" / "sandbox-bookworm.yml"
NAME = "sandbox-secureboot"
SSH_PORT = 2228
MOKUTIL_LOG = "/var/lib/llamarig-test/mokutil.log"

# A recorded stand-in for mokutil (no firmware here): it answers --sb-state as enabled, records
# each call's arguments and stdin, and answers --test-key from what it recorded.
MOKUTIL_STANDIN = f"""#!/bin/sh
# STAND-IN for mokutil, installed by tests/test_sandbox_secureboot.py: this container has no
# UEFI firmware, so an import is recorded here, never confirmed.
mkdir -p {os.path.dirname(MOKUTIL_LOG)}
case "$1" in
  --sb-state) echo "SecureBoot enabled"; exit 0;;
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


@pytest.fixture(scope="module")
def sandbox():
    yield from fresh_sandbox(NAME, "bookworm", SSH_PORT)


def fake_secure_boot_on(info) -> None:
    variable = FirmwareBoot.EFIVAR
    in_sandbox(
        info,
        "mountpoint -q /sys/firmware || mount -t tmpfs -o size=64k llamarig-fake-efi "
        f"/sys/firmware; mkdir -p {os.path.dirname(variable)}; "
        f"printf '\\006\\000\\000\\000\\001' > {variable}",
    )


def inventory(tmp_path, mode: str):
    """The bookworm sandbox's inventory for this sandbox, with driver.secure_boot `mode`."""
    data = yaml.safe_load(BASE_INVENTORY.read_text())
    rig = data["all"]["children"]["sandbox"]["hosts"].pop("sandbox-bookworm")
    rig["ssh"].update(port=SSH_PORT, known_hosts=f"/var/cache/llamarig/sandbox/{NAME}/known_hosts")
    rig["driver"]["secure_boot"] = mode
    rig["reboot"] = "never"  # a reboot would drop the faked variable (a tmpfs)
    # Signing concerns the driver's module alone: Debian's CUDA toolkit (1.5 GB of packages,
    # installed by test_sandbox_bookworm) would only slow this down.
    rig["cuda"] = {"source": "none"}
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


def test_sign_builds_a_signed_module_and_queues_the_enrollment(sandbox, tmp_path):
    fake_secure_boot_on(sandbox)
    in_sandbox(
        sandbox,
        "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "
        "--no-install-recommends mokutil >/dev/null",
    )
    real = sandbox_run(sandbox, "mokutil --sb-state")
    print("real mokutil on the fake variables:", real)
    if "SecureBoot enabled" not in real:
        # The real mokutil cannot run here (no efivarfs): the recorded stand-in takes its place.
        in_sandbox(
            sandbox,
            f"cat > /usr/local/sbin/mokutil <<'EOF'\n{MOKUTIL_STANDIN}EOF\n"
            "chmod 755 /usr/local/sbin/mokutil",
        )
    result = deploy(inventory(tmp_path, "sign"), "--json")
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
    if "SecureBoot enabled" not in real:
        recorded = in_sandbox(sandbox, f"cat {MOKUTIL_LOG}").splitlines()
        assert recorded == [
            f"argv: --import {secureboot.MOK_CERTIFICATE}",
            f"stdin: {password}",
            f"stdin: {password}",
        ]
    else:
        assert in_sandbox(sandbox, "ls /sys/firmware/efi/efivars | grep -c '^MokNew-'") == "1"
    leaks = sandbox_run(
        sandbox,
        f"grep -rl -- {password} /var/log /etc /root /tmp /var/lib/dkms 2>/dev/null; "
        f"journalctl -b --no-pager 2>/dev/null | grep -c -- {password}",
    )
    assert leaks.strip() == "0", leaks


def hex_digits(text: str) -> str:
    return "".join(character for character in text.upper() if character in "0123456789ABCDEF")


def sandbox_run(info, command: str) -> str:
    """Run a command that may fail; its stdout and stderr together."""
    from llamarig_sandbox import sandbox as rig

    result = rig.ssh(info, command, timeout=300)
    return result.stdout + result.stderr
