"""`llamarig status`: what each host serves now, read from the host over SSH (no port opened):
the unit and its uptime, the build running and the one deployed, the model, the slots, the
tokens per second over a window, each GPU's memory against the plan, and the last deploy. A
host that runs the team gateway shows it too (``gateway_status``): HAProxy's unit, each model's
rigs as HAProxy sees them, its totals and its certificate's fingerprint; a gateway alone
(`role: gateway`) runs no llama-server and shows only that.

One SSH command per host gathers everything (`probe_command`); the host's own shell sleeps
through the window between the two reads of llama-server's /metrics counter, and every request
in it is bounded. The hosts are asked at once. A host that does not answer is a row saying so.
Reading /metrics resets its per-scrape gauges (llama.cpp averages them over the time between
two scrapes); the counters status uses are not reset.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from llamarig.config import HostConfig
from llamarig.config.builders import SERVES_NO_MODEL
from llamarig.config.gateways import runs_gateway
from llamarig.config.ssh import SshTarget
from llamarig.model.catalog import is_router, model_alias, model_views
from llamarig.model.reference import HubError
from llamarig.onhost import checksums, deploy_record, hostpaths
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.onhost.progress import format_duration
from llamarig.planner import render
from llamarig.planner.gather import host_plan
from llamarig.serving import gateway_status
from llamarig.serving.gateway_status import GatewayStatus
from llamarig.tables.text import printable

CONNECT_TIMEOUT_S = 10
# The command's own bound beyond its window and its requests to the server (each within the
# rig's probe bound, REQUESTS of them at most): connection, systemctl, nvidia-smi.
SLACK_S = 60
REQUESTS = 4
DEFAULT_WINDOW_S = 10
SECTION = "@@llamarig-status "
TOKENS_COUNTER = "llamacpp:tokens_predicted_total"
_BUILD_IN_PATH = re.compile(r"/builds/([^/]+)/bin/")


@dataclass
class GpuRow:
    index: int
    used_mib: int
    total_mib: int
    planned_mib: int | None = None


@dataclass
class HostStatus:
    """One host's row; ``error`` alone when the host did not answer."""

    host: str
    error: str | None = None
    unit: str = ""
    active: str = ""  # ActiveState/SubState, e.g. "active/running"
    uptime_s: float | None = None
    pid: int | None = None
    restarts: int | None = None
    build_running: str | None = None
    build_current: str | None = None
    model_name: str | None = None
    model_file: str | None = None
    model_sha256: str | None = None  # the host's own checksum record, else the rig data's
    slots_busy: int | None = None
    slots_total: int | None = None
    requests_deferred: int | None = None
    tokens_per_second: float | None = None
    tokens_total: int | None = None
    window_s: float | None = None
    server_note: str | None = None  # why slots or speed are missing
    gpus: list[GpuRow] = field(default_factory=list)
    plan_note: str | None = None  # why the GPUs are not compared with the plan
    last_deploy: dict | None = None
    # A router (`models:`): each model's state as the router tells it (loaded, sleeping,
    # unloaded, loading; "unloaded, failed (exit N)" after a load that failed).
    models: dict[str, str] = field(default_factory=dict)
    router: bool = False
    role: str = ""  # the inventory's: standalone, rpc-head, rpc-worker or gateway (no server)
    gateway: GatewayStatus | None = None  # the team gateway it runs, as HAProxy tells it


def section(name: str) -> str:
    return f"echo '{SECTION}{name}'"


def probe_command(data: dict, window: float) -> str:
    """The shell command that prints every section `parse` reads, the window slept on the host
    between the two reads of the tokens counter; a gateway alone's or a builder's has no
    server's sections."""
    if data["role"] in SERVES_NO_MODEL:
        lines = [section("uptime"), "cut -d' ' -f1 /proc/uptime"]
        lines += gateway_status.probe_lines(section) if data["role"] == "gateway" else []
        lines += [section("deploy"), f"cat -- {shlex.quote(deploy_record.RECORD_PATH)} 2>/dev/null"]
        return _steps(lines)
    worker = data["role"] == "rpc-worker"
    service = data["rpc" if worker else "server"]["service"] + ".service"
    paths = render.layout(data)
    unit = shlex.quote(service)
    curl = f"curl -sS -f {HttpTimeouts.of(data).options('probe')} {hostpaths.CURL_AUTH} --"
    base = render.base_url(data)
    metrics, slots = shlex.quote(f"{base}/metrics"), shlex.quote(f"{base}/slots")
    lines = [
        section("unit"),
        f"systemctl show -p ActiveState -p SubState -p MainPID -p NRestarts "
        f"-p ActiveEnterTimestampMonotonic -- {unit} 2>/dev/null",
        section("uptime"),
        "cut -d' ' -f1 /proc/uptime",
        section("running"),
        f'pid=$(systemctl show -P MainPID -- {unit} 2>/dev/null); [ "${{pid:-0}}" -gt 0 ] '
        '&& readlink "/proc/$pid/exe"',
        section("current"),
        f"readlink -- {shlex.quote(paths['current'])}",
    ]
    if is_router(data):
        lines += [section("models"), f"{curl} {shlex.quote(f'{base}/models')} 2>&1; echo"]
    elif not worker:
        lines += [
            section("model"),
            checksums.read_command(paths["model"]),
            section("metrics-before"),
            f"date +%s.%N; {curl} {metrics} 2>&1 | grep -F -- {TOKENS_COUNTER}",
            section("slots-before"),
            f"{curl} {slots} 2>&1; echo",  # its JSON ends without a newline
            f"sleep {window:g}",
            section("metrics"),
            f"date +%s.%N; {curl} {metrics} 2>&1 | grep -v '^#'",
            section("slots"),
            f"{curl} {slots} 2>&1; echo",
        ]
    lines += [
        section("gpus"),
        "command -v nvidia-smi >/dev/null && nvidia-smi "
        "--query-gpu=index,memory.used,memory.total --format=csv,noheader,nounits",
        section("deploy"),
        f"cat -- {shlex.quote(deploy_record.RECORD_PATH)} 2>/dev/null",
    ]
    if runs_gateway(data):
        lines += gateway_status.probe_lines(section)
    return _steps(lines)


def _steps(lines: list[str]) -> str:
    """The lines as one command: a step that fails (no server, no nvidia-smi, no socat) leaves
    its section empty, never the rest."""
    return "\n".join(line if line.startswith(section("")) else f"{line} || true" for line in lines)


def sections(output: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith(SECTION):
            current = line[len(SECTION) :].strip()
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def _counter(lines: list[str]) -> tuple[float, float] | None:
    """(host time, tokens counter) from a metrics section; None when the server gave none."""
    if not lines:
        return None
    try:
        when = float(lines[0])
    except ValueError:
        return None
    for line in lines[1:]:
        name, _, value = line.partition(" ")
        if name == TOKENS_COUNTER:
            try:
                return when, float(value)
            except ValueError:
                return None
    return None


def _slots(lines: list[str]) -> list[dict] | str:
    """The /slots answer, or why there is none (curl's last line)."""
    text = "\n".join(lines).strip()
    try:
        slots = json.loads(text)
    except ValueError:
        slots = None
    if isinstance(slots, list) and all(isinstance(slot, dict) for slot in slots):
        return slots
    return text.splitlines()[-1] if text else "nothing"


def _decoding(slots: list[dict]) -> int:
    """Tokens generated so far by the requests in progress."""
    total = 0
    for slot in slots:
        if slot.get("is_processing"):
            for step in slot.get("next_token") or []:
                total += int(step.get("n_decoded") or 0) if isinstance(step, dict) else 0
    return total


def _metric(lines: list[str], name: str) -> float | None:
    for line in lines:
        key, _, value = line.partition(" ")
        if key == name:
            try:
                return float(value)
            except ValueError:
                return None
    return None


def parse(name: str, data: dict, output: str) -> HostStatus:
    """A host's row from `probe_command`'s output."""
    found = sections(output)
    gateway = gateway_status.parse(data, found) if runs_gateway(data) else None
    if data["role"] in SERVES_NO_MODEL:
        row = HostStatus(host=name, role=data["role"], gateway=gateway)
        row.last_deploy = deploy_record.parse("\n".join(found.get("deploy", [])))
        return row
    worker = data["role"] == "rpc-worker"
    row = HostStatus(
        host=name,
        unit=data["rpc" if worker else "server"]["service"] + ".service",
        role=data["role"],
        gateway=gateway,
    )
    unit = dict(line.partition("=")[::2] for line in found.get("unit", []))
    row.active = f"{unit.get('ActiveState', 'unknown')}/{unit.get('SubState', 'unknown')}"
    if not worker and data["server"]["supervisor"] == "none":
        row.active = "no unit (server.supervisor: none; `llamarig run` starts the server)"
    pid = int(unit.get("MainPID") or 0)
    row.pid = pid or None
    row.restarts = int(unit["NRestarts"]) if unit.get("NRestarts", "").isdigit() else None
    entered = int(unit.get("ActiveEnterTimestampMonotonic") or 0)
    uptime = (found.get("uptime") or [""])[0]
    if unit.get("ActiveState") == "active" and entered and re.fullmatch(r"[0-9.]+", uptime):
        row.uptime_s = max(0.0, float(uptime) - entered / 1e6)
    # /proc/PID/exe is the binary in its build; `current` links to a build directory.
    running = _BUILD_IN_PATH.search((found.get("running") or [""])[0])
    current = _BUILD_IN_PATH.search((found.get("current") or [""])[0] + "/bin/")
    row.build_running = running.group(1) if running else None
    row.build_current = current.group(1) if current else None
    if is_router(data):
        _router_fields(row, data, found)
    elif not worker:
        _server_fields(row, data, found)
    for line in found.get("gpus", []):
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 3 and all(part.isdigit() for part in parts):
            row.gpus.append(GpuRow(int(parts[0]), int(parts[1]), int(parts[2])))
    row.last_deploy = deploy_record.parse("\n".join(found.get("deploy", [])))
    return row


def _router_fields(row: HostStatus, data: dict, found: dict[str, list[str]]) -> None:
    """A router's models and their states, from its /models (which loads none)."""
    names = [view.name for view in model_views(data)]
    row.router = True
    row.model_name = f"{len(names)} models"
    row.model_file = render.layout(data)["presets"]
    text = "\n".join(found.get("models", [])).strip()
    try:
        listed = json.loads(text)["data"]
        states = {entry["id"]: entry.get("status") or {} for entry in listed}
    except (ValueError, KeyError, TypeError):
        row.server_note = f"no answer from {render.base_url(data)}/models: {text[-200:]}"
        return
    for name in names:
        state = states.get(name)
        if state is None:
            row.models[name] = "not listed by the router (deployed with another presets file?)"
            continue
        value = str(state.get("value", "unknown"))
        if state.get("failed"):
            value += f", failed (exit {state.get('exit_code')})"
        row.models[name] = value


def _server_fields(row: HostStatus, data: dict, found: dict[str, list[str]]) -> None:
    paths = render.layout(data)
    row.model_name = model_alias(data)
    row.model_file = paths["model"]
    trusted = checksums.trusted_sha256(found.get("model", []))
    declared = data["model"].get("sha256")
    declared = declared[0] if isinstance(declared, list) else declared
    row.model_sha256 = (trusted or {}).get("sha256") or declared
    if trusted is None:
        row.model_file += " (missing)"
    slots, slots_before = _slots(found.get("slots", [])), _slots(found.get("slots-before", []))
    if isinstance(slots, str):
        row.server_note = f"no answer from {render.base_url(data)}: {slots}"
    else:
        row.slots_total = len(slots)
        row.slots_busy = sum(1 for slot in slots if slot.get("is_processing"))
    before, after = _counter(found.get("metrics-before", [])), _counter(found.get("metrics", []))
    deferred = _metric(found.get("metrics", [])[1:], "llamacpp:requests_deferred")
    row.requests_deferred = int(deferred) if deferred is not None else None
    if before and after and not isinstance(slots, str) and not isinstance(slots_before, str):
        # The counter grows only when a request ends: the tokens of the requests still
        # running (each processing slot's n_decoded) are added to it at both reads.
        generated = (after[1] + _decoding(slots)) - (before[1] + _decoding(slots_before))
        row.tokens_total = int(after[1] + _decoding(slots))
        if after[0] > before[0] and generated >= 0:
            row.window_s = after[0] - before[0]
            row.tokens_per_second = generated / row.window_s
    if row.tokens_per_second is None and not data["server"]["metrics"]:
        row.server_note = row.server_note or "no speed: server.metrics is off"


# Each host's planned MiB per GPU index (or why there is none), planned once per process: a
# watch asks again every few seconds, and the plan reads the GPUs and the model's header.
_planned: dict[str, dict[int, int] | str] = {}


def _planned_mib(host_config: HostConfig) -> dict[int, int] | str:
    if host_config.name not in _planned:
        try:
            plan = host_plan(host_config)
        except HubError as error:
            _planned[host_config.name] = f"no plan: {error.message}"
            return _planned[host_config.name]
        indices = plan.planned_gpu_indices
        if not indices or plan.memory is None:
            why = "; ".join(plan.errors) or "no GPU planned"
            _planned[host_config.name] = f"no memory plan ({why})"
        else:
            devices = plan.memory.devices
            _planned[host_config.name] = {
                index: device.planned_mib for index, device in zip(indices, devices, strict=True)
            }
    return _planned[host_config.name]


def _compare_with_plan(row: HostStatus, host_config: HostConfig) -> None:
    """Each GPU's planned MiB beside what it holds; a note when there is no plan to compare."""
    if not row.gpus:
        return
    planned = _planned_mib(host_config)
    if isinstance(planned, str):
        row.plan_note = planned
        return
    for gpu in row.gpus:
        gpu.planned_mib = planned.get(gpu.index)


def host_status(host_config: HostConfig, window: float) -> HostStatus:
    """One host's row, asked over SSH (or by the local shell), every wait bounded."""
    data = host_config.data
    command = probe_command(data, window)
    timeout = window + SLACK_S + REQUESTS * HttpTimeouts.of(data).probe
    try:
        if data["ssh"].get("local"):
            result = subprocess.run(
                ["sh", "-c", command], capture_output=True, text=True, timeout=timeout
            )
        else:
            argv = SshTarget.of(data["ssh"]).argv("-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}")
            result = subprocess.run(
                [*argv, command], capture_output=True, text=True, timeout=timeout
            )
    except subprocess.TimeoutExpired:
        return HostStatus(host=host_config.name, error=f"no answer within {timeout:g} s")
    if SECTION not in result.stdout:
        said = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return HostStatus(host=host_config.name, error=f"not reachable: {said}")
    row = parse(host_config.name, data, result.stdout)
    if data["role"] not in ("rpc-worker", "gateway"):
        _compare_with_plan(row, host_config)
    return row


def wait_out(started: float, interval: float, clock=time.monotonic, sleep=time.sleep) -> None:
    """Sleep until ``interval`` seconds have passed since ``started`` (a ``clock`` reading):
    `--watch` asks once per interval whether or not the hosts answered (a host that does not
    answer returns at once; one that does slept through its window on the host)."""
    left = started + interval - clock()
    if left > 0:
        sleep(left)


def statuses(hosts: dict[str, HostConfig], window: float) -> list[HostStatus]:
    """Every host's row, asked at once, in the inventory's order."""
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        return list(pool.map(lambda config: host_status(config, window), hosts.values()))


def report(row: HostStatus) -> str:
    """The row as lines for a terminal: each line escaped (``llamarig.tables.text``), since
    most of it is what the box printed."""
    if row.error:
        return printable(f"{row.host}: {row.error}")
    lines = (
        [f"{row.host}: {row.role} (no llama-server)"]
        if row.role in SERVES_NO_MODEL
        else _rig_lines(row)
    )
    if row.gateway is not None:
        lines += gateway_status.report_lines(row.gateway)
    deploy = row.last_deploy
    if deploy is None:
        lines.append("  deploy   no record (not deployed by this llamarig, or before records)")
    elif deploy["outcome"] == "converged":
        lines.append(
            f"  deploy   {deploy['finished']}: converged, {deploy['changed']} operation(s) changed"
        )
    else:
        rolled = "; rolled back to the last version that served" if deploy["rolled_back"] else ""
        lines.append(
            f"  deploy   {deploy['finished']}: failed at {deploy['failed_operation']!r}{rolled}"
        )
    return "\n".join(printable(line) for line in lines)


def _rig_lines(row: HostStatus) -> list[str]:
    """The rig's own lines: its unit, build, model, slots, speed and GPUs (unescaped)."""
    state = f"{row.unit} {row.active}"
    if row.uptime_s is not None:
        state += f" for {format_duration(row.uptime_s)}"
    if row.pid:
        state += f", pid {row.pid}"
    if row.restarts:
        state += f", {row.restarts} restart(s) by systemd"
    lines = [f"{row.host}: {state}"]
    build = row.build_running or "not running"
    if row.build_current and row.build_current != row.build_running:
        build += f" (deployed: {row.build_current}; a restart would switch to it)"
    lines.append(f"  build    {build}")
    if row.router:
        lines.append(f"  models   {row.model_name} from {row.model_file}")
    elif row.model_name:
        digest = (row.model_sha256 or "")[:12] or "no sha256"
        lines.append(f"  model    {row.model_name}  {row.model_file}  sha256 {digest}")
    for name, state in row.models.items():
        lines.append(f"  model    {name}: {state}")
    if row.slots_total is not None:
        queued = f", {row.requests_deferred} waiting" if row.requests_deferred else ""
        lines.append(f"  slots    {row.slots_busy} of {row.slots_total} busy{queued}")
    if row.tokens_per_second is not None:
        lines.append(
            f"  speed    {row.tokens_per_second:.1f} tokens/s over the last "
            f"{row.window_s:.0f} s ({row.tokens_total:,} tokens since it started)"
        )
    if row.server_note:
        lines.append(f"  server   {row.server_note}")
    for gpu in row.gpus:
        plan = f", plan {gpu.planned_mib:,} MiB" if gpu.planned_mib is not None else ""
        lines.append(f"  gpu {gpu.index}    {gpu.used_mib:,} of {gpu.total_mib:,} MiB used{plan}")
    if row.plan_note:
        lines.append(f"  plan     {row.plan_note}")
    return lines


def as_json(rows: list[HostStatus]) -> str:
    return json.dumps([asdict(row) for row in rows], indent=2)


def healthy(row: HostStatus) -> bool:
    """The host answered and its service is active, or, without a unit, its server answered;
    a host that runs the gateway also needs HAProxy active with a rig up for every model (the
    exit status of `llamarig status`)."""
    if row.error is not None:
        return False
    if row.gateway is not None and not gateway_status.healthy(row.gateway):
        return False
    if row.role == "gateway":
        return row.gateway is not None
    if row.role == "builder":  # it answered; it serves nothing
        return True
    if row.active.startswith("no unit"):
        return row.slots_total is not None
    return row.active.startswith("active/")
