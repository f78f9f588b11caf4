"""Operations of the team endpoint: HAProxy's configuration checked before it is put in place
and applied by a reload (never a restart: no connection is dropped), a self-signed certificate
made once, the certificate copied to the control machine, and the wait until every model has a
rig the gateway sees up."""

from __future__ import annotations

import hashlib
import ipaddress
import shlex
import time
from io import BytesIO
from pathlib import Path, PurePosixPath
from typing import IO

from pyinfra import host, logger
from pyinfra.api import FileUploadCommand, FunctionCommand, StringCommand, operation

from llamarig.facts.cache import known
from llamarig.facts.files import FileState
from llamarig.facts.gateway import (
    GatewayStat,
    models_without_rig_up,
    rigs_up,
    runtime_api,
    stat_rows,
)
from llamarig.operations.files import ATOMIC_SUFFIX, rename_into_place
from llamarig.operations.host import fail
from llamarig.tables.certificates import fingerprint
from llamarig.tables.text import printable


@operation()
def haproxy_config(src: IO[str], dest: str):
    """
    Put HAProxy's configuration in place only when it differs, and only once ``haproxy -c``
    accepts it (with the maps and certificate it names, already in place): a configuration
    HAProxy refuses never replaces the one that serves.

    + src: the wanted configuration (rendered from the plan, never raw user text)
    + dest: the configuration file Debian's unit reads

    **Example:**

    .. code:: python

        haproxy_config(src=StringIO(text), dest="/etc/haproxy/haproxy.cfg")
    """
    src.seek(0)
    content = src.read().encode()
    remote = known(FileState, path=dest)
    if remote and remote["sha256"] == hashlib.sha256(content).hexdigest():
        host.noop(f"{dest} is up to date")
        return
    candidate = dest + ATOMIC_SUFFIX
    yield f"mkdir -p {shlex.quote(str(PurePosixPath(dest).parent))}"
    yield FileUploadCommand(BytesIO(content), candidate)
    yield (
        f"if ! checked=$(haproxy -c -q -f {shlex.quote(candidate)} 2>&1); then "
        f'echo "llamarig: HAProxy refuses the new configuration (the running one is kept): '
        f'$checked" >&2; rm -f {shlex.quote(candidate)}; exit 1; fi'
    )
    yield rename_into_place(dest, "644")


@operation(is_idempotent=False)
def haproxy_applied(service: str, admin_socket: str, state_file: str, servers: list[str]):
    """
    Apply HAProxy's files: a reload when it runs (its master hands the listeners to new
    workers; requests in flight finish on the old ones), after saving the servers' state (a
    rig set to drain stays drained), else a start.

    + service: the unit, e.g. ``haproxy.service``
    + admin_socket: the runtime API's Unix socket
    + state_file: where ``show servers state`` is saved for the new workers to load
    + servers: ``BACKEND SERVER ADDRESS PORT`` of each server in the new configuration; the
      saved state of any other is dropped, since a saved port and address win over the
      configuration's (HAProxy 2.6): a rig moved to another port would be sought at the old

    **Example:**

    .. code:: python

        haproxy_applied(service="haproxy.service", admin_socket="/run/haproxy/admin.sock",
                        state_file="/var/lib/haproxy/server-state",
                        servers=["model_0 rig1 10.0.0.21 8080"])
    """
    unit, state = shlex.quote(service), shlex.quote(state_file)
    wanted = shlex.quote("|".join(servers))
    # show servers state: a version line, a `#` header, then be_id be_name srv_id srv_name
    # srv_addr ... with srv_port in column 19 (format 1).
    keep = (
        "awk -v wanted=" + wanted + ' \'BEGIN {n = split(wanted, w, "|"); '
        "for (i = 1; i <= n; i++) keep[w[i]] = 1} "
        'NR <= 2 || (($2 " " $4 " " $5 " " $19) in keep)\''
    )
    yield (
        f"if systemctl is-active -q -- {unit}; then "
        f"mkdir -p $(dirname {state}); "
        f"{runtime_api('show servers state', socket=admin_socket)} 2>/dev/null "
        f"| {keep} > {state}.new && mv {state}.new {state} || rm -f {state}.new; "
        f"systemctl reload -- {unit}; "
        f"else systemctl enable -- {unit} && systemctl start -- {unit}; fi"
    )


@operation()
def self_signed_certificate(pem: str, cert: str, names: list[str], days: int = 3650):
    """
    Make a self-signed certificate and key (ECDSA P-256) on the host once, for the gateway's
    TLS when the user gives none: ``pem`` holds the key and certificate (root only), ``cert``
    the certificate alone. An existing pair is kept.

    + pem: the key and certificate, as HAProxy's ``crt`` reads them
    + cert: the certificate alone (what clients trust)
    + names: DNS names and IP addresses for subjectAltName (checked shapes)
    + days: validity

    **Example:**

    .. code:: python

        self_signed_certificate(pem="/etc/haproxy/llamarig/tls.pem",
                                cert="/etc/haproxy/llamarig/tls.crt", names=["10.0.0.5"])
    """
    if known(FileState, path=pem) and known(FileState, path=cert):
        host.noop(f"{cert} exists")
        return
    alt = ",".join(f"{'IP' if _is_ip(name) else 'DNS'}:{name}" for name in names)
    q_pem, q_cert = shlex.quote(pem), shlex.quote(cert)
    work = shlex.quote(pem + ".work")
    yield (
        f"umask 077 && rm -rf {work} && mkdir -p {work} $(dirname {q_pem}) && "
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
        f"-days {int(days)} -subj /CN=llamarig-gateway "
        f"-addext {shlex.quote('subjectAltName=' + alt)} "
        f"-keyout {work}/key -out {work}/crt 2>{work}/log || "
        f"{{ cat {work}/log >&2; rm -rf {work}; exit 1; }}"
    )
    yield (
        f"cat {work}/crt {work}/key > {work}/pem && chmod 600 {work}/pem && "
        f"chmod 644 {work}/crt && mv {work}/crt {q_cert} && mv {work}/pem {q_pem} && rm -rf {work}"
    )


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@operation()
def certificate_copy(src: str, dest: str):
    """
    Copy the gateway's certificate to the control machine (what clients trust, e.g. the
    OpenAI client's ``SSL_CERT_FILE``) and print its SHA-256 fingerprint; only when the copy
    differs.

    + src: the certificate on the host
    + dest: the file on the control machine

    **Example:**

    .. code:: python

        certificate_copy(src="/etc/haproxy/llamarig/tls.crt", dest="gateway-certs/gw.crt")
    """
    local = Path(dest)
    remote = known(FileState, path=src)
    if remote and local.is_file():
        text = local.read_text(errors="replace")
        if hashlib.sha256(local.read_bytes()).hexdigest() == remote["sha256"]:
            host.noop(f"{dest} is up to date; certificate SHA-256 {fingerprint(text)}")
            return

    def fetch(state, host) -> bool:
        buffer = BytesIO()
        if not host.get_file(src, buffer):
            return False
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(buffer.getvalue())
        host.log(
            f"gateway certificate {dest}: SHA-256 {fingerprint(buffer.getvalue().decode())}",
            logger.warning,
        )
        return True

    yield FunctionCommand(fetch, (), {})


@operation(is_idempotent=False)
def check_gateway(admin_socket: str, backends: dict[str, str]):
    """
    Fail unless HAProxy answers on its admin socket and sees, for every model, a rig up;
    changes nothing. Guard it with ``_if=`` to skip it after a reload whose wait checked the
    same.

    + admin_socket: the runtime API's Unix socket
    + backends: HAProxy backend name -> the model name clients send

    **Example:**

    .. code:: python

        check_gateway(admin_socket="/run/haproxy/admin.sock", backends={"model_0": "smollm2"})
    """
    rows = host.get_fact(GatewayStat, admin_socket=admin_socket)
    if not rows:
        yield from fail._inner(
            f"HAProxy does not answer on {admin_socket} (systemctl status haproxy)"
        )
        return
    missing = models_without_rig_up(rows, backends)
    if missing:
        yield from fail._inner(f"the gateway sees no rig up for: {', '.join(missing)}")
        return
    host.noop(
        "the gateway sees "
        + "; ".join(
            f"{backends[b]}: {', '.join(servers)} up"
            for b, servers in rigs_up(rows, backends).items()
        )
    )


@operation(is_idempotent=False)
def gateway_serving(admin_socket: str, backends: dict[str, str], timeout: int):
    """
    Wait until HAProxy's health checks see, for every model, at least one rig up; else fail
    naming each model without one and what its checks last said.

    + admin_socket: the runtime API's Unix socket
    + backends: HAProxy backend name -> the model name clients send
    + timeout: seconds to wait

    **Example:**

    .. code:: python

        gateway_serving(admin_socket="/run/haproxy/admin.sock",
                        backends={"model_0": "smollm2"}, timeout=30)
    """
    command = StringCommand(runtime_api("show stat", socket=admin_socket))

    def wait(state, host) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            _, output = host.run_shell_command(command)
            rows = stat_rows(output.stdout_lines)
            missing = models_without_rig_up(rows, backends)
            if not missing:
                host.log("llamarig: the gateway sees a rig up for every model")
                return True
            if time.monotonic() >= deadline:
                break
            time.sleep(1)
        host.log_styled(
            f"llamarig: the gateway sees no rig up for: {', '.join(missing)} after {timeout} s; "
            "its checks:",
            fg="red",
            log_func=logger.error,
        )
        for row in rows:
            if row.get("svname") not in ("BACKEND", "FRONTEND"):
                said = (
                    f"  {row.get('pxname')}/{row.get('svname')}: {row.get('status')} "
                    f"({row.get('check_status')} {row.get('last_chk')})"
                )
                host.log(printable(said), log_func=logger.error)
        return False

    yield FunctionCommand(wait, (), {})
