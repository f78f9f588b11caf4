"""The gateway: what HAProxy's runtime API says of its frontends, backends and servers."""

from __future__ import annotations

import csv
import shlex

from pyinfra.api import FactBase

from llamarig.onhost import hostpaths


def runtime_api(*commands: str, socket: str | None = None) -> str:
    """One shell line sending each command to HAProxy's runtime API on its admin socket (a
    Unix socket, never on the network; default hostpaths.GATEWAY_ADMIN_SOCKET), each bounded
    to 5 s."""
    socket = socket or hostpaths.GATEWAY_ADMIN_SOCKET
    return "; ".join(
        f"echo {shlex.quote(command)} | socat -t 5 stdio UNIX-CONNECT:{shlex.quote(socket)}"
        for command in commands
    )


def read_stat(lines: list[str]) -> list[dict[str, str]] | str:
    """`show stat`'s rows, each by its header's column names, or why there are none."""
    start = next((i for i, line in enumerate(lines) if line.startswith("# pxname,")), None)
    if start is None:
        said = next((line for line in reversed(lines) if line.strip()), "nothing")
        return f"no statistics from {hostpaths.GATEWAY_ADMIN_SOCKET}: {said[:300]}"
    columns = [name.strip() for name in lines[start][2:].split(",")]
    if not {"pxname", "svname", "status"} <= set(columns):
        return "HAProxy's `show stat` header lacks pxname, svname or status"
    try:
        rows = list(csv.reader(lines[start + 1 :]))
    except csv.Error as error:
        return f"HAProxy's `show stat` is not CSV: {str(error)[:200]}"
    return [dict(zip(columns, row, strict=False)) for row in rows if len(row) >= 2]


def stat_rows(lines: list[str]) -> list[dict[str, str]]:
    """``read_stat``'s rows; none where it found no statistics."""
    rows = read_stat(lines)
    return rows if isinstance(rows, list) else []


def rigs_up(rows: list[dict[str, str]], backends: dict[str, str]) -> dict[str, list[str]]:
    """For each backend (HAProxy's name -> the model name), the servers HAProxy has UP."""
    up: dict[str, list[str]] = {backend: [] for backend in backends}
    for row in rows:
        backend, server = row.get("pxname", ""), row.get("svname", "")
        if backend in up and server not in ("BACKEND", "FRONTEND"):
            if row.get("status", "").startswith("UP"):
                up[backend].append(server)
    return up


def models_without_rig_up(rows: list[dict[str, str]], backends: dict[str, str]) -> list[str]:
    """The models (``backends``: HAProxy's backend name -> the model name) with no server UP."""
    return [backends[backend] for backend, up in rigs_up(rows, backends).items() if not up]


class GatewayStat(FactBase):
    """``show stat`` of the gateway's HAProxy, read on its admin socket ([] when HAProxy or
    its socket is not there).

    + admin_socket: the runtime API's Unix socket

    .. code:: python

        [{"pxname": "model_0", "svname": "rig1", "status": "UP", "scur": "0", ...}, ...]
    """

    def default(self):
        return []

    def command(self, admin_socket: str) -> str:
        return f"{runtime_api('show stat', socket=admin_socket)} 2>/dev/null; true"

    def process(self, output: list[str]) -> list[dict[str, str]]:
        return stat_rows(output)
