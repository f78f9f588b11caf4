"""What a gateway's HAProxy is given, from its validated data (never raw user text): the
configuration's values, the users' key hashes, the key it sends to the rigs, and the answer to
GET /v1/models. The names in them passed the schema's patterns; the addresses ``shapes``."""

from __future__ import annotations

import hashlib
import json

from llamarig.config.addresses import WILDCARD_HOSTS
from llamarig.config.gateways import backend_id, read_key, runs_gateway
from llamarig.onhost import hostpaths
from llamarig.planner.render import render_env_file, render_file, render_unit
from llamarig.tables.text import printable

SERVICE = "haproxy.service"
PACKAGES = ["haproxy", "socat", "openssl"]
# The POST paths a team needs; everything else at the gateway is a 404 (the rigs' /slots,
# /props and /metrics stay theirs).
API_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
CONNECT_TIMEOUT_S = 5
# Where the deploy copies each gateway's certificate (HOST.crt), beside the inventory file.
CERTIFICATES_DIR = "gateway-certs"
# Where the backup server that holds requests "connects": a loopback port nothing listens on,
# below 1024 so that only root could (it would get the rigs' key). A refused TCP connection
# is retried about a second later; a Unix socket that does not exist was retried at once, 60
# times in a millisecond (HAProxy 2.6). Its name, `_hold`, is no inventory host's (they begin
# with a letter or digit).
HOLD_SERVER = "_hold"
HOLD_ADDRESS = "127.0.0.1:1"


def _address(address: str) -> str:
    """An address as a URL writes it (the plan's lines); the template brackets its own."""
    return f"[{address}]" if ":" in address else address


def config_context(data: dict) -> dict:
    """The values files/haproxy.cfg.j2 is rendered from (addresses raw: it brackets IPv6)."""
    gateway = data["gateway"]
    backends = [
        {
            "id": backend_id(index),
            "model": backend["model"],
            "servers": [
                {
                    "name": server["name"],
                    "address": server["address"],
                    "port": server["port"],
                    "maxconn": server["slots"],
                }
                for server in backend["servers"]
            ],
        }
        for index, backend in enumerate(gateway["backends"])
    ]
    return {
        "listen_host": gateway["host"],
        "listen_port": gateway["port"],
        "tls_pem": hostpaths.GATEWAY_TLS_PEM,
        "users_map": hostpaths.GATEWAY_USERS_MAP,
        "rig_key_map": hostpaths.GATEWAY_RIG_KEY_MAP,
        "models_json": hostpaths.GATEWAY_MODELS_JSON,
        "known_models_json": json.dumps([backend["model"] for backend in backends]),
        "queue_timeout": gateway["queue_timeout"],
        # A retry comes about a second after a failed connection (timeout connect is longer).
        "hold_retries": gateway["hold_timeout"],
        "hold_address": HOLD_ADDRESS,
        "hold_server": HOLD_SERVER,
        "connect_timeout": CONNECT_TIMEOUT_S,
        "idle_timeout": gateway["idle_timeout"],
        "body_limit": gateway["max_body_kib"] * 1024,
        "maxconn": gateway["max_connections"],
        "stats_socket": hostpaths.GATEWAY_ADMIN_SOCKET,
        "server_state_file": hostpaths.GATEWAY_SERVER_STATE,
        "metrics_host": gateway["metrics"]["host"],
        "metrics_port": gateway["metrics"]["port"],
        "api_paths": API_PATHS,
        "backends": backends,
        "log_target": "/dev/log",
    }


def render_config(data: dict) -> str:
    return render_file("haproxy.cfg.j2", **config_context(data))


def backend_models(data: dict) -> dict[str, str]:
    """HAProxy backend name -> the model name clients send."""
    return {
        backend_id(index): backend["model"]
        for index, backend in enumerate(data["gateway"]["backends"])
    }


def state_keys(data: dict) -> list[str]:
    """``BACKEND SERVER ADDRESS PORT`` of every server of the configuration (what a saved
    server state must match to be kept across a reload)."""
    return [
        f"{backend_id(index)} {server['name']} {server['address']} {server['port']}"
        for index, backend in enumerate(data["gateway"]["backends"])
        for server in backend["servers"]
    ]


def users_map(data: dict) -> str:
    """The users' map: the SHA-256 of each key (lowercase hex, as HAProxy's ``sha2(256),hex,
    lower`` prints it) and the user's name. The keys themselves never leave this machine."""
    lines = ["# Managed by llamarig: sha256(key) user (gateway.users)"]
    for user in data["gateway"]["users"]:
        key = read_key(user["key_file"])
        if key is None:  # checked at load; a file changed since is refused, not skipped
            raise ValueError(f"gateway.users: {user['key_file']} holds no key any more")
        lines.append(f"{hashlib.sha256(key.encode()).hexdigest()} {user['name']}")
    return "\n".join(lines) + "\n"


def rig_key_map(data: dict) -> bytes:
    """The map that holds the header the gateway sends to the rigs (a secret: root only)."""
    key = read_key(data["gateway"]["rig_key_file"])
    if key is None:
        raise ValueError(f"gateway.rig_key_file: {data['gateway']['rig_key_file']} holds no key")
    return f"rigs Bearer {key}\n".encode()


def models_json(data: dict) -> str:
    """GET /v1/models as the gateway answers it: every model of every rig it fronts."""
    created = 0  # fixed, so the file changes only when the models do
    body = {
        "object": "list",
        "data": [
            {"id": backend["model"], "object": "model", "created": created, "owned_by": "llamarig"}
            for backend in data["gateway"]["backends"]
        ],
    }
    return json.dumps(body, indent=1) + "\n"


def certificate_names(data: dict) -> list[str]:
    """The self-signed certificate's names: `tls.names`, else the listen address (unless a
    wildcard) and the address the gateway is reached at over SSH."""
    gateway, ssh = data["gateway"], data.get("ssh") or {}
    if gateway["tls"]["names"]:
        return list(gateway["tls"]["names"])
    names = [] if gateway["host"] in WILDCARD_HOSTS else [gateway["host"]]
    reached = "127.0.0.1" if ssh.get("local") else ssh.get("host")
    if reached and reached not in names:
        names.append(reached)
    return names


def summary(data: dict) -> dict:
    """What a host's gateway does, from its data (`llamarig plan --json`): where it listens,
    its TLS, its users (names, never keys), the rigs behind each model and its bounds."""
    gateway = data["gateway"]
    tls = gateway["tls"]
    return {
        "listen": f"https://{_address(gateway['host'])}:{gateway['port']}",
        "tls": (
            {"source": "given", "cert_file": tls["cert_file"], "key_file": tls["key_file"]}
            if tls["cert_file"]
            else {"source": "self-signed", "names": certificate_names(data)}
        ),
        "users": [user["name"] for user in gateway["users"]],
        "models": [
            {"model": backend["model"], "rigs": [dict(server) for server in backend["servers"]]}
            for backend in gateway["backends"]
        ],
        "queue_timeout_s": gateway["queue_timeout"],
        "idle_timeout_s": gateway["idle_timeout"],
        "max_body_kib": gateway["max_body_kib"],
        "max_connections": gateway["max_connections"],
        "metrics": f"http://{_address(gateway['metrics']['host'])}:{gateway['metrics']['port']}"
        "/metrics",
    }


def _slots(count: int) -> str:
    return f"{count} slot{'' if count == 1 else 's'}"


def describe(data: dict) -> list[str]:
    """The gateway of a host as `llamarig plan` shows it, one line each (escaped: names and
    file names come from the inventory)."""
    told = summary(data)
    tls = told["tls"]
    if tls["source"] == "given":
        certificate = f"TLS: your certificate {tls['cert_file']} and key {tls['key_file']}"
    else:
        names = ", ".join(tls["names"]) or "no name (set gateway.tls.names)"
        certificate = (
            f"TLS: self-signed, made on the first deploy, for {names}; clients trust its copy "
            f"in {CERTIFICATES_DIR}/ beside the inventory"
        )
    users = told["users"]
    lines = [
        f"listen {told['listen']}",
        certificate,
        f"users: {len(users)} ({', '.join(users)})"
        if users
        else "users: none (every request gets 401 until gateway.users lists one)",
    ]
    for model in told["models"]:
        rigs = ", ".join(
            f"{rig['name']} at {_address(rig['address'])}:{rig['port']} ({_slots(rig['slots'])})"
            for rig in model["rigs"]
        )
        lines.append(f"model {model['model']}: {rigs}")
    lines += [
        f"queue_timeout {told['queue_timeout_s']} s: a request waits that long for a free "
        "slot, then 503 with Retry-After",
        f"max body {told['max_body_kib']} KiB (larger: 413); at most "
        f"{told['max_connections']} connections",
        f"metrics {told['metrics']}",
    ]
    return [printable(line) for line in lines]


def fronted_by(hosts: dict[str, dict]) -> dict[str, list[str]]:
    """Each rig's gateways, from every host's (derived) data: host name -> data."""
    fronting: dict[str, list[str]] = {}
    for name, data in hosts.items():
        for backend in data["gateway"].get("backends", []):
            for server in backend["servers"]:
                gateways = fronting.setdefault(server["name"], [])
                if name not in gateways:
                    gateways.append(name)
    return fronting


def plan_views(inventory, plans: dict, names: list[str]) -> dict[str, tuple]:
    """Each of ``names`` (hosts of ``inventory``) as `llamarig plan` shows it: its data, its
    plan in ``plans`` (None: a gateway alone), the gateways in front of it, which may be hosts
    that --host leaves out."""
    hosts = {name: host.data for name, host in inventory.hosts.items()}
    fronting = fronted_by(hosts)
    return {name: (hosts[name], plans.get(name), fronting.get(name)) for name in names}


def plan_lines(
    name: str, data: dict, plan, gateways: list[str] | None, unit: bool = False
) -> list[str]:
    """A host as `llamarig plan` shows it: its rig ``plan``'s report (None: a gateway alone,
    which has none), the gateways in front of it, the gateway it runs; with ``unit``, the
    rig's unit and env file last."""
    lines = [plan.report()] if plan else [f"== {name}: gateway (serves no model)"]
    if gateways:
        lines.append(f"  behind gateway(s) {', '.join(gateways)}")
    if runs_gateway(data):
        described = [f"{'  ' if plan is None else '    '}{line}" for line in describe(data)]
        lines += described if plan is None else ["  gateway:", *described]
    if plan and unit and plan.server_args_ready:
        lines += [render_unit(plan.resolved), render_env_file(plan.resolved)]
    return lines


def plan_document(data: dict, plan, gateways: list[str] | None) -> dict:
    """A host as `llamarig plan --json` shows it: its rig ``plan`` (a gateway alone has none:
    ``fits``, as nothing needs to), its "gateway", the gateways in front of it."""
    document = plan.to_json() if plan else {"role": "gateway", "fits": True}
    if runs_gateway(data):
        document["gateway"] = summary(data)
    if gateways:
        document["behind_gateways"] = gateways
    return document
