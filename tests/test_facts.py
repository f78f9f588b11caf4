"""Parsers of llamarig's pyinfra facts, fed with the output of real commands."""

import base64
import hashlib
import http.server
import json
import os
import re
import subprocess
import threading
import time

import pytest
from pyinfra.api import FactBase

from llamarig.facts.apt import AptListsAge, PackageVersions
from llamarig.facts.build import BuildDirectories, MissingCommands
from llamarig.facts.cache import Batch, parse_one
from llamarig.facts.driver import FirmwareBoot
from llamarig.facts.files import FileHead, FileState, JsonFile
from llamarig.facts.gpu import HostOutputError, NvidiaPciDevices, NvidiaSmiGpus
from llamarig.facts.server import ServerProbe
from llamarig.facts.systemd import UnitState
from llamarig.onhost.hostpaths import BUILD_COMPLETE_MARKER, CURL_AUTH
from llamarig.onhost.httpbounds import HttpTimeouts
from tests.conftest import default_http_timeouts


def test_nvidia_smi_gpus():
    output = [
        "0, 00000000:01:00.0, NVIDIA GeForce RTX 3090, 24576, 8.6, 4, 8, 580.95.05",
        "1, 00000000:07:00.0, NVIDIA GeForce RTX 5080, 16303, 12.0, 4, 8, 580.95.05",
    ]
    gpus = NvidiaSmiGpus().process(output)
    assert gpus[1] == {
        "index": 1,
        "bus_id": "00000000:07:00.0",
        "name": "NVIDIA GeForce RTX 5080",
        "vram_mib": 16303,
        "compute_capability": "12.0",
        "pcie_gen": "4",
        "pcie_width": "8",
        "driver_version": "580.95.05",
    }
    assert NvidiaSmiGpus().process(["NVIDIA-SMI has failed", "FAILED"]) is None


def test_nvidia_pci_devices():
    output = ["0000:01:00.0 0x2204 0x030000 nvidia", "0000:07:00.0 0x2c02 0x030000 -"]
    devices = NvidiaPciDevices().process(output)
    assert devices[0]["driver"] == "nvidia" and devices[1]["driver"] is None
    assert devices[1]["device_id"] == "0x2c02"


def test_firmware_boot():
    assert FirmwareBoot().process(["uefi", "   1"]) == {"uefi": True, "secure_boot": True}
    assert FirmwareBoot().process(["bios", "unknown"]) == {"uefi": False, "secure_boot": None}


def test_file_head_decodes_base64():
    data = b"GGUF\x03\x00\x00\x00" + bytes(range(200))
    assert FileHead().process([base64.b64encode(data).decode()]) == data
    assert FileHead().process([]) is None


def test_server_probe():
    answer = '{"content": " hi", "timings": {"predicted_per_second": 812.5}}'
    assert ServerProbe().process(["200", "slots 2 1", answer]) == {
        "health": 200,
        "slots": 2,
        "busy": 1,
        "completion_ok": True,
        "loaded": True,
        "tokens_per_second": 812.5,
    }
    # A router with no model loaded: no completion sent, the check passes on /health.
    idle = ServerProbe().process(["200", "slots 0 0", "unloaded"])
    assert idle["loaded"] is False and idle["completion_ok"] is None
    assert ServerProbe().process(["503", "slots 0 0"])["completion_ok"] is False
    assert ServerProbe().process(["200", "slots 2 2", "busy"])["completion_ok"] is None


HANG_S = 30


class _Llama(http.server.BaseHTTPRequestHandler):
    """A stand-in of llama-server's /health, /slots and /completion: ``busy`` slots of 2 are
    processing (one holds a prompt that tries to fake the pattern), ``hung`` answers nothing."""

    busy, hung, completions = 0, False, []

    def do_GET(self):  # noqa: N802 (http.server's name)
        if _Llama.hung:
            time.sleep(HANG_S)
        slots = [
            {"id": n, "is_processing": n < _Llama.busy, "prompt": '"is_processing":false'}
            for n in range(2)
        ]
        body = json.dumps(slots, separators=(",", ":")) if self.path == "/slots" else '{"ok":1}'
        self._send(body)

    def do_POST(self):  # noqa: N802
        _Llama.completions.append(self.path)
        self._send('{"content":" hi","timings":{"predicted_per_second":99.5}}')

    def _send(self, body: str):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.fixture
def llama_stand_in():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Llama)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Llama.busy, _Llama.hung, _Llama.completions = 0, False, []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _probe(base_url: str, timeouts: HttpTimeouts | None = None) -> dict:
    timeouts = timeouts or default_http_timeouts()
    command = ServerProbe().command(base_url, timeouts).replace(CURL_AUTH, "")
    run = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    return ServerProbe().process(run.stdout.splitlines())


def test_the_probe_completes_only_when_a_slot_is_idle(llama_stand_in):
    _Llama.busy = 1
    probe = _probe(llama_stand_in)
    assert (probe["slots"], probe["busy"], probe["completion_ok"]) == (2, 1, True)
    assert _Llama.completions == ["/completion"]
    _Llama.busy = 2  # every slot serves a user: a completion would wait behind them
    probe = _probe(llama_stand_in)
    assert (probe["health"], probe["busy"], probe["completion_ok"]) == (200, 2, None)
    assert _Llama.completions == ["/completion"], "no completion sent while every slot is busy"


def test_a_hung_server_fails_the_probe_within_its_bound(llama_stand_in):
    _Llama.hung = True
    started = time.monotonic()
    probe = _probe(llama_stand_in, HttpTimeouts(connect=1, probe=1, answer=1, generation=1))
    elapsed = time.monotonic() - started
    assert probe["health"] == 0 and probe["completion_ok"] is False
    # Three requests of at most 1 s each, where an unbounded one would wait out the hang.
    assert elapsed < HANG_S, elapsed


def test_missing_commands_runs_in_a_shell_and_lists_the_missing(tmp_path):
    import subprocess

    from llamarig.facts.build import MissingCommands

    fact = MissingCommands()
    command = fact.command(["sh", "no-such-tool-llamarig", "git"])
    output = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert output.returncode == 0
    assert fact.process(output.stdout.splitlines()) == ["no-such-tool-llamarig"]


def test_running_service_parses_the_main_process():
    import base64

    from llamarig.facts.server import RunningService

    def encoded(items):
        return base64.b64encode("\0".join(items).encode() + b"\0").decode()

    output = [
        "812",
        "no",
        "/opt/llamarig/builds/abc/bin/llama-server",
        "1764520000",
        encoded(["/opt/llamarig/current/bin/llama-server", "-m", "/m.gguf", "-c", "2048"]),
        encoded(["HOME=/var/lib/llama-server", "A=b=c"]),
        "1764519000",
    ]
    running = RunningService().process(output)
    assert running == {
        "pid": 812,
        "need_daemon_reload": False,
        "exe": "/opt/llamarig/builds/abc/bin/llama-server",
        "started": 1764520000,
        "cmdline": ["/opt/llamarig/current/bin/llama-server", "-m", "/m.gguf", "-c", "2048"],
        "environ": {"HOME": "/var/lib/llama-server", "A": "b=c"},
        "model_mtime": 1764519000,
    }
    assert RunningService().process([]) is None
    # An empty argument is kept: dropping it made a server run with `extra_args: [--x, ""]`
    # differ from its unit on every run, so each converge restarted it.
    output[4] = encoded(["/bin/llama-server", "--chat-template", "", "-c", "2048"])
    assert RunningService().process(output)["cmdline"] == [
        "/bin/llama-server",
        "--chat-template",
        "",
        "-c",
        "2048",
    ]


def _fact_output(fact, **arguments) -> list[str]:
    result = subprocess.run(
        ["sh", "-c", fact.command(**arguments)], capture_output=True, text=True, check=True
    )
    return result.stdout.splitlines()


def test_build_directories_newest_first_and_none_on_a_fresh_host(tmp_path):
    builds = tmp_path / "builds"
    for age, name in ((200, "old-build"), (100, "new-build"), (300, "unfinished")):
        (builds / name).mkdir(parents=True)
        os.utime(builds / name, (1_700_000_000 - age, 1_700_000_000 - age))
    os.utime(builds / "old-build", (1_700_000_000, 1_700_000_000))  # marker-less: dir mtime
    marker = builds / "new-build" / BUILD_COMPLETE_MARKER
    marker.write_text("")
    os.utime(marker, (1_800_000_000, 1_800_000_000))
    fact = BuildDirectories()
    assert fact.process(_fact_output(fact, path=str(builds))) == [
        "new-build",
        "old-build",
        "unfinished",
    ]
    # pyinfra gives a fact with no output its default: an empty list, not None
    assert _fact_output(fact, path=str(tmp_path / "absent")) == []
    assert fact.default() == []


def test_package_versions_queries_only_the_named_packages():
    fact = PackageVersions()
    command = fact.command(packages=["dpkg", "no-such-package-llamarig"])
    assert command.startswith("dpkg-query -W ") and "dpkg -l" not in command
    assert command.split(" -- ", 1)[1].startswith("dpkg no-such-package-llamarig")
    versions = fact.process(_fact_output(fact, packages=["dpkg", "no-such-package-llamarig"]))
    assert re.fullmatch(r"\d[\w.+~-]*", versions["dpkg"])
    assert versions.get("no-such-package-llamarig") is None


def test_package_versions_reads_installed_held_and_removed_states():
    output = ["cmake ii  3.31.6-2", "ninja-build hi  1.12.1-1", "nvidia-driver rc  580.95.05-1"]
    assert PackageVersions().process(output) == {
        "cmake": "3.31.6-2",
        "ninja-build": "1.12.1-1",
        "nvidia-driver": None,
    }


def test_unit_state_shows_one_unit_never_all():
    command = UnitState().command(unit="llama-server.service")
    assert "'*'" not in command and "--all" not in command
    assert command.startswith("systemctl show -p Id -p ActiveState")
    assert "-- llama-server.service" in command
    output = [
        "Id=llama-server.service",
        "ActiveState=active",
        "SubState=running",
        "UnitFileState=enabled",
        "NeedDaemonReload=no",
    ]
    assert UnitState().process(output) == {
        "active": True,
        "sub_state": "running",
        "enabled": True,
        "need_daemon_reload": False,
    }
    assert UnitState().default() == {
        "active": False,
        "sub_state": "",
        "enabled": False,
        "need_daemon_reload": False,
    }


def test_file_state_mode_and_sha256_in_one_command(tmp_path):
    path = tmp_path / "unit's file"
    path.write_bytes(b"[Unit]\n")
    path.chmod(0o640)
    fact = FileState()
    assert fact.process(_fact_output(fact, path=str(path))) == {
        "mode": 640,
        "sha256": hashlib.sha256(b"[Unit]\n").hexdigest(),
    }
    assert fact.process(_fact_output(fact, path=str(tmp_path / "missing"))) is None


def test_batch_gives_each_fact_what_its_own_command_gives(tmp_path):
    path = tmp_path / "env"
    path.write_text("LLAMA_ARG_CTX=2048\n")
    requests = (
        (FileState, (("path", str(path)),)),
        (MissingCommands, (("commands", ["sh", "no-such-command-llamarig"]),)),
        (FileState, (("path", str(tmp_path / "missing")),)),
    )
    outputs = Batch().process(_fact_output(Batch(), requests=requests))
    alone = [
        FileState().process(_fact_output(FileState(), path=str(path))),
        ["no-such-command-llamarig"],
    ]
    assert [parse_one(cls, dict(args), outputs[i]) for i, (cls, args) in enumerate(requests)] == [
        *alone,
        None,
    ]


class FailingFact(FactBase):
    def command(self) -> str:
        return "echo partial; exit 3"


def test_batch_leaves_out_a_fact_whose_command_fails(tmp_path):
    requests = ((FailingFact, ()), (JsonFile, (("path", str(tmp_path / "none.json")),)))
    outputs = Batch().process(_fact_output(Batch(), requests=requests))
    assert 0 not in outputs
    assert parse_one(JsonFile, dict(requests[1][1]), outputs[1]) is None


def test_apt_lists_age_from_the_stamp():
    fact = AptListsAge()
    assert "update-success-stamp" in fact.command()
    assert fact.process(["42"]) == 42
    assert fact.process([]) is None


@pytest.mark.parametrize(
    "fact, line, said",
    [
        (NvidiaSmiGpus, "0, 00000000:01:00.0, RTX 3090, [N/A], 8.6, 4, 16, 580.95.05", "[N/A]"),
        (NvidiaSmiGpus, "0, 00000000:01:00.0, RTX, 3090, 24576, 8.6, 4, 16, 580.95.05", "9 "),
        (NvidiaSmiGpus, "0, 0;reboot, RTX 3090, 24576, 8.6, 4, 16, 580.95.05", "0;reboot"),
        (NvidiaSmiGpus, "\x1b[2J, 00000000:01:00.0, RTX 3090, 24576, 8.6, 4, 16, 5", "\\x1b[2J"),
        (NvidiaPciDevices, "0000:01:00.0 0x2204 0x030000", "3 fields"),
        (NvidiaPciDevices, "0000:01:00.0\x1b[2J 0x2204 0x030000 nvidia", "\\x1b[2J"),
    ],
)
def test_gpu_facts_refuse_what_is_not_a_gpu_naming_it_escaped(fact, line, said):
    with pytest.raises(HostOutputError) as refused:
        fact().process([line])
    assert said in str(refused.value) and "\x1b" not in str(refused.value)
