"""The `distro` driver path and the reboot policy on a real Debian bookworm target.

A bookworm sandbox (systemd-nspawn, like the trixie one) converges with `driver.source: distro`:
Debian's nvidia-open-kernel-dkms is installed from contrib/non-free and DKMS builds the module
for the sandbox's installed kernel headers (the sandbox has no GPU: the module is built, never
loaded), and Debian's CUDA toolkit against which llama.cpp's CUDA build configures. The
changed blacklist triggers exactly one reboot under `reboot: if-needed` (the
sandbox's supervisor restarts systemd-nspawn, as a machine comes back), after which the deploy
reconnects and finishes. Stand-ins as in test_sandbox_converge: model and llama.cpp mirror on
loopback.

The rig is the one test_sandbox_secureboot's `sign` case reads too (tests/signed_bookworm.py):
its first converge runs with Secure Boot faked on and `driver.secure_boot: sign`, so that one
DKMS build serves both modules; the reboot drops the faked state, and what follows is the plain
rig.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import urllib.request

import pytest

from llamarig.config import load_inventory
from llamarig.planner import render
from tests.conftest import PROJECT
from tests.sandboxes import changed_operations, converge, in_sandbox, verify
from tests.signed_bookworm import NAME, boot_id

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

INVENTORY = PROJECT / "inventory" / "sandbox-bookworm.yml"
BLACKLIST = "/etc/modprobe.d/llamarig-blacklist-nouveau-nova.conf"


@pytest.fixture(scope="module")
def bookworm(signed_bookworm):
    return signed_bookworm.info


@pytest.fixture(scope="module")
def rig_inventory(signed_bookworm):
    """The rig's inventory: inventory/sandbox-bookworm.yml with `driver.secure_boot: sign`."""
    return signed_bookworm.inventory


def test_distro_driver_builds_with_dkms_and_reboots_once(signed_bookworm, bookworm):
    first = signed_bookworm.first_converge
    assert first.returncode == 0, f"deploy failed:\n{first.stderr[-6000:]}"
    names = changed_operations(json.loads(first.stdout)["results"])
    assert "NVIDIA driver (distro, branch 580)" in names
    assert "Reboot to load the new modules (policy `if-needed`)" in names
    assert boot_id(bookworm) != signed_bookworm.boot_before, "the sandbox was not rebooted"
    status = in_sandbox(bookworm, "dkms status")
    print(status)
    assert "nvidia-current" in status and "installed" in status, status
    kernel = in_sandbox(bookworm, "ls /lib/modules | grep -- '-amd64$' | sort -V | tail -1")
    module = in_sandbox(bookworm, f"find /lib/modules/{kernel} -name 'nvidia*.ko*' | head -1")
    assert module, f"no nvidia module built for {kernel}"
    assert "blacklist nova_core" in in_sandbox(bookworm, f"cat {BLACKLIST}")
    request = urllib.request.Request(
        "http://127.0.0.1:8081/completion",
        json.dumps({"prompt": "Hi", "n_predict": 4}).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.load(response)["tokens_predicted"] == 4


def test_cuda_configure_with_the_installed_toolkit(bookworm):
    """cmake configures llama.cpp with GGML_CUDA=ON against the toolkit the deploy installed,
    with the command the deploy renders for a CUDA rig (an RTX 3090: 86-real)."""
    data = copy.deepcopy(load_inventory(INVENTORY).hosts[NAME].data)
    data["llama_cpp"]["backend"] = "cuda"
    data["gpus"] = [
        {"name": "NVIDIA GeForce RTX 3090", "vram_mib": 24576, "compute_capability": "8.6"}
    ]
    command = render.cmake_configure_command(data)
    command[command.index("-B") + 1] = "/tmp/llamarig-cuda-configure"
    assert "-DCMAKE_CUDA_COMPILER=/usr/bin/nvcc" in command
    log = in_sandbox(
        bookworm,
        f"{shlex.join(command)} > /tmp/configure.log 2>&1; rc=$?; cat /tmp/configure.log; "
        "rm -rf /tmp/llamarig-cuda-configure; exit $rc",
    )
    print("\n".join(line for line in log.splitlines() if "CUDA" in line))
    assert "CUDA Toolkit found" in log or "Found CUDAToolkit" in log, log[-3000:]
    assert "86-real" in log
    assert "Build files have been written" in log


def test_second_converge_changes_nothing_and_does_not_reboot(bookworm, rig_inventory):
    before = boot_id(bookworm)
    results = converge(rig_inventory)
    assert results["totals"]["success"] == 0, changed_operations(results)
    assert boot_id(bookworm) == before


def test_verify_passes_without_gpu_checks(bookworm, rig_inventory):
    result = verify(rig_inventory, "-v")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "no NVIDIA GPU on this host's PCI bus" in result.stdout
    for check in ("test_nouveau_and_nova_blacklisted", "test_nouveau_and_nova_not_loaded"):
        assert f"{check}[ssh://llamarig-sandbox-bookworm] PASSED" in result.stdout


def test_verify_names_a_removed_blacklist_and_the_deploy_restores_it(bookworm, rig_inventory):
    in_sandbox(bookworm, f"rm {BLACKLIST}")
    result = verify(rig_inventory)
    assert result.returncode != 0
    assert "test_nouveau_and_nova_blacklisted" in result.stdout
    assert "not blacklisted in the modprobe configuration" in result.stdout
    before = boot_id(bookworm)
    names = changed_operations(converge(rig_inventory))
    assert "Blacklist nouveau, nova_core and nova" in names
    assert boot_id(bookworm) != before  # the restored blacklist needs its reboot again
    assert verify(rig_inventory).returncode == 0
