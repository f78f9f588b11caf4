"""The guard that keeps tests on this machine works: in-process sockets to other addresses and
DNS lookups are refused and fail the test, loopback works; commands run through
conftest.offline cannot reach another machine."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from llamarig.planner.header import load_header
from tests.conftest import offline
from tests.netguard import NetworkGuard, is_loopback, ssh_destination


def test_loopback_is_told_from_the_rest():
    for host in (
        "127.0.0.1",
        "127.8.9.10",
        "::1",
        "[::1]",
        "localhost",
        "LOCALHOST.",
        "a.localhost",
    ):
        assert is_loopback(host), host
    for host in ("192.0.2.10", "10.0.0.1", "::ffff:192.0.2.1", "example.org", "0.0.0.0", None):
        assert not is_loopback(host), host
    assert is_loopback("::ffff:127.0.0.1")


def expected(guard: NetworkGuard, *violations: str) -> None:
    """The violations this test provoked, cleared so that the guard does not fail it."""
    assert guard.violations == list(violations)
    guard.violations.clear()


def test_connect_outside_loopback_is_refused_and_recorded(network_guard):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        with pytest.raises(OSError, match="test network guard: connect to 192.0.2.10:22"):
            sock.connect(("192.0.2.10", 22))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        with pytest.raises(OSError, match="sendto to 192.0.2.53:53"):
            sock.sendto(b"x", ("192.0.2.53", 53))
    with pytest.raises(OSError, match="name lookup of 'example.org'"):
        socket.getaddrinfo("example.org", 443)
    expected(
        network_guard,
        "connect to 192.0.2.10:22",
        "sendto to 192.0.2.53:53",
        "name lookup of 'example.org'",
    )


def test_a_swallowed_fetch_is_still_caught(network_guard):
    """load_header turns a failed fetch into a note; the record still shows the attempt."""
    header, note = load_header({"model": {"url": "https://example.org/m.gguf"}})
    assert header is None and "cannot read the GGUF header" in note
    expected(network_guard, "name lookup of 'example.org'")


def test_loopback_works(network_guard):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("localhost", port), timeout=5):
            pass
    with pytest.raises(urllib.error.URLError):  # reached, and refused: nothing listens there
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
    assert network_guard.violations == []


def test_offline_commands_cannot_reach_another_machine():
    probe = (
        "import socket\n"
        "s = socket.socket()\n"
        "s.settimeout(5)\n"
        "print(s.connect_ex(('192.0.2.10', 22)))\n"
        "print([name for _, name in socket.if_nameindex()])\n"
    )
    result = subprocess.run(
        offline([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    errno, interfaces = result.stdout.splitlines()
    assert int(errno) == 101  # ENETUNREACH: no route, at once
    assert interfaces == "['lo']"


def test_ssh_to_another_machine_is_refused_and_recorded(network_guard, tmp_path, monkeypatch):
    """The OpenSSH client bound for a documentation address fails as an unreachable host does,
    without dialling it; one bound for loopback runs; a stand-in `ssh` first on PATH runs."""
    from llamarig.config.ssh import SshTarget

    result = SshTarget.of({"host": "192.0.2.10", "port": 22}).run("true", timeout=30)
    assert result.returncode == 255
    assert "test network guard: ssh to 192.0.2.10" in result.stderr
    expected(network_guard, "ssh to 192.0.2.10")

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    loopback = SshTarget.of({"host": "127.0.0.1", "port": port}).run("true", timeout=30)
    assert loopback.returncode == 255 and "guard" not in loopback.stderr, loopback.stderr
    assert network_guard.violations == []

    shim = tmp_path / "bin" / "ssh"
    shim.parent.mkdir()
    shim.write_text("#!/bin/sh\necho stand-in\n")
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim.parent}:/usr/bin:/bin")
    stand_in = SshTarget.of({"host": "192.0.2.10", "port": 22}).run("true", timeout=30)
    assert stand_in.stdout == "stand-in\n"
    assert network_guard.violations == []


def test_ssh_destinations_are_read_from_sshtargets_command_lines():
    assert ssh_destination(["ssh", "-p", "22", "--", "root@192.0.2.1", "true"]) == "192.0.2.1"
    assert ssh_destination(["ssh", "-o", "BatchMode=yes", "--", "127.0.0.1"]) == "127.0.0.1"
    assert ssh_destination(["ssh", "-G", "-p", "22", "--", "192.0.2.1"]) is None
    assert ssh_destination(["ssh", "-F", "config", "llamarig-rig1", "true"]) is None
    assert ssh_destination(["ssh", "--"]) is None
