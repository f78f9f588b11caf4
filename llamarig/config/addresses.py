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
