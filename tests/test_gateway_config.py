"""The team gateway as the inventory configures it, checked when the inventory is loaded (no
host is reached): a good team derives each gateway's backends (one per model name, the rigs
that serve it, their slots) and each fronted rig's gateway key files; every careless or hostile
value is refused with a ConfigError that names the inventory file, the key path under the host
and the fix; and nothing a user writes reaches HAProxy's configuration or maps unless it has a
safe shape (names of letters, digits and ._:+/-; addresses an IP or an RFC 1123 name), with no
key in the configuration and no user key in the map of the rigs' key.

test_sandbox_gateway deploys the same kind of team for real."""

from __future__ import annotations

import copy
import hashlib
import ipaddress
import re
import secrets
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from llamarig.config import ConfigError, load_inventory
from llamarig.planner.gateway import models_json, render_config, rig_key_map, users_map

SHA = "a" * 64
CHAT_URL = "https://example.org/chat.Q4_K_M.gguf"
CERT = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
PRIVATE_KEY = "-----BEGIN PRIVATE KEY-----\nMIGHfake\n-----END PRIVATE KEY-----\n"
# What a name that reaches HAProxy may be made of (the schema's user and alias patterns).
SAFE_NAME = re.compile(r"[A-Za-z0-9._:+/-]+")
RFC1123 = re.compile(
    r"(?=.{1,253}\.?$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?"
)


def key_file(directory: Path, name: str, text: str | None = None) -> str:
    """A key file on this machine: a fresh random key, or ``text``."""
    path = directory / f"{name}.key"
    path.write_text(secrets.token_hex(32) + "\n" if text is None else text)
    path.chmod(0o600)
    return str(path)


def team(directory: Path) -> dict:
    """Two rigs in `rigs` (rig-a standalone with an alias and 2 slots on 10.0.0.11; rig-b a
    router of `chat`, the same file as rig-a's, with 4 slots, and `code` with the rig's 3,
    listening on every address) and a gateway box `gw` in `gateways` with two users."""
    rig_a = {
        "ssh": {"host": "192.0.2.1", "user": "root"},
        "llama_cpp": {"backend": "cpu"},
        "model": {"url": CHAT_URL, "sha256": SHA},
        "server": {
            "host": "10.0.0.11",
            "alias": "chat",
            "parallel": 2,
            "api_key_file": key_file(directory, "rig-a"),
        },
    }
    rig_b = {
        "ssh": {"host": "192.0.2.2", "user": "root"},
        "llama_cpp": {"backend": "cpu"},
        "server": {
            "host": "0.0.0.0",
            "port": 8081,
            "parallel": 3,
            "api_key_file": key_file(directory, "rig-b"),
        },
        "models": [
            {"name": "chat", "url": CHAT_URL, "sha256": SHA, "server": {"parallel": 4}},
            {"name": "code", "path": "/srv/models/code.gguf"},
        ],
    }
    gateway = {
        "role": "gateway",
        "ssh": {"host": "192.0.2.9", "user": "root"},
        "gateway": {
            "host": "0.0.0.0",
            "rig_key_file": key_file(directory, "gw-rigs"),
            "fronts": "rigs",
            "users": [
                {"name": "alice", "key_file": key_file(directory, "alice")},
                {"name": "bob", "key_file": key_file(directory, "bob")},
            ],
        },
    }
    return {
        "all": {
            "children": {
                "rigs": {"hosts": {"rig-a": rig_a, "rig-b": rig_b}},
                "gateways": {"hosts": {"gw": gateway}},
            }
        }
    }


def hosts_of(document: dict, group: str) -> dict:
    return document["all"]["children"][group]["hosts"]


def rig(document: dict, name: str = "rig-a") -> dict:
    return hosts_of(document, "rigs")[name]


def gw(document: dict) -> dict:
    """The gateway's own settings (`gateway:`) of host `gw`."""
    return hosts_of(document, "gateways")["gw"]["gateway"]


def gateway_on_rig_b(document: dict) -> dict:
    """Move the gateway box's settings to rig-b, the one host of `gateways`; returns them."""
    settings_ = document["all"]["children"].pop("gateways")["hosts"]["gw"]["gateway"]
    document["all"]["children"]["gateways"] = {"hosts": {"rig-b": {"gateway": settings_}}}
    return settings_


def write(directory: Path, document: dict) -> Path:
    path = directory / "team.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def load(directory: Path, document: dict) -> dict[str, dict]:
    """Each host's data as loaded and derived."""
    inventory = load_inventory(write(directory, document))
    return {name: host.data for name, host in inventory.hosts.items()}


def refused(directory: Path, document: dict) -> tuple[Path, list[str]]:
    path = write(directory, document)
    with pytest.raises(ConfigError) as caught:  # any other exception fails the test
        load_inventory(path)
    return path, caught.value.problems


def servers(backend: dict) -> list[tuple]:
    return [(s["name"], s["address"], s["port"], s["slots"]) for s in backend["servers"]]


# --- a good team --------------------------------------------------------------------------------


def test_a_team_loads_with_one_backend_per_model_name(tmp_path):
    document = team(tmp_path)
    hosts = load(tmp_path, document)
    backends = hosts["gw"]["gateway"]["backends"]
    assert [backend["model"] for backend in backends] == ["chat", "code"]
    chat, code = backends
    # The standalone rig's slots are its parallel; a router's, the model's own (else the rig's).
    assert servers(chat) == [("rig-a", "10.0.0.11", 8080, 2), ("rig-b", "192.0.2.2", 8081, 4)]
    assert servers(code) == [("rig-b", "192.0.2.2", 8081, 3)]
    rig_key = gw(document)["rig_key_file"]
    for name in ("rig-a", "rig-b"):
        assert hosts[name]["server"]["gateway_key_files"] == [rig_key]
    assert "gateway_key_files" not in hosts["gw"]["server"]
    # Rigs no gateway fronts are left as they were.
    assert "backends" not in hosts["rig-a"]["gateway"]


def test_a_rig_that_is_also_the_gateway_reaches_itself_on_loopback(tmp_path):
    """rig-b (listening on every address) runs the gateway too: it reaches its own
    llama-server at 127.0.0.1, rig-a at its listen address."""
    document = team(tmp_path)
    gateway_settings = gateway_on_rig_b(document)
    hosts = load(tmp_path, document)
    assert set(hosts) == {"rig-a", "rig-b"}
    chat, code = hosts["rig-b"]["gateway"]["backends"]
    assert servers(chat) == [("rig-a", "10.0.0.11", 8080, 2), ("rig-b", "127.0.0.1", 8081, 4)]
    assert servers(code) == [("rig-b", "127.0.0.1", 8081, 3)]
    key = gateway_settings["rig_key_file"]
    assert hosts["rig-b"]["server"]["gateway_key_files"] == [key]
    assert hosts["rig-a"]["server"]["gateway_key_files"] == [key]
    assert "server rig-b 127.0.0.1:8081 maxconn 4" in render_config(hosts["rig-b"])


def test_fronts_null_fronts_every_host_that_serves_a_model(tmp_path):
    """Without `fronts`, every standalone and rpc-head host of the inventory, in any group;
    not a worker, not the gateway box."""
    document = team(tmp_path)
    del gw(document)["fronts"]
    rig_c = copy.deepcopy(rig(document, "rig-a"))
    rig_c["ssh"] = {"host": "192.0.2.3", "user": "root"}
    document["all"]["children"]["others"] = {"hosts": {"rig-c": rig_c}}
    hosts = load(tmp_path, document)
    assert hosts["gw"]["gateway"]["fronts"] is None
    chat, code = hosts["gw"]["gateway"]["backends"]
    assert [server[0] for server in servers(chat)] == ["rig-a", "rig-b", "rig-c"]
    assert [server[0] for server in servers(code)] == ["rig-b"]
    assert hosts["rig-c"]["server"]["gateway_key_files"] == [gw(document)["rig_key_file"]]


def test_two_gateways_give_a_rig_both_their_keys(tmp_path):
    document = team(tmp_path)
    second = copy.deepcopy(hosts_of(document, "gateways")["gw"])
    second["ssh"]["host"] = "192.0.2.10"
    second["gateway"]["rig_key_file"] = key_file(tmp_path, "gw2-rigs")
    hosts_of(document, "gateways")["gw2"] = second
    hosts = load(tmp_path, document)
    expected = [gw(document)["rig_key_file"], second["gateway"]["rig_key_file"]]
    assert hosts["rig-a"]["server"]["gateway_key_files"] == expected
    assert hosts["gw2"]["gateway"]["backends"] == hosts["gw"]["gateway"]["backends"]


def test_loopback_rigs_on_the_gateways_own_box_are_reached_on_loopback(tmp_path):
    """Containers of one machine share its loopback: a rig on 127.0.0.1 is fronted by a
    gateway whose SSH address is loopback too (another SSH port)."""
    document = team(tmp_path)
    rig(document)["ssh"] = {"host": "127.0.0.1", "port": 2201, "user": "root"}
    rig(document)["server"]["host"] = "127.0.0.1"
    hosts_of(document, "gateways")["gw"]["ssh"] = {"host": "127.0.0.1", "port": 2209}
    hosts = load(tmp_path, document)
    chat = hosts["gw"]["gateway"]["backends"][0]
    assert servers(chat)[0] == ("rig-a", "127.0.0.1", 8080, 2)


def test_the_maps_hold_hashes_of_the_users_keys_and_the_rig_key_alone(tmp_path):
    document = team(tmp_path)
    hosts = load(tmp_path, document)
    data = hosts["gw"]
    user_keys = {
        user["name"]: Path(user["key_file"]).read_text().strip() for user in gw(document)["users"]
    }
    rig_key = Path(gw(document)["rig_key_file"]).read_text().strip()
    text = users_map(data)
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    assert lines == [
        f"{hashlib.sha256(key.encode()).hexdigest()} {name}" for name, key in user_keys.items()
    ]
    assert rig_key_map(data) == f"rigs Bearer {rig_key}\n".encode()
    config = render_config(data)
    for key in [*user_keys.values(), rig_key]:
        assert key not in text.replace(hashlib.sha256(key.encode()).hexdigest(), "")
        assert key not in config and key not in models_json(data)
    for key in user_keys.values():
        assert key.encode() not in rig_key_map(data)
    # Nor does a rig's own key reach the gateway.
    for name in ("rig-a", "rig-b"):
        own = Path(rig(document, name)["server"]["api_key_file"]).read_text().strip()
        assert own not in config and own not in text
        assert own.encode() not in rig_key_map(data)


# --- careless and hostile input, refused at load ------------------------------------------------


Edit = Callable[[dict, Path], None]


@dataclass(frozen=True)
class Case:
    id: str
    edit: Edit  # what the user wrote, over the good team
    key: str  # the key path the problem names, under hosts.
    words: tuple[str, ...]  # what is wrong and the fix


def setting(*path_and_value) -> Edit:
    """Set ``gateway.PATH...`` of `gw` to the last argument."""
    *path, value = path_and_value

    def edit(document: dict, directory: Path) -> None:
        node = gw(document)
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value

    return edit


def user_name(name) -> Edit:
    def edit(document: dict, directory: Path) -> None:
        gw(document)["users"][0]["name"] = name

    return edit


def user_key(text: str | None = None, directory_instead: bool = False) -> Edit:
    """Alice's key file: holding ``text``, missing (None), or a directory."""

    def edit(document: dict, directory: Path) -> None:
        path = directory / "alice-bad.key"
        if directory_instead:
            path.mkdir()
        elif text is not None:
            path.write_text(text)
        gw(document)["users"][0]["key_file"] = str(path)

    return edit


def same_key_as(path_of: Callable[[dict], str]) -> Edit:
    def edit(document: dict, directory: Path) -> None:
        gw(document)["users"][1]["key_file"] = path_of(document)

    return edit


def tls(**files: str | list) -> Edit:
    """gateway.tls: each of cert_file/key_file a file holding the given text; names as given."""

    def edit(document: dict, directory: Path) -> None:
        settings_ = gw(document).setdefault("tls", {})
        for name, value in files.items():
            if name == "names":
                settings_["names"] = value
            else:
                path = directory / f"gateway.{name}"
                path.write_text(value)
                settings_[name] = str(path)

    return edit


def on_rig(name: str, **server) -> Edit:
    def edit(document: dict, directory: Path) -> None:
        rig(document, name)["server"].update(server)

    return edit


def workers_only(document: dict, directory: Path) -> None:
    """rig-a becomes an rpc-head of a worker in group `workers`, which the gateway fronts."""
    rig(document)["role"] = "rpc-head"
    rig(document)["rpc"] = {"workers": ["w1"]}
    document["all"]["children"]["workers"] = {
        "hosts": {
            "w1": {
                "role": "rpc-worker",
                "ssh": {"host": "192.0.2.21", "user": "root"},
                "llama_cpp": {"backend": "cpu"},
                "rpc": {"host": "10.0.0.21"},
            }
        }
    }
    gw(document)["fronts"] = "workers"


def no_api_key_on_one_box(document: dict, directory: Path) -> None:
    """rig-a without a key of its own, on loopback of the gateway's box."""
    rig(document)["ssh"] = {"host": "127.0.0.1", "port": 2201, "user": "root"}
    rig(document)["server"]["host"] = "127.0.0.1"
    del rig(document)["server"]["api_key_file"]
    hosts_of(document, "gateways")["gw"]["ssh"] = {"host": "127.0.0.1", "port": 2209}


def other_sha(document: dict, directory: Path) -> None:
    rig(document, "rig-b")["models"][0]["sha256"] = "b" * 64


def other_sha_fronting_all(document: dict, directory: Path) -> None:
    other_sha(document, directory)
    del gw(document)["fronts"]


def gateway_role_on_a_rig(document: dict, directory: Path) -> None:
    rig(document)["role"] = "gateway"


def worker_in_gateways(document: dict, directory: Path) -> None:
    """A worker (of rig-a, an rpc-head) listed in `gateways` too, with gateway settings."""
    workers_only(document, directory)
    gw(document)["fronts"] = "rigs"
    settings_ = copy.deepcopy(gw(document))
    settings_["rig_key_file"] = key_file(directory, "w1-rigs")
    hosts_of(document, "gateways")["w1"] = {"gateway": settings_}


def on_rig_b(*path_and_value) -> Edit:
    """rig-b (server.port 8081) runs the gateway too, with ``gateway.PATH...`` set."""

    def edit(document: dict, directory: Path) -> None:
        setting(*path_and_value)(document, directory)
        gateway_on_rig_b(document)

    return edit


def port_on_ssh_port(document: dict, directory: Path) -> None:
    hosts_of(document, "gateways")["gw"]["ssh"]["port"] = 2222
    gw(document)["port"] = 2222


def derived_on_rig(document: dict, directory: Path) -> None:
    rig(document)["server"]["gateway_key_files"] = [str(directory / "mine.key")]


FIX_NAME = "a user name of letters, digits and ._- (up to 64)"
FIX_KEY = "openssl rand -hex 32"
# A control character anywhere is refused by the shape checks, before any other rule.
ONE_LINE = ("control character", "a setting is one line of plain text: remove it")
CONTROL = ("control character", "remove it")
NOT_A_KEY = "does not hold one key of 32 to 512 characters"
GOOD_KEY = "k" * 40

CASES = [
    # --- user names: the schema's pattern, before HAProxy's map and log see them ---------------
    *(
        Case(f"user-name-{label}", user_name(name), "gw.gateway.users.0.name", words)
        for label, name, words in [
            ("space", "alice smith", (FIX_NAME,)),
            ("double-quote", 'al"ice', (FIX_NAME,)),
            ("newline", "alice\nbob", CONTROL),
            ("trailing-newline", "alice\n", CONTROL),
            ("tab", "al\tice", CONTROL),
            ("percent", "al%[req.hdr(x)]ice", (FIX_NAME,)),
            ("single-quote", "al'ice", (FIX_NAME,)),
            ("leading-dash", "-alice", (FIX_NAME,)),
            ("65-chars", "a" * 65, (FIX_NAME,)),
            ("empty", "", (FIX_NAME,)),
            ("right-to-left", "\u202ealice", ("U+202E",)),
        ]
    ),
    Case(
        "user-name-integer", user_name(12345), "gw.gateway.users.0.name", ("12345 is an integer",)
    ),
    Case(
        "user-name-twice",
        user_name("bob"),
        "gw.gateway.users.1.name",
        ("'bob' is listed twice", "give each user one entry"),
    ),
    # --- key files ---------------------------------------------------------------------------
    *(
        Case(f"user-key-{label}", edit, "gw.gateway.users.0.key_file", (NOT_A_KEY, FIX_KEY))
        for label, edit in [
            ("missing", user_key(None)),
            ("empty", user_key("")),
            ("blank", user_key("\n \n")),
            ("two-lines", user_key(f"{GOOD_KEY}\n{GOOD_KEY}x\n")),
            ("31-chars", user_key("k" * 31 + "\n")),
            ("inner-space", user_key("k" * 20 + " " + "k" * 20 + "\n")),
            ("double-quote", user_key('"' + GOOD_KEY + '"\n')),
            ("single-quote", user_key("'" + GOOD_KEY + "'\n")),
            ("control-char", user_key("k" * 20 + "\x07" + "k" * 20 + "\n")),
            ("escape-char", user_key(GOOD_KEY + "\x1b[2J\n")),
            ("nul", user_key(GOOD_KEY + "\x00\n")),
            ("percent", user_key(GOOD_KEY + "%[env(HOME)]\n")),
            ("513-chars", user_key("k" * 513 + "\n")),
            ("directory", user_key(directory_instead=True)),
        ]
    ),
    Case(
        "two-users-one-key",
        same_key_as(lambda document: gw(document)["users"][0]["key_file"]),
        "gw.gateway.users.1.key_file",
        ("the same key as user 'alice'", "a key of their own"),
    ),
    Case(
        "user-key-is-the-rig-key",
        same_key_as(lambda document: gw(document)["rig_key_file"]),
        "gw.gateway.users.1.key_file",
        ("the gateway's own key", "a key of their own"),
    ),
    Case(
        "rig-key-file-missing",
        setting("rig_key_file", None),
        "gw.gateway.rig_key_file",
        ("is missing", FIX_KEY),
    ),
    Case(
        "rig-key-file-not-given",
        lambda document, directory: gw(document).pop("rig_key_file"),
        "gw.gateway.rig_key_file",
        ("is missing", FIX_KEY),
    ),
    Case(
        "rig-key-file-short",
        lambda document, directory: setting("rig_key_file", key_file(directory, "short", "k" * 8))(
            document, directory
        ),
        "gw.gateway.rig_key_file",
        (NOT_A_KEY, FIX_KEY),
    ),
    Case(
        "rig-key-file-with-a-variable",
        setting("rig_key_file", "/home/$USER/rigs.key"),
        "gw.gateway.rig_key_file",
        ("`$` is not expanded",),
    ),
    # --- addresses ---------------------------------------------------------------------------
    Case(
        "host-not-given",
        lambda document, directory: gw(document).pop("host"),
        "gw.gateway.host",
        ("is missing", "0.0.0.0 for every address"),
    ),
    *(
        Case(f"{key}-{label}", setting(*key.split("."), value), f"gw.gateway.{key}", words)
        for key in ("host", "metrics.host")
        for label, value, words in [
            ("url", "https://gw.example.org", ("is a URL", "give only the address")),
            ("port", "10.0.0.5:8443", ("holds a port", "put 8443 in")),
            ("brackets", "[2001:db8::5]", ("in brackets", "without brackets: 2001:db8::5")),
            ("command", "$(id)", ("not an IP address or a host name", "RFC 1123")),
            ("newline", "10.0.0.5\nbind 0.0.0.0:80", ONE_LINE),
            ("trailing-newline", "gw.example.org\n", ONE_LINE),
            ("space", "gw example", ("not an IP address or a host name",)),
            ("star", "*", ("`*` is not an address", "0.0.0.0")),
            ("option", "-gw", ("starts with `-`",)),
            ("zone", "fe80::1%eth0", ("IPv6 zone",)),
        ]
    ),
    Case("metrics-host-empty", setting("metrics", "host", ""), "gw.gateway.metrics.host", ("",)),
    Case(
        "metrics-port-is-the-port",
        setting("metrics", "port", 8443),
        "gw.gateway.metrics.port",
        ("8443 is also gateway.port", "a port of its own"),
    ),
    Case(
        "port-is-the-rigs-own-server-port",
        on_rig_b("port", 8081),
        "rig-b.gateway.port",
        ("8081 is also this rig's server.port", "give the gateway a port of its own"),
    ),
    Case(
        "metrics-port-is-the-rigs-own-server-port",
        on_rig_b("metrics", "port", 8081),
        "rig-b.gateway.metrics.port",
        ("8081 is also this rig's server.port", "give the exporter a port of its own"),
    ),
    Case(
        "port-is-the-ssh-port",
        port_on_ssh_port,
        "gw.gateway.port",
        ("2222 is also the host's SSH port", "give the gateway a port of its own"),
    ),
    Case("port-80", setting("port", 80), "gw.gateway.port", ("from 1024 to 65535",)),
    Case("port-70000", setting("port", 70000), "gw.gateway.port", ("from 1024 to 65535",)),
    Case("metrics-port-0", setting("metrics", "port", 0), "gw.gateway.metrics.port", ("1024",)),
    # --- TLS ---------------------------------------------------------------------------------
    Case(
        "cert-without-key",
        tls(cert_file=CERT),
        "gw.gateway.tls.key_file",
        ("is missing while `cert_file` is given", "give both"),
    ),
    Case(
        "key-without-cert",
        tls(key_file=PRIVATE_KEY),
        "gw.gateway.tls.cert_file",
        ("is missing while `key_file` is given", "give both"),
    ),
    Case(
        "cert-not-pem",
        tls(cert_file="not a certificate\n", key_file=PRIVATE_KEY),
        "gw.gateway.tls.cert_file",
        ("holds no PEM certificate", "give the certificate file"),
    ),
    Case(
        "key-not-a-private-key",
        tls(cert_file=CERT, key_file=CERT),
        "gw.gateway.tls.key_file",
        ("holds no PEM private key", "give the certificate's key file"),
    ),
    *(
        Case(
            f"tls-name-{label}",
            tls(names=["llm.example.lan", name]),
            "gw.gateway.tls.names.1",
            words,
        )
        for label, name, words in [
            ("wildcard", "*.x", ("not an IP address or a host name",)),
            ("space", "a b", ("not an IP address or a host name",)),
            ("command", "$(id)", ("not an IP address or a host name",)),
            ("newline", "llm\nx", ONE_LINE),
            ("unspecified", "0.0.0.0", ("not an address to connect to",)),
        ]
    ),
    Case(
        "tls-names-beside-a-cert",
        tls(cert_file=CERT, key_file=PRIVATE_KEY, names=["llm.example.lan"]),
        "gw.gateway.tls.names",
        ("cert_file is given", "remove `names`"),
    ),
    # --- what the gateway fronts -------------------------------------------------------------
    Case(
        "fronts-unknown-group",
        setting("fronts", "rig"),
        "gw.gateway.fronts",
        ("names the group `rig`", "did you mean `rigs`?"),
    ),
    Case(
        "fronts-workers-only",
        workers_only,
        "gw.gateway.fronts",
        ("the group `workers` has no rig that serves a model",),
    ),
    Case(
        "fronted-rig-without-a-key",
        no_api_key_on_one_box,
        "rig-a.server.api_key_file",
        ("is missing, and gateway `gw` fronts this rig", "give the rig a key of its own"),
    ),
    Case(
        "fronted-rig-on-loopback-of-another-box",
        on_rig("rig-a", host="127.0.0.1"),
        "rig-a.server.host",
        ("127.0.0.1 is loopback", "another box (192.0.2.9)", "private address"),
    ),
    Case(
        "one-name-two-files",
        other_sha,
        "gw.gateway.fronts",
        ("`rig-a` and `rig-b` both serve a model named 'chat'", "give one of them another name"),
    ),
    Case(
        "one-name-two-files-fronting-all",
        other_sha_fronting_all,
        "gw.gateway.fronts",
        ("`rig-a` and `rig-b` both serve a model named 'chat'", "give one of them another name"),
    ),
    # --- derived keys and roles ---------------------------------------------------------------
    Case(
        "backends-set-by-hand",
        setting("backends", [{"model": "x", "servers": []}]),
        "gw.gateway.backends",
        ("is derived", "set `gateway.fronts`"),
    ),
    Case(
        "gateway-key-files-set-by-hand",
        derived_on_rig,
        "rig-a.server.gateway_key_files",
        ("is derived", "set it on the gateway instead"),
    ),
    Case(
        "gateway-role-outside-gateways",
        gateway_role_on_a_rig,
        "rig-a.role",
        ("is `gateway`", "not in the `gateways` group", "children: gateways: hosts:"),
    ),
    Case(
        "worker-in-gateways",
        worker_in_gateways,
        "w1.role",
        ("is rpc-worker, which serves no API",),
    ),
    # --- numbers and names of settings ---------------------------------------------------------
    Case("queue-timeout-0", setting("queue_timeout", 0), "gw.gateway.queue_timeout", ("1",)),
    Case(
        "queue-timeout-string",
        setting("queue_timeout", "30s"),
        "gw.gateway.queue_timeout",
        ("'30s' is a string", "seconds from 1 to 86400"),
    ),
    Case(
        "queue-timeout-float",
        setting("queue_timeout", 1.5),
        "gw.gateway.queue_timeout",
        ("1.5 is a number with a fraction", "seconds from 1 to 86400"),
    ),
    Case(
        "queue-timeout-bool",
        setting("queue_timeout", True),
        "gw.gateway.queue_timeout",
        ("seconds from 1 to 86400",),
    ),
    Case("max-body-8", setting("max_body_kib", 8), "gw.gateway.max_body_kib", ("16 to 65536",)),
    Case(
        "max-connections-huge",
        setting("max_connections", 10**7),
        "gw.gateway.max_connections",
        ("16 to 1000000",),
    ),
    Case(
        "unknown-key",
        setting("queue_timout", 30),
        "gw.gateway.queue_timout",
        ("unknown key `queue_timout`", "did you mean `queue_timeout`?"),
    ),
    Case(
        "unknown-key-of-a-user",
        lambda document, directory: gw(document)["users"][0].update(keyfile="/x"),
        "gw.gateway.users.0.keyfile",
        ("unknown key `keyfile`", "did you mean `key_file`?"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_careless_and_hostile_input_is_refused_at_load(case, tmp_path):
    document = team(tmp_path)
    case.edit(document, tmp_path)
    path, problems = refused(tmp_path, document)
    assert problems and all(isinstance(p, str) and p.strip() for p in problems)
    prefix = f"{path}: hosts.{case.key}: "
    named = [p for p in problems if p.startswith(prefix)]
    assert named, f"no problem starts with {prefix!r}: {problems}"
    assert any(all(word in p for word in case.words) for p in named), named


def test_every_case_is_distinct():
    assert len({case.id for case in CASES}) == len(CASES)


# --- nothing a user writes reaches HAProxy unvalidated --------------------------------------------

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
HOSTILE = [
    "",
    " ",
    "a b",
    "alice\n",
    "alice\nbind *:80",
    "x'y",
    'x"y',
    "%[env(HOME)]",
    "$(id)",
    "`id`",
    "-alice",
    "a#b",
    "a\\b",
    "a{b}",
    "a;b",
    "\u202ealice",
    "al\u200bice",
    "ａlice",
    "a" * 65,
    "a" * 129,
    "x\x00y",
    "0.0.0.0",
    "::",
    "::1",
    "[::1]",
    "gw.example.org.",
    "10.0.0.5:80",
    "localhost",
]
TEXT = st.one_of(
    st.sampled_from(HOSTILE),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:+/-]{0,20}", fullmatch=True),
    st.text(st.characters(exclude_categories=("Cs",)), max_size=24),
    st.text(st.sampled_from("aZ09._-:+/ %'\"\n\t\\$()[]{}#;*@,\x00\x1b\x7f\u0085"), max_size=12),
)


def _no_control_characters(config: str) -> None:
    bad = [ch for ch in config if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf")]
    assert not bad, [hex(ord(ch)) for ch in bad]


def _is_address(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(RFC1123.fullmatch(text)) and not text.rstrip(".").split(".")[-1].isdigit()


def _try_load(directory: Path, document: dict) -> dict | None:
    """Each host's data, or None when the loader refused the inventory (by ConfigError)."""
    try:
        hosts = load(directory, document)
    except ConfigError as error:
        assert error.problems
        event("refused")
        return None
    event("loaded")
    return hosts


@PROPERTY
@given(text=TEXT)
@example(text="alice\n")
@example(text="al'ice")
def test_a_user_name_reaches_haproxy_only_in_a_safe_shape(tmp_path, text):
    document = team(tmp_path)
    gw(document)["users"][0]["name"] = text
    hosts = _try_load(tmp_path, document)
    if hosts is None:
        return
    assert SAFE_NAME.fullmatch(text), text
    data = hosts["gw"]
    config, users = render_config(data), users_map(data)
    _no_control_characters(config)
    _no_control_characters(users)
    key = Path(gw(document)["users"][0]["key_file"]).read_text().strip()
    assert f"{hashlib.sha256(key.encode()).hexdigest()} {text}\n" in users
    assert key not in users and key not in config


@PROPERTY
@given(text=TEXT)
@example(text="chat\n")
@example(text="chat' || 1")
def test_a_model_alias_reaches_haproxy_only_in_a_safe_shape(tmp_path, text):
    """The standalone rig's server.alias names its backend (an ACL value, a comment, the
    answer to /v1/models); rig-b serves `chat` and `code`, so another name adds a backend."""
    document = team(tmp_path)
    rig(document)["server"]["alias"] = text
    hosts = _try_load(tmp_path, document)
    if hosts is None:
        return
    assert SAFE_NAME.fullmatch(text), text
    data = hosts["gw"]
    models = [backend["model"] for backend in data["gateway"]["backends"]]
    assert text in models and models == sorted(models)
    config = render_config(data)
    _no_control_characters(config)
    assert f"var(txn.model) -m str {text}\n" in config
    _no_control_characters(models_json(data))


@PROPERTY
@given(text=TEXT)
@example(text="code\n")
def test_a_router_entry_name_reaches_haproxy_only_in_a_safe_shape(tmp_path, text):
    document = team(tmp_path)
    rig(document, "rig-b")["models"][1]["name"] = text
    hosts = _try_load(tmp_path, document)
    if hosts is None:
        return
    assert SAFE_NAME.fullmatch(text), text
    config = render_config(hosts["gw"])
    _no_control_characters(config)
    assert f"var(txn.model) -m str {text}\n" in config


@PROPERTY
@given(text=TEXT)
@example(text="10.0.0.5\nbind *:80")
@example(text="gw.example.org\n")
def test_a_gateway_address_reaches_haproxy_only_in_a_safe_shape(tmp_path, text):
    document = team(tmp_path)
    gw(document)["host"] = text
    hosts = _try_load(tmp_path, document)
    if hosts is None:
        return
    assert _is_address(text), text
    config = render_config(hosts["gw"])
    _no_control_characters(config)
    bind = f"[{text}]" if ":" in text else text
    assert f"    bind {bind}:8443 ssl " in config
