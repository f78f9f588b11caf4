"""The team endpoint (docs/gateway.md) on a host of the `gateways` group: HAProxy running and
enabled, its configuration accepted, its secrets root's alone, the users' map exactly the
inventory's users, listening where configured, a rig up for every model, and the certificate
the one clients were given. Skipped, with the reason, on a host that runs no gateway (the
`gateway` fixture); what the host prints is escaped before it is shown."""

from __future__ import annotations

import ipaddress
import shlex

import pytest

from llamarig.config.addresses import WILDCARD_HOSTS
from llamarig.facts.gateway import GatewayStat, models_without_rig_up, rigs_up, stat_rows
from llamarig.onhost import hostpaths
from llamarig.operations.gateway import fingerprint
from llamarig.planner.gateway import SERVICE, backend_models
from llamarig.tables.text import printable

FIX = "run the deploy (pyinfra inventory.py deploy.py)"


def _said(result) -> str:
    """The last lines a command printed, escaped, for a failure's message."""
    text = (result.stderr or "") + (result.stdout or "")
    return printable(" / ".join(text.strip().splitlines()[-3:]) or f"exit status {result.rc}")


def test_haproxy_active_and_enabled(host, gateway):
    service = host.service(SERVICE)
    assert service.is_running, (
        f"{SERVICE} is not running: systemctl status {SERVICE}; journalctl -u {SERVICE}"
    )
    assert service.is_enabled, f"{SERVICE} is not enabled: it will not start at boot; {FIX}"


def test_haproxy_accepts_its_configuration(host, gateway):
    result = host.run(f"haproxy -c -q -f {shlex.quote(hostpaths.HAPROXY_CONFIG)}")
    assert result.rc == 0, (
        f"haproxy -c refuses {hostpaths.HAPROXY_CONFIG} ({_said(result)}): the next reload "
        f"would fail; {FIX}, which puts back a configuration it checked"
    )


@pytest.mark.parametrize("path", [hostpaths.GATEWAY_RIG_KEY_MAP, hostpaths.GATEWAY_TLS_PEM])
def test_secret_is_roots_alone(host, gateway, path):
    """The rigs' key and the TLS key: HAProxy's master reads them as root, nobody else may."""
    file = host.file(path)
    assert file.exists, f"{path} is missing: {FIX}"
    owner, mode = file.user, file.mode
    assert (owner, mode) == ("root", 0o600), (
        f"{path} is {printable(owner)}'s with mode {mode:o}, not root's with 600: "
        f"chown root {path}; chmod 600 {path} (and ask who else could read it)"
    )


def test_users_map_holds_exactly_the_users(host, gateway):
    """The SHA-256 of each user's key beside their name, and nothing else: a key revoked in
    the inventory (its user removed) must not open the gateway."""
    file = host.file(hostpaths.GATEWAY_USERS_MAP)
    assert file.exists, f"{hostpaths.GATEWAY_USERS_MAP} is missing: {FIX}"
    found = {
        # A line of another shape is named, not shown: it may hold anything, a key too.
        tuple(line.split()) if len(line.split()) == 2 else ("?", "(a line not `SHA256 NAME`)")
        for line in file.content_string.splitlines()
        if line.strip() and not line.startswith("#")
    }
    wanted = {(user["sha256"], user["name"]) for user in gateway["users"]}
    lacking = sorted(name for key_hash, name in wanted - found)
    extra = sorted(printable(name) for key_hash, name in found - wanted)
    print(f"users: {', '.join(sorted(name for _, name in wanted)) or 'none'}")
    assert not lacking and not extra, (
        f"{hostpaths.GATEWAY_USERS_MAP} is not the inventory's gateway.users: "
        + "; ".join(
            filter(
                None,
                [
                    lacking and f"lacks the key of {', '.join(lacking)}",
                    extra and f"holds entries of no user of the inventory: {', '.join(extra)}",
                ],
            )
        )
        + f"; {FIX}"
    )


def listening_at(host, port: int) -> list[str]:
    """The local addresses `ss -Hltn` lists as listening on TCP ``port``, without brackets or
    an interface (`[::]:8443` -> `::`, `127.0.0.1%lo:8443` -> `127.0.0.1`)."""
    output = host.run(f"ss -Hltn 'sport = :{int(port)}'").stdout
    found = []
    for line in output.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            address = fields[3].rpartition(":")[0].strip("[]").partition("%")[0]
            found.append(address)
    return sorted(set(found))


def _is(found: str, wanted: str) -> bool:
    if found == "*":  # ss's wildcard of a dual-stack socket
        return wanted in WILDCARD_HOSTS
    try:
        return ipaddress.ip_address(found) == ipaddress.ip_address(wanted)
    except ValueError:
        return found == wanted


@pytest.mark.parametrize("what", ["listener", "exporter"])
def test_listens_where_configured(host, data, gateway, what):
    if not host.exists("ss"):
        pytest.skip("no ss on this host to list its listeners")
    settings = data["gateway"] if what == "listener" else data["gateway"]["metrics"]
    key = "gateway" if what == "listener" else "gateway.metrics"
    address, port = settings["host"], settings["port"]
    found = listening_at(host, port)
    shown = ", ".join(printable(one) for one in found)
    assert found, (
        f"nothing listens on port {port}: HAProxy's {what} is not bound ({key}); "
        f"systemctl status {SERVICE}; journalctl -u {SERVICE}"
    )
    print(f"{what}: port {port} at {shown}")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        if address not in WILDCARD_HOSTS:
            return  # a name: HAProxy listens at what it resolved to
    wrong = [one for one in found if not _is(one, address)]
    assert not wrong, f"port {port} is listened on at {shown}, {key}.host is only {address}"


def test_every_model_has_a_rig_up(host, data, gateway):
    """HAProxy's own health checks (`show stat` on its admin socket): a model without a rig
    up gets 503 at the gateway."""
    socket = hostpaths.GATEWAY_ADMIN_SOCKET
    result = host.run(GatewayStat().command(admin_socket=socket))
    rows = stat_rows(result.stdout.splitlines())
    assert rows, f"HAProxy does not answer on {socket}: systemctl status {SERVICE}"
    backends = backend_models(data)
    up = rigs_up(rows, backends)
    print(
        "; ".join(
            f"{backends[b]}: {', '.join(map(printable, s)) or 'none'} up" for b, s in up.items()
        )
    )
    missing = models_without_rig_up(rows, backends)
    assert not missing, (
        f"the gateway sees no rig up for {', '.join(missing)}: `llamarig verify` or "
        f"`llamarig status` on the rigs that serve it; the gateway's view: echo 'show stat' | "
        f"socat stdio UNIX-CONNECT:{socket}"
    )


def test_certificate_is_the_copy_clients_trust(host, gateway):
    """The certificate HAProxy serves is the one the deploy copied beside the inventory
    (gateway-certs/HOST.crt), which clients were given to trust."""
    copy = gateway["certificate_copy"]
    if copy is None:
        pytest.skip("no copy of the certificate beside the inventory to compare with")
    assert copy["fingerprint"], f"{copy['path']} holds no PEM certificate: {FIX} to copy it again"
    served = host.file(hostpaths.GATEWAY_TLS_CERT)
    assert served.exists, f"{hostpaths.GATEWAY_TLS_CERT} is missing: {FIX}"
    try:
        found = fingerprint(served.content_string)
    except ValueError:
        found = None
    assert found, f"{hostpaths.GATEWAY_TLS_CERT} holds no PEM certificate: {FIX}"
    print(f"certificate SHA-256 {found}")
    assert found == copy["fingerprint"], (
        f"the gateway's certificate has SHA-256 {found}, the copy clients trust "
        f"({copy['path']}) {copy['fingerprint']}: clients that trust the copy refuse the "
        f"gateway; {FIX}, which copies the gateway's certificate again"
    )
