"""Host keys are checked before connecting also when the rig names no `ssh.known_hosts`: pyinfra
then trusts only ~/.ssh/known_hosts (of $HOME; tests get a fresh one), so a host missing from it
is refused up front with the message of the explicit case, not by a failed connection."""

from __future__ import annotations

import subprocess
import sys

import paramiko

from llamarig.config import connection_problems, load_inventory
from tests.conftest import PROJECT, offline, pyinfra_env
from tests.test_ssh_trust import RIG  # the same one-host rig, `{SSH}` filled in per test

KEY = paramiko.RSAKey.generate(1024)


def inventory(write_inventory, ssh: str = "{host: 192.0.2.1}"):
    return load_inventory(write_inventory(RIG.replace("{SSH}", ssh)))


def write_known_hosts(path, *hosts: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{host} ssh-rsa {KEY.get_base64()}\n" for host in hosts))


def test_default_known_hosts_without_the_host_is_refused_as_an_explicit_one(
    write_inventory, home, tmp_path
):
    default = inventory(write_inventory)
    (missing_file,) = connection_problems(default)  # no ~/.ssh/known_hosts at all
    write_known_hosts(home / ".ssh" / "known_hosts", "192.0.2.9")
    (other_host,) = connection_problems(default)
    assert missing_file == other_host
    assert other_host.startswith(
        f"{default.path}: hosts.rig1.ssh.known_hosts: ~/.ssh/known_hosts has no key for "
        "192.0.2.1, and host keys are checked strictly"
    )
    explicit_file = tmp_path / "known_hosts"
    write_known_hosts(explicit_file, "192.0.2.9")
    explicit = inventory(write_inventory, f"{{host: 192.0.2.1, known_hosts: {explicit_file}}}")
    (explicit_problem,) = connection_problems(explicit)
    assert explicit_problem == other_host.replace("~/.ssh/known_hosts", str(explicit_file))

    write_known_hosts(home / ".ssh" / "known_hosts", "192.0.2.9", "192.0.2.1")
    assert connection_problems(default) == []


def test_home_decides_which_file_is_read(write_inventory, home, tmp_path, monkeypatch):
    write_known_hosts(home / ".ssh" / "known_hosts", "[192.0.2.1]:2200")
    rig = inventory(write_inventory, "{host: 192.0.2.1, port: 2200}")
    assert connection_problems(rig) == []
    other = tmp_path / "other-home"
    other.mkdir()
    monkeypatch.setenv("HOME", str(other))
    (problem,) = connection_problems(rig)
    assert "~/.ssh/known_hosts has no key for [192.0.2.1]:2200" in problem


def test_no_verdict_where_ssh_config_may_name_another_file(write_inventory, home):
    rig = inventory(write_inventory)
    (home / ".ssh").mkdir()
    (home / ".ssh" / "config").write_text("Host *\n  UserKnownHostsFile ~/.ssh/rigs_known\n")
    assert connection_problems(rig) == []
    (home / ".ssh" / "config").write_text("Include ~/.ssh/config.d/*\n")
    assert connection_problems(rig) == []


def test_accept_new_and_local_need_no_key(write_inventory):
    assert connection_problems(inventory(write_inventory, "{local: true}")) == []
    accept_new = "{host: 192.0.2.1, host_key_checking: accept-new}"
    assert connection_problems(inventory(write_inventory, accept_new)) == []


def test_pyinfra_inventory_refuses_before_connecting(write_inventory):
    path = write_inventory(RIG.replace("{SSH}", "{host: 192.0.2.1}"))
    result = subprocess.run(
        offline([sys.executable, "-m", "pyinfra", "inventory.py", "deploy.py", "--dry"]),
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY=str(path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert f"{path}: hosts.rig1.ssh.known_hosts: ~/.ssh/known_hosts has no key" in result.stderr
    assert "Could not connect" not in output and "Traceback" not in output
