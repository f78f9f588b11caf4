"""Shapes of the rig data's strings that reach a command, a unit or a file: addresses, URLs,
paths, package names and versions, file names, and the characters any setting may hold.

A value that passes has a shape that cannot carry shell or unit syntax (an address, a URL of a
known scheme, an absolute normalised path); what reaches a command is quoted there as well.
Each check returns (key path, message) tuples in the style of config.semantic_problems: what
is wrong and where the right part goes.
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
import unicodedata
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from llamarig.model.files import url_file_name

# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens.
_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
# Debian policy: package names and (epoch-less) versions.
# An inventory's host name is a label, not an address: pyinfra reads a leading `@` as a
# connector (`@local` runs on the control machine, `@chroot/DIR` in a chroot), and the name
# becomes a file name (tuned/HOST.yml) and pyinfra's name for the host on every line it prints.
_HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_DEBIAN_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]+$")
_DEBIAN_VERSION = re.compile(r"^[0-9][A-Za-z0-9.+~]*(?:-[A-Za-z0-9.+~]+)*$")
_LOGIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# RFC 3986: what may appear in a URL as it is; anything else is percent-encoded.
_URL_CHARACTERS = re.compile(r"^[A-Za-z0-9\-._~:/?#\[\]@!$&'()*+,;=%]*$")
_SCP_LIKE = re.compile(r"^(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9_.-]*)@)?(?P<host>[^/:@]+):(?!//)")

LOCAL_FILES = (
    "`ssh.key`, `ssh.known_hosts`, `server.api_key_file` and the gateway's key and certificate "
    "files"
)
EXAMPLE_ADDRESS = "e.g. 192.0.2.10 or rig1.example.org"


def describe_character(character: str) -> str:
    """A character as the user can find it: its code point and Unicode name."""
    name = unicodedata.name(character, "")
    if unicodedata.category(character) == "Cc":
        return f"the control character {ascii(character)} (U+{ord(character):04X})"
    return f"U+{ord(character):04X} {name}".strip()


def _invisible(character: str) -> bool:
    """Control and format characters, and every space and line break but the plain space."""
    category = unicodedata.category(character)
    return category in ("Cc", "Cf", "Zl", "Zp") or (category == "Zs" and character != " ")


def invisible_characters(text: str) -> str:
    """For a value refused for its form: the first control or format character in it (the
    reason a value that looks right is wrong), named, or ""."""
    bad = next((ch for ch in text if _invisible(ch)), None)
    if bad is None:
        return ""
    return f" (it contains {describe_character(bad)}; remove it)"


def foreign_characters(text: str) -> str:
    """For a value that must be one of a few ASCII words: the non-ASCII characters in it (a
    Cyrillic а in `layer` looks like the Latin a), named, or ""."""
    found = [ch for ch in dict.fromkeys(text) if ord(ch) > 127]
    if not found:
        return ""
    return f" (it contains {', '.join(describe_character(ch) for ch in found)}; type it in ASCII)"


def invisible_character_problems(data: Any, key_path: tuple = ()) -> list[tuple]:
    """Settings are one line of visible text: a newline or NUL would end up in a unit or an
    environment file as a line of its own, and a zero-width or non-breaking space makes two
    values that look alike differ. Only `server.chat_template_kwargs`, passed as JSON, may hold
    any text."""
    if key_path == ("server", "chat_template_kwargs"):
        return []
    if isinstance(data, str):
        bad = next((ch for ch in data if _invisible(ch)), None)
        if bad is None:
            return []
        return [
            (
                key_path,
                f"{data!r:.80} contains {describe_character(bad)}; a setting is one line of "
                "plain text: remove it (retype the value if you cannot see it)",
            )
        ]
    if not isinstance(data, dict | list):
        return []
    items = data.items() if isinstance(data, dict) else enumerate(data)
    problems = []
    for key, value in items:
        if isinstance(key, str):
            bad = next((ch for ch in key if _invisible(ch)), None)
            if bad is not None:
                problems.append(
                    (
                        (*key_path, key),
                        f"the key's name contains {describe_character(bad)}; remove it",
                    )
                )
        problems += invisible_character_problems(value, (*key_path, key))
    return problems


def _host_name_problem(value: str) -> str | None:
    name = value[:-1] if value.endswith(".") else value
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        return (
            f"{value!r} is not an IP address or a host name (RFC 1123: letters, digits, `-` and "
            f"`.`); {EXAMPLE_ADDRESS}"
        )
    if labels[-1].isdigit():
        return f"{value!r} is not a valid IPv4 address (four numbers 0-255); {EXAMPLE_ADDRESS}"
    return None


def host_name_problem(name: str) -> str | None:
    """What keeps ``name`` from being an inventory host name, or None."""
    if _HOST_NAME.fullmatch(name) and ".." not in name:
        return None
    return (
        f"{name!r} is not a host name: use letters, digits, `.`, `-` and `_`, starting with a "
        "letter or digit, at most 63 characters (e.g. `rig1`); where the box is goes in its "
        "`ssh.host`"
    )


# The distribution part of an NVIDIA repository URL (debian12/x86_64, ubuntu2404/sbsa, ...).
_NVIDIA_DISTRIBUTION_PATH = re.compile(r"/(debian|ubuntu)\d+/(x86_64|sbsa|arm64)/?$")


def address_problem(
    value: str, port_key: str, user_key: str | None = None, wildcard: bool = False
) -> str | None:
    """What keeps ``value`` from being an IP address or an RFC 1123 host name, with where the
    parts that do not belong go, or None. ``wildcard``: 0.0.0.0 and :: are allowed."""
    if value.startswith("-"):
        return (
            f"{value!r} starts with `-`, which ssh and other commands read as an option; give "
            f"the address, {EXAMPLE_ADDRESS}"
        )
    if "://" in value:
        return f"{value!r} is a URL; give only the address, {EXAMPLE_ADDRESS}"
    if "@" in value:
        user, _, address = value.rpartition("@")
        if user_key:
            host, colon, port = address.rpartition(":")
            if colon and port.isdigit() and ":" not in host:
                return (
                    f"{value!r} holds a user and a port: put `{user}` in `{user_key}`, {port} "
                    f"in `{port_key}` and `{host}` here"
                )
            rest = address_problem(address, port_key, wildcard=wildcard)
            if rest:  # the fix of the address part too, e.g. brackets and a port
                return f"{value!r} holds a user: put `{user}` in `{user_key}`; then {rest}"
            return f"{value!r} holds a user: put `{user}` in `{user_key}` and `{address}` here"
        return f"{value!r} holds a user part; give only the address, `{address}`"
    if value.startswith("["):
        inner, _, rest = value[1:].partition("]")
        fix = f"write the address without brackets: {inner}"
        if rest.startswith(":") and rest[1:].isdigit():
            fix += f", and put the port {rest[1:]} in `{port_key}`"
        return f"{value!r} is in brackets; {fix}"
    if value == "*":
        return "`*` is not an address; write 0.0.0.0 (every IPv4 interface) or :: (every one)"
    if "%" in value:
        return f"{value!r} has an IPv6 zone (`%...`), which URLs cannot carry; use another address"
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        address = None
    if address is not None:
        if address.is_unspecified and not wildcard:
            return f"{value} is not an address to connect to; give the host's own address"
        return None
    host, colon, port = value.rpartition(":")
    if colon and port.isdigit() and host.count(":") == 0:
        return f"{value!r} holds a port: put {port} in `{port_key}` and `{host}` here"
    if colon and port.isdigit():
        return (
            f"{value!r} is not an IP address; an IPv6 address is written alone (the port "
            f"goes in `{port_key}`)"
        )
    return _host_name_problem(value)


def decoded_invisible(value: str) -> str | None:
    """What a URL holds percent-encoded that a setting may not hold typed: a control or format
    character (``%00``, ``%1B``, ``%C2%85``, ``%E2%80%AE``) decodes into the file's name on
    the host and into what is printed, where it ends a line, rewrites the terminal or reorders
    text. Named by its code point and the escape that holds it, or None."""
    decoded = unquote(value, errors="replace")
    bad = next((ch for ch in decoded if _invisible(ch)), None)
    if bad is None:
        return None
    encoded = quote(bad, safe="")  # as the URL spells it, if it does (%1b or %1B)
    at = value.lower().find(encoded.lower())
    spelled = value[at : at + len(encoded)] if at >= 0 else encoded
    return (
        f"{value!r} holds {spelled}, which percent-decodes to {describe_character(bad)}; "
        "decoded, a URL becomes the model file's name and what llamarig prints, one line of "
        "visible text: remove it"
    )


def url_problem(value: str, schemes: tuple[str, ...], scheme_fix: str) -> str | None:
    """What keeps ``value`` from being a URL of one of ``schemes`` with a host, or None."""
    if any(ch.isspace() for ch in value):
        return f"{value!r} contains a space; percent-encode it (%20)"
    if not _URL_CHARACTERS.match(value):
        bad = next(ch for ch in value if not _URL_CHARACTERS.match(ch))
        return f"{value!r} contains {bad!r}, which a URL cannot hold as it is; percent-encode it"
    decoded = decoded_invisible(value)
    if decoded:
        return decoded
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as error:
        return f"{value!r} is not a valid URL ({error})"
    if parts.scheme not in schemes:
        return f"{value!r} is not a {' or '.join(schemes)} URL; {scheme_fix}"
    if parts.scheme == "file":
        return None if parts.path.startswith("/") else f"{value!r} has no absolute path"
    if not parts.hostname:
        return f"{value!r} has no host; e.g. https://example.org/model.gguf"
    problem = address_problem(parts.hostname, "the URL (host:port)")
    if problem:
        return f"the host of {value!r}: {problem}"
    return None


def git_repo_problem(value: str) -> str | None:
    """llama_cpp.repo: an https, ssh, git or file URL, an scp-like `git@host:path`, or an
    absolute path."""
    if value.startswith("-"):
        return f"{value!r} starts with `-`, which git reads as an option; give a URL"
    if value.startswith("/"):
        return host_path_problem(value)
    if "::" in value:
        return (
            f"{value!r} names a git remote helper (`TRANSPORT::`), which can run commands; "
            "give an https://, ssh://, git:// or file:// URL"
        )
    if any(ch.isspace() for ch in value):
        return f"{value!r} contains a space; percent-encode it (%20)"
    scp = _SCP_LIKE.match(value)
    if scp and "://" not in value:
        problem = address_problem(scp["host"], "an ssh:// URL (ssh://host:port/path)")
        return f"the host of {value!r}: {problem}" if problem else None
    return url_problem(
        value,
        ("https", "ssh", "git", "file"),
        "give an https://, ssh://, git:// or file:// URL, git@host:path, or an absolute path",
    )


def host_path_problem(value: str) -> str | None:
    """A path on the host: absolute and normalised, without `$`, `~` or backslashes."""
    if value.startswith("~"):
        return (
            f"{value!r}: `~` is expanded only in {LOCAL_FILES} (files on this machine); give "
            "the absolute path on the host"
        )
    if "$" in value:
        return f"{value!r}: `$` is not expanded (no variables in paths); write the path out"
    if "\\" in value:
        return f"{value!r} contains a backslash; paths on the host use `/`"
    if not value.startswith("/"):
        return f"{value!r} is not an absolute path; give the path from /, e.g. /opt/llamarig"
    normal = "/" + posixpath.normpath(value).lstrip("/")
    if normal != value:
        return f"{value!r} is not normalised (`..`, `.`, `//` or a trailing `/`); write {normal}"
    return None


def local_path_problem(value: str) -> str | None:
    """A path on this machine (`~` is expanded there, variables are not)."""
    if "$" in value:
        return (
            f"{value!r}: `$` is not expanded (no variables in paths); write the path out "
            "(`~` works)"
        )
    return None


def file_name_problem(name: str) -> str | None:
    """A model's file name under paths.models: any visible text but a path, an option or
    `.`/`..`. Checked as it lands on the disk: a name taken from a URL, decoded."""
    bad = next((ch for ch in name if _invisible(ch)), None)
    if bad is not None:
        return (
            f"{name!r} contains {describe_character(bad)}; a file name is one line of "
            "visible text: remove it"
        )
    if "/" in name:
        return f"{name!r} is a path; give only the file name (the directory is `paths.models`)"
    if name in (".", ".."):
        return f"{name!r} is not a file name"
    if name.startswith("-"):
        return f"{name!r} starts with `-`, which commands read as an option; rename it"
    return None


def _strings(data: dict, *key_paths: tuple) -> list[tuple[tuple, str]]:
    """The string values at ``key_paths`` (missing keys and other types skipped)."""
    found = []
    for key_path in key_paths:
        value: Any = data
        for part in key_path:
            if isinstance(value, list) and isinstance(part, int) and part < len(value):
                value = value[part]
            else:
                value = value.get(part) if isinstance(value, dict) else None
        if isinstance(value, str):
            found.append((key_path, value))
    return found


def shape_problems(data: dict) -> list[tuple]:
    """Every shape check of one host's rig data (after the schema passed), group by group of
    keys."""
    problems = invisible_character_problems(data)
    flagged = {key_path for key_path, *_ in problems}
    found = [
        *_address_shapes(data),
        *_ssh_user_shapes(data.get("ssh") or {}),
        *_local_path_shapes(data),
        *_source_shapes(data),
        *_unit_name_shapes(data),
        *_host_path_shapes(data),
    ]
    problems += _unflagged(found, flagged)
    url_refused = any(key_path == ("model", "url") for key_path, *_ in problems)
    problems += _unflagged(_model_file_shapes(data["model"], url_refused), flagged)
    return problems


# What a shape check finds: the key path and what keeps its value from its shape, or None.
Found = tuple[tuple, str | None]


def _unflagged(found: list[Found], flagged: set[tuple]) -> list[tuple]:
    """The problems found, less those of keys refused already for an invisible character."""
    return [
        (key_path, problem) for key_path, problem in found if problem and key_path not in flagged
    ]


def _address_shapes(data: dict) -> list[Found]:
    """The addresses the host is reached at and llama-server and ggml-rpc-server bind."""
    return [
        *(
            (key_path, address_problem(value, "ssh.port", "ssh.user"))
            for key_path, value in _strings(data, ("ssh", "host"))
        ),
        *(
            (key_path, address_problem(value, "server.port", wildcard=True))
            for key_path, value in _strings(data, ("server", "host"))
        ),
        # 0.0.0.0 and :: are refused by the RPC role rule, with the reason.
        *(
            (key_path, address_problem(value, "rpc.port", wildcard=True))
            for key_path, value in _strings(data, ("rpc", "host"))
        ),
        *(
            (key_path, address_problem(value, "gateway.port", wildcard=True))
            for key_path, value in _strings(data, ("gateway", "host"))
        ),
        *(
            (key_path, address_problem(value, "gateway.metrics.port", wildcard=True))
            for key_path, value in _strings(data, ("gateway", "metrics", "host"))
        ),
        # A self-signed certificate's names: what clients connect to, never a wildcard.
        *(
            (("gateway", "tls", "names", index), address_problem(value, "gateway.port"))
            for index, value in enumerate(
                (data.get("gateway") or {}).get("tls", {}).get("names", [])
            )
        ),
    ]


def _ssh_user_shapes(ssh: dict) -> list[Found]:
    """`ssh.user`: a login name, not an address and never an option."""
    user = ssh.get("user")
    if not isinstance(user, str):
        return []
    if "@" in user:
        return [(("ssh", "user"), f"{user!r} holds an address: put it in `ssh.host`")]
    if not _LOGIN.match(user):
        return [
            (
                ("ssh", "user"),
                f"{user!r} is not a login name (letters, digits, `_`, `.`, `-`; not starting "
                "with `-`), e.g. root",
            )
        ]
    return []


def _local_path_shapes(data: dict) -> list[Found]:
    """The files on this machine: SSH key and known_hosts, API key, the gateway's files."""
    key_paths = [
        ("ssh", "key"),
        ("ssh", "known_hosts"),
        ("server", "api_key_file"),
        ("gateway", "rig_key_file"),
        ("gateway", "tls", "cert_file"),
        ("gateway", "tls", "key_file"),
    ]
    users = (data.get("gateway") or {}).get("users", [])
    key_paths += [("gateway", "users", index, "key_file") for index in range(len(users))]
    return [(key_path, local_path_problem(value)) for key_path, value in _strings(data, *key_paths)]


def _source_shapes(data: dict) -> list[Found]:
    """Where things are fetched from: the model's URL, NVIDIA's repository and llama.cpp's."""
    return [
        *(
            (key_path, url_problem(value, ("http", "https"), "download over https"))
            for key_path, value in _strings(data, ("model", "url"))
        ),
        *_nvidia_repo_shapes(data["nvidia_repo"]),
        (("llama_cpp", "repo"), git_repo_problem(data["llama_cpp"]["repo"])),
    ]


def _nvidia_repo_shapes(repo: dict) -> list[Found]:
    """NVIDIA's repository: a URL the keyring may be installed from, as a base (llamarig
    appends the distribution), and the keyring package's Debian name and version."""
    insecure = repo.get("allow_insecure", False)
    schemes = ("https", "http", "file") if insecure else ("https",)
    found: list[Found] = [
        (
            ("nvidia_repo", "url"),
            url_problem(
                repo["url"],
                schemes,
                "the keyring is installed as root from it: use https, or set "
                "`nvidia_repo.allow_insecure: true` for a mirror you trust on your own network",
            ),
        )
    ]
    distribution_path = _NVIDIA_DISTRIBUTION_PATH.search(repo["url"])
    if distribution_path:
        base = repo["url"][: distribution_path.start()]
        found.append(
            (
                ("nvidia_repo", "url"),
                f"{repo['url']!r} already names a distribution "
                f"({distribution_path[0].strip('/')}), which llamarig appends from the host's "
                f"release: give the base, {base}",
            )
        )
    if not _DEBIAN_PACKAGE.match(repo["keyring_package"]):
        found.append(
            (
                ("nvidia_repo", "keyring_package"),
                f"{repo['keyring_package']!r} is not a Debian package name (lowercase letters, "
                "digits, `+`, `-`, `.`), e.g. cuda-keyring",
            )
        )
    if not _DEBIAN_VERSION.match(repo["keyring_version"]):
        found.append(
            (
                ("nvidia_repo", "keyring_version"),
                f"{repo['keyring_version']!r} is not a Debian version as in the .deb file name "
                "(digits first, then letters, digits, `.+~-`, no epoch), e.g. 1.1-1",
            )
        )
    return found


def _unit_name_shapes(data: dict) -> list[Found]:
    """The systemd units' names, as written without the `.service` llamarig adds."""
    found: list[Found] = []
    for key_path, value in _strings(data, ("server", "service"), ("rpc", "service")):
        if value.startswith(("-", ".")):
            found.append(
                (
                    key_path,
                    f"{value!r} starts with {value[0]!r}; a unit name starts with a letter or "
                    "digit",
                )
            )
        elif value.endswith(".service"):
            found.append(
                (
                    key_path,
                    f"{value!r} ends in `.service`, which llamarig adds: write "
                    f"{value.removesuffix('.service')!r}",
                )
            )
    return found


def _host_path_shapes(data: dict) -> list[Found]:
    """The paths on the host: every `paths` entry, the model's path and an explicit nvcc."""
    host_paths = [("paths", key) for key in data["paths"]] + [("model", "path")]
    if data["cuda"]["nvcc"] != "auto":
        host_paths.append(("cuda", "nvcc"))
    return [(key_path, host_path_problem(value)) for key_path, value in _strings(data, *host_paths)]


def _model_file_shapes(model: dict, url_refused: bool) -> list[Found]:
    """The model's file name as it lands on the disk: `model.filename`, or else the name its
    URL gives (unless the URL is refused already)."""
    if isinstance(model.get("filename"), str):
        return [(("model", "filename"), file_name_problem(model["filename"]))]
    if not isinstance(model.get("url"), str) or url_refused:
        return []
    problem = file_name_problem(url_file_name(model["url"]))
    if problem is None:
        return []
    return [
        (("model", "url"), f"the file name taken from the URL, {problem}; set `model.filename`")
    ]
