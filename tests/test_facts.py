"""Parsers of llamarig's pyinfra facts, fed with the output of real commands."""

import base64

from llamarig.facts import FileHead, FirmwareBoot, NvidiaPciDevices, NvidiaSmiGpus, ServerProbe


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
    assert ServerProbe().process(["200", answer]) == {
        "health": 200,
        "completion_ok": True,
        "tokens_per_second": 812.5,
    }
    assert ServerProbe().process(["503"])["completion_ok"] is False


def test_missing_commands_runs_in_a_shell_and_lists_the_missing(tmp_path):
    import subprocess

    from llamarig.facts import MissingCommands

    fact = MissingCommands()
    command = fact.command(["sh", "no-such-tool-llamarig", "git"])
    output = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    assert output.returncode == 0
    assert fact.process(output.stdout.splitlines()) == ["no-such-tool-llamarig"]


def test_running_service_parses_the_main_process():
    import base64

    from llamarig.facts import RunningService

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
