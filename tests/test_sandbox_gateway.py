"""The team endpoint, for real: a gateway sandbox (Debian bookworm, HAProxy from its own
repository) in front of two CPU rigs (trixie): `rig-a` serves SmolLM2, `rig-b` is a router
serving SmolLM2 and the random-weight test model. One `pyinfra inventory.py deploy.py`
converges all three; the next changes nothing. Through the gateway, over TLS, with the OpenAI
Python client and a user's key: every model is listed and answers by name, a wrong or revoked
key gets 401 and never reaches a rig, an unknown model gets 404 with the known names, the rigs'
own paths are 404; more clients than slots wait at the gateway (no rig ever runs more than its
slots) and spread over both rigs; a killed llama-server is taken out and comes back.

The sandboxes share this machine's loopback, which plays the team's network. Stand-ins as in
test_sandbox_converge (the model from the loopback file server, llama.cpp from a git daemon
mirror). Needs root, systemd-nspawn and mmdebstrap.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from llamarig import CACHE_DIR
from llamarig.tables.certificates import fingerprint
from tests import sandboxes
from tests.conftest import PROJECT
from tests.gateway_clients import QUESTION, Endpoint, Streaming, stream_chat, whole
from tests.sandboxes import changed_operations, compilers, fresh_sandboxes, in_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

GATEWAY, RIG_A, RIG_B = "sandbox-gw", "sandbox-gw-rig-a", "sandbox-gw-rig-b"
SSH_PORTS = {GATEWAY: 2240, RIG_A: 2241, RIG_B: 2242}
RIG_PORTS = {RIG_A: 8111, RIG_B: 8112}
GATEWAY_PORT, METRICS_PORT = 8443, 8405
GATEWAY_URL = f"https://127.0.0.1:{GATEWAY_PORT}"
USERS = ("alice", "bob")


def _host(name: str, release_known_hosts: str) -> dict:
    return {
        "ssh": {
            "host": "127.0.0.1",
            "port": SSH_PORTS[name],
            "user": "root",
            "key": str(CACHE_DIR / "sandbox" / "id_ed25519"),
            "known_hosts": release_known_hosts,
        }
    }


def inventory(
    path: Path,
    infos: dict,
    keys: dict,
    users=USERS,
    queue_timeout: int = 30,
    fronted=(RIG_A, RIG_B),
    ctx: int = 2048,
    hold_timeout: int = 60,
    cmake_options: dict | None = None,
) -> Path:
    """Three hosts: the demo rig's settings on the two rigs (one thread, speed unmeasured:
    sandboxes.lane_rig), the gateway in the `gateways` group fronting the rigs of group
    `front` (``fronted``); ``ctx``: rig-a's context, and the router's SmolLM2 twice it;
    ``cmake_options``: added to both rigs' build options."""
    demo = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    base = demo["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    smollm2_model = base["model"]
    rigs = {}
    for name in (RIG_A, RIG_B):
        rig = yaml.safe_load(yaml.safe_dump(base))
        rig["ssh"] = _host(name, str(infos[name].known_hosts_path))["ssh"]
        rig["server"].update(port=RIG_PORTS[name], api_key_file=str(keys[name]))
        rig["llama_cpp"]["cmake_options"].update(cmake_options or {})
        sandboxes.lane_rig(rig)
        rigs[name] = rig
    rigs[RIG_A]["server"].update(alias="smollm2", ctx=ctx)
    router = rigs[RIG_B]
    router.pop("model")
    answers = router.pop("expect")["answers"]
    router["models"] = [
        {"name": "smollm2", **smollm2_model, "load_on_startup": True,
         "server": {"ctx": 2 * ctx, "parallel": 2}, "expect": {"answers": answers}},
        {"name": "tiny-random", **sandboxes.random_model(infos[RIG_B]), "load_on_startup": True,
         "server": {"ctx": 1024, "parallel": 1}},
    ]  # fmt: skip
    gateway = _host(GATEWAY, str(infos[GATEWAY].known_hosts_path))
    gateway.update(
        role="gateway",
        gateway={
            "host": "127.0.0.1",
            "port": GATEWAY_PORT,
            "rig_key_file": str(keys["gateway"]),
            "fronts": "front",
            "queue_timeout": queue_timeout,
            "hold_timeout": hold_timeout,
            "users": [{"name": user, "key_file": str(keys[user])} for user in users],
            "metrics": {"host": "127.0.0.1", "port": METRICS_PORT},
        },
    )
    document = {
        "all": {
            "children": {
                "rigs": {"hosts": rigs},
                "front": {"hosts": {name: None for name in fronted}},
                "gateways": {"hosts": {"gw": gateway}},
            }
        }
    }
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gateway")
    keys = {
        name: sandboxes.new_api_key(directory, name)[1]
        for name in (RIG_A, RIG_B, "gateway", *USERS)
    }
    releases = {RIG_A: "trixie", RIG_B: "trixie", GATEWAY: "bookworm"}
    sandboxes_up = fresh_sandboxes(
        {name: (release, SSH_PORTS[name]) for name, release in releases.items()}
    )
    infos = next(sandboxes_up)
    try:
        path = inventory(directory / "team.yml", infos, keys)
        result = sandboxes.deploy(path)
        assert result.returncode == 0, sandboxes.failure_lines(result)
        yield {"infos": infos, "keys": keys, "path": path, "dir": directory, "first": result}
    finally:
        next(sandboxes_up, None)  # takes them down


def key_of(team, user: str) -> str:
    return team["keys"][user].read_text().strip()


def tls_context(team) -> ssl.SSLContext:
    """Trust the gateway's self-signed certificate, as the deploy copied it beside the
    inventory."""
    return ssl.create_default_context(cafile=str(team["dir"] / "gateway-certs" / "gw.crt"))


def call(team, path: str, body=None, key: str | None = None, method=None, timeout=300):
    """One request to the gateway: (status, parsed JSON body or text)."""
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(GATEWAY_URL + path, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=tls_context(team)) as reply:
            status, text = reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        status, text = error.code, error.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def rig_requests(team, name: str) -> int:
    """How many tasks a rig's llama-server (a router's children too) logged in its journal:
    one `processing task` line per completion a slot takes (its default log level; the
    per-request line is a trace)."""
    out = in_sandbox(
        team["infos"][name],
        "journalctl -u llama-server.service --no-pager -o cat | grep -c 'processing task' || true",
    )
    return int(out or 0)


def test_one_converge_sets_up_the_team_endpoint_and_the_next_changes_nothing(team):
    output = team["first"].stdout + team["first"].stderr
    cert = (team["dir"] / "gateway-certs" / "gw.crt").read_text()
    # The run printed the self-signed certificate's fingerprint, as the copy has it.
    assert fingerprint(cert) in output, output[-4000:]
    assert changed_operations(sandboxes.converge(team["path"])) == []
    gateway = team["infos"][GATEWAY]
    # The gateway keeps the users' key hashes and its key for the rigs; never a user's key.
    stored = in_sandbox(gateway, "cat /etc/haproxy/llamarig/*.map /etc/haproxy/haproxy.cfg")
    for user in USERS:
        assert key_of(team, user) not in stored
    assert in_sandbox(gateway, "stat -c %a /etc/haproxy/llamarig/rig-key.map") == "600"
    # Each rig accepts its own key and the gateway's.
    for rig in (RIG_A, RIG_B):
        accepted = in_sandbox(team["infos"][rig], "cat /etc/llamarig/api-key").split()
        assert accepted == [key_of(team, rig), key_of(team, "gateway")]


def test_every_model_answers_by_name_through_tls_with_a_users_key(team):
    client = openai_client(team, "alice")
    assert sorted(model.id for model in client.models.list()) == ["smollm2", "tiny-random"]
    answer = client.chat.completions.create(
        model="smollm2", messages=[QUESTION], max_tokens=16, temperature=0
    )
    assert "Paris" in answer.choices[0].message.content, answer
    # Random weights: it answers, with nonsense.
    text = client.completions.create(model="tiny-random", prompt="Hello", max_tokens=8)
    assert text.usage.completion_tokens == 8, text
    log = in_sandbox(team["infos"][GATEWAY], "journalctl -u haproxy --no-pager -o cat")
    # The user's name on each request's log line, never the key.
    assert re.search(r"user=alice model=\"smollm2\" model_0/", log), log[-3000:]
    assert key_of(team, "alice") not in log


def test_verify_checks_the_gateway_and_skips_the_rig_checks_there(team):
    from llamarig.checks.conftest import GATEWAY_ONLY

    result = sandboxes.verify(team["path"], "-v")
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    runs = dict(part.split("\n", 1) for part in result.stdout.split("== verify ")[1:])
    passed = re.findall(r"test_gateway\.py::(\w+)\[[^\]]*\] PASSED", runs["gw"])
    assert len(passed) == 9 and len(set(passed)) == 7, runs["gw"][-4000:]
    assert GATEWAY_ONLY in runs["gw"]
    for rig in (RIG_A, RIG_B):
        assert len(re.findall(r"test_gateway\.py::\w+\[[^\]]*\] SKIPPED", runs[rig])) == 9
        assert "this host runs no gateway" in runs[rig]


def test_status_shows_each_rig_as_the_gateway_sees_it(team):
    result = sandboxes.llamarig(team["path"], "status", "--window", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    cert = (team["dir"] / "gateway-certs" / "gw.crt").read_text()
    assert f"SHA-256 {fingerprint(cert)}" in result.stdout, result.stdout
    assert re.search(rf"backend  smollm2 .*{RIG_A} UP.*{RIG_B} UP", result.stdout), result.stdout
    assert re.search(rf"backend  tiny-random .*{RIG_B} UP", result.stdout), result.stdout
    rows = {row["host"]: row for row in json.loads(
        sandboxes.llamarig(team["path"], "status", "--json", "--window", "1").stdout
    )}  # fmt: skip
    models = {model["model"]: model for model in rows["gw"]["gateway"]["models"]}
    assert {rig["name"] for rig in models["smollm2"]["rigs"]} == {RIG_A, RIG_B}


def test_a_wrong_key_gets_401_and_never_reaches_a_rig(team):
    before = {rig: rig_requests(team, rig) for rig in (RIG_A, RIG_B)}
    body = {"model": "smollm2", "messages": [QUESTION], "max_tokens": 4}
    for key in (None, "x" * 64, key_of(team, RIG_A), key_of(team, "gateway")):
        status, reply = call(team, "/v1/chat/completions", body, key)
        assert status == 401, reply
        assert reply["error"]["code"] == "invalid_api_key", reply
    assert {rig: rig_requests(team, rig) for rig in (RIG_A, RIG_B)} == before
    # The count does see a request that reaches a rig: two with a user's key reach both.
    records = clients_at_once(team, 4, 4)
    assert all(record.get("status") == 200 for record in records), records
    after = {rig: rig_requests(team, rig) for rig in (RIG_A, RIG_B)}
    assert sum(after.values()) >= sum(before.values()) + 4, (before, after)


def test_an_unknown_model_gets_404_with_the_known_names(team):
    for name in ("gpt-4o", 'a"b\\c\u0007%[d]'):
        status, reply = call(
            team,
            "/v1/chat/completions",
            {"model": name, "messages": [QUESTION]},
            key_of(team, "bob"),
        )
        assert status == 404, reply
        message = reply["error"]["message"]
        assert name in message and "smollm2" in message and "tiny-random" in message, message


def test_only_the_api_is_forwarded(team):
    refused = [("GET", "/slots"), ("GET", "/props"), ("GET", "/metrics"), ("GET", "/health"),
               ("POST", "/completion"), ("GET", "/v1/chat/completions")]  # fmt: skip
    for method, path in refused:
        body = {"model": "smollm2", "prompt": "x"} if method == "POST" else None
        status, reply = call(team, path, body, key_of(team, "alice"), method=method)
        assert status == 404, (path, reply)


def test_the_metrics_exporter_listens_on_loopback_only(team):
    with urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10) as reply:
        metrics = reply.read().decode()
    assert re.search(rf'haproxy_server_status{{proxy="model_0",server="{RIG_A}"', metrics)
    listening = in_sandbox(team["infos"][GATEWAY], f"ss -Hltn 'sport = :{METRICS_PORT}'")
    assert listening.split()[3] == f"127.0.0.1:{METRICS_PORT}", listening


def openai_client(team, user: str):
    import httpx
    from openai import OpenAI

    return OpenAI(
        base_url=f"{GATEWAY_URL}/v1",
        api_key=key_of(team, user),
        http_client=httpx.Client(verify=tls_context(team)),
        timeout=300,
        max_retries=0,
    )


def test_a_body_too_large_to_route_gets_413(team):
    """The OpenAI client sends `messages` before `model`: a body past the buffer would be
    routed on its first part. (A client that writes a large body whole before reading may see
    the connection reset instead: docs/gateway.md.)"""
    import openai

    client = openai_client(team, "alice")
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "x" * (1100 * 1024)}]
        )
    assert refused.value.status_code == 413, refused.value
    assert refused.value.body["code"] == "request_too_large", refused.value.body
    # Just under the limit, with `model` last, it is routed (and refused by the rig for its
    # length, not by the gateway).
    status, reply = call(
        team, "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * (1000 * 1024)}], "model": "nope"},
        key_of(team, "alice"),
    )  # fmt: skip
    assert status == 404 and reply["error"]["code"] == "model_not_found", reply


def test_a_revoked_user_is_refused_at_the_next_request(team):
    revoked = inventory(team["dir"] / "revoked.yml", team["infos"], team["keys"], users=("alice",))
    applied = changed_operations(sandboxes.converge(revoked))
    assert any(name.startswith("Users' key hashes") for name in applied), applied
    # verify against the inventory that still lists bob: the gateway no longer has his hash.
    stale = sandboxes.verify(team["path"], "-k", "test_users_map")
    assert stale.returncode != 0 and "lacks the key of bob" in stale.stdout, stale.stdout[-3000:]
    body = {"model": "smollm2", "messages": [QUESTION], "max_tokens": 4}
    assert call(team, "/v1/chat/completions", body, key_of(team, "bob"))[0] == 401
    assert call(team, "/v1/chat/completions", body, key_of(team, "alice"))[0] == 200
    assert changed_operations(sandboxes.converge(team["path"])) != []  # bob back


def endpoint(team, user: str = "alice") -> Endpoint:
    """The gateway as ``user`` asking for SmolLM2 sees it."""
    return Endpoint(
        GATEWAY_URL, team["dir"] / "gateway-certs" / "gw.crt", key_of(team, user), "smollm2"
    )


def clients_at_once(team, count: int, tokens: int) -> list[dict]:
    """``count`` streamed chats started together; each one's ``stream_chat`` record."""
    records = [{} for _ in range(count)]
    threads = [
        threading.Thread(target=stream_chat, args=(endpoint(team), tokens, record))
        for record in records
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return records


def busy_slots(team, rig: str) -> int:
    """How many of a rig's SmolLM2 slots are processing now (its /slots, with its own key)."""
    query = "?model=smollm2" if rig == RIG_B else ""
    request = urllib.request.Request(
        f"http://127.0.0.1:{RIG_PORTS[rig]}/slots{query}",
        headers={"Authorization": f"Bearer {key_of(team, rig)}"},
    )
    with urllib.request.urlopen(request, timeout=10) as reply:
        return sum(1 for slot in json.load(reply) if slot.get("is_processing"))


def served_by(team, since: str) -> dict[str, int]:
    """Requests of model smollm2 each rig answered (HAProxy's log lines since ``since``)."""
    log = in_sandbox(
        team["infos"][GATEWAY],
        f"journalctl -u haproxy --no-pager -o cat --since {json.dumps(since)}",
    )
    return {rig: len(re.findall(rf"model_0/{rig} 200 ", log)) for rig in (RIG_A, RIG_B)}


def gateway_clock(team) -> str:
    return in_sandbox(team["infos"][GATEWAY], "date '+%Y-%m-%d %H:%M:%S'")


def test_more_clients_than_slots_wait_at_the_gateway_and_spread_over_both_rigs(team):
    """10 clients for 4 slots of SmolLM2 (2 on each rig): no rig ever runs more than its
    slots (its /slots, read every 0.2 s), every request ends whole, both rigs serve."""
    since = gateway_clock(team)
    most = {RIG_A: 0, RIG_B: 0}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for rig in most:
                most[rig] = max(most[rig], busy_slots(team, rig))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        records = clients_at_once(team, 10, 64)
    finally:
        stop.set()
        watcher.join(timeout=30)
    assert [r.get("status") for r in records] == [200] * 10, records
    assert all(r.get("finish") == "length" and "error" not in r for r in records), records
    assert most[RIG_A] <= 2 and most[RIG_B] <= 2, most
    assert max(most.values()) == 2, most  # the watch saw the slots full: the queue was used
    spread = served_by(team, since)
    assert spread[RIG_A] > 0 and spread[RIG_B] > 0 and sum(spread.values()) == 10, spread


def test_a_request_that_waits_past_queue_timeout_gets_503_with_retry_after(team):
    short = inventory(team["dir"] / "short-queue.yml", team["infos"], team["keys"], queue_timeout=2)
    sandboxes.converge(short)
    try:
        records = clients_at_once(team, 8, 400)  # each several seconds: 4 run, 4 wait
    finally:
        sandboxes.converge(team["path"])
    statuses = sorted(r.get("status") for r in records)
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 4, records
    refused = [r for r in records if r.get("status") == 503]
    assert refused, records
    for record in refused:
        assert json.loads(record["body"])["error"]["code"] == "overloaded", record
        assert record["retry_after"], record
        assert record["end"] - record["start"] < 10, record  # the bound, not a rig's answer


def test_a_killed_rig_is_taken_out_and_takes_requests_again_once_back(team):
    """SIGKILL llama-server on rig-a while 4 clients stream: requests that start after the
    health checks' 2 s (plus a second) all succeed on rig-b; rig-a restarts by itself
    (systemd) and serves again."""
    records: list[dict] = []
    deadline = time.monotonic() + 40
    killed: dict = {}

    def client() -> None:
        for _ in range(200):  # bounded in count and in time
            if time.monotonic() > deadline:
                return
            record: dict = {}
            stream_chat(endpoint(team), 24, record)
            records.append(record)

    clients = [threading.Thread(target=client) for _ in range(4)]
    for thread in clients:
        thread.start()
    time.sleep(4)
    in_sandbox(team["infos"][RIG_A], "systemctl kill -s KILL llama-server.service")
    killed["at"] = time.monotonic()
    for thread in clients:
        thread.join(timeout=120)
    late = [r for r in records if r["start"] > killed["at"] + 3]
    assert late and all(r.get("status") == 200 and r.get("finish") for r in late), late
    early_failed = [r for r in records if r["start"] <= killed["at"] + 3 and r.get("status") != 200]
    # Only a stream in flight on the killed rig may end short; none may be refused.
    assert len(early_failed) <= 2, early_failed
    # Back by itself (Restart=on-failure, RestartSec=5) and in rotation again.
    in_sandbox(
        team["infos"][RIG_A],
        "for i in $(seq 60); do curl -sf localhost:8111/health && break; sleep 1; done",
    )
    since = gateway_clock(team)
    time.sleep(3)  # its health check: rise 2, 1 s apart
    clients_at_once(team, 6, 16)
    assert served_by(team, since)[RIG_A] > 0


# Issue 56's scenarios: changes rolled through the gateway while clients stream.


def rollout(path: Path) -> subprocess.CompletedProcess:
    """`llamarig rollout` of ``path``; it must succeed."""
    result = sandboxes.llamarig(path, "rollout")
    assert result.returncode == 0, (result.stdout + result.stderr)[-8000:]
    return result


class OutOfService:
    """The longest span in which the gateway had one server (``BACKEND,SERVER``) not UP and
    ready (drained for a change, or down), read from its runtime API every half second."""

    def __init__(self, team, server: str):
        self.spans: list[float] = []
        self.stop = threading.Event()
        stat = (
            "echo 'show stat' | socat -t 5 stdio UNIX-CONNECT:/run/haproxy/admin.sock "
            f"| grep '^{server},' | cut -d, -f18"
        )

        def watch() -> None:
            since = None
            deadline = time.monotonic() + 900
            while not self.stop.is_set() and time.monotonic() < deadline:
                state = in_sandbox(team["infos"][GATEWAY], stat)
                now = time.monotonic()
                if state == "UP":
                    if since is not None:
                        self.spans.append(now - since)
                    since = None
                elif since is None:
                    since = now
                time.sleep(0.5)

        self.thread = threading.Thread(target=watch)
        self.thread.start()

    def finish(self) -> float:
        self.stop.set()
        self.thread.join(timeout=60)
        return max(self.spans, default=0.0)


def gateway_said(team, since: str) -> str:
    """HAProxy's log lines since ``since`` of requests that did not end 200, for a failure's
    message: which rig answered what, and when."""
    return in_sandbox(
        team["infos"][GATEWAY],
        f"journalctl -u haproxy --no-pager -o short-precise --since {json.dumps(since)} "
        "| grep -v ' 200 ' | tail -n 40",
    )


def rolled_out_under_load(team, path: Path, clients: int) -> tuple[list[dict], str]:
    """`llamarig rollout` of ``path`` with ``clients`` streaming before, throughout and after;
    every request's record and the rollout's output, which must succeed. A request that did
    not end whole is a failure unless the caller allows it; the gateway's log of the requests
    that did not end 200 is appended to the output for the message."""
    since = gateway_clock(team)
    streaming = Streaming(endpoint(team), clients)
    try:
        time.sleep(2)
        result = rollout(path)
        time.sleep(2)
    finally:
        records = streaming.finish()
    said = gateway_said(team, since)
    output = result.stdout + result.stderr + "\n--- gateway, not 200:\n" + said
    broken = [record for record in records if not whole(record)]
    if broken:  # the whole story, for the failure the caller reports
        (team["dir"] / f"broken-{path.stem}.txt").write_text(f"{broken}\n{output}")
        print(f"broken requests; the rollout and the gateway: {team['dir']}/broken-{path.stem}.txt")
    return records, output


def test_a_change_rolls_through_both_rigs_one_at_a_time_and_cuts_nothing(team):
    """6 clients stream throughout; rig-a's context and the router's SmolLM2 change: rig-a
    restarts, the router reloads SmolLM2, each out of rotation in turn; every request ends
    whole, and the next rollout changes nothing."""
    changed = inventory(team["dir"] / "ctx.yml", team["infos"], team["keys"], ctx=3072)
    records, output = rolled_out_under_load(team, changed, 6)
    broken = [record for record in records if not whole(record)]
    assert len(records) > 20 and not broken, (len(records), broken[:5], output[-6000:])
    out_a = output.index(f"out of rotation at gateway gw (model_0/{RIG_A})")
    back_a = output.index(f"back in rotation at gateway gw (model_0/{RIG_A})")
    out_b = output.index("out of rotation at gateway gw (model_0/" + RIG_B)
    back_b = output.index("back in rotation at gateway gw (model_0/" + RIG_B)
    assert out_a < back_a < out_b < back_b, output[-6000:]
    assert "expected answer(s) right" in output[out_a:back_a], output[out_a:back_a]
    unit = "/etc/systemd/system/llama-server.service"
    in_sandbox(team["infos"][RIG_A], f"grep -q -- '-c 3072' {unit}")
    assert changed_operations(sandboxes.converge(changed)) == []
    team["path"] = changed


def test_a_build_change_is_compiled_once_and_shipped_while_clients_stream(team):
    """4 clients stream throughout; both rigs' build options change (a new build key): the
    rollout's first step compiles the new build once, on rig-a while it still serves, and keeps
    it; rig-a's own step switches to it, rig-b's gets it shipped from the control machine's
    cache, with no compiler on rig-b before or after. Every request ends whole; the next
    converge changes nothing."""
    infos = team["infos"]
    assert compilers(infos[RIG_B]) == ""
    changed = inventory(team["dir"] / "build.yml", infos, team["keys"], ctx=3072,
                        cmake_options={"LLAMA_BUILD_EXAMPLES": False})  # fmt: skip
    records, output = rolled_out_under_load(team, changed, 4)
    broken = [record for record in records if not whole(record)]
    assert len(records) > 10 and not broken, (len(records), broken[:5], output[-6000:])
    assert f"step 1 of 4: {RIG_A}, {RIG_B} (the builds" in output, output[-6000:]
    # pyinfra writes to stderr, the rollout its steps to stdout: each run of pyinfra begins so.
    runs = output.split("--> Loading config...")
    assert len(runs) == 5, output[-6000:]
    builds, rig_a_run, rig_b_run = runs[1:4]
    compiled = re.search(rf"\[{RIG_A}\]\s+llamarig: build (\S+) kept in ", builds)
    ship = re.compile(r"llamarig: build \S+ shipped from")
    assert compiled and not ship.search(builds), builds[-8000:]
    key = compiled[1]
    assert "kept in" not in rig_a_run and not ship.search(rig_a_run), rig_a_run[-6000:]
    shipped = rf"\[{RIG_B}\]\s+llamarig: build {key} shipped from the control machine's cache"
    assert re.search(shipped, rig_b_run), rig_b_run[-8000:]
    assert compilers(infos[RIG_B]) == ""
    running = {
        name: in_sandbox(infos[name], "readlink /opt/llamarig/current") for name in (RIG_A, RIG_B)
    }
    assert running[RIG_A] == running[RIG_B] and key.startswith(running[RIG_A].rsplit("/")[-1])
    assert changed_operations(sandboxes.converge(changed)) == []
    team["path"] = changed
    print(f"build change rolled out: {len(records)} requests ended whole, 0 cut; {compiled[0]}")


def test_one_rig_behind_the_gateway_holds_new_requests_while_it_restarts(team):
    """rig-b leaves the gateway and a user joins while 4 clients stream (0 failed); then
    rig-a, alone behind it, restarts for a context change: requests wait at the gateway and
    are served, the longest first token within drain + restart + 10 s; with a hold bound
    shorter than the restart, the waiting requests get the clear 503 and nothing else fails."""
    keys = team["keys"]
    keys["carol"] = sandboxes.new_api_key(team["dir"], "carol")[1]
    alone = dict(fronted=(RIG_A,), users=(*USERS, "carol"), ctx=3072)
    records, output = rolled_out_under_load(
        team, inventory(team["dir"] / "alone.yml", team["infos"], keys, **alone), 4
    )
    broken = [record for record in records if not whole(record)]
    assert records and not broken, (broken[:5], output[-4000:])
    assert call(team, "/v1/models", key=key_of(team, "carol"))[0] == 200

    path = inventory(team["dir"] / "alone-ctx.yml", team["infos"], keys, **{**alone, "ctx": 2048})
    out = OutOfService(team, f"model_0,{RIG_A}")
    try:
        records, output = rolled_out_under_load(team, path, 4)
    finally:
        window = out.finish()
    broken = [record for record in records if not whole(record)]
    assert records and not broken, (broken[:5], output[-4000:])
    longest = max(record["first"] - record["start"] for record in records)
    assert 0 < window and longest <= window + 10, (longest, window)
    print(
        f"rig-a out of service {window:.1f} s; the longest wait for a first token {longest:.1f} s"
    )

    short = {**alone, "ctx": 2048, "hold_timeout": 1}
    path = inventory(team["dir"] / "alone-short-hold.yml", team["infos"], keys, **short)
    sandboxes.converge(path)  # the shorter hold first (the gateway's reload), then the change
    short["ctx"] = 3072
    path = inventory(team["dir"] / "alone-short-hold-ctx.yml", team["infos"], keys, **short)
    records, output = rolled_out_under_load(team, path, 4)
    held_out = [r for r in records if r.get("status") == 503]
    others = [r for r in records if r.get("status") != 503]
    assert held_out, f"no request waited past a 1 s hold during the restart: {output[-3000:]}"
    assert all(json.loads(r["body"])["error"]["code"] == "overloaded" and r["retry_after"]
               for r in held_out), held_out[:3]  # fmt: skip
    assert all(whole(r) for r in others), ([r for r in others if not whole(r)][:5], output[-4000:])
