"""Rig configuration: load the Ansible-style YAML inventory, merge defaults, validate.

Every mistake a user can make in the YAML is reported as a :class:`ConfigError` naming the file,
the key path (``hosts.rig1.server.tensor_split``), what is wrong and what would be right, before
any host is contacted.
"""

from __future__ import annotations

import copy
import datetime
import difflib
import ipaddress
import json
import math
import os
import re
import reprlib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import yaml
from jsonschema import Draft202012Validator, validators

from llamarig import PACKAGE_DIR, PROJECT_DIR, hardware, llama_args
from llamarig.shapes import foreign_characters, shape_problems, url_file_name

SCHEMA_PATH = PACKAGE_DIR / "schema.json"
DEFAULTS_PATH = PROJECT_DIR / "group_data" / "all.yml"
DEFAULT_INVENTORY = "inventory/hosts.yml"
INVENTORY_ENV = "RIG_INVENTORY"


class ConfigError(Exception):
    """One or more user mistakes in the rig configuration, each a full sentence."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass
class HostConfig:
    """One host of the inventory with its merged, validated rig data."""

    name: str
    groups: list[str]  # every group the host is in, in the order their vars merge (`all` first)
    data: dict[str, Any]
    # key path (tuple) -> file that set it, for error messages
    origins: dict[tuple, str] = field(default_factory=dict, repr=False)


@dataclass
class Inventory:
    path: Path
    hosts: dict[str, HostConfig]
    groups: dict[str, list[str]]


def inventory_path() -> Path:
    """The inventory file chosen by ``RIG_INVENTORY``, relative to the project by default."""
    chosen = Path(os.environ.get(INVENTORY_ENV) or DEFAULT_INVENTORY)
    if not chosen.is_absolute() and not chosen.exists():
        chosen = PROJECT_DIR / chosen
    return chosen


class _RigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with a scalar it cannot convert (``2024-13-45`` read as a date,
    ``!!int abc``) reported as a syntax error at its line instead of a bare ValueError, and a
    key given twice in one mapping refused (PyYAML would silently keep the last one: a second
    `server:` under a host would drop the first)."""

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple, Any] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.composer.ComposerError(
                    "while reading a mapping",
                    node.start_mark,
                    f"the key `{key_node.value}` is given twice in one mapping (first on line "
                    f"{seen[key].line + 1}) and YAML would keep only the last; merge the two",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as error:  # PyYAML's constructors raise ValueError, IndexError, ...
            shown = f" {node.value!r}" if isinstance(node, yaml.ScalarNode) else ""
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"cannot read the value{shown} as {node.tag.rsplit(':', 1)[-1]} ({error}); "
                "quote it to keep it as text",
                node.start_mark,
            ) from None


# Far beyond any inventory (a few levels deep, a few hundred values), far below what would
# exhaust the recursion limit or memory of the checks that walk the data.
MAX_DEPTH = 32
MAX_VALUES = 100_000


def load_yaml(path: Path) -> Any:
    """Parse a YAML file; every way it can fail becomes a ConfigError naming the file (and the
    line and column where YAML knows them)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            [f"{path}: file not found (set {INVENTORY_ENV} to an inventory file)"]
        ) from None
    except IsADirectoryError:
        raise ConfigError(
            [f"{path}: is a directory; set {INVENTORY_ENV} to an inventory file in it"]
        ) from None
    except OSError as error:
        raise ConfigError(
            [f"{path}: cannot be read ({error.strerror or error}); fix its permissions or path"]
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ConfigError(
            [
                f"{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset "
                f"{error.start}); save the file as UTF-8"
            ]
        ) from None
    try:
        return yaml.load(text, Loader=_RigLoader)  # a SafeLoader: no Python objects
    except yaml.reader.ReaderError as error:
        line = text[: error.position].count("\n") + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        character = error.character
        character = chr(character) if isinstance(character, int) else character
        raise ConfigError(
            [
                f"{path}:{line}:{column}: YAML cannot contain the character {ascii(character)} "
                f"({error.reason}); remove it or write it as an escape in a double-quoted string"
            ]
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        context = getattr(error, "context", None)
        context_mark = getattr(error, "context_mark", None)
        if context and context_mark and (not mark or context_mark.line != mark.line):
            problem += f" ({context} that starts on line {context_mark.line + 1})"
        if "'\\t'" in problem:
            problem += "; indent with spaces: YAML does not allow tabs there"
        elif "; " not in problem:
            problem += (
                "; fix the YAML there (indentation, a missing `:`, an unclosed bracket or "
                "quote; quote a value that starts with a special character)"
            )
        raise ConfigError([f"{path}{where}: YAML syntax error: {problem}"]) from None
    except RecursionError:
        raise ConfigError(
            [
                f"{path}: YAML nested too deeply to read; an inventory needs a few levels "
                "(all: children: GROUP: hosts: NAME: settings)"
            ]
        ) from None


def _shape_problem(document: Any) -> str | None:
    """What makes a parsed document unfit to walk, or None: a structure that refers to itself
    (``&a [*a]``), nesting beyond MAX_DEPTH, or aliases expanding beyond MAX_VALUES values."""
    count = 0
    stack: list[tuple[Any, tuple, frozenset]] = [(document, (), frozenset())]
    while stack:
        value, key_path, ancestors = stack.pop()
        count += 1
        dotted = ".".join(str(part) for part in key_path[:MAX_DEPTH]) or "the top level"
        if count > MAX_VALUES:
            return (
                f"{dotted}: the document expands to more than {MAX_VALUES} values (anchors "
                "and aliases nested in each other); write the settings out plainly"
            )
        if not isinstance(value, dict | list):
            continue
        if id(value) in ancestors:
            return (
                f"{dotted}: an alias refers to a mapping or list that contains it (a "
                "recursive structure); settings must be a tree: use the alias elsewhere"
            )
        if len(key_path) >= MAX_DEPTH:
            return f"{dotted}: nested more than {MAX_DEPTH} levels deep; no setting needs that"
        inner = ancestors | {id(value)}
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((child, (*key_path, key), inner) for key, child in items)
    return None


@cache
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def defaults() -> dict:
    """The documented defaults of group_data/all.yml (a fresh copy)."""
    return copy.deepcopy(_defaults_cached())


@cache
def _defaults_cached() -> dict:
    return load_yaml(DEFAULTS_PATH)


def deep_merge(base: dict, override: dict) -> dict:
    """Merge ``override`` into a copy of ``base``; mappings merge, anything else replaces."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _record_origins(data: Any, origin: str, prefix: tuple, origins: dict[tuple, str]) -> None:
    origins[prefix] = origin
    if isinstance(data, dict):
        for key, value in data.items():
            _record_origins(value, origin, (*prefix, key), origins)


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
        f"{where}: is {_json_type(value)}; it must be an integer (groups of one depth merge "
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


def _did_you_mean(key: Any, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(known)}"


def _document_problem(path: Path, document: Any) -> str | None:
    """The top level of an inventory is one mapping, `all:`, holding a group."""
    layout = "(Ansible YAML inventory layout: all: children: GROUP: hosts: NAME: settings)"
    if document is None:
        return f"{path}: the file is empty; write `all:` with `children:` and/or `hosts:` {layout}"
    if not isinstance(document, dict):
        return (
            f"{path}: the top level is {_json_type(document)}; it must be a mapping with one key, "
            f"`all:`, holding `children:` and/or `hosts:` {layout}"
        )
    if "all" not in document:
        keys = ", ".join(f"`{key}`" for key in document)
        hint = _did_you_mean(next(iter(document)), ["all"]) if document else ""
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
    document = load_yaml(path)
    problem = _document_problem(path, document)
    if problem is None:
        shape = _shape_problem(document)
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
            f"{path}: all: is {_json_type(document['all'])}; it must be a mapping of "
            "`vars:`, `hosts:` and `children:`"
        )
        raise ConfigError(problems)

    # Ansible's two implicit groups: `all` holds every group, `ungrouped` the hosts of no other.
    groups: dict[str, _Group] = {"all": _Group(), "ungrouped": _Group(parents=["all"])}
    host_settings: dict[str, dict] = {}  # every entry of a host, merged in document order
    listed_in: dict[str, list[str]] = {}  # host -> the groups it is listed directly under

    def mapping(node: Any, key_path: str, what: str) -> dict:
        """``node`` as a mapping (null is empty); anything else is a problem, and empty."""
        if node is None:
            return {}
        if isinstance(node, dict):
            return node
        problems.append(f"{path}: {key_path}: is {_json_type(node)}; it must be {what}")
        return {}

    def named(name: Any, key_path: str, what: str) -> bool:
        if isinstance(name, str) and name:
            return True
        problems.append(
            f"{path}: {key_path}: {what} {name!r} is {_json_type(name)}; a {what} is a "
            f'non-empty string (quote it: "{name}")'
        )
        return False

    def ancestors(group_name: str) -> set[str]:
        found: set[str] = set()
        stack = list(groups[group_name].parents)
        while stack:
            parent = stack.pop()
            if parent not in found:
                found.add(parent)
                stack.extend(groups[parent].parents)
        return found

    def walk(group_name: str, node: Any, key_path: str) -> None:
        """Gather one place a group is written, in document order as Ansible's YAML inventory
        plugin reads it: a group written twice is one group, with the vars, hosts and
        children of both."""
        node = mapping(node, key_path, "a group: a mapping of `vars:`, `hosts:`, `children:`")
        group = groups.setdefault(group_name, _Group())
        for key, value in node.items():
            if key == "vars":
                group_vars = mapping(value, f"{key_path}.vars", "a mapping of settings")
                for name, setting in group_vars.items():
                    if name == GROUP_PRIORITY:
                        group.priority = _group_priority(
                            setting, f"{path}: {key_path}.vars.{name}", problems
                        )
                    else:
                        group.vars = deep_merge(group.vars, {name: setting})
            elif key == "hosts":
                hosts_here = mapping(
                    value,
                    f"{key_path}.hosts",
                    "a mapping of host names to their settings (`rig1:` or `rig1: {ssh: ...}`, "
                    "not a list `- rig1`)",
                )
                for host_name, settings in hosts_here.items():
                    if not named(host_name, f"{key_path}.hosts.{host_name}", "host name"):
                        continue
                    if settings is not None and not isinstance(settings, dict):
                        problems.append(
                            f"{path}: hosts.{host_name}: is {_json_type(settings)}; a host's "
                            "settings are a mapping such as `ssh: {host: ...}` (or nothing)"
                        )
                        continue
                    # Ansible merges the settings of every entry of a host; the later wins.
                    host_settings[host_name] = deep_merge(
                        host_settings.get(host_name, {}), settings or {}
                    )
                    direct = listed_in.setdefault(host_name, [])
                    if group_name not in direct:
                        direct.append(group_name)
            elif key == "children":
                children = mapping(
                    value,
                    f"{key_path}.children",
                    "a mapping of group names to groups (`rigs:` with `hosts:` under it, not a "
                    "list)",
                )
                for child_name, child in children.items():
                    child_path = f"{key_path}.children.{child_name}"
                    if not named(child_name, child_path, "group name"):
                        continue
                    if child_name == "all":
                        problems.append(
                            f"{path}: {child_path}: `all` holds every group and cannot be the "
                            "child of one; give this group another name"
                        )
                        continue
                    walk(child_name, child, child_path)
                    if child_name == group_name or child_name in ancestors(group_name):
                        problems.append(
                            f"{path}: {child_path}: group `{child_name}` contains `{group_name}` "
                            "already, so it cannot also be its child (a loop); remove one of "
                            "the two entries"
                        )
                    elif group_name not in groups[child_name].parents:
                        groups[child_name].parents.append(group_name)
            else:
                hint = _did_you_mean(key, GROUP_KEYS)
                problems.append(
                    f"{path}: {key_path}.{key}: unknown group key; {hint} "
                    "(a group has `vars`, `hosts` and `children`; host settings go under "
                    "`hosts: NAME:` or `vars:`)"
                )

    walk("all", document["all"], "all")
    depths = _group_depths(groups)
    defaults_name = str(DEFAULTS_PATH.relative_to(PROJECT_DIR))
    file_defaults: dict[str, tuple[dict, str] | None] = {}

    def group_file_defaults(group_name: str) -> tuple[dict, str] | None:
        """group_data/GROUP.yml, the group's documented defaults (loaded once), and its name."""
        if group_name not in file_defaults:
            group_file = DEFAULTS_PATH.parent / f"{group_name}.yml"
            found = None
            if group_name != "all" and group_file.is_file():
                file_vars = load_yaml(group_file)
                if not isinstance(file_vars, dict):
                    problems.append(
                        f"{group_file}: is {_json_type(file_vars)}; it must be a mapping"
                    )
                    file_vars = {}
                found = (file_vars, str(group_file.relative_to(PROJECT_DIR)))
            file_defaults[group_name] = found
        return file_defaults[group_name]

    hosts: dict[str, HostConfig] = {}
    for host_name, settings in host_settings.items():
        member_of = {"all", *listed_in[host_name]}
        for group_name in listed_in[host_name]:
            member_of |= ancestors(group_name)
        if member_of - {"all", "ungrouped"}:
            member_of.discard("ungrouped")  # as Ansible: a host in another group is not ungrouped
        else:
            member_of.add("ungrouped")
        order = sorted(member_of, key=lambda name: (depths[name], groups[name].priority, name))
        data = defaults()
        origins: dict[tuple, str] = {}
        _record_origins(data, defaults_name, (), origins)
        for group_name in order:
            # group_data/GROUP.yml sits right under the group's own inventory vars.
            found = group_file_defaults(group_name)
            if found:
                data = deep_merge(data, found[0])
                _record_origins(found[0], found[1], (), origins)
            data = deep_merge(data, groups[group_name].vars)
            _record_origins(groups[group_name].vars, str(path), (), origins)
        data = deep_merge(data, settings)
        _record_origins(settings, str(path), (), origins)
        origins[()] = str(path)
        hosts[host_name] = HostConfig(host_name, order, data, origins)

    members: dict[str, list[str]] = {}
    for host_config in hosts.values():
        for group_name in host_config.groups:
            if group_name != "all":
                members.setdefault(group_name, []).append(host_config.name)
    if not hosts and not problems:
        problems.append(f"{path}: no hosts defined (add `all: children: GROUP: hosts: NAME: ...`)")
    for host_config in hosts.values():
        problems.extend(validate_host(host_config))
    if not problems:
        problems.extend(_shared_machine_problems(list(hosts.values())))
        problems.extend(_rpc_inventory_problems(hosts))
        problems.extend(_rpc_topology_problems(hosts))
    if problems:
        raise ConfigError(problems)
    return Inventory(path, hosts, {name: members[name] for name in groups if name in members})


def _rpc_inventory_problems(hosts: dict[str, HostConfig]) -> list[str]:
    """Each head's workers are rpc-worker hosts of this inventory; their addresses become the
    head's rpc.endpoints (so --rpc is never typed twice)."""
    problems = []
    for host_config in hosts.values():
        rpc = host_config.data["rpc"]
        derived = [key for key in ("endpoints", "worker_gpus") if key in rpc]
        if derived:
            problems.extend(
                _located(
                    host_config,
                    ("rpc", key),
                    "is derived from rpc.workers (their rpc.host:rpc.port and gpus); name the "
                    "workers and declare their settings there instead",
                    in_inventory=True,
                )
                for key in derived
            )
            continue
        if host_config.data["role"] != "rpc-head":
            continue
        endpoints, worker_gpus = [], []
        for name in rpc["workers"]:
            worker = hosts.get(name)
            if worker is None or worker.data["role"] != "rpc-worker":
                what = (
                    f"not a host of this inventory ({_did_you_mean(name, list(hosts))})"
                    if worker is None
                    else f"a `{worker.data['role']}` host"
                )
                problems.append(
                    _located(
                        host_config,
                        ("rpc", "workers"),
                        f"names `{name}`, which is {what}; a head's workers are hosts with "
                        "`role: rpc-worker`",
                        in_inventory=True,
                    )
                )
                continue
            address = worker.data["rpc"]["host"]
            address = f"[{address}]" if ":" in address else address
            endpoints.append(f"{address}:{worker.data['rpc']['port']}")
            worker_gpus += [{"worker": name, **gpu} for gpu in worker.data["gpus"]]
        rpc["endpoints"] = endpoints
        rpc["worker_gpus"] = worker_gpus
        server = host_config.data["server"]
        split, devices = server["tensor_split"], len(worker_gpus) + len(host_config.data["gpus"])
        all_declared = all(name in hosts and hosts[name].data["gpus"] for name in rpc["workers"])
        if isinstance(split, list) and all_declared and len(split) != devices:
            problems.append(
                _located(
                    host_config,
                    ("server", "tensor_split"),
                    f"has {len(split)} shares for {devices} devices: the workers' "
                    f"{len(worker_gpus)} GPUs first (rpc.workers order), then this host's "
                    f"{len(host_config.data['gpus'])}",
                    in_inventory=True,
                )
            )
        if "auto" in (server["ctx"], server["tensor_split"]):
            cpu_workers = [
                name for name in rpc["workers"] if name in hosts and not hosts[name].data["gpus"]
            ]
            if host_config.data["llama_cpp"]["backend"] != "cuda" or cpu_workers:
                problems.append(
                    _located(
                        host_config,
                        ("server", "ctx" if server["ctx"] == "auto" else "tensor_split"),
                        "`auto` plans GPU memory across hosts: it needs a cuda head and the "
                        "`gpus` of every worker"
                        + (f" (not declared on {', '.join(cpu_workers)})" if cpu_workers else "")
                        + "; or give numbers (llama.cpp puts the workers' devices first, in "
                        "rpc.workers order, then the head's GPUs)",
                        in_inventory=True,
                    )
                )
    return problems


def _is_loopback(address: str) -> bool:
    if address.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _box(data: dict) -> str:
    """The box a host's SSH address names, port aside: every loopback name and address (and
    pyinfra's @local) is this machine, whose containers share its loopback."""
    ssh = data["ssh"]
    if ssh.get("local") or _is_loopback(ssh["host"]):
        return "this machine"
    return ssh["host"].lower().rstrip(".")


def _machine(data: dict) -> tuple:
    """What identifies the machine a host's settings reach: pyinfra's @local, or the SSH
    address (127.0.0.1, ::1 and localhost alike) and port."""
    ssh = data["ssh"]
    if ssh.get("local"):
        return ("@local",)
    box = _box(data)
    return ("127.0.0.1" if box == "this machine" else box, ssh.get("port", 22))


def _rpc_topology_problems(hosts: dict[str, HostConfig]) -> list[str]:
    """RPC layouts that cannot work: a worker lent to two heads, two workers of one machine
    on one port (or unit), a loopback worker address that a head on another box cannot reach."""
    problems = []
    head_of: dict[str, str] = {}
    for head in hosts.values():
        if head.data["role"] != "rpc-head":
            continue
        for name in head.data["rpc"]["workers"]:
            worker = hosts.get(name)
            if worker is None or worker.data["role"] != "rpc-worker":
                continue  # named by _rpc_inventory_problems
            if name in head_of:
                problems.append(
                    _located(
                        head,
                        ("rpc", "workers"),
                        f"names `{name}`, which is already a worker of `{head_of[name]}`; "
                        "ggml-rpc-server lends its devices to one head: give each head its own "
                        "workers",
                        in_inventory=True,
                    )
                )
                continue
            head_of[name] = head.name
            address = worker.data["rpc"]["host"]
            if _is_loopback(address) and _box(worker.data) != _box(head.data):
                problems.append(
                    _located(
                        worker,
                        ("rpc", "host"),
                        f"{address} is loopback, which head `{head.name}` on another box "
                        f"({_box(head.data)}) cannot reach: bind the private address of "
                        f"{_box(worker.data)} that the head reaches, e.g. 10.0.0.12",
                    )
                )
    owners: dict[tuple, HostConfig] = {}
    for worker in hosts.values():
        if worker.data["role"] != "rpc-worker":
            continue
        machine = _machine(worker.data)
        for key in ("port", "service"):
            value = worker.data["rpc"][key]
            other = owners.setdefault((machine, key, value), worker)
            if other is not worker:
                problems.append(
                    _located(
                        worker,
                        ("rpc", key),
                        f"{value} is also the rpc.{key} of worker `{other.name}`, which is the "
                        "same machine; give each worker on one machine its own rpc.port and "
                        "rpc.service",
                        in_inventory=True,
                    )
                )
    return problems


def _shared_machine_problems(host_configs: list[HostConfig]) -> list[str]:
    """Hosts of one inventory that reach the same machine must not collide on it: one @local,
    and per machine distinct server ports, unit names and environment files."""
    problems = []
    by_machine: dict[tuple, list[HostConfig]] = {}
    for host_config in host_configs:
        by_machine.setdefault(_machine(host_config.data), []).append(host_config)
    for machine, members in by_machine.items():
        first = members[0]
        if machine == ("@local",):
            problems.extend(
                _located(
                    other,
                    ("ssh", "local"),
                    f"host `{first.name}` already converges this machine with `local: true` "
                    "(pyinfra has one @local); keep one of them",
                    in_inventory=True,
                )
                for other in members[1:]
            )
            continue
        for key_path, what in (
            (("server", "port"), "server.port"),
            (("server", "service"), "server.service"),
            (("paths", "env_file"), "paths.env_file"),
        ):
            owners: dict[Any, HostConfig] = {}
            for host_config in members:
                value = host_config.data[key_path[0]][key_path[1]]
                if value in owners:
                    problems.append(
                        _located(
                            host_config,
                            key_path,
                            f"{value} is also the {what} of host `{owners[value].name}`, which "
                            f"is the same machine (ssh {machine[0]} port {machine[1]}); give "
                            f"each host on one machine its own {what}",
                            in_inventory=True,
                        )
                    )
                else:
                    owners[value] = host_config
    return problems


def _is_integer(checker, instance) -> bool:
    # JSON Schema counts 8080.0 as an integer; a port, a size or a count written that way would
    # reach command lines and URLs as "8080.0".
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_number(checker, instance) -> bool:
    # .nan and .inf pass every minimum/maximum comparison; no setting means them.
    if isinstance(instance, float):
        return math.isfinite(instance)
    return _is_integer(checker, instance)


_RigValidator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _is_integer, "number": _is_number}
    ),
)


def validate_host(host_config: HostConfig) -> list[str]:
    """Schema and cross-field checks of one host; returns the problems found."""
    problems = []
    validator = _RigValidator(schema())
    errors = sorted(validator.iter_errors(host_config.data), key=lambda e: _path_key(e.path))
    for error in errors:
        problems.extend(_describe_schema_error(host_config, error))
    if not problems:
        for key_path, message, *missing in semantic_problems(host_config.data):
            problems.append(_located(host_config, key_path, message, in_inventory=bool(missing)))
    return problems


def _path_key(key_path) -> list[tuple[int, Any]]:
    """A sort key for key paths that mix list indexes and mapping keys of any type."""
    return [(0, part, "") if isinstance(part, int) else (1, 0, str(part)) for part in key_path]


def _origin_of(host_config: HostConfig, key_path: tuple, in_inventory: bool = False) -> str:
    """The file to fix: the one that set the key (or its nearest parent); ``in_inventory``:
    the inventory, for what only it can fix (a missing setting, hosts that collide)."""
    if in_inventory:
        return host_config.origins.get((), "?")
    for length in range(len(key_path), -1, -1):
        origin = host_config.origins.get(tuple(key_path[:length]))
        if origin:
            return origin
    return "?"


def _located(
    host_config: HostConfig, key_path: tuple, message: str, in_inventory: bool = False
) -> str:
    dotted = ".".join(str(part) for part in key_path)
    origin = _origin_of(host_config, key_path, in_inventory)
    return f"{origin}: hosts.{host_config.name}.{dotted}: {message}"


# Values are shown as the YAML gave them, but never at length: a wrong value can be a whole
# tree, and aliases can make it a large one.
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 80, 80
_repr.maxlist = _repr.maxdict = _repr.maxset = _repr.maxtuple = 6


def _shown(value: Any) -> str:
    return _repr.repr(value)


def _expected(subschema: Any) -> str:
    """What a schema asks for, in words: its description, else its type, values or form."""
    if not isinstance(subschema, dict):
        return ""
    if subschema.get("description"):
        return subschema["description"]
    parts = []
    if "enum" in subschema:
        parts.append("one of " + ", ".join(map(str, subschema["enum"])))
    if "type" in subschema:
        types = subschema["type"] if isinstance(subschema["type"], list) else [subschema["type"]]
        parts.append(" or ".join(f"{'an' if t[0] in 'aeiou' else 'a'} {t}" for t in types))
    if "pattern" in subschema:
        parts.append(f"matching {subschema['pattern']}")
    if "minimum" in subschema:
        parts.append(f"at least {subschema['minimum']}")
    if "maximum" in subschema:
        parts.append(f"at most {subschema['maximum']}")
    return ", ".join(parts)


def _describe_schema_error(host_config: HostConfig, error) -> list[str]:
    key_path = tuple(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed), key=lambda key: (str(key), repr(key)))
        parts = []
        for key in extra:
            if isinstance(key, str):
                hint = _did_you_mean(key, allowed)
                wrong = f"unknown key `{key}`{foreign_characters(key)}"
            else:
                hint = f"keys are names such as {', '.join(allowed[:3])}"
                wrong = f"the key {_shown(key)} is {_json_type(key)}, not a name"
            parts.append(_located(host_config, (*key_path, key), f"{wrong}; {hint}"))
        return parts
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else ""
        fix = f"add `{missing}`" if missing else "add it"
        return [_located(host_config, key_path, f"{error.message}; {fix}", in_inventory=True)]
    if "propertyNames" in error.schema_path:
        # The instance is the offending key itself: name it in the path.
        name = error.instance
        text = (
            f"the name {_shown(name)} has the wrong form"
            f"{foreign_characters(name) if isinstance(name, str) else ''}; expected a name "
            f"{_expected(error.schema)}"
        )
        return [_located(host_config, (*key_path, name), text)]
    description = error.schema.get("description") if isinstance(error.schema, dict) else None
    expected = description or _expected(error.schema)
    if error.validator == "enum":
        wrong = f"{_shown(error.instance)} is not allowed"
        if isinstance(error.instance, str):
            wrong += foreign_characters(error.instance)
        expected = description or "one of " + ", ".join(map(str, error.validator_value))
    elif error.validator == "type":
        if isinstance(error.instance, float) and not math.isfinite(error.instance):
            wrong = f"{_shown(error.instance)} is not a finite number"
        elif isinstance(error.instance, float) and "integer" in str(error.validator_value):
            wrong = f"{_shown(error.instance)} is a number with a fraction, not a whole number"
        else:
            wrong = f"{_shown(error.instance)} is {_json_type(error.instance)}"
    elif error.validator == "pattern":
        wrong = f"{_shown(error.instance)} has the wrong form"
        if "{" in error.validator_value:  # a fixed length, such as a checksum's or a commit's
            wrong += f" ({len(error.instance)} characters)"
    elif error.validator in ("minimum", "exclusiveMinimum"):
        wrong = f"{_shown(error.instance)} is out of range (below {error.validator_value})"
    elif error.validator in ("maximum", "exclusiveMaximum"):
        wrong = f"{_shown(error.instance)} is out of range (above {error.validator_value})"
    elif error.validator in ("minLength", "minItems"):
        wrong = f"{_shown(error.instance)} is empty"
    else:
        wrong = f"{_shown(error.instance)} is not valid"
    text = _known_mistake(key_path, error.validator, error.instance)
    text = text or (f"{wrong}; expected {expected}" if expected else wrong)
    return [_located(host_config, key_path, text)]


def _known_mistake(key_path: tuple, validator: str, value: Any) -> str | None:
    """The message for a schema error that has a well-known cause, or None."""
    key = key_path[-1] if key_path else None
    if key == "pci_bus_id" and validator == "type" and isinstance(value, int | float):
        return (
            f"{_shown(value)} is a number: YAML 1.1 reads an unquoted bus id such as "
            '01:00.0 as base 60; quote it (pci_bus_id: "0000:01:00.0")'
        )
    if key in ("vram_mib", "usable_mib") and validator == "minimum" and 0 < value < 1024:
        return (
            f"{value} looks like GiB, and the key is in MiB: {value} GiB is {value * 1024} MiB "
            "(nvidia-smi --query-gpu=memory.total --format=csv shows the exact MiB)"
        )
    if key_path == ("model", "url") and isinstance(value, str) and value.startswith("file:"):
        return (
            f"{_shown(value)} is a local file, and `url` is downloaded over http(s): use "
            "`model.path` for a file already on the host"
        )
    return None


LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def _json_type(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
        bytes: "binary data (!!binary)",
        set: "a set (!!set)",
        datetime.date: "a date (quote it to keep it as text)",
        datetime.datetime: "a timestamp (quote it to keep it as text)",
    }
    return names.get(type(value), type(value).__name__)


MISSING = "missing"  # third element of a semantic problem: blame the inventory, not a default

# KV cache types the CUDA backend has a flash-attention kernel for at the pinned llama.cpp
# (ggml_cuda_fattn_kv_type_supported in ggml-cuda/fattn.cu); f32 is converted to f16.
CUDA_FA_KV_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
UNQUANTIZED_KV_TYPES = ("f32", "f16", "bf16")


def semantic_problems(data: dict) -> list[tuple]:
    """Cross-field rules the schema cannot state. Returns (key path, message) pairs, with a
    third element MISSING when the fix is to add a setting the defaults leave empty."""
    problems: list[tuple] = []
    model, server, gpus = data["model"], data["server"], data["gpus"]
    backend = data["llama_cpp"]["backend"]

    ssh = data.get("ssh") or {}
    if not ssh.get("local") and not ssh.get("host"):
        problems.append(
            (
                ("ssh", "host"),
                "is missing: give the address sshd listens on (and usually `port`, `user`, "
                "`key`, `known_hosts`), or set `ssh.local: true` to converge this machine",
                MISSING,
            )
        )
    if ssh.get("local") and ssh.get("host"):
        problems.append(
            (
                ("ssh", "local"),
                "`local: true` converges this machine, yet `host` names another; "
                "remove one of them",
            )
        )
    if not ssh.get("local") and ssh.get("host") and server["port"] == ssh.get("port", 22):
        problems.append(
            (
                ("server", "port"),
                f"{server['port']} is also the host's SSH port (ssh.port); llama-server cannot "
                "bind the port sshd listens on: pick another, such as 8080",
            )
        )

    if server["port"] < 1024 and server.get("supervisor", "systemd") == "systemd":
        problems.append(
            (
                ("server", "port"),
                f"{server['port']} is a privileged port, and the unit runs llama-server as an "
                "unprivileged dynamic user without CAP_NET_BIND_SERVICE, so it cannot bind it; "
                "use a port from 1024 up, such as 8080 (put a reverse proxy in front for 80/443)",
            )
        )

    if not model["url"] and not model["path"] and data["role"] != "rpc-worker":
        problems.append(
            (
                ("model",),
                "has neither `url` nor `path`: set `url` (download, with `sha256`) or `path` "
                "(a file already on the host)",
                MISSING,
            )
        )
    elif model["url"] and model["path"]:
        problems.append(
            (
                ("model",),
                "set exactly one of `url` (download) and `path` (a file already on the host)",
            )
        )
    if model["url"] and not model["sha256"]:
        problems.append(
            (
                ("model", "sha256"),
                "is required with `url`: a download is only used "
                "when its checksum matches (sha256sum FILE prints it)",
                MISSING,
            )
        )
    if model["url"] and not model["filename"] and not model_filename(data).endswith(".gguf"):
        problems.append(
            (
                ("model", "filename"),
                "cannot be taken from the URL (it does not end "
                "in .gguf); set `filename: NAME.gguf`",
                MISSING,
            )
        )

    split_mode = server["split_mode"]
    if split_mode == "row":
        problems.append(
            (
                ("server", "split_mode"),
                "`row` no longer works with CUDA at the "
                "pinned llama.cpp (it fails at load with `does not support split "
                "buffers`); use `tensor` (splits every layer, fastest on two cards) or "
                "`layer` (pipeline)",
            )
        )
    if split_mode == "tensor" and server["flash_attn"] == "off":
        problems.append(
            (
                ("server", "flash_attn"),
                "`off` is refused by `split_mode: tensor`, "
                "which forces flash attention; set `on` or `auto`",
            )
        )
    if split_mode == "tensor" and backend == "cpu":
        problems.append(
            (
                ("server", "split_mode"),
                "`tensor` needs GPU devices; a cpu build "
                "exits at load (LLAMA_SPLIT_MODE_TENSOR needs >= 1 devices); use `none`",
            )
        )
    problems += _kv_problems(server, split_mode, backend)
    split = server["tensor_split"]
    if isinstance(split, list):
        if not any(split):
            problems.append((("server", "tensor_split"), "needs at least one non-zero share"))
        # A head's split also covers its workers' devices (checked across the inventory).
        if gpus and len(split) != len(gpus) and data["role"] != "rpc-head":
            problems.append(
                (
                    ("server", "tensor_split"),
                    f"has {len(split)} {'entry' if len(split) == 1 else 'entries'} for "
                    f"{len(gpus)} declared GPUs; give one share per GPU, in `gpus` order",
                )
            )
    if split is not None and backend == "cpu" and data["role"] != "rpc-head":
        problems.append(
            (("server", "tensor_split"), "applies to GPUs only; set null for a cpu build")
        )
    if server["ctx"] == "auto" and backend == "cpu":
        problems.append(
            (("server", "ctx"), "`auto` plans GPU memory; give a number for a cpu build")
        )

    if server["host"] not in LOOPBACK_HOSTS and not server["api_key_file"]:
        problems.append(
            (
                ("server", "host"),
                f"{server['host']} exposes the API to the network; set `server.api_key_file` to "
                "a file holding an API key, or listen on 127.0.0.1",
            )
        )
    if server["api_key_file"]:
        key_file = expand_path(server["api_key_file"])
        if not _key_file_text(key_file).strip():
            problems.append(
                (
                    ("server", "api_key_file"),
                    f"{key_file} does not exist or is empty; write the "
                    "key to it (e.g. openssl rand -hex 32 > FILE; chmod 600 FILE)",
                )
            )

    spec_types = server["spec"]["type"]
    if "none" in spec_types and len(spec_types) > 1:
        problems.append(
            (
                ("server", "spec", "type"),
                "`none` cannot be combined with other types; use [] for no speculative decoding",
            )
        )
    if server["spec"]["draft_max"] is not None and not spec_types:
        problems.append(
            (
                ("server", "spec", "draft_max"),
                "has no effect without `spec.type`; "
                "set a type such as [ngram-mod] or remove draft_max",
            )
        )

    if backend == "cuda":
        if data["cuda"]["source"] == "none":
            problems.append(
                (
                    ("cuda", "source"),
                    "is `none` but `llama_cpp.backend` is `cuda`; "
                    "choose a toolkit source or build for the cpu",
                )
            )
        if data["driver"]["source"] == "none":
            problems.append(
                (
                    ("driver", "source"),
                    "is `none` but `llama_cpp.backend` is "
                    "`cuda`; choose a driver source or build for the cpu",
                )
            )
        if data["llama_cpp"]["cuda_architectures"] == "auto" and not gpus:
            problems.append(
                (
                    ("llama_cpp", "cuda_architectures"),
                    "`auto` needs the `gpus` "
                    'list; declare the GPUs or give a list such as "86-real;120a-real" '
                    "(a build host's own GPUs are not the target's)",
                )
            )
        problems += _version_problems(data)
    problems += _gpu_list_problems(gpus)
    problems += _json_problems(server["chat_template_kwargs"], ("server", "chat_template_kwargs"))
    problems += _rpc_role_problems(data)
    problems += shape_problems(data)
    # The escape hatches, and settings that contradict each other, llama.cpp or the hardware.
    problems += llama_args.extra_args_problems(server["extra_args"])
    problems += llama_args.env_problems(server["env"])
    problems += _contradiction_problems(data)
    return problems


WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")


def _rpc_role_problems(data: dict) -> list[tuple]:
    """One host's RPC settings against its role (the workers' names are checked across the
    inventory by _rpc_inventory_problems)."""
    role, rpc = data["role"], data["rpc"]
    problems: list[tuple] = []
    if role == "rpc-worker":
        if rpc["host"] is None:
            problems.append(
                (
                    ("rpc", "host"),
                    "is missing: an rpc-worker binds ggml-rpc-server to a private address the "
                    "head reaches, e.g. 10.0.0.12 (the RPC protocol has no authentication, so "
                    "never a public one)",
                    MISSING,
                )
            )
        elif rpc["host"] in WILDCARD_HOSTS:
            problems.append(
                (
                    ("rpc", "host"),
                    f"{rpc['host']!r} would expose ggml-rpc-server, which has no "
                    "authentication, on every interface; name the private address the head "
                    "reaches, e.g. 10.0.0.12",
                )
            )
        if rpc["workers"]:
            problems.append(
                (("rpc", "workers"), "is for an rpc-head; a worker lends its devices to one")
            )
    elif rpc["workers"] and role != "rpc-head":
        problems.append(
            (
                ("role",),
                f"is `{role}` but rpc.workers lists {', '.join(rpc['workers'])}; set "
                "`role: rpc-head` to use them, or remove rpc.workers",
            )
        )
    elif role == "rpc-head":
        if not rpc["workers"]:
            problems.append(
                (
                    ("rpc", "workers"),
                    "is empty: an rpc-head names its worker hosts from this inventory, e.g. "
                    "[worker1]",
                    MISSING,
                )
            )
        if data["server"]["split_mode"] != "layer":
            problems.append(
                (
                    ("server", "split_mode"),
                    f"`{data['server']['split_mode']}` does not span hosts: RPC devices take "
                    "whole layers; use `layer`",
                )
            )
    return problems


def _json_problems(value: Any, key_path: tuple) -> list[tuple]:
    """What JSON cannot hold, in a setting passed as JSON: YAML's dates, sets and binary, a
    key that is not a string (`1:`, `true:`, `null:` would reach llama.cpp renamed) and a
    float that is not a number (.nan, .inf), each with its key path."""
    if isinstance(value, dict):
        problems = []
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(
                    (
                        (*key_path, key),
                        f"the key {key!r} is {_json_type(key)}; JSON keys are text: quote it "
                        f'("{key}")',
                    )
                )
            problems += _json_problems(item, (*key_path, key))
        return problems
    if isinstance(value, list):
        return [
            p for index, item in enumerate(value) for p in _json_problems(item, (*key_path, index))
        ]
    if isinstance(value, float) and not math.isfinite(value):
        return [(key_path, f"{value} is not a number JSON can hold; give a finite number")]
    if value is None or isinstance(value, str | int | float):
        return []
    return [
        (
            key_path,
            f"is {_json_type(value)}, which JSON cannot hold (the value is passed to llama-server "
            "as JSON); write it as a string, number, boolean, list or mapping",
        )
    ]


def _kv_problems(server: dict, split_mode: str, backend: str) -> list[tuple]:
    """KV cache types llama.cpp refuses with these attention and split settings."""
    problems: list[tuple] = []
    type_v = server["cache_type_v"]
    if type_v not in UNQUANTIZED_KV_TYPES and server["flash_attn"] == "off":
        problems.append(
            (
                ("server", "cache_type_v"),
                f"`{type_v}` is a quantized V cache, which llama.cpp refuses without flash "
                "attention (`quantized V cache requires flash_attn`), and `flash_attn` is "
                "`off`; set `flash_attn: auto` or a V type of f16, bf16 or f32",
            )
        )
    if split_mode == "tensor" and backend == "cuda":
        for key in ("cache_type_k", "cache_type_v"):
            if server[key] not in CUDA_FA_KV_TYPES:
                problems.append(
                    (
                        ("server", key),
                        f"`{server[key]}` has no CUDA flash-attention kernel at the pinned "
                        "llama.cpp, and `split_mode: tensor` forces flash attention on the GPUs; "
                        f"use one of {', '.join(CUDA_FA_KV_TYPES[1:])} (q8_0 halves the KV)",
                    )
                )
    return problems


def _version_problems(data: dict) -> list[tuple]:
    """Toolkit and driver choices that cannot serve the declared GPUs (the plan checks the
    probed GPUs and the installed driver the same way, through hardware.check_versions)."""
    problems: list[tuple] = []
    capabilities = sorted(
        {g["compute_capability"] for g in data["gpus"]}, key=hardware.parse_version
    )
    names = {g["compute_capability"]: g["name"] for g in data["gpus"]}
    cuda, driver = data["cuda"], data["driver"]
    if cuda["source"] != "none":
        version = hardware.parse_version(cuda["version"])
        for cc in capabilities:
            floor = hardware.ARCHITECTURE_FLOORS.get(cc)
            if floor and version < hardware.parse_version(floor.first_cuda):
                problems.append(
                    (
                        ("cuda", "version"),
                        f'"{cuda["version"]}" cannot build for {names[cc]} (compute {cc}, '
                        f"{floor.family}): it needs CUDA {floor.first_cuda} or newer; set "
                        f'`cuda.version: "{floor.first_cuda}"` or newer',
                    )
                )
        old = [
            cc
            for cc in capabilities
            if hardware.parse_version(cc) < hardware.parse_version(hardware.CUDA13_MIN_CAPABILITY)
        ]
        if version >= hardware.parse_version("13.0") and old:
            problems.append(
                (
                    ("cuda", "version"),
                    f'"{cuda["version"]}" dropped compute capability below '
                    f"{hardware.CUDA13_MIN_CAPABILITY} ({', '.join(names[cc] for cc in old)}); "
                    'set `cuda.version: "12.9"`',
                )
            )
    blackwell = [names[cc] for cc in capabilities if hardware.is_blackwell(cc)]
    if blackwell and driver["source"] != "none" and not driver["open"]:
        problems.append(
            (
                ("driver", "open"),
                f"`false` cannot drive {', '.join(blackwell)}: Blackwell works only with the "
                "open kernel modules; set `driver.open: true`",
            )
        )
    pre_turing = [
        names[cc]
        for cc in capabilities
        if hardware.parse_version(cc) < hardware.parse_version(hardware.OPEN_MODULES_MIN_CAPABILITY)
    ]
    if pre_turing and driver["source"] != "none" and driver["open"]:
        problems.append(
            (
                ("driver", "open"),
                f"`true` (the open kernel modules) needs Turing (7.5) or newer, not "
                f"{', '.join(pre_turing)}; set `driver.open: false` (the proprietary modules)",
            )
        )
    if blackwell and driver["source"] == "distro":
        problems.append(
            (
                ("driver", "source"),
                f"{hardware.DISTRO_DRIVER_NOTE} cannot drive {', '.join(blackwell)} (Blackwell "
                "needs >= 570.26 with open modules); set `driver.source: nvidia-repo`",
            )
        )
    if blackwell and cuda["source"] == "distro":
        problems.append(
            (
                ("cuda", "source"),
                f"{hardware.DISTRO_TOOLKIT_NOTE} cannot build for {', '.join(blackwell)} "
                "(Blackwell needs CUDA >= 12.8); set `cuda.source: nvidia-repo`",
            )
        )
    return problems


def _gpu_list_problems(gpus: list[dict]) -> list[tuple]:
    problems: list[tuple] = []
    seen: dict[str, int] = {}
    for index, gpu in enumerate(gpus):
        bus_id = gpu.get("pci_bus_id")
        if bus_id is None:
            continue
        # 0000:01:00.0, 00000000:01:00.0 and 01:00.0 are the same slot.
        slot = bus_id.lower().rsplit(":", 2)
        slot = ":".join([slot[0].lstrip("0") if len(slot) == 3 else "", *slot[-2:]])
        if slot in seen:
            problems.append(
                (
                    ("gpus", index, "pci_bus_id"),
                    f"{bus_id} is also the bus id of gpus.{seen[slot]}; each GPU has its own "
                    "(nvidia-smi --query-gpu=pci.bus_id --format=csv lists them)",
                )
            )
        else:
            seen[slot] = index
    return problems


# --- settings that contradict each other, llama.cpp or the hardware (issue 12) ----------------

# llama.cpp's most sequences per context (LLAMA_MAX_SEQ, src/llama-cparams.h at the pinned
# commit): `-np` above it fails at context creation (n_seq_max > 256).
LLAMA_MAX_SEQ = 256
# More MiB than any GPU has (the largest in the hardware table has about 180 GiB): a vram_mib
# above it was written in bytes or KiB.
MAX_PLAUSIBLE_VRAM_MIB = 4 << 20
# CMake cache entries llamarig derives, and the rig key that sets each.
DERIVED_CMAKE_OPTIONS = {
    "GGML_CUDA": "`llama_cpp.backend` (cuda or cpu)",
    "GGML_NATIVE": (
        "`llama_cpp.cuda_architectures` (llamarig turns GGML_NATIVE off: the build host's own "
        "GPUs are not the target's)"
    ),
    "CMAKE_CUDA_ARCHITECTURES": "`llama_cpp.cuda_architectures`",
    "CMAKE_CUDA_COMPILER": "`cuda.nvcc` (or `cuda.version` with `nvcc: auto`)",
    "GGML_RPC": "`role` (rpc-head and rpc-worker build with RPC)",
    "GGML_CCACHE": "`llama_cpp.ccache`",
}
_TOOLKIT_NVCC = re.compile(r"/cuda-(\d+\.\d+)/")


def _contradiction_problems(data: dict) -> list[tuple]:
    """Each rule below refuses one kind of setting that cannot work as written."""
    return [
        *_split_mode_none_problems(data["server"]),
        *_parallel_problems(data["server"]),
        *_gpu_table_problems(data["gpus"]),
        *_driver_branch_problems(data),
        *_cuda_architecture_problems(data),
        *_cmake_option_problems(data["llama_cpp"]["cmake_options"]),
        *_target_problems(data),
        *_nvcc_problems(data),
        *_model_location_problems(data),
        *_rpc_address_problems(data),
    ]


def _split_mode_none_problems(server: dict) -> list[tuple]:
    """One GPU serves with `split_mode: none`: a split over several contradicts it (a list
    with one non-zero share only picks that card)."""
    split = server["tensor_split"]
    if server["split_mode"] != "none" or not isinstance(split, list):
        return []
    if sum(1 for share in split if share) < 2:
        return []
    return [
        (
            ("server", "tensor_split"),
            f"{_shown(split)} splits the model over GPUs, but `split_mode: none` serves from "
            "one (the first of `gpus`): remove tensor_split (null), or set `split_mode: layer` "
            "or `tensor`",
        )
    ]


def _parallel_problems(server: dict) -> list[tuple]:
    if server["parallel"] <= LLAMA_MAX_SEQ:
        return []
    return [
        (
            ("server", "parallel"),
            f"{server['parallel']} slots are more than llama.cpp's {LLAMA_MAX_SEQ} sequences "
            "per context (LLAMA_MAX_SEQ; it fails at load with n_seq_max > 256): set at most "
            f"{LLAMA_MAX_SEQ}",
        )
    ]


def _gpu_table_problems(gpus: list[dict]) -> list[tuple]:
    """Declared GPUs against the hardware table: the capability of a known name, and memory
    that was written in bytes."""
    problems: list[tuple] = []
    for index, gpu in enumerate(gpus):
        model = hardware.gpu_named(gpu["name"])
        if model and model.compute_capability != gpu["compute_capability"]:
            problems.append(
                (
                    ("gpus", index, "compute_capability"),
                    f'"{gpu["compute_capability"]}" is not that of {gpu["name"]}, which is '
                    f'{model.compute_capability}: set `compute_capability: "'
                    f'{model.compute_capability}"` (or fix the name; nvidia-smi '
                    "--query-gpu=name,compute_cap --format=csv shows both)",
                )
            )
        for key in ("vram_mib", "usable_mib"):
            value = gpu.get(key)
            if value is not None and value > MAX_PLAUSIBLE_VRAM_MIB:
                problems.append(
                    (
                        ("gpus", index, key),
                        f"{value} is more MiB than any GPU has: it looks like bytes "
                        f"({value} bytes are {value >> 20} MiB); give MiB, as nvidia-smi "
                        "--query-gpu=memory.total --format=csv reports them",
                    )
                )
    return problems


def _driver_branch_problems(data: dict) -> list[tuple]:
    """The branch llamarig installs must run the toolkit and every declared GPU."""
    driver, cuda = data["driver"], data["cuda"]
    if driver["source"] not in ("nvidia-repo", "distro") or data["llama_cpp"]["backend"] != "cuda":
        return []
    capabilities = [gpu["compute_capability"] for gpu in data["gpus"]]
    toolkit = cuda["version"] if cuda["source"] != "none" else None
    problems: list[tuple] = []
    for needed, what in hardware.driver_floors(capabilities, toolkit):
        branch = hardware.parse_version(needed)[0]
        if driver["branch"] < branch:
            problems.append(
                (
                    ("driver", "branch"),
                    f"{driver['branch']} is below what {what} needs (driver {needed} or "
                    f"newer): set `driver.branch: {max(branch, 580)}` (R580 is the long-term "
                    "branch)",
                )
            )
    return problems


def _cuda_architecture_problems(data: dict) -> list[tuple]:
    """An explicit architecture list must hold code that runs on every declared GPU."""
    listed = data["llama_cpp"]["cuda_architectures"]
    if listed == "auto" or data["llama_cpp"]["backend"] != "cuda":
        return []
    archs = listed.split(";")
    problems: list[tuple] = []
    for gpu in data["gpus"]:
        cc = gpu["compute_capability"]
        if not any(hardware.architecture_runs_on(arch, cc) for arch in archs):
            problems.append(
                (
                    ("llama_cpp", "cuda_architectures"),
                    f'"{listed}" has no code that runs on {gpu["name"]} (compute {cc}; 12X '
                    "is built as 12Xa, which runs only on 12.X, and PTX alone is not enough): "
                    f'add "{hardware.cuda_architecture(cc)}", or set `auto`',
                )
            )
    return problems


def _cmake_option_problems(options: dict) -> list[tuple]:
    return [
        (
            ("llama_cpp", "cmake_options", name),
            f"is derived by llamarig, and this would override it: set "
            f"{DERIVED_CMAKE_OPTIONS[name]} instead",
        )
        for name in options
        if name in DERIVED_CMAKE_OPTIONS
    ]


def _target_problems(data: dict) -> list[tuple]:
    if data["role"] == "rpc-worker" or "llama-server" in data["llama_cpp"]["targets"]:
        return []
    return [
        (
            ("llama_cpp", "targets"),
            f"{_shown(data['llama_cpp']['targets'])} lacks llama-server, which this "
            f"`{data['role']}` host serves with: add it (e.g. [llama-server, llama-bench])",
        )
    ]


def _nvcc_problems(data: dict) -> list[tuple]:
    cuda = data["cuda"]
    match = _TOOLKIT_NVCC.search(cuda["nvcc"])
    if cuda["source"] == "none" or not match or match.group(1) == cuda["version"]:
        return []
    return [
        (
            ("cuda", "nvcc"),
            f"{cuda['nvcc']} is the nvcc of CUDA {match.group(1)}, but `cuda.version` is "
            f'"{cuda["version"]}": set `cuda.nvcc: auto` (or the version that path holds)',
        )
    ]


def _model_location_problems(data: dict) -> list[tuple]:
    """Model files must live where no deploy step deletes them, and URLs must name the file."""
    problems: list[tuple] = []
    prefix = PurePosixPath(os.path.normpath(data["paths"]["prefix"]))
    wiped = {
        prefix / "src" / "llama.cpp": "the llama.cpp checkout, which `git clean -ffdx` empties "
        "on every update",
        prefix / "builds": "the build directories, which llamarig deletes past "
        "`llama_cpp.keep_builds`",
    }
    for key_path, value in (
        (("paths", "models"), data["paths"]["models"]),
        (("model", "path"), data["model"]["path"]),
    ):
        if not value:
            continue
        where = PurePosixPath(os.path.normpath(value))
        for directory, what in wiped.items():
            if where == directory or directory in where.parents:
                problems.append(
                    (
                        key_path,
                        f"{value} is inside {directory}, {what}; keep models outside "
                        f"{prefix}/src and {prefix}/builds (the default is {prefix}/models)",
                    )
                )
    url = data["model"]["url"] or ""
    if re.match(r"^https?://(www\.)?huggingface\.co/", url) and "/blob/" in url:
        problems.append(
            (
                ("model", "url"),
                "is a Hugging Face page (/blob/), which serves HTML, not the file: use "
                f"/resolve/ ({url.replace('/blob/', '/resolve/', 1)})",
            )
        )
    return problems


def _rpc_address_problems(data: dict) -> list[tuple]:
    """The RPC protocol has no authentication: a worker binds a private address, unless the
    user says the network in between is theirs (rpc.allow_public)."""
    rpc = data["rpc"]
    if data["role"] != "rpc-worker" or not rpc["host"] or rpc["allow_public"]:
        return []
    try:
        address = ipaddress.ip_address(rpc["host"])
    except ValueError:
        return []  # a name: where it points is not known before connecting
    if address.is_private or address.is_link_local or address.is_loopback:
        return []
    return [
        (
            ("rpc", "host"),
            f"{rpc['host']} is a public address, and ggml-rpc-server has no authentication or "
            "encryption: bind a private, link-local or loopback address the head reaches "
            "(e.g. 10.0.0.12), or set `rpc.allow_public: true` if the network in between is "
            "yours alone",
        )
    ]


def model_filename(data: dict) -> str:
    """File name of the model on the host: explicit, else the URL's or path's last part."""
    model = data["model"]
    if model["filename"]:
        return model["filename"]
    if model["url"]:
        return url_file_name(model["url"])
    return (model["path"] or "").rstrip("/").rsplit("/", 1)[-1]


def expand_path(path: str) -> str:
    """``~`` and ``~user`` expanded; a path that cannot be (an unknown user) is kept as given."""
    try:
        return os.path.expanduser(path)
    except (ValueError, KeyError, OSError):
        return path


def _key_file_text(path: str) -> str:
    """The start of a local key file, or "" when it is missing, unreadable or not a file."""
    try:
        if not os.path.isfile(path):
            return ""
        with open(path, encoding="utf-8", errors="replace") as key_file:
            return key_file.read(65536)
    except (OSError, ValueError):
        return ""


def strict_host_key_checking(ssh: dict) -> str:
    """OpenSSH's ``StrictHostKeyChecking`` value for a host's `ssh` settings, which pyinfra's
    ``ssh_strict_host_key_checking`` takes too: ``yes``, unless the user opted in to
    ``host_key_checking: accept-new`` (any other value stays strict)."""
    return "accept-new" if ssh.get("host_key_checking") == "accept-new" else "yes"


def _host_key_known(known_hosts: str, host: str, port: int) -> bool | None:
    """Whether ``known_hosts`` holds a key for host:port, looked up as pyinfra (paramiko) will:
    the name ``host`` or ``[host]:port``, hashed entries included, after ~/.ssh/config's
    ``HostName``. None when that cannot be told for sure (an unreadable file, @cert-authority
    or @revoked lines, an ssh config with Include), so that nothing is refused on a guess."""
    import paramiko

    try:
        text = Path(known_hosts).read_text(encoding="utf-8", errors="replace")
        if any(line.lstrip().startswith("@") for line in text.splitlines()):
            return None
        config = Path(os.path.expanduser("~/.ssh/config"))
        if config.is_file():
            config_text = config.read_text(encoding="utf-8", errors="replace")
            if "include" in config_text.lower():
                return None
            host = paramiko.SSHConfig.from_text(config_text).lookup(host).get("hostname", host)
        keys = paramiko.HostKeys()
        keys.load(known_hosts)
    except Exception:  # any doubt: leave the verdict to the connection
        return None
    return keys.lookup(host if port == 22 else f"[{host}]:{port}") is not None


def connection_problems(inventory: Inventory) -> list[str]:
    """What this machine must have before pyinfra connects: the files named in `ssh`, and with
    strict host-key checking, the host's key in the `known_hosts` file."""
    problems = []
    for host_config in inventory.hosts.values():
        ssh = host_config.data.get("ssh") or {}
        accept_new = strict_host_key_checking(ssh) == "accept-new"
        sandbox = " or run `llamarig sandbox up`"
        for key, what in (("key", "private key"), ("known_hosts", "known_hosts file")):
            if key not in ssh:
                continue
            path = expand_path(ssh[key])
            if os.path.isfile(path):
                continue
            if key == "known_hosts" and accept_new and os.path.isdir(os.path.dirname(path) or "."):
                continue  # accept-new creates it on first contact
            problems.append(
                _located(
                    host_config,
                    ("ssh", key),
                    f"the {what} {ssh[key]} does not exist on this machine; fix the path"
                    + (sandbox if "llamarig" in ssh[key] else "")
                    + (
                        " (or, to enroll a new box, create its directory and set "
                        "`ssh.host_key_checking: accept-new` for the first run)"
                        if key == "known_hosts"
                        else ""
                    ),
                )
            )
        if ssh.get("local") or accept_new or not ssh.get("host"):
            continue
        known_hosts = ssh.get("known_hosts") or _default_known_hosts()
        if not known_hosts:
            continue
        path = expand_path(known_hosts)
        port = ssh.get("port", 22)
        if os.path.isfile(path):
            known = _host_key_known(path, ssh["host"], port)
        elif "known_hosts" in ssh:
            continue  # a missing file named in the inventory is reported above
        else:  # no ~/.ssh/known_hosts: paramiko knows no key at all
            known = False
        if known is False:
            name = ssh["host"] if port == 22 else f"[{ssh['host']}]:{port}"
            problems.append(
                _located(
                    host_config,
                    ("ssh", "known_hosts"),
                    f"{known_hosts} has no key for {name}, and host keys are checked strictly: "
                    "add the box's key first (docs/inventory.md, Enrolling a new box: "
                    "`ssh-keyscan` it and compare the fingerprint with the box's console), or set "
                    "`ssh.host_key_checking: accept-new` for the first run",
                    in_inventory="known_hosts" not in ssh,
                )
            )
    return problems


DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def _default_known_hosts() -> str | None:
    """The file pyinfra checks host keys against when `ssh.known_hosts` is not set: the user's
    ~/.ssh/known_hosts (after $HOME), or None where ~/.ssh/config may name another
    (UserKnownHostsFile, or an Include that could), so that nothing is refused on a guess."""
    config = Path(os.path.expanduser("~/.ssh/config"))
    try:
        text = config.read_text(encoding="utf-8", errors="replace").lower()
    except FileNotFoundError:
        return DEFAULT_KNOWN_HOSTS
    except OSError:
        return None
    return None if "userknownhostsfile" in text or "include" in text else DEFAULT_KNOWN_HOSTS


def rig_data(host_data: dict) -> dict:
    """The rig keys of pyinfra host data, validated (for deploys run without inventory.py)."""
    keys = schema()["properties"].keys()
    data = {key: copy.deepcopy(host_data[key]) for key in keys if key in host_data}
    host_config = HostConfig("this-host", [], data)
    problems = validate_host(host_config)
    if problems:
        raise ConfigError(problems)
    return data
