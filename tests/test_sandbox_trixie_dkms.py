"""The `distro` driver path where the world says no: on Debian trixie (2026-11-30), Debian's
nvidia-open-kernel-dkms 550.163.01 does not compile for trixie's kernel 6.12 (`too few
arguments to function 'pci_resize_resource'`), and apt leaves the driver half-configured.

The deploy must report it in one message (package, kernel, the compiler's error line, what to
do), leave apt and dpkg consistent and remember the failed build; a second run must refuse the
same build in preflight, with the same facts, before it installs anything (not spend minutes
on a build that fails the same way), and leave apt as usable. If this test starts failing
because the module builds, Debian fixed the package: update the test.
"""

from __future__ import annotations

import os

import pytest

from llamarig.onhost.hostpaths import DRIVER_BUILD_FAILURE_PATH, DRIVER_INSTALL_LOG
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
    install_log = f"stat -c '%Y %s' {DRIVER_INSTALL_LOG} 2>/dev/null; true"
    log_before = in_sandbox(trixie, install_log)
    result = deploy(INVENTORY)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "pci_resize_resource" in output, output[-3000:]
    assert "for kernel(s) 6.12." in output
    assert "Use driver.source nvidia-repo" in output
    assert "Traceback" not in output
    if attempt == 1:
        assert "llamarig: the NVIDIA driver did not install: nvidia-open-kernel-dkms 550." in output
        assert "The next deploy refuses this build" in output
        record = in_sandbox(trixie, f"cat {DRIVER_BUILD_FAILURE_PATH}")
        assert "package=nvidia-open-kernel-dkms\nversion=550." in record, record
        assert "pci_resize_resource" in record
        print(next(line for line in output.splitlines() if "did not install" in line))
    else:
        # Refused from the record before any stage ran: apt never started again.
        assert "the last deploy's DKMS build of nvidia-open-kernel-dkms 550." in output
        assert f"remove {DRIVER_BUILD_FAILURE_PATH}" in output
        assert "did not install" not in output
        assert in_sandbox(trixie, install_log) == log_before
        print(next(line for line in output.splitlines() if "last deploy's DKMS" in line))
    assert_package_state_consistent(trixie)
