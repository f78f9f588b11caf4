"""What a gateway's HAProxy is given, from its validated data (never raw user text): the
configuration's values, the users' key hashes, the key it sends to the rigs, and the answer to
GET /v1/models. The names in them passed the schema's patterns; the addresses ``shapes``."""

from __future__ import annotations

import hashlib
import json

from llamarig.config.addresses import WILDCARD_HOSTS
from llamarig.config.gateways import read_key
from llamarig.onhost import hostpaths
from llamarig.planner.render import render_file

SERVICE = "haproxy.service"
PACKAGES = ["haproxy", "socat", "openssl"]
# The POST paths a team needs; everything else at the gateway is a 404 (the rigs' /slots,
# /props and /metrics stay theirs).
API_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
CONNECT_TIMEOUT_S = 5


def backend_id(index: int) -> str:
    return f"model_{index}"


def _address(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def config_context(data: dict) -> dict:
    """The values files/haproxy.cfg.j2 is rendered from."""
    gateway = data["gateway"]
    backends = [
        {
            "id": backend_id(index),
            "model": backend["model"],
            "servers": [
                {
                    "name": server["name"],
                    "address": _address(server["address"]),
                    "port": server["port"],
                    "maxconn": server["slots"],
                }
                for server in backend["servers"]
            ],
        }
        for index, backend in enumerate(gateway["backends"])
    ]
    return {
        "listen_host": _address(gateway["host"]),
        "listen_port": gateway["port"],
        "tls_pem": hostpaths.GATEWAY_TLS_PEM,
        "users_map": hostpaths.GATEWAY_USERS_MAP,
        "rig_key_map": hostpaths.GATEWAY_RIG_KEY_MAP,
        "models_json": hostpaths.GATEWAY_MODELS_JSON,
        "known_models_json": json.dumps([backend["model"] for backend in backends]),
        "queue_timeout": gateway["queue_timeout"],
        "connect_timeout": CONNECT_TIMEOUT_S,
        "idle_timeout": gateway["idle_timeout"],
        "body_limit": gateway["max_body_kib"] * 1024,
        "maxconn": gateway["max_connections"],
        "stats_socket": hostpaths.GATEWAY_ADMIN_SOCKET,
        "server_state_file": hostpaths.GATEWAY_SERVER_STATE,
        "metrics_host": _address(gateway["metrics"]["host"]),
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
