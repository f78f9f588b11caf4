"""A slower version refused out of rotation, for real: a gateway sandbox (bookworm) in front of
two CPU rigs (trixie) serving the random-weight test model with the slowdown guard on (one
decode thread, `server.max_slowdown` at its default 10%). While 3 clients stream through the
gateway, `llamarig rollout` changes both rigs' context; the first rig's new version is made
markedly slower (tests/halting.py: stopped 35 ms of every 40). The first rig is taken out of
rotation, restarted, measured in turns with the last version while no user request reaches it,
refused, rolled back and put back; the rollout stops before the second rig, which served every
request meanwhile: 0 failed, 0 cut. The next converge changes nothing.

`alone`, as test_sandbox_slowdown: the guard's verdict rests on speeds measured here, which a
build in the other lane would spread. The test model, not SmolLM2, for the same reason as
there (its looks take seconds, not minutes).
"""

from __future__ import annotations

import os
import re
import shlex
import threading
import time
from pathlib import Path

import pytest
import yaml

from llamarig import CACHE_DIR
from llamarig.facts.gateway import runtime_api, stat_rows
from tests import sandboxes
from tests.conftest import PROJECT
from tests.gateway_clients import Endpoint, Streaming, whole
from tests.halting import SERVICE, halted_most_of_the_time, option
from tests.sandboxes import changed_operations, fresh_sandboxes, in_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy, pytest.mark.alone]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

GATEWAY, RIG_1, RIG_2 = "sandbox-gs", "sandbox-gs-rig-1", "sandbox-gs-rig-2"
SSH_PORTS = {GATEWAY: 2250, RIG_1: 2251, RIG_2: 2252}
RIG_PORTS = {RIG_1: 8121, RIG_2: 8122}
GATEWAY_PORT, METRICS_PORT = 8444, 8406
MODEL = "tiny-random"
SLOWER_CTX = 1024


def _ssh(name: str, infos: dict) -> dict:
    return {
        "host": "127.0.0.1",
        "port": SSH_PORTS[name],
        "user": "root",
        "key": str(CACHE_DIR / "sandbox" / "id_ed25519"),
        "known_hosts": str(infos[name].known_hosts_path),
    }


def inventory(path: Path, infos: dict, keys: dict, ctx: int) -> Path:
    """The two rigs (the demo rig's settings, the test model as MODEL, one decode thread, the
    guard on) with context ``ctx``, fronted by the gateway."""
    demo = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    base = demo["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    rigs = {}
    for name in (RIG_1, RIG_2):
        rig = sandboxes.serving_the_random_model(yaml.safe_load(yaml.safe_dump(base)), infos[name])
        rig["ssh"] = _ssh(name, infos)
        rig["server"].update(
            port=RIG_PORTS[name], api_key_file=str(keys[name]), alias=MODEL, ctx=ctx, threads=1
        )
        rigs[name] = rig
    gateway = {
        "ssh": _ssh(GATEWAY, infos),
        "role": "gateway",
        "gateway": {
            "host": "127.0.0.1",
            "port": GATEWAY_PORT,
            "rig_key_file": str(keys["gateway"]),
            "fronts": "front",
            "users": [{"name": "alice", "key_file": str(keys["alice"])}],
            "metrics": {"host": "127.0.0.1", "port": METRICS_PORT},
        },
    }
    document = {
        "all": {
            "children": {
                "rigs": {"hosts": rigs},
                "front": {"hosts": {RIG_1: None, RIG_2: None}},
                "gateways": {"hosts": {"gw": gateway}},
            }
        }
    }
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gateway-slow")
    keys = {
        name: sandboxes.new_api_key(directory, name)[1]
        for name in (RIG_1, RIG_2, "gateway", "alice")
    }
    releases = {RIG_1: "trixie", RIG_2: "trixie", GATEWAY: "bookworm"}
    sandboxes_up = fresh_sandboxes(
        {name: (release, SSH_PORTS[name]) for name, release in releases.items()}
    )
    infos = next(sandboxes_up)
    try:
        path = inventory(directory / "team.yml", infos, keys, ctx=2048)
        result = sandboxes.deploy(path)
        assert result.returncode == 0, sandboxes.failure_lines(result)
        yield {"infos": infos, "keys": keys, "path": path, "dir": directory}
    finally:
        next(sandboxes_up, None)  # takes them down


def ctx_running(info) -> str:
    line = in_sandbox(info, f"systemctl show -P ExecStart {SERVICE}")
    return option(shlex.split(line.split("argv[]=", 1)[1].split(" ;", 1)[0]), "-c")


def server_stat(team, rig: str) -> tuple[str, int]:
    """The gateway's view of ``rig``: its status (UP, MAINT, ...) and how many requests it
    has sent it so far (`show stat`'s status and stot), read as the product reads it."""
    lines = in_sandbox(team["infos"][GATEWAY], runtime_api("show stat")).splitlines()
    (row,) = [r for r in stat_rows(lines) if (r["pxname"], r["svname"]) == ("model_0", rig)]
    return row["status"], int(row["stot"])


class WhileOut:
    """The gateway's view of a rig, read every quarter second until stopped: whether it sent
    the rig a request while the rig stayed in maintenance (two reads in a row in MAINT with
    the count grown), and how many reads found it there."""

    def __init__(self, team, rig: str):
        self.reads: list[tuple[str, int]] = []
        self.stop = threading.Event()

        def watch() -> None:
            deadline = time.monotonic() + 900
            while not self.stop.is_set() and time.monotonic() < deadline:
                self.reads.append(server_stat(team, rig))
                time.sleep(0.25)

        self.thread = threading.Thread(target=watch)
        self.thread.start()

    def finish(self) -> tuple[int, list[tuple[str, int]]]:
        """(the reads in maintenance, the pairs of reads in it where the count grew)."""
        self.stop.set()
        self.thread.join(timeout=60)
        pairs = zip(self.reads, self.reads[1:], strict=False)
        grown = [(a, b) for a, b in pairs if a[0] == b[0] == "MAINT" and b[1] > a[1]]
        return sum(1 for status, _ in self.reads if status == "MAINT"), grown


def test_a_slower_version_is_refused_out_of_rotation_while_the_other_rig_serves(team):
    infos, keys = team["infos"], team["keys"]
    assert ctx_running(infos[RIG_1]) == ctx_running(infos[RIG_2]) == "2048"
    endpoint = Endpoint(
        f"https://127.0.0.1:{GATEWAY_PORT}",
        team["dir"] / "gateway-certs" / "gw.crt",
        keys["alice"].read_text().strip(),
        MODEL,
    )
    out_line = f"out of rotation at gateway gw (model_0/{RIG_1})"
    back_line = f"back in rotation at gateway gw (model_0/{RIG_1})"
    changed = inventory(team["dir"] / "slower.yml", infos, keys, ctx=SLOWER_CTX)
    slower = RIG_PORTS[RIG_1]
    streaming = Streaming(endpoint, 3, tokens=400, most=2000)
    out = WhileOut(team, RIG_1)
    try:
        time.sleep(2)
        with halted_most_of_the_time(slower, lambda argv: option(argv, "-c") == str(SLOWER_CTX)):
            result = sandboxes.llamarig(changed, "rollout")
        rollout_ended = time.monotonic()
        time.sleep(2)
    finally:
        records = streaming.finish()
        maintenance, grown = out.finish()
    returncode, output = result.returncode, result.stdout + result.stderr
    print("\n".join(line for line in output.splitlines() if "decodes at" in line))
    broken = [record for record in records if not whole(record)]
    print(f"{len(records)} requests while the rollout ran, {len(broken)} failed or cut")
    assert returncode != 0, f"a markedly slower version must stop the rollout:\n{output[-6000:]}"
    refused = re.search(
        r"the new version of \S+ decodes at ([0-9.]+) tokens/s at best, (\d+)% slower than the "
        r"last version's best, ([0-9.]+) tokens/s",
        output,
    )
    assert refused, output[-6000:]
    assert float(refused[1]) < 0.9 * float(refused[3]), refused[0]
    # Out of rotation before the first look, measured, rolled back, back in; then stopped.
    marks = [out_line, refused[0], "rolled back", back_line]
    where = [output.find(mark) for mark in marks]
    assert -1 not in where and where == sorted(where), (where, output[-6000:])
    # No user request reached RIG_1 while it was out: it was there for many reads, and the
    # gateway's count of its requests never grew between two of them.
    print(f"{RIG_1} in maintenance for {maintenance} reads of the gateway, 4 a second")
    assert maintenance >= 20 and not grown, (maintenance, grown)
    assert re.search(rf"stopped before [^.]*{RIG_2}", output), output[-3000:]
    assert re.search(rf"{RIG_1}: runs \S+", output), output[-3000:]
    # The other rig served throughout: every request ended whole.
    assert len(records) >= 10 and not broken, (len(records), broken[:5], output[-4000:])
    assert max(record["start"] for record in records) > rollout_ended, "streamed throughout"
    assert server_stat(team, RIG_2)[1] > 0
    assert ctx_running(infos[RIG_1]) == ctx_running(infos[RIG_2]) == "2048"
    for rig in (RIG_1, RIG_2):
        assert in_sandbox(infos[rig], f"systemctl is-active {SERVICE}") == "active"
    assert changed_operations(sandboxes.converge(team["path"])) == []
