"""What this machine must have before pyinfra connects to a host: the local files its `ssh`
settings name, and under strict host-key checking, the host's key in known_hosts."""

from __future__ import annotations

import os
from pathlib import Path

from llamarig.config.hosts import Inventory
from llamarig.config.paths import expand_path
from llamarig.config.problems import Problem, located


def strict_host_key_checking(ssh: dict) -> str:
    """OpenSSH's ``StrictHostKeyChecking`` value for a host's `ssh` settings, which pyinfra's
    ``ssh_strict_host_key_checking`` takes too: ``yes``, unless the user opted in to
    ``host_key_checking: accept-new`` (any other value stays strict)."""
    return "accept-new" if ssh.get("host_key_checking") == "accept-new" else "yes"


def _host_key_known(known_hosts: str, host: str, port: int) -> bool | None:
    """Whether ``known_hosts`` holds a key for host:port, looked up as pyinfra (paramiko) will:
    the name ``host`` or ``[host]:port``, hashed entries included, after ~/.ssh/config's
    ``HostName``. None when that cannot be told for sure (an unreadable file, @cert-authority
    or @revoked lines, an ssh config with Include), so that nothing is refused on a guess."""
    import paramiko

    try:
        text = Path(known_hosts).read_text(encoding="utf-8", errors="replace")
        if any(line.lstrip().startswith("@") for line in text.splitlines()):
            return None
        config = Path(os.path.expanduser("~/.ssh/config"))
        if config.is_file():
            config_text = config.read_text(encoding="utf-8", errors="replace")
            if "include" in config_text.lower():
                return None
            host = paramiko.SSHConfig.from_text(config_text).lookup(host).get("hostname", host)
        keys = paramiko.HostKeys()
        keys.load(known_hosts)
    except Exception:  # any doubt: leave the verdict to the connection
        return None
    return keys.lookup(host if port == 22 else f"[{host}]:{port}") is not None


def connection_problems(inventory: Inventory) -> list[str]:
    """What this machine must have before pyinfra connects: the files named in `ssh`, and with
    strict host-key checking, the host's key in the `known_hosts` file."""
    problems = []
    for host_config in inventory.hosts.values():
        ssh = host_config.data.get("ssh") or {}
        accept_new = strict_host_key_checking(ssh) == "accept-new"
        sandbox = " or run `llamarig sandbox up`"
        for key, what in (("key", "private key"), ("known_hosts", "known_hosts file")):
            if key not in ssh:
                continue
            path = expand_path(ssh[key])
            if os.path.isfile(path):
                continue
            if key == "known_hosts" and accept_new and os.path.isdir(os.path.dirname(path) or "."):
                continue  # accept-new creates it on first contact
            problems.append(
                located(
                    host_config,
                    Problem(
                        ("ssh", key),
                        f"the {what} {ssh[key]} does not exist on this machine; fix the path"
                        + (sandbox if "llamarig" in ssh[key] else "")
                        + (
                            " (or, to enroll a new box, create its directory and set "
                            "`ssh.host_key_checking: accept-new` for the first run)"
                            if key == "known_hosts"
                            else ""
                        ),
                    ),
                )
            )
        if ssh.get("local") or accept_new or not ssh.get("host"):
            continue
        known_hosts = ssh.get("known_hosts") or _default_known_hosts()
        if not known_hosts:
            continue
        path = expand_path(known_hosts)
        port = ssh.get("port", 22)
        if os.path.isfile(path):
            known = _host_key_known(path, ssh["host"], port)
        elif "known_hosts" in ssh:
            continue  # a missing file named in the inventory is reported above
        else:  # no ~/.ssh/known_hosts: paramiko knows no key at all
            known = False
        if known is False:
            name = ssh["host"] if port == 22 else f"[{ssh['host']}]:{port}"
            problems.append(
                located(
                    host_config,
                    Problem(
                        ("ssh", "known_hosts"),
                        f"{known_hosts} has no key for {name}, and host keys are checked "
                        "strictly: add the box's key first (docs/inventory.md, Enrolling a new "
                        "box: `ssh-keyscan` it and compare the fingerprint with the box's "
                        "console), or set `ssh.host_key_checking: accept-new` for the first run",
                        in_inventory="known_hosts" not in ssh,
                    ),
                )
            )
    return problems


DEFAULT_KNOWN_HOSTS = "~/.ssh/known_hosts"


def _default_known_hosts() -> str | None:
    """The file pyinfra checks host keys against when `ssh.known_hosts` is not set: the user's
    ~/.ssh/known_hosts (after $HOME), or None where ~/.ssh/config may name another
    (UserKnownHostsFile, or an Include that could), so that nothing is refused on a guess."""
    config = Path(os.path.expanduser("~/.ssh/config"))
    try:
        text = config.read_text(encoding="utf-8", errors="replace").lower()
    except FileNotFoundError:
        return DEFAULT_KNOWN_HOSTS
    except OSError:
        return None
    return None if "userknownhostsfile" in text or "include" in text else DEFAULT_KNOWN_HOSTS
