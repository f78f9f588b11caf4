"""The gateway's cost on the sandbox: K streaming clients through the team gateway (HAProxy,
TLS, a user's key) against the same clients straight to the rig (plain HTTP, the rig's own
key), side by side in one run.

It boots its own two sandboxes - ``sandbox-gwb`` (Debian bookworm, the gateway, ssh 2250) and
``sandbox-gwb-rig`` (trixie, ssh 2251, llama-server on 127.0.0.1:8121) - and converges a one-rig
plus gateway inventory in one ``pyinfra -y inventory.py deploy.py``: the demo rig
(inventory/hosts.yml: SmolLM2-135M Q4_1 from the sandbox's file server) with 4 slots, alias
``smollm2``, ``server.threads`` set (``--threads``, 1 by default), its speed unmeasured
(``max_slowdown: null``); the gateway on 127.0.0.1:8453 (metrics 8415) in front of it. Keys are
made fresh in a temporary directory and never printed; the gateway's self-signed certificate is
trusted from the copy the deploy leaves beside the inventory.

Then, for each K (``--clients``, 1,2,4): ``--rounds`` pairs of rounds (20), one round straight to
the rig and one through the gateway, the order flipped in every pair (direct first, then gateway
first, ...) so that drift in the machine's load hits both sides alike. A round is bench/load.py's
``served``: K streamed chat completions started together, each of exactly ``--tokens`` tokens (64,
``ignore_eos``) after a distinct prompt of ``--prompt-words`` words (20: the rig's prompt
processing is what varies most in the time to first token, and the gateway's cost does not
depend on it). By default each request opens its own connection (its connect, the TLS handshake
through the gateway, is timed apart: ``connect_ms``) and the time to first token counts from
opening it. With ``--keep-alive`` each of the K clients keeps one connection open for all its
requests (as httpx and the OpenAI SDKs do): before each round the client holds K open
connections, replacing any the server closed while idle (the rig after 5 s, HAProxy after 10 s)
with a new one warmed by a request of its own, and the time to first token counts from sending
the request. ``--max-body-kib`` sets the gateway's ``gateway.max_body_kib`` for the run
(HAProxy's tune.bufsize is it x 1024 + 32 KiB; 1024 by default). Per K and side: the median
round's aggregate tokens/s, p50/p95 time to first token and inter-token gap over every
request, errors; the ratio of tokens/s (gateway / direct) and the TTFT difference, also as
medians over the pairs (with their spread, the standard deviation). The goal (the gateway
issue): at most 2% fewer tokens/s and at most 5 ms more to the first token.

The machine is shared: the CPU seconds HAProxy, llama-server, the sandboxes' journals, this
process (the clients) and everything else used are recorded for each round. Before each pair it
waits (``--quiet-wait`` seconds at most) for a second in which other work used at most 0.15 CPU;
the pairs in which other work took more than 5% of the CPUs in either round are counted, and the
paired figures are given over the quiet pairs too.

Before booting its sandboxes, before measuring and before any pair, it waits (``--wait-others``
seconds at most, a look every 30 s) while the gateway sandbox test (what ``pgrep -f
test_sandbox_gateway`` finds) or another pytest run of a sandbox test runs, as they share the
CPUs, and records what else ran. Every request is bounded (``--request-timeout``) and so is
the whole run (``--max-minutes``); the sandboxes are taken down at the end whatever happens.
Loopback only. Writes ``--out`` (JSON) and prints a markdown table. As root:

    .venv/bin/python -m bench.gateway --out bench/runs/gateway-sandbox/results.json
    .venv/bin/python -m bench.gateway --keep-alive --max-body-kib 64 --out ...

Exit status 0 when every K meets the goal, 1 when one does not, 2 when it could not measure.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import itertools
import json
import os
import platform
import re
import secrets
import select
import signal
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import yaml

from bench.converge import _git, machine, pyinfra
from bench.load import Client, _clients, prompt, served
from llamarig.serving.throughput import percentile

PROJECT = Path(__file__).resolve().parent.parent

GATEWAY, RIG = "sandbox-gwb", "sandbox-gwb-rig"
RELEASES = {GATEWAY: "bookworm", RIG: "trixie"}
SSH_PORTS = {GATEWAY: 2250, RIG: 2251}
RIG_PORT, GATEWAY_PORT, METRICS_PORT = 8121, 8453, 8415
GATEWAY_HOST = "gw"  # its inventory name: the certificate lands in gateway-certs/gw.crt
DIRECT_URL = f"http://127.0.0.1:{RIG_PORT}"
GATEWAY_URL = f"https://127.0.0.1:{GATEWAY_PORT}"
MODEL = "smollm2"
SLOTS = 4
USER = "bench"
SIDES = ("direct", "gateway")

MAX_TPS_LOSS = 0.02  # at most 2% fewer tokens/s through the gateway
MAX_TTFT_DELTA_MS = 5.0  # at most 5 ms more to the first token

CONVERGE_TIMEOUT_S = 1800
# Before each pair: a second in which other work used at most this much CPU (CPU-seconds per
# second); a pair counts as quiet when other work used at most QUIET_SHARE of all CPUs' time in
# each of its rounds (the paired figures are also given over the quiet pairs alone).
QUIET_CPU = 0.15
# Keep-alive: how long after a warm-up answer a server that closes its connection after each
# answer has surely done so (loopback).
SETTLE_S = 0.05
QUIET_SHARE = 0.05
OTHER_BENCH = "test_sandbox_gateway"  # the sandbox test that shares the CPUs
# What else may take CPU time from the measurement (outside this run's sandboxes).
BUSY = re.compile(r"pytest|pyinfra|cc1plus|cc1 |ninja|cmake|llama-server|haproxy|mmdebstrap|apt")


# --- pure parts (tests/test_bench_gateway.py) -------------------------------------------------


def order(pair: int) -> tuple[str, str]:
    """Which side runs first in pair ``pair``: direct in even pairs, the gateway in odd ones."""
    return SIDES if pair % 2 == 0 else SIDES[::-1]


def plan(clients: list[int], rounds: int) -> list[tuple[int, int, str]]:
    """Every round of the run in order: (K, pair, side); per K, ``rounds`` pairs."""
    return [(k, pair, side) for k in clients for pair in range(rounds) for side in order(pair)]


def round_record(clients: int, pair: int, side: str, row: dict, replies: list[dict]) -> dict:
    """One round from ``served``'s row (one round) and the replies it got, times in ms."""
    good = [reply for reply in replies if "error" not in reply]
    return {
        "clients": clients,
        "pair": pair,
        "side": side,
        "tps": row["aggregate_tps"],
        "ttft_ms": [round(reply["ttft_s"] * 1000, 2) for reply in good],
        "connect_ms": [
            round(reply["connect_s"] * 1000, 2) for reply in good if "connect_s" in reply
        ],
        # what is left of the time to first token once connected (TCP, and TLS through the
        # gateway): what a client that keeps its connection open would wait
        "after_connect_ms": [
            round((reply["ttft_s"] - reply["connect_s"]) * 1000, 2)
            for reply in good
            if "connect_s" in reply
        ],
        "gaps_ms": [gap * 1000 for reply in good for gap in reply["gaps_s"]],
        "tokens": [reply["tokens"] for reply in good],
        # measured requests that opened a connection (all of them, unless kept alive)
        "new_connections": sum(1 for reply in good if reply.get("new_connection", True)),
        "errors": row["errors"],
        "first_error": row["first_error"],
    }


def _p(values: list[float], share: float) -> float | None:
    value = percentile(values, share)
    return round(value, 2) if value is not None else None


def summarize(records: list[dict]) -> dict:
    """One side at one K: the median round's tokens/s (rounds with an error left out), the
    percentiles of every request's time to first token, connect time and inter-token gap."""
    rates = [record["tps"] for record in records if record["tps"] is not None]
    ttft = [value for record in records for value in record["ttft_ms"]]
    connect = [value for record in records for value in record["connect_ms"]]
    after = [value for record in records for value in record.get("after_connect_ms", [])]
    gaps = [value for record in records for value in record["gaps_ms"]]
    return {
        "rounds": len(rates),
        "tps": round(statistics.median(rates), 2) if rates else None,
        "ttft_ms": {"p50": _p(ttft, 0.5), "p95": _p(ttft, 0.95)},
        "connect_ms": {"p50": _p(connect, 0.5), "p95": _p(connect, 0.95)},
        "after_connect_ms": {"p50": _p(after, 0.5), "p95": _p(after, 0.95)},
        "itl_ms": {"p50": _p(gaps, 0.5), "p95": _p(gaps, 0.95), "max": _p(gaps, 1.0)},
        "requests": sum(len(record["ttft_ms"]) + record["errors"] for record in records),
        "new_connections": sum(
            record.get("new_connections", len(record["ttft_ms"])) for record in records
        ),
        "errors": sum(record["errors"] for record in records),
    }


def paired(records: list[dict]) -> dict:
    """Medians over the pairs of one K: gateway / direct tokens/s of each pair, and the
    difference of the pair's TTFT medians (gateway - direct), in ms."""
    by_pair: dict[int, dict[str, dict]] = {}
    for record in records:
        by_pair.setdefault(record["pair"], {})[record["side"]] = record
    ratios, deltas = [], []
    for sides in by_pair.values():
        direct, gateway = sides.get("direct"), sides.get("gateway")
        if not direct or not gateway:
            continue
        if direct["tps"] and gateway["tps"]:
            ratios.append(gateway["tps"] / direct["tps"])
        if direct["ttft_ms"] and gateway["ttft_ms"]:
            deltas.append(
                statistics.median(gateway["ttft_ms"]) - statistics.median(direct["ttft_ms"])
            )
    return {
        "pairs": len(ratios),
        "tps_ratio": round(statistics.median(ratios), 4) if ratios else None,
        "tps_ratio_sd": round(statistics.stdev(ratios), 4) if len(ratios) > 1 else None,
        "tps_ratio_each": [round(ratio, 4) for ratio in ratios],
        "ttft_delta_ms": round(statistics.median(deltas), 2) if deltas else None,
        "ttft_delta_sd_ms": round(statistics.stdev(deltas), 2) if len(deltas) > 1 else None,
        "ttft_delta_each_ms": [round(delta, 2) for delta in deltas],
    }


def quiet(records: list[dict]) -> list[dict]:
    """The rounds of the pairs in which other work used at most QUIET_SHARE of all CPUs'
    time in both rounds (rounds without a CPU record count as quiet)."""
    loud = {
        (record["clients"], record["pair"])
        for record in records
        if record.get("cpu_s", {}).get("rest_share", 0) > QUIET_SHARE
    }
    return [record for record in records if (record["clients"], record["pair"]) not in loud]


def compare(clients: int, records: list[dict]) -> dict:
    """One K's row: each side's summary, the ratio of their median tokens/s, the difference of
    their TTFT and inter-token p50, the paired medians, and whether the goal is met."""
    mine = [record for record in records if record["clients"] == clients]
    direct = summarize([record for record in mine if record["side"] == "direct"])
    gateway = summarize([record for record in mine if record["side"] == "gateway"])
    ratio = gateway["tps"] / direct["tps"] if direct["tps"] and gateway["tps"] else None

    def delta(key: str) -> float | None:
        a, b = direct[key]["p50"], gateway[key]["p50"]
        return round(b - a, 2) if a is not None and b is not None else None

    ttft_delta = delta("ttft_ms")
    if ratio is not None:
        ratio = round(ratio, 4)  # as written and shown: 0.98 is within 2%, not 2.0000000001%
    return {
        "clients": clients,
        "direct": direct,
        "gateway": gateway,
        "tps_ratio": ratio,
        "tps_loss_pct": round((1 - ratio) * 100, 2) if ratio is not None else None,
        "ttft_p50_delta_ms": ttft_delta,
        "connect_p50_delta_ms": delta("connect_ms"),
        "after_connect_p50_delta_ms": delta("after_connect_ms"),
        "itl_p50_delta_ms": delta("itl_ms"),
        "paired": paired(mine),
        "paired_quiet": paired(quiet(mine)),
        "tps_within": ratio is not None and round(1 - ratio, 4) <= MAX_TPS_LOSS,
        "ttft_within": ttft_delta is not None and ttft_delta <= MAX_TTFT_DELTA_MS,
        "errors": direct["errors"] + gateway["errors"],
    }


def _num(value: float | None, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def _signed(value: float | None, digits: int = 1) -> str:
    return f"{value:+.{digits}f}" if value is not None else "-"


def _ratio(value: float | None) -> str:
    return f"{value:.1%}" if value is not None else "-"


def markdown_table(rows: list[dict]) -> str:
    header = (
        "| K | direct t/s | gateway t/s | gateway / direct (paired) |"
        " TTFT p50 direct / gateway ms | TTFT delta ms (paired) | connect p50 direct / gateway ms"
        " | TTFT once connected: delta ms | inter-token p50 direct / gateway ms | errors |"
        " quiet pairs: ratio, TTFT delta | goal: >= 98% t/s, <= +5 ms |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        direct, gateway, pairs, calm = (
            row["direct"],
            row["gateway"],
            row["paired"],
            row["paired_quiet"],
        )
        verdict = " ".join(
            [
                "t/s ok" if row["tps_within"] else "t/s MISSED",
                "TTFT ok" if row["ttft_within"] else "TTFT MISSED",
            ]
        )
        lines.append(
            f"| {row['clients']} | {_num(direct['tps'])} | {_num(gateway['tps'])} |"
            f" {_ratio(row['tps_ratio'])} ({_ratio(pairs['tps_ratio'])}) |"
            f" {_num(direct['ttft_ms']['p50'])} / {_num(gateway['ttft_ms']['p50'])} |"
            f" {_signed(row['ttft_p50_delta_ms'])} ({_signed(pairs['ttft_delta_ms'])}) |"
            f" {_num(direct['connect_ms']['p50'], 2)} / {_num(gateway['connect_ms']['p50'], 2)} |"
            f" {_signed(row['after_connect_p50_delta_ms'])} |"
            f" {_num(direct['itl_ms']['p50'], 2)} / {_num(gateway['itl_ms']['p50'], 2)} |"
            f" {row['errors']} | {calm['pairs']} of {pairs['pairs']}:"
            f" {_ratio(calm['tps_ratio'])}, {_signed(calm['ttft_delta_ms'])} | {verdict} |"
        )
    return header + "\n".join(lines) + "\n"


def summary_line(rows: list[dict]) -> str:
    parts = ", ".join(
        f"K={row['clients']}: {_num(row['tps_ratio'] and row['tps_ratio'] * 100)}% t/s,"
        f" {_signed(row['ttft_p50_delta_ms'])} ms TTFT"
        for row in rows
    )
    met = all(row["tps_within"] and row["ttft_within"] for row in rows)
    return f"gateway against direct: {parts}: goal {'met' if met else 'NOT met'}"


def without_gaps(records: list[dict]) -> list[dict]:
    """The rounds as written: every gap is too many numbers, their p50/p95 per round instead."""
    written = []
    for record in records:
        kept = {key: value for key, value in record.items() if key != "gaps_ms"}
        kept["itl_ms"] = {"p50": _p(record["gaps_ms"], 0.5), "p95": _p(record["gaps_ms"], 0.95)}
        written.append(kept)
    return written


_TIMERS = re.compile(r"TR=(-?\d+) Tw=(-?\d+) Tc=(-?\d+) Tr=(-?\d+) Ta=(-?\d+)")


def haproxy_timings(log: str, user: str) -> dict:
    """HAProxy's own timers (ms, whole) over the log lines of ``user``'s answered requests
    (files/haproxy.cfg.j2's log-format): TR from the end of the TLS handshake to the whole
    request (headers and buffered body), Tw waiting in the queue, Tc connecting to the rig, Tr
    until the rig's response headers, Ta the whole request; their p50 and p95."""
    rows = [
        tuple(int(value) for value in match.groups())
        for line in log.splitlines()
        if f"user={user} " in line and " 200 " in line
        for match in [_TIMERS.search(line)]
        if match
    ]
    timings: dict = {"requests": len(rows)}
    for index, name in enumerate(("TR", "Tw", "Tc", "Tr", "Ta")):
        values = [row[index] for row in rows if row[index] >= 0]
        timings[name] = {"p50": percentile(values, 0.5), "p95": percentile(values, 0.95)}
    return timings


# --- the client: bench/load.py's, over TLS too --------------------------------------------------


def stale(sock) -> bool:
    """Whether an idle keep-alive connection's socket can no longer carry a request: gone, or
    readable while no request is out (the server closed it, or sent something unasked), as
    httpx's pool checks before reusing one. Over TLS, records that carry no data (TLS 1.3's
    session tickets, sent after the handshake) make it readable too: they are read here."""
    if sock is None:
        return True
    try:
        pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
        if not pending and not select.select([sock], [], [], 0)[0]:
            return False
    except (OSError, ValueError):  # closed under us
        return True
    if not isinstance(sock, ssl.SSLSocket) or pending:
        return True
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1)  # data unasked, or b"" at the end: no good either way
        return True
    except ssl.SSLWantReadError:  # only records without data: still good
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(timeout)


class BenchClient(Client):
    """bench/load.py's Client for http:// and https:// (a CA file to trust), its connect (the
    TCP and TLS handshake) timed apart. Both sides use this same code, so they differ only in
    what they reach.

    By default each request opens a connection of its own (as bench/load.py's do). With
    ``keep_alive`` (as httpx and the OpenAI SDKs do) connections are kept open and reused: a
    request takes an idle one (the most recently used first) and gives it back once its
    response is read to the end; ``keep`` holds the pool at K connections before a round, each
    warmed by a request of its own. A measured request opens a connection only when none is
    idle (``new_connection`` in its reply, its connect then in ``connect_s``): when the server
    closed the one it had (after its idle timeout, found in ``keep``, or after each answer, as
    llama-server does after a streamed one: then ``server_closes`` and no more warm-ups)."""

    def __init__(
        self,
        url: str,
        api_key: str,
        model: str,
        cafile: Path | None,
        timeout: float,
        keep_alive: bool = False,
    ):
        parts = urllib.parse.urlsplit(url)
        self.tls = parts.scheme == "https"
        if self.tls and not cafile:
            raise SystemExit(f"{url}: an https URL needs the certificate to trust")
        # load.Client checks the scheme, that the host is loopback, and sets the headers.
        super().__init__(urllib.parse.urlunsplit(parts._replace(scheme="http")), api_key, model)
        self.port = parts.port or (443 if self.tls else 80)
        self.context = ssl.create_default_context(cafile=str(cafile)) if self.tls else None
        self.timeout = timeout
        self.keep_alive = keep_alive
        self.idle: list[http.client.HTTPConnection] = []
        self.lock = threading.Lock()
        self.server_closes = False  # keep-alive: the server closes a connection after an answer

    def _connection(self) -> http.client.HTTPConnection:
        if self.tls:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=self.context
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _open(self) -> tuple[http.client.HTTPConnection, float]:
        connection = self._connection()
        started = time.perf_counter()
        try:
            connection.connect()
        except BaseException:
            connection.close()
            raise
        return connection, time.perf_counter() - started

    def _take_idle(self) -> http.client.HTTPConnection | None:
        with self.lock:
            while self.idle:
                connection = self.idle.pop()
                if not stale(connection.sock):
                    return connection
                connection.close()
        return None

    def _connect(self) -> tuple[http.client.HTTPConnection, dict]:
        connection = self._take_idle() if self.keep_alive else None
        if connection is not None:
            return connection, {"connect_s": 0.0, "new_connection": False}
        connection, seconds = self._open()
        return connection, {"connect_s": seconds, "new_connection": True}

    def _release(self, connection: http.client.HTTPConnection, finished: bool) -> None:
        # http.client drops the socket of a response that closes its connection; a server
        # that closes after each answer without saying so may not have closed it yet, and a
        # reuse would race its close (RemoteDisconnected, seen 1 run in 3 on a busy machine).
        reuse = self.keep_alive and not self.server_closes
        if reuse and finished and connection.sock is not None:
            with self.lock:
                self.idle.append(connection)
        else:
            connection.close()

    def keep(self, count: int, warm_up: str) -> int:
        """Keep-alive: hold ``count`` idle connections, each with one request behind it (the
        ``warm_up`` prompt, 4 tokens): close those the server closed while idle and any beyond
        ``count``, open the missing ones and send each its warm-up request. How many were
        opened. Between rounds only (the pool is not in use)."""
        with self.lock:
            alive = [connection for connection in self.idle if not stale(connection.sock)]
            for connection in self.idle:
                if connection not in alive:
                    connection.close()
            for connection in alive[count:]:
                connection.close()
            self.idle = alive[:count]
        if self.server_closes:
            return 0  # what was opened would be closed by its first answer: none kept
        opened = count - len(self.idle)
        for _ in range(opened):
            connection, _seconds = self._open()
            with self.lock:
                self.idle.append(connection)  # on top: the warm-up request takes it
            reply = self.request(warm_up, 4)
            if "error" in reply:
                raise BenchError(f"the warm-up of a new connection failed: {reply['error']}")
        time.sleep(SETTLE_S)
        with self.lock:
            alive = [connection for connection in self.idle if not stale(connection.sock)]
            for connection in self.idle:
                if connection not in alive:
                    connection.close()
            self.idle = alive
        # The server closed what it had just answered on (llama-server does so after each
        # streamed answer): its requests open connections of their own, as httpx's would.
        self.server_closes = len(self.idle) < count
        return opened

    def close(self) -> None:
        with self.lock:
            for connection in self.idle:
                connection.close()
            self.idle = []


class Recorder:
    """A client that keeps every reply ``served`` got (it reports only percentiles) and numbers
    the prompts across rounds: ``served`` numbers them from 0 in each call, and a prompt seen
    before would find its whole prefix cached in a slot (llama-server's cache_prompt) and skip
    prompt processing, the time to first token measured."""

    def __init__(self, client: BenchClient, serials: Iterator[int]):
        self.client = client
        self.serials = serials
        self.replies: list[dict] = []

    def request(self, text: str, tokens: int) -> dict:
        body = text.split("\n", 1)[1]  # bench.load.prompt: "Request N.\n" and the words
        reply = self.client.request(f"Request {next(self.serials)}.\n{body}", tokens)
        self.replies.append(reply)
        return reply


# --- the sandbox run ----------------------------------------------------------------------------


class BenchError(Exception):
    """The benchmark could not measure."""


class RunTimeout(BenchError):
    """The whole run's bound passed."""


def _say(message: str) -> None:
    print(f"gateway bench: {message}", file=sys.stderr, flush=True)


def _key(directory: Path, name: str) -> Path:
    path = directory / f"{name}.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def write_inventory(
    path: Path, infos: dict, keys: dict, threads: int, max_body_kib: int | None = None
) -> Path:
    """The demo rig on the rig sandbox (4 slots, alias smollm2, ``threads`` decode threads,
    speed unmeasured) and the gateway in front of it (``gateway.max_body_kib``, hence HAProxy's
    tune.bufsize, set when given; else group_data/all.yml's)."""
    demo = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    rig = demo["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    rig["ssh"].update(port=SSH_PORTS[RIG], known_hosts=str(infos[RIG].known_hosts_path))
    rig["server"].update(
        port=RIG_PORT,
        api_key_file=str(keys["rig"]),
        parallel=SLOTS,
        alias=MODEL,
        threads=threads,
        max_slowdown=None,
    )
    gateway = {
        "ssh": {
            **rig["ssh"],
            "port": SSH_PORTS[GATEWAY],
            "known_hosts": str(infos[GATEWAY].known_hosts_path),
        },
        "role": "gateway",
        "gateway": {
            "host": "127.0.0.1",
            "port": GATEWAY_PORT,
            "rig_key_file": str(keys["gateway"]),
            "fronts": "rigs",
            "users": [{"name": USER, "key_file": str(keys[USER])}],
            "metrics": {"host": "127.0.0.1", "port": METRICS_PORT},
        },
    }
    if max_body_kib is not None:
        gateway["gateway"]["max_body_kib"] = max_body_kib
    document = {
        "all": {
            "children": {
                "rigs": {"hosts": {RIG: rig}},
                "gateways": {"hosts": {GATEWAY_HOST: gateway}},
            }
        }
    }
    path.write_text(yaml.safe_dump(document))
    return path


def _ssh(info, command: str) -> str:
    from llamarig_sandbox import sshaccess

    result = sshaccess.ssh(info, command, timeout=120)
    return (result.stdout or result.stderr).strip()


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def in_machine(pid: int, machines: set[str]) -> str | None:
    """The sandbox (systemd-nspawn ``--machine=NAME``) among ``machines`` that ``pid`` runs in
    or is the supervisor of, found up its parents; None for any other process. (A sandbox's
    processes show "/" as their root here: they are in a mount namespace of their own.)"""
    while pid > 1:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        for argument in argv:
            if argument.startswith(b"--machine=") and argument[10:].decode() in machines:
                return argument[10:].decode()
        pid = _parent(pid)
    return None


def sandbox_pids(machine_name: str, name: str) -> list[int]:
    """The pids of the processes called ``name`` in sandbox ``machine_name``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != name:
                continue
        except OSError:
            continue
        if in_machine(int(entry.name), {machine_name}):
            pids.append(int(entry.name))
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """User plus system CPU seconds the processes have used (those that still run)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return total / ticks


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot (/proc/stat)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


class CpuMeter:
    """CPU seconds used by the measured processes, this process (the clients) and the whole
    machine (/proc/stat, every CPU)."""

    def __init__(self, pids: dict[str, list[int]]):
        self.pids = pids
        self.ticks = os.sysconf("SC_CLK_TCK")

    def sample(self) -> dict[str, float]:
        busy, total = machine_busy()
        sample = {name: cpu_seconds(found) for name, found in self.pids.items()}
        sample.update(
            clients=time.process_time(), machine=busy / self.ticks, capacity=total / self.ticks
        )
        return sample

    @staticmethod
    def used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        """What each used between two samples; ``rest``: the machine's busy CPU time that none
        of them used (other work on this machine), ``rest_share`` of all CPUs' time."""
        used = {name: round(after[name] - before[name], 3) for name in before}
        ours = sum(value for name, value in used.items() if name not in ("machine", "capacity"))
        used["rest"] = round(max(0.0, used["machine"] - ours), 3)
        used["rest_share"] = round(used["rest"] / used["capacity"], 3) if used["capacity"] else 0
        return used


def wait_quiet(meter: CpuMeter, bound_s: float) -> dict:
    """Wait (up to ``bound_s``) for a second in which work outside this run used at most
    QUIET_CPU of a CPU."""
    started = time.monotonic()
    while True:
        before = meter.sample()
        time.sleep(1)
        rest = CpuMeter.used(before, meter.sample())["rest"]
        waited = round(time.monotonic() - started, 1)
        if rest <= QUIET_CPU or waited >= bound_s:
            return {"waited_s": waited, "quiet": rest <= QUIET_CPU, "rest_cpu_s": rest}


def others(machines: set[str]) -> list[str]:
    """Processes that may take CPU time, outside this run's sandboxes (and not this one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if not command or not BUSY.search(command) or in_machine(int(entry.name), machines):
            continue
        found.append(f"{entry.name} {command[:160]}")
    return sorted(found, key=lambda line: int(line.split()[0]))


def blocking(command: str) -> bool:
    """Whether a process's command line is one this run waits for: the gateway sandbox test
    (what ``pgrep -f test_sandbox_gateway`` finds), or any pytest run of a sandbox test."""
    return OTHER_BENCH in command or ("pytest" in command and "sandbox" in command)


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        pid = _parent(pid)
    return pids


def sandbox_tests() -> list[str]:
    """The processes this run waits for (not this process or those that started it)."""
    mine = _ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if command and blocking(command):
            found.append(f"{entry.name} {command[:160]}")
    return found


def wait_for_others(bound_s: float, poll_s: float = 30) -> dict:
    """Wait while the gateway sandbox test or another sandbox test runs (bounded, a look every
    ``poll_s``); how long, and whether they ended."""
    started = time.monotonic()
    while True:
        running = sandbox_tests()
        waited = round(time.monotonic() - started, 1)
        if not running:
            return {"waited_s": waited, "still_running": False}
        if waited >= bound_s:
            return {"waited_s": waited, "still_running": True, "processes": running}
        if waited == 0:
            _say(f"sandbox tests run ({'; '.join(running)[:300]}): waiting up to {bound_s:.0f} s")
        time.sleep(poll_s)


def warm(client: BenchClient, what: str, bound_s: float) -> dict:
    """Requests until one answers (a 503 while the rig loads is waited for, bounded)."""
    deadline = time.monotonic() + bound_s
    while True:
        reply = client.request(prompt(-1, 100), 4)
        if "error" not in reply:
            return reply
        if time.monotonic() > deadline:
            raise BenchError(f"{what} did not answer within {bound_s:.0f} s: {reply['error']}")
        time.sleep(1)


def versions(infos: dict) -> dict:
    from llamarig.config import defaults

    return {
        "python": platform.python_version(),
        "openssl_client": ssl.OPENSSL_VERSION,
        "haproxy": _ssh(infos[GATEWAY], "haproxy -v | head -n1"),
        "gateway_os": _ssh(infos[GATEWAY], ". /etc/os-release; echo $PRETTY_NAME"),
        "gateway_openssl": _ssh(infos[GATEWAY], "openssl version"),
        "rig_os": _ssh(infos[RIG], ". /etc/os-release; echo $PRETTY_NAME"),
        "llama_cpp": defaults()["llama_cpp"]["commit"][:12],
        "llama_server": _ssh(
            infos[RIG], "/opt/llamarig/current/bin/llama-server --version 2>&1 | grep -i version"
        ),
    }


def measure(args, infos: dict, keys: dict, cafile: Path) -> dict:
    direct = BenchClient(
        DIRECT_URL,
        keys["rig"].read_text().strip(),
        MODEL,
        None,
        args.request_timeout,
        keep_alive=args.keep_alive,
    )
    gateway = BenchClient(
        GATEWAY_URL,
        keys[USER].read_text().strip(),
        MODEL,
        cafile,
        args.request_timeout,
        keep_alive=args.keep_alive,
    )
    clients = {"direct": direct, "gateway": gateway}
    try:
        return _measure(args, clients)
    finally:
        direct.close()
        gateway.close()


def _measure(args, clients: dict[str, BenchClient]) -> dict:
    warmed = {}
    for side, client in clients.items():
        warm(client, side, 120)
        for _ in range(3):  # the caches, the first handshake, the rig's slots
            time.sleep(SETTLE_S)  # kept alive: the server's close of the last one, if it does
            warmed[side] = client.request(prompt(-2, args.prompt_words), 16)
        if "error" in warmed[side]:
            raise BenchError(f"{side}: {warmed[side]['error']}")
    pids = {
        "haproxy": sandbox_pids(GATEWAY, "haproxy"),
        "llama-server": sandbox_pids(RIG, "llama-server"),
        # HAProxy's log line per request and llama-server's lines go to the journals
        "journald": sandbox_pids(GATEWAY, "systemd-journal") + sandbox_pids(RIG, "systemd-journal"),
    }
    if not pids["haproxy"] or not pids["llama-server"]:
        raise BenchError(f"HAProxy or llama-server not found in the sandboxes: {pids}")
    _say(f"processes measured: {pids}")
    meter = CpuMeter(pids)
    records: list[dict] = []
    serials = itertools.count()  # every measured request its own prompt, on both sides
    waits, paused = [], []
    first = meter.sample()
    for clients_at_once, pair, side in plan(args.clients, args.rounds):
        if time.monotonic() > args.deadline:
            raise RunTimeout("the run's bound passed while measuring")
        if side == order(pair)[0]:
            if sandbox_tests():  # one started meanwhile: its boot and converge are not quiet
                left = args.deadline - time.monotonic() - 600
                paused.append(
                    {"clients": clients_at_once, "pair": pair}
                    | wait_for_others(max(0.0, min(args.wait_others, left)))
                )
            waits.append(wait_quiet(meter, args.quiet_wait))
        recorder = Recorder(clients[side], serials)
        # keep-alive: K open connections, a new one (the server closed one while idle: the
        # rig after 5 s, HAProxy after 10 s) warmed by a request before the round
        opened = (
            clients[side].keep(clients_at_once, prompt(-3, args.prompt_words))
            if args.keep_alive
            else 0
        )
        before = meter.sample()
        row = served(
            recorder, clients_at_once, 1, args.tokens, args.prompt_words, args.request_timeout
        )
        record = round_record(clients_at_once, pair, side, row, recorder.replies)
        record["cpu_s"] = CpuMeter.used(before, meter.sample())
        if args.keep_alive:
            record["warmed_connections"] = opened
        records.append(record)
        _say(
            f"K={clients_at_once} pair {pair + 1}/{args.rounds} {side:>7}:"
            f" {record['tps'] or 0:.1f} t/s, TTFT median"
            f" {statistics.median(record['ttft_ms']) if record['ttft_ms'] else 0:.1f} ms,"
            f" errors {record['errors']}, other CPU {record['cpu_s']['rest_share']:.0%}"
            + (
                f", connections opened: {opened} warmed before, {record['new_connections']} in"
                if args.keep_alive
                else ""
            )
        )
    return {
        "records": records,
        "prompt_tokens": warmed["direct"].get("prompt_tokens"),
        "cpu_s": CpuMeter.used(first, meter.sample()),
        "quiet_waits_s": [wait["waited_s"] for wait in waits],
        "quiet_not_reached": sum(1 for wait in waits if not wait["quiet"]),
        "paused_for_sandbox_tests": paused,
        "others_during": others({GATEWAY, RIG}),
    }


def answers_paris(client: BenchClient) -> str:
    """The question of the demo rig through ``client`` (a non-streamed check of the route)."""
    connection = client._connection()
    try:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": "What is the capital of France? Answer in one word."}
            ],
            "max_tokens": 8,
            "temperature": 0,
        }
        connection.request("POST", "/v1/chat/completions", json.dumps(body), client.headers)
        response = connection.getresponse()
        text = response.read().decode()
        if response.status != 200:
            raise BenchError(f"HTTP {response.status}: {text[:300]}")
        return json.loads(text)["choices"][0]["message"]["content"].strip()
    finally:
        connection.close()


def idle_connects(cafile: Path, count: int = 50) -> dict:
    """With nothing else to do: ``count`` TCP connects straight to the rig and ``count`` TLS
    handshakes with the gateway (p50/p95 ms), one after another."""
    times: dict[str, list[float]] = {"direct_tcp": [], "gateway_tls": []}
    context = ssl.create_default_context(cafile=str(cafile))
    for _ in range(count):
        for name, connection in (
            ("direct_tcp", http.client.HTTPConnection("127.0.0.1", RIG_PORT, timeout=30)),
            (
                "gateway_tls",
                http.client.HTTPSConnection("127.0.0.1", GATEWAY_PORT, timeout=30, context=context),
            ),
        ):
            started = time.perf_counter()
            try:
                connection.connect()
                times[name].append((time.perf_counter() - started) * 1000)
            finally:
                connection.close()
    return {
        name: {"p50": _p(values, 0.5), "p95": _p(values, 0.95)} for name, values in times.items()
    }


def tls_session(cafile: Path) -> dict:
    """The TLS version and cipher the gateway agrees with this client."""
    context = ssl.create_default_context(cafile=str(cafile))
    connection = http.client.HTTPSConnection("127.0.0.1", GATEWAY_PORT, timeout=30, context=context)
    try:
        connection.connect()
        return {"version": connection.sock.version(), "cipher": connection.sock.cipher()[0]}
    finally:
        connection.close()


def run(args) -> dict:
    from llamarig_sandbox import sandbox

    dirty = (
        " (with uncommitted changes)"
        if _git("status", "--porcelain", "--untracked-files=no")
        else ""
    )
    meta = {
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "--short=12", "HEAD") + dirty,
        "machine": machine(),
        "nproc": os.cpu_count(),
        "load_average_start": [round(value, 2) for value in os.getloadavg()],
    }
    infos = {}
    # The other sandbox tests boot and converge their own machines on the same CPUs.
    meta["others_before_boot"] = wait_for_others(args.wait_others)
    if meta["others_before_boot"]["still_running"]:
        raise BenchError(f"sandbox tests still run: {meta['others_before_boot']['processes']}")
    try:
        with tempfile.TemporaryDirectory(prefix="gateway-bench-") as name:
            directory = Path(name)
            keys = {who: _key(directory, who) for who in ("rig", "gateway", USER)}
            for sandbox_name in (RIG, GATEWAY):
                sandbox.down(sandbox_name)
                _say(f"booting {sandbox_name} ({RELEASES[sandbox_name]})")
                infos[sandbox_name] = sandbox.up(
                    release=RELEASES[sandbox_name],
                    name=sandbox_name,
                    ssh_port=SSH_PORTS[sandbox_name],
                )
            inventory = write_inventory(
                directory / "bench.yml", infos, keys, args.threads, args.max_body_kib
            )
            _say("converging the rig and the gateway")
            timeout = max(60, min(CONVERGE_TIMEOUT_S, args.deadline - time.monotonic()))
            seconds, result = pyinfra(inventory, "inventory.py", "deploy.py", timeout=timeout)
            log = deploy_log(args.out)  # pyinfra's output: never a key
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(result.stdout + result.stderr)
            if result.returncode != 0:
                raise BenchError(f"the deploy failed (exit {result.returncode}): see {log}")
            meta["converge_s"] = round(seconds, 1)
            cafile = directory / "gateway-certs" / f"{GATEWAY_HOST}.crt"
            if not cafile.exists():
                raise BenchError(f"the deploy left no certificate at {cafile}")
            meta["versions"] = versions(infos)
            meta["haproxy_bufsize"] = _ssh(
                infos[GATEWAY], "grep -h -m1 tune.bufsize /etc/haproxy/haproxy.cfg"
            )
            for side, client in (
                (
                    "direct",
                    BenchClient(DIRECT_URL, keys["rig"].read_text().strip(), MODEL, None, 60),
                ),
                (
                    "gateway",
                    BenchClient(GATEWAY_URL, keys[USER].read_text().strip(), MODEL, cafile, 60),
                ),
            ):
                warm(client, side, 120)
                said = answers_paris(client)
                if "paris" not in said.lower():
                    raise BenchError(f"{side}: the rig answered {said!r}, not Paris")
            meta["tls"] = tls_session(cafile)
            meta["others"] = wait_for_others(args.wait_others)
            meta["others_before"] = others({GATEWAY, RIG})
            meta["connect_idle_ms"] = idle_connects(cafile)
            meta["load_average_before"] = [round(value, 2) for value in os.getloadavg()]
            _say(f"measuring; load average {meta['load_average_before']}")
            since = int(time.time()) - 1
            measured = measure(args, infos, keys, cafile)
            measured["haproxy_timings_ms"] = haproxy_timings(
                _ssh(infos[GATEWAY], f"journalctl -u haproxy --no-pager -o cat --since @{since}"),
                USER,
            )
            meta["load_average_after"] = [round(value, 2) for value in os.getloadavg()]
            meta["others_during"] = measured.pop("others_during")
    finally:
        signal.alarm(0)  # the teardown is not cut short
        for sandbox_name in (GATEWAY, RIG):
            try:
                sandbox.down(sandbox_name)
            except Exception as error:  # noqa: BLE001 - say it, take the other down too
                _say(f"could not take {sandbox_name} down: {error}")
    meta["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    records = measured.pop("records")
    rows = [compare(k, records) for k in args.clients]
    return {
        "meta": meta,
        "setup": {
            "direct": DIRECT_URL + " (plain HTTP, the rig's own key)",
            "gateway": GATEWAY_URL + " (TLS to HAProxy, a user's key; HAProxy to the rig over"
            " plain HTTP with the gateway's key)",
            "model": "SmolLM2-135M-Instruct Q4_1 (alias smollm2)",
            "slots": SLOTS,
            "threads": args.threads,
            "tokens": args.tokens,
            "prompt_words": args.prompt_words,
            "rounds": args.rounds,
            "clients": args.clients,
            "request_timeout_s": args.request_timeout,
            "connections": (
                "keep-alive: each client keeps one open connection for its requests, warmed"
                " by one request when opened; TTFT from sending the request"
                if args.keep_alive
                else "a new connection per request; TTFT from opening it"
            ),
            "max_body_kib": args.max_body_kib or 1024,
            **measured,
        },
        "goal": {"max_tps_loss": MAX_TPS_LOSS, "max_ttft_delta_ms": MAX_TTFT_DELTA_MS},
        "results": rows,
        "rounds": without_gaps(records),
    }


def deploy_log(out: Path) -> Path:
    """Where a run writes pyinfra's output: deploy.log beside results.json, deploy-NAME.log
    beside results-NAME.json (another run's log is kept)."""
    name = out.stem.removeprefix("results").removeprefix("-")
    return out.with_name(f"deploy-{name}.log" if name else "deploy.log")


def _alarm(_signum, _frame):
    raise RunTimeout("the run's bound passed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gateway", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--out", type=Path, default=PROJECT / "bench/runs/gateway-sandbox/results.json"
    )
    parser.add_argument("--clients", type=_clients, default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=20, help="pairs of rounds per K")
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    parser.add_argument(
        "--prompt-words",
        type=int,
        default=20,
        help="words per prompt (short: the rig's prompt processing is what varies most in the"
        " time to first token, and the gateway's cost does not depend on it)",
    )
    parser.add_argument("--threads", type=int, default=1, help="the rig's server.threads")
    parser.add_argument(
        "--keep-alive",
        action="store_true",
        help="each client keeps one connection open for all its requests (as httpx does),"
        " warmed by one request; by default every request opens a connection of its own",
    )
    parser.add_argument(
        "--max-body-kib",
        type=int,
        help="the gateway's gateway.max_body_kib for the run (HAProxy's tune.bufsize is it"
        " x 1024 + 32 KiB); by default group_data/all.yml's, 1024",
    )
    parser.add_argument("--request-timeout", type=float, default=120, help="seconds per request")
    parser.add_argument(
        "--wait-others",
        type=float,
        default=1800,
        help=f"seconds to wait for {OTHER_BENCH} and other sandbox tests (before booting the"
        " sandboxes and again before measuring)",
    )
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=60,
        help="seconds to wait before each pair for other work on the machine to pause",
    )
    parser.add_argument("--max-minutes", type=float, default=60, help="the whole run's bound")
    args = parser.parse_args(argv)
    if max(args.clients) > SLOTS:
        parser.error(f"--clients: at most {SLOTS} (the rig's slots; more would queue)")
    if not 1 <= args.rounds <= 50 or not 1 <= args.tokens <= 400 or not 1 <= args.threads <= 64:
        parser.error("--rounds 1..50, --tokens 1..400 (the slot's context), --threads 1..64")
    if args.max_body_kib is not None and not 16 <= args.max_body_kib <= 65536:
        parser.error("--max-body-kib: 16..65536 (the inventory's bounds)")
    if os.geteuid() != 0:
        parser.error("the sandboxes need root (systemd-nspawn)")
    args.deadline = time.monotonic() + args.max_minutes * 60
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(args.max_minutes * 60) + 120)  # the last resort; the loop checks first
    from llamarig_sandbox.processes import SandboxError

    try:
        results = run(args)
    except (BenchError, SandboxError, subprocess.TimeoutExpired) as error:
        print(f"gateway bench: failed: {error}", file=sys.stderr)
        return 2
    finally:
        signal.alarm(0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(markdown_table(results["results"]), end="")
    print(f"connections: {results['setup']['connections']}")
    print(f"gateway: {results['meta'].get('haproxy_bufsize')}")
    print(summary_line(results["results"]))
    ok = all(row["tps_within"] and row["ttft_within"] for row in results["results"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
