"""Reaching a host: its SSH settings rendered once for each client (pyinfra, ssh,
testinfra), with the host key always checked against the known_hosts file named."""

from __future__ import annotations

import copy
import re
import subprocess
from dataclasses import dataclass

from llamarig.config.hosts import HostConfig
from llamarig.config.paths import expand_path
from llamarig.config.ssh_trust import strict_host_key_checking


@dataclass(frozen=True)
class SshTarget:
    """One host's SSH settings (`ssh` of the rig data, paths with ``~`` expanded), rendered
    for pyinfra, for the ssh command line and for testinfra's ssh_config alike."""

    host: str
    port: int = 22
    user: str | None = None
    key: str | None = None
    known_hosts: str | None = None
    # OpenSSH's StrictHostKeyChecking value: yes, or accept-new where the user opted in.
    checking: str = "yes"

    @classmethod
    def of(cls, ssh: dict) -> SshTarget:
        return cls(
            host=ssh["host"],
            port=ssh.get("port", 22),
            user=ssh.get("user"),
            key=expand_path(ssh["key"]) if "key" in ssh else None,
            known_hosts=expand_path(ssh["known_hosts"]) if "known_hosts" in ssh else None,
            checking=strict_host_key_checking(ssh),
        )

    def pyinfra_data(self) -> dict:
        """pyinfra's connector data for the host."""
        connection = {
            "ssh_hostname": self.host,
            "ssh_port": self.port,
            # Host keys are always checked: a rig holds API keys and model files. pyinfra's own
            # default is accept-new; only the user's `ssh.host_key_checking` chooses it here.
            "ssh_strict_host_key_checking": self.checking,
        }
        if self.user is not None:
            connection["ssh_user"] = self.user
        if self.key is not None:
            connection["ssh_key"] = self.key
        if self.known_hosts is not None:
            connection["ssh_known_hosts_file"] = self.known_hosts
        return connection

    def argv(self, *options: str) -> list[str]:
        """An ssh command line for the host (``options`` added), with the same host-key
        checking as the deploy.

        `--` ends the options: the destination is never read as one (`-oProxyCommand=...`
        would run a command here), though the loader refuses such a host already."""
        command = ["ssh", "-o", f"StrictHostKeyChecking={self.checking}", "-o", "BatchMode=yes"]
        if self.known_hosts is not None:
            command += ["-o", f"UserKnownHostsFile={ssh_config_value(self.known_hosts)}"]
        if self.key is not None:
            # As an option, not -i: ssh checks an -i path before it expands %-tokens in it, so
            # no spelling of a path with `%` would work there.
            command += ["-o", f"IdentityFile={ssh_config_value(self.key)}"]
        command += ["-p", str(self.port), *options]
        user = f"{self.user}@" if self.user is not None else ""
        return [*command, "--", f"{user}{self.host}"]

    def ssh_config(self, alias: str) -> str:
        """An ssh_config block for testinfra's ssh backend (never paramiko://, which does not
        check host keys), under the name ``alias`` (see `ssh_alias`)."""
        lines = [
            f"Host {alias}",
            f"  HostName {self.host}",
            f"  Port {self.port}",
            f"  StrictHostKeyChecking {self.checking}",
            "  BatchMode yes",
        ]
        if self.user is not None:
            lines.append(f"  User {self.user}")
        if self.key is not None:
            lines += [f"  IdentityFile {ssh_config_value(self.key)}", "  IdentitiesOnly yes"]
        if self.known_hosts is not None:
            lines.append(f"  UserKnownHostsFile {ssh_config_value(self.known_hosts)}")
        return "\n".join(lines) + "\n"

    def run(self, command: str, timeout: float | None = 120) -> subprocess.CompletedProcess:
        """``command`` run by the host's shell over ssh, its output captured as text."""
        return subprocess.run(
            [*self.argv(), command], capture_output=True, text=True, timeout=timeout
        )


def ssh_config_value(value: str) -> str:
    """``value`` as one argument of an ssh_config line (or ``ssh -o``): %-tokens escaped, and
    quoted (ssh splits arguments at spaces, honouring double quotes and backslashes)."""
    value = value.replace("%", "%%")
    if value and not any(ch in value for ch in " \t\"'\\#"):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def ssh_alias(name: str) -> str:
    """The ssh_config alias of an inventory host: one word whatever the host's name holds."""
    return "llamarig-" + re.sub(r"[^A-Za-z0-9._-]", "_", name)


def pyinfra_host(host_config: HostConfig) -> tuple[str, dict]:
    """The (name, data) pair pyinfra's inventory expects, with SSH settings mapped."""
    data = copy.deepcopy(host_config.data)
    ssh = data.get("ssh") or {}
    if ssh.get("local"):
        return "@local", data
    return host_config.name, {**data, **SshTarget.of(ssh).pyinfra_data()}
