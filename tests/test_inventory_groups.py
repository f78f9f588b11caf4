"""Ansible's group semantics in the inventory loader (docs/inventory.md, "How settings cascade").

The rules, from Ansible's inventory guide (docs.ansible.com/ansible/latest/inventory_guide/
intro_inventory.html: "How variables are merged", "Inheriting variable values") and the code of
ansible-core 2.19 (inventory/helpers.py `sort_groups`, inventory/group.py, inventory/host.py,
inventory/data.py `reconcile_inventory`, plugins/inventory/yaml.py):

R1  A host gets the vars of every group it is in: `all` first, then parent groups, then child
    groups ("A child group's variables will have higher precedence (override) than a parent
    group's variables"), then its own vars, which win.
R2  A group's depth is its longest path from `all` (`Group.add_child_group`: a child's depth is
    max(parent's depth + 1, its depth)), so a group under two parents sorts below the deeper.
R3  Groups of one depth merge in ASCII order of their names, the later winning ("an a_group will
    be merged with b_group and b_group vars that match will overwrite the ones in a_group"),
    unless `ansible_group_priority` (default 1, "the larger the number, the later it will be
    merged") reorders them; depth still comes first (`sort_groups`: depth, priority, name).
R4  A host listed in several places is one host: its vars are merged entry by entry in document
    order, the later winning (`Host.set_variable`), wherever it is first listed and whether or
    not it has settings there; it is a member of every group it is listed in.
R5  A group written in several places is one group, with the vars, hosts and children of each;
    `ungrouped` holds the hosts that are in no group but `all`.
R6  Mappings merge key by key, anything else replaces: Ansible with `hash_behaviour = merge`
    (Ansible's default, `replace`, would drop a group's whole `server:` once a host sets one
    `server:` key; llamarig always merges mappings).

The expected values below are written by hand from these rules. ANSIBLE_LISTINGS is
`ansible-inventory -i CASE.yml --list` (ANSIBLE_HASH_BEHAVIOUR=merge) for each case, made once
with ansible-core 2.19.14 by `python -m tests.test_inventory_groups` with ansible-inventory on
PATH (ansible-core is not a dependency of llamarig); the loader is compared with it, and with a
live ansible-inventory when one is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from llamarig.config import ConfigError, load_inventory
from tests.conftest import offline

ANSIBLE_LISTINGS = Path(__file__).with_name("ansible_inventory_groups.json")

# What every host of the cases needs to be a valid rig; no setting below is a group marker.
COMMON = """\
    driver: {source: none}
    cuda: {source: none}
    llama_cpp: {backend: cpu}
    model: {path: /srv/m.gguf}
"""

CASES = {
    # R1, R2: all < parent < mid, zz_two < leaf; `leaf` is written first under `all` (depth 1)
    # but is also under parent.mid, so its depth is 3 and it beats zz_two (depth 2).
    "depth": f"""\
all:
  vars:
{COMMON}    server: {{env: {{SET_BY: all, FROM_ALL: "yes"}}}}
  children:
    leaf:
      vars: {{server: {{env: {{SET_BY: leaf, FROM_LEAF: "yes"}}}}}}
      hosts:
        leafy: {{ssh: {{host: 10.0.0.5}}}}
    parent:
      vars: {{server: {{env: {{SET_BY: parent, FROM_PARENT: "yes"}}, parallel: 2}}}}
      children:
        mid:
          children:
            leaf:
        zz_two:
          vars: {{server: {{env: {{SET_BY: zz_two, FROM_ZZ: "yes"}}}}}}
          hosts:
            leafy:
            plain: {{ssh: {{host: 10.0.0.6}}, server: {{env: {{SET_BY: host}}}}}}
""",
    # R3, R4: groups of depth 1 by name (a_side < b_side < late) or by priority; twin's two
    # entries merge, the later (a_side's) port winning; early is listed bare first, under
    # `all`, and gets its settings in `late`.
    "siblings": f"""\
all:
  vars:
{COMMON}    server: {{env: {{SET_BY: all}}}}
  hosts:
    early:
  children:
    b_side:
      vars: {{server: {{env: {{SET_BY: b_side, FROM_B: "yes"}}, threads: 2}}}}
      hosts:
        twin: {{ssh: {{host: 10.0.0.3}}, server: {{port: 8081, ubatch: 256}}}}
        early:
    a_side:
      vars: {{server: {{env: {{SET_BY: a_side, FROM_A: "yes"}}, threads: 1}}}}
      hosts:
        twin: {{server: {{port: 8083}}}}
    ranked:
      vars:
        ansible_group_priority: 10
        server: {{env: {{SET_BY: ranked}}}}
      hosts:
        first_rank: {{ssh: {{host: 10.0.0.7}}}}
    z_plain:
      vars: {{server: {{env: {{SET_BY: z_plain}}}}}}
      hosts:
        first_rank:
    late:
      hosts:
        early: {{ssh: {{host: 10.0.0.4}}, server: {{env: {{SET_BY: host}}}}}}
        twin: {{server: {{threads: 4}}}}
""",
    # R5: `shared` is written twice (under all and under outer: depth 2), one group with both
    # vars for both hosts; lone is only under all, so it is in `ungrouped`, which has vars here.
    "one-group": f"""\
all:
  vars:
{COMMON}  hosts:
    lone: {{ssh: {{host: 10.0.0.1}}}}
  children:
    ungrouped:
      vars: {{server: {{env: {{SET_BY: ungrouped}}}}}}
    shared:
      vars: {{server: {{env: {{FIRST: "yes"}}}}}}
      hosts:
        one: {{ssh: {{host: 10.0.0.8}}}}
    outer:
      children:
        shared:
          vars: {{server: {{env: {{SECOND: "yes"}}}}}}
          hosts:
            two: {{ssh: {{host: 10.0.0.9}}}}
""",
}

# Per case and host: the groups in merge order, then the values the rules give.
EXPECTED = {
    "depth": {
        "leafy": (
            ["all", "parent", "mid", "zz_two", "leaf"],
            {
                ("server", "env"): {
                    "SET_BY": "leaf", "FROM_ALL": "yes", "FROM_PARENT": "yes",
                    "FROM_ZZ": "yes", "FROM_LEAF": "yes",
                },
                ("server", "parallel"): 2,
            },
        ),
        "plain": (
            ["all", "parent", "zz_two"],
            {
                ("server", "env"): {
                    "SET_BY": "host", "FROM_ALL": "yes", "FROM_PARENT": "yes", "FROM_ZZ": "yes",
                },
                ("server", "parallel"): 2,
            },
        ),
    },
    "siblings": {
        "early": (
            ["all", "b_side", "late"],
            {
                ("server", "env"): {"SET_BY": "host", "FROM_B": "yes"},
                ("server", "threads"): 2,
                ("ssh", "host"): "10.0.0.4",
            },
        ),
        "twin": (
            ["all", "a_side", "b_side", "late"],
            {
                ("server", "env"): {"SET_BY": "b_side", "FROM_A": "yes", "FROM_B": "yes"},
                ("server", "threads"): 4,
                ("server", "port"): 8083,
                ("server", "ubatch"): 256,
            },
        ),
        "first_rank": (["all", "z_plain", "ranked"], {("server", "env"): {"SET_BY": "ranked"}}),
    },
    "one-group": {
        "lone": (["all", "ungrouped"], {("server", "env"): {"SET_BY": "ungrouped"}}),
        "one": (["all", "outer", "shared"], {("server", "env"): {"FIRST": "yes", "SECOND": "yes"}}),
        "two": (["all", "outer", "shared"], {("server", "env"): {"FIRST": "yes", "SECOND": "yes"}}),
    },
}  # fmt: skip


def value_at(data: dict, key_path: tuple):
    for key in key_path:
        data = data[key]
    return data


def load_case(name: str, directory: Path):
    path = directory / f"{name}.yml"
    path.write_text(CASES[name])
    return load_inventory(path)


@pytest.mark.parametrize("name", CASES)
def test_cascade_follows_ansible_rules(name, tmp_path):
    inventory = load_case(name, tmp_path)
    assert set(inventory.hosts) == set(EXPECTED[name])
    for host_name, (groups, values) in EXPECTED[name].items():
        host_config = inventory.hosts[host_name]
        assert host_config.groups == groups, host_name
        for key_path, expected in values.items():
            assert value_at(host_config.data, key_path) == expected, (host_name, key_path)


def test_groups_hold_the_hosts_of_their_children(tmp_path):
    """R5: an Ansible group's hosts include its children's (pyinfra's --limit GROUP and the
    inventory's group lists follow that); `ungrouped` only hosts of no other group."""
    assert load_case("one-group", tmp_path).groups == {
        "ungrouped": ["lone"],
        "shared": ["one", "two"],
        "outer": ["one", "two"],
    }
    groups = load_case("siblings", tmp_path).groups
    assert "ungrouped" not in groups  # early is listed under `all` but also in b_side and late
    assert groups["late"] == ["early", "twin"]


def test_group_data_sits_under_its_groups_inventory_vars(write_inventory):
    """group_data/GROUP.yml is a group's documented defaults: merged at the group's place in the
    cascade, right under that group's inventory vars (so it beats a shallower group's vars,
    and the group's own vars beat it). The origins say which file set each key."""
    path = write_inventory(
        f"""\
all:
  vars:
{COMMON}  children:
    lab:
      vars: {{role: standalone, server: {{env: {{SET_BY: lab}}}}}}
      children:
        rpc_workers:
          vars: {{server: {{env: {{SET_BY: rpc_workers}}}}}}
          hosts:
            worker: {{ssh: {{host: 10.0.0.11}}, rpc: {{host: 10.0.0.11, port: 50052}}}}
    rpc_heads:
      vars: {{server: {{split_mode: layer}}}}
      hosts:
        head: {{ssh: {{host: 10.0.0.10}}, rpc: {{workers: [worker]}}, server: {{gpu_layers: 20}}}}
"""
    )
    inventory = load_inventory(path)
    worker, head = inventory.hosts["worker"], inventory.hosts["head"]
    assert worker.groups == ["all", "lab", "rpc_workers"]
    # rpc_workers.yml (depth 2) over lab's vars (depth 1), its own vars over both.
    assert worker.data["role"] == "rpc-worker"
    assert worker.origins[("role",)] == "group_data/rpc_workers.yml"
    assert worker.data["server"]["env"] == {"SET_BY": "rpc_workers"}
    assert worker.origins[("server", "env", "SET_BY")] == str(path)
    assert head.origins[("role",)] == "group_data/rpc_heads.yml"
    assert head.origins[("server", "split_mode")] == str(path)
    assert worker.origins[()] == head.origins[()] == str(path)


def problems_of(write_inventory, text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_inventory(write_inventory(text))
    return caught.value.problems


def test_all_inside_a_group_and_a_bad_priority_are_refused(write_inventory):
    text = f"""\
all:
  vars:
{COMMON}  children:
    rigs:
      vars: {{ansible_group_priority: high}}
      hosts:
        rig1: {{ssh: {{host: 10.0.0.2}}}}
      children:
        all:
"""
    path = write_inventory(text)
    problems = problems_of(write_inventory, text)
    assert len(problems) == 2, problems
    assert problems[0].startswith(f"{path}: all.children.rigs.vars.ansible_group_priority: ")
    assert "is a string; it must be an integer" in problems[0]
    assert problems[1].startswith(f"{path}: all.children.rigs.children.all: ")
    assert "`all` holds every group and cannot be the child of one" in problems[1]


def test_a_loop_of_groups_is_refused_wherever_it_closes(write_inventory):
    text = f"""\
all:
  vars:
{COMMON}  children:
    outer:
      children:
        inner:
          hosts:
            rig1: {{ssh: {{host: 10.0.0.2}}}}
    inner:
      children:
        outer:
"""
    (problem,) = problems_of(write_inventory, text)
    assert ": all.children.inner.children.outer: group `outer` contains `inner` already" in problem
    assert "a loop" in problem


# Checked against Ansible itself: ansible-inventory's view of each case.


def ansible_groups_and_vars(listing: dict) -> dict[str, tuple[set[str], dict]]:
    """Each host of an `ansible-inventory --list` output: its groups (ancestors included, as
    Ansible's `host.get_groups()`) and its merged vars."""
    groups = {name: entry for name, entry in listing.items() if name != "_meta"}
    parents: dict[str, set[str]] = {}
    for name, entry in groups.items():
        for child in entry.get("children", []):
            parents.setdefault(child, set()).add(name)
    seen = {}
    for host_name, host_vars in listing["_meta"]["hostvars"].items():
        member_of = {"all"}
        stack = [name for name, entry in groups.items() if host_name in entry.get("hosts", [])]
        while stack:
            name = stack.pop()
            if name not in member_of:
                member_of.add(name)
                stack.extend(parents.get(name, ()))
        seen[host_name] = (member_of, host_vars)
    return seen


def leaves(data: dict, prefix: tuple = ()):
    for key, value in data.items():
        if isinstance(value, dict) and value:
            yield from leaves(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def assert_loader_agrees_with(listing: dict, inventory) -> None:
    ansible_view = ansible_groups_and_vars(listing)
    assert set(ansible_view) == set(inventory.hosts)
    for host_name, (member_of, host_vars) in ansible_view.items():
        host_config = inventory.hosts[host_name]
        assert set(host_config.groups) == member_of, host_name
        assert host_vars, host_name
        for key_path, value in leaves(host_vars):
            assert value_at(host_config.data, key_path) == value, (host_name, key_path)


@pytest.mark.parametrize("name", CASES)
def test_loader_agrees_with_recorded_ansible_inventory(name, tmp_path):
    listings = json.loads(ANSIBLE_LISTINGS.read_text())
    assert set(listings) == set(CASES)  # regenerate the file when a case changes
    assert_loader_agrees_with(listings[name], load_case(name, tmp_path))


def ansible_inventory() -> str | None:
    beside = Path(sys.executable).with_name("ansible-inventory")
    return str(beside) if beside.is_file() else shutil.which("ansible-inventory")


def ansible_listing(executable: str, path: Path) -> dict:
    home = path.parent / "ansible-home"
    env = {
        **os.environ,
        "ANSIBLE_HASH_BEHAVIOUR": "merge",  # R6
        "ANSIBLE_INVENTORY_ENABLED": "yaml",
        "ANSIBLE_HOME": str(home),
        "ANSIBLE_LOCAL_TEMP": str(home / "tmp"),
    }
    result = subprocess.run(
        offline([executable, "-i", str(path), "--list"]),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)


@pytest.mark.parametrize("name", CASES)
def test_loader_agrees_with_live_ansible_inventory(name, tmp_path):
    executable = ansible_inventory()
    if executable is None:
        pytest.skip(
            "ansible-inventory is not installed (pip install ansible-core to compare live); "
            f"the recorded listings in {ANSIBLE_LISTINGS.name} are still compared"
        )
    inventory = load_case(name, tmp_path)
    listing = ansible_listing(executable, tmp_path / f"{name}.yml")
    assert_loader_agrees_with(listing, inventory)
    recorded = json.loads(ANSIBLE_LISTINGS.read_text())[name]
    assert ansible_groups_and_vars(listing) == ansible_groups_and_vars(recorded)


if __name__ == "__main__":  # rewrite ANSIBLE_LISTINGS with the ansible-inventory on PATH
    if ansible_inventory() is None:
        sys.exit("ansible-inventory not found: pip install ansible-core (in a scratch venv)")
    with tempfile.TemporaryDirectory() as scratch:
        listings = {}
        for case_name, text in CASES.items():
            case_path = Path(scratch) / f"{case_name}.yml"
            case_path.write_text(text)
            listings[case_name] = ansible_listing(ansible_inventory(), case_path)
    ANSIBLE_LISTINGS.write_text(json.dumps(listings, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize(
    "host_name",
    ["'@local'", "'@chroot/tmp'", "'../x'", "'-x'", "'.hidden'", '"rig\\u200b1"', "'a/b'"],
)
def test_a_host_name_that_picks_a_connector_or_a_path_is_refused(write_inventory, host_name):
    """pyinfra reads `@local` or `@chroot/DIR` in a host's name as the connector to use, and
    the tuned file of a host named `../x` would be `tuned/../x.yml`: a name is a name."""
    text = f"""\
all:
  vars:
{COMMON}  hosts:
    {host_name}: {{ssh: {{host: 192.0.2.10}}}}
"""
    path = write_inventory(text)
    (problem,) = problems_of(write_inventory, text)
    assert problem.startswith(f"{path}: all.hosts: "), problem
    assert "is not a host name" in problem
    assert "`ssh.host`" in problem
