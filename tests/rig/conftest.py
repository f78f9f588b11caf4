"""Fixtures of the rig verification suite (run by `llamarig verify`, or by hand with
`pytest tests/rig --hosts=ssh://HOST --ssh-config=FILE` and LLAMARIG_VERIFY_DATA set).

The expectations come from the rig data that drove the deploy, written to a JSON file by
`llamarig verify` and named by LLAMARIG_VERIFY_DATA."""

from __future__ import annotations

import json
import os

import pytest


@pytest.fixture(scope="session")
def rig() -> dict:
    path = os.environ.get("LLAMARIG_VERIFY_DATA")
    if not path:
        pytest.exit("LLAMARIG_VERIFY_DATA is not set: run the suite through `llamarig verify`", 2)
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.fixture(scope="session")
def data(rig) -> dict:
    """The rig data as planned (ctx and tensor_split resolved)."""
    return rig["data"]


@pytest.fixture(scope="session")
def derived(rig) -> dict:
    """Values llamarig derives from the data: base_url, nvcc, cmake_options, api_key."""
    return rig["derived"]


@pytest.fixture(scope="session")
def nvidia_rig(data) -> dict:
    if data["driver"]["source"] == "none":
        pytest.skip("driver.source is none: a CPU-only rig has no NVIDIA driver to check")
    return data


# testinfra's `host` is module-scoped, so fixtures that use it are too.
@pytest.fixture(scope="module")
def gpus(host, nvidia_rig) -> list[dict]:
    """The GPUs as nvidia-smi reports them; skipped (with the reason) on a host without one."""
    from llamarig.facts import NvidiaPciDevices

    if not host.run(NvidiaPciDevices().command()).stdout.strip():
        pytest.skip("no NVIDIA GPU on this host's PCI bus: GPU checks not possible")
    if not host.exists("nvidia-smi"):
        pytest.fail("the host has an NVIDIA GPU but no nvidia-smi: the driver is not installed")
    fields = "index,pci.bus_id,name,memory.total,compute_cap,pcie.link.gen.current," + (
        "pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max,driver_version"
    )
    result = host.run(f"nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits")
    assert result.rc == 0, f"nvidia-smi fails: {result.stderr.strip()} (driver not loaded?)"
    keys = fields.split(",")
    return [
        dict(zip(keys, (value.strip() for value in line.split(",")), strict=True))
        for line in result.stdout.splitlines()
        if line.strip()
    ]


@pytest.fixture(scope="module")
def api(host, derived):
    """Call the server's API from the host itself (it may listen on loopback only)."""
    base = derived["base_url"]

    def call(path: str, body: dict | None = None, auth: bool = True) -> tuple[int, str]:
        """GET (or POST ``body``); with the host's root-only API key header when one is set."""
        payload = derived["curl_auth"] if auth else ""
        if body is not None:
            payload += f" -H 'Content-Type: application/json' -d '{json.dumps(body)}'"
        result = host.run(
            f"curl -s -o /tmp/llamarig-verify.out -w '%{{http_code}}' {payload} {base}{path}; "
            "echo; cat /tmp/llamarig-verify.out; rm -f /tmp/llamarig-verify.out"
        )
        code, _, text = result.stdout.partition("\n")
        return int(code or 0), text

    return call
