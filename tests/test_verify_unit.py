"""`llamarig verify` glue: the ssh configuration it hands testinfra and the expectations file."""

import json
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
