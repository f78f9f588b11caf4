"""The gateway's part of `llamarig status`: HAProxy's unit, each model's rigs as HAProxy sees
them (its runtime API's ``show stat``), the totals of the `gateway` frontend, and the SHA-256
fingerprint of the certificate clients compare.

Everything here is what the gateway host printed: read by the columns ``show stat``'s header
names (never by position), each count only when it is a plain number, and every failure (no
socket, no socat, garbage, a huge answer) a note in the row, never an exception. The report's
lines are escaped by the caller (``llamarig.tables.text.printable``)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from llamarig.facts.gateway import read_stat, runtime_api
from llamarig.onhost import hostpaths
from llamarig.onhost.progress import format_duration
from llamarig.planner.gateway import HOLD_SERVER, SERVICE, backend_id
from llamarig.tables.certificates import fingerprint

# The gateway's frontend (files/haproxy.cfg.j2) and HAProxy's names for its summary rows.
FRONTEND = "gateway"
# What is read of the host's answers: `show stat` is ~1 KiB a row; a certificate chain a few.
MAX_STAT_BYTES = 1 << 20
MAX_CERT_BYTES = 1 << 16
_COUNT = re.compile(r"[0-9]{1,18}")
# "UP 1/2": up, failing its checks (going down after the next failures); "DOWN 1/2": passing
# them (coming up); HAProxy shows the checks done of those needed.
_TRANSITION = re.compile(r"(UP|DOWN|NOLB|DRAIN) ([0-9]+)/([0-9]+)")


@dataclass
class GatewayRig:
    """One rig of one model, as HAProxy sees it (its server row of `show stat`)."""

    name: str
    # HAProxy's status: UP, DOWN, MAINT, DRAIN, NOLB, "no check"; "UP 1/2" is up but failing
    # its checks, "DOWN 1/2" down but passing them; "missing": HAProxy has no such server.
    state: str
    check: str | None = None  # the last check's result, e.g. L7OK, L4CON, L7STS
    state_for_s: int | None = None  # seconds since the state last changed
    requests_now: int | None = None  # scur: requests the rig is answering now
    queued: int | None = None  # qcur: requests waiting for this rig in particular
    errors: int | None = None  # eresp + econ: failed connections and failed answers
    requests_total: int | None = None  # stot: requests sent to it since the last reload
    retries: int | None = None  # wretr
    redispatches: int | None = None  # wredis

    @property
    def serving(self) -> bool:
        """Whether HAProxy sends it new requests: UP, also while failing checks (UP 1/2)."""
        return self.state.split(" ")[0] == "UP" or self.state == "no check"


@dataclass
class GatewayModel:
    model: str
    backend: str  # HAProxy's backend name, model_N
    queued: int | None = None  # the backend's qcur: requests waiting for any of its rigs
    errors: int | None = None  # the backend's eresp + econ (503s with no rig up included)
    # Requests held while no rig of the model could take one (each out of rotation for a
    # change, or down): the `_hold` backup server's scur.
    held: int | None = None
    rigs: list[GatewayRig] = field(default_factory=list)
    note: str | None = None  # why HAProxy's view of it is missing


@dataclass
class GatewayTotals:
    """The `gateway` frontend's counters (since HAProxy's last reload) and the queues."""

    connections_now: int | None = None  # scur: client connections open, idle ones included
    requests_total: int | None = None  # req_tot: HTTP requests received
    answered_by_gateway: int | None = None  # intercepted: the model list, 401/404/413/431
    malformed: int | None = None  # ereq: requests HAProxy could not read (or that timed out)
    queued: int | None = None  # every backend's qcur


@dataclass
class GatewayStatus:
    service: str = SERVICE
    active: str = ""  # ActiveState/SubState, e.g. "active/running"
    uptime_s: float | None = None
    pid: int | None = None
    tls_sha256: str | None = None  # the first certificate of tls.crt, as `openssl x509` prints
    tls_note: str | None = None  # why there is no fingerprint
    models: list[GatewayModel] = field(default_factory=list)
    totals: GatewayTotals | None = None
    note: str | None = None  # why HAProxy's statistics are missing


def probe_lines(section) -> list[str]:
    """The shell lines (between ``section(NAME)`` markers) whose output `parse` reads."""
    return [
        section("gateway-unit"),
        "systemctl show -p ActiveState -p SubState -p MainPID "
        f"-p ActiveEnterTimestampMonotonic -- {SERVICE} 2>/dev/null",
        section("gateway-stat"),
        f"{runtime_api('show stat')} 2>&1 | head -c {MAX_STAT_BYTES}; echo",
        section("gateway-cert"),
        f"cat -- {shlex.quote(hostpaths.GATEWAY_TLS_CERT)} 2>&1 | head -c {MAX_CERT_BYTES}; echo",
    ]


def count(row: dict[str, str], *columns: str) -> int | None:
    """The sum of ``columns`` of a `show stat` row; None when one is missing or no number."""
    values = [row.get(column, "") for column in columns]
    if not all(_COUNT.fullmatch(value) for value in values):
        return None
    return sum(int(value) for value in values)


def _rig(name: str, row: dict[str, str] | None) -> GatewayRig:
    if row is None:
        return GatewayRig(name=name, state="missing")
    return GatewayRig(
        name=name,
        state=row.get("status", "")[:40] or "unknown",
        check=row.get("check_status", "")[:40] or None,
        state_for_s=count(row, "lastchg"),
        requests_now=count(row, "scur"),
        queued=count(row, "qcur"),
        errors=count(row, "eresp", "econ"),
        requests_total=count(row, "stot"),
        retries=count(row, "wretr"),
        redispatches=count(row, "wredis"),
    )


def _models(data: dict, rows: list[dict[str, str]]) -> list[GatewayModel]:
    """Each model of the plan with its rigs as HAProxy lists them: the planned ones in the
    inventory's order, then any server HAProxy has beside them (a configuration not applied)."""
    models = []
    for index, backend in enumerate(data["gateway"]["backends"]):
        name = backend_id(index)
        found = {row.get("svname", ""): row for row in rows if row.get("pxname") == name}
        model = GatewayModel(model=backend["model"], backend=name)
        summary = found.pop("BACKEND", None)
        if summary is None:
            model.note = (
                f"HAProxy has no backend {name} (its configuration is not this inventory's: "
                "converge)"
            )
        else:
            model.queued = count(summary, "qcur")
            model.errors = count(summary, "eresp", "econ")
        hold = found.pop(HOLD_SERVER, None)
        model.held = count(hold, "scur") if hold else None
        for server in backend["servers"]:
            model.rigs.append(_rig(server["name"], found.pop(server["name"], None)))
        model.rigs += [_rig(svname[:80], row) for svname, row in found.items()]
        models.append(model)
    return models


def _totals(models: list[GatewayModel], rows: list[dict[str, str]]) -> GatewayTotals | None:
    frontend = next(
        (r for r in rows if r.get("pxname") == FRONTEND and r.get("svname") == "FRONTEND"), None
    )
    if frontend is None:
        return None
    queues = [model.queued for model in models]
    return GatewayTotals(
        connections_now=count(frontend, "scur"),
        requests_total=count(frontend, "req_tot"),
        answered_by_gateway=count(frontend, "intercepted"),
        malformed=count(frontend, "ereq"),
        queued=None if None in queues else sum(queues),
    )


def parse(data: dict, found: dict[str, list[str]]) -> GatewayStatus:
    """The gateway's view from the probe's sections (``uptime`` and the gateway's own)."""
    view = GatewayStatus()
    unit = dict(line.partition("=")[::2] for line in found.get("gateway-unit", []))
    view.active = (
        f"{unit.get('ActiveState', 'unknown')[:40]}/{unit.get('SubState', 'unknown')[:40]}"
    )
    pid = count(unit, "MainPID")
    view.pid = pid or None
    entered = count(unit, "ActiveEnterTimestampMonotonic")
    uptime = (found.get("uptime") or [""])[0]
    if unit.get("ActiveState") == "active" and entered and re.fullmatch(r"[0-9.]{1,30}", uptime):
        try:
            view.uptime_s = max(0.0, float(uptime) - entered / 1e6)
        except ValueError:
            pass
    cert = found.get("gateway-cert", [])
    view.tls_sha256 = fingerprint("\n".join(cert))
    if view.tls_sha256 is None:
        said = next((line for line in cert if line.strip()), "nothing")
        view.tls_note = f"no certificate in {hostpaths.GATEWAY_TLS_CERT}: {said[:200]}"
    rows = read_stat(found.get("gateway-stat", []))
    if isinstance(rows, str):
        view.note = rows
        return view
    view.models = _models(data, rows)
    view.totals = _totals(view.models, rows)
    if view.totals is None:
        view.note = f"HAProxy has no frontend {FRONTEND!r} (its configuration is not llamarig's)"
    return view


def healthy(view: GatewayStatus) -> bool:
    """HAProxy runs, its statistics were read, and every model has a rig it sends requests to."""
    return (
        view.active.startswith("active/")
        and view.note is None
        and all(any(rig.serving for rig in model.rigs) for model in view.models)
    )


def _number(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _state(rig: GatewayRig) -> str:
    transition = _TRANSITION.fullmatch(rig.state)
    state = rig.state
    if transition:
        going = "going down" if transition.group(1) != "DOWN" else "coming up"
        state += f" ({going}: {transition.group(2)} of {transition.group(3)} checks)"
    if not rig.serving and rig.state_for_s is not None:
        state += f" for {format_duration(rig.state_for_s)}"
    if rig.check and rig.check != "L7OK":
        state += f" ({rig.check})"
    return state


def rig_text(rig: GatewayRig) -> str:
    if rig.state == "missing":
        return f"{rig.name} missing from HAProxy's configuration (converge)"
    parts = [f"{_number(rig.requests_now)} now"]
    if rig.queued:
        parts.append(f"{rig.queued:,} queued for it")
    parts += [f"{_number(rig.errors)} errors", f"{_number(rig.requests_total)} sent"]
    if rig.retries:
        parts.append(f"{rig.retries:,} retried")
    if rig.redispatches:
        parts.append(f"{rig.redispatches:,} sent elsewhere")
    return f"{rig.name} {_state(rig)}: {', '.join(parts)}"


def report_lines(view: GatewayStatus) -> list[str]:
    """The gateway's lines of a host's report, unescaped."""
    state = f"{view.service} {view.active}"
    if view.uptime_s is not None:
        state += f" for {format_duration(view.uptime_s)}"
    if view.pid:
        state += f", pid {view.pid}"
    lines = [f"  gateway  {state}"]
    if view.tls_sha256:
        lines.append(f"  tls      SHA-256 {view.tls_sha256}")
    else:
        lines.append(f"  tls      {view.tls_note}")
    if view.note:
        lines.append(f"  haproxy  {view.note}")
    for model in view.models:
        queued = f"{_number(model.queued)} queued, {_number(model.errors)} errors"
        if model.held:
            queued += f", {model.held} held until a rig serves"
        rigs = "; ".join(rig_text(rig) for rig in model.rigs)
        lines.append(f"  backend  {model.model} ({queued}): {model.note or rigs}")
    totals = view.totals
    if totals:
        lines.append(
            f"  totals   {_number(totals.connections_now)} connections now, "
            f"{_number(totals.queued)} queued; since the last reload "
            f"{_number(totals.requests_total)} requests, {_number(totals.answered_by_gateway)} "
            f"answered by the gateway itself (model list, 401/404/413), "
            f"{_number(totals.malformed)} malformed"
        )
    return lines
