"""What an address in the settings means for who can reach it."""

from __future__ import annotations

import ipaddress

# Listen on every interface (`*` is refused by the shape checks, with the fix).
WILDCARD_HOSTS = ("0.0.0.0", "::", "*", "")


def is_loopback(address: str) -> bool:
    """Whether ``address`` is this machine's loopback: `localhost` (any case, with or without
    the root's dot) or a loopback IP address (127.0.0.0/8, ::1)."""
    if address.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def local_url(host: str, port: int) -> str:
    """Where a client on the server's own machine reaches a server bound to ``host``:``port``
    (a wildcard address is reached on loopback)."""
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"
