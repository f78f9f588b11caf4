"""Fixtures of the rig verification suite (run by `llamarig verify`, or by hand with
`pytest llamarig/checks --hosts=ssh://HOST --ssh-config=FILE` and LLAMARIG_VERIFY_DATA set).

The expectations come from the rig data that drove the deploy, written to a JSON file by
`llamarig verify` and named by LLAMARIG_VERIFY_DATA."""

from __future__ import annotations

import json
import os
import shlex

import pytest

from llamarig.onhost.httpbounds import HttpTimeouts


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


# Why a rig's checks skip on a gateway alone (`role: gateway`); test_gateway checks it.
GATEWAY_ONLY = "a gateway runs no llama-server (role: gateway): test_gateway.py checks it"
# And on a builder, which builds for the rigs: they check the builds they run.
BUILDER_ONLY = "a builder runs no llama-server (role: builder): its rigs check the builds they run"


@pytest.fixture(scope="session")
def llama_rig(data) -> dict:
    """A rig of llama.cpp (a server, a head or a worker): not a gateway alone, which has no
    driver, build, model or llama-server of its own, nor a builder."""
    if data["role"] == "gateway":
        pytest.skip(GATEWAY_ONLY)
    if data["role"] == "builder":
        pytest.skip(BUILDER_ONLY)
    return data


@pytest.fixture(scope="session")
def derived(rig, llama_rig) -> dict:
    """Values llamarig derives from the data: base_url, nvcc, cmake_options, api_key."""
    return rig["derived"]


@pytest.fixture(scope="session")
def gateway(rig) -> dict:
    """What this host's gateway is checked against (`runner.gateway_expectations`: the users'
    names and key hashes, the certificate copy's fingerprint); skipped on a host that runs
    no gateway."""
    if not rig.get("gateway"):
        pytest.skip("this host runs no gateway (it is not in the `gateways` group)")
    return rig["gateway"]


@pytest.fixture(scope="session")
def serving_rig(llama_rig) -> dict:
    """A rig that runs llama-server (not an RPC worker, which lends its devices to a head)."""
    data = llama_rig
    if data["role"] == "rpc-worker":
        pytest.skip("an rpc-worker runs ggml-rpc-server, not llama-server: its head serves")
    return data


@pytest.fixture(scope="session")
def systemd_rig(serving_rig) -> dict:
    data = serving_rig
    if data["server"]["supervisor"] != "systemd":
        pytest.skip("server.supervisor is none (no systemd on this host): no unit to check")
    return data


@pytest.fixture(scope="session")
def managed_kernel(nvidia_rig) -> dict:
    if not nvidia_rig["kernel_modules"]["manage"]:
        pytest.skip("kernel_modules.manage is false: the host's owner keeps nouveau/nova off")
    return nvidia_rig


@pytest.fixture(scope="module")
def server_pid(host, llama_rig) -> str:
    """The main PID of the running llama-server (the unit's, or the launcher's process)."""
    data = llama_rig
    if data["server"]["supervisor"] == "systemd":
        return host.run(f"systemctl show -P MainPID {data['server']['service']}").stdout.strip()
    pids = host.run("pgrep -x llama-server").stdout.split()
    assert pids, "no llama-server process: start it with `llamarig run`"
    return pids[0]


@pytest.fixture(scope="session")
def nvidia_rig(llama_rig) -> dict:
    data = llama_rig
    if data["driver"]["source"] == "none":
        pytest.skip("driver.source is none: a CPU-only rig has no NVIDIA driver to check")
    return data


# testinfra's `host` is module-scoped, so fixtures that use it are too.
@pytest.fixture(scope="module")
def gpus(host, nvidia_rig) -> list[dict]:
    """The GPUs as nvidia-smi reports them; skipped (with the reason) on a host without one."""
    from llamarig.facts.gpu import NvidiaPciDevices

    on_pci_bus = bool(host.run(NvidiaPciDevices().command()).stdout.strip())
    if not host.exists("nvidia-smi"):
        if not on_pci_bus:
            pytest.skip("no NVIDIA GPU on this host's PCI bus: GPU checks not possible")
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
def api(host, derived, serving_rig):
    """Call the server's API from the host itself (it may listen on loopback only). /health
    is asked first, within the rig's probe bounds: a server that is hung or down fails every
    API check at once, naming the endpoint, instead of each waiting its request's bound."""
    return answering_api(host, derived, HttpTimeouts.of(serving_rig))


def answering_api(host, derived: dict, timeouts: HttpTimeouts):
    """The API caller of ``api``, once /health answered within the probe bounds; each call is
    bounded by ``timeouts`` (the rig's server.http_timeouts: connect, answer)."""
    base = derived["base_url"]
    if host.exists("curl"):
        call = curl_api(host, derived, timeouts)
    else:
        call = python_api(host, base, timeouts)
    code, _ = call("/health", max_time=timeouts.probe)
    if code == 0:
        pytest.fail(
            f"{base}/health gave no answer within {timeouts.said('probe')}: llama-server is "
            "down or hung (see `systemctl status` and its journal)"
        )
    return call


def curl_api(host, derived: dict, timeouts: HttpTimeouts):
    def call(
        path: str, body: dict | None = None, auth: bool = True, max_time: int | None = None
    ) -> tuple[int, str]:
        """GET (or POST ``body``); with the host's root-only API key header when one is set;
        status 0 when no answer came within ``max_time`` seconds (default: the answer bound)."""
        payload = derived["curl_auth"] if auth else ""
        if body is not None:
            # One quoted argument: a prompt of `expect.answers` may hold any character.
            payload += f" -H 'Content-Type: application/json' -d {shlex.quote(json.dumps(body))}"
        # Bounded: a hung server fails its checks instead of hanging `llamarig verify`.
        result = host.run(
            f"curl -s --connect-timeout {timeouts.connect} "
            f"--max-time {max_time or timeouts.answer} "
            f"-o /tmp/llamarig-verify.out -w '%{{http_code}}' {payload} "
            f"-- {shlex.quote(derived['base_url'] + path)}; "
            "echo; cat /tmp/llamarig-verify.out; rm -f /tmp/llamarig-verify.out"
        )
        code, _, text = result.stdout.partition("\n")
        return int(code or 0), text

    return call


# The same call through the host's python3, for hosts without curl (a bare GPU container).
PYTHON_CALL = """
import json, os, sys, urllib.error, urllib.request
url, body, auth, header_file = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
timeout = float(sys.argv[5])
headers = {"Content-Type": "application/json"} if body else {}
if auth and os.path.exists(header_file):
    name, _, value = open(header_file).read().strip().partition(": ")
    headers[name] = value
request = urllib.request.Request(url, data=body.encode() or None, headers=headers)
try:
    with urllib.request.urlopen(request, timeout=timeout) as response:
        code, text = response.status, response.read().decode()
except urllib.error.HTTPError as error:
    code, text = error.code, error.read().decode()
except OSError:
    code, text = 0, ""
print(code)
print(text)
"""


def python_api(host, base: str, timeouts: HttpTimeouts):
    from llamarig.onhost.hostpaths import API_KEY_HEADER_PATH

    def call(
        path: str, body: dict | None = None, auth: bool = True, max_time: int | None = None
    ) -> tuple[int, str]:
        result = host.run(
            "python3 -c "
            + shlex.quote(PYTHON_CALL)
            + " "
            + " ".join(
                shlex.quote(arg)
                for arg in (
                    f"{base}{path}",
                    json.dumps(body) if body is not None else "",
                    "1" if auth else "0",
                    API_KEY_HEADER_PATH,
                    str(max_time or timeouts.answer),
                )
            )
        )
        code, _, text = result.stdout.partition("\n")
        return int(code or 0), text

    return call
