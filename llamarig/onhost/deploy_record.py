"""The last deploy of a host, recorded on the host by the deploy itself for `llamarig status`.

``/var/lib/llamarig/last-deploy.json`` is replaced when a run ends for the host: after the
deploy's last operation (``converged``: how many operations changed something, and which), or
when an operation fails (``failed``: which, and whether the server was rolled back to the last
version that served; ``operations.rollback`` leaves ``ROLLED_BACK_PATH`` for that).

A pyinfra state callback writes it, not an operation: an operation that wrote it would count
as a change in every run, and a second converge must report none. A dry run executes no
operation and writes nothing.
"""

from __future__ import annotations

import json
import shlex
from datetime import UTC, datetime

from pyinfra import logger
from pyinfra.api.state import BaseStateCallback, State

from llamarig.onhost.hostpaths import DEPLOY_RECORD_PATH, ROLLED_BACK_PATH

RECORD_PATH = DEPLOY_RECORD_PATH
# Names of changed operations kept in the record: enough to tell what a deploy did.
NAMES_KEPT = 20
WRITE_TIMEOUT_S = 30


def record(changed: list[str], failed: str | None, rolled_back: bool, when: datetime) -> dict:
    """The record of one run: ``changed``, the names of the operations that changed something;
    ``failed``, the name of the operation that failed (None: the run converged)."""
    return {
        "finished": when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "outcome": "failed" if failed else "converged",
        "changed": len(changed),
        "changed_operations": changed[:NAMES_KEPT],
        "failed_operation": failed,
        "rolled_back": rolled_back,
    }


def write_command(entry: dict) -> str:
    """Replaces the record whole (a reader never sees half of it) and clears the rollback
    marker, which this record has taken into account."""
    target, marker = shlex.quote(RECORD_PATH), shlex.quote(ROLLED_BACK_PATH)
    return (
        f"mkdir -p -- $(dirname {target}) && printf '%s\\n' {shlex.quote(json.dumps(entry))}"
        f" > {target}.new && mv -f -- {target}.new {target} && rm -f -- {marker}"
    )


def parse(text: str) -> dict | None:
    """A record as ``write_command`` wrote it; None for no record or one this version of
    llamarig cannot read."""
    try:
        entry = json.loads(text)
    except ValueError:
        return None
    keys = {"finished", "outcome", "changed", "failed_operation", "rolled_back"}
    return entry if isinstance(entry, dict) and keys <= entry.keys() else None


class DeployRecorder(BaseStateCallback):
    """Writes each host's record when its run ends: once the deploy's last operation has run
    (every host still running), or at the operation that failed for one host."""

    def __init__(self) -> None:
        self._failed: set[str] = set()
        self._last_op: str | None = None

    def operation_host_error(self, state: State, host, op_hash, retry_attempt, retries):
        arguments = state.get_op_data_for_host(host, op_hash).global_arguments
        if arguments.get("_ignore_errors"):
            return
        self._failed.add(host.name)
        _, marker = host.run_shell_command(
            f"cat {shlex.quote(ROLLED_BACK_PATH)} 2>/dev/null", _timeout=WRITE_TIMEOUT_S
        )
        name = ", ".join(state.get_op_meta(op_hash).names) or op_hash
        _write(host, record(_changed(state, host), name, bool(marker.stdout.strip()), _now()))

    def operation_end(self, state: State, op_hash):
        if self._last_op is None:
            self._last_op = state.get_op_order()[-1]
        if op_hash != self._last_op:
            return
        for host in state.activated_hosts:
            if host.name not in self._failed and host.connected:
                _write(host, record(_changed(state, host), None, False, _now()))


def _now() -> datetime:
    return datetime.now(UTC)


def _changed(state: State, host) -> list[str]:
    """The names of the host's operations that ran and changed something, in order."""
    names = []
    for op_hash in host.op_hash_order:
        meta = state.get_op_data_for_host(host, op_hash).operation_meta
        if meta.is_complete() and meta.did_change():
            names.append(", ".join(state.get_op_meta(op_hash).names) or op_hash)
    return names


def _write(host, entry: dict) -> None:
    """Writes the record; a host that does not take it fails nothing (status then shows the
    record before)."""
    try:
        written, output = host.run_shell_command(write_command(entry), _timeout=WRITE_TIMEOUT_S)
    except Exception as error:  # noqa: BLE001 - a record is never worth failing a deploy
        written, output = False, error
    if not written:
        logger.warning(f"{host.print_prefix}llamarig: could not record this deploy: {output}")


def register(state: State) -> None:
    """Adds the recorder to the run's state once (every host's preparation calls this)."""
    if not any(isinstance(handler, DeployRecorder) for handler in state.callback_handlers):
        state.add_callback_handler(DeployRecorder())
