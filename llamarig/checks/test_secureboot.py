"""Secure Boot (README "Secure Boot"): with it on, the loaded nvidia module is signed by a key
the firmware trusts, Canonical's or an enrolled Machine Owner Key. Skipped, with the reason,
where Secure Boot is off or cannot be read."""

from __future__ import annotations

import pytest

from llamarig.converge.secureboot import untrusted_module_problem
from llamarig.facts.driver import NVIDIA_MODULE_NAMES, FirmwareBoot, NvidiaModule


def fact(host, fact_class):
    result = host.run(fact_class().command())
    return fact_class().process(result.stdout.splitlines())


def test_nvidia_module_signed_by_a_trusted_key(host, nvidia_rig):
    secure_boot = fact(host, FirmwareBoot)["secure_boot"]
    if secure_boot is not True:
        state = "off" if secure_boot is False else "unknown (no EFI variable, no mokutil)"
        pytest.skip(f"secure boot is {state}: the kernel loads unsigned modules")
    module = fact(host, NvidiaModule)
    sig_key = host.run(
        " || ".join(f"modinfo -F sig_key {name} 2>/dev/null" for name in NVIDIA_MODULE_NAMES)
    ).stdout
    enrolled = host.run("mokutil --list-enrolled 2>/dev/null").stdout
    problem = untrusted_module_problem(module, sig_key, enrolled)
    assert problem is None, problem
