"""bench/gateway.py without a sandbox: the A/B order, one round's record, the summaries, the
ratio and the TTFT difference (also per pair), the goal, the table; its client against a
streaming server on loopback, in plain HTTP and over TLS with a CA file to trust, a connection
per request or kept alive; what it waits for, its inventory and its options."""

import http.server
import json
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time

import pytest

from bench import gateway


def test_the_order_flips_in_every_pair_and_each_k_gets_its_pairs():
    assert gateway.order(0) == ("direct", "gateway")
    assert gateway.order(1) == ("gateway", "direct")
    assert gateway.plan([1, 4], 2) == [
        (1, 0, "direct"), (1, 0, "gateway"), (1, 1, "gateway"), (1, 1, "direct"),
        (4, 0, "direct"), (4, 0, "gateway"), (4, 1, "gateway"), (4, 1, "direct"),
    ]  # fmt: skip


def reply(ttft_s: float, gaps_s: list[float], connect_s: float = 0.001) -> dict:
    return {"ttft_s": ttft_s, "connect_s": connect_s, "gaps_s": gaps_s, "tokens": 4}


def test_a_round_record_keeps_every_reply_in_ms_and_counts_errors():
    row = {"aggregate_tps": 50.0, "errors": 1, "first_error": "HTTP 503: b''"}
    replies = [reply(0.1, [0.01, 0.02]), {"error": "HTTP 503: b''"}, reply(0.2, [0.03])]
    record = gateway.round_record(2, 3, "gateway", row, replies)
    assert record["ttft_ms"] == [100.0, 200.0]
    assert record["connect_ms"] == [1.0, 1.0]
    assert record["gaps_ms"] == pytest.approx([10.0, 20.0, 30.0])
    assert (record["clients"], record["pair"], record["side"]) == (2, 3, "gateway")
    assert (record["tps"], record["errors"], record["tokens"]) == (50.0, 1, [4, 4])


def record(k, pair, side, tps, ttft, gaps=(10.0,), errors=0, connect=()):
    return {"clients": k, "pair": pair, "side": side, "tps": tps, "ttft_ms": list(ttft),
            "connect_ms": list(connect), "gaps_ms": list(gaps), "errors": errors}  # fmt: skip


def test_a_side_is_the_median_round_and_the_percentiles_of_every_request():
    records = [
        record(2, 0, "direct", 100.0, [10, 20], gaps=[5, 6, 7]),
        record(2, 1, "direct", 90.0, [30, 40], gaps=[8]),
        record(2, 2, "direct", None, [50], gaps=[], errors=1),  # a round with an error has no rate
    ]
    summary = gateway.summarize(records)
    assert summary["tps"] == 95.0 and summary["rounds"] == 2
    assert summary["ttft_ms"] == {"p50": 30, "p95": 50}  # nearest rank over 5 requests
    assert summary["itl_ms"] == {"p50": 6, "p95": 8, "max": 8}
    assert summary["connect_ms"] == {"p50": None, "p95": None}
    assert (summary["requests"], summary["errors"]) == (6, 1)


def test_the_ratio_the_ttft_difference_and_the_goal():
    records = [
        record(1, 0, "direct", 100.0, [200.0], gaps=[10.0]),
        record(1, 0, "gateway", 99.0, [203.0], gaps=[10.5]),
        record(1, 1, "gateway", 97.0, [206.0], gaps=[10.5]),
        record(1, 1, "direct", 100.0, [200.0], gaps=[10.0]),
        record(4, 0, "direct", 200.0, [300.0]),
        record(4, 0, "gateway", 190.0, [310.0]),
    ]
    one = gateway.compare(1, records)
    assert one["direct"]["tps"] == 100.0 and one["gateway"]["tps"] == 98.0
    assert one["tps_ratio"] == 0.98 and one["tps_loss_pct"] == 2.0
    assert one["ttft_p50_delta_ms"] == 3.0  # nearest-rank p50 of 203 and 206
    assert one["itl_p50_delta_ms"] == 0.5
    assert one["paired"] == {
        "pairs": 2,
        "tps_ratio": 0.98,
        "tps_ratio_sd": 0.0141,  # the spread of the pairs: sample standard deviations
        "tps_ratio_each": [0.99, 0.97],
        "ttft_delta_ms": 4.5,
        "ttft_delta_sd_ms": 2.12,
        "ttft_delta_each_ms": [3.0, 6.0],
    }
    assert one["tps_within"] and one["ttft_within"]  # 2% and 3 ms: at the bounds, within
    four = gateway.compare(4, records)
    assert four["tps_ratio"] == 0.95 and four["ttft_p50_delta_ms"] == 10.0
    assert not four["tps_within"] and not four["ttft_within"]


def test_a_side_without_a_good_round_has_no_ratio_and_misses_the_goal():
    records = [record(2, 0, "direct", 80.0, [100.0]), record(2, 0, "gateway", None, [], errors=2)]
    row = gateway.compare(2, records)
    assert row["tps_ratio"] is None and row["ttft_p50_delta_ms"] is None
    assert row["paired"]["pairs"] == 0 and row["errors"] == 2
    assert not row["tps_within"] and not row["ttft_within"]
    table = gateway.markdown_table([row])
    assert (
        "| 2 | 80.0 | - | - (-) |" in table and "| 0 of 0: -, - | t/s MISSED TTFT MISSED" in table
    )


def test_pairs_with_other_work_in_either_round_are_left_out_of_the_quiet_figures():
    def busy(record_, share):
        record_["cpu_s"] = {"rest_share": share}
        return record_

    records = [
        busy(record(1, 0, "direct", 100.0, [200.0]), 0.01),
        busy(record(1, 0, "gateway", 99.0, [202.0]), 0.04),
        busy(record(1, 1, "gateway", 50.0, [400.0]), 0.30),  # a test suite ran beside it
        busy(record(1, 1, "direct", 100.0, [200.0]), 0.02),
        record(1, 2, "direct", 100.0, [200.0]),  # no CPU record: counted as quiet
        record(1, 2, "gateway", 98.0, [204.0]),
    ]
    assert {(r["pair"], r["side"]) for r in gateway.quiet(records)} == {
        (0, "direct"), (0, "gateway"), (2, "direct"), (2, "gateway")
    }  # fmt: skip
    row = gateway.compare(1, records)
    assert row["paired"]["pairs"] == 3 and row["paired"]["tps_ratio"] == 0.98
    assert row["paired_quiet"]["pairs"] == 2 and row["paired_quiet"]["tps_ratio"] == 0.985
    assert row["paired_quiet"]["ttft_delta_each_ms"] == [2.0, 4.0]


def test_cpu_used_between_samples_and_what_other_work_took():
    before = {"haproxy": 1.0, "llama-server": 10.0, "clients": 2.0, "machine": 100.0,
              "capacity": 400.0}  # fmt: skip
    after = {"haproxy": 1.2, "llama-server": 14.0, "clients": 2.3, "machine": 105.0,
             "capacity": 408.0}  # fmt: skip
    used = gateway.CpuMeter.used(before, after)
    assert used["haproxy"] == 0.2 and used["llama-server"] == 4.0 and used["clients"] == 0.3
    assert used["rest"] == 0.5 and used["rest_share"] == round(0.5 / 8, 3)
    # A process counted by both (a sample's rounding) never makes the rest negative.
    after["machine"] = 103.0
    assert gateway.CpuMeter.used(before, after)["rest"] == 0.0
    sample = gateway.CpuMeter({"self": [os.getpid()]}).sample()
    assert sample["capacity"] >= sample["machine"] > 0 and sample["self"] > 0


def test_the_table_and_the_summary_line():
    records = [
        record(1, 0, "direct", 100.0, [200.0], connect=[0.2]),
        record(1, 0, "gateway", 99.5, [202.0], connect=[1.5]),
    ]
    rows = [gateway.compare(1, records)]
    table = gateway.markdown_table(rows)
    lines = table.splitlines()
    assert lines[0].count("|") == lines[1].count("|") == lines[2].count("|") == 13
    assert lines[2] == (
        "| 1 | 100.0 | 99.5 | 99.5% (99.5%) | 200.0 / 202.0 | +2.0 (+2.0) | 0.20 / 1.50 | - |"
        " 10.00 / 10.00 | 0 | 1 of 1: 99.5%, +2.0 | t/s ok TTFT ok |"
    )
    assert gateway.summary_line(rows) == (
        "gateway against direct: K=1: 99.5% t/s, +2.0 ms TTFT: goal met"
    )


def test_the_written_rounds_keep_the_gaps_percentiles_not_the_gaps():
    written = gateway.without_gaps([record(1, 0, "direct", 1.0, [1.0], gaps=[1, 2, 3, 4])])
    assert "gaps_ms" not in written[0] and written[0]["itl_ms"] == {"p50": 2, "p95": 4}


def test_the_inventory_has_one_rig_and_the_gateway_in_front_of_it(tmp_path):
    class Info:
        def __init__(self, name):
            self.known_hosts_path = f"/kh/{name}"

    infos = {gateway.RIG: Info("rig"), gateway.GATEWAY: Info("gw")}
    keys = {who: tmp_path / f"{who}.key" for who in ("rig", "gateway", gateway.USER)}
    path = gateway.write_inventory(tmp_path / "bench.yml", infos, keys, threads=1)
    import yaml

    document = yaml.safe_load(path.read_text())["all"]["children"]
    rig = document["rigs"]["hosts"][gateway.RIG]
    assert rig["ssh"]["port"] == 2251 and rig["ssh"]["known_hosts"] == "/kh/rig"
    assert rig["server"]["port"] == 8121 and rig["server"]["parallel"] == 4
    assert rig["server"]["threads"] == 1 and rig["server"]["max_slowdown"] is None
    assert rig["server"]["api_key_file"] == str(keys["rig"])
    assert rig["model"]["url"].startswith("http://127.0.0.1:")  # the sandbox's file server
    gw = document["gateways"]["hosts"]["gw"]
    assert gw["ssh"]["port"] == 2250 and gw["ssh"]["known_hosts"] == "/kh/gw"
    assert gw["role"] == "gateway" and gw["gateway"]["port"] == 8453
    assert gw["gateway"]["metrics"] == {"host": "127.0.0.1", "port": 8415}
    assert gw["gateway"]["users"] == [{"name": "bench", "key_file": str(keys["bench"])}]


# --- the client against a streaming server on loopback ------------------------------------------


class Streaming(http.server.BaseHTTPRequestHandler):
    """Answers a chat completion as llama-server streams one: three tokens, then the usage.
    HTTP/1.0: the connection closes after each answer."""

    seen: list[dict] = []

    def send(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Streaming.seen.append(
            {"auth": self.headers["Authorization"], "body": body, "port": self.client_address[1]}
        )
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if self.protocol_version == "HTTP/1.1":
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for word in ("Par", "is", "."):
            chunk = {"choices": [{"delta": {"content": word}}]}
            self.send(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 7}}
        self.send(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.send(b"")

    def log_message(self, *args):
        pass


class KeptAlive(Streaming):
    """The same answers chunked over HTTP/1.1, as llama-server's: the connection stays open
    between requests until it has been idle ``timeout`` seconds (cpp-httplib's: 5)."""

    protocol_version = "HTTP/1.1"
    timeout = 0.5

    def send(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()


def serve(context: ssl.SSLContext | None = None, handler=Streaming):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    if context:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def check_reply(answer: dict, new_connection: bool = True) -> None:
    assert "error" not in answer, answer
    assert answer["tokens"] == 3 and answer["prompt_tokens"] == 7 and len(answer["gaps_s"]) == 2
    assert 0 <= answer["connect_s"] <= answer["ttft_s"] <= answer["seconds"]
    assert answer["new_connection"] is new_connection
    if not new_connection:
        assert answer["connect_s"] == 0
    seen = Streaming.seen[-1]
    assert seen["auth"] == "Bearer k" and seen["body"]["model"] == "smollm2"
    assert seen["body"]["stream"] and seen["body"]["ignore_eos"]


def test_the_client_streams_over_plain_http():
    server = serve()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = gateway.BenchClient(url, "k", "smollm2", None, 10)
        check_reply(client.request("hello", 3))
    finally:
        server.shutdown()


def self_signed(cert, key) -> None:
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=gw",
         "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl")
def test_the_client_streams_over_tls_trusting_the_given_certificate(tmp_path):
    cert, key, other = tmp_path / "gw.crt", tmp_path / "gw.key", tmp_path / "other.crt"
    self_signed(cert, key)
    self_signed(other, tmp_path / "other.key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = serve(context)
    try:
        url = f"https://127.0.0.1:{server.server_address[1]}"
        check_reply(gateway.BenchClient(url, "k", "smollm2", cert, 10).request("hello", 3))
        # Without the certificate to trust, the handshake fails: an error, not an exception.
        untrusted = gateway.BenchClient(url, "k", "smollm2", other, 10)
        assert "CERTIFICATE_VERIFY_FAILED" in untrusted.request("hello", 3)["error"]
    finally:
        server.shutdown()


def test_the_client_refuses_https_without_a_certificate_and_a_remote_host():
    with pytest.raises(SystemExit, match="certificate"):
        gateway.BenchClient("https://127.0.0.1:8453", "k", "m", None, 10)
    with pytest.raises(SystemExit, match="loopback"):
        gateway.BenchClient("https://10.0.0.5:8453", "k", "m", gateway.PROJECT / "x.crt", 10)


def test_the_recorder_keeps_every_reply_and_never_sends_a_prompt_twice():
    sent = []

    class Echo:
        def request(self, text, tokens):
            sent.append(text)
            return {"text": text}

    serials = iter(range(100, 200))
    first, second = gateway.Recorder(Echo(), serials), gateway.Recorder(Echo(), serials)
    for recorder in (first, second):  # bench.load.served numbers from 0 in each call
        recorder.request(gateway.prompt(0, 5), 4)
        recorder.request(gateway.prompt(1, 5), 4)
    assert [text.split("\n")[0] for text in sent] == [
        "Request 100.", "Request 101.", "Request 102.", "Request 103."
    ]  # fmt: skip
    assert {text.split("\n")[1] for text in sent} == {gateway.prompt(0, 5).split("\n")[1]}
    assert [reply["text"] for reply in first.replies] == sent[:2]


def test_the_time_to_first_token_once_connected_is_compared_too():
    replies = [reply(0.100, [], connect_s=0.006), reply(0.110, [], connect_s=0.008)]
    row = {"aggregate_tps": 10.0, "errors": 0, "first_error": None}
    gw = gateway.round_record(1, 0, "gateway", row, replies)
    assert gw["after_connect_ms"] == [94.0, 102.0]
    direct = gateway.round_record(
        1, 0, "direct", row, [reply(0.095, [], 0.0005), reply(0.101, [], 0.0005)]
    )
    compared = gateway.compare(1, [direct, gw])
    assert compared["ttft_p50_delta_ms"] == 5.0  # nearest-rank p50: 95 and 100 ms
    assert compared["connect_p50_delta_ms"] == 5.5
    assert compared["after_connect_p50_delta_ms"] == -0.5


# files/haproxy.cfg.j2's log-format, as journald keeps it (-o cat)
HAPROXY_LOG = """\
127.0.0.1:50412 [07/Dec/2026:15:10:01.123] gateway~ user=bench model="smollm2" \
model_0/sandbox-gwb-rig 200 9000 POST HTTP/1.1 TR=1 Tw=0 Tc=0 Tr=160 Ta=1500 ---- 3/3/2/2/0 0/0
127.0.0.1:50414 [07/Dec/2026:15:10:01.125] gateway~ user=bench model="smollm2" \
model_0/sandbox-gwb-rig 200 9000 POST HTTP/1.1 TR=0 Tw=2 Tc=1 Tr=170 Ta=1600 ---- 3/3/2/2/0 0/0
127.0.0.1:50416 [07/Dec/2026:15:10:01.127] gateway~ user=bench model="smollm2" \
model_0/sandbox-gwb-rig 200 9000 POST HTTP/1.1 TR=3 Tw=0 Tc=0 Tr=180 Ta=1700 ---- 3/3/2/2/0 0/0
127.0.0.1:50418 [07/Dec/2026:15:10:02.000] gateway~ user=<NOSRV> model="-" \
gateway/<NOSRV> 401 200 POST HTTP/1.1 TR=0 Tw=-1 Tc=-1 Tr=-1 Ta=0 LR-- 1/1/0/0/0 0/0
127.0.0.1:50420 [07/Dec/2026:15:10:02.000] gateway~ user=alice model="smollm2" \
model_0/sandbox-gwb-rig 200 9000 POST HTTP/1.1 TR=9 Tw=9 Tc=9 Tr=900 Ta=9000 ---- 1/1/0/0/0 0/0
[WARNING]  (1) : Server model_0/sandbox-gwb-rig is UP.
"""


def test_haproxy_timers_of_the_users_answered_requests():
    timings = gateway.haproxy_timings(HAPROXY_LOG, "bench")
    assert timings["requests"] == 3
    assert timings["TR"] == {"p50": 1, "p95": 3}
    assert timings["Tw"] == {"p50": 0, "p95": 2} and timings["Tc"] == {"p50": 0, "p95": 1}
    assert timings["Tr"] == {"p50": 170, "p95": 180} and timings["Ta"]["p50"] == 1600
    assert gateway.haproxy_timings("", "bench")["TR"] == {"p50": None, "p95": None}


# --- keep-alive, and what the run waits for ------------------------------------------------------


def test_an_idle_socket_is_usable_until_its_peer_closes_it():
    mine, theirs = socket.socketpair()
    try:
        assert not gateway.stale(mine)
        theirs.sendall(b"x")  # something unasked: not a connection to send a request on
        assert gateway.stale(mine)
        mine.recv(1)
        theirs.close()
        assert gateway.stale(mine)  # readable: the end of the stream
    finally:
        mine.close()
    assert gateway.stale(mine)  # closed here
    assert gateway.stale(None)  # http.client dropped it


def keep_alive_run(url: str, cafile=None) -> None:
    client = gateway.BenchClient(url, "k", "smollm2", cafile, 10, keep_alive=True)
    try:
        assert client.keep(2, "warm") == 2  # two opened, each warmed by a request
        warm_ports = [seen["port"] for seen in Streaming.seen[-2:]]
        assert len(set(warm_ports)) == 2 and len(client.idle) == 2
        check_reply(client.request("hello", 3), new_connection=False)
        check_reply(client.request("hello", 3), new_connection=False)
        assert Streaming.seen[-1]["port"] == Streaming.seen[-2]["port"] == warm_ports[-1]
        assert client.keep(2, "warm") == 0 and client.keep(1, "warm") == 0
        assert len(client.idle) == 1
        time.sleep(1.0)  # past the server's idle timeout: it closes the connection
        assert client.keep(1, "warm") == 1
        check_reply(client.request("hello", 3), new_connection=False)
        client.close()
        assert client.idle == []
        check_reply(client.request("hello", 3), new_connection=True)  # none idle: a new one
    finally:
        client.close()


def test_kept_alive_connections_are_reused_and_replaced_once_the_server_closes_them():
    server = serve(handler=KeptAlive)
    try:
        keep_alive_run(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()


@pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl")
def test_kept_alive_connections_are_reused_over_tls(tmp_path):
    cert, key = tmp_path / "gw.crt", tmp_path / "gw.key"
    self_signed(cert, key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = serve(context, KeptAlive)
    try:
        keep_alive_run(f"https://127.0.0.1:{server.server_address[1]}", cert)
    finally:
        server.shutdown()


class ClosesAfterStream(KeptAlive):
    """llama-server's way: HTTP/1.1 and chunked, no "Connection: close", but the connection is
    closed once a streamed answer is done."""

    def do_POST(self):  # noqa: N802 - http.server's name
        super().do_POST()
        self.close_connection = True


@pytest.mark.parametrize("handler", [Streaming, ClosesAfterStream])
def test_a_server_that_closes_every_connection_gets_a_new_one_per_request(handler):
    server = serve(handler=handler)  # Streaming: HTTP/1.0, says it closes after each answer
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = gateway.BenchClient(url, "k", "smollm2", None, 10, keep_alive=True)
        assert client.keep(2, "warm") == 2 and client.server_closes and client.idle == []
        assert client.keep(2, "warm") == 0  # no more warm-ups: they would be closed too
        for _ in range(2):
            check_reply(client.request("hello", 3), new_connection=True)
        assert Streaming.seen[-1]["port"] != Streaming.seen[-2]["port"]
    finally:
        server.shutdown()


def test_bench_loads_own_client_still_opens_a_connection_per_request():
    server = serve(handler=KeptAlive)
    try:
        client = gateway.Client(f"http://127.0.0.1:{server.server_address[1]}", "k", "smollm2")
        for _ in range(2):
            answer = client.request("hello", 3)
            assert "error" not in answer and answer["tokens"] == 3 and "connect_s" not in answer
        assert Streaming.seen[-1]["port"] != Streaming.seen[-2]["port"]
    finally:
        server.shutdown()


def test_a_round_counts_the_requests_that_opened_a_connection():
    row = {"aggregate_tps": 50.0, "errors": 0, "first_error": None}
    kept = [{**reply(0.1, [0.01], 0.0), "new_connection": False}] * 3
    record_ = gateway.round_record(4, 0, "gateway", row, [*kept, reply(0.2, [0.01], 0.004)])
    assert record_["new_connections"] == 1  # a reply that does not say: a new connection
    assert record_["connect_ms"] == [0.0, 0.0, 0.0, 4.0]
    assert gateway.summarize([record_, record(4, 1, "gateway", 50.0, [1.0, 2.0])])[
        "new_connections"
    ] == 3  # fmt: skip


@pytest.mark.parametrize(
    ("command", "waits"),
    [
        (
            "timeout 3000 .venv/bin/pytest -p no:cacheprovider tests/test_sandbox_gateway.py -x",
            True,
        ),
        ("python3 -m pytest llamarig/checks --hosts=ssh://llamarig-sandbox-gw-rig-a", True),
        ("python -m pytest tests/test_sandbox_converge.py", True),
        ("/bin/sh -c test_sandbox_gateway", True),  # whatever pgrep -f finds
        (".venv/bin/pytest -q tests/test_bench_gateway.py", False),
        ("python -m llamarig_sandbox.fileserver --root /var/cache/llamarig/www", False),
        (".venv/bin/python -m bench.gateway --out bench/runs/gateway-sandbox/x.json", False),
    ],
)
def test_the_run_waits_for_sandbox_tests_only(command, waits):
    assert gateway.blocking(command) is waits


def test_the_deploy_log_of_a_run_is_named_after_its_results():
    runs = gateway.PROJECT / "bench/runs/gateway-sandbox"
    assert gateway.deploy_log(runs / "results.json") == runs / "deploy.log"
    assert gateway.deploy_log(runs / "results-keepalive.json") == runs / "deploy-keepalive.log"
    assert gateway.deploy_log(runs / "other.json") == runs / "deploy-other.log"


def test_the_inventory_sets_the_gateways_body_limit_when_asked(tmp_path):
    import yaml

    class Info:
        known_hosts_path = "/kh"

    infos = {gateway.RIG: Info(), gateway.GATEWAY: Info()}
    keys = {who: tmp_path / f"{who}.key" for who in ("rig", "gateway", gateway.USER)}
    for body, expected in ((None, None), (64, 64)):
        path = gateway.write_inventory(tmp_path / "bench.yml", infos, keys, 1, max_body_kib=body)
        hosts = yaml.safe_load(path.read_text())["all"]["children"]["gateways"]["hosts"]
        assert hosts["gw"]["gateway"].get("max_body_kib") == expected


@pytest.mark.parametrize("bad", ["8", "70000"])
def test_a_body_limit_out_of_the_inventorys_bounds_is_refused(bad, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gateway.main(["--max-body-kib", bad])
    assert exit_info.value.code == 2
    assert "--max-body-kib: 16..65536" in capsys.readouterr().err
