"""Several boxes: roles, the RPC worker's settings, the head's --rpc list taken from the
inventory, group defaults from group_data/GROUP.yml, and the rendered worker unit."""

import pytest

from llamarig.config import ConfigError, load_inventory
from llamarig.planner import render
from llamarig.planner.plan import plan_host
from tests.conftest import PROJECT

PAIR = """
all:
  vars:
    driver: {{source: none}}
    cuda: {{source: none}}
    llama_cpp: {{backend: cpu}}
  children:
    rpc_heads:
      hosts:
        head:
          ssh: {{host: 10.0.0.10}}
          rpc: {{workers: [{workers}]}}
          model: {{path: /srv/m.gguf}}
          server: {{ctx: 4096, gpu_layers: 20{head_extra}}}
    rpc_workers:
      hosts:
        worker1:
          ssh: {{host: 10.0.0.11}}
          rpc: {{host: {worker_host}, port: 50052}}
        worker2:
          ssh: {{host: 10.0.0.12}}
          rpc: {{host: "fd00::12", port: 50053, threads: 8, cache: true}}
"""


def pair(write_inventory, workers="worker1, worker2", worker_host="10.0.0.11", head_extra=""):
    return write_inventory(
        PAIR.format(workers=workers, worker_host=worker_host, head_extra=head_extra)
    )


def problems(path) -> str:
    with pytest.raises(ConfigError) as error:
        load_inventory(path)
    return "\n".join(error.value.problems)


def test_roles_come_from_group_data_and_endpoints_from_the_workers(write_inventory):
    inventory = load_inventory(pair(write_inventory))
    head = inventory.hosts["head"].data
    assert head["role"] == "rpc-head" and head["server"]["split_mode"] == "layer"
    assert inventory.hosts["worker1"].data["role"] == "rpc-worker"
    assert head["rpc"]["endpoints"] == ["10.0.0.11:50052", "[fd00::12]:50053"]
    args = render.server_args(head)
    assert args[args.index("--rpc") + 1] == "10.0.0.11:50052,[fd00::12]:50053"
    # A CPU head still offloads layers: to the RPC devices.
    assert args[args.index("-ngl") + 1] == "20"
    assert render.cmake_options(head)["GGML_RPC"] == "ON"
    assert set(inventory.groups) >= {"rpc_heads", "rpc_workers"}


def test_worker_builds_and_runs_only_ggml_rpc_server(write_inventory):
    inventory = load_inventory(pair(write_inventory))
    worker = inventory.hosts["worker2"].data
    assert render.build_targets(worker) == ["ggml-rpc-server"]
    assert render.cmake_options(worker)["GGML_RPC"] == "ON"
    assert render.rpc_server_args(worker) == [
        "/opt/llamarig/current/bin/ggml-rpc-server", "-H", "fd00::12", "-p", "50053",
        "-t", "8", "-c",
    ]  # fmt: skip
    unit = render.render_rpc_unit(worker)
    assert "ExecStart=/opt/llamarig/current/bin/ggml-rpc-server -H fd00::12 -p 50053" in unit
    for hardening in ("DynamicUser=yes", "ProtectSystem=strict", "NoNewPrivileges=yes"):
        assert hardening in unit
    assert render.build_id(worker) != render.build_id(inventory.hosts["head"].data)
    plan = plan_host("worker2", worker, None)
    assert "ggml-rpc-server: /opt/llamarig/current/bin/ggml-rpc-server" in plan.report()
    head_plan = plan_host("head", inventory.hosts["head"].data, None)
    assert "the network between hosts is the bottleneck" in head_plan.report()


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"worker_host": "0.0.0.0"}, "hosts.worker1.rpc.host: '0.0.0.0' would expose"),
        ({"worker_host": "null"}, "hosts.worker1.rpc.host: is missing"),
        (
            {"workers": "worker1, wroker2"},
            "names `wroker2`, which is not a host of this inventory (did you mean",
        ),
        ({"workers": ""}, "hosts.head.rpc.workers: is empty"),
        ({"head_extra": ", split_mode: tensor"}, "`tensor` does not span hosts"),
        ({"head_extra": ", tensor_split: auto"}, "`auto` plans GPU memory across hosts: it needs"),
        ({"head_extra": ", split_mode: none"}, "`none` does not span hosts"),
    ],
)
def test_bad_rpc_settings_are_refused_by_name(write_inventory, changes, words):
    assert words in problems(pair(write_inventory, **changes))


def test_a_head_cannot_use_a_standalone_box_nor_set_endpoints(write_inventory):
    text = PAIR.format(workers="solo", worker_host="10.0.0.11", head_extra="")
    text += """
    others:
      hosts:
        solo:
          ssh: {host: 10.0.0.13}
          model: {path: /srv/m.gguf}
"""
    assert "names `solo`, which is a `standalone` host" in problems(write_inventory(text))
    text = PAIR.format(workers="worker1", worker_host="10.0.0.11", head_extra="").replace(
        "rpc: {workers: [worker1]}", "rpc: {workers: [worker1], endpoints: ['1.2.3.4:1']}"
    )
    assert "hosts.head.rpc.endpoints: is derived from rpc.workers" in problems(
        write_inventory(text)
    )


def test_each_worker_knows_the_head_server_it_drains_and_restarts(write_inventory):
    inventory = load_inventory(
        pair(
            write_inventory,
            head_extra=', host: "::1", port: 8081, drain_timeout: 30, http_timeouts: {probe: 9}',
        )
    )
    for name in ("worker1", "worker2"):
        assert inventory.hosts[name].data["rpc"]["head"] == {
            "name": "head",
            "url": "http://[::1]:8081",  # asked on the head
            "service": "llama-server.service",
            "drain_timeout": 30,
            "start_timeout": 600,  # the head's default: it restarts after the worker
            # Each look at the head's /slots is bounded by the head's own bounds.
            "http_timeouts": {"connect": 5, "probe": 9, "answer": 120, "generation": 600},
        }
    assert "head" not in inventory.hosts["head"].data["rpc"]
    # A worker no head names has nothing to drain.
    alone = load_inventory(pair(write_inventory, workers="worker1"))
    assert "head" not in alone.hosts["worker2"].data["rpc"]
    text = PAIR.format(workers="worker1", worker_host="10.0.0.11", head_extra="").replace(
        "rpc: {host: 10.0.0.11, port: 50052}",
        "rpc: {host: 10.0.0.11, port: 50052, head: {name: head}}",
    )
    assert (
        "hosts.worker1.rpc.head: is derived from the head whose rpc.workers names this worker"
        in problems(write_inventory(text))
    )


def test_the_rpc_sandbox_inventory_plans():
    inventory = load_inventory(PROJECT / "inventory" / "sandbox-rpc.yml")
    head = inventory.hosts["rpc-head"].data
    assert head["rpc"]["endpoints"] == ["127.0.0.1:29052"]
    assert inventory.hosts["rpc-worker"].data["rpc"]["host"] == "127.0.0.1"


def test_a_cuda_head_does_not_narrow_its_devices_to_local_gpus(write_inventory):
    text = PAIR.format(workers="worker1", worker_host="10.0.0.11", head_extra="")
    text = text.replace(
        "          rpc: {workers: [worker1]}\n",
        "          rpc: {workers: [worker1]}\n"
        "          llama_cpp: {backend: cuda}\n"
        "          driver: {source: nvidia-repo}\n"
        "          cuda: {source: nvidia-repo}\n"
        "          gpus: [{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, "
        'compute_capability: "8.6", pci_bus_id: "0000:01:00.0"}]\n',
    )
    head = load_inventory(write_inventory(text)).hosts["head"].data
    args = render.server_args(head)
    assert "--rpc" in args and "-dev" not in args


def test_a_cuda_head_plans_memory_across_its_workers_gpus(write_inventory, tmp_path):
    """Workers' declared GPUs join the head's in one layer-mode plan, in llama.cpp's order."""
    from pathlib import Path

    from llamarig.model.gguf import read_gguf_header
    from tests.ggufmodels import write_llama

    model = write_llama(
        Path(tmp_path / "m.gguf"), n_layer=32, n_embd=4096, n_ff=14336, n_head=32,
        n_head_kv=8, n_vocab=128256, context_length=131072, weight_type="q8_0",
    )  # fmt: skip
    gpu = '{{name: NVIDIA GeForce RTX {0}, vram_mib: {1}, compute_capability: "8.6"}}'
    text = PAIR.format(workers="worker1", worker_host="10.0.0.11", head_extra="")
    text = (
        text.replace(
            "          rpc: {workers: [worker1]}\n",
            "          rpc: {workers: [worker1]}\n"
            "          llama_cpp: {backend: cuda}\n"
            "          driver: {source: nvidia-repo}\n"
            "          cuda: {source: nvidia-repo}\n"
            f"          gpus: [{gpu.format(3090, 24576)}]\n",
        )
        .replace("gpu_layers: 20", "gpu_layers: all, ctx: auto, tensor_split: auto")
        .replace("server: {ctx: 4096, ", "server: {")
    )
    text = text.replace(
        "          rpc: {host: 10.0.0.11, port: 50052}\n",
        "          rpc: {host: 10.0.0.11, port: 50052}\n"
        f"          gpus: [{gpu.format(3060, 12288)}]\n",
    )
    head = load_inventory(write_inventory(text)).hosts["head"].data
    assert [g["worker"] for g in head["rpc"]["worker_gpus"]] == ["worker1"]
    plan = plan_host("head", head, read_gguf_header(model.read_bytes(), name=str(model)))
    assert plan.fits, plan.report()
    names = [device.name for device in plan.memory.devices]
    assert names == ["NVIDIA GeForce RTX 3060 (worker1)", "NVIDIA GeForce RTX 3090"]
    share_worker, share_head = plan.resolved["server"]["tensor_split"]
    assert share_worker < share_head  # the 12 GiB card gets less than the 24 GiB one
    assert plan.resolved["server"]["ctx"] != "auto"
    assert "the network between hosts is the bottleneck" in plan.report()
    wrong = text.replace("tensor_split: auto", "tensor_split: [1, 1, 1]")
    assert "has 3 shares for 2 devices: the workers' 1 GPUs first" in problems(
        write_inventory(wrong)
    )
