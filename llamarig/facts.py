"""pyinfra facts llamarig reads from a host. Each is one shell command and a pure parser."""

from __future__ import annotations

import base64
import json
import re
import shlex

from pyinfra.api import FactBase

from llamarig.render import BUILD_COMPLETE_MARKER, CURL_AUTH


class NvidiaPciDevices(FactBase):
    """NVIDIA display/3D controllers on the PCI bus, read from sysfs (works before any driver).

    .. code:: python

        [{"bus_id": "0000:01:00.0", "device_id": "0x2204", "class": "0x030000",
          "driver": "nvidia"}]
    """

    default = list

    def command(self) -> str:
        return (
            "for dev in /sys/bus/pci/devices/*; do "
            '[ "$(cat $dev/vendor 2>/dev/null)" = 0x10de ] || continue; '
            'case "$(cat $dev/class)" in 0x03*) ;; *) continue;; esac; '
            'driver=-; [ -e $dev/driver ] && driver=$(basename "$(readlink $dev/driver)"); '
            'echo "$(basename $dev) $(cat $dev/device) $(cat $dev/class) $driver"; '
            "done"
        )

    def process(self, output):
        devices = []
        for line in output:
            bus_id, device_id, device_class, driver = line.split()
            devices.append(
                {
                    "bus_id": bus_id,
                    "device_id": device_id,
                    "class": device_class,
                    "driver": None if driver == "-" else driver,
                }
            )
        return devices


NVIDIA_SMI_FIELDS = (
    "index",
    "pci.bus_id",
    "name",
    "memory.total",
    "compute_cap",
    "pcie.link.gen.current",
    "pcie.link.width.current",
    "driver_version",
)


class NvidiaSmiGpus(FactBase):
    """GPUs as the loaded NVIDIA driver reports them, in nvidia-smi (PCI bus) order.

    An empty list when nvidia-smi is missing; None when it is present but cannot talk to the
    driver (not loaded, or a version mismatch after an upgrade without reboot).
    """

    default = list

    def requires_command(self) -> str:
        return "nvidia-smi"

    def command(self) -> str:
        fields = ",".join(NVIDIA_SMI_FIELDS)
        return f"nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits || echo FAILED"

    def process(self, output):
        if any(line.strip() == "FAILED" for line in output):
            return None
        return [parse_nvidia_smi_line(line) for line in output if line.strip()]


def parse_nvidia_smi_line(line: str) -> dict:
    values = [value.strip() for value in line.split(",")]
    record = dict(zip(NVIDIA_SMI_FIELDS, values, strict=True))
    return {
        "index": int(record["index"]),
        "bus_id": record["pci.bus_id"],
        "name": record["name"],
        "vram_mib": int(record["memory.total"]),
        "compute_capability": record["compute_cap"],
        "pcie_gen": record["pcie.link.gen.current"],
        "pcie_width": record["pcie.link.width.current"],
        "driver_version": record["driver_version"],
    }


class FirmwareBoot(FactBase):
    """Boot mode and Secure Boot state: {"uefi": bool, "secure_boot": True|False|None}."""

    # The SecureBoot EFI variable: 4 attribute bytes, then one data byte (1 = enabled).
    EFIVAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"

    def command(self) -> str:
        return (
            "if [ -d /sys/firmware/efi ]; then echo uefi; else echo bios; fi; "
            f"if [ -r {self.EFIVAR} ]; then od -An -t u1 -j 4 -N 1 {self.EFIVAR}; "
            "else echo unknown; fi"
        )

    def process(self, output):
        lines = [line.strip() for line in output]
        state = lines[1] if len(lines) > 1 else "unknown"
        return {
            "uefi": lines[0] == "uefi",
            "secure_boot": None if state == "unknown" else state == "1",
        }


class JsonFile(FactBase):
    """The parsed content of a JSON file, or None when it is missing or not valid JSON."""

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then cat {quoted}; else echo null; fi"

    def process(self, output):
        try:
            return json.loads("\n".join(output))
        except json.JSONDecodeError:
            return None


class FileSha256(FactBase):
    """The sha256 of a regular file, or None when there is none.

    pyinfra's Sha256File matches ``sha256sum PATH``'s line against the path, and GNU sha256sum
    escapes a name holding a backslash there (``\\HASH  a\\\\b``): such a file never matched,
    so a model named that way was downloaded again on every run. From stdin there is no name.
    """

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then sha256sum < {quoted}; fi"

    def process(self, output):
        digest = "".join(output).split(" ", 1)[0].strip()
        return digest if re.fullmatch(r"[0-9a-f]{64}", digest) else None


class ServerProbe(FactBase):
    """Health and one short completion of a running llama-server, from the host itself.

    .. code:: python

        {"health": 200, "completion_ok": True, "tokens_per_second": 812.4}
    """

    def command(self, base_url: str) -> str:
        body = shlex.quote('{"prompt": "Hello", "n_predict": 4, "temperature": 0}')
        health, completion = (
            shlex.quote(f"{base_url}/health"),
            shlex.quote(f"{base_url}/completion"),
        )
        return (
            f"curl -s -o /dev/null -w '%{{http_code}}\\n' -- {health} || echo 000; "
            f"curl -sf {CURL_AUTH} -H 'Content-Type: application/json' -d {body} "
            f"-- {completion} || true"
        )

    def process(self, output):
        lines = list(output)
        health = int(lines[0]) if lines and lines[0].strip().isdigit() else 0
        try:
            answer = json.loads("\n".join(lines[1:])) if len(lines) > 1 else None
        except json.JSONDecodeError:
            answer = None
        completion_ok = isinstance(answer, dict) and "content" in answer
        timings = (answer or {}).get("timings", {}) if completion_ok else {}
        return {
            "health": health,
            "completion_ok": completion_ok,
            "tokens_per_second": timings.get("predicted_per_second"),
        }


class FileHead(FactBase):
    """The first ``size`` bytes of a file (a model's GGUF header), or None when it is missing."""

    def command(self, path: str, size: int) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then head -c {int(size)} {quoted} | base64 -w0; echo; fi"

    def process(self, output):
        text = "".join(output).strip()
        return base64.b64decode(text) if text else None


class MissingCommands(FactBase):
    """The commands of ``commands`` that are not on the host's PATH.

    .. code:: python

        ["ninja"]
    """

    def command(self, commands: list[str]) -> str:
        return (
            "for c in "
            + " ".join(shlex.quote(c) for c in commands)
            + ('; do command -v "$c" >/dev/null 2>&1 || echo "$c"; done; true')
        )

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]


class BuildDirectories(FactBase):
    """Build directories under ``path``, newest first (by their completion marker, else the
    directory itself).

    .. code:: python

        ["0c1e57098bba-1a2b3c4d5e", "b8f2e1a0c9d7-5e4d3c2b1a"]
    """

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return (
            f"[ -d {quoted} ] && for d in {quoted}/*/; do d=${{d%/}}; "
            f'[ -d "$d" ] || continue; m="$d/{BUILD_COMPLETE_MARKER}"; [ -e "$m" ] || m="$d"; '
            'echo "$(stat -c %Y "$m") ${d##*/}"; done | sort -rn; true'
        )

    def process(self, output: list[str]) -> list[str]:
        return [line.split(" ", 1)[1] for line in output if " " in line.strip()]


class RunningService(FactBase):
    """What a systemd service's main process runs now, to tell whether it predates its inputs
    (a run interrupted between writing the unit and restarting leaves exactly that). None when
    the service has no main process.

    .. code:: python

        {"pid": 812, "exe": "/opt/llamarig/builds/0c1e57098bba-1a2b3c4d5e/bin/llama-server",
         "started": 1764520000, "need_daemon_reload": False,
         "cmdline": ["/opt/llamarig/current/bin/llama-server", "-m", "..."],
         "environ": {"HOME": "/var/lib/llama-server"}, "model_mtime": 1764519000}
    """

    def command(self, service: str, model: str) -> str:
        quoted = shlex.quote(service)
        return (
            f"pid=$(systemctl show -P MainPID {quoted} 2>/dev/null); "
            '[ "${pid:-0}" -gt 0 ] 2>/dev/null || exit 0; '
            f"echo $pid; systemctl show -P NeedDaemonReload {quoted}; "
            'readlink "/proc/$pid/exe"; stat -c %Y "/proc/$pid"; '
            'base64 -w0 "/proc/$pid/cmdline"; echo; base64 -w0 "/proc/$pid/environ"; echo; '
            f"stat -c %Y {shlex.quote(model)} 2>/dev/null || echo 0"
        )

    def process(self, output: list[str]) -> dict | None:
        lines = [line.strip() for line in output]
        if len(lines) < 7:
            return None
        pid, reload, exe, started, cmdline, environ, model_mtime = lines[:7]

        def nul_list(encoded: str) -> list[str]:
            # Each item ends in a NUL: only the last one is a terminator, not an empty item (an
            # empty argument such as `--chat-template ""` is one).
            text = base64.b64decode(encoded).decode()
            return text.removesuffix("\0").split("\0") if text else []

        return {
            "pid": int(pid),
            "need_daemon_reload": reload == "yes",
            "exe": exe,
            "started": int(started),
            "cmdline": nul_list(cmdline),
            "environ": dict(item.split("=", 1) for item in nul_list(environ) if "=" in item),
            "model_mtime": int(model_mtime),
        }
