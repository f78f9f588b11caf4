"""Tests reach only loopback: a guard over Python's socket layer, installed for every test by
conftest.py (subprocesses run in a network namespace of their own instead: conftest.offline).

A socket that would connect or send to an address outside loopback, and a name lookup that
would ask DNS, is refused with OSError and recorded; the test fails on the record even when the
code under test catches the error (load_header turns a failed fetch into a note, for one)."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from typing import Any

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def is_loopback(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return False
    name = host.split("%", 1)[0].strip("[]").rstrip(".").lower()
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _is_ip(host: Any) -> bool:
    try:
        ipaddress.ip_address(str(host).split("%", 1)[0].strip("[]"))
    except ValueError:
        return False
    return True


class NetworkGuard:
    """Wraps socket.socket's connect/connect_ex/sendto/sendmsg and socket.getaddrinfo."""

    def __init__(self) -> None:
        self.violations: list[str] = []

    def _refuse(self, what: str) -> None:
        self.violations.append(what)
        raise OSError(f"test network guard: {what} (tests reach only loopback)")

    def _checked(self, name: str, original: Callable, where: Callable[[tuple], Any]) -> Callable:
        guard = self

        def wrapper(sock, *args, **kwargs):
            address = where(args)
            if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
                if not is_loopback(address[0]):
                    guard._refuse(f"{name} to {address[0]}:{address[1]}")
            return original(sock, *args, **kwargs)

        return wrapper

    def install(self, monkeypatch) -> None:
        plain = socket.socket
        for name, where in (
            ("connect", lambda args: args[0] if args else None),
            ("connect_ex", lambda args: args[0] if args else None),
            ("sendto", lambda args: args[-1] if len(args) >= 2 else None),
            ("sendmsg", lambda args: args[3] if len(args) >= 4 else None),
        ):
            monkeypatch.setattr(plain, name, self._checked(name, getattr(plain, name), where))
        lookup = socket.getaddrinfo
        guard = self

        def getaddrinfo(host, *args, **kwargs):
            if host is not None and not is_loopback(host) and not _is_ip(host):
                guard._refuse(f"name lookup of {host!r}")
            return lookup(host, *args, **kwargs)

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
