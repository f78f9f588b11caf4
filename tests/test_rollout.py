"""`llamarig rollout`'s order, from the inventory alone (no host is reached): the fronted rigs
in batches that never take more than `gateway.max_unavailable` rigs of one model out of
rotation at once, then the gateways, then the hosts no gateway fronts (a rig the gateway stops
fronting drops its key only once the gateway stopped sending it requests); and the command each
step runs (the deploy, limited to the step's hosts)."""

from __future__ import annotations

import copy

import yaml

from llamarig.config import load_inventory
from llamarig.serving.rollout import Step, deploy_command, steps
from tests.test_gateway_config import gw, hosts_of, rig, team


def load(tmp_path, document):
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(document))
    return load_inventory(path)


def with_third_rig(document: dict) -> dict:
    """A third rig serving `chat` (rig-a's file), and one the gateway does not front."""
    third = copy.deepcopy(rig(document))
    third["ssh"]["host"] = "192.0.2.3"
    hosts_of(document, "rigs")["rig-c"] = third
    alone = copy.deepcopy(rig(document))
    alone["ssh"]["host"] = "192.0.2.4"
    document["all"]["children"]["solo"] = {"hosts": {"rig-solo": alone}}
    return document


def test_one_rig_at_a_time_then_the_gateway(tmp_path):
    inventory = load(tmp_path, with_third_rig(team(tmp_path)))
    assert [step.hosts for step in steps(inventory)] == [
        ("rig-a",),
        ("rig-b",),
        ("rig-c",),
        ("gw",),
        ("rig-solo",),
    ]


def test_max_unavailable_two_takes_two_rigs_of_a_model_at_once(tmp_path):
    document = with_third_rig(team(tmp_path))
    gw(document)["max_unavailable"] = 2
    inventory = load(tmp_path, document)
    assert [step.hosts for step in steps(inventory)] == [
        ("rig-a", "rig-b"),
        ("rig-c",),
        ("gw",),
        ("rig-solo",),
    ]


def test_each_step_is_the_deploy_limited_to_its_hosts():
    command = deploy_command(Step(("rig-a", "rig-b"), "x").hosts, ["--dry"])
    assert command[1:] == [
        "-m", "pyinfra", "-y", "--limit", "rig-a", "--limit", "rig-b", "--dry",
        "inventory.py", "deploy.py",
    ]  # fmt: skip


def test_an_rpc_head_changes_with_its_workers_out_of_rotation(tmp_path):
    """A worker's restart restarts its head: the worker changes in its head's step."""
    document = team(tmp_path)
    head = copy.deepcopy(rig(document))
    head["ssh"]["host"] = "192.0.2.5"
    head.update(role="rpc-head", rpc={"workers": ["worker"]})
    hosts_of(document, "rigs")["head"] = head
    document["all"]["children"]["workers"] = {
        "hosts": {
            "worker": {
                "role": "rpc-worker",
                "ssh": {"host": "192.0.2.6", "user": "root"},
                "llama_cpp": {"backend": "cpu"},
                "rpc": {"host": "10.0.1.6", "port": 29052},
            }
        }
    }
    inventory = load(tmp_path, document)
    # The hosts in the inventory's order (yaml.safe_dump sorted them: head first).
    assert [step.hosts for step in steps(inventory)] == [
        ("head", "worker"),
        ("rig-a",),
        ("rig-b",),
        ("gw",),
    ]
