"""The inventory: Ansible's YAML layout read group by group, each host's settings cascaded
from the defaults through its groups (with the file that set each key), then every host and
the inventory as a whole checked, and the derived settings written."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llamarig import PROJECT_DIR
from llamarig.config.builders import builder_problems
from llamarig.config.crosshost import (
    rpc_inventory_problems,
    rpc_topology_problems,
    shared_machine_problems,
)
from llamarig.config.derived import derive_fleet_architectures, derive_rpc
from llamarig.config.gateways import derive_gateways, gateway_problems
from llamarig.config.hosts import HostConfig, Inventory
from llamarig.config.loader import defaults, load_yaml, shape_problem
from llamarig.config.paths import DEFAULTS_PATH, inventory_path
from llamarig.config.problems import ConfigError, did_you_mean, json_type
from llamarig.config.shapes import host_name_problem
from llamarig.config.validation import validate_host


def deep_merge(base: dict, override: dict) -> dict:
    """Merge ``override`` into a copy of ``base``; mappings merge, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def record_origins(data: Any, origin: str, prefix: tuple, origins: dict[tuple, str]) -> None:
    origins[prefix] = origin
    if isinstance(data, dict):
        for key, value in data.items():
            record_origins(value, origin, (*prefix, key), origins)


# `llamarig tune` writes its winner to tuned/HOST.yml beside the inventory; the loader merges it
# above the host's groups and under the host's own settings, so what the user set still wins.
TUNED_DIR = "tuned"
TUNED_SERVER_KEYS = (
    "split_mode",
    "tensor_split",
    "batch",
    "ubatch",
    "threads",
    "spec",
    "parallel",
    "backend_sampling",
    "kv_unified",
)
# Of `server.spec`, tune measures the draft length, and `--for throughput` may turn drafting
# off under load (type [none]); which types to draft with stays the user's choice.
TUNED_SPEC_KEYS = ("draft_max", "type")
TUNED_SPEC_TYPE = ["none"]


def tuned_path(inventory: Path, host: str) -> Path:
    return inventory.parent / TUNED_DIR / f"{host}.yml"


def _tuned_settings(file: Path, problems: list[str]) -> dict:
    """The settings of a tuned file (empty when there is none); its values are checked with
    the host's, by the schema, and named by this file."""
    if not file.is_file():
        return {}
    document = load_yaml(file)
    keys = ", ".join(TUNED_SERVER_KEYS)
    if not isinstance(document, dict) or set(document) != {"server"}:
        problems.append(
            f"{file}: must hold `server:` with {keys} (written by `llamarig tune`); run "
            "`llamarig tune` again or delete the file"
        )
        return {}
    server = document["server"]
    if not isinstance(server, dict):
        problems.append(f"{file}: server: is {json_type(server)}; a mapping of {keys}")
        return {}
    for key in server:
        if key not in TUNED_SERVER_KEYS:
            problems.append(
                f"{file}: server.{key}: is not a setting `llamarig tune` writes ({keys}); "
                "set it in the inventory instead"
            )
    settings = {k: v for k, v in server.items() if k in TUNED_SERVER_KEYS}
    spec = settings.get("spec")
    if isinstance(spec, dict):
        for key in [key for key in spec if key not in TUNED_SPEC_KEYS]:
            problems.append(
                f"{file}: server.spec.{key}: is not a setting `llamarig tune` writes (of spec "
                "only draft_max, and type [none]); set it in the inventory instead"
            )
            del spec[key]
        if "type" in spec and spec["type"] != TUNED_SPEC_TYPE:
            problems.append(
                f"{file}: server.spec.type: is {spec['type']!r}; tune writes only "
                f"{TUNED_SPEC_TYPE} (drafting off under load): set the types in the inventory "
                "instead"
            )
            del spec["type"]
    elif "spec" in settings:
        problems.append(
            f"{file}: server.spec: is {json_type(spec)}; a mapping of draft_max and type"
        )
        del settings["spec"]
    return {"server": settings}


GROUP_KEYS = ("vars", "hosts", "children")
# Ansible's group variable that orders groups of one depth (higher merges later, and wins).
GROUP_PRIORITY = "ansible_group_priority"


@dataclass
class _Group:
    """One inventory group, gathered from every place the file writes it."""

    vars: dict[str, Any] = field(default_factory=dict)
    priority: int = 1  # Ansible's default
    parents: list[str] = field(default_factory=list)


def _group_priority(value: Any, where: str, problems: list[str]) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    problems.append(
        f"{where}: is {json_type(value)}; it must be an integer (groups of one depth merge "
        "in the order of their priority, default 1, then of their names; the higher wins)"
    )
    return 1


def _group_depths(groups: dict[str, _Group]) -> dict[str, int]:
    """Each group's depth as Ansible counts it: `all` is 0, any other group one more than its
    deepest parent (the longest path from `all`). The parents form no loop: the walk refuses
    the entry that would close one."""
    depths: dict[str, int] = {}
    for start in groups:
        stack = [start]
        while stack:
            name = stack[-1]
            pending = [parent for parent in groups[name].parents if parent not in depths]
            if name in depths:
                stack.pop()
            elif pending:
                stack.extend(pending)
            else:
                parent_depths = [depths[parent] for parent in groups[name].parents]
                depths[name] = 0 if name == "all" else 1 + max(parent_depths, default=0)
                stack.pop()
    return depths


def _document_problem(path: Path, document: Any) -> str | None:
    """The top level of an inventory is one mapping, `all:`, holding a group."""
    layout = "(Ansible YAML inventory layout: all: children: GROUP: hosts: NAME: settings)"
    if document is None:
        return f"{path}: the file is empty; write `all:` with `children:` and/or `hosts:` {layout}"
    if not isinstance(document, dict):
        return (
            f"{path}: the top level is {json_type(document)}; it must be a mapping with one key, "
            f"`all:`, holding `children:` and/or `hosts:` {layout}"
        )
    if "all" not in document:
        keys = ", ".join(f"`{key}`" for key in document)
        hint = did_you_mean(next(iter(document)), ["all"]) if document else ""
        hint = f" ({hint})" if hint.startswith("did") else ""
        return (
            f"{path}: the top level has {keys or 'no keys'} but no `all:`{hint}; put every "
            f"group under `all: children:` {layout}"
        )
    return None


def load_inventory(path: Path | None = None) -> Inventory:
    """Load, merge and validate every host of an inventory file.

    A host's settings cascade as Ansible's (docs/inventory.md, "How settings cascade"):
    group_data/all.yml, then every group the host is in, ordered by depth, priority and name,
    each as its group_data/GROUP.yml under its inventory `vars:`, then the host's own settings
    from all of its entries. Raises ConfigError listing every problem of every host at once.
    """
    path = path or inventory_path()
    top_group, top_problems = _top_level(path)
    load = _Load(path, top_problems)
    _walk(load, "all", top_group, "all")
    depths = _group_depths(load.groups)
    defaults_name = str(DEFAULTS_PATH.relative_to(PROJECT_DIR))
    hosts = {name: _host_config(load, name, depths, defaults_name) for name in load.host_settings}
    problems = load.problems
    if not hosts and not problems:
        problems.append(f"{path}: no hosts defined (add `all: children: GROUP: hosts: NAME: ...`)")
    for host_config in hosts.values():
        problems.extend(validate_host(host_config))
    members = _group_members(load.groups, hosts)
    if not problems:
        problems.extend(shared_machine_problems(list(hosts.values())))
        problems.extend(rpc_inventory_problems(hosts))
        problems.extend(rpc_topology_problems(hosts))
        problems.extend(gateway_problems(hosts, members))
        problems.extend(builder_problems(hosts, members))
    if problems:
        raise ConfigError(problems)
    derive_rpc(hosts)
    derive_fleet_architectures(hosts)
    derive_gateways(hosts, members)
    return Inventory(path, hosts, members)


def _top_level(path: Path) -> tuple[Any, list[str]]:
    """The `all:` group of the inventory file, and the problems of the file's top level;
    raises ConfigError when there is no group to read."""
    document = load_yaml(path)
    problem = _document_problem(path, document)
    if problem is None:
        shape = shape_problem(document)
        problem = f"{path}: {shape}" if shape else None
    if problem:
        raise ConfigError([problem])
    problems: list[str] = [
        f"{path}: {key}: unknown top-level key; the file has one, `all:` (a group `{key}` goes "
        f"under `all: children:`)"
        for key in document
        if key != "all"
    ]
    if not isinstance(document["all"], dict | None):
        problems.append(
            f"{path}: all: is {json_type(document['all'])}; it must be a mapping of "
            "`vars:`, `hosts:` and `children:`"
        )
        raise ConfigError(problems)
    return document["all"], problems


def _implicit_groups() -> dict[str, _Group]:
    """Ansible's two implicit groups: `all` holds every group, `ungrouped` the hosts of no
    other."""
    return {"all": _Group(), "ungrouped": _Group(parents=["all"])}


@dataclass
class _Load:
    """What one load of an inventory file gathers as it reads the file, with every problem
    found (the top level's first)."""

    path: Path
    problems: list[str]
    groups: dict[str, _Group] = field(default_factory=_implicit_groups)
    # Every entry of a host, merged in document order.
    host_settings: dict[str, dict] = field(default_factory=dict)
    # Host -> the groups it is listed directly under.
    listed_in: dict[str, list[str]] = field(default_factory=dict)
    # Group -> its group_data/GROUP.yml and that file's name, loaded once (None: it has none).
    group_files: dict[str, tuple[dict, str] | None] = field(default_factory=dict)


def _mapping(load: _Load, node: Any, key_path: str, what: str) -> dict:
    """``node`` as a mapping (null is empty); anything else is a problem, and empty."""
    if node is None:
        return {}
    if isinstance(node, dict):
        return node
    load.problems.append(f"{load.path}: {key_path}: is {json_type(node)}; it must be {what}")
    return {}


def _named(load: _Load, name: Any, key_path: str, what: str) -> bool:
    if isinstance(name, str) and name:
        return True
    load.problems.append(
        f"{load.path}: {key_path}: {what} {name!r} is {json_type(name)}; a {what} is a "
        f'non-empty string (quote it: "{name}")'
    )
    return False


def _ancestors(groups: dict[str, _Group], group_name: str) -> set[str]:
    """Every group that holds ``group_name``, its parents' parents too."""
    found: set[str] = set()
    stack = list(groups[group_name].parents)
    while stack:
        parent = stack.pop()
        if parent not in found:
            found.add(parent)
            stack.extend(groups[parent].parents)
    return found


def _walk(load: _Load, group_name: str, node: Any, key_path: str) -> None:
    """Gather one place a group is written, in document order as Ansible's YAML inventory
    plugin reads it: a group written twice is one group, with the vars, hosts and children
    of both."""
    node = _mapping(load, node, key_path, "a group: a mapping of `vars:`, `hosts:`, `children:`")
    load.groups.setdefault(group_name, _Group())
    for key, value in node.items():
        if key == "vars":
            _gather_vars(load, group_name, value, f"{key_path}.vars")
        elif key == "hosts":
            _gather_hosts(load, group_name, value, f"{key_path}.hosts")
        elif key == "children":
            _gather_children(load, group_name, value, f"{key_path}.children")
        else:
            hint = did_you_mean(key, GROUP_KEYS)
            load.problems.append(
                f"{load.path}: {key_path}.{key}: unknown group key; {hint} "
                "(a group has `vars`, `hosts` and `children`; host settings go under "
                "`hosts: NAME:` or `vars:`)"
            )


def _gather_vars(load: _Load, group_name: str, node: Any, key_path: str) -> None:
    group = load.groups[group_name]
    for name, setting in _mapping(load, node, key_path, "a mapping of settings").items():
        if name == GROUP_PRIORITY:
            group.priority = _group_priority(
                setting, f"{load.path}: {key_path}.{name}", load.problems
            )
        else:
            group.vars = deep_merge(group.vars, {name: setting})


def _gather_hosts(load: _Load, group_name: str, node: Any, key_path: str) -> None:
    hosts_here = _mapping(
        load,
        node,
        key_path,
        "a mapping of host names to their settings (`rig1:` or `rig1: {ssh: ...}`, "
        "not a list `- rig1`)",
    )
    for host_name, settings in hosts_here.items():
        if not _named(load, host_name, f"{key_path}.{host_name}", "host name"):
            continue
        name_problem = host_name_problem(host_name)
        if name_problem:
            load.problems.append(f"{load.path}: {key_path}: {name_problem}")
            continue
        if settings is not None and not isinstance(settings, dict):
            load.problems.append(
                f"{load.path}: hosts.{host_name}: is {json_type(settings)}; a host's "
                "settings are a mapping such as `ssh: {host: ...}` (or nothing)"
            )
            continue
        # Ansible merges the settings of every entry of a host; the later wins.
        load.host_settings[host_name] = deep_merge(
            load.host_settings.get(host_name, {}), settings or {}
        )
        direct = load.listed_in.setdefault(host_name, [])
        if group_name not in direct:
            direct.append(group_name)


def _gather_children(load: _Load, group_name: str, node: Any, key_path: str) -> None:
    children = _mapping(
        load,
        node,
        key_path,
        "a mapping of group names to groups (`rigs:` with `hosts:` under it, not a list)",
    )
    for child_name, child in children.items():
        child_path = f"{key_path}.{child_name}"
        if not _named(load, child_name, child_path, "group name"):
            continue
        if child_name == "all":
            load.problems.append(
                f"{load.path}: {child_path}: `all` holds every group and cannot be the "
                "child of one; give this group another name"
            )
            continue
        _walk(load, child_name, child, child_path)
        if child_name == group_name or child_name in _ancestors(load.groups, group_name):
            load.problems.append(
                f"{load.path}: {child_path}: group `{child_name}` contains `{group_name}` "
                "already, so it cannot also be its child (a loop); remove one of the two entries"
            )
        elif group_name not in load.groups[child_name].parents:
            load.groups[child_name].parents.append(group_name)


def _cascade_order(load: _Load, host_name: str, depths: dict[str, int]) -> list[str]:
    """The groups a host is in, in the order their settings merge (the later wins)."""
    member_of = {"all", *load.listed_in[host_name]}
    for group_name in load.listed_in[host_name]:
        member_of |= _ancestors(load.groups, group_name)
    if member_of - {"all", "ungrouped"}:
        member_of.discard("ungrouped")  # as Ansible: a host in another group is not ungrouped
    else:
        member_of.add("ungrouped")
    groups = load.groups
    return sorted(member_of, key=lambda name: (depths[name], groups[name].priority, name))


def _group_file_defaults(load: _Load, group_name: str) -> tuple[dict, str] | None:
    """group_data/GROUP.yml, the group's documented defaults (loaded once), and its name."""
    if group_name not in load.group_files:
        group_file = DEFAULTS_PATH.parent / f"{group_name}.yml"
        found = None
        if group_name != "all" and group_file.is_file():
            file_vars = load_yaml(group_file)
            if not isinstance(file_vars, dict):
                load.problems.append(
                    f"{group_file}: is {json_type(file_vars)}; it must be a mapping"
                )
                file_vars = {}
            found = (file_vars, str(group_file.relative_to(PROJECT_DIR)))
        load.group_files[group_name] = found
    return load.group_files[group_name]


def _host_config(
    load: _Load, host_name: str, depths: dict[str, int], defaults_name: str
) -> HostConfig:
    """One host's settings cascaded from the defaults through its groups and its tuned file to
    its own, with the file that set each key."""
    order = _cascade_order(load, host_name, depths)
    data = defaults()
    origins: dict[tuple, str] = {}
    record_origins(data, defaults_name, (), origins)
    for group_name in order:
        # group_data/GROUP.yml sits right under the group's own inventory vars.
        found = _group_file_defaults(load, group_name)
        if found:
            data = deep_merge(data, found[0])
            record_origins(found[0], found[1], (), origins)
        data = deep_merge(data, load.groups[group_name].vars)
        record_origins(load.groups[group_name].vars, str(load.path), (), origins)
    tuned_file = tuned_path(load.path, host_name)
    tuned = _tuned_settings(tuned_file, load.problems)
    data = deep_merge(data, tuned)
    record_origins(tuned, str(tuned_file), (), origins)
    settings = load.host_settings[host_name]
    data = deep_merge(data, settings)
    record_origins(settings, str(load.path), (), origins)
    origins[()] = str(load.path)
    return HostConfig(host_name, order, data, origins)


def _group_members(groups: dict[str, _Group], hosts: dict[str, HostConfig]) -> dict[str, list[str]]:
    """Each group's hosts (`all` aside), the groups in the order the file first names them."""
    members: dict[str, list[str]] = {}
    for host_config in hosts.values():
        for group_name in host_config.groups:
            if group_name != "all":
                members.setdefault(group_name, []).append(host_config.name)
    return {name: members[name] for name in groups if name in members}
