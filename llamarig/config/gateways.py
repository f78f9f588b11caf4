"""The team endpoint across the inventory: the hosts of the `gateways` group, the rigs each
fronts, the keys and certificate files each reads on this machine, and what llamarig derives
from them (each gateway's backends, one per model name; each rig's gateway keys).

Everything a user writes here ends up in HAProxy's configuration or in a file beside it, so
every value is checked into a safe shape first: names by the schema's pattern, addresses by
``shapes``, keys by ``KEY``, files by what they must hold."""

from __future__ import annotations

import re

from llamarig.config.addresses import WILDCARD_HOSTS, is_loopback
from llamarig.config.crosshost import machine_box
from llamarig.config.hosts import HostConfig
from llamarig.config.paths import expand_path, local_file_text
from llamarig.config.problems import Problem, did_you_mean, located
from llamarig.model.catalog import is_router, model_alias, model_views

GATEWAYS_GROUP = "gateways"
# A key clients send in `Authorization: Bearer`: one token of URL-safe or base64 characters,
# at least 32 of them (128 bits as hex): the gateway keeps an unsalted SHA-256 of it, which
# only a long random key makes safe to keep.
KEY = re.compile(r"[A-Za-z0-9._~+/=-]{32,512}")
KEY_FIX = "write one key of at least 32 characters to it (e.g. openssl rand -hex 32 > FILE)"
_PEM_CERTIFICATE = "-----BEGIN CERTIFICATE-----"
_PEM_KEY = re.compile(r"-----BEGIN (?:EC |RSA |ENCRYPTED )?PRIVATE KEY-----")
# Derived keys, with what the user sets instead.
DERIVED_GATEWAY_KEYS = {
    "backends": "is derived from the rigs the gateway fronts (their model names, addresses "
    "and slots); set `gateway.fronts` and the rigs' own settings instead",
}
DERIVED_SERVER_KEYS = {
    "gateway_key_files": "is derived from the gateways that front this rig (their "
    "`gateway.rig_key_file`); set it on the gateway instead",
    "gateways": "is derived from the gateways that front this rig (each gateway host and the "
    "HAProxy servers that are this rig); set `gateway.fronts` on the gateway instead",
}


def read_key(path: str) -> str | None:
    """The one key a key file holds, or None when it holds anything else."""
    lines = local_file_text(expand_path(path)).splitlines()
    lines = [line.strip() for line in lines if line.strip()]
    if len(lines) == 1 and KEY.fullmatch(lines[0]):
        return lines[0]
    return None


def runs_gateway(data: dict) -> bool:
    """Whether a host's (derived) data makes it a gateway: derive_gateways gave it backends."""
    return "backends" in data["gateway"]


def serves_models(data: dict) -> bool:
    """A host whose llama-server answers requests: not a worker, not a gateway alone."""
    return data["role"] in ("standalone", "rpc-head")


def _fronted(gateway: HostConfig, hosts: dict, groups: dict) -> list[HostConfig]:
    group = gateway.data["gateway"]["fronts"]
    names = groups.get(group, []) if group else list(hosts)
    return [hosts[name] for name in names if serves_models(hosts[name].data)]


def rig_address(rig: HostConfig, gateway: HostConfig) -> str:
    """Where ``gateway`` reaches ``rig``'s llama-server: its listen address, else (a wildcard)
    the address it is reached at over SSH, loopback on one machine."""
    server_host = rig.data["server"]["host"]
    if server_host not in WILDCARD_HOSTS:
        return server_host
    if machine_box(rig.data) == machine_box(gateway.data):
        return "127.0.0.1"
    return rig.data["ssh"]["host"]


def _key_file_problem(key_path: tuple, path: str | None, what: str) -> Problem | None:
    if not path:
        # The defaults leave it empty: the fix is in the inventory, not in group_data/all.yml.
        return Problem(
            key_path, f"is missing: give the file that holds {what}; {KEY_FIX}", in_inventory=True
        )
    if read_key(path) is None:
        return Problem(
            key_path,
            f"{expand_path(path)} does not hold one key of 32 to 512 characters from A-Z a-z "
            f"0-9 and -._~+/= (it is missing, empty, or holds more); {KEY_FIX}",
        )
    return None


def _settings_problems(data: dict) -> list[Problem]:
    """One gateway's own settings: its address, its keys and its certificate files."""
    gateway = data["gateway"]
    problems: list[Problem] = []
    if data["role"] in ("rpc-worker", "builder"):
        problems.append(
            Problem(
                ("role",),
                f"is {data['role']}, which serves no API; a gateway is a standalone "
                "rig, an rpc-head or `role: gateway` (a box of its own)",
            )
        )
    if not gateway["host"]:
        problems.append(
            Problem(
                ("gateway", "host"),
                "is missing: give the address clients reach the "
                "gateway at (0.0.0.0 for every address)",
                in_inventory=True,
            )
        )
    problems += filter(
        None,
        [
            _key_file_problem(
                ("gateway", "rig_key_file"),
                gateway["rig_key_file"],
                "the key the gateway sends to rigs",
            )
        ],
    )
    keys: dict[str, str] = {}
    rig_key = gateway["rig_key_file"] and read_key(gateway["rig_key_file"])
    seen: set[str] = set()
    for index, user in enumerate(gateway["users"]):
        where = ("gateway", "users", index)
        if user["name"] in seen:
            problems.append(
                Problem(
                    (*where, "name"), f"{user['name']!r} is listed twice; give each user one entry"
                )
            )
        seen.add(user["name"])
        problem = _key_file_problem((*where, "key_file"), user["key_file"], "the user's key")
        if problem:
            problems.append(problem)
            continue
        key = read_key(user["key_file"])
        if key == rig_key:
            problems.append(
                Problem(
                    (*where, "key_file"),
                    "holds the gateway's own key for the "
                    "rigs (gateway.rig_key_file); give the user a key of their own",
                )
            )
        elif key in keys:
            problems.append(
                Problem(
                    (*where, "key_file"),
                    f"holds the same key as user "
                    f"{keys[key]!r}; give each user a key of their own (a key names "
                    "its user in the log and on revocation)",
                )
            )
        else:
            keys[key] = user["name"]
    return problems + _tls_problems(gateway["tls"]) + _port_problems(data)


def _tls_problems(tls: dict) -> list[Problem]:
    cert, key = tls["cert_file"], tls["key_file"]
    if bool(cert) != bool(key):
        given, missing = ("cert_file", "key_file") if cert else ("key_file", "cert_file")
        return [
            Problem(
                ("gateway", "tls", missing),
                f"is missing while `{given}` is given; give "
                "both (your certificate) or neither (a self-signed pair made on the "
                "gateway)",
                in_inventory=True,  # the missing one is the defaults' null
            )
        ]
    problems = []
    if cert and _PEM_CERTIFICATE not in local_file_text(expand_path(cert)):
        problems.append(
            Problem(
                ("gateway", "tls", "cert_file"),
                f"{expand_path(cert)} holds no "
                "PEM certificate (-----BEGIN CERTIFICATE-----); give the "
                "certificate file (with its chain)",
            )
        )
    if key and not _PEM_KEY.search(local_file_text(expand_path(key))):
        problems.append(
            Problem(
                ("gateway", "tls", "key_file"),
                f"{expand_path(key)} holds no "
                "PEM private key (-----BEGIN PRIVATE KEY-----); give the "
                "certificate's key file",
            )
        )
    if cert and tls["names"]:
        problems.append(
            Problem(
                ("gateway", "tls", "names"),
                "names a self-signed certificate's "
                "addresses, but cert_file is given (its names are its own); "
                "remove `names`",
            )
        )
    return problems


def _port_problems(data: dict) -> list[Problem]:
    """The gateway's two ports against each other and against what else listens on its host:
    sshd, and its own llama-server on a rig that runs the gateway too (the second to start
    would fail to bind, mid-deploy)."""
    gateway, ssh = data["gateway"], data.get("ssh") or {}
    taken: dict[int, str] = {}
    if not ssh.get("local") and ssh.get("host"):
        taken[ssh.get("port", 22)] = "the host's SSH port (ssh.port)"
    if serves_models(data):
        taken.setdefault(data["server"]["port"], "this rig's server.port")
    problems = []
    for key_path, port, what, default in (
        (("gateway", "port"), gateway["port"], "the gateway", 8443),
        (("gateway", "metrics", "port"), gateway["metrics"]["port"], "the exporter", 8405),
    ):
        if port in taken:
            problems.append(
                Problem(
                    key_path,
                    f"{port} is also {taken[port]}; give {what} a port of its own "
                    f"(default {default})",
                )
            )
        taken.setdefault(port, "gateway.port")
    return problems


def gateway_problems(hosts: dict[str, HostConfig], groups: dict[str, list[str]]) -> list[str]:
    """Every gateway's settings and the rigs it fronts, the derived keys nobody may set, and
    `role: gateway` only in the `gateways` group; each problem located."""
    problems = []
    members = set(groups.get(GATEWAYS_GROUP, []))
    for host_config in hosts.values():
        for section, derived in (
            ("gateway", DERIVED_GATEWAY_KEYS),
            ("server", DERIVED_SERVER_KEYS),
        ):
            problems += [
                located(host_config, Problem((section, key), message, in_inventory=True))
                for key, message in derived.items()
                if key in host_config.data[section]
            ]
        if host_config.data["role"] == "gateway" and host_config.name not in members:
            problems.append(
                located(
                    host_config,
                    Problem(
                        ("role",),
                        "is `gateway`, but the host "
                        f"is not in the `{GATEWAYS_GROUP}` group; list it under `all: "
                        f"children: {GATEWAYS_GROUP}: hosts:`",
                        in_inventory=True,
                    ),
                )
            )
    for name in sorted(members):
        gateway = hosts[name]
        problems += [located(gateway, p) for p in _settings_problems(gateway.data)]
        problems += [located(gateway, p) for p in _fronts_problems(gateway, hosts, groups)]
        for rig in _fronted(gateway, hosts, groups):
            problems += [located(rig, p) for p in _fronted_rig_problems(rig, gateway)]
    return problems


def _fronts_problems(gateway: HostConfig, hosts: dict, groups: dict) -> list[Problem]:
    group = gateway.data["gateway"]["fronts"]
    if group and group not in groups:
        return [
            Problem(
                ("gateway", "fronts"),
                f"names the group `{group}`, which this "
                f"inventory does not have ({did_you_mean(group, list(groups))})",
            )
        ]
    if not _fronted(gateway, hosts, groups):
        where = f"the group `{group}`" if group else "this inventory"
        return [
            Problem(
                ("gateway", "fronts"),
                f"{where} has no rig that serves a model "
                "(standalone or rpc-head) for the gateway to front",
                in_inventory=True,
            )
        ]
    return _same_name_problems(gateway, hosts, groups)


def _same_name_problems(gateway: HostConfig, hosts: dict, groups: dict) -> list[Problem]:
    """Rigs behind one model name serve the same file: a client that names a model gets it
    whichever rig answers."""
    digests: dict[str, tuple[str, object]] = {}
    problems = []
    for rig in _fronted(gateway, hosts, groups):
        for name, data in _served(rig.data):
            model = data["model"]
            # The sha256 when given, else what names the file: a Hub file (repo, file or
            # quant, revision), a path on the host.
            digest = model["sha256"] or (
                (model["hf"], model["file"], model["quant"], model["revision"])
                if model["hf"]
                else model["path"]
            )
            first = digests.setdefault(name, (rig.name, digest))
            if first[1] != digest:
                problems.append(
                    Problem(
                        ("gateway", "fronts"),
                        f"rigs `{first[0]}` and "
                        f"`{rig.name}` both serve a model named {name!r}, but not the "
                        "same file; give one of them another name (server.alias or the "
                        "entry's name)",
                        # The fix is the rigs' (in the inventory), whichever file set `fronts`.
                        in_inventory=True,
                    )
                )
    return problems


def _fronted_rig_problems(rig: HostConfig, gateway: HostConfig) -> list[Problem]:
    server = rig.data["server"]
    problems = []
    if not server["api_key_file"]:
        problems.append(
            Problem(
                ("server", "api_key_file"),
                f"is missing, and gateway "
                f"`{gateway.name}` fronts this rig: give the rig a key of its own (for "
                "llamarig and its operators; the gateway sends another)",
                in_inventory=True,
            )
        )
    if is_loopback(server["host"]) and machine_box(rig.data) != machine_box(gateway.data):
        problems.append(
            Problem(
                ("server", "host"),
                f"{server['host']} is loopback, which "
                f"gateway `{gateway.name}` on another box ({machine_box(gateway.data)}) "
                "cannot reach: listen on the rig's private address the gateway "
                "reaches, e.g. 10.0.0.12",
            )
        )
    return problems


def _served(data: dict) -> list[tuple[str, dict]]:
    """Each model name a rig answers to, with that model's one-model data."""
    if is_router(data):
        return [(view.name, view.data) for view in model_views(data)]
    return [(model_alias(data), data)]


def derive_gateways(hosts: dict[str, HostConfig], groups: dict[str, list[str]]) -> None:
    """Write each gateway's `gateway.backends` (a model name, the rigs that serve it: where,
    and how many requests at once) and each fronted rig's `server.gateway_key_files`; run
    after the checks passed."""
    for name in groups.get(GATEWAYS_GROUP, []):
        gateway = hosts[name]
        backends: dict[str, list[dict]] = {}
        for rig in _fronted(gateway, hosts, groups):
            for model, data in _served(rig.data):
                backends.setdefault(model, []).append(
                    {
                        "name": rig.name,
                        "address": rig_address(rig, gateway),
                        "port": rig.data["server"]["port"],
                        "slots": data["server"]["parallel"],
                    }
                )
            keys = rig.data["server"].setdefault("gateway_key_files", [])
            if gateway.data["gateway"]["rig_key_file"] not in keys:
                keys.append(gateway.data["gateway"]["rig_key_file"])
        gateway.data["gateway"]["backends"] = [
            {"model": model, "servers": servers} for model, servers in sorted(backends.items())
        ]
        _derive_rotation(gateway, hosts)


def backend_id(index: int) -> str:
    """HAProxy's name of a gateway's backend: its place in `gateway.backends`."""
    return f"model_{index}"


def _derive_rotation(gateway: HostConfig, hosts: dict[str, HostConfig]) -> None:
    """Each fronted rig's `server.gateways`: the gateway and the HAProxy servers (BACKEND/
    SERVER) that are this rig there, which a restart of the rig takes out of rotation first."""
    servers: dict[str, list[str]] = {}
    for index, backend in enumerate(gateway.data["gateway"]["backends"]):
        for server in backend["servers"]:
            servers.setdefault(server["name"], []).append(f"{backend_id(index)}/{server['name']}")
    for rig_name, names in servers.items():
        hosts[rig_name].data["server"].setdefault("gateways", []).append(
            {"host": gateway.name, "servers": names}
        )
