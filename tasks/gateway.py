"""Gateway: on each host of the `gateways` group, HAProxy from the distribution in front of the
rigs it fronts (after their server stage, so they accept its key): the users' key hashes, its
key for the rigs, TLS, the models list and the configuration, each checked before it is put in
place, then a reload (never a restart) and a wait until every model has a rig up."""

from io import BytesIO, StringIO
from pathlib import Path

from pyinfra import api, host, state
from pyinfra.api.operation import OperationMeta
from pyinfra.operations.util import any_changed

from llamarig import operations
from llamarig.config import inventory_path
from llamarig.config.gateways import GATEWAYS_GROUP, runs_gateway
from llamarig.config.paths import expand_path
from llamarig.converge import stage
from llamarig.onhost import hostpaths
from llamarig.operations import gateway as gateway_ops
from llamarig.planner import gateway

# Where the run copies each gateway's certificate on the control machine, beside the inventory.
CERTIFICATES_DIR = "gateway-certs"


@api.deploy("tasks/gateway.py")
def deploy() -> None:
    if state.inventory.get_group(GATEWAYS_GROUP, default=None):
        # pyinfra interleaves the hosts' operations by their place in each host's list: one
        # operation every host calls here orders every rig's server stage before any gateway
        # operation, so a gateway sends its key only to rigs that accept it.
        operations.barrier(name="Every rig converged before a gateway changes")
    rig = stage.rig()
    if not runs_gateway(rig) or stage.builds_only():
        return
    operations.apt_packages(
        name="HAProxy, socat (its runtime API) and openssl, from the distribution",
        packages=gateway.PACKAGES,
        no_recommends=True,
    )
    files = [*_tls(rig), *_maps(rig)]
    config = gateway_ops.haproxy_config(
        name=f"HAProxy configuration ({len(rig['gateway']['backends'])} models), checked "
        "with haproxy -c",
        src=StringIO(gateway.render_config(rig)),
        dest=hostpaths.HAPROXY_CONFIG,
    )
    changed = any_changed(config, *files)
    applied = gateway_ops.haproxy_applied(
        name="Apply it: reload HAProxy (connections kept), or start it",
        service=gateway.SERVICE,
        admin_socket=hostpaths.GATEWAY_ADMIN_SOCKET,
        state_file=hostpaths.GATEWAY_SERVER_STATE,
        servers=gateway.state_keys(rig),
        _if=changed,
    )
    started = operations.unit_running(
        name=f"{gateway.SERVICE} enabled and running", unit=gateway.SERVICE
    )
    reloaded = any_changed(applied, started)
    backends = gateway.backend_models(rig)
    gateway_ops.gateway_serving(
        name="Wait until the gateway sees a rig up for every model",
        admin_socket=hostpaths.GATEWAY_ADMIN_SOCKET,
        backends=backends,
        timeout=60,
        _if=reloaded,
    )
    gateway_ops.check_gateway(
        name="Verify the gateway (unless the wait above just checked it)",
        admin_socket=hostpaths.GATEWAY_ADMIN_SOCKET,
        backends=backends,
        _if=lambda: not reloaded(),
    )


def _tls(rig: dict) -> list[OperationMeta]:
    """The certificate and key HAProxy serves: the user's, or a self-signed pair made once;
    the certificate copied beside the inventory for clients."""
    tls = rig["gateway"]["tls"]
    if tls["cert_file"]:
        cert = Path(expand_path(tls["cert_file"])).read_bytes()
        key = Path(expand_path(tls["key_file"])).read_bytes()
        placed = [
            operations.secret_file(
                name="TLS certificate and key (root only)",
                src=BytesIO(cert.rstrip(b"\n") + b"\n" + key),
                dest=hostpaths.GATEWAY_TLS_PEM,
            ),
            operations.atomic_file(
                name="TLS certificate",
                src=StringIO(cert.decode()),
                dest=hostpaths.GATEWAY_TLS_CERT,
                mode="644",
            ),
        ]
    else:
        placed = [
            gateway_ops.self_signed_certificate(
                name="Self-signed TLS certificate (made once)",
                pem=hostpaths.GATEWAY_TLS_PEM,
                cert=hostpaths.GATEWAY_TLS_CERT,
                names=gateway.certificate_names(rig),
            )
        ]
    gateway_ops.certificate_copy(
        name="Copy the certificate beside the inventory (what clients trust)",
        src=hostpaths.GATEWAY_TLS_CERT,
        dest=str(inventory_path().parent / CERTIFICATES_DIR / f"{host.name}.crt"),
    )
    return placed


def _maps(rig: dict) -> list[OperationMeta]:
    return [
        operations.atomic_file(
            name=f"Users' key hashes ({len(rig['gateway']['users'])} users; never the keys)",
            src=StringIO(gateway.users_map(rig)),
            dest=hostpaths.GATEWAY_USERS_MAP,
            mode="600",
        ),
        operations.secret_file(
            name="The gateway's key for the rigs (root only)",
            src=BytesIO(gateway.rig_key_map(rig)),
            dest=hostpaths.GATEWAY_RIG_KEY_MAP,
        ),
        operations.atomic_file(
            name="GET /v1/models as the gateway answers it",
            src=StringIO(gateway.models_json(rig)),
            dest=hostpaths.GATEWAY_MODELS_JSON,
            mode="644",
        ),
    ]
