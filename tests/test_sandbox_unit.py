"""Fast tests of the sandbox rig's pieces: no root, no systemd-nspawn, no network."""

import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from llamarig import CACHE_DIR, cli
from llamarig_sandbox import containers, layout, processes, roots, sandbox, services, sshaccess
from llamarig_sandbox.fileserver import UnsatisfiableRange, make_server, parse_range
from llamarig_sandbox.testmodel import sha256_file, write_test_model

# --- file server ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("bytes=0-", (0, 99)),
        ("bytes=10-", (10, 99)),
        ("bytes=10-19", (10, 19)),
        ("bytes=90-500", (90, 99)),
        ("bytes=99-99", (99, 99)),
        ("bytes=-5", None),
        ("bytes=0-1,5-6", None),
        ("items=0-5", None),
    ],
)
def test_parse_range(header, expected):
    assert parse_range(header, 100) == expected


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=150-160", "bytes=20-10"])
def test_parse_range_unsatisfiable(header):
    with pytest.raises(UnsatisfiableRange):
        parse_range(header, 100)


@pytest.fixture
def served(tmp_path):
    """A running file server over a directory with one 1000-byte file; yields (port, bytes)."""
    payload = bytes(range(256)) * 3 + bytes(232)
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "blob.bin").write_bytes(payload)
    (tmp_path / "www" / "sub").mkdir()
    (tmp_path / "secret").write_text("outside the root")
    server = make_server(tmp_path / "www", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], payload
    server.shutdown()
    server.server_close()


def _request(port, method, path, headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    connection.request(method, path, headers=headers or {})
    response = connection.getresponse()
    body = response.read()
    connection.close()
    return response, body


def test_get_whole_file(served):
    port, payload = served
    response, body = _request(port, "GET", "/blob.bin")
    assert response.status == 200
    assert body == payload
    assert response.getheader("Accept-Ranges") == "bytes"
    assert response.getheader("Content-Length") == "1000"


def test_get_open_ended_range_resumes(served):
    port, payload = served
    response, body = _request(port, "GET", "/blob.bin", {"Range": "bytes=600-"})
    assert response.status == 206
    assert response.getheader("Content-Range") == "bytes 600-999/1000"
    assert body == payload[600:]


def test_get_closed_range(served):
    port, payload = served
    response, body = _request(port, "GET", "/blob.bin", {"Range": "bytes=10-19"})
    assert response.status == 206
    assert response.getheader("Content-Range") == "bytes 10-19/1000"
    assert body == payload[10:20]


def test_range_past_end_is_416(served):
    port, _ = served
    response, body = _request(port, "GET", "/blob.bin", {"Range": "bytes=1000-"})
    assert response.status == 416
    assert response.getheader("Content-Range") == "bytes */1000"
    assert body == b""


def test_head_has_length_but_no_body(served):
    port, _ = served
    response, body = _request(port, "HEAD", "/blob.bin")
    assert response.status == 200
    assert response.getheader("Content-Length") == "1000"
    assert body == b""


@pytest.mark.parametrize("path", ["/missing", "/sub", "/", "/../secret", "/%2e%2e/secret"])
def test_only_files_inside_the_root_are_served(served, path):
    port, _ = served
    response, _ = _request(port, "GET", path)
    assert response.status == 404


def test_writes_are_refused(served):
    port, _ = served
    response, _ = _request(port, "POST", "/blob.bin")
    assert response.status == 405


# --- sandbox helpers -----------------------------------------------------------------------------

HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample root@debootstrap\n"


def test_known_hosts_line_pins_port_and_drops_comment():
    assert (
        sshaccess.known_hosts_line(HOST_KEY, 2222)
        == "[127.0.0.1]:2222 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample\n"
    )


def test_known_hosts_line_on_port_22_has_no_brackets():
    assert sshaccess.known_hosts_line(HOST_KEY, 22).startswith("127.0.0.1 ssh-ed25519 ")


def test_known_hosts_line_rejects_garbage():
    with pytest.raises(ValueError):
        sshaccess.known_hosts_line("", 2222)


def test_sshd_dropin():
    assert sshaccess.sshd_dropin(2223) == (
        "Port 2223\nListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
    )


def test_a_base_root_gets_a_machine_id_of_its_own(tmp_path):
    """mmdebstrap leaves /etc/machine-id empty: a boot from it would be a first boot."""
    machine_ids = []
    for name in ("first", "second"):
        (tmp_path / name / "etc").mkdir(parents=True)
        (tmp_path / name / "etc/machine-id").write_text("")
        roots._write_machine_id(tmp_path / name)
        machine_ids.append((tmp_path / name / "etc/machine-id").read_text())
    assert all(len(text) == 33 and text.endswith("\n") for text in machine_ids)
    assert all(int(text, 16) for text in machine_ids)
    assert machine_ids[0] != machine_ids[1]


def test_drop_dhcp_stanzas_keeps_loopback_and_static():
    interfaces = (
        "source /etc/network/interfaces.d/*\n"
        "\n"
        "auto lo\n"
        "iface lo inet loopback\n"
        "\n"
        "# The primary network interface\n"
        "allow-hotplug eth0\n"
        "iface eth0 inet dhcp\n"
        "    hostname sandbox\n"
        "iface eth0 inet6 auto\n"
        "auto eth1 eth2\n"
        "iface eth1 inet dhcp\n"
        "iface eth2 inet static\n"
        "    address 10.0.0.2/24\n"
    )
    assert roots.drop_dhcp_stanzas(interfaces) == (
        "source /etc/network/interfaces.d/*\n"
        "\n"
        "auto lo\n"
        "iface lo inet loopback\n"
        "\n"
        "# The primary network interface\n"
        "auto eth2\n"
        "iface eth2 inet static\n"
        "    address 10.0.0.2/24\n"
    )


def test_nspawn_command_binds_caches():
    command = containers.nspawn_command(
        "sandbox-trixie", "trixie", layout.RUN_DIR / "sandbox-trixie"
    )
    assert command[:5] == [
        "systemd-nspawn",
        "--register=no",
        "--keep-unit",
        "--console=passive",
        "-b",
    ]
    assert "--machine=sandbox-trixie" in command
    archives = CACHE_DIR / "sandbox" / "sandbox-trixie" / "apt-archives"
    assert f"--bind={archives}:/var/cache/apt/archives" in command
    assert f"--bind={CACHE_DIR}/ccache/trixie:/var/cache/llamarig/ccache" in command


def test_urls():
    assert services.model_url(8765) == "http://127.0.0.1:8765/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert services.model_url(8765, services.TEST_MODEL_NAME) == (
        "http://127.0.0.1:8765/tiny-llama.gguf"
    )
    assert services.git_url(9418) == "git://127.0.0.1:9418/llama.cpp.git"


def test_main_refuses_non_root(monkeypatch, capsys):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    assert sandbox.main(["status"]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert "root" in error


def test_llamarig_sandbox_runs_the_sandbox_package_under_its_own_name(monkeypatch, capsys):
    """`llamarig sandbox ...` is the sandbox package's command line, named as the user typed it."""
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 1000)
    assert cli.main(["sandbox", "status"]) == 2
    assert capsys.readouterr().err.startswith(
        "llamarig sandbox: error: the sandbox must be managed"
    )


def test_ssh_command_pins_the_host_key_and_offers_only_the_sandbox_key():
    info = sshaccess.SandboxInfo(
        name="sandbox-trixie", release="trixie", ssh_port=2223, key_path="/keys/id_ed25519",
        known_hosts_path="/state/known_hosts", root_dir="/run/sandbox-trixie",
        model_url=services.model_url(8765), model_sha256="0" * 64,
        test_model_url=services.model_url(8765, services.TEST_MODEL_NAME),
        test_model_sha256="1" * 64,
        git_url=services.git_url(9418),
    )  # fmt: skip
    command = sshaccess.ssh_command(info)
    options = {command[i + 1] for i, word in enumerate(command) if word == "-o"}
    assert {
        "StrictHostKeyChecking=yes", "BatchMode=yes", "UserKnownHostsFile=/state/known_hosts",
        "IdentityFile=/keys/id_ed25519", "IdentitiesOnly=yes",
    } <= options  # fmt: skip
    assert command[0] == "ssh" and command[-2:] == ["--", "root@127.0.0.1"]
    assert command[command.index("-p") + 1] == "2223"


def test_main_rejects_bad_name(monkeypatch, capsys):
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    assert sandbox.main(["status", "--name", "Bad/Name"]) == 2
    assert "invalid sandbox name" in capsys.readouterr().err


def test_port_in_use_detects_a_listener():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert processes.port_in_use(port)
    assert not processes.port_in_use(port)


# --- supervisor ----------------------------------------------------------------------------------


def test_supervise_restarts_on_reboot_exit_code(tmp_path, capfd):
    marker = tmp_path / "booted-once"
    # Exits 133 (a reboot) the first time, then 0 (a halt).
    script = f"if [ -e {marker} ]; then exit 0; fi; touch {marker}; exit 133"
    assert containers.supervise(["sh", "-c", script]) == 0
    assert capfd.readouterr().out.count("supervisor: starting") == 2


def test_supervise_returns_other_exit_codes(capfd):
    assert containers.supervise(["sh", "-c", "exit 7"]) == 7


def test_supervisor_passes_sigterm_on_and_stops():
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "llamarig_sandbox.sandbox", "_supervise", "--", "sleep", "60"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert supervisor.stdout.readline().startswith("supervisor: starting sleep 60")
    time.sleep(0.2)
    supervisor.send_signal(signal.SIGTERM)
    # Killed by the signal passed on (143), long before its `sleep 60` would end.
    assert supervisor.wait(timeout=30) == 128 + signal.SIGTERM


# --- working roots -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mem_total_kib", "on_disk", "in_memory"),
    [
        (24_000_000, "", True),
        (24_000_000, "0", True),
        (8_000_000, "", False),
        (24_000_000, "1", False),
    ],
)
def test_working_roots_go_in_memory_only_with_the_memory_and_not_told_otherwise(
    tmp_path, monkeypatch, mem_total_kib, on_disk, in_memory
):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {mem_total_kib} kB\nMemFree:        1000 kB\n")
    monkeypatch.setenv("LLAMARIG_SANDBOX_ROOTS_ON_DISK", on_disk)
    assert roots.roots_in_memory(meminfo) is in_memory


@pytest.mark.parametrize("value", ["yes", "true", " 1", "1; rm -rf /"])
def test_a_roots_on_disk_setting_other_than_0_or_1_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("LLAMARIG_SANDBOX_ROOTS_ON_DISK", value)
    with pytest.raises(processes.SandboxError, match="LLAMARIG_SANDBOX_ROOTS_ON_DISK.*set it to 1"):
        roots.roots_in_memory()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_removing_a_root_on_its_own_tmpfs_unmounts_it(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(root)], check=True)
    (root / "etc").mkdir()
    (root / "etc/hostname").write_text("sandbox-x\n")
    processes.remove_tree(root)
    assert not root.exists()
    assert str(root) not in Path("/proc/self/mounts").read_text()


# --- locks ---------------------------------------------------------------------------------------


@pytest.fixture
def sandbox_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "SANDBOX_DIR", tmp_path / "sandbox")
    monkeypatch.setattr(layout, "RUN_DIR", tmp_path / "run")
    (tmp_path / "run").mkdir()
    return tmp_path


def test_one_sandbox_lock_does_not_hold_up_another_or_the_services(sandbox_dirs):
    holding, release = threading.Event(), threading.Event()

    def hold_a():
        with layout.sandbox_lock("sandbox-a"):
            holding.set()
            release.wait(10)

    holder = threading.Thread(target=hold_a)
    holder.start()
    try:
        assert holding.wait(10)
        entered = []

        def take_others():
            with layout.sandbox_lock("sandbox-b"), layout.services_lock():
                with layout.release_lock("trixie"):
                    entered.append(True)

        other = threading.Thread(target=take_others)
        other.start()
        other.join(5)
        assert entered == [True], "sandbox-b, the services or a release waited for sandbox-a"
    finally:
        release.set()
        holder.join(10)


def test_a_sandbox_whose_up_started_its_supervisor_keeps_the_services(sandbox_dirs):
    # `up` writes the state, then the supervisor's pid file; until the supervisor execs, its
    # command line is still its parent's (this process here), so is_running cannot tell.
    paths = layout.sandbox_paths("sandbox-b")
    paths["state"].parent.mkdir(parents=True)
    paths["pid"].write_text(f"{os.getpid()}\n")
    assert not containers.is_running("sandbox-b")
    assert not containers.up_or_booting("sandbox-b"), "a pid file alone is no sandbox on its way up"
    paths["state"].write_text("{}")
    assert containers.up_or_booting("sandbox-b")
    # Once that process is gone (a sandbox that died without `down`), the services may stop.
    gone = subprocess.Popen(["true"])
    gone.wait()
    paths["pid"].write_text(f"{gone.pid}\n")
    assert not containers.up_or_booting("sandbox-b")


# --- test model ----------------------------------------------------------------------------------


@pytest.fixture
def vocab_gguf(tmp_path):
    """A vocabulary-only GGUF like llama.cpp's models/ggml-vocab-*.gguf, with 8 tokens."""
    path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(["<unk>", "<s>", "</s>", "a", "b", "c", "d", "e"])
    writer.add_token_scores([0.0] * 8)
    writer.add_token_types([2, 3, 3, 1, 1, 1, 1, 1])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_test_model_is_deterministic(tmp_path, vocab_gguf):
    first = write_test_model(tmp_path / "one.gguf", vocab_gguf)
    second = write_test_model(tmp_path / "two.gguf", vocab_gguf)
    assert first == second == sha256_file(tmp_path / "one.gguf")
    assert write_test_model(tmp_path / "other.gguf", vocab_gguf, seed=1) != first
    assert not list(tmp_path.glob("*.partial"))


def test_test_model_has_llama_keys_and_shapes(tmp_path, vocab_gguf):
    write_test_model(tmp_path / "model.gguf", vocab_gguf)
    reader = GGUFReader(tmp_path / "model.gguf")
    fields = {key: field.contents() for key, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["general.file_type"] == 0
    assert fields["llama.block_count"] == 2
    assert fields["llama.embedding_length"] == 128
    assert fields["llama.feed_forward_length"] == 256
    assert fields["llama.attention.head_count"] == 2
    assert fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.dimension_count"] == 64
    assert fields["llama.context_length"] == 2048
    assert fields["tokenizer.ggml.tokens"][3] == "a"
    assert fields["tokenizer.ggml.token_type"][:3] == [2, 3, 3]
    # GGUF shapes are ggml's (ne0 first): llama.cpp wants token_embd as {n_embd, n_vocab}.
    shapes = {tensor.name: [int(n) for n in tensor.shape] for tensor in reader.tensors}
    assert shapes["token_embd.weight"] == [128, 8]
    assert shapes["output.weight"] == [128, 8]
    assert shapes["blk.1.attn_q.weight"] == [128, 128]
    assert shapes["blk.1.ffn_gate.weight"] == [128, 256]
    assert shapes["blk.1.ffn_down.weight"] == [256, 128]
    assert len(shapes) == 3 + 2 * 9
    for tensor in reader.tensors:
        assert np.isfinite(tensor.data).all()
