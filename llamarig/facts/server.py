"""llama-server as it runs: its slots and answers (``ServerProbe``) and the process behind the
unit."""

from __future__ import annotations

import base64
import json
import shlex

from pyinfra.api import FactBase

from llamarig.onhost.hostpaths import (
    CURL_AUTH,
)
from llamarig.onhost.httpbounds import HttpTimeouts


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
