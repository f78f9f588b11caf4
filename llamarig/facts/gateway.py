"""The gateway: what HAProxy's runtime API says of its frontends, backends and servers."""

from __future__ import annotations

import csv
import shlex

from pyinfra.api import FactBase

# A stats line longer than this is not HAProxy's: cut it rather than hold it.
_MAX_LINE = 16384


def stat_rows(output: list[str]) -> list[dict[str, str]]:
    """``show stat``'s CSV as one dict per row, keyed by the header's column names (`# pxname,
    svname,...`); rows that do not fit the header are left out. What the box printed is
    untrusted: nothing here is evaluated, only split."""
    lines = [line[:_MAX_LINE] for line in output if line.strip()]
    if not lines or not lines[0].startswith("# "):
        return []
    header = next(csv.reader([lines[0][2:]]))
    rows = []
    for fields in csv.reader(lines[1:]):
        if len(fields) >= len(header) - 1 and fields and fields[0]:
            rows.append(dict(zip(header, fields, strict=False)))
    return rows


def rigs_up(rows: list[dict[str, str]], backends: dict[str, str]) -> dict[str, list[str]]:
    """For each backend (HAProxy's name -> the model name), the servers HAProxy has UP."""
    up: dict[str, list[str]] = {backend: [] for backend in backends}
    for row in rows:
        backend, server = row.get("pxname", ""), row.get("svname", "")
        if backend in up and server not in ("BACKEND", "FRONTEND"):
            if row.get("status", "").startswith("UP"):
                up[backend].append(server)
    return up


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
        return (
            f"echo 'show stat' | socat -t 5 stdio UNIX-CONNECT:{shlex.quote(admin_socket)} "
            "2>/dev/null; true"
        )

    def process(self, output: list[str]) -> list[dict[str, str]]:
        return stat_rows(output)
