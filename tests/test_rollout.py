"""`llamarig rollout`'s order, from the inventory alone (no host is reached): first the builds
of every rig and builder (made once and kept, nothing that serves changed), then the fronted rigs
in batches that never take more than `gateway.max_unavailable` rigs of one model out of
rotation at once, then the gateways, then the hosts no gateway fronts (a rig the gateway stops
fronting drops its key only once the gateway stopped sending it requests); and the command each
step runs (the deploy, limited to the step's hosts)."""

from __future__ import annotations

import copy

import yaml

from llamarig.config import load_inventory
from llamarig.serving.rollout import Step, deploy_command, step_env, steps
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
        ("rig-a", "rig-b", "rig-c", "rig-solo"),
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
    assert [step.hosts for step in steps(inventory)][1:] == [
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
    assert [step.hosts for step in steps(inventory)][1:] == [
        ("head", "worker"),
        ("rig-a",),
        ("rig-b",),
        ("gw",),
    ]


def test_the_builds_come_first_and_only_they_run_with_the_builds_only_switch(tmp_path, monkeypatch):
    """Without the first step each rig's own run would be a run of one rig: it would compile
    its key's build itself (out of rotation), and no other rig would get it."""
    document = team(tmp_path)
    document["all"]["children"]["builders"] = {
        "hosts": {
            "bd": {
                "role": "builder",
                "ssh": {"host": "192.0.2.9", "user": "root"},
                "llama_cpp": {"backend": "cpu"},
            }
        }
    }
    plan = steps(load(tmp_path, document))
    assert plan[0].builds_only and set(plan[0].hosts) == {"rig-a", "rig-b", "bd"}
    assert "gw" not in plan[0].hosts
    assert not any(step.builds_only for step in plan[1:])
    assert all("bd" not in step.hosts for step in plan[1:])  # a builder's run is its builds
    monkeypatch.setenv("LLAMARIG_BUILDS_ONLY", "1")  # left over in the user's shell
    assert step_env(plan[0])["LLAMARIG_BUILDS_ONLY"] == "1"
    assert "LLAMARIG_BUILDS_ONLY" not in step_env(plan[1])


def test_no_builds_step_when_no_rig_shares_its_build(tmp_path):
    document = team(tmp_path)
    for host in hosts_of(document, "rigs").values():
        host.setdefault("llama_cpp", {})["share_builds"] = False
    plan = steps(load(tmp_path, document))
    assert [step.hosts for step in plan] == [("rig-a",), ("rig-b",), ("gw",)]
