"""Checksum records: a file's sha256 is computed once, then trusted while the file is unchanged.

After a file is hashed on a host, its digest is written with the file's identity (device, inode,
size, and mtime and ctime with nanoseconds, from GNU ``stat -L``) to a root-only record:
``/var/lib/llamarig/checksums/<sha256 of the path>`` (directory 0700, record 0600), one line
``SHA256 DEVICE INODE SIZE MTIME CTIME``. Any write, truncation, ``touch``, ``chmod`` or
replacement of the file changes its ctime (which no user can set back), so a record whose
identity is the file's current one still describes its content: later runs read the record
instead of reading the whole file. Naming a record by the sha256 of its path keeps any
validated path (spaces, quotes, ``%``) out of the record's name.

A record may hold a digest other than the one expected: the content is then known to be wrong,
and it is refused (or downloaded again) without reading it a second time.

Pure functions: the shell snippets that facts, operations and ``llamarig verify`` run."""

from __future__ import annotations

import hashlib
import re
import shlex

from llamarig.onhost.hostpaths import CHECKSUM_RECORDS

RECORD_DIRECTORY = CHECKSUM_RECORDS
# GNU stat: %.9Y and %.9Z are mtime and ctime in seconds since the epoch with nanoseconds
# (coreutils 9.1 on bookworm, 9.7 on trixie); -L follows a symbolic link to the file itself.
IDENTITY_FORMAT = "%d %i %s %.9Y %.9Z"
DIGEST = re.compile(r"[0-9a-f]{64}")


def record_path(path: str, records: str = RECORD_DIRECTORY) -> str:
    """The record of ``path`` in the directory ``records``: named by the sha256 of the path,
    so no path reaches a file name."""
    return f"{records}/{hashlib.sha256(path.encode()).hexdigest()}"


def identity_command(path: str) -> str:
    return f"stat -L -c {shlex.quote(IDENTITY_FORMAT)} -- {shlex.quote(path)}"


def read_command(path: str, records: str = RECORD_DIRECTORY) -> str:
    """Prints ``file IDENTITY`` and, when there is a record, ``record LINE``; nothing when
    ``path`` is not a regular file. Reads no byte of the file."""
    quoted, record = shlex.quote(path), shlex.quote(record_path(path, records))
    return (
        f'if [ -f {quoted} ]; then echo "file $({identity_command(path)})"; '
        f'if [ -f {record} ]; then echo "record $(head -c 256 {record})"; fi; fi'
    )


def trusted_sha256(lines: list[str]) -> dict | None:
    """Parses ``read_command``'s output: None when there is no file, else
    ``{"sha256": DIGEST or None}``, the digest of a record whose identity is the file's own."""
    found = {line.split(" ", 1)[0]: line.partition(" ")[2].strip() for line in lines}
    if "file" not in found:
        return None
    digest, _, identity = found.get("record", "").partition(" ")
    trusted = DIGEST.fullmatch(digest) and identity and identity == found["file"]
    return {"sha256": digest if trusted else None}


def write_record_command(
    path: str, digest: str, identity: str | None = None, records: str = RECORD_DIRECTORY
) -> str:
    """Records ``digest`` for the file's ``identity`` (shell words, e.g. a quoted digest and
    ``"$before"``; the identity now by default), written to a temporary file and renamed: a
    record is never half written."""
    record = record_path(path, records)
    q_record, q_temporary = shlex.quote(record), shlex.quote(record + ".tmp")
    directory = shlex.quote(records)
    identity = identity or f'"$({identity_command(path)})"'
    return (
        f"mkdir -p {directory} && chmod 700 {directory} && "
        f"(umask 077 && printf '%s %s\\n' {digest} {identity} > {q_temporary}) && "
        f"mv -f {q_temporary} {q_record}"
    )


def hash_and_record_command(path: str, records: str = RECORD_DIRECTORY) -> str:
    """Hashes ``path`` into ``$actual`` and records it (whatever it is: a wrong digest is
    worth knowing too), unless the file changed while it was read; fails when it cannot be
    read."""
    identity = identity_command(path)
    record = write_record_command(path, '"$actual"', '"$before"', records)
    return (
        f"before=$({identity}) && "
        f"actual=$(sha256sum < {shlex.quote(path)} | cut -d' ' -f1) && "
        '[ "${#actual}" -eq 64 ] && '
        f'if [ "$({identity})" = "$before" ]; then '
        f"{record}; fi"
    )
