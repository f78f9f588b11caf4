"""Files llamarig owns on a host: written atomically (a temporary file renamed into place),
secrets that never reach pyinfra's diff, links, directories, and paths removed."""

from __future__ import annotations

import hashlib
import shlex
from io import BytesIO
from pathlib import PurePosixPath
from typing import IO

from pyinfra import host, logger, state
from pyinfra.api import (
    FileUploadCommand,
    operation,
)
from pyinfra.facts.files import Directory, File, FileContents, Link
from pyinfra.operations.util.files import generate_color_diff

from llamarig.facts.cache import known
from llamarig.facts.files import FileState
from llamarig.onhost.hostpaths import ATOMIC_SUFFIX
from llamarig.operations.host import fail


def rename_into_place(dest: str, mode: str) -> str:
    """A shell command that gives the complete copy beside ``dest`` (``dest`` + ATOMIC_SUFFIX)
    its mode and renames it over ``dest``."""
    copy, quoted = shlex.quote(dest + ATOMIC_SUFFIX), shlex.quote(dest)
    # sync: the rename must not reach the disk before the content does.
    return f"chmod {mode} {copy} && sync {copy} && mv -f {copy} {quoted}"


@operation()
def atomic_file(src: IO[str], dest: str, mode: str = "644"):
    """
    Write a file on the host only when its content or mode differ, by renaming a complete copy
    over it: a run cut short leaves the old file or the new one, never part of one.

    + src: the wanted content (a file-like object, e.g. a rendered template)
    + dest: path on the host; its directory is created when missing
    + mode: octal permissions

    ``files.put`` writes over SFTP into the file itself: a deploy killed mid-write left an
    empty systemd unit behind, which would have kept llama-server down after a reboot. Like
    ``files.put``, ``--diff`` shows what changes.

    **Example:**

    .. code:: python

        atomic_file(src=StringIO(unit_text), dest="/etc/systemd/system/llama-server.service")
    """
    # pyinfra runs an operation's body more than once (to plan, then to execute).
    src.seek(0)
    content = src.read().encode()
    remote = known(FileState, path=dest)
    same_content = bool(remote) and remote["sha256"] == hashlib.sha256(content).hexdigest()
    if same_content:
        if remote["mode"] != int(mode):
            yield f"chmod {mode} {shlex.quote(dest)}"
        else:
            host.noop(f"{dest} is up to date")
        return
    if state.config.DIFF:
        current = host.get_fact(FileContents, path=dest) if remote else None
        host.log(f"Will {'modify' if remote else 'create'} {dest}", logger.info)
        for line in generate_color_diff(
            [line + "\n" for line in current or []], content.decode().splitlines(keepends=True)
        ):
            logger.info("  %s", line)
    if not remote:
        yield f"mkdir -p {shlex.quote(str(PurePosixPath(dest).parent))}"
    yield FileUploadCommand(BytesIO(content), dest + ATOMIC_SUFFIX)
    yield rename_into_place(dest, mode)


@operation()
def secret_file(src: str | IO[bytes], dest: str):
    """
    Copy a secret (an API key, a token's header) to a root-only file on the host, only when
    it differs.

    + src: local file with the secret, or a binary stream holding it
    + dest: file on the host, created 0600 before anything is written to it

    Unlike ``files.put`` this never shows the content (pyinfra's ``--diff`` prints what
    ``files.put`` writes) and never leaves a readable copy; like ``atomic_file`` it renames a
    complete copy over the old key.

    **Example:**

    .. code:: python

        secret_file(src="~/.config/llamarig/rig1.key", dest="/etc/llamarig/api-key")
    """
    if hasattr(src, "read"):
        # From the start: pyinfra may run an operation's generator more than once.
        src.seek(0)
        secret = src.read()
    else:
        with open(src, "rb") as handle:
            secret = handle.read()
    if (known(FileState, path=dest) or {}).get("sha256") == hashlib.sha256(secret).hexdigest():
        host.noop(f"{dest} is up to date")
        return
    quoted, temporary = shlex.quote(dest), shlex.quote(dest + ATOMIC_SUFFIX)
    # The copy is root-only before a byte is written to it, then renamed over the key.
    yield f"mkdir -p $(dirname {quoted}) && umask 077 && : > {temporary} && chmod 600 {temporary}"
    yield FileUploadCommand(BytesIO(secret), dest + ATOMIC_SUFFIX)
    yield f"chown root:root {temporary} && {rename_into_place(dest, '600')}"


@operation()
def curl_auth_header(key_file: str, dest: str, rewrite: bool = False):
    """
    Write a root-only curl header file (``Authorization: Bearer <key>``) from the API key on the
    host, for the deploy's own checks (``curl -H @dest``).

    + key_file: the key file on the host (its first line is the key)
    + dest: the header file, 0600
    + rewrite: write it even when it exists (the key changes in this run)

    The key never appears in a process's arguments (printf is a shell builtin), and the file is
    renamed into place: a truncated header would survive every later run.
    """
    if not rewrite and known(File, path=dest):
        host.noop(f"{dest} exists")
        return
    yield (
        f"umask 077; printf 'Authorization: Bearer %s\\n' "
        f'"$(head -n1 {shlex.quote(key_file)})" > {shlex.quote(dest + ATOMIC_SUFFIX)} '
        f"&& {rename_into_place(dest, '600')}"
    )


@operation()
def symlink(path: str, target: str):
    """
    Point a symbolic link at ``target``, replacing a link that points elsewhere by renaming a
    new one over it (never a moment without the link); its directory is created when missing.

    + path: the link
    + target: what it points at

    **Example:**

    .. code:: python

        symlink(path="/opt/llamarig/current", target="/opt/llamarig/builds/0c1e57098bba-1a2b")
    """
    link = known(Link, path=path)
    if link is False:
        yield from fail._inner(f"{path} exists and is not a symbolic link")
        return
    if link and link["link_target"] == target:
        host.noop(f"{path} points at {target}")
        return
    new = shlex.quote(path + ATOMIC_SUFFIX)
    parent = shlex.quote(str(PurePosixPath(path).parent))
    yield (
        f"mkdir -p {parent} && ln -sfn {shlex.quote(target)} {new} && "
        f"mv -T {new} {shlex.quote(path)}"
    )


@operation()
def directory(path: str, mode: str, user: str | None = None, group: str | None = None):
    """
    A directory with this mode (and owner), created when missing, as pyinfra's
    ``files.directory`` makes it.

    + path: the directory
    + mode: octal permissions, e.g. ``"755"``
    + user, group: its owner, or None to leave it

    **Example:**

    .. code:: python

        directory(path="/etc/llamarig/hub", mode="700", user="root", group="root")
    """
    info = known(Directory, path=path)
    if info is False:
        yield from fail._inner(f"{path} exists and is not a directory")
        return
    quoted = shlex.quote(path)
    commands = [] if info else [f"mkdir -p {quoted}"]
    if not info or info["mode"] != int(mode):
        commands.append(f"chmod {mode} {quoted}")
    if (user and (not info or info["user"] != user)) or (
        group and (not info or info["group"] != group)
    ):
        owner = shlex.quote(user or "") + (f":{shlex.quote(group)}" if group else "")
        commands.append(f"chown {owner} {quoted}")
    if not commands:
        host.noop(f"{path} is a directory with mode {mode}")
    yield from commands


@operation()
def absent(path: str):
    """
    No file at ``path`` (a directory there is an error, as for pyinfra's
    ``files.file(present=False)``).

    + path: the file

    **Example:**

    .. code:: python

        absent(path="/etc/llamarig/api-key")
    """
    info = known(File, path=path)
    if info is False:
        yield from fail._inner(f"{path} exists and is not a file")
    elif info:
        yield f"rm -f {shlex.quote(path)}"
    else:
        host.noop(f"{path} does not exist")
