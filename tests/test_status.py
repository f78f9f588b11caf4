"""`llamarig status` without a sandbox: the host's command run by this machine's shell against
a stand-in of llama-server's /metrics and /slots on loopback (named so: the sandbox scenario in
test_sandbox_converge asks the real server), a host that does not answer, and the deploy
record's shape."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from llamarig.cli import main
from llamarig.config import load_inventory
from llamarig.onhost import deploy_record
from llamarig.serving import status

# Tokens the stand-in's counter gains between two reads of /metrics (requests that ended), and
# its running request between two reads of /slots.
TOKENS_PER_READ = 40
DECODED_PER_READ = 5


class _Server(http.server.BaseHTTPRequestHandler):
    """A stand-in of llama-server's /metrics (its counter grows by TOKENS_PER_READ a read) and
    /slots (1 of 2 processing, DECODED_PER_READ tokens more at each read)."""

    reads = slot_reads = 0

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/metrics":
            _Server.reads += 1
            body = (
                "# HELP llamacpp:tokens_predicted_total Number of generation tokens processed\n"
                f"llamacpp:tokens_predicted_total {1000 + TOKENS_PER_READ * _Server.reads}\n"
                "llamacpp:requests_deferred 3\n"
            )
        elif self.path == "/slots":
            _Server.slot_reads += 1
            decoded = {"n_decoded": DECODED_PER_READ * _Server.slot_reads}
            idle = {"n_decoded": 7}  # the last request's, not counted again
            body = json.dumps(
                [
                    {"id": 0, "is_processing": True, "next_token": [decoded]},
                    {"id": 1, "is_processing": False, "next_token": [idle]},
                ]
            )
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def server_port():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Server.reads = _Server.slot_reads = 0
    yield server.server_address[1]
    server.shutdown()


def local_host(write_inventory, tmp_path: Path, port: int, supervisor: str = "systemd"):
    model = tmp_path / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF")
    prefix = tmp_path / "opt"
    inventory = write_inventory(
        f"""
all:
  hosts:
    here:
      ssh: {{local: true}}
      llama_cpp: {{backend: cpu}}
      paths: {{prefix: {prefix}}}
      server: {{port: {port}, supervisor: {supervisor}}}
      model: {{path: {model}}}
"""
    )
    host = load_inventory(inventory).hosts["here"]
    build = prefix / "builds" / "0c1e57098bba-f9a55c7a12"
    build.mkdir(parents=True)
    (prefix / "current").symlink_to(build)
    return host


def test_a_row_from_the_hosts_shell(write_inventory, tmp_path, server_port):
    host = local_host(write_inventory, tmp_path, server_port)
    row = status.host_status(host, window=1)
    assert row.error is None
    assert (row.slots_busy, row.slots_total, row.requests_deferred) == (1, 2, 3)
    # Two reads of the counter and the slots, the window slept on the host between them.
    assert row.tokens_total == 1000 + 2 * TOKENS_PER_READ + 2 * DECODED_PER_READ
    assert 1 <= row.window_s < 10
    generated = TOKENS_PER_READ + DECODED_PER_READ
    assert row.tokens_per_second == pytest.approx(generated / row.window_s)
    assert row.build_current == "0c1e57098bba-f9a55c7a12"
    assert row.model_name == "SmolLM2-135M-Instruct"
    assert row.model_file.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    text = status.report(row)
    assert "slots    1 of 2 busy, 3 waiting" in text
    assert f"tokens/s over the last {row.window_s:.0f} s (1,090 tokens since it started)" in text


def test_a_server_without_a_unit_is_healthy_when_it_answers(write_inventory, tmp_path, server_port):
    # server.supervisor none (a container without systemd): no unit to ask, the server is.
    host = local_host(write_inventory, tmp_path, server_port, supervisor="none")
    row = status.host_status(host, window=0.1)
    assert row.active.startswith("no unit (server.supervisor: none")
    assert row.slots_total == 2 and status.healthy(row)
    row.slots_total = None  # as when nothing answers
    assert not status.healthy(row)


def test_a_server_that_does_not_answer_is_said(write_inventory, tmp_path):
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    host = local_host(write_inventory, tmp_path, port)
    row = status.host_status(host, window=0.1)
    assert row.error is None and row.slots_total is None and row.tokens_per_second is None
    assert row.server_note.startswith(f"no answer from http://127.0.0.1:{port}: curl: (7)")


def test_a_host_that_does_not_answer_is_a_row(write_inventory, capsys, monkeypatch):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    inventory = write_inventory(
        f"""
all:
  hosts:
    gone:
      ssh: {{host: 127.0.0.1, port: {port}, known_hosts: /dev/null}}
      llama_cpp: {{backend: cpu}}
      model: {{path: /opt/models/m.gguf}}
"""
    )
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    assert main(["status", "--window", "0.1"]) == 1
    out = capsys.readouterr().out
    assert "gone: not reachable: " in out and "Connection refused" in out, out
    assert main(["status", "--window", "0.1", "--json"]) == 1
    (row,) = json.loads(capsys.readouterr().out)
    assert row["host"] == "gone" and "Connection refused" in row["error"]


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "3601", "ten"])
def test_a_window_that_is_not_a_bound_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["status", "--window", bad])
    assert exit_info.value.code == 2
    assert "is not a number of seconds above 0 and at most 3600" in capsys.readouterr().err


def test_the_deploy_record_is_written_whole_and_read_back(tmp_path):
    entry = deploy_record.record(
        ["tasks/server.py | Unit llama-server.service", 'it\'s "quoted" $(not run)'],
        "tasks/server.py | Serve the new version or roll back",
        True,
        datetime(2026, 12, 3, 14, 2, 11, tzinfo=UTC),
    )
    target = tmp_path / "var" / "last-deploy.json"
    command = (
        deploy_record.write_command(entry)
        .replace(deploy_record.RECORD_PATH, str(target))
        .replace(deploy_record.ROLLED_BACK_PATH, str(tmp_path / "rolled-back"))
    )
    (tmp_path / "rolled-back").write_text("2026-12-03T14:02:10Z\n")
    subprocess.run(["sh", "-c", command], check=True)
    read = deploy_record.parse(target.read_text())
    assert read == entry and read["changed"] == 2 and read["rolled_back"] is True
    assert read["finished"] == "2026-12-03T14:02:11Z" and read["outcome"] == "failed"
    assert not (tmp_path / "rolled-back").exists()
    assert deploy_record.parse("") is None and deploy_record.parse('{"outcome": 1}') is None


def test_what_a_hostile_box_prints_reaches_the_terminal_escaped():
    # Every field of a row but the counts is the box's own text: a build link, a model state,
    # the server's or ssh's last words. None of their escape sequences reaches the terminal.
    row = status.HostStatus(
        host="rig1",
        unit="llama-server.service",
        active="active/running\x1b[2J",
        build_running="0c1e57098bba\x1b]0;pwned\x07",
        models={"qwen\u202e": "loaded\nforged: line"},
        server_note="curl: (7) \x9b31m",
    )
    text = status.report(row)
    assert not any(ch in text for ch in "\x1b\x07\x9b\u202e"), ascii(text)
    assert "\\x1b[2J" in text and "\\u202e" in text and "loaded\\nforged: line" in text
    assert len(text.splitlines()) == 5  # the forged line stays in its own
    unreachable = status.HostStatus(host="rig1", error="not reachable: ssh: \x1b[1;31mboom")
    assert status.report(unreachable) == "rig1: not reachable: ssh: \\x1b[1;31mboom"
