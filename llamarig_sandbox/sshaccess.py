"""How the rig reaches a sandbox over SSH: what `up` says of a running sandbox (SandboxInfo),
the rig's client key, the sshd settings and key a working root is given, its host key pinned,
and the ssh command line."""

import subprocess
from dataclasses import dataclass
from pathlib import Path

from llamarig.config.ssh import SshTarget
from llamarig_sandbox.layout import KEY_PATH, LOOPBACK, SANDBOX_DIR, lock, sandbox_paths
from llamarig_sandbox.processes import run

SSH_CONNECT_TIMEOUT_S = 10


@dataclass(frozen=True)
class SandboxInfo:
    """How to reach a running sandbox and what it is served."""

    name: str
    release: str
    ssh_port: int
    key_path: str
    known_hosts_path: str
    root_dir: str
    model_url: str
    model_sha256: str
    test_model_url: str
    test_model_sha256: str
    git_url: str


def known_hosts_line(public_key: str, port: int, host: str = LOOPBACK) -> str:
    """Render the known_hosts line pinning `public_key` (an .pub file's text) for host:port."""
    fields = public_key.split()
    if len(fields) < 2:
        raise ValueError("not an OpenSSH public key")
    host_pattern = host if port == 22 else f"[{host}]:{port}"
    return f"{host_pattern} {fields[0]} {fields[1]}\n"


def sshd_dropin(port: int) -> str:
    """sshd configuration for a sandbox: key-only root login on loopback at `port`."""
    return (
        f"Port {port}\n"
        f"ListenAddress {LOOPBACK}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
    )


def ensure_ssh_key() -> Path:
    """Generate the sandbox SSH client key pair once; return the private key's path."""
    with lock("ssh-key"):
        if KEY_PATH.exists():
            return KEY_PATH
        SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
        run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "llamarig-sandbox",
                "-f",
                str(KEY_PATH),
            ],
            "ssh-keygen",
        )
    return KEY_PATH


def configure_sshd(root: Path, ssh_port: int) -> None:
    """Let the rig's key log in as root to `root`'s sshd, which listens on loopback at
    `ssh_port`."""
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    ssh_dir.chmod(0o700)
    authorized_keys = ssh_dir / "authorized_keys"
    authorized_keys.write_text(Path(f"{KEY_PATH}.pub").read_text())
    authorized_keys.chmod(0o600)
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/llamarig.conf").write_text(sshd_dropin(ssh_port))


def pin_host_key(name: str, root: Path, ssh_port: int) -> Path:
    """Write known_hosts from the root's own host key (read from disk, no keyscan)."""
    known_hosts = sandbox_paths(name)["known_hosts"]
    known_hosts.parent.mkdir(parents=True, exist_ok=True)
    public_key = (root / "etc/ssh/ssh_host_ed25519_key.pub").read_text()
    known_hosts.write_text(known_hosts_line(public_key, ssh_port))
    return known_hosts


def ssh_command(info: SandboxInfo) -> list[str]:
    """The ssh command line for the sandbox: the rig's own (`SshTarget`, host key pinned), with
    only the sandbox key offered and a bounded connect while it boots."""
    target = SshTarget(
        host=LOOPBACK,
        port=info.ssh_port,
        user="root",
        key=info.key_path,
        known_hosts=info.known_hosts_path,
    )
    return target.argv("-o", "IdentitiesOnly=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}")


def ssh(
    info: SandboxInfo, command: str, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """Run a shell command in the sandbox over SSH (host key pinned); capture text output."""
    return subprocess.run(
        [*ssh_command(info), command],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )
