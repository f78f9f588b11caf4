"""GGUF headers kept on the control machine by the sha256 of their model file, so a model's
header is read from its URL or its host once, not on every plan.

A header with a large vocabulary is several MiB: read from the host it travels base64 over
pyinfra's SSH connection, and 16 MiB took 20 s on the sandbox (0.2 s through @local), which
was most of a no-op converge of an 8B model on the H200 box (27 s against 2.3 s for a bare
connection). The sha256 names the file's content, so the header kept for it cannot go stale;
a file on the host that does not match it is refused by the model stage anyway. A file on the
host given without a sha256 is keyed by its path and identity (device, inode, size, mtime and
ctime, read by `stat`): a changed file has a new key and is read again.

The directory is ``$LLAMARIG_HEADER_CACHE``, else ``$XDG_CACHE_HOME/llamarig/gguf-headers``
(``~/.cache`` when unset). It is only a cache: one that cannot be written or holds a damaged
entry is passed by, never an error."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path

from llamarig.gguf_header import GgufError, GgufHeader, read_gguf_header

DIGEST = re.compile(r"[0-9a-f]{64}")


def directory() -> Path:
    """Where the headers are kept (``$LLAMARIG_HEADER_CACHE`` or the XDG cache)."""
    if os.environ.get("LLAMARIG_HEADER_CACHE"):
        return Path(os.environ["LLAMARIG_HEADER_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llamarig" / "gguf-headers"


def identity_key(path: str, identity: str | None) -> str | None:
    """The key of a file without a sha256: its path and identity (None: no such file)."""
    return hashlib.sha256(f"{path}\n{identity}".encode()).hexdigest() if identity else None


def _entry(sha256: str | None) -> Path | None:
    return directory() / f"{sha256}.gguf-header" if sha256 and DIGEST.fullmatch(sha256) else None


def cached(sha256: str | None, name: str = "") -> GgufHeader | None:
    """The header kept for the model file of ``sha256``, parsed (``name`` in its errors), or
    None (no key, none kept, or an entry that is not a whole GGUF header)."""
    entry = _entry(sha256)
    if entry is None:
        return None
    try:
        return read_gguf_header(entry.read_bytes(), name=name or str(entry))
    except (OSError, GgufError):
        return None


def keep(sha256: str | None, data: bytes, header: GgufHeader) -> None:
    """Keep ``header``, parsed from ``data`` (a model file's first bytes), for ``sha256``: the
    bytes up to its data offset; nothing when there is no key or the cache cannot be written."""
    entry = _entry(sha256)
    if entry is None:
        return
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=entry.parent, delete=False) as part:
            part.write(data[: header.data_offset])
        os.replace(part.name, entry)  # whole or absent, whoever reads it meanwhile
    except OSError:
        return
