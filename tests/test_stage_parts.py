"""The data and decisions the deploy stages act on (package names, what the kernel_modules stage
writes, the reboot policy) and the operations they hand over to (the curl header, the barrier
that orders RPC workers before heads), the latter run for real by pyinfra on this machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llamarig.converge import boot
from llamarig.planner import render
from llamarig.tables.packages import (
    BUILD_DEPENDENCIES,
    DriverPackages,
    cuda_toolkit_package,
    driver_packages,
)
from tests.conftest import pyinfra_env
from tests.test_operations import changed, run_deploy


class TestDriverPackages:
    def test_nvidia_repo_open_modules(self):
        assert driver_packages(
            "nvidia-repo", open_modules=True, branch="580", debian=True, kernel="6.1.0-9-amd64"
        ) == DriverPackages(["nvidia-open", "linux-headers-amd64"], "nvidia-open-dkms")

    def test_nvidia_repo_proprietary_modules_on_ubuntu(self):
        assert driver_packages(
            "nvidia-repo", open_modules=False, branch="580", debian=False, kernel="6.8.0-31-generic"
        ) == DriverPackages(
            ["cuda-drivers", "linux-headers-6.8.0-31-generic"], "nvidia-kernel-dkms"
        )

    def test_debian_distribution_driver(self):
        assert driver_packages(
            "distro", open_modules=True, branch="550", debian=True, kernel="6.12.0-1-amd64"
        ) == DriverPackages(
            [
                "nvidia-open-kernel-dkms",
                "nvidia-driver",
                "firmware-nvidia-gsp",
                "linux-headers-amd64",
            ],
            "nvidia-open-kernel-dkms",
        )

    @pytest.mark.parametrize(
        ("open_modules", "driver", "dkms"),
        [
            (True, "nvidia-driver-570-open", "nvidia-dkms-570-open"),
            (False, "nvidia-driver-570", "nvidia-dkms-570"),
        ],
    )
    def test_ubuntu_distribution_driver_names_the_branch(self, open_modules, driver, dkms):
        assert driver_packages(
            "distro", open_modules=open_modules, branch="570", debian=False, kernel="6.8.0-1-x"
        ) == DriverPackages([driver, "nvidia-utils-570", "linux-headers-6.8.0-1-x"], dkms)

    @pytest.mark.parametrize("source", ["none", "preinstalled"])
    def test_a_source_that_installs_nothing_has_no_packages(self, source):
        with pytest.raises(ValueError, match=source):
            driver_packages(source, open_modules=True, branch="580", debian=True, kernel="k")


class TestCudaToolkitPackage:
    def test_nvidia_repo_is_versioned(self):
        assert cuda_toolkit_package("nvidia-repo", "12.8") == "cuda-toolkit-12-8"

    def test_distribution_has_one_toolkit(self):
        assert cuda_toolkit_package("distro", "12.8") == "nvidia-cuda-toolkit"

    def test_preinstalled_has_no_package(self):
        with pytest.raises(ValueError, match="preinstalled"):
            cuda_toolkit_package("preinstalled", "12.8")


def test_build_dependencies_carry_the_build_tools_and_the_download_tools():
    assert {"cmake", "ninja-build", "git", "ccache", "curl"} <= set(BUILD_DEPENDENCIES)
    assert len(set(BUILD_DEPENDENCIES)) == len(BUILD_DEPENDENCIES)


class TestKernelModuleFiles:
    def test_modules_load_file_lists_the_modules_one_a_line(self):
        assert (
            render.render_file("modules-load-nvidia.conf.j2", modules=boot.LOADED_AT_BOOT)
            == "# Managed by llamarig\nnvidia\nnvidia_uvm\n"
        )

    def test_blacklist_keeps_every_in_kernel_driver_off(self):
        text = render.render_file("modprobe-blacklist.conf.j2")
        for module in ("nouveau", "nova_core", "nova"):
            assert f"blacklist {module}\n" in text


class TestRebootStep:
    @pytest.mark.parametrize("policy", ["always", "if-needed", "never"])
    def test_local_is_never_rebooted(self, policy):
        step = boot.reboot_step(policy, local=True, may_change=True)
        assert step.reboot is None and "@local is never rebooted" in step.note

    def test_local_without_change_says_nothing_unless_always(self):
        assert boot.reboot_step("if-needed", local=True, may_change=False) == boot.RebootStep()
        assert boot.reboot_step("always", local=True, may_change=False).note

    def test_never_names_the_reboot_the_operator_owes(self):
        step = boot.reboot_step("never", local=False, may_change=True)
        assert step.reboot is None and "reboot this host" in step.note
        assert boot.reboot_step("never", local=False, may_change=False) == boot.RebootStep()

    @pytest.mark.parametrize("may_change", [True, False])
    def test_always_reboots_unconditionally(self, may_change):
        step = boot.reboot_step("always", local=False, may_change=may_change)
        assert step == boot.RebootStep(reboot="Reboot (policy `always`)")

    @pytest.mark.parametrize("may_change", [True, False])
    def test_if_needed_reboots_only_once_an_input_changed(self, may_change):
        # Decided when the operations run: a change known at prepare time may not happen.
        step = boot.reboot_step("if-needed", local=False, may_change=may_change)
        assert step.only_if_changed and step.reboot.startswith("Reboot to load the new modules")
        assert step.note is None


needs_tools = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("curl", "git", "cmake", "sha256sum")),
    reason="needs curl, git, cmake and sha256sum on this machine",
)


@needs_tools
def test_curl_auth_header_is_written_once_and_rewritten_for_a_new_key(tmp_path):
    key, header = tmp_path / "api-key", tmp_path / "api-key.header"
    key.write_text("s3cret-key\nsecond line\n")

    def deploy(rewrite: bool):
        body = (
            f"operations.curl_auth_header(key_file={str(key)!r}, dest={str(header)!r}, "
            f"rewrite={rewrite})"
        )
        code, results, stderr = run_deploy(tmp_path, body)
        assert code == 0, stderr
        return changed(results)

    assert deploy(rewrite=False) == 1
    assert header.read_text() == "Authorization: Bearer s3cret-key\n"
    assert header.stat().st_mode & 0o777 == 0o600
    assert deploy(rewrite=False) == 0
    key.write_text("new-key\n")
    assert deploy(rewrite=True) == 1
    assert header.read_text() == "Authorization: Bearer new-key\n"


ORDERING_DEPLOY = """
    from pyinfra import api, host
    from pyinfra.operations import server

    from llamarig import operations

    WORKER = "@chroot//"


    @api.deploy("workers")
    def workers(barrier):
        if host.name == WORKER:
            for step in range(4):
                server.shell(name=f"worker step {step}", commands=["true"])
        if barrier:
            operations.barrier(name="barrier")


    @api.deploy("heads")
    def heads():
        if host.name != WORKER:
            server.shell(name="head restart", commands=["true"])


    workers(barrier=BARRIER)
    heads()
"""


def executed_order(tmp_path: Path, barrier: bool) -> list[str]:
    """The operations' order when one host (the worker) has four operations before a point and
    the other (the head) one after it: two chroot hosts into / (root only), so both are this
    machine and every command is `true`."""
    deploy = tmp_path / "ordering_deploy.py"
    deploy.write_text(textwrap.dedent(ORDERING_DEPLOY).replace("BARRIER", str(barrier)))
    result = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", "--json", "@chroot//,@chroot///", str(deploy)],
        cwd=tmp_path,
        env=pyinfra_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    operations = json.loads(result.stdout)["results"]["operations"]
    return [operation["name"].split(" | ", 1)[-1] for operation in operations]


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("chroot"), reason="two chroot hosts need root"
)
class TestBarrier:
    def test_without_it_pyinfra_interleaves_the_hosts(self, tmp_path):
        # The premise of the barrier: operations of different hosts run by their position.
        order = executed_order(tmp_path, barrier=False)
        assert order.index("head restart") < order.index("worker step 3"), order

    def test_every_operation_before_it_runs_before_any_after_it(self, tmp_path):
        order = executed_order(tmp_path, barrier=True)
        assert order == [*(f"worker step {step}" for step in range(4)), "barrier", "head restart"]
