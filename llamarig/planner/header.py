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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from llamarig.config.lock import (
    declared_key,
    header_key,
    lock_path,
    merged_records,
    recorded_header,
)
from llamarig.facts.cache import Reader
from llamarig.facts.files import FileHead, FileIdentity, UrlHead
from llamarig.model import header_record
from llamarig.model.files import ModelFile, model_files, shard_digests, sibling_paths, sibling_urls
from llamarig.model.gguf import GgufError, GgufHeader, merge_split, read_gguf_header
from llamarig.model.reference import HubError, read_token, sends_hub_token
from llamarig.onhost import hostpaths
from llamarig.tables.text import printable

HEADER_FIRST_READ = 8 << 20
HEADER_MAX_READ = 256 << 20


def fetch_header(url: str, token: str | None = None, sha256: str | None = None) -> GgufHeader:
    """Read a model's GGUF header over HTTP with range requests, growing the read as needed;
    ``token`` (a Hugging Face token, given only for a URL of its Hub: ``sends_hub_token``) is
    sent to ``url`` alone, never across a redirect. With ``sha256`` (the file's) the header is
    kept on this machine and not fetched again."""
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
    URL (or kept on this machine); or no headers and why. The Hub token goes only with a
    shard's URL on the model's Hub endpoint (``sends_hub_token``)."""
    url = data["model"]["url"]
    if not url:
        return [], "the model is a file on the host (plan with --model PATH, a local copy)"
    model = data["model"]
    try:
        token = read_token(model["token_file"]) if model.get("token_file") else None
        shards = sibling_urls(url)
        digests = shard_digests(model, len(shards))
        return [
            fetch_header(shard, token if sends_hub_token(model, shard) else None, digest)
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


# --- the header of the rig's model, wherever it is had ---


@dataclass
class FoundHeader:
    """The model's header as `find_model_header` found it, and what a deploy records of it."""

    header: GgufHeader | None = None
    header_note: str = ""  # why there is no header
    header_source: str = ""  # models.lock.yml when the header came from its record
    header_declared: str = ""  # where a declared header's values come from (none read)
    # headers read from the model's files that models.lock.yml does not hold: (key, header)
    read: list[tuple[dict, GgufHeader]] = field(default_factory=list)
    # declared headers (keys) that the files' own headers in ``read`` replace
    superseded: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def find_model_header(found: FoundHeader, data: dict, reader: Reader | None) -> None:
    """The model's header, into ``found``: recorded in models.lock.yml, else read from the
    model's URL, else from the file on the host (through ``reader``; None: the host is not
    contacted). A header read from the file that the lock does not hold (or holds with another
    digest) goes to ``found.read``, to be recorded.
    A file with no sha256 may change on the host: with the host at hand its own header wins
    over the record. Raises LockError (a GgufError) for a lock that is not one and for a record
    that cannot be decoded or contradicts itself (a split model's records: together)."""
    files = model_files(data)
    keys = [header_key(file) for file in files]
    lock = lock_path()
    # A lock that is not one, or a record that lies, is refused (LockError, naming the entry
    # and the fix), not passed by: a plan must not silently stand on something else.
    locked = [
        recorded_header(lock, key) or recorded_header(lock, declared_key(file))
        for key, file in zip(keys, files, strict=True)
    ]
    pinned = all(file.sha256 for file in files)
    declared = any(record is not None and not record.digest for record in locked)
    if all(locked) and not declared and (pinned or reader is None):
        found.header, found.header_source = merged_records(locked), str(lock)
        return
    headers, note = url_headers(data)
    if not headers and reader is not None:
        heads = [(host_header(reader, file), file.dest) for file in files]
        merged, note = header_from_host(heads, note)
        headers = [head for head, _ in heads] if merged else []
        if not headers and all(file.url for file in files):
            # Not on the host yet: the host may reach the URL where this machine cannot.
            from_host = [host_url_header(reader, file, data["model"]) for file in files]
            if all(isinstance(head, GgufHeader) for head in from_host):
                headers = from_host
    if not headers:
        if all(locked):  # not readable yet (the file is not on the host): the record plans
            found.header, found.header_source = merged_records(locked), str(lock)
            found.header_declared = "; ".join(
                dict.fromkeys(r.source for r in locked if not r.digest)
            )
        else:
            found.header_note = note
        return
    try:
        found.header = merge_split(headers)
    except GgufError as error:
        found.header_note = str(error)
        return
    for key, header, record, file in zip(keys, headers, locked, files, strict=True):
        if record is None or record.digest != header.digest:
            found.read.append((key, header))
        if record is None or record.digest == header.digest:
            continue
        what = next(iter(key.values()))
        if record.digest:
            found.warnings.append(
                f"{lock}: the recorded header of {what} is not the file's (digest "
                f"{record.digest[:12]} against {header.digest[:12]}): planned with the file's, "
                "and recorded again by a deploy or `llamarig lock`"
            )
            continue
        found.superseded.append(declared_key(file))
        differ = header_record.differences(record, header)
        found.warnings.append(
            printable(
                f"{record.source}: the file's header "
                + (f"differs: {'; '.join(differ)}; planned with the file's" if differ else "agrees")
                + ", which a deploy or `llamarig lock` records in its place"
            )
        )


def host_url_header(reader: Reader, file: ModelFile, model: dict) -> GgufHeader | GgufError | None:
    """The GGUF header of a model file's URL as the host reads it, kept on this machine by the
    file's sha256; None when the host reads nothing. The Hub token's header file goes with the
    request only when ``file``'s URL is on the Hub endpoint of ``model`` (its model section:
    ``sends_hub_token``), never to a URL model's host."""
    header_file = hostpaths.HUB_TOKEN_HEADER_PATH if sends_hub_token(model, file.url) else None
    return _kept_or_read(
        file.sha256,
        file.url,
        lambda size: reader(UrlHead, url=file.url, size=size, header_file=header_file),
    )


def host_header(reader: Reader, file: ModelFile) -> GgufHeader | GgufError | None:
    """The GGUF header of a model file on the host, the error reading it, or None when the
    file is not there: kept on this machine by the file's sha256, else by its path and
    identity (``llamarig.planner.header``); else read over the connection."""
    key = file.sha256 or identity_key(file.dest, reader(FileIdentity, path=file.dest))
    return _kept_or_read(key, file.dest, lambda size: reader(FileHead, path=file.dest, size=size))


def _kept_or_read(
    key: str | None, name: str, read: Callable[[int], bytes | None]
) -> GgufHeader | GgufError | None:
    """The header kept on this machine under ``key``, else the one in the first bytes that
    ``read(size)`` gives (a small read first, the rest only for a large header), kept; the
    error reading it, or None when ``read`` gives nothing."""
    kept = cached(key, name=name)
    if kept is not None:
        return kept
    header: GgufHeader | GgufError | None = None
    for size in (HOST_HEADER_FIRST_READ, HOST_HEADER_READ):
        head = read(size)
        if not head:
            return None
        try:
            header = read_gguf_header(head, name=name)
            break
        except GgufError as error:  # truncated, or damaged: a larger read says which
            header = error
            if len(head) < size:  # the whole file was read
                break
    if isinstance(header, GgufHeader):
        keep(key, head, header)
    return header


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
