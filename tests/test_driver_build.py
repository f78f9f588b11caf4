"""The record of a failed DKMS build of the NVIDIA driver, and the refusal it makes of the same
build on a later deploy (driver_build.py; the real failure is test_sandbox_trixie_dkms's)."""

from __future__ import annotations

import pytest

from llamarig.facts.driver import DriverBuildFailure
from llamarig.onhost.driver_build import BuildFailure, parse_record, refusal
from llamarig.onhost.hostpaths import DRIVER_BUILD_FAILURE_PATH

PACKAGE = "nvidia-open-kernel-dkms"
VERSION = "550.163.01-2"
KERNEL = "6.12.57+deb13-amd64"
ERROR = "nv-pci.c:212:14: error: too few arguments to function 'pci_resize_resource'"
RECORD = [
    f"package={PACKAGE}",
    f"version={VERSION}",
    f"kernel={KERNEL}",
    f"kernels={KERNEL}",
    f"error={ERROR}",
]


def test_the_fact_reads_what_the_driver_installation_wrote():
    failure = DriverBuildFailure().process(RECORD)
    assert failure == BuildFailure(PACKAGE, VERSION, KERNEL, KERNEL, ERROR)


def test_no_record_is_no_failure():
    assert DriverBuildFailure().default() is None
    assert parse_record([]) is None


@pytest.mark.parametrize("missing", ["package", "version", "kernel"])
def test_a_record_without_what_identifies_the_build_is_not_trusted(missing):
    lines = [line for line in RECORD if not line.startswith(f"{missing}=")]
    assert parse_record(lines) is None
    assert parse_record([*lines, f"{missing}="]) is None


def test_an_error_line_with_equals_signs_is_kept_whole():
    failure = parse_record([*RECORD[:4], "error=a.c:1: error: x = y == z"])
    assert failure.error == "a.c:1: error: x = y == z"


def test_the_same_build_is_refused_naming_package_kernel_error_and_the_way_out():
    message = refusal(parse_record(RECORD), PACKAGE, VERSION, KERNEL)
    assert f"DKMS build of {PACKAGE} {VERSION} failed for kernel(s) {KERNEL}" in message
    assert ERROR in message
    assert "nothing was installed" in message
    assert "Use driver.source nvidia-repo" in message
    assert f"remove {DRIVER_BUILD_FAILURE_PATH}" in message


@pytest.mark.parametrize(
    "package, candidate, kernel",
    [
        (PACKAGE, "550.163.01-3", KERNEL),  # the distribution published another version
        (PACKAGE, None, KERNEL),  # no candidate any more (the component was removed)
        (PACKAGE, VERSION, "6.12.63+deb13-amd64"),  # booted into another kernel
        ("nvidia-open-dkms", "580.105.08-1", KERNEL),  # driver.source nvidia-repo now
        (None, None, KERNEL),  # a driver without a DKMS build
    ],
)
def test_a_changed_version_kernel_or_package_tries_the_build_again(package, candidate, kernel):
    assert refusal(parse_record(RECORD), package, candidate, kernel) is None


def test_without_a_record_nothing_is_refused():
    assert refusal(None, PACKAGE, VERSION, KERNEL) is None
