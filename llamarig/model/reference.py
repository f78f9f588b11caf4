"""A Hugging Face model reference checked offline: its keys, and values in shapes that cannot
carry shell syntax (the repo id, a path in the repo, a quant, a revision, the endpoint). The
config rules use it at load time; `llamarig.model.hub` resolves what passes (see there for the
reference's forms and the choices made). The token: read private (`read_token`), and sent only
with requests for the endpoint's URLs (`sends_hub_token`)."""

from __future__ import annotations

import ipaddress
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REVISION = "main"
# Hugging Face tokens are about 40 characters; a file far larger is not a token file.
MAX_TOKEN_BYTES = 4096
KEYS = ("hf", "file", "quant", "revision", "endpoint", "token_file")

# The Hub's own rules for a repo id, with the namespace required: word characters, '-' and
# '.', at most 96 each side, neither '--' nor '..', no '.git' ending; nothing a shell or ssh
# reads as syntax or as an option.
_REPO_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
_REPO = re.compile(rf"{_REPO_PART}/{_REPO_PART}")
_PATH_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")
_QUANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_./-]{0,254}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*")
_ENDPOINT = re.compile(
    r"(?P<scheme>https?)://(?P<host>\[[0-9A-Fa-f:.]+\]|[^/:\[\]]+)(?::(?P<port>\d{1,5}))?"
    r"(?P<path>(?:/[A-Za-z0-9._~-]+)*)/?"
)


class HubError(Exception):
    """A reference that cannot be resolved: ``key_path`` is the key of the model section at
    fault (("model", "quant"), ...), ``message`` says why and what to change."""

    def __init__(self, key_path: tuple[str, ...], message: str):
        super().__init__(f"{'.'.join(key_path)}: {message}")
        self.key_path = key_path
        self.message = message


@dataclass(frozen=True)
class Reference:
    repo: str
    file: str | None
    quant: str | None
    revision: str
    endpoint: str
    token_file: str | None


def problem(key: str, message: str) -> HubError:
    return HubError(("model", key), message)


def quant_pattern(quant: str) -> re.Pattern:
    """``quant`` as a whole part of a file's path in a repo, in any case."""
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(quant)}(?![A-Za-z0-9_])", re.IGNORECASE)


def validated(reference: Mapping) -> Reference:
    """The reference's values in shapes that cannot carry shell syntax, checked before any
    request is made."""
    if not isinstance(reference, Mapping):
        raise problem("hf", f"a Hugging Face reference is a mapping, not {reference!r}")
    unknown = sorted(str(key) for key in reference if key not in KEYS)
    if unknown:
        raise problem(unknown[0], f"is not a key of a Hugging Face reference ({', '.join(KEYS)})")
    repo = reference.get("hf")
    if (
        not isinstance(repo, str)
        or not _REPO.fullmatch(repo)
        or "--" in repo
        or ".." in repo
        or repo.endswith(".git")
    ):
        raise problem(
            "hf",
            f"{repo!r} is not a repo id: ORG/REPO, letters, digits, '_', '-' and '.', not "
            "ending in .git, e.g. bartowski/SmolLM2-135M-Instruct-GGUF",
        )
    file, quant = reference.get("file"), reference.get("quant")
    if (file is None) == (quant is None):
        raise problem(
            "file",
            f"name the GGUF of {repo} by exactly one of `file` (its path in the repo) or `quant` "
            "(e.g. Q4_K_M)",
        )
    if file is not None:
        segments = file.split("/") if isinstance(file, str) else []
        if (
            not segments
            or not all(_PATH_SEGMENT.fullmatch(s) for s in segments)
            or not file.endswith(".gguf")
        ):
            raise problem(
                "file",
                f"{file!r} is not a GGUF path in a repo: NAME.gguf or DIR/NAME.gguf (a lowercase "
                ".gguf), of letters, digits and '_', '.', '+', '-', no part starting with '.' "
                "or '-'",
            )
    if quant is not None and (not isinstance(quant, str) or not _QUANT.fullmatch(quant)):
        raise problem(
            "quant", f"{quant!r} is not a quant name: letters, digits, '_' and '-', e.g. Q4_K_M"
        )
    revision = reference.get("revision", DEFAULT_REVISION)
    if revision is None:
        revision = DEFAULT_REVISION
    if not isinstance(revision, str) or not _REVISION.fullmatch(revision) or ".." in revision:
        raise problem(
            "revision",
            f"{revision!r} is not a branch, tag or commit: letters, digits, '_', '.', '/', '-'",
        )
    endpoint = reference.get("endpoint") or DEFAULT_ENDPOINT
    token_file = reference.get("token_file")
    if token_file is not None and (not isinstance(token_file, str) or not token_file.strip()):
        raise problem("token_file", f"{token_file!r} is not a path of a file")
    return Reference(repo, file, quant, revision, _validated_endpoint(endpoint), token_file)


def _validated_endpoint(endpoint: object) -> str:
    match = _ENDPOINT.fullmatch(endpoint) if isinstance(endpoint, str) else None
    host = match["host"] if match else ""
    address = None
    try:
        address = ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
        valid_host = address.version == 6 or not host.startswith("[")
    except ValueError:
        valid_host = not host.startswith("[") and bool(_HOST.fullmatch(host))
    if not match or not valid_host or not 0 < int(match["port"] or 443) < 65536:
        raise problem(
            "endpoint",
            f"{endpoint!r} is not an https URL of a Hub: scheme, host, optional port and path, "
            f"no user, query or fragment (default {DEFAULT_ENDPOINT})",
        )
    # The token travels to the endpoint: in the clear only to a mirror on this machine.
    loopback = host == "localhost" or (address is not None and address.is_loopback)
    if match["scheme"] == "http" and not loopback:
        raise problem(
            "endpoint",
            f"{endpoint!r} is plain http, which shows the token and the files to the network: "
            f"use https://{endpoint.split('://', 1)[1].rstrip('/')} (http only for a mirror on "
            "127.0.0.1 or localhost)",
        )
    return endpoint.rstrip("/")


_DEFAULT_PORTS = {"http": 80, "https": 443}


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of a URL, the scheme's port when none is written; ValueError for a
    URL that does not parse (a port out of range)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(scheme)


def hub_token_file(model: Mapping) -> str | None:
    """The token file whose token ``model`` (a model section) sends to its Hub: a Hugging Face
    reference's `token_file`, else None."""
    return model.get("token_file") if model.get("hf") else None


def sends_hub_token(model: Mapping, url: str) -> bool:
    """Whether a request for ``url`` carries the Hub token of ``model`` (a model section, or
    one model of `models:`): only when the model is a Hugging Face reference with a
    `token_file` and ``url`` is a URL of its endpoint (`endpoint`, default
    https://huggingface.co) - the same scheme, host and port, as huggingface_hub decides where
    its Authorization header goes, spelled as the endpoint (its path included) and without
    user info. Every request that could carry the token asks this, per URL (each shard): the
    download, the header read on this machine and the host's; a model given by `url:` never
    gets it, wherever its host is. Across a redirect the token goes no further than the
    request's own host: curl drops the header file's Authorization line on a redirect to
    another host, scheme or port (no ``--location-trusted``), urllib an unredirected header
    on every redirect."""
    if not hub_token_file(model):
        return False
    endpoint = (model.get("endpoint") or DEFAULT_ENDPOINT).rstrip("/")
    if not isinstance(url, str) or not url.startswith(f"{endpoint}/"):
        return False
    try:
        parts = urlsplit(url)
        same = _origin(url) == _origin(endpoint)
    except ValueError:
        return False
    return same and "@" not in parts.netloc and "\\" not in url


def read_token(token_file: str) -> str:
    """The token in ``token_file`` (a file on the control machine), checked private to its
    owner and printable."""
    path = Path(os.path.expanduser(token_file))
    try:
        # O_NONBLOCK: a FIFO is refused, not waited on.
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as stream:
            mode = os.fstat(stream.fileno()).st_mode
            raw = stream.read(MAX_TOKEN_BYTES + 1) if stat.S_ISREG(mode) else None
    except OSError as error:
        raise problem(
            "token_file",
            f"cannot read {path} ({error.strerror or error}): give a file on the control machine "
            "that holds a Hugging Face token (https://huggingface.co/settings/tokens)",
        ) from None
    if raw is None:
        raise problem("token_file", f"{path} is not a regular file: give the token's file")
    if mode & 0o077:
        raise problem(
            "token_file",
            f"{path} can be read by others (mode {stat.S_IMODE(mode):04o}); a token is a "
            f"password: chmod 600 {path}",
        )
    try:
        token = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        token = None
    if not token or len(raw) > MAX_TOKEN_BYTES or not all(33 <= ord(c) < 127 for c in token):
        raise problem(
            "token_file",
            f"{path} does not hold a token: one line of printable ASCII without spaces, as "
            "https://huggingface.co/settings/tokens shows it",
        )
    return token
