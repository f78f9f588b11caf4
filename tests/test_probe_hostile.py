"""What a probed box prints is hostile input, and so are `init`'s arguments (issue 53, items 5
and 6 and the leftovers about `init` and messages).

- `llamarig init` reads a box that lies: `[N/A]` memory, a GPU name with a comma, escape
  sequences in nvidia-smi's output, in /etc/os-release or in the PCI ids. Each is refused with
  the field and the box named (exit 2, nothing written, no traceback), or, where it is only
  shown (the release's name), shown escaped: no raw ESC reaches the terminal or the entry.
- Every `init` argument is refused before any connection: a `--known-hosts` file without the
  box's key, a `--user` that is not a login name, a `--model` that is not an http(s) URL.
- `llamarig status --watch N` waits its interval when the host does not answer.
- `llamarig tune --for throughput` against a host that does not answer says so.

The box is a stand-in for `subprocess.run`: an ssh command line gets the recorded output of
the command it carries; every call is recorded, so "no connection" is an empty record."""

from __future__ import annotations

import subprocess
import time

import pytest

from llamarig import cli

# github.com's published ed25519 host key: a well-formed key line for a known_hosts file.
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
ADDRESS = "192.0.2.10"  # TEST-NET-1: never routed

UBUNTU = (
    "/etc/os-release\n"
    'PRETTY_NAME="Ubuntu 24.04.3 LTS"\nNAME="Ubuntu"\nVERSION_ID="24.04"\nID=ubuntu\n'
    "VERSION_CODENAME=noble\n---\n"
)
SMI_3090 = "0, 00000000:01:00.0, NVIDIA GeForce RTX 3090, 24576, 8.6, 4, 16, 580.95.05\n"
ESC = "\x1b"


class Box:
    """A stand-in for subprocess.run: ssh command lines are answered from ``replies`` (the
    first key found in the remote command wins), other commands are refused; all recorded."""

    def __init__(self, replies: dict[str, str] | None = None, ssh_fails: str | None = None):
        self.replies = replies or {}
        self.ssh_fails = ssh_fails  # ssh's own failure (exit 255) with this message
        self.calls: list[list[str]] = []

    def __call__(self, argv, *args, **kwargs):
        argv = [str(arg) for arg in argv]
        self.calls.append(argv)
        if argv[0] != "ssh":
            raise AssertionError(f"started {argv!r}")
        if self.ssh_fails is not None:
            return subprocess.CompletedProcess(argv, 255, "", self.ssh_fails + "\n")
        command = argv[-1]
        if command == "true":
            return subprocess.CompletedProcess(argv, 0, "", "")
        for needle, output in self.replies.items():
            if needle in command:
                return subprocess.CompletedProcess(argv, 0, output, "")
        return subprocess.CompletedProcess(argv, 1, "", "")


def smi_box(smi: str = SMI_3090, release: str = UBUNTU, pci: str = "") -> Box:
    return Box({"nvidia-smi --query-gpu": smi, "-release": release, "/sys/bus/pci": pci})


@pytest.fixture
def known_hosts(tmp_path):
    path = tmp_path / "known_hosts"
    path.write_text(f"{ADDRESS} {KEY}\n")
    return path


def run_cli(argv: list[str], box, monkeypatch, capsys) -> tuple[int, str, str]:
    """``llamarig ARGV`` in-process with ``box`` as every process start; (status, out, err)."""
    monkeypatch.setattr(subprocess, "run", box)
    for name in ("Popen", "check_output", "call"):
        monkeypatch.setattr(subprocess, name, box)
    try:
        status = cli.main(argv)
    except SystemExit as stop:
        status = stop.code
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return status, captured.out, captured.err


def init_argv(known_hosts, output, *more: str) -> list[str]:
    return [
        "init", "rig1", "--address", ADDRESS, "--known-hosts", str(known_hosts),
        "--output", str(output), *more,
    ]  # fmt: skip


# --- (a) what the box prints ------------------------------------------------------------------


def refused_probe(smi, known_hosts, tmp_path, monkeypatch, capsys, **box) -> str:
    """init against a box printing ``smi``: exit 2, the box named, nothing written, no ESC."""
    output = tmp_path / "rig.yml"
    status, out, err = run_cli(
        init_argv(known_hosts, output), smi_box(smi, **box), monkeypatch, capsys
    )
    assert status == 2, err
    assert "rig1" in err and ADDRESS in err and "nothing was written" in err, err
    assert ESC not in out + err
    assert not output.exists()
    return err


def test_unknown_memory_is_refused_naming_the_field(known_hosts, tmp_path, monkeypatch, capsys):
    smi = "0, 00000000:01:00.0, NVIDIA H200, [N/A], 9.0, 5, 16, 580.95.05\n"
    err = refused_probe(smi, known_hosts, tmp_path, monkeypatch, capsys)
    assert "memory.total" in err and "'[N/A]'" in err, err


def test_a_gpu_name_with_a_comma_is_refused_naming_the_field(
    known_hosts, tmp_path, monkeypatch, capsys
):
    smi = "0, 00000000:01:00.0, NVIDIA GeForce RTX 3090, Founders, 24576, 8.6, 4, 16, 580.95.05\n"
    err = refused_probe(smi, known_hosts, tmp_path, monkeypatch, capsys)
    assert "name" in err and "comma" in err, err


def test_an_escape_sequence_in_a_gpu_name_is_refused_and_shown_escaped(
    known_hosts, tmp_path, monkeypatch, capsys
):
    smi = (
        f"0, 00000000:01:00.0, NVIDIA {ESC}]0;owned{ESC}\\RTX 3090, 24576, 8.6, 4, 16, 580.95.05\n"
    )
    err = refused_probe(smi, known_hosts, tmp_path, monkeypatch, capsys)
    assert "name" in err and "\\x1b" in err, err


def test_an_escape_sequence_in_the_driver_version_is_refused(
    known_hosts, tmp_path, monkeypatch, capsys
):
    smi = f"0, 00000000:01:00.0, NVIDIA GeForce RTX 3090, 24576, 8.6, 4, 16, 580{ESC}[2J\n"
    err = refused_probe(smi, known_hosts, tmp_path, monkeypatch, capsys)
    assert "driver_version" in err, err


def test_a_bus_id_that_is_not_one_is_refused(known_hosts, tmp_path, monkeypatch, capsys):
    smi = "0, 00000000:01:00.0;reboot, NVIDIA GeForce RTX 3090, 24576, 8.6, 4, 16, 580.95.05\n"
    err = refused_probe(smi, known_hosts, tmp_path, monkeypatch, capsys)
    assert "pci.bus_id" in err, err


def test_an_escape_sequence_in_a_pci_bus_id_is_refused(known_hosts, tmp_path, monkeypatch, capsys):
    pci = f"0000:01:00.0{ESC}[2J 0x2204 0x030000 -\n"
    err = refused_probe("", known_hosts, tmp_path, monkeypatch, capsys, pci=pci)
    assert "bus id" in err and "\\x1b" in err, err


def test_release_files_that_cannot_be_read_are_refused(known_hosts, tmp_path, monkeypatch, capsys):
    # pyinfra writes each release file's basename into a scratch /etc: `..` is a directory.
    release = "/etc/..\nID=ubuntu\n---\n"
    err = refused_probe(SMI_3090, known_hosts, tmp_path, monkeypatch, capsys, release=release)
    assert "release" in err, err


def test_escape_sequences_in_os_release_are_written_and_printed_escaped(
    known_hosts, tmp_path, monkeypatch, capsys
):
    release = (
        "/etc/os-release\n"
        f'PRETTY_NAME="Evil{ESC}[2J{ESC}]0;owned\\a OS \u202eSL"\nID=evil\nVERSION_ID="1"\n---\n'
    )
    output = tmp_path / "rig.yml"
    status, out, err = run_cli(
        init_argv(known_hosts, output), smi_box(release=release), monkeypatch, capsys
    )
    assert status == 0, err
    written = output.read_bytes()
    assert b"\x1b" not in written and "\u202e".encode() not in written
    assert b"Evil\\x1b[2J" in written and b"\\u202e" in written
    assert ESC not in out + err and "\u202e" not in out + err


# --- (b) every argument refused before any connection ------------------------------------------


def refused_argument(argv, monkeypatch, capsys) -> str:
    box = smi_box()
    status, _, err = run_cli(argv, box, monkeypatch, capsys)
    assert status == 2, err
    assert box.calls == [], box.calls  # nothing started: no ssh, no process
    assert "cannot run a command" not in err
    return err


def test_a_known_hosts_file_without_the_box_key_is_refused_before_connecting(
    tmp_path, monkeypatch, capsys
):
    other = tmp_path / "known_hosts"
    other.write_text(f"192.0.2.99 {KEY}\n")
    err = refused_argument(init_argv(other, tmp_path / "rig.yml"), monkeypatch, capsys)
    assert "--known-hosts" in err and ADDRESS in err, err


def test_a_key_for_port_22_is_not_the_key_for_another_port(
    known_hosts, tmp_path, monkeypatch, capsys
):
    argv = init_argv(known_hosts, tmp_path / "rig.yml", "--port", "2222")
    err = refused_argument(argv, monkeypatch, capsys)
    assert "--known-hosts" in err and f"[{ADDRESS}]:2222" in err, err


@pytest.mark.parametrize(
    "user", ["-oProxyCommand=touch /tmp/owned", "root@192.0.2.99", "a b", "", f"r{ESC}[2J"]
)
def test_a_user_that_is_not_a_login_name_is_refused_before_connecting(
    user, known_hosts, tmp_path, monkeypatch, capsys
):
    argv = init_argv(known_hosts, tmp_path / "rig.yml", f"--user={user}")
    err = refused_argument(argv, monkeypatch, capsys)
    assert "--user" in err and ESC not in err, err


@pytest.mark.parametrize(
    "model",
    ["file:///etc/passwd", "ftp://example.org/m.gguf", "example.org/m.gguf", "-x", "https://"],
)
def test_a_model_that_is_not_a_url_is_refused_before_connecting(
    model, known_hosts, tmp_path, monkeypatch, capsys
):
    argv = init_argv(known_hosts, tmp_path / "rig.yml", f"--model={model}", "--sha256=" + "0" * 64)
    err = refused_argument(argv, monkeypatch, capsys)
    assert "--model" in err, err


# --- (c) status --watch against a host that does not answer ------------------------------------

INVENTORY = f"""\
all:
  hosts:
    rig1:
      ssh: {{host: {ADDRESS}, user: root}}
      gpus: [{{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}}]
      model: {{path: /srv/models/m.gguf}}
"""


def test_status_watch_waits_its_interval_when_the_host_does_not_answer(
    tmp_path, monkeypatch, capsys
):
    inventory = tmp_path / "rig.yml"
    inventory.write_text(INVENTORY)
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    bound_s, interval_s = 1.5, 0.3
    started = time.monotonic()
    box = Box(ssh_fails=f"ssh: connect to host {ADDRESS} port 22: Connection refused")

    def unreachable(argv, *args, **kwargs):
        if time.monotonic() - started > bound_s:
            raise KeyboardInterrupt  # the way out of --watch
        return box(argv, *args, **kwargs)

    status, out, err = run_cli(
        ["status", "--watch", str(interval_s)], unreachable, monkeypatch, capsys
    )
    assert status == 130, err
    assert "not reachable" in out
    attempts = len(box.calls)
    # One attempt per interval (and the first at once), not one after another.
    assert 2 <= attempts <= bound_s / interval_s + 2, attempts


# --- (d) tune against a host that does not answer ---------------------------------------------


def test_tune_for_throughput_says_the_host_did_not_answer(tmp_path, monkeypatch, capsys):
    inventory = tmp_path / "rig.yml"
    inventory.write_text(INVENTORY)
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    said = f"ssh: connect to host {ADDRESS} port 22: Connection timed out"
    box = Box(ssh_fails=said)
    status, _, err = run_cli(["tune", "--for", "throughput"], box, monkeypatch, capsys)
    assert status == 1, err
    assert "is not there" not in err and "deploy with" not in err, err
    assert "rig1" in err and ADDRESS in err and "Connection timed out" in err, err
    assert len(box.calls) <= 2, box.calls  # it stops at the first command that fails


# --- `complete` reads what the server answers as hostile ---------------------------------------


@pytest.mark.parametrize(
    "reply",
    [
        "<html>\x1b[2J502 Bad Gateway</html>",
        '["not", "an", "object"]',
        '{"content": 42}',
        '{"content": "ok\\u001b]0;pwned\\u0007", "timings": "fast", "tokens_predicted": "many"}',
    ],
)
def test_complete_shows_a_hostile_reply_escaped_never_a_traceback(
    reply, tmp_path, monkeypatch, capsys
):
    inventory = tmp_path / "rig.yml"
    inventory.write_text(INVENTORY)
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    box = Box({"/completion": reply})
    status, out, err = run_cli(["complete", "--tokens", "4"], box, monkeypatch, capsys)
    assert ESC not in out + err and "\x07" not in out + err
    if reply.startswith('{"content": "ok'):  # an answer, its odd numbers left out
        assert status == 0, err
        assert "ok\\x1b]0;pwned\\x07" in out and "None tokens at 0.0 tokens/s" in out
    else:
        assert status == 1 and "no answer in the reply" in err, err


def test_complete_refuses_an_rpc_worker_before_sending_anything(tmp_path, monkeypatch, capsys):
    # A worker runs no llama-server: whatever listens at its server.port must not get a key.
    inventory = tmp_path / "rig.yml"
    inventory.write_text(
        f"""\
all:
  hosts:
    worker:
      role: rpc-worker
      ssh: {{host: {ADDRESS}, user: root}}
      rpc: {{host: 10.0.0.12}}
      llama_cpp: {{backend: cpu}}
"""
    )
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    box = Box()
    status, _, err = run_cli(["complete"], box, monkeypatch, capsys)
    assert status == 2 and "worker is an rpc-worker" in err, err
    assert box.calls == []


# --- the planner reads the same facts as hostile (plan --probe, the deploy, verify, tune) ------


def plan_probe(smi: str, tmp_path, monkeypatch, capsys, pci: str = "") -> tuple[int, str, str]:
    inventory = tmp_path / "rig.yml"
    inventory.write_text(INVENTORY)
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    box = Box({"nvidia-smi --query-gpu": smi, "-release": UBUNTU, "/sys/bus/pci": pci})
    status, out, err = run_cli(["plan", "--probe"], box, monkeypatch, capsys)
    assert ESC not in out + err, ascii(out + err)
    return status, out, err


@pytest.mark.parametrize(
    "smi, said",
    [
        (SMI_3090.replace("24576", "[N/A]"), "nvidia-smi's memory.total is '[N/A]', not a number"),
        (
            SMI_3090.replace("RTX 3090", "RTX 3090, Ti"),
            "nvidia-smi --query-gpu printed 9 comma-separated",
        ),
        (SMI_3090.replace("00000000:01:00.0", "0;reboot"), "nvidia-smi's pci.bus_id is '0;reboot'"),
    ],
)
def test_plan_probe_sets_aside_what_nvidia_smi_printed_that_is_not_a_gpu(
    smi, said, tmp_path, monkeypatch, capsys
):
    # No traceback: the plan stands on the PCI ids (none here) and the declared GPUs, and says
    # why it did not use nvidia-smi.
    status, out, err = plan_probe(smi, tmp_path, monkeypatch, capsys)
    assert status in (0, 3), err  # fits, or provisional without the model's header
    assert f"rig1: nvidia-smi not used: {said}" in err, err


def test_plan_probe_shows_a_gpu_name_with_an_escape_sequence_escaped(tmp_path, monkeypatch, capsys):
    smi = SMI_3090.replace("RTX 3090", "RTX 3090\x1b[2J\x1b]0;owned\x07")
    status, out, err = plan_probe(smi, tmp_path, monkeypatch, capsys)
    assert "RTX 3090\\x1b[2J\\x1b]0;owned\\x07" in out + err, out + err
    assert "\x07" not in out + err
