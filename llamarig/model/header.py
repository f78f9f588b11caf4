"""The model's GGUF header, read where it can be had without the model's weights: over HTTP
with range requests, from a local copy, or from the files on the host (merged across a split
model's shards), and kept on this machine. The planner receives the header; it reads none.

Kept: the headers on the control machine, keyed by the sha256 of their model file, so a model's
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
import urllib.error
import urllib.request
from pathlib import Path

from llamarig.gguf_header import GgufError, GgufHeader, merge_split, read_gguf_header
from llamarig.model.files import shard_digests, sibling_paths, sibling_urls
from llamarig.model.reference import HubError, read_token

HEADER_FIRST_READ = 8 << 20
HEADER_MAX_READ = 256 << 20


def fetch_header(url: str, token: str | None = None, sha256: str | None = None) -> GgufHeader:
    """Read a model's GGUF header over HTTP with range requests, growing the read as needed;
    ``token`` (a Hugging Face token) is sent to ``url`` alone, never across a redirect. With
    ``sha256`` (the file's) the header is kept on this machine and not fetched again."""
    kept = cached(sha256, name=url)
    if kept is not None:
        return kept
    size = HEADER_FIRST_READ
    while True:
        request = urllib.request.Request(url, headers={"Range": f"bytes=0-{size - 1}"})
        if token:
            request.add_unredirected_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=60) as response:
            data = response.read(size)
        try:
            header = read_gguf_header(data, name=url)
        except GgufError as error:
            if "truncated" not in str(error) or len(data) < size or size >= HEADER_MAX_READ:
                raise
            size *= 4
            continue
        keep(sha256, data, header)
        return header


def load_header(data: dict, model_path: str | None = None) -> tuple[GgufHeader | None, str]:
    """The model header for planning: a local file, else the configured URL; for a split
    model (named by its first shard) every shard's header, merged. Returns (header, "") or
    (None, why it cannot be had); raises GgufError when the local file named by
    ``model_path`` (or a shard beside it) is missing or not a GGUF header."""
    if model_path:  # the user's own copy: a file that cannot be read is an error, not a note
        headers = []
        for path in sibling_paths(model_path):
            try:
                with open(path, "rb") as model:
                    headers.append(read_gguf_header(model, name=path))
            except OSError as error:
                raise GgufError(
                    f"{path}: cannot be read ({error.strerror or error}); give --model the "
                    "path of a local copy of the model (a split model's shards beside it)"
                ) from None
        return merge_split(headers), ""
    headers, note = url_headers(data)
    if not headers:
        return None, note
    try:
        return merge_split(headers), ""
    except GgufError as error:
        return None, f"cannot read the GGUF header from {data['model']['url']}: {error}"


def url_headers(data: dict) -> tuple[list[GgufHeader], str]:
    """The header of each of the model's files (every shard of a split model), read from its
    URL (or kept on this machine); or no headers and why."""
    url = data["model"]["url"]
    if not url:
        return [], "the model is a file on the host (plan with --model PATH, a local copy)"
    model = data["model"]
    try:
        token = read_token(model["token_file"]) if model.get("token_file") else None
        shards = sibling_urls(url)
        digests = shard_digests(model, len(shards))
        return [
            fetch_header(shard, token, digest)
            for shard, digest in zip(shards, digests, strict=True)
        ], ""
    except (HubError, urllib.error.URLError, OSError, GgufError) as error:
        return [], f"cannot read the GGUF header from {url}: {error}"


# A GGUF header with a 250k-token vocabulary is about 10 MiB; it travels base64 over SSH (slow:
# 16 MiB in 20 s), so a small read comes first and the header is kept (`keep`).
HOST_HEADER_FIRST_READ = 1 << 20
HOST_HEADER_READ = 16 << 20


def header_from_host(
    heads: list[tuple[GgufHeader | GgufError | None, str]], reason: str
) -> tuple[GgufHeader | None, str]:
    """The header of the model's files on the host, ``(header, the error reading it, or None
    when the file is missing; path)`` per file (each shard of a split model), merged; or None
    with why it cannot be had (``reason``: why the URL gave none)."""
    missing = [path for head, path in heads if head is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        return None, f"{reason}; {', '.join(missing)} {verb} not on the host yet"
    try:
        for head, _ in heads:
            if isinstance(head, GgufError):
                raise head
        return merge_split([head for head, _ in heads]), ""
    except GgufError as error:
        return None, f"{reason}; {error}"


# --- the headers kept on this machine ---


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
