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

from llamarig.model.header import load_header
from tests.conftest import offline
from tests.netguard import NetworkGuard, is_loopback


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
