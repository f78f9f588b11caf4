"""The host as a whole: a planned failure, another host's connection, a reboot that waits
for the new boot, a barrier between hosts, and the Machine Owner Key for Secure Boot."""

from __future__ import annotations

import shlex
import time
from pathlib import PurePosixPath

from pyinfra import host
from pyinfra.api import (
    FunctionCommand,
    OperationError,
    StringCommand,
    operation,
)

from llamarig.facts.driver import MokKeyState


@operation(is_idempotent=False)
def fail(message: str):
    """
    Stop the run on this host with a message (for a check that found the host wrong); the
    other operations compose it (``yield from fail._inner(message=...)``).

    + message: what is wrong and what to do about it

    **Example:**

    .. code:: python

        fail(message="model file /srv/m.gguf does not exist on the host")
    """
    yield f"echo {shlex.quote('llamarig: ' + message)} >&2; exit 1"


def connected_host(state, name: str, reason: str):
    """The inventory host ``name``, connected over its own connection (also when this run's
    --limit leaves it out), or None when it cannot be reached."""
    other = state.inventory.get_host(name)
    other.connect(reason=reason, show_errors=False)
    return other if other.connected else None


def _boot_id(target) -> str | None:
    ok, output = target.run_shell_command(StringCommand("cat /proc/sys/kernel/random/boot_id"))
    return output.stdout.strip() if ok else None


@operation(is_idempotent=False)
def reboot(reboot_timeout: int = 600, interval: int = 2):
    """
    Reboot the host and wait until it is back with a new boot id, then reconnect.

    + reboot_timeout: seconds to wait for the host to come back
    + interval: seconds between reconnection attempts

    pyinfra's ``server.reboot`` confirms the reboot by a lower uptime, which a container (such
    as the sandbox rig in systemd-nspawn) never shows: its /proc/uptime is the host kernel's.
    The boot id changes on every boot, of a machine and of a container alike. Guard with
    ``_if=``: it always reboots.
    """
    before: list[str | None] = []

    # pyinfra passes state and host only to functions whose parameters have these names.
    def remember_boot(state, host):
        before.append(_boot_id(host))

    yield FunctionCommand(remember_boot, (), {})
    # Detached, so the SSH channel closes before the machine goes down.
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")

    def wait_for_new_boot(state, host):
        deadline = time.monotonic() + reboot_timeout
        time.sleep(interval + 1)
        host.disconnect()
        while time.monotonic() < deadline:
            host.connect(show_errors=False)
            if host.connected:
                current = _boot_id(host)
                if current and current != before[0]:
                    return
                host.disconnect()
            time.sleep(interval)
        raise OperationError(f"{host.name} did not come back within {reboot_timeout} s")

    yield FunctionCommand(wait_for_new_boot, (), {})


@operation()
def barrier():
    """
    Change nothing. Hosts that call it from one line of the deploy share it as one operation,
    and pyinfra runs each host's operations in order: so every operation they call before it
    runs, on every host, before any they call after it.
    """
    host.noop("every host before this point is done")
    yield from ()


@operation()
def machine_owner_key(key: str, certificate: str, common_name: str):
    """
    Generate a Machine Owner Key pair on the host for DKMS's module signing: the private key
    readable by root alone (created under umask 077, never leaving the host), the certificate
    in DER form as ``mokutil --import`` wants it. An existing pair is kept (its certificate may
    be enrolled already); a key others can read is made root's alone.

    + key: the private key's path, e.g. ``/var/lib/dkms/mok.key``
    + certificate: the certificate's path, e.g. ``/var/lib/dkms/mok.pub``
    + common_name: the certificate's CN, which ``modinfo -F signer`` shows for a signed module
    """
    existing = host.get_fact(MokKeyState, key=key, certificate=certificate)
    quoted_key, quoted_certificate = shlex.quote(key), shlex.quote(certificate)
    if existing["key_exists"] and existing["certificate_exists"]:
        if existing["key_mode"] != "600":
            yield f"chown root:root {quoted_key} && chmod 600 {quoted_key}"
        else:
            host.noop(f"Machine Owner Key {key} exists")
        return
    subject = shlex.quote(f"/CN={common_name}/")
    yield (
        f"mkdir -p {shlex.quote(str(PurePosixPath(key).parent))} && (umask 077 && "
        "openssl req -new -x509 -nodes -days 36500 -newkey rsa:2048 -sha256 "
        f"-subj {subject} -keyout {quoted_key} -outform DER -out {quoted_certificate}) "
        f"&& chmod 644 {quoted_certificate}"
    )
