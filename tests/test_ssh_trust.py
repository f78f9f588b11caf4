"""SSH trust: the deploy (pyinfra), `llamarig verify` (testinfra's ssh backend) and the CLI's ssh
command check host keys strictly against the known_hosts file the rig names; only
`ssh.host_key_checking: accept-new`, set by the user, lets them record the key of a host that
is not there yet, and a key that changed is refused either way.

The mapping is checked in each of the three places, then each client connects for real to an
SSH server on loopback (paramiko's server side, with a host key made for the test)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
from pathlib import Path

import paramiko
import pytest
import testinfra
from pyinfra.api import Config, Inventory, State
from pyinfra.api.exceptions import ConnectError
from pyinfra.connectors.ssh import ConnectorData
from pyinfra.connectors.sshuserclient.client import (
    AcceptNewPolicy,
    StrictPolicy,
    get_host_keys,
    get_missing_host_key_policy,
)

from llamarig.config import (
    ConfigError,
    connection_problems,
    defaults,
    load_inventory,
    strict_host_key_checking,
)
from llamarig.config.ssh import SshTarget, pyinfra_host

RIG = """\
all:
  hosts:
    rig1:
      ssh: {SSH}
      gpus: [{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}]
      model: {path: /srv/m.gguf}
"""


def rig(write_inventory, ssh: str):
    return load_inventory(write_inventory(RIG.replace("{SSH}", ssh))).hosts["rig1"]


# --- the setting and its mapping -------------------------------------------------------------


def test_strict_is_the_default_and_accept_new_an_opt_in():
    assert defaults()["ssh"] == {"host_key_checking": "strict"}
    assert strict_host_key_checking({}) == "yes"
    assert strict_host_key_checking({"host_key_checking": "strict"}) == "yes"
    assert strict_host_key_checking({"host_key_checking": "accept-new"}) == "accept-new"
    # Anything else stays strict (the schema refuses it before this is ever asked).
    assert strict_host_key_checking({"host_key_checking": "no"}) == "yes"


def test_other_values_are_refused(write_inventory):
    with pytest.raises(ConfigError) as caught:
        rig(write_inventory, "{host: 192.0.2.1, host_key_checking: 'off'}")
    (problem,) = caught.value.problems
    assert "hosts.rig1.ssh.host_key_checking: 'off' is not allowed" in problem
    assert "strict" in problem and "accept-new" in problem


def test_pyinfra_data_keys_exist_in_the_pinned_connector():
    """The names llamarig sets are pyinfra 3's connector data, and the values are policies."""
    assert {"ssh_known_hosts_file", "ssh_strict_host_key_checking"} <= set(
        ConnectorData.__annotations__
    )
    assert isinstance(get_missing_host_key_policy("yes"), StrictPolicy)
    assert isinstance(get_missing_host_key_policy("accept-new"), AcceptNewPolicy)


@pytest.mark.parametrize(
    ("setting", "value"), [("", "yes"), ("strict", "yes"), ("accept-new", "accept-new")]
)
def test_pyinfra_host_maps_the_policy_and_known_hosts(write_inventory, setting, value):
    extra = f", host_key_checking: {setting}" if setting else ""
    host = rig(write_inventory, f"{{host: 192.0.2.1, port: 2200, known_hosts: ~/kh{extra}}}")
    name, data = pyinfra_host(host)
    assert name == "rig1"
    assert data["ssh_strict_host_key_checking"] == value
    assert data["ssh_known_hosts_file"] == str(Path.home() / "kh")
    # pyinfra itself would default to accept-new: the host data always overrides it.
    pyinfra_inventory = Inventory(([(name, data)], {}))
    State(pyinfra_inventory, Config())
    assert pyinfra_inventory.get_host("rig1").data.ssh_strict_host_key_checking == value


@pytest.mark.parametrize(("setting", "value"), [("strict", "yes"), ("accept-new", "accept-new")])
def test_testinfra_ssh_config_maps_the_policy(setting, value):
    text = SshTarget.of(
        {"host": "192.0.2.1", "port": 2200, "known_hosts": "/kh", "host_key_checking": setting}
    ).ssh_config("llamarig-rig1")
    assert f"  StrictHostKeyChecking {value}\n" in text
    assert "  UserKnownHostsFile /kh\n" in text and "  BatchMode yes\n" in text


@pytest.mark.parametrize(("setting", "value"), [("strict", "yes"), ("accept-new", "accept-new")])
def test_cli_ssh_command_maps_the_policy(setting, value):
    command = SshTarget.of(
        {"host": "192.0.2.1", "user": "root", "known_hosts": "/kh", "host_key_checking": setting}
    ).argv()
    assert command[:5] == ["ssh", "-o", f"StrictHostKeyChecking={value}", "-o", "BatchMode=yes"]
    assert "UserKnownHostsFile=/kh" in command and command[-1] == "root@192.0.2.1"


# --- before connecting -----------------------------------------------------------------------


def test_strict_refuses_a_known_hosts_file_without_the_host(write_inventory, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    key = paramiko.RSAKey.generate(1024)
    known_hosts.write_text(f"[192.0.2.9]:2200 ssh-rsa {key.get_base64()}\n")
    ssh = f"{{host: 192.0.2.1, port: 2200, known_hosts: {known_hosts}}}"
    inventory = load_inventory(write_inventory(RIG.replace("{SSH}", ssh)))
    (problem,) = connection_problems(inventory)
    assert f"hosts.rig1.ssh.known_hosts: {known_hosts} has no key for [192.0.2.1]:2200" in problem
    assert "Enrolling a new box" in problem and "accept-new" in problem

    # The host's line, hashed as `ssh-keyscan -H` writes it, is enough.
    hashed = paramiko.HostKeys()
    hashed.add(paramiko.HostKeys.hash_host("[192.0.2.1]:2200"), "ssh-rsa", key)
    hashed.save(str(known_hosts))
    assert connection_problems(inventory) == []


def test_accept_new_may_start_without_a_known_hosts_file(write_inventory, tmp_path):
    missing = tmp_path / "new" / "known_hosts"
    ssh = f"{{host: 192.0.2.1, known_hosts: {missing}, host_key_checking: %s}}"
    strict = load_inventory(write_inventory(RIG.replace("{SSH}", ssh % "strict")))
    (problem,) = connection_problems(strict)
    assert f"the known_hosts file {missing} does not exist" in problem
    # accept-new creates the file, but only in a directory that exists.
    accept_new = load_inventory(write_inventory(RIG.replace("{SSH}", ssh % "accept-new")))
    (problem,) = connection_problems(accept_new)
    assert "create its directory" in problem
    missing.parent.mkdir()
    assert connection_problems(accept_new) == []


# --- connecting for real ---------------------------------------------------------------------


class _Server(paramiko.ServerInterface):
    def __init__(self):
        self.exec_requested = threading.Event()

    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL

    def check_channel_request(self, kind, chanid):
        if kind == "session":
            return paramiko.OPEN_SUCCEEDED
        return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_exec_request(self, channel, command):
        self.exec_requested.set()
        return True


class SshServer:
    """An SSH server on 127.0.0.1 that accepts any client key and answers any command with
    "ok" and exit status 0: enough for each client to get past the host-key check."""

    def __init__(self, host_key: paramiko.PKey):
        self.host_key = host_key
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.stopped:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection):
        transport = paramiko.Transport(connection)
        transport.add_server_key(self.host_key)
        server = _Server()
        try:
            transport.start_server(server=server)
            channel = transport.accept(10)
            if channel is not None and server.exec_requested.wait(10):
                channel.sendall(b"ok\n")
                channel.send_exit_status(0)
                channel.close()
                # Let the client hang up first: closing under it breaks its pipe.
                deadline = time.monotonic() + 10
                while transport.is_active() and time.monotonic() < deadline:
                    time.sleep(0.02)
        except (paramiko.SSHException, EOFError, OSError):
            pass
        finally:
            transport.close()

    def close(self):
        self.stopped = True
        self.listener.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ssh")
    client_key = paramiko.RSAKey.generate(2048)
    client_key.write_private_key_file(str(directory / "id_rsa"))
    (directory / "id_rsa").chmod(0o600)
    return directory / "id_rsa", paramiko.RSAKey.generate(2048), paramiko.RSAKey.generate(2048)


@pytest.fixture
def server(keys):
    running = SshServer(keys[1])
    yield running
    running.close()


def known_line(server: SshServer, key: paramiko.PKey) -> str:
    return f"[127.0.0.1]:{server.port} {key.get_name()} {key.get_base64()}\n"


def ssh_settings(keys, server, known_hosts: Path, checking: str) -> dict:
    return {
        "host": "127.0.0.1",
        "port": server.port,
        "user": "root",
        "key": str(keys[0]),
        "known_hosts": str(known_hosts),
        "host_key_checking": checking,
    }


def connects_with_pyinfra(write_inventory, ssh: dict) -> bool:
    """Through the loader and its mapping to pyinfra host data, as inventory.py does."""
    host_config = rig(write_inventory, json.dumps(ssh))
    pyinfra_inventory = Inventory(([pyinfra_host(host_config)], {}))
    state = State(pyinfra_inventory, Config(CONNECT_TIMEOUT=10))
    get_host_keys.cache.clear()  # pyinfra reads known_hosts once per process; each call is one run
    host = pyinfra_inventory.get_host("rig1")
    try:
        host.connect(raise_exceptions=True, show_errors=False)
    except ConnectError:
        return False
    finally:
        host.disconnect()
        del state
    return True


def connects_with_openssh(ssh: dict) -> bool:
    result = subprocess.run(
        [*SshTarget.of(ssh).argv(), "true"], capture_output=True, text=True, timeout=30
    )
    return result.returncode == 0 and result.stdout == "ok\n"


def connects_with_testinfra(ssh: dict, directory: Path) -> bool:
    config = directory / "ssh_config"
    config.write_text(SshTarget.of(ssh).ssh_config("llamarig-rig1"))
    host = testinfra.get_host("ssh://llamarig-rig1", ssh_config=str(config))
    try:
        return host.run("true").rc == 0
    except RuntimeError:
        return False


CLIENTS = ["pyinfra", "openssh", "testinfra"]


def connects(client: str, write_inventory, ssh: dict, directory: Path) -> bool:
    if client == "pyinfra":
        return connects_with_pyinfra(write_inventory, ssh)
    if client == "openssh":
        return connects_with_openssh(ssh)
    return connects_with_testinfra(ssh, directory)


@pytest.mark.parametrize("client", CLIENTS)
def test_strict_connects_only_to_a_known_key(client, keys, server, write_inventory, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    ssh = ssh_settings(keys, server, known_hosts, "strict")
    assert not connects(client, write_inventory, ssh, tmp_path)
    assert known_hosts.read_text() == ""  # nothing was recorded
    known_hosts.write_text(known_line(server, keys[1]))
    assert connects(client, write_inventory, ssh, tmp_path)


@pytest.mark.parametrize("client", CLIENTS)
def test_accept_new_records_a_new_key_once(client, keys, server, write_inventory, tmp_path):
    known_hosts = tmp_path / "known_hosts"  # not there yet: the first contact creates it
    ssh = ssh_settings(keys, server, known_hosts, "accept-new")
    assert connects(client, write_inventory, ssh, tmp_path)
    recorded = paramiko.HostKeys(str(known_hosts))
    assert recorded.lookup(f"[127.0.0.1]:{server.port}")[keys[1].get_name()] == keys[1]
    # Back to strict: the recorded key is the one that is trusted now.
    assert connects(client, write_inventory, {**ssh, "host_key_checking": "strict"}, tmp_path)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("checking", ["strict", "accept-new"])
def test_a_changed_key_is_refused(client, checking, keys, server, write_inventory, tmp_path):
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(known_line(server, keys[2]))  # another key for this host:port
    ssh = ssh_settings(keys, server, known_hosts, checking)
    assert not connects(client, write_inventory, ssh, tmp_path)
    assert known_hosts.read_text() == known_line(server, keys[2])
