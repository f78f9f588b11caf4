"""`llamarig status` on hosts that run the team gateway, without a gateway: the probe of a
gateway alone asks HAProxy and no llama-server, a rig that runs the gateway asks both; real
`show stat` answers of HAProxy 2.6 become each model's rigs (state, requests now, queued,
errors, sent) and the frontend's totals; the certificate's fingerprint is openssl's; `--json`
carries it all; and a hostile or broken gateway (no socket, garbage CSV, escape sequences, a
huge line, non-numbers) becomes a note and escaped text, never a traceback. With haproxy and
socat installed, the probe's own lines also read a live HAProxy on loopback.

test_sandbox_gateway deploys the same kind of team for real."""

from __future__ import annotations

import http.server
import json
import secrets
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

from llamarig.cli import main
from llamarig.config import load_inventory
from llamarig.onhost import hostpaths
from llamarig.serving import gateway_status, status

# Captured from HAProxy 2.6.12 (Debian bookworm) by `echo 'show stat' | socat ...`: a gateway of
# files/haproxy.cfg.j2's shape with model_0 (smollm2) on rig-a (up, 2 slots) and rig-b (a closed
# port), model_1 (tiny) on rig-b alone. BUSY: 3 requests to smollm2 at once (rig-a answering 2,
# 1 queued in the backend), 4 answered by the gateway itself (401s and 404s). DRAINED: later,
# rig-a set to drain and model_1/rig-b disabled (MAINT).
SHOW_STAT_BUSY = (
    "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,"
    "wredis,status,weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttl"
    "e,lbtot,tracked,type,rate,rate_lim,rate_max,check_status,check_code,check_duration,hrsp_"
    "1xx,hrsp_2xx,hrsp_3xx,hrsp_4xx,hrsp_5xx,hrsp_other,hanafail,req_rate,req_rate_max,req_to"
    "t,cli_abrt,srv_abrt,comp_in,comp_out,comp_byp,comp_rsp,lastsess,last_chk,last_agt,qtime,"
    "ctime,rtime,ttime,agent_status,agent_code,agent_duration,check_desc,agent_desc,check_ris"
    "e,check_fall,check_health,agent_rise,agent_fall,agent_health,addr,cookie,mode,algo,conn_"
    "rate,conn_rate_max,conn_tot,intercepted,dcon,dses,wrew,connect,reuse,cache_lookups,cache"
    "_hits,srv_icur,src_ilim,qtime_max,ctime_max,rtime_max,ttime_max,eint,idle_conn_cur,safe_"
    "conn_cur,used_conn_cur,need_conn_est,uweight,agg_server_status,agg_server_check_status,a"
    "gg_check_status,-,ssl_sess,ssl_reused_sess,ssl_failed_handshake,h2_headers_rcvd,h2_data_"
    "rcvd,h2_settings_rcvd,h2_rst_stream_rcvd,h2_goaway_rcvd,h2_detected_conn_protocol_errors"
    ",h2_detected_strm_protocol_errors,h2_rst_stream_resp,h2_goaway_resp,h2_open_connections,"
    "h2_backend_open_streams,h2_total_connections,h2_backend_total_streams,h1_open_connection"
    "s,h1_open_streams,h1_total_connections,h1_total_streams,h1_bytes_in,h1_bytes_out,h1_spli"
    "ced_bytes_in,h1_spliced_bytes_out,\n"
    "gateway,FRONTEND,,,3,4,64,13,1890,1271,0,0,0,,,,,OPEN,,,,,,,,,1,2,0,,,,0,5,0,6,,,,0,4,0,"
    "4,2,0,,5,6,13,,,0,0,0,0,,,,,,,,,,,,,,,,,,,,,http,,5,6,13,4,0,0,0,,,0,0,,,,,,,0,,,,,,,,,-"
    ",0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,3,3,13,13,2600,1209,0,0,\n"
    "model_0,rig-a,0,0,2,2,2,6,812,428,,0,,0,0,0,0,UP,1,1,0,3,2,3,11,,1,3,1,,6,,2,1,,4,L7OK,2"
    "00,1,0,4,0,0,0,0,0,,,4,0,0,,,,,1,,,0,0,1,1,,,,Layer7 check passed,,2,2,3,,,,127.0.0.1:18"
    "081,,http,,,,,,,,0,6,0,,,0,,0,0,3,3,0,0,0,2,3,1,,,,-,0,0,0,,,,,,,,,,,,,,,,,,,,,,\n"
    "model_0,rig-b,0,0,0,0,4,0,0,0,,0,,0,0,0,0,DOWN,1,1,0,1,1,31,31,,1,3,2,,0,,2,0,,0,L4CON,,"
    "0,0,0,0,0,0,0,0,,,0,0,0,,,,,-1,Connection refused,,0,0,0,0,,,,Layer4 connection problem,"
    ",2,2,0,,,,127.0.0.1:18082,,http,,,,,,,,0,0,0,,,0,,0,0,0,0,0,0,0,0,1,1,,,,-,0,0,0,,,,,,,,"
    ",,,,,,,,,,,,,,\n"
    "model_0,BACKEND,1,1,3,3,7,9,1218,862,0,0,,2,0,0,0,UP,1,1,0,,2,3,11,,1,3,0,,6,,1,2,,4,,,,"
    "0,4,0,0,2,0,,,,6,0,0,0,0,0,0,1,,,0,0,1,1,,,,,,,,,,,,,,http,leastconn,,,,,,,0,6,0,0,0,,,0"
    ",0,3,3,0,,,,,1,0,0,0,-,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,2,2,70,70,2649,1800,0,0,\n"
    "model_1,rig-b,0,0,0,0,3,0,0,0,,0,,0,0,0,0,DOWN,1,1,0,1,1,31,31,,1,4,1,,0,,2,0,,0,L4CON,,"
    "0,0,0,0,0,0,0,0,,,0,0,0,,,,,-1,Connection refused,,0,0,0,0,,,,Layer4 connection problem,"
    ",2,2,0,,,,127.0.0.1:18082,,http,,,,,,,,0,0,0,,,0,,0,0,0,0,0,0,0,0,1,1,,,,-,0,0,0,,,,,,,,"
    ",,,,,,,,,,,,,,\n"
    "model_1,BACKEND,0,0,0,0,7,0,0,0,0,0,,0,0,0,0,DOWN,0,0,0,,1,31,31,,1,4,0,,0,,1,0,,0,,,,0,"
    "0,0,0,0,0,,,,0,0,0,0,0,0,0,-1,,,0,0,0,0,,,,,,,,,,,,,,http,leastconn,,,,,,,0,0,0,0,0,,,0,"
    "0,0,0,0,,,,,0,0,0,0,-,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,31,31,0,0,0,0,\n"
    "metrics,FRONTEND,,,0,0,100,0,0,0,0,0,0,,,,,OPEN,,,,,,,,,1,5,0,,,,0,0,0,0,,,,0,0,0,0,0,0,"
    ",0,0,0,,,0,0,0,0,,,,,,,,,,,,,,,,,,,,,http,,0,0,0,0,0,0,0,,,0,0,,,,,,,0,,,,,,,,,-,0,0,0,0"
    ",0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,\n"
    "\n"
)

SHOW_STAT_DRAINED = (
    "# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,"
    "wredis,status,weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttl"
    "e,lbtot,tracked,type,rate,rate_lim,rate_max,check_status,check_code,check_duration,hrsp_"
    "1xx,hrsp_2xx,hrsp_3xx,hrsp_4xx,hrsp_5xx,hrsp_other,hanafail,req_rate,req_rate_max,req_to"
    "t,cli_abrt,srv_abrt,comp_in,comp_out,comp_byp,comp_rsp,lastsess,last_chk,last_agt,qtime,"
    "ctime,rtime,ttime,agent_status,agent_code,agent_duration,check_desc,agent_desc,check_ris"
    "e,check_fall,check_health,agent_rise,agent_fall,agent_health,addr,cookie,mode,algo,conn_"
    "rate,conn_rate_max,conn_tot,intercepted,dcon,dses,wrew,connect,reuse,cache_lookups,cache"
    "_hits,srv_icur,src_ilim,qtime_max,ctime_max,rtime_max,ttime_max,eint,idle_conn_cur,safe_"
    "conn_cur,used_conn_cur,need_conn_est,uweight,agg_server_status,agg_server_check_status,a"
    "gg_check_status,-,ssl_sess,ssl_reused_sess,ssl_failed_handshake,h2_headers_rcvd,h2_data_"
    "rcvd,h2_settings_rcvd,h2_rst_stream_rcvd,h2_goaway_rcvd,h2_detected_conn_protocol_errors"
    ",h2_detected_strm_protocol_errors,h2_rst_stream_resp,h2_goaway_resp,h2_open_connections,"
    "h2_backend_open_streams,h2_total_connections,h2_backend_total_streams,h1_open_connection"
    "s,h1_open_streams,h1_total_connections,h1_total_streams,h1_bytes_in,h1_bytes_out,h1_spli"
    "ced_bytes_in,h1_spliced_bytes_out,\n"
    "gateway,FRONTEND,,,0,4,64,16,3108,2243,0,0,0,,,,,OPEN,,,,,,,,,1,2,0,,,,0,3,0,6,,,,0,7,0,"
    "4,5,0,,3,6,16,,,0,0,0,0,,,,,,,,,,,,,,,,,,,,,http,,3,6,16,4,0,0,0,,,0,0,,,,,,,0,,,,,,,,,-"
    ",0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,16,16,3236,2151,0,0,\n"
    "model_0,rig-a,0,0,0,2,2,7,1421,749,,0,,0,0,0,0,DRAIN,1,1,0,4,2,6,11,,1,3,1,,6,,2,0,,4,L7"
    "OK,200,1,0,7,0,0,0,0,0,,,7,0,0,,,,,604,,,573,1,1729,2303,,,,Layer7 check passed,,2,2,3,,"
    ",,127.0.0.1:18081,,http,,,,,,,,0,7,0,,,0,,4011,2,4055,8014,0,0,0,0,3,1,,,,-,0,0,0,,,,,,,"
    ",,,,,,,,,,,,,,,\n"
    "model_0,rig-b,0,0,0,0,4,0,0,0,,0,,0,0,0,0,DOWN,1,1,0,1,1,638,638,,1,3,2,,0,,2,0,,0,L4CON"
    ",,2,0,0,0,0,0,0,0,,,0,0,0,,,,,-1,Connection refused,,0,0,0,0,,,,Layer4 connection proble"
    "m,,2,2,0,,,,127.0.0.1:18082,,http,,,,,,,,0,0,0,,,0,,0,0,0,0,0,0,0,0,1,1,,,,-,0,0,0,,,,,,"
    ",,,,,,,,,,,,,,,,\n"
    "model_0,BACKEND,0,1,0,3,7,12,2436,1834,0,0,,5,0,0,0,DOWN,0,0,0,,3,6,17,,1,3,0,,6,,1,3,,4"
    ",,,,0,7,0,0,5,0,,,,12,0,0,0,0,0,0,608,,,335,1,1009,1344,,,,,,,,,,,,,,http,leastconn,,,,,"
    ",,0,7,0,0,0,,,4011,2,4055,8014,0,,,,,0,0,0,0,-,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,1280,"
    "1280,64305,16484,0,0,\n"
    "model_1,rig-b,0,0,0,0,3,0,0,0,,0,,0,0,0,0,MAINT,1,1,0,1,1,638,638,,1,4,1,,0,,2,0,,0,,,,0"
    ",0,0,0,0,0,0,,,0,0,0,,,,,-1,,,0,0,0,0,,,,,,,,,,,,127.0.0.1:18082,,http,,,,,,,,0,0,0,,,0,"
    ",0,0,0,0,0,0,0,0,1,1,,,,-,0,0,0,,,,,,,,,,,,,,,,,,,,,,\n"
    "model_1,BACKEND,0,0,0,0,7,0,0,0,0,0,,0,0,0,0,DOWN,0,0,0,,1,638,638,,1,4,0,,0,,1,0,,0,,,,"
    "0,0,0,0,0,0,,,,0,0,0,0,0,0,0,-1,,,0,0,0,0,,,,,,,,,,,,,,http,leastconn,,,,,,,0,0,0,0,0,,,"
    "0,0,0,0,0,,,,,0,0,0,0,-,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,631,631,0,0,0,0,\n"
    "metrics,FRONTEND,,,0,0,100,0,0,0,0,0,0,,,,,OPEN,,,,,,,,,1,5,0,,,,0,0,0,0,,,,0,0,0,0,0,0,"
    ",0,0,0,,,0,0,0,0,,,,,,,,,,,,,,,,,,,,,http,,0,0,0,0,0,0,0,,,0,0,,,,,,,0,,,,,,,,,-,0,0,0,0"
    ",0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,\n"
    "\n"
)

# A self-signed certificate as the deploy makes one, and its `openssl x509 -fingerprint -sha256`.
CERT = (
    "-----BEGIN CERTIFICATE-----\n"
    "MIIBjDCCATGgAwIBAgIUZ39QKEr2a4iofCN6/nVFxRTN+UkwCgYIKoZIzj0EAwIw\n"
    "GzEZMBcGA1UEAwwQbGxhbWFyaWctZ2F0ZXdheTAeFw0yNjEyMDcxNDUwMjlaFw0z\n"
    "NjEyMDQxNDUwMjlaMBsxGTAXBgNVBAMMEGxsYW1hcmlnLWdhdGV3YXkwWTATBgcq\n"
    "hkjOPQIBBggqhkjOPQMBBwNCAAT0C8+m8BbNmchxt3KPbvlNCsY4q6Jk3KWhmYMt\n"
    "973x7FDlQW9q+E5YjVAIJ24NBQcjcVHlQPYT7D2mAMx6gBR0o1MwUTAdBgNVHQ4E\n"
    "FgQU1Ivglc4BIaGWGiQ2TZs7RV/xHzowHwYDVR0jBBgwFoAU1Ivglc4BIaGWGiQ2\n"
    "TZs7RV/xHzowDwYDVR0TAQH/BAUwAwEB/zAKBggqhkjOPQQDAgNJADBGAiEAm9b0\n"
    "/h9/OVSeEXO0l0Y2cV0XZ3QjrxDCz/oZk1fKkasCIQCgeQF8SlENFPSslIEGqQi/\n"
    "FEJK8LHTDC1q/sZNtnbLGQ==\n"
    "-----END CERTIFICATE-----\n"
)
CERT_SHA256 = (
    "7C:FB:FD:0A:98:FC:83:C0:EF:CB:C9:82:31:59:C7:78:"
    "9D:97:D7:ED:E4:A7:20:6F:FF:4E:8A:00:EB:E6:8F:D4"
)

UNIT = (
    "ActiveState=active\nSubState=running\nMainPID=812\n"
    "ActiveEnterTimestampMonotonic=1000000000\n"
)  # active since 1000 s after boot
UPTIME = "8200.5"  # 2h00m00s later
TINY_UP = SHOW_STAT_BUSY.replace(
    "model_1,rig-b,0,0,0,0,3,0,0,0,,0,,0,0,0,0,DOWN,",
    "model_1,rig-b,0,0,0,0,3,0,0,0,,0,,0,0,0,0,UP 1/2,",
)


def _key(directory: Path, name: str) -> str:
    path = directory / f"{name}.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return str(path)


def team(directory: Path, gateway_on: str = "gw") -> dict:
    """rig-a serves smollm2 (2 slots); rig-b is a router of smollm2 and tiny; the gateway
    (`gw`, a box of its own, or ``gateway_on`` a rig) fronts both: model_0 is smollm2 on rig-a
    and rig-b, model_1 tiny on rig-b, as in the captures."""
    rigs = {
        "rig-a": {
            "ssh": {"host": "192.0.2.1"},
            "model": {"url": "http://127.0.0.1:8765/s.gguf", "sha256": "a" * 64},
            "server": {"host": "10.0.0.11", "port": 8110, "parallel": 2, "alias": "smollm2",
                       "api_key_file": _key(directory, "rig-a")},
        },
        "rig-b": {
            "ssh": {"host": "192.0.2.2"},
            "models": [
                {"name": "smollm2", "url": "http://127.0.0.1:8765/s.gguf", "sha256": "a" * 64},
                {"name": "tiny", "url": "http://127.0.0.1:8765/t.gguf", "sha256": "b" * 64},
            ],
            "server": {"host": "10.0.0.12", "port": 8111,
                       "api_key_file": _key(directory, "rig-b")},
        },
    }  # fmt: skip
    settings = {
        "host": "0.0.0.0",
        "rig_key_file": _key(directory, "rigs"),
        "fronts": "rigs",
        "users": [{"name": "alice", "key_file": _key(directory, "alice")}],
    }
    gateways = {"gw": {"role": "gateway", "ssh": {"host": "192.0.2.9"}, "gateway": settings}}
    if gateway_on != "gw":
        gateways = {gateway_on: {"gateway": settings}}
    return {
        "all": {
            "vars": {
                "driver": {"source": "none"},
                "cuda": {"source": "none"},
                "llama_cpp": {"backend": "cpu"},
                "ssh": {"user": "root"},
            },
            "children": {"rigs": {"hosts": rigs}, "gateways": {"hosts": gateways}},
        }
    }


def inventory_file(directory: Path, gateway_on: str = "gw") -> Path:
    path = directory / "team.yml"
    path.write_text(yaml.safe_dump(team(directory, gateway_on)))
    return path


def host_data(directory: Path, name: str, gateway_on: str = "gw") -> dict:
    return load_inventory(inventory_file(directory, gateway_on)).hosts[name].data


def probe_output(**sections: str) -> str:
    """What the probe prints: each section's marker, then its text (names with - as _)."""
    return "".join(
        f"{status.SECTION}{name.replace('_', '-')}\n{text}\n" for name, text in sections.items()
    )


def gateway_output(stat: str = SHOW_STAT_BUSY, unit: str = UNIT, cert: str = CERT) -> str:
    return probe_output(
        uptime=UPTIME, gateway_unit=unit, gateway_stat=stat, gateway_cert=cert, deploy=""
    )


def assert_escaped(text: str) -> None:
    assert all(ch == "\n" or ch.isprintable() for ch in text), ascii(text)


# --- the probe ----------------------------------------------------------------------------------


def test_a_gateway_alone_asks_haproxy_and_no_llama_server(tmp_path):
    command = status.probe_command(host_data(tmp_path, "gw"), window=10)
    assert "haproxy.service" in command and hostpaths.GATEWAY_TLS_CERT in command
    assert f"echo 'show stat' | socat -t 5 stdio UNIX-CONNECT:{hostpaths.GATEWAY_ADMIN_SOCKET}" in (
        command
    )
    for rig_only in ("llama-server", "/slots", "/metrics", "sleep", "nvidia-smi", "current"):
        assert rig_only not in command, rig_only
    # Each step may fail alone (no socat, no socket) without silencing the next.
    assert all(
        line.startswith("echo '@@") or line.endswith("|| true") for line in command.splitlines()
    )


def test_a_rig_that_runs_the_gateway_asks_both_and_a_rig_alone_only_its_server(tmp_path):
    both = status.probe_command(host_data(tmp_path, "rig-a", gateway_on="rig-a"), window=10)
    assert "llama-server.service" in both and "/slots" in both and "haproxy.service" in both
    alone = status.probe_command(host_data(tmp_path, "rig-a"), window=10)
    assert "haproxy" not in alone and "gateway-" not in alone


# --- real answers -------------------------------------------------------------------------------


def test_a_gateway_alone_from_haproxys_own_show_stat(tmp_path):
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output())
    view = row.gateway
    assert (row.role, view.active, view.pid, view.uptime_s) == (
        "gateway",
        "active/running",
        812,
        7200.5,
    )
    assert view.tls_sha256 == CERT_SHA256 and view.note is None
    smollm2, tiny = view.models
    assert (smollm2.model, smollm2.backend, smollm2.queued) == ("smollm2", "model_0", 1)
    rig_a, rig_b = smollm2.rigs
    assert (rig_a.name, rig_a.state, rig_a.check, rig_a.requests_now) == ("rig-a", "UP", "L7OK", 2)
    assert (rig_a.queued, rig_a.errors, rig_a.requests_total) == (0, 0, 6)
    assert (rig_b.state, rig_b.check, rig_b.state_for_s) == ("DOWN", "L4CON", 31)
    assert [(r.name, r.state) for r in tiny.rigs] == [("rig-b", "DOWN")]
    assert view.totals == gateway_status.GatewayTotals(
        connections_now=3, requests_total=13, answered_by_gateway=4, malformed=0, queued=1
    )
    assert status.report(row).splitlines() == [
        "gw: gateway (no llama-server)",
        "  gateway  haproxy.service active/running for 2h00m00s, pid 812",
        f"  tls      SHA-256 {CERT_SHA256}",
        "  backend  smollm2 (1 queued, 2 errors): rig-a UP: 2 now, 0 errors, 6 sent; "
        "rig-b DOWN for 31s (L4CON): 0 now, 0 errors, 0 sent",
        "  backend  tiny (0 queued, 0 errors): rig-b DOWN for 31s (L4CON): 0 now, 0 errors, 0 sent",
        "  totals   3 connections now, 1 queued; since the last reload 13 requests, 4 answered by "
        "the gateway itself (model list, 401/404/413), 0 malformed",
        "  deploy   no record (not deployed by this llamarig, or before records)",
    ]
    # tiny has no rig up: the host is not healthy until it has.
    assert not status.healthy(row)
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output(TINY_UP))
    assert row.gateway.models[1].rigs[0].state == "UP 1/2" and status.healthy(row)
    assert "rig-b UP 1/2 (going down: 1 of 2 checks)" in status.report(row)


def test_drained_and_disabled_rigs_take_no_requests(tmp_path):
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output(SHOW_STAT_DRAINED))
    smollm2, tiny = row.gateway.models
    assert [r.state for r in smollm2.rigs] == ["DRAIN", "DOWN"]
    assert [r.state for r in tiny.rigs] == ["MAINT"]
    assert not status.healthy(row)
    text = status.report(row)
    assert "rig-a DRAIN for 6s: 0 now, 0 errors, 7 sent" in text
    assert "tiny (0 queued, 0 errors): rig-b MAINT for 10m38s: 0 now" in text


def test_haproxy_not_active_is_not_healthy(tmp_path):
    unit = UNIT.replace("active\nSubState=running", "failed\nSubState=failed")
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output(TINY_UP, unit=unit))
    assert row.gateway.active == "failed/failed" and row.gateway.uptime_s is None
    assert not status.healthy(row)


RIG_A_UNIT = (
    "ActiveState=active\nSubState=running\nMainPID=100\nNRestarts=0\n"
    "ActiveEnterTimestampMonotonic=8000000000"
)
SLOTS = json.dumps([{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}])


def rig_and_gateway_output(rig_unit: str = RIG_A_UNIT, stat: str = TINY_UP) -> str:
    return probe_output(
        unit=rig_unit,
        uptime=UPTIME,
        running="/opt/llamarig/builds/0c1e57098bba-f9a55c7a12/bin/llama-server",
        current="/opt/llamarig/builds/0c1e57098bba-f9a55c7a12",
        slots_before=SLOTS,
        slots=SLOTS,
        gateway_unit=UNIT,
        gateway_stat=stat,
        gateway_cert=CERT,
        deploy="",
    )


def test_a_rig_that_runs_the_gateway_shows_both_and_needs_both_up(tmp_path):
    data = host_data(tmp_path, "rig-a", gateway_on="rig-a")
    row = status.parse("rig-a", data, rig_and_gateway_output())
    assert (row.role, row.slots_busy, row.slots_total) == ("standalone", 1, 2)
    assert row.gateway.tls_sha256 == CERT_SHA256 and status.healthy(row)
    lines = status.report(row).splitlines()
    assert lines[0] == "rig-a: llama-server.service active/running for 3m20s, pid 100"
    assert "  slots    1 of 2 busy" in lines
    assert "  gateway  haproxy.service active/running for 2h00m00s, pid 812" in lines
    assert lines.index("  slots    1 of 2 busy") < lines.index(f"  tls      SHA-256 {CERT_SHA256}")
    assert lines[-1].startswith("  deploy   ")
    stopped = RIG_A_UNIT.replace("active\nSubState=running", "inactive\nSubState=dead")
    assert not status.healthy(status.parse("rig-a", data, rig_and_gateway_output(stopped)))
    assert not status.healthy(status.parse("rig-a", data, rig_and_gateway_output(stat="")))


def test_status_json_carries_the_gateway(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RIG_INVENTORY", str(inventory_file(tmp_path)))
    asked = []

    def host(argv, **kwargs):
        asked.append(argv[-1])
        return subprocess.CompletedProcess(argv, 0, gateway_output(), "")

    monkeypatch.setattr(status.subprocess, "run", host)
    assert main(["status", "--json", "--host", "gw"]) == 1  # tiny has no rig up
    (row,) = json.loads(capsys.readouterr().out)
    assert len(asked) == 1 and "show stat" in asked[0]  # one round trip
    assert row["role"] == "gateway" and row["gateway"]["tls_sha256"] == CERT_SHA256
    smollm2 = row["gateway"]["models"][0]
    assert smollm2["model"] == "smollm2" and smollm2["queued"] == 1
    assert smollm2["rigs"][0] == {
        "name": "rig-a",
        "state": "UP",
        "check": "L7OK",
        "state_for_s": 3,
        "requests_now": 2,
        "queued": 0,
        "errors": 0,
        "requests_total": 6,
        "retries": 0,
        "redispatches": 0,
    }
    assert row["gateway"]["totals"]["answered_by_gateway"] == 4
    assert main(["status", "--host", "gw"]) == 1
    assert "  backend  smollm2 (1 queued, 2 errors): rig-a UP: 2 now" in capsys.readouterr().out


# --- a broken or hostile gateway ----------------------------------------------------------------

HEADER = SHOW_STAT_BUSY.splitlines()[0]
ROWS = SHOW_STAT_BUSY.splitlines()[1:]


def _without_columns(text: str, names: set[str]) -> str:
    lines = text.splitlines()
    columns = lines[0][2:].split(",")
    keep = [i for i, name in enumerate(columns) if name not in names]
    rows = [
        ",".join(line.split(",")[i] for i in keep if i < len(line.split(","))) for line in lines[1:]
    ]
    return "\n".join(["# " + ",".join(columns[i] for i in keep), *rows])


@pytest.mark.parametrize(
    "stat, said",
    [
        ("2026/12/07 14:50:34 socat[3259] E connect(, AF=1 \"/run/haproxy/admin.sock\", 25): "
         "No such file or directory", "no statistics from /run/haproxy/admin.sock: 2026/12/07"),
        ("sh: 1: socat: not found", "no statistics from /run/haproxy/admin.sock: sh: 1: socat"),
        ("", "no statistics from /run/haproxy/admin.sock: nothing"),
        ("Unknown command. Please enter one of the following commands only :", "no statistics"),
        ("# pxname,svname,status\n", "HAProxy has no frontend 'gateway'"),
        ("# pxname,qcur,status\ngateway,FRONTEND,OPEN", "HAProxy's `show stat` header lacks"),
        ("# px,sv,status\ngateway,FRONTEND,OPEN", "no statistics from /run/haproxy/admin.sock: "
         "gateway,FRONTEND,OPEN"),
        (HEADER + "\nmodel_0,rig-a," + "A" * 200_000, "HAProxy's `show stat` is not CSV: field "
         "larger than field limit"),
        ("\x1b[2J" * 100_000, "no statistics from /run/haproxy/admin.sock: \x1b[2J"),
    ],
    ids=["no-socket", "no-socat", "nothing", "not-stat", "header-only", "no-svname",
         "other-header", "huge-field", "escapes"],
)  # fmt: skip
def test_a_gateway_without_readable_statistics_is_a_note(tmp_path, stat, said):
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output(stat))
    assert row.gateway.note.startswith(said), row.gateway.note
    assert not status.healthy(row)
    text = status.report(row)
    assert_escaped(text)
    assert max(len(line) for line in text.splitlines()) < 1000


def test_missing_columns_and_non_numbers_are_unknown_not_guessed(tmp_path):
    stat = _without_columns(SHOW_STAT_BUSY, {"scur", "check_status", "req_tot"})
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output(stat))
    rig_a = row.gateway.models[0].rigs[0]
    assert (rig_a.state, rig_a.requests_now, rig_a.check, rig_a.requests_total) == (
        "UP",
        None,
        None,
        6,
    )
    assert row.gateway.totals.requests_total is None and row.gateway.totals.connections_now is None
    assert "rig-a UP: ? now, 0 errors, 6 sent" in status.report(row)
    # Numbers HAProxy never prints: signs, exponents, other scripts' digits, absurd lengths.
    garbled = SHOW_STAT_BUSY.replace(
        "model_0,rig-a,0,0,2,2,2,6,", "model_0,rig-a,-1,0,\u0661\u0662,2,2,1e9,"
    )
    garbled = garbled.replace("gateway,FRONTEND,,,3,", "gateway,FRONTEND,,," + "9" * 40 + ",")
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output(garbled))
    rig_a = row.gateway.models[0].rigs[0]
    assert (rig_a.queued, rig_a.requests_now, rig_a.requests_total) == (None, None, None)
    assert row.gateway.totals.connections_now is None
    assert_escaped(status.report(row))


def test_what_a_hostile_gateway_prints_reaches_the_terminal_escaped(tmp_path):
    hostile = SHOW_STAT_BUSY.replace(",UP,1,1,0,3,2,3,", ",UP\x1b]0;pwned\x07,1,1,0,3,2,3,", 1)
    assert hostile != SHOW_STAT_BUSY
    hostile += 'model_0,"rig-\x1b[2J\nforged: line",0,0,0,0,1,0,,0,,0,,0,0,0,0,UP\u202e,1\n'
    hostile += "model_0,\x9b31m,\x00,0\n"
    unit = UNIT.replace("SubState=running", "SubState=running\x1b[31m") + "MainPID=abc\n"
    row = status.parse("gw", host_data(tmp_path, "gw"), gateway_output(hostile, unit=unit))
    names = [rig.name for rig in row.gateway.models[0].rigs]
    # A quoted newline joins the two lines (csv reads the section's lines): no forged line.
    assert names == ["rig-a", "rig-b", "rig-\x1b[2Jforged: line", "\x9b31m"]
    # rig-a's state is not "UP": HAProxy never said so, whatever it starts with.
    assert not row.gateway.models[0].rigs[0].serving and row.gateway.pid is None
    text = status.report(row)
    assert_escaped(text)
    assert "\\x1b[2Jforged: line" in text and "\\u202e" in text and "\\x9b31m" in text
    assert not any(line.startswith("forged") for line in text.splitlines())


def test_the_fingerprint_is_the_servers_own_certificate_or_a_note(tmp_path):
    data = host_data(tmp_path, "gw")
    chain = CERT + CERT.replace("MIIB", "MIIC")  # the server's first, then its issuer's
    assert status.parse("gw", data, gateway_output(cert=chain)).gateway.tls_sha256 == CERT_SHA256
    for cert, said in [
        ("cat: /etc/haproxy/llamarig/tls.crt: No such file or directory", "No such file"),
        ("-----BEGIN CERTIFICATE-----\n!!\x1b[2J\n-----END CERTIFICATE-----", "-----BEGIN"),
        ("-----BEGIN CERTIFICATE-----\nMIIBfake=\n-----END CERTIFICATE-----", "-----BEGIN"),
        ("", "nothing"),
    ]:
        view = status.parse("gw", data, gateway_output(cert=cert)).gateway
        assert view.tls_sha256 is None, cert
        assert view.tls_note == f"no certificate in {hostpaths.GATEWAY_TLS_CERT}: " + (
            cert.splitlines()[0] if cert else "nothing"
        )
        assert said in view.tls_note
        assert_escaped(status.report(status.parse("gw", data, gateway_output(cert=cert))))


def test_a_gateway_that_did_not_answer_is_one_line(tmp_path):
    row = status.HostStatus(host="gw", error="not reachable: ssh: connect to host 192.0.2.9")
    assert status.report(row) == "gw: not reachable: ssh: connect to host 192.0.2.9"
    assert not status.healthy(row)


# --- a live HAProxy -----------------------------------------------------------------------------


class _Rig(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        return unused.getsockname()[1]


@pytest.mark.skipif(
    not (shutil.which("haproxy") and shutil.which("socat")), reason="needs haproxy and socat"
)
def test_the_probes_lines_read_a_live_haproxy(tmp_path, monkeypatch):
    """HAProxy on loopback with a stats socket under tmp_path: model_0 on rig-a (answers its
    checks) and rig-b (a closed port). The probe's own lines (but systemctl's) read it."""
    rig = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Rig)
    threading.Thread(target=rig.serve_forever, daemon=True).start()
    admin, cert = tmp_path / "admin.sock", tmp_path / "tls.crt"
    cert.write_text(CERT)
    (tmp_path / "haproxy.cfg").write_text(
        f"global\n    stats socket {admin} mode 600 level admin\n"
        "defaults\n    mode http\n    timeout connect 1s\n    timeout client 5s\n"
        "    timeout server 5s\n"
        f"frontend gateway\n    bind 127.0.0.1:{_free_port()}\n    default_backend model_0\n"
        "backend model_0\n    option httpchk GET /health\n"
        "    default-server check inter 200ms fall 2 rise 2\n"
        f"    server rig-a 127.0.0.1:{rig.server_address[1]} maxconn 2\n"
        f"    server rig-b 127.0.0.1:{_free_port()} maxconn 2\n"
    )
    monkeypatch.setattr(hostpaths, "GATEWAY_ADMIN_SOCKET", str(admin))
    monkeypatch.setattr(hostpaths, "GATEWAY_TLS_CERT", str(cert))
    lines = [line for line in gateway_status.probe_lines(status.section) if "systemctl" not in line]
    data = {"role": "gateway", "gateway": {"backends": [{"model": "smollm2", "servers": [
        {"name": "rig-a"}, {"name": "rig-b"}]}]}}  # fmt: skip
    haproxy = subprocess.Popen(
        ["haproxy", "-db", "-f", str(tmp_path / "haproxy.cfg")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline, states = time.monotonic() + 15, []
        while time.monotonic() < deadline and states != ["UP", "DOWN"]:
            time.sleep(0.2)
            output = subprocess.run(
                ["sh", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=30
            ).stdout
            view = gateway_status.parse(data, status.sections(output))
            states = [rig.state for rig in view.models[0].rigs] if view.models else []
    finally:
        haproxy.kill()
        haproxy.wait()
        rig.shutdown()
    assert states == ["UP", "DOWN"], output
    rig_a, rig_b = view.models[0].rigs
    assert (rig_a.check, rig_b.check) == ("L7OK", "L4CON")
    assert view.totals.requests_total == 0 and view.tls_sha256 == CERT_SHA256
    assert not gateway_status.healthy(view)  # haproxy.service itself was not asked
