"""The gateway's operations, run for real by pyinfra against @local on temporary directories:
a configuration HAProxy refuses never replaces the one in place, a self-signed certificate is
made once with the names asked for, the certificate copy and its fingerprint, and the saved
server state a reload keeps only for servers whose address and port are unchanged."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from llamarig.operations.gateway import haproxy_applied
from llamarig.tables.certificates import fingerprint
from tests.test_operations import changed, run_deploy

pytestmark = pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl")

# A stand-in for haproxy's configuration check (haproxy is not installed on this machine; the
# sandbox scenario runs the real one): it refuses a file that holds the word `refuse`.
STAND_IN_HAPROXY = """#!/bin/sh
# stand-in of `haproxy -c -q -f FILE` for the test
for last; do :; done
if grep -q refuse "$last"; then echo "[ALERT] config: parsing error" >&2; exit 1; fi
exit 0
"""


@pytest.fixture
def stand_in_path(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    haproxy = bin_dir / "haproxy"
    haproxy.write_text(STAND_IN_HAPROXY)
    haproxy.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_a_configuration_haproxy_refuses_never_replaces_the_one_in_place(tmp_path, stand_in_path):
    dest = tmp_path / "haproxy.cfg"
    dest.write_text("serving\n")
    body = """
    from io import StringIO
    from llamarig.operations import gateway
    gateway.haproxy_config(src=StringIO({text!r}), dest={dest!r})
    """
    refused = body.format(text="refuse me\n", dest=str(dest))
    status, _, stderr = run_deploy(tmp_path, refused, env=stand_in_path)
    assert status != 0 and "HAProxy refuses the new configuration" in stderr, stderr
    assert dest.read_text() == "serving\n"
    assert not list(tmp_path.glob("haproxy.cfg.*"))  # no candidate left behind
    accepted = body.format(text="frontend x\n", dest=str(dest))
    status, results, stderr = run_deploy(tmp_path, accepted, env=stand_in_path)
    assert status == 0 and changed(results) == 1, stderr
    assert dest.read_text() == "frontend x\n"
    status, results, stderr = run_deploy(tmp_path, accepted, env=stand_in_path)
    assert status == 0 and changed(results) == 0, stderr


def test_a_self_signed_certificate_is_made_once_with_its_names(tmp_path):
    pem, cert, copy = tmp_path / "tls.pem", tmp_path / "tls.crt", tmp_path / "certs" / "gw.crt"
    body = f"""
    from llamarig.operations import gateway
    gateway.self_signed_certificate(pem={str(pem)!r}, cert={str(cert)!r},
                                    names=["gw.example.lan", "10.0.0.5", "::1"])
    gateway.certificate_copy(src={str(cert)!r}, dest={str(copy)!r})
    """
    status, results, stderr = run_deploy(tmp_path, body)
    assert status == 0 and changed(results) == 2, stderr
    assert oct(pem.stat().st_mode & 0o777) == "0o600"
    assert "PRIVATE KEY" in pem.read_text() and "CERTIFICATE" in pem.read_text()
    assert "PRIVATE KEY" not in cert.read_text()
    text = subprocess.run(
        ["openssl", "x509", "-noout", "-text", "-fingerprint", "-sha256", "-in", str(cert)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert "DNS:gw.example.lan" in text and "IP Address:10.0.0.5" in text, text
    assert "IP Address:0:0:0:0:0:0:0:1" in text, text
    assert f"Fingerprint={fingerprint(cert.read_text())}" in text
    assert copy.read_text() == cert.read_text()
    before = cert.read_bytes()
    status, results, stderr = run_deploy(tmp_path, body)
    assert status == 0 and changed(results) == 0, stderr
    assert cert.read_bytes() == before  # kept, not made again


STATE_HEADER = (
    "# be_id be_name srv_id srv_name srv_addr srv_op_state srv_admin_state srv_uweight srv_iweight "
    "srv_time_since_last_change srv_check_status srv_check_result srv_check_health "
    "srv_check_state srv_agent_state bk_f_forced_id srv_f_forced_id srv_fqdn srv_port srvrecord "
    "srv_use_ssl srv_check_port srv_check_addr srv_agent_addr srv_agent_port"
)
SAVED_STATE = (
    "1\n"
    + STATE_HEADER
    + """
3 model_0 1 rig1 10.0.0.21 2 1 1 1 45 6 3 4 6 0 0 0 - 8080 - 0 0 - - 0
3 model_0 2 rig2 10.0.0.22 2 1 1 1 45 6 3 4 6 0 0 0 - 8080 - 0 0 - - 0
4 model_1 1 rig2 10.0.0.22 2 0 1 1 45 6 3 4 6 0 0 0 - 8080 - 0 0 - - 0
"""
)


def test_a_reload_keeps_the_saved_state_only_of_servers_whose_address_and_port_stay(tmp_path):
    """HAProxy 2.6 takes a saved server's port and address over the configuration's: a rig
    moved to port 8090 must not be sought at 8080 after the reload."""
    servers = ["model_0 rig1 10.0.0.21 8080", "model_0 rig2 10.0.0.22 8090"]
    command = next(haproxy_applied._inner("haproxy.service", "/sock", "/state", servers))
    keep = command[command.index("awk ") : command.index(" > /state.new")]
    kept = subprocess.run(
        ["sh", "-c", keep], input=SAVED_STATE, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert kept[:2] == SAVED_STATE.splitlines()[:2]
    assert [line.split()[3] for line in kept[2:]] == ["rig1"], kept


@pytest.mark.parametrize("exit_status", [0, 3])
def test_a_guarded_step_runs_as_its_operation_would_and_says_what_it_printed(tmp_path, exit_status):
    """A step of serve_or_roll_back wrapped for a rig behind a gateway (here none is reached:
    an empty rotation) keeps its outcome and its output."""
    marker = tmp_path / "ran"
    body = f"""
    from pyinfra.api import operation
    from llamarig.operations.rotation import Rotation, guarded

    @operation(is_idempotent=False)
    def step():
        yield guarded("echo said-by-the-step; touch {marker}; exit {exit_status}", Rotation((), 5))

    step()
    """
    status, _, stderr = run_deploy(tmp_path, body, "-v")
    assert marker.exists()
    assert (status == 0) == (exit_status == 0), stderr
    assert "said-by-the-step" in stderr, stderr[-2000:]
