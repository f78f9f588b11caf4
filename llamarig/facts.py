"""pyinfra facts llamarig reads from a host. Each is one shell command and a pure parser."""

from __future__ import annotations

import base64
import json
import re
import shlex
from collections.abc import Callable
from typing import Any

from pyinfra.api import FactBase

from llamarig import checksums, driver_build
from llamarig.hostpaths import (
    APT_UPDATE_STAMP,
    BUILD_COMPLETE_MARKER,
    CURL_AUTH,
    DRIVER_BUILD_FAILURE_PATH,
)
from llamarig.httpbounds import HttpTimeouts

# A reader answers a pyinfra fact for the host: ``reader(FactClass, **arguments)``, as
# ``pyinfra.host.get_fact`` does in a deploy.
Reader = Callable[..., Any]


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
        # mokutil --sb-state answers where the variable cannot be read (an efivarfs that
        # hides it), and says "SecureBoot enabled" / "SecureBoot disabled".
        return (
            "if [ -d /sys/firmware/efi ]; then echo uefi; else echo bios; fi; "
            f"if [ -r {self.EFIVAR} ]; then od -An -t u1 -j 4 -N 1 {self.EFIVAR}; "
            "elif command -v mokutil >/dev/null 2>&1; then "
            "mokutil --sb-state 2>/dev/null | grep -o -m1 'SecureBoot [a-z]*' || echo unknown; "
            "else echo unknown; fi"
        )

    def process(self, output):
        lines = [line.strip() for line in output]
        state = lines[1] if len(lines) > 1 else "unknown"
        states = {"1": True, "0": False, "SecureBoot enabled": True, "SecureBoot disabled": False}
        secure_boot = states.get(state)
        return {"uefi": lines[0] == "uefi", "secure_boot": secure_boot}


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


class RecordedSha256(FactBase):
    """The sha256 an earlier check recorded for a file, while the file is unchanged since
    (``llamarig.checksums``); reads the file's identity and its record, never the file.

    None when there is no regular file; else ``{"sha256": DIGEST}``, or ``{"sha256": None}``
    when there is no record, or the file's identity (device, inode, size, mtime, ctime) is no
    longer the recorded one.

    .. code:: python

        {"sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
    """

    def command(self, path: str, records: str = checksums.RECORD_DIRECTORY) -> str:
        return checksums.read_command(path, records)

    def process(self, output):
        return checksums.trusted_sha256(list(output))


class FileIdentity(FactBase):
    """A regular file's identity (device, inode, size, mtime and ctime with nanoseconds,
    ``llamarig.checksums.IDENTITY_FORMAT``), or None when there is none; reads no byte of it.

    .. code:: python

        "2049 1835012 8540775808 1764590400.123456789 1764590400.223456789"
    """

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then {checksums.identity_command(path)}; fi"

    def process(self, output):
        line = " ".join(output).strip()
        return line or None


def slot_counts_command(base_url: str, timeouts: HttpTimeouts, models: tuple[str, ...] = ()) -> str:
    """Shell lines that set $total and $busy to the server's slots and those processing a
    request (llama-server's /slots, with the API key where one is set; 0 0 without an answer
    within the probe bound) and print them as `slots TOTAL BUSY`. Counted, not printed: a
    slot's state holds users' prompts, and inside JSON strings a quote is escaped, so a prompt
    cannot fake the pattern.

    ``models``: a router's model names; each loaded one's slots are counted (``autoload=false``:
    asking never loads a model), and $probe is set to a 4-token completion body for the first
    with an idle slot."""
    count = (
        'total=$((total + $(printf %s "$slots" | grep -o \'"is_processing":[a-z]*\' | wc -l))); '
        'busy=$((busy + $(printf %s "$slots" | grep -o \'"is_processing":true\' | wc -l))); '
    )
    probe_curl = timeouts.curl("probe")
    if not models:
        slots = shlex.quote(f"{base_url}/slots")
        fetch = f"slots=$({probe_curl} -f {CURL_AUTH} -- {slots}) || slots=; "
        return f"total=0; busy=0; {fetch}{count}" + 'echo "slots $total $busy"'
    lines = ["total=0; busy=0; probe=; "]
    for name in models:
        slots = shlex.quote(f"{base_url}/slots?model={name}&autoload=false")
        body = shlex.quote(json.dumps({"model": name, **PROBE_COMPLETION}))
        lines.append(
            f"if slots=$({probe_curl} -f {CURL_AUTH} -- {slots}); then before=$busy; {count}"
            f'if [ -z "$probe" ] && [ $((busy - before)) -lt "$(printf %s "$slots" | '
            f'grep -o \'"is_processing":[a-z]*\' | wc -l)" ]; then probe={body}; fi; fi; '
        )
    return "".join(lines) + 'echo "slots $total $busy"'


# The probe's completion: 4 greedy tokens.
PROBE_COMPLETION = {"prompt": "Hello", "n_predict": 4, "temperature": 0}


def parse_slot_counts(line: str) -> tuple[int, int]:
    """(total, busy) from `slot_counts_command`'s line; (0, 0) when it is not one."""
    words = line.split()
    if len(words) == 3 and words[0] == "slots" and words[1].isdigit() and words[2].isdigit():
        return int(words[1]), int(words[2])
    return 0, 0


class ServerProbe(FactBase):
    """Health, the slots' state and, only when a slot is idle, one short completion of a
    running llama-server, from the host itself. Each request is bounded (``timeouts``: the
    rig's server.http_timeouts, connect and probe), and the completion is not sent while every
    slot serves a user (it would wait behind them): ``completion_ok`` is then None.

    .. code:: python

        {"health": 200, "slots": 2, "busy": 0, "completion_ok": True, "tokens_per_second": 812.4}
    """

    def command(self, base_url: str, timeouts: HttpTimeouts, models: tuple[str, ...] = ()) -> str:
        """``models``: a router's model names (the completion goes to a loaded one with an
        idle slot; none loaded prints ``unloaded``)."""
        probe_curl = timeouts.curl("probe")
        body = '"$probe"' if models else shlex.quote(json.dumps(PROBE_COMPLETION))
        health, completion = (
            shlex.quote(f"{base_url}/{path}") for path in ("health", "completion")
        )
        unloaded = 'elif [ -z "$probe" ]; then echo unloaded; ' if models else ""
        return (
            f"{probe_curl} -o /dev/null -w '%{{http_code}}\\n' -- {health} || echo 000; "
            f"{slot_counts_command(base_url, timeouts, tuple(models))}; "
            'if [ "$total" -gt 0 ] && [ "$busy" -ge "$total" ]; then echo busy; '
            f"{unloaded}else "
            f"{probe_curl} -f {CURL_AUTH} -H 'Content-Type: application/json' -d {body} "
            f"-- {completion} || true; fi"
        )

    def process(self, output):
        lines = list(output)
        health = int(lines[0]) if lines and lines[0].strip().isdigit() else 0
        total, busy = parse_slot_counts(lines[1]) if len(lines) > 1 else (0, 0)
        rest = "\n".join(lines[2:])
        try:
            answer = json.loads(rest) if rest and rest not in ("busy", "unloaded") else None
        except json.JSONDecodeError:
            answer = None
        waiting = rest in ("busy", "unloaded")
        completion_ok = None if waiting else isinstance(answer, dict) and "content" in answer
        timings = (answer or {}).get("timings", {}) if completion_ok else {}
        return {
            "health": health,
            "slots": total,
            "busy": busy,
            "completion_ok": completion_ok,
            "loaded": rest != "unloaded",
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


class UrlHead(FactBase):
    """The first ``size`` bytes of a URL as the host reads it (a model's GGUF header, where
    the host reaches the model and this machine does not), or None: no curl, no answer, or an
    error status. ``header_file``: a root-only file of request headers (the Hub token), sent
    when it exists; give it only for a URL it belongs to (``reference.sends_hub_token``: the
    Hub endpoint's), never for another host's. curl follows redirects (``-L``) but without
    ``--location-trusted``, so it drops the file's Authorization line on a redirect to another
    host, scheme or port (the Hub's CDN gets none), as the Hub client does."""

    def command(self, url: str, size: int, header_file: str | None = None) -> str:
        auth = ""
        if header_file:
            quoted = shlex.quote(header_file)
            auth = f"$([ -r {quoted} ] && printf '%s' '-H @'{quoted})"
        return (
            "command -v curl >/dev/null && "
            f"curl -sS -f -L --connect-timeout 5 --max-time 60 -r 0-{int(size) - 1} {auth} "
            f"-- {shlex.quote(url)} | head -c {int(size)} | base64 -w0; echo"
        )

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

    # A fresh host has no builds directory: empty output, and pyinfra then takes the default.
    default = list

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


class MeasuredOverheads(FactBase):
    """The per-GPU overheads the deploy measured after starting each build in each split mode
    (files ``BUILD.MODE`` in ``path``, each the MiB beyond llama.cpp's buffers per used GPU).

    .. code:: python

        {("0c1e57098bba-1a2b3c4d5e", "tensor"): [1907, 1907]}
    """

    default = dict

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return (
            f'for f in {quoted}/*.*; do [ -f "$f" ] && echo "${{f##*/}} $(head -c 200 "$f")"; '
            "done; true"
        )

    def process(self, output: list[str]) -> dict:
        found = {}
        for line in output:
            name, _, values = line.partition(" ")
            build, _, mode = name.rpartition(".")
            try:
                found[(build, mode)] = [int(value) for value in values.split()]
            except ValueError:
                continue  # a file llamarig did not write: ignored, never trusted
        return found


class DkmsSigning(FactBase):
    """How DKMS signs the modules it builds: the key pair its configuration names
    (``mok_signing_key``/``mok_certificate`` in /etc/dkms/framework.conf and framework.conf.d,
    the last one wins; /var/lib/dkms/mok.key and mok.pub by default), whether they exist, and
    whether the certificate is enrolled as a Machine Owner Key (``mokutil --test-key``).

    .. code:: python

        {"key": "/var/lib/dkms/mok.key", "certificate": "/var/lib/dkms/mok.pub",
         "key_exists": True, "certificate_exists": True, "enrollment": "pending"}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self) -> str:
        # The assignments only, not the files sourced: they are shell that dkms itself runs.
        return (
            "for f in /etc/dkms/framework.conf /etc/dkms/framework.conf.d/*.conf; do "
            '[ -f "$f" ] && grep -h -E "^[[:space:]]*(mok_signing_key|mok_certificate)=" "$f"; '
            "done; true"
        )

    def process(self, output):
        from llamarig.secureboot import MOK_CERTIFICATE, MOK_KEY

        values = {"mok_signing_key": MOK_KEY, "mok_certificate": MOK_CERTIFICATE}
        for line in output:
            name, _, value = line.strip().partition("=")
            values[name] = value.split("#", 1)[0].strip().strip("\"'")
        return {"key": values["mok_signing_key"], "certificate": values["mok_certificate"]}


class MokKeyState(FactBase):
    """Whether the key pair exists (the key's mode too: it must be root's alone) and what
    ``mokutil --test-key`` says of the certificate: enrolled, pending (queued by
    ``mokutil --import``, not yet confirmed at the console), not-enrolled, or unknown (no
    mokutil, no certificate, or no EFI variables).

    .. code:: python

        {"key_exists": True, "key_mode": "600", "certificate_exists": True,
         "enrollment": "not-enrolled"}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self, key: str, certificate: str) -> str:
        key, certificate = shlex.quote(key), shlex.quote(certificate)
        return (
            f"if [ -f {key} ]; then echo key $(stat -c %a {key}); else echo key -; fi; "
            f"if [ -f {certificate} ]; then echo certificate yes; else echo certificate -; fi; "
            f"if [ -f {certificate} ] && command -v mokutil >/dev/null 2>&1; then "
            f"echo test $(mokutil --test-key {certificate} 2>&1 | head -1); fi; true"
        )

    def process(self, output):
        fields = dict(line.strip().split(" ", 1) for line in output if " " in line.strip())
        answer = fields.get("test", "")
        if "already enrolled" in answer:
            enrollment = "enrolled"
        elif "enrollment request" in answer:
            enrollment = "pending"
        elif "not enrolled" in answer:
            enrollment = "not-enrolled"
        else:
            enrollment = "unknown"
        key_mode = fields.get("key", "-")
        return {
            "key_exists": key_mode != "-",
            "key_mode": None if key_mode == "-" else key_mode,
            "certificate_exists": fields.get("certificate") == "yes",
            "enrollment": enrollment,
        }


NVIDIA_MODULE_NAMES = ("nvidia", "nvidia-current", "nvidia-current-open")


class NvidiaModule(FactBase):
    """The nvidia kernel module: whether one is installed for the running kernel, its signer
    (``modinfo -F signer``, empty when unsigned) and whether it is loaded.

    .. code:: python

        {"present": True, "signer": "llamarig DKMS module signing key", "loaded": False}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self) -> str:
        # Debian's packages name the module nvidia-current, its open one nvidia-current-open.
        names = " ".join(NVIDIA_MODULE_NAMES)
        loaded = " || ".join(
            f"[ -d /sys/module/{name.replace('-', '_')} ]" for name in NVIDIA_MODULE_NAMES
        )
        return (
            f"for m in {names}; do "
            "modinfo -F filename $m >/dev/null 2>&1 || continue; echo present; "
            "echo signer=$(modinfo -F signer $m 2>/dev/null); break; done; "
            f"{{ {loaded}; }} && echo loaded; true"
        )

    def process(self, output):
        lines = [line.strip() for line in output]
        signer = next((line[7:] for line in lines if line.startswith("signer=")), "")
        return {"present": "present" in lines, "signer": signer, "loaded": "loaded" in lines}


class DriverBuildFailure(FactBase):
    """The NVIDIA driver's DKMS build that failed on an earlier deploy (driver_build.py), None
    where none is recorded.

    .. code:: python

        BuildFailure(package="nvidia-open-kernel-dkms", version="550.163.01-2",
                     kernel="6.12.57+deb13-amd64", kernels="6.12.57+deb13-amd64",
                     error="nv-pci.c:212:14: error: too few arguments to function ...")
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return None

    def command(self) -> str:
        return f"cat {DRIVER_BUILD_FAILURE_PATH} 2>/dev/null; true"

    def process(self, output):
        return driver_build.parse_record(output)


class AptCandidates(FactBase):
    """The version apt would install of each package, None where it has none (not in the
    lists, or only a virtual name).

    .. code:: python

        {"linux-modules-nvidia-580-open-generic": "6.8.0-50.51", "nvidia-utils-580": None}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self, packages: list[str]) -> str:
        return "".join(
            f"printf '%s ' {shlex.quote(package)}; "
            f"apt-cache policy {shlex.quote(package)} 2>/dev/null "
            "| sed -n 's/^ *Candidate: //p' | head -1; echo; "
            for package in packages
        )

    def process(self, output):
        candidates = {}
        for line in output:
            name, _, version = line.strip().partition(" ")
            if name:
                version = version.strip()
                candidates[name] = None if version in ("", "(none)") else version
        return candidates


class NvccVersion(FactBase):
    """The CUDA toolkit version of ``path`` (``nvcc --version``'s release), or None.

    .. code:: python

        "13.0"
    """

    def command(self, path: str = "/usr/local/cuda/bin/nvcc") -> str:
        release = r"s/.*release \([0-9.]*\),.*/\1/p"
        return f"{shlex.quote(path)} --version 2>/dev/null | sed -n '{release}'; true"

    def process(self, output: list[str]) -> str | None:
        version = output[0].strip() if output else ""
        return version if re.fullmatch(r"\d+\.\d+", version) else None


class PackageVersions(FactBase):
    """The installed version of each of ``packages`` (``dpkg-query`` of those names only, not a
    listing of the whole system), None where it is not installed (or only its configuration
    files are left).

    + packages: the package names

    .. code:: python

        {"cmake": "3.31.6-2", "ninja-build": None}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return {}

    def command(self, packages: list[str]) -> str:
        names = " ".join(shlex.quote(package) for package in packages)
        # Unknown names make dpkg-query exit 1 after printing the known ones.
        show = "'${Package} ${db:Status-Abbrev} ${Version}\\n'"
        return f"dpkg-query -W -f={show} -- {names} 2>/dev/null; true"

    def process(self, output: list[str]) -> dict[str, str | None]:
        versions: dict[str, str | None] = {}
        for line in output:
            fields = line.split()
            if len(fields) == 3 and fields[1] in ("ii", "hi"):
                versions[fields[0].split(":", 1)[0]] = fields[2]
            elif fields:
                versions.setdefault(fields[0].split(":", 1)[0], None)
        return versions


UNIT_PROPERTIES = ("Id", "ActiveState", "SubState", "UnitFileState", "NeedDaemonReload")


class UnitState(FactBase):
    """One systemd unit's state (``systemctl show -p ...`` of that unit only, not of ``*``).

    + unit: the unit name, e.g. ``llama-server.service``

    .. code:: python

        {"active": True, "sub_state": "running", "enabled": True, "need_daemon_reload": False}
    """

    def default(self):
        # pyinfra gives the default, not process(), when the command prints nothing.
        return self.process([])

    def command(self, unit: str) -> str:
        properties = " ".join(f"-p {name}" for name in UNIT_PROPERTIES)
        return f"systemctl show {properties} -- {shlex.quote(unit)} 2>/dev/null; true"

    def process(self, output: list[str]) -> dict:
        values = dict(line.strip().split("=", 1) for line in output if "=" in line)
        sub_state = values.get("SubState", "")
        return {
            # pyinfra's SystemdStatus counts these sub-states as running.
            "active": sub_state in ("running", "waiting", "exited", "listening", "mounted"),
            "sub_state": sub_state,
            "enabled": values.get("UnitFileState", "") in ("enabled", "static"),
            "need_daemon_reload": values.get("NeedDaemonReload") == "yes",
        }


class FileState(FactBase):
    """A small file's mode and sha256 in one command (a unit, an environment file, a launcher);
    None when there is no regular file. Not for model-size files: it hashes the whole file.

    + path: absolute path

    .. code:: python

        {"mode": 644, "sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"}
    """

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return f"if [ -f {quoted} ]; then stat -c %a {quoted}; sha256sum < {quoted}; fi"

    def process(self, output: list[str]) -> dict | None:
        lines = [line.strip() for line in output]
        if len(lines) < 2 or not lines[0].isdigit():
            return None
        digest = lines[1].split(" ", 1)[0]
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            return None
        return {"mode": int(lines[0]), "sha256": digest}


class AptListsAge(FactBase):
    """Seconds since the last ``apt-get update`` that touched the stamp pyinfra's
    ``apt.update(cache_time=...)`` keeps, by the host's clock; None when there is no stamp.

    .. code:: python

        1234
    """

    def command(self) -> str:
        return (
            f"if [ -e {APT_UPDATE_STAMP} ]; then "
            f"echo $(( $(date +%s) - $(stat -c %Y {APT_UPDATE_STAMP}) )); fi"
        )

    def process(self, output: list[str]) -> int | None:
        text = "".join(output).strip()
        return int(text) if re.fullmatch(r"-?\d+", text) else None
