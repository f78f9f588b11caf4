"""The command line on an inventory with a gateway (no host is reached): `plan` shows a gateway
alone's gateway and no rig plan, a rig that runs the gateway too its plan then its gateway,
and the rigs behind it; `--json` gets a "gateway" object; `complete`, `tune`, `run` and `lock`
refuse a gateway alone, saying why; `verify`'s expectations of a gateway hold the users' names
and key hashes, never a key, and plan no model for a gateway alone.

test_sandbox_gateway deploys and verifies the same kind of team for real."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
from pathlib import Path

import pytest
import yaml

from llamarig import cli
from llamarig.checks import runner
from llamarig.config import load_inventory
from llamarig.operations.gateway import fingerprint

SMOLLM2 = {"url": "http://127.0.0.1:8765/SmolLM2.Q4_1.gguf", "sha256": "a" * 64}
TINY = {"url": "http://127.0.0.1:8765/tiny.gguf", "sha256": "b" * 64}
CERT = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
PRIVATE_KEY = "-----BEGIN PRIVATE KEY-----\nMIGHfake\n-----END PRIVATE KEY-----\n"


def _key(directory: Path, name: str) -> Path:
    path = directory / f"{name}.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def team_document(directory: Path) -> dict:
    """/tmp/gw/inv.yml's shape: rig1 serves smollm2 (2 slots) on 10.0.0.11, rig2 is a router of
    smollm2 (2 slots) and tiny-random (1) on every address, gw (`role: gateway`) fronts both
    for alice and bob."""
    rigs = {
        "rig1": {
            "ssh": {"host": "192.0.2.1", "port": 2240},
            "model": SMOLLM2,
            "server": {"host": "10.0.0.11", "port": 8110, "parallel": 2, "alias": "smollm2",
                       "api_key_file": str(_key(directory, "rig1"))},
        },
        "rig2": {
            "ssh": {"host": "192.0.2.2", "port": 2241},
            "models": [{"name": "smollm2", **SMOLLM2, "server": {"parallel": 2}},
                       {"name": "tiny-random", **TINY, "server": {"parallel": 1}}],
            "server": {"host": "0.0.0.0", "port": 8111,
                       "api_key_file": str(_key(directory, "rig2"))},
        },
    }  # fmt: skip
    gateway = {
        "role": "gateway",
        "ssh": {"host": "192.0.2.9"},
        "gateway": {
            "host": "0.0.0.0",
            "rig_key_file": str(_key(directory, "rigkey")),
            "fronts": "rigs",
            "users": [
                {"name": name, "key_file": str(_key(directory, name))} for name in ("alice", "bob")
            ],
        },
    }
    return {
        "all": {
            "vars": {
                "driver": {"source": "none"},
                "cuda": {"source": "none"},
                "llama_cpp": {"backend": "cpu"},
                "ssh": {"user": "root"},
            },
            "children": {
                "rigs": {"hosts": rigs},
                "gateways": {"hosts": {"gw": gateway}},
            },
        }
    }


def keys_in(directory: Path) -> list[str]:
    return [path.read_text().strip() for path in sorted(directory.glob("*.key"))]


@pytest.fixture
def team(tmp_path) -> Path:
    path = tmp_path / "team.yml"
    path.write_text(yaml.safe_dump(team_document(tmp_path)))
    return path


def gateway_on_rig2(path: Path) -> Path:
    """The same team, its gateway run by rig2 (in both groups), with your certificate, on
    every IPv6 address; rig1 alone behind it."""
    document = yaml.safe_load(path.read_text())
    children = document["all"]["children"]
    settings = children.pop("gateways")["hosts"]["gw"]["gateway"]
    (path.parent / "gw.crt").write_text(CERT)
    (path.parent / "gw.pem").write_text(PRIVATE_KEY)
    tls = {"cert_file": str(path.parent / "gw.crt"), "key_file": str(path.parent / "gw.pem")}
    settings.update(host="::", fronts="fronted", tls=tls)
    children["gateways"] = {"hosts": {"rig2": {"gateway": settings}}}
    children["fronted"] = {"hosts": {"rig1": None}}
    changed = path.with_name("rig-gateway.yml")
    changed.write_text(yaml.safe_dump(document))
    return changed


def llamarig(monkeypatch, capsys, inventory: Path, *argv: str) -> tuple[int, str, str]:
    """`llamarig ARGV` in this process (nothing here reaches a host): status, out, err."""
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def section(output: str, host: str) -> str:
    """One host's part of `plan`'s output, from its `== HOST:` line to the next."""
    return output.split(f"== {host}:", 1)[1].split("\n== ", 1)[0]


def test_plan_shows_a_gateway_alone_and_no_rig_plan_for_it(monkeypatch, capsys, team):
    status, out, err = llamarig(monkeypatch, capsys, team, "plan")
    assert status == 0, err
    assert section(out, "gw").splitlines() == [
        " gateway (serves no model)",
        "  listen https://0.0.0.0:8443",
        "  TLS: self-signed, made on the first deploy, for 192.0.2.9; clients trust its copy in "
        "gateway-certs/ beside the inventory",
        "  users: 2 (alice, bob)",
        "  model smollm2: rig1 at 10.0.0.11:8110 (2 slots), rig2 at 192.0.2.2:8111 (2 slots)",
        "  model tiny-random: rig2 at 192.0.2.2:8111 (1 slot)",
        "  queue_timeout 30 s: a request waits that long for a free slot, then 503 with "
        "Retry-After",
        "  max body 1024 KiB (larger: 413); at most 512 connections",
        "  metrics http://127.0.0.1:8405/metrics",
    ]
    for rig in ("rig1", "rig2"):
        assert "llama-server:" in section(out, rig) and "  behind gateway(s) gw" in section(
            out, rig
        )
    assert not [key for key in keys_in(team.parent) if key in out + err]


def test_plan_json_gives_the_gateway_an_object(monkeypatch, capsys, team):
    status, out, err = llamarig(monkeypatch, capsys, team, "plan", "--json")
    assert status == 0, err
    hosts = json.loads(out)["hosts"]
    assert hosts["gw"] == {
        "role": "gateway",
        "fits": True,
        "gateway": {
            "listen": "https://0.0.0.0:8443",
            "tls": {"source": "self-signed", "names": ["192.0.2.9"]},
            "users": ["alice", "bob"],
            "models": [
                {
                    "model": "smollm2",
                    "rigs": [
                        {"name": "rig1", "address": "10.0.0.11", "port": 8110, "slots": 2},
                        {"name": "rig2", "address": "192.0.2.2", "port": 8111, "slots": 2},
                    ],
                },
                {
                    "model": "tiny-random",
                    "rigs": [{"name": "rig2", "address": "192.0.2.2", "port": 8111, "slots": 1}],
                },
            ],  # fmt: skip
            "queue_timeout_s": 30,
            "idle_timeout_s": 600,
            "max_body_kib": 1024,
            "max_connections": 512,
            "metrics": "http://127.0.0.1:8405/metrics",
        },
    }
    assert hosts["rig1"]["fits"] and hosts["rig1"]["behind_gateways"] == ["gw"]
    assert "gateway" not in hosts["rig1"] and "server_args" in hosts["rig1"]
    assert not [key for key in keys_in(team.parent) if key in out]


def test_a_rig_that_runs_the_gateway_shows_its_plan_then_the_gateway(monkeypatch, capsys, team):
    inventory = gateway_on_rig2(team)
    status, out, err = llamarig(monkeypatch, capsys, inventory, "plan")
    assert status == 0, err
    rig2 = section(out, "rig2")
    assert rig2.index("llama-server:") < rig2.index("\n  gateway:\n    listen https://[::]:8443")
    assert f"    TLS: your certificate {team.parent}/gw.crt and key {team.parent}/gw.pem" in rig2
    assert "    model smollm2: rig1 at 10.0.0.11:8110 (2 slots)\n" in rig2
    assert "behind gateway(s)" not in rig2 and "behind gateway(s) rig2" in section(out, "rig1")
    status, out, _ = llamarig(monkeypatch, capsys, inventory, "plan", "--unit", "--host", "rig2")
    assert status == 0 and out.index("    metrics http://") < out.index("[Unit]")
    status, out, err = llamarig(monkeypatch, capsys, inventory, "plan", "--json", "--host", "rig2")
    document = json.loads(out)["hosts"]["rig2"]
    assert status == 0 and document["fits"] and document["server_args"]
    assert document["gateway"]["tls"]["source"] == "given"
    assert [m["model"] for m in document["gateway"]["models"]] == ["smollm2"]


@pytest.mark.parametrize(
    "verb, status, said",
    [
        (["complete"], 2, "gw is a gateway: ask through it with a user's key (README 'A team "
         "endpoint')\n"),
        (["tune"], 1, "llamarig tune: gw is a gateway: it serves no model; tune the rigs it "
         "fronts (rig1, rig2)\n"),
        (["run"], 2, "llamarig: gw is a gateway: no llama-server to start; run a rig\n"),
    ],
)  # fmt: skip
def test_verbs_of_a_rig_refuse_a_gateway_alone(monkeypatch, capsys, team, verb, status, said):
    def no_host(*args, **kwargs):
        raise AssertionError("a refused verb reached a host")

    monkeypatch.setattr(cli, "run_on_host", no_host)
    monkeypatch.setattr(subprocess, "run", no_host)
    assert llamarig(monkeypatch, capsys, team, *verb, "--host", "gw") == (status, "", said)


def test_lock_has_nothing_to_record_for_a_gateway(monkeypatch, capsys, team):
    status, out, _ = llamarig(monkeypatch, capsys, team, "lock", "--host", "gw")
    assert (status, out) == (
        0,
        "gw: nothing to record (only a CUDA rig's plan reads the model's header)\n",
    )


def test_verify_expects_of_a_gateway_alone_its_users_hashes_and_no_plan(monkeypatch, team):
    def no_plan(host_config):
        raise AssertionError(f"{host_config.name} was planned")

    monkeypatch.setattr(runner, "host_plan", no_plan)
    host = load_inventory(team).hosts["gw"]
    expected = runner.expectations(host, inventory=team)
    keys = {path.stem: path.read_text().strip() for path in team.parent.glob("*.key")}
    assert expected["gateway"]["users"] == [
        {"sha256": hashlib.sha256(keys[name].encode()).hexdigest(), "name": name}
        for name in ("alice", "bob")
    ]
    assert expected["gateway"]["certificate_copy"] is None  # no deploy copied it yet
    assert expected["derived"] is None and expected["model_files"] == []
    assert expected["data"]["gateway"]["backends"][0]["model"] == "smollm2"
    # The runner writes this to a file: no key of anyone, the rigs' included.
    written = json.dumps(expected)
    assert [name for name, key in keys.items() if key in written] == []


def test_verify_expects_the_certificate_copy_beside_the_inventory(monkeypatch, team, tmp_path):
    made = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=test", "-keyout", str(tmp_path / "cert.key"),
         "-out", str(tmp_path / "cert.pem")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if made.returncode:
        pytest.skip(f"no openssl to make a certificate: {made.stderr}")
    copy = team.parent / "gateway-certs" / "gw.crt"
    copy.parent.mkdir()
    copy.write_text((tmp_path / "cert.pem").read_text())
    host = load_inventory(team).hosts["gw"]
    assert runner.expectations(host, inventory=team)["gateway"]["certificate_copy"] == {
        "path": str(copy),
        "fingerprint": fingerprint(copy.read_text()),
    }
    copy.write_text("not a certificate\n")
    certificate = runner.expectations(host, inventory=team)["gateway"]["certificate_copy"]
    assert certificate == {"path": str(copy), "fingerprint": None}


def test_verify_expects_of_a_rig_that_runs_the_gateway_both(team):
    inventory = gateway_on_rig2(team)
    hosts = load_inventory(inventory).hosts
    rig2 = runner.expectations(hosts["rig2"], inventory=inventory)
    assert rig2["derived"]["base_url"] == "http://127.0.0.1:8111"
    assert [user["name"] for user in rig2["gateway"]["users"]] == ["alice", "bob"]
    assert runner.expectations(hosts["rig1"], inventory=inventory)["gateway"] is None
    written = json.dumps(rig2)
    assert not [key for key in keys_in(team.parent) if key in written]
