"""The `distro` driver path where the world says no: on Debian trixie (2026-11-30), Debian's
nvidia-open-kernel-dkms 550.163.01 does not compile for trixie's kernel 6.12 (`too few
arguments to function 'pci_resize_resource'`), and apt leaves the driver half-configured.

The deploy must report it in one message (package, kernel, the compiler's error line, what to
do), leave apt and dpkg consistent, and a second run must fail the same way, not worse. If this
test starts failing because the module builds, Debian fixed the package: update the test.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import PROJECT
from tests.sandboxes import deploy, fresh_sandbox, in_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

INVENTORY = PROJECT / "inventory" / "sandbox-trixie-distro.yml"
NAME = "sandbox-trixie-distro"


@pytest.fixture(scope="module")
def trixie():
    yield from fresh_sandbox(NAME, "trixie", 2224)


def assert_package_state_consistent(info):
    assert in_sandbox(info, "dpkg --audit && apt-get check -qq") == ""
    state = in_sandbox(info, "dpkg-query -W -f='${Status}' nvidia-open-kernel-dkms || true")
    assert "install ok installed" not in state
    assert "half-configured" not in state and "unpacked" not in state


@pytest.mark.parametrize("attempt", [1, 2])
def test_failed_dkms_build_is_reported_and_apt_left_usable(trixie, attempt):
    result = deploy(INVENTORY)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "llamarig: the NVIDIA driver did not install: nvidia-open-kernel-dkms 550." in output
    assert "pci_resize_resource" in output, output[-3000:]
    assert "for kernel(s) 6.12." in output
    assert "Use driver.source nvidia-repo" in output
    assert "Traceback" not in output
    print(next(line for line in output.splitlines() if "did not install" in line))
    assert_package_state_consistent(trixie)
