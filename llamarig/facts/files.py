"""Files on the host: their state, digest and identity, JSON records, and the first bytes of a file
or a URL (a model's GGUF header)."""

from __future__ import annotations

import base64
import json
import re
import shlex

from pyinfra.api import FactBase

from llamarig.onhost import checksums


class JsonFile(FactBase):
    """The parsed content of a JSON file, or None when it is missing or not valid JSON."""

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then cat {quoted}; else echo null; fi"

    def process(self, output):
        try:
            return json.loads("\n".join(output))
        except json.JSONDecodeError:
            return None


class FileSha256(FactBase):
    """The sha256 of a regular file, or None when there is none.

    pyinfra's Sha256File matches ``sha256sum PATH``'s line against the path, and GNU sha256sum
    escapes a name holding a backslash there (``\\HASH  a\\\\b``): such a file never matched,
    so a model named that way was downloaded again on every run. From stdin there is no name.
    """

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then sha256sum < {quoted}; fi"

    def process(self, output):
        digest = "".join(output).split(" ", 1)[0].strip()
        return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


class RecordedSha256(FactBase):
    """The sha256 an earlier check recorded for a file, while the file is unchanged since
    (``llamarig.onhost.checksums``); reads the file's identity and its record, never the file.

    None when there is no regular file; else ``{"sha256": DIGEST}``, or ``{"sha256": None}``
    when there is no record, or the file's identity (device, inode, size, mtime, ctime) is no
    longer the recorded one.

    .. code:: python

        {"sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
    """

    def command(self, path: str, records: str = checksums.RECORD_DIRECTORY) -> str:
        return checksums.read_command(path, records)

    def process(self, output):
        return checksums.trusted_sha256(list(output))


class FileIdentity(FactBase):
    """A regular file's identity (device, inode, size, mtime and ctime with nanoseconds,
    ``llamarig.onhost.checksums.IDENTITY_FORMAT``), or None when there is none; reads no byte of it.

    .. code:: python

        "2049 1835012 8540775808 1764590400.123456789 1764590400.223456789"
    """

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then {checksums.identity_command(path)}; fi"

    def process(self, output):
        line = " ".join(output).strip()
        return line or None


class FileHead(FactBase):
    """The first ``size`` bytes of a file (a model's GGUF header), or None when it is missing."""

    def command(self, path: str, size: int) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then head -c {int(size)} {quoted} | base64 -w0; echo; fi"

    def process(self, output):
        text = "".join(output).strip()
        return base64.b64decode(text) if text else None


class UrlHead(FactBase):
    """The first ``size`` bytes of a URL as the host reads it (a model's GGUF header, where
    the host reaches the model and this machine does not), or None: no curl, no answer, or an
    error status. ``header_file``: a root-only file of request headers (the Hub token), sent
    when it exists; give it only for a URL it belongs to (``reference.sends_hub_token``: the
    Hub endpoint's), never for another host's. curl follows redirects (``-L``) but without
    ``--location-trusted``, so it drops the file's Authorization line on a redirect to another
    host, scheme or port (the Hub's CDN gets none), as the Hub client does."""

    def command(self, url: str, size: int, header_file: str | None = None) -> str:
        auth = ""
        if header_file:
            quoted = shlex.quote(header_file)
            auth = f"$([ -r {quoted} ] && printf '%s' '-H @'{quoted})"
        return (
            "command -v curl >/dev/null && "
            f"curl -sS -f -L --connect-timeout 5 --max-time 60 -r 0-{int(size) - 1} {auth} "
            f"-- {shlex.quote(url)} | head -c {int(size)} | base64 -w0; echo"
        )

    def process(self, output):
        text = "".join(output).strip()
        return base64.b64decode(text) if text else None


class FileState(FactBase):
    """A small file's mode and sha256 in one command (a unit, an environment file, a launcher);
    None when there is no regular file. Not for model-size files: it hashes the whole file.

    + path: absolute path

    .. code:: python

        {"mode": 644, "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
    """

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then stat -c %a {quoted}; sha256sum < {quoted}; fi"

    def process(self, output: list[str]) -> dict | None:
        lines = [line.strip() for line in output]
        if len(lines) < 2 or not lines[0].isdigit():
            return None
        digest = lines[1].split(" ", 1)[0]
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            return None
        return {"mode": int(lines[0]), "sha256": digest}
