"""`llamarig verify` glue: the ssh configuration it hands testinfra and the expectations file."""

import copy
import json
import os
import re
from types import SimpleNamespace

import pytest
import yaml

from llamarig.checks.runner import expectations
from llamarig.config import load_inventory
from llamarig.config.ssh import SshTarget
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.planner import gather
from tests.conftest import PROJECT
from tests.ggufmodels import write_qwen35


def test_ssh_config_checks_host_keys():
    text = SshTarget.of(
        {"host": "192.0.2.1", "port": 2200, "user": "root", "key": "/k", "known_hosts": "/kh"}
    ).ssh_config("llamarig-rig1")
    assert "Host llamarig-rig1\n  HostName 192.0.2.1\n  Port 2200\n" in text
    assert "StrictHostKeyChecking yes" in text and "UserKnownHostsFile /kh" in text
    assert "IdentityFile /k" in text and "BatchMode yes" in text


@pytest.fixture
def unreachable_host(monkeypatch):
    """The seed rig's host (a documentation address) as ssh finds it, unreachable: every fact
    its default, without dialling the address (3 s a fact, and a packet off loopback)."""

    def reader(data):
        return lambda fact_class, **arguments: fact_class().default()

    monkeypatch.setattr(gather, "shell_reader", reader)


def test_expectations_carry_the_planned_data(file_server, tmp_path, unreachable_host):
    """The seed rig, its model URL pointed at a loopback server holding a header of the same
    shape (the real one is on Hugging Face, and the host at a documentation address)."""
    www, url = file_server
    write_qwen35(www / "model.gguf")
    seed = (PROJECT / "inventory" / "example-5080-3090.yml").read_text()
    real_url = re.search(r"url: (https://huggingface\.co/\S+)", seed).group(1)
    (tmp_path / "rig.yml").write_text(seed.replace(real_url, f"{url}/model.gguf"))
    host = load_inventory(tmp_path / "rig.yml").hosts["rig1"]
    expected = expectations(host)
    assert expected["data"]["server"]["tensor_split"] == [2, 3]
    assert expected["derived"]["base_url"] == "http://127.0.0.1:8001"
    assert expected["derived"]["nvcc"] == "/usr/local/cuda-13.0/bin/nvcc"
    assert expected["derived"]["cmake_options"]["CMAKE_CUDA_ARCHITECTURES"] == "86-real;120a-real"
    # The model check's files and digests, the records trusted unless `verify --rehash`.
    data = host.data
    assert expected["model_files"] == [
        {"path": f"{data['paths']['models']}/{data['model']['filename'] or 'model.gguf'}",
         "sha256": data["model"]["sha256"]}
    ]  # fmt: skip
    assert expected["rehash"] is False and expectations(host, rehash=True)["rehash"] is True
    assert expected["checksum_records"] == "/var/lib/llamarig/checksums"


def test_a_router_expects_each_model_memory_on_the_gpus_it_plans(
    file_server, tmp_path, unreachable_host
):
    """The seed rig serving its model under two names (models_max 1: one loaded at a time):
    verify expects each model's own MiB per GPU, by nvidia-smi's index."""
    www, url = file_server
    write_qwen35(www / "model.gguf")
    seed = (PROJECT / "inventory" / "example-5080-3090.yml").read_text()
    real_url = re.search(r"url: (https://huggingface\.co/\S+)", seed).group(1)
    document = yaml.safe_load(seed.replace(real_url, f"{url}/model.gguf"))
    rig = document["all"]["children"]["rigs"]["hosts"]["rig1"]
    model = rig.pop("model")
    rig["models"] = [{"name": "qwen-a", **model}, {"name": "qwen-b", **model, "filename": "b.gguf"}]
    rig["server"]["models_max"] = 1
    (tmp_path / "rig.yml").write_text(yaml.safe_dump(document))
    expected = expectations(load_inventory(tmp_path / "rig.yml").hosts["rig1"])
    assert expected["memory"] is None  # the router itself holds no model
    per_model = expected["model_memory"]
    assert sorted(per_model) == ["qwen-a", "qwen-b"]
    # Each as the one-model rig of the same file plans it: the same GPUs, by the same index.
    (tmp_path / "one.yml").write_text(seed.replace(real_url, f"{url}/model.gguf"))
    alone = expectations(load_inventory(tmp_path / "one.yml").hosts["rig1"])["memory"]
    assert {d["name"] for d in alone} == {"NVIDIA GeForce RTX 5080", "NVIDIA GeForce RTX 3090"}
    for devices in per_model.values():
        assert [(d["index"], d["name"]) for d in devices] == [
            (d["index"], d["name"]) for d in alone
        ]
        assert all(d["planned_mib"] > 10000 for d in devices), devices


class RouterHost:
    """nvidia-smi's memory used per GPU index, as a testinfra host answers it."""

    def __init__(self, used: dict[int, int]) -> None:
        self.used = used

    def run(self, command: str):
        assert command.startswith("nvidia-smi --query-gpu=index,memory.used"), command
        lines = "\n".join(f"{index}, {mib}" for index, mib in self.used.items())
        return SimpleNamespace(rc=0, stdout=lines, stderr="")


MODEL_MEMORY = {
    "a": [{"index": 0, "name": "NVIDIA H200", "planned_mib": 9000}],
    "b": [{"index": 0, "name": "NVIDIA H200", "planned_mib": 9190}],
}


@pytest.mark.parametrize(
    "states, used, verdict",
    [
        # Both loaded: 18,190 MiB planned, as on the H200 (nvidia-smi 18,003: -1.0%).
        ({"a": "loaded", "b": "loaded"}, 18003, "passes"),
        # Only a is loaded (b loading or unloaded counts nothing): 9,000 planned.
        ({"a": "loaded", "b": "loading"}, 9100, "passes"),
        ({"a": "loaded", "b": "unloaded"}, 18003, "fails"),
        ({"a": "unloaded", "b": "sleeping"}, 4, "skips"),
    ],
)
def test_a_router_holds_what_the_plans_of_its_loaded_models_add_up_to(states, used, verdict):
    from llamarig.checks import test_gpu_memory

    listed = [{"id": name, "status": {"value": value}} for name, value in states.items()]

    def api(path: str):
        assert path == "/models"
        return 200, json.dumps({"data": listed})

    check = test_gpu_memory.test_gpu_memory_of_the_loaded_models_is_as_planned
    rig = {"model_memory": MODEL_MEMORY}
    if verdict == "passes":
        check(RouterHost({0: used}), rig, [], api)
    elif verdict == "fails":
        with pytest.raises(AssertionError, match=r"the plans of the models loaded \(a\)"):
            check(RouterHost({0: used}), rig, [], api)
    else:
        with pytest.raises(pytest.skip.Exception, match="no model loaded now"):
            check(RouterHost({0: used}), rig, [], api)


@pytest.mark.parametrize("client", ["curl", "python3"])
def test_a_hung_server_fails_the_api_checks_within_the_probe_bound(monkeypatch, client):
    """A server that accepts connections and never answers (a SIGSTOPped llama-server): the
    checks' API fails at once, naming the endpoint and the bound, instead of each check waiting
    its request's 120 s."""
    import socket
    import time

    import testinfra

    from llamarig.checks import conftest

    bounds = HttpTimeouts(connect=5, probe=2, answer=120, generation=600)
    host = testinfra.get_host("local://")
    if client == "python3":
        monkeypatch.setattr(host, "exists", lambda command: command != "curl")
    with socket.create_server(("127.0.0.1", 0)) as hung:  # its backlog accepts; nobody reads
        base = f"http://127.0.0.1:{hung.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception) as failed:
            conftest.answering_api(host, {"base_url": base, "curl_auth": ""}, bounds)
        waited = time.monotonic() - started
    assert str(failed.value).startswith(
        f"{base}/health gave no answer within 2 s (connect 5 s; server.http_timeouts.probe)"
    )
    assert waited < 10, f"the check waited {waited:.1f} s"


class GpuHost:
    """A testinfra host whose nvidia-smi lists ``apps`` (pid, bus id, MiB) and whose ps lists
    ``children`` of the server's PID."""

    def __init__(self, apps: list[tuple[str, str, int]], children: list[str]) -> None:
        self.apps, self.children = apps, children

    def run(self, command: str):
        if command.startswith("ps -o pid= --ppid"):
            return SimpleNamespace(stdout="\n".join(f"  {pid}" for pid in self.children))
        if "--query-compute-apps" in command:
            return SimpleNamespace(stdout="\n".join(f"{p}, {b}, {m}" for p, b, m in self.apps))
        raise AssertionError(command)

    def file(self, path: str):
        return SimpleNamespace(exists=path.removeprefix("/proc/") in {"100", "201", "202"})


H200 = [{"name": "NVIDIA H200", "pci.bus_id": "00000000:00:05.0"}]


@pytest.mark.parametrize(
    "models, apps, children, verdict",
    [
        # One model: the server's own process holds the GPU.
        ([], [("100", "00000000:00:05.0", 9000)], [], "passes"),
        ([], [("201", "00000000:00:05.0", 9000)], [], "fails"),
        # A router holds no model: the model servers it started do (found on the H200: the
        # check asked the router's own PID and failed a rig that served on the GPU).
        ([{"name": "a"}], [("201", "00000000:00:05.0", 9000)], ["201", "202"], "passes"),
        ([{"name": "a"}], [("100", "00000000:00:05.0", 4)], ["201"], "fails"),
        ([{"name": "a"}], [], [], "skips"),
    ],
)
def test_the_gpu_check_asks_for_the_processes_that_hold_models(models, apps, children, verdict):
    from llamarig.checks import test_rig

    data = {"models": models, "server": {"split_mode": "none"}}
    check = test_rig.test_server_runs_on_the_gpus
    host = GpuHost(apps, children)
    if verdict == "passes":
        check(host, data, H200, "100")
    elif verdict == "fails":
        with pytest.raises(AssertionError, match="holds no GPU memory"):
            check(host, data, H200, "100")
    else:
        with pytest.raises(pytest.skip.Exception, match="no model loaded"):
            check(host, data, H200, "100")


# --- the gateway's checks (llamarig/checks/test_gateway.py) ---------------------------------


class GatewayHost:
    """A testinfra host of a gateway: ``files`` by path (content, owner, mode), and what each
    command prints (``outputs``: the first whose key starts the command)."""

    def __init__(self, files: dict[str, tuple[str, str, int]], outputs: dict[str, str]) -> None:
        self.files, self.outputs = files, outputs

    def file(self, path: str):
        if path not in self.files:
            return SimpleNamespace(exists=False)
        content, user, mode = self.files[path]
        return SimpleNamespace(exists=True, content_string=content, user=user, mode=mode)

    def exists(self, command: str) -> bool:
        return command == "ss"

    def run(self, command: str):
        said = next((out for start, out in self.outputs.items() if command.startswith(start)), "")
        return SimpleNamespace(rc=0, stdout=said, stderr="")


USERS_MAP = "/etc/haproxy/llamarig/users.map"
ALICE, BOB = ("a" * 64, "alice"), ("b" * 64, "bob")
EXPECTED_USERS = {"users": [{"sha256": ALICE[0], "name": "alice"}]}


@pytest.mark.parametrize(
    "lines, said",
    [
        ([ALICE], None),
        # bob removed from the inventory (revoked) but still in the map.
        ([ALICE, BOB], "holds entries of no user of the inventory: bob"),
        # alice's key replaced in the inventory; the map holds her old one.
        ([("c" * 64, "alice")], "lacks the key of alice; holds entries of no user of the "),
        ([ALICE, ("x",)], "holds entries of no user of the inventory: (a line not `SHA256 NAME`)"),
    ],
)
def test_the_users_map_must_hold_exactly_the_inventorys_users(lines, said):
    from llamarig.checks import test_gateway

    text = "# Managed by llamarig\n" + "".join(" ".join(line) + "\n" for line in lines)
    host = GatewayHost({USERS_MAP: (text, "root", 0o600)}, {})
    check = test_gateway.test_users_map_holds_exactly_the_users
    if said is None:
        check(host, EXPECTED_USERS)
    else:
        with pytest.raises(AssertionError, match=re.escape(said)):
            check(host, EXPECTED_USERS)


@pytest.mark.parametrize(
    "owner, mode, said",
    [
        ("root", 0o600, None),
        ("root", 0o644, "is root's with mode 644"),
        ("haproxy", 0o600, "is haproxy's with mode 600"),
    ],
)
def test_the_gateways_secrets_are_roots_alone(owner, mode, said):
    from llamarig.checks import test_gateway

    path = "/etc/haproxy/llamarig/rig-key.map"
    host = GatewayHost({path: ("rigs Bearer x", owner, mode)}, {})
    if said is None:
        test_gateway.test_secret_is_roots_alone(host, {}, path)
    else:
        with pytest.raises(AssertionError, match=re.escape(said)):
            test_gateway.test_secret_is_roots_alone(host, {}, path)
    with pytest.raises(AssertionError, match="is missing: run the deploy"):
        test_gateway.test_secret_is_roots_alone(GatewayHost({}, {}), {}, path)


GATEWAY_DATA = {
    "gateway": {
        "host": "0.0.0.0",
        "port": 8443,
        "metrics": {"host": "127.0.0.1", "port": 8405},
        "backends": [
            {"model": "smollm2", "servers": [{"name": "rig1"}, {"name": "rig2"}]},
            {"model": "tiny-random", "servers": [{"name": "rig2"}]},
        ],
    }
}


def _ss(*addresses: str) -> str:
    return "".join(f"LISTEN 0      4096     {address}      0.0.0.0:*\n" for address in addresses)


@pytest.mark.parametrize(
    "host_address, listed, said",
    [
        ("0.0.0.0", _ss("0.0.0.0:8443"), None),
        ("::", _ss("[::]:8443"), None),
        ("::", _ss("*:8443"), None),  # a dual-stack socket, as some ss print it
        ("127.0.0.1", _ss("127.0.0.1%lo:8443"), None),
        ("127.0.0.1", _ss("0.0.0.0:8443"), "port 8443 is listened on at 0.0.0.0, gateway.host"),
        ("0.0.0.0", "", "nothing listens on port 8443: HAProxy's listener is not bound"),
        ("gw.example.lan", _ss("10.0.0.5:8443"), None),  # a name: where it resolved to
    ],
)
def test_the_gateway_listens_where_configured(host_address, listed, said):
    from llamarig.checks import test_gateway

    data = copy.deepcopy(GATEWAY_DATA)
    data["gateway"]["host"] = host_address
    host = GatewayHost({}, {"ss -Hltn 'sport = :8443'": listed})
    check = test_gateway.test_listens_where_configured
    if said is None:
        check(host, data, {}, "listener")
    else:
        with pytest.raises(AssertionError, match=re.escape(said)):
            check(host, data, {}, "listener")


def _stat(*rows: str) -> str:
    return "# pxname,svname,status\n" + "".join(f"{row}\n" for row in rows)


@pytest.mark.parametrize(
    "stat, said",
    [
        (_stat("model_0,rig1,DOWN", "model_0,rig2,UP", "model_1,rig2,UP 1/2"), None),
        (_stat("model_0,rig1,UP", "model_0,BACKEND,UP", "model_1,rig2,DOWN"),
         "the gateway sees no rig up for tiny-random"),
        ("", "HAProxy does not answer on /run/haproxy/admin.sock"),
    ],
)  # fmt: skip
def test_every_model_needs_a_rig_the_gateway_sees_up(stat, said):
    from llamarig.checks import test_gateway

    host = GatewayHost({}, {"echo 'show stat'": stat})
    check = test_gateway.test_every_model_has_a_rig_up
    if said is None:
        check(host, GATEWAY_DATA, {})
    else:
        with pytest.raises(AssertionError, match=re.escape(said)):
            check(host, GATEWAY_DATA, {})


def test_the_gateways_certificate_is_the_copy_clients_trust(tmp_path):
    import subprocess

    from llamarig.checks import test_gateway
    from llamarig.operations.gateway import fingerprint

    pems = []
    for name in ("one", "two"):
        made = subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj", "/CN=test",
             "-keyout", str(tmp_path / f"{name}.key"), "-out", str(tmp_path / f"{name}.crt")],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if made.returncode:
            pytest.skip(f"no openssl to make a certificate: {made.stderr}")
        pems.append((tmp_path / f"{name}.crt").read_text())
    served = GatewayHost({"/etc/haproxy/llamarig/tls.crt": (pems[0], "root", 0o644)}, {})
    check = test_gateway.test_certificate_is_the_copy_clients_trust
    copy_of = {"path": "inventory/gateway-certs/gw.crt", "fingerprint": fingerprint(pems[0])}
    check(served, {"certificate_copy": copy_of})
    other = {**copy_of, "fingerprint": fingerprint(pems[1])}
    with pytest.raises(AssertionError, match="clients that trust the copy refuse the gateway"):
        check(served, {"certificate_copy": other})
    with pytest.raises(AssertionError, match="gw.crt holds no PEM certificate"):
        check(served, {"certificate_copy": {**copy_of, "fingerprint": None}})
    with pytest.raises(pytest.skip.Exception, match="no copy of the certificate"):
        check(served, {"certificate_copy": None})


RIG_MODULES = [
    str(PROJECT / "llamarig" / "checks" / name)
    for name in ("test_rig.py", "test_gpu_memory.py", "test_secureboot.py")
]


def _suite_outcomes(tmp_path, expected: dict, *pytest_args: str) -> dict[str, str]:
    """Run (the part ``pytest_args`` choose of) the verify suite against this machine
    (local://) with ``expected`` as its data: each test's outcome, a skip's reason after
    `skipped: `."""
    import subprocess
    import sys
    import xml.etree.ElementTree as ElementTree

    from llamarig.checks.runner import SUITE

    (tmp_path / "rig.json").write_text(json.dumps(expected))
    report = tmp_path / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "--rootdir", str(SUITE), "--hosts=local://", "-p",
         "no:cacheprovider", f"--junitxml={report}", *pytest_args],
        cwd=PROJECT, env={**os.environ, "LLAMARIG_VERIFY_DATA": str(tmp_path / "rig.json")},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname').rpartition('.')[2]}::{case.get('name')}"
        verdicts = [f"{child.tag}: {child.get('message')}" for child in case]
        outcomes[name] = verdicts[0] if verdicts else "passed"
    return outcomes


def test_a_gateway_alone_skips_every_check_of_a_rig_saying_why(tmp_path):
    """The suite on a gateway alone's expectations: each check of a rig skips with the
    reason (none runs its commands, none fails); only the host's own checks run."""
    from llamarig.checks.conftest import GATEWAY_ONLY

    data = load_inventory(PROJECT / "inventory" / "example-5080-3090.yml").hosts["rig1"].data
    gateway_alone = {**copy.deepcopy(data), "role": "gateway"}  # its driver: nvidia-repo
    gateway_alone["expect"]["uefi"] = None
    expected = {"name": "gw", "data": gateway_alone, "derived": None, "gateway": None}
    outcomes = {
        name.partition("[")[0]: said
        for name, said in _suite_outcomes(tmp_path, expected, *RIG_MODULES).items()
    }
    # Checks of any host (this machine's OS), and those that skip by the role, for their own.
    generic = {
        "test_rig::test_os_is_supported",
        "test_rig::test_boot_mode_and_secure_boot_reported",
    }
    by_role = {"test_rig::test_expected_answer", "test_rig::test_rpc_worker_unit_active",
               "test_rig::test_rpc_workers_reachable_from_the_head",
               "test_rig::test_head_is_connected_to_its_workers"}  # fmt: skip
    assert all(outcomes[name].startswith("skipped: ") for name in by_role), outcomes
    of_a_rig = {name: said for name, said in outcomes.items() if name not in generic | by_role}
    assert len(of_a_rig) >= 25 and set(of_a_rig.values()) == {f"skipped: {GATEWAY_ONLY}"}, outcomes


def test_the_gateway_checks_skip_on_a_host_without_one(tmp_path):
    from llamarig.checks.runner import SUITE

    expected = {"name": "rig1", "data": {"role": "standalone"}, "gateway": None}
    outcomes = _suite_outcomes(tmp_path, expected, str(SUITE / "test_gateway.py"))
    assert len(outcomes) == 9, outcomes
    assert set(outcomes.values()) == {
        "skipped: this host runs no gateway (it is not in the `gateways` group)"
    }
