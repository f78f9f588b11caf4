"""Rig configuration: load the Ansible-style YAML inventory, merge defaults, validate.

Every mistake a user can make in the YAML is reported as a :class:`ConfigError` naming the file,
the key path (``hosts.rig1.server.tensor_split``), what is wrong and what would be right, before
any host is contacted.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from jsonschema import Draft202012Validator

from llamarig import PACKAGE_DIR, PROJECT_DIR

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
    groups: list[str]
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


def load_yaml(path: Path) -> Any:
    """Parse a YAML file; syntax errors become a ConfigError with the line and column."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            [f"{path}: file not found (set {INVENTORY_ENV} to an inventory file)"]
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        raise ConfigError([f"{path}{where}: YAML syntax error: {problem}"]) from None


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


def load_inventory(path: Path | None = None) -> Inventory:
    """Load, merge and validate every host of an inventory file.

    Raises ConfigError listing every problem of every host at once.
    """
    path = path or inventory_path()
    document = load_yaml(path)
    problems: list[str] = []
    if not isinstance(document, dict) or not isinstance(document.get("all"), dict):
        raise ConfigError(
            [
                f"{path}: the top level must be `all:` with `children:` and/or `hosts:` "
                "(Ansible YAML inventory layout)"
            ]
        )

    hosts: dict[str, HostConfig] = {}
    groups: dict[str, list[str]] = {}
    base_origins: dict[tuple, str] = {}
    defaults_name = str(DEFAULTS_PATH.relative_to(PROJECT_DIR))
    _record_origins(_defaults_cached(), defaults_name, (), base_origins)

    def walk(group_name: str, node: Any, inherited: dict, origins: dict, key_path: str) -> None:
        if node is None:
            node = {}
        if not isinstance(node, dict):
            problems.append(f"{path}: {key_path}: a group is a mapping of vars/hosts/children")
            return
        unknown = set(node) - {"vars", "hosts", "children"}
        for key in sorted(unknown):
            problems.append(
                f"{path}: {key_path}.{key}: unknown group key; a group has `vars`, `hosts` and "
                "`children` (host settings go under `hosts: NAME:` or `vars:`)"
            )
        group_vars = node.get("vars") or {}
        if not isinstance(group_vars, dict):
            problems.append(f"{path}: {key_path}.vars: must be a mapping of settings")
            group_vars = {}
        data = deep_merge(inherited, group_vars)
        group_origins = dict(origins)
        _record_origins(group_vars, str(path), (), group_origins)
        # Hosts directly under `all` form Ansible's implicit `ungrouped` group.
        members = groups.setdefault("ungrouped" if group_name == "all" else group_name, [])
        for host_name, host_vars in (node.get("hosts") or {}).items():
            host_vars = host_vars or {}
            if not isinstance(host_vars, dict):
                problems.append(f"{path}: hosts.{host_name}: must be a mapping of settings")
                continue
            members.append(host_name)
            if host_name in hosts:
                hosts[host_name].groups.append(group_name)
                continue
            host_origins = dict(group_origins)
            _record_origins(host_vars, str(path), (), host_origins)
            hosts[host_name] = HostConfig(
                host_name, [group_name], deep_merge(data, host_vars), host_origins
            )
        for child_name, child in (node.get("children") or {}).items():
            walk(child_name, child, data, group_origins, f"children.{child_name}")

    walk("all", document["all"], _defaults_cached(), base_origins, "all")
    groups = {name: members for name, members in groups.items() if members}
    if not hosts and not problems:
        problems.append(f"{path}: no hosts defined (add `all: children: GROUP: hosts: NAME: ...`)")
    for host_config in hosts.values():
        problems.extend(validate_host(host_config))
    if problems:
        raise ConfigError(problems)
    return Inventory(path, hosts, groups)


def validate_host(host_config: HostConfig) -> list[str]:
    """Schema and cross-field checks of one host; returns the problems found."""
    problems = []
    validator = Draft202012Validator(schema())
    errors = sorted(validator.iter_errors(host_config.data), key=lambda e: list(e.absolute_path))
    for error in errors:
        problems.append(_describe_schema_error(host_config, error))
    if not problems:
        problems.extend(
            _located(host_config, key_path, message)
            for key_path, message in semantic_problems(host_config.data)
        )
    return problems


def _origin_of(host_config: HostConfig, key_path: tuple) -> str:
    for length in range(len(key_path), -1, -1):
        origin = host_config.origins.get(tuple(key_path[:length]))
        if origin:
            return origin
    return "?"


def _located(host_config: HostConfig, key_path: tuple, message: str) -> str:
    dotted = ".".join(str(part) for part in key_path)
    origin = _origin_of(host_config, key_path)
    return f"{origin}: hosts.{host_config.name}.{dotted}: {message}"


def _describe_schema_error(host_config: HostConfig, error) -> str:
    key_path = tuple(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        parts = []
        for key in extra:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(allowed)}"
            parts.append(_located(host_config, (*key_path, key), f"unknown key `{key}`; {hint}"))
        return "\n".join(parts)
    if error.validator == "required":
        return _located(host_config, key_path, f"{error.message}; add it or remove the override")
    description = error.schema.get("description") if isinstance(error.schema, dict) else None
    expected = description
    if error.validator == "enum":
        wrong = f"{error.instance!r} is not allowed"
        expected = description or ", ".join(map(str, error.validator_value))
    elif error.validator == "type":
        wrong = f"{error.instance!r} is {_json_type(error.instance)}"
    elif error.validator == "pattern":
        wrong = f"{error.instance!r} has the wrong form"
    elif error.validator in ("minimum", "maximum", "minLength", "minItems"):
        wrong = f"{error.instance!r} is out of range ({error.message})"
    else:
        wrong = f"{error.instance!r} is not valid"
    text = f"{wrong}; expected {expected}" if expected else wrong
    return _located(host_config, key_path, text)


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
    }
    return names.get(type(value), type(value).__name__)


def semantic_problems(data: dict) -> list[tuple[tuple, str]]:
    """Cross-field rules the schema cannot state. Returns (key path, message) pairs."""
    problems: list[tuple[tuple, str]] = []
    model, server, gpus = data["model"], data["server"], data["gpus"]
    backend = data["llama_cpp"]["backend"]

    ssh = data.get("ssh") or {}
    if not ssh.get("local") and not ssh.get("host"):
        problems.append(
            (
                ("ssh",),
                "needs `host` (and usually `port`, `user`, `key`, "
                "`known_hosts`), or `local: true` to converge this machine",
            )
        )

    if bool(model["url"]) == bool(model["path"]):
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
            )
        )
    if model["url"] and not model["filename"] and not model_filename(data).endswith(".gguf"):
        problems.append(
            (
                ("model", "filename"),
                "cannot be taken from the URL (it does not end "
                "in .gguf); set `filename: NAME.gguf`",
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
    split = server["tensor_split"]
    if isinstance(split, list):
        if not any(split):
            problems.append((("server", "tensor_split"), "needs at least one non-zero share"))
        if gpus and len(split) != len(gpus):
            problems.append(
                (
                    ("server", "tensor_split"),
                    f"has {len(split)} entries for "
                    f"{len(gpus)} declared GPUs; give one share per GPU, in `gpus` order",
                )
            )
    if split is not None and backend == "cpu":
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
        key_file = os.path.expanduser(server["api_key_file"])
        if not os.path.isfile(key_file) or not Path(key_file).read_text().strip():
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
    return problems


def model_filename(data: dict) -> str:
    """File name of the model on the host: explicit, else the URL's or path's last part."""
    model = data["model"]
    if model["filename"]:
        return model["filename"]
    source = model["url"] or model["path"] or ""
    return source.split("?", 1)[0].rstrip("/").rsplit("/", 1)[-1]


def pyinfra_host(host_config: HostConfig) -> tuple[str, dict]:
    """The (name, data) pair pyinfra's inventory expects, with SSH settings mapped."""
    data = copy.deepcopy(host_config.data)
    ssh = data.get("ssh") or {}
    if ssh.get("local"):
        return "@local", data
    connection = {
        "ssh_hostname": ssh["host"],
        "ssh_port": ssh.get("port", 22),
        # Host keys are always checked: a rig holds API keys and model files.
        "ssh_strict_host_key_checking": "yes",
    }
    if "user" in ssh:
        connection["ssh_user"] = ssh["user"]
    if "key" in ssh:
        connection["ssh_key"] = os.path.expanduser(ssh["key"])
    if "known_hosts" in ssh:
        connection["ssh_known_hosts_file"] = os.path.expanduser(ssh["known_hosts"])
    return host_config.name, {**data, **connection}


def connection_problems(inventory: Inventory) -> list[str]:
    """Files named in `ssh` that this machine must have before pyinfra connects."""
    problems = []
    for host_config in inventory.hosts.values():
        ssh = host_config.data.get("ssh") or {}
        for key, what in (("key", "private key"), ("known_hosts", "known_hosts file")):
            if key in ssh and not os.path.isfile(os.path.expanduser(ssh[key])):
                problems.append(
                    _located(
                        host_config,
                        ("ssh", key),
                        f"the {what} {ssh[key]} does not exist "
                        "on this machine; fix the path"
                        + (" or run `llamarig sandbox up`" if "llamarig" in ssh[key] else ""),
                    )
                )
    return problems


def rig_data(host_data: dict) -> dict:
    """The rig keys of pyinfra host data, validated (for deploys run without inventory.py)."""
    keys = schema()["properties"].keys()
    data = {key: copy.deepcopy(host_data[key]) for key in keys if key in host_data}
    host_config = HostConfig("this-host", [], data)
    problems = validate_host(host_config)
    if problems:
        raise ConfigError(problems)
    return data
