"""Tests reach only loopback: a guard over Python's socket layer and over the OpenSSH client's
command lines, installed for every test by conftest.py (other subprocesses that need a network
run in a namespace of their own instead: conftest.offline).

A socket that would connect or send to an address outside loopback, and a name lookup that
would ask DNS, is refused with OSError and recorded; the test fails on the record even when the
code under test catches the error (load_header turns a failed fetch into a note, for one)."""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
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


def ssh_destination(argv: list[str]) -> str | None:
    """The host of an ``ssh [options] -- [user@]host [command]`` command line (SshTarget's
    shape), None for any other and for ``ssh -G`` (it prints its configuration, connecting
    nowhere)."""
    if "--" not in argv:
        return None
    end = argv.index("--")
    if end + 1 >= len(argv) or "-G" in argv[:end]:
        return None
    return argv[end + 1].rpartition("@")[2]


# The OpenSSH client of this machine (a test's stand-in `ssh` first on PATH is not it).
OPENSSH = shutil.which("ssh", path=os.defpath)


class NetworkGuard:
    """Wraps socket.socket's connect/connect_ex/sendto/sendmsg and socket.getaddrinfo, and the
    start of an OpenSSH client bound for another machine: a documentation address in a test's
    inventory is dialled for real by ssh, out of the socket layer's sight (two verify unit
    tests did, 3 s an attempt, until 2026-12-06)."""

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
        start = subprocess.Popen.__init__

        def popen(process, args, *more, **options):
            destination = self._ssh_elsewhere(args, options.get("env"))
            if destination is not None:
                guard.violations.append(f"ssh to {destination}")
                # ssh's own exit status for a host it cannot reach, without dialling it.
                message = f"test network guard: ssh to {destination} (tests reach only loopback)"
                exit_255 = f"import sys; sys.stderr.write({message!r}); sys.exit(255)"
                args = [sys.executable, "-c", exit_255]
            start(process, args, *more, **options)

        monkeypatch.setattr(subprocess.Popen, "__init__", popen)

    @staticmethod
    def _ssh_elsewhere(args: Any, env: dict | None) -> str | None:
        """The destination outside loopback of an OpenSSH command line, else None."""
        if not isinstance(args, (list, tuple)) or not args or OPENSSH is None:
            return None
        argv = [str(arg) for arg in args]
        if os.path.basename(argv[0]) != "ssh":
            return None
        program = shutil.which(argv[0], path=(env or os.environ).get("PATH"))
        if program is None or os.path.realpath(program) != os.path.realpath(OPENSSH):
            return None
        destination = ssh_destination(argv)
        return destination if destination and not is_loopback(destination) else None
