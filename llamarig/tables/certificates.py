"""X.509 certificates as PEM text: the fingerprint clients compare, of the first certificate
(the server's own, before its chain). What a host printed is untrusted: the base64 is decoded
strictly and must be one whole DER sequence."""

from __future__ import annotations

import base64
import binascii
import hashlib
import re

_PEM = re.compile(
    r"-----BEGIN CERTIFICATE-----([A-Za-z0-9+/=\s]{1,65536}?)-----END CERTIFICATE-----"
)


def fingerprint(text: str) -> str | None:
    """The SHA-256 of the first certificate of a PEM text (the server's own, before its chain),
    AB:CD:... as ``openssl x509 -fingerprint -sha256`` prints it; None when there is none."""
    found = _PEM.search(text)
    if not found:
        return None
    try:
        der = base64.b64decode("".join(found.group(1).split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    if not _der_sequence(der):
        return None
    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


def _der_sequence(der: bytes) -> bool:
    """Whether ``der`` is one whole DER SEQUENCE (what a certificate is), not base64 noise."""
    if len(der) < 2 or der[0] != 0x30:
        return False
    if der[1] < 0x80:
        return 2 + der[1] == len(der)
    width = der[1] & 0x7F
    return 0 < width <= 4 and 2 + width + int.from_bytes(der[2 : 2 + width]) == len(der)
