"""Facts read in batches and once per change: ``prefetch`` reads several facts of a host in one
round trip (``Batch``), ``known`` answers from what was read until an operation runs a command
on any host. pyinfra 3 keeps no fact cache: without these every read is a round trip, and a
stage's fact read while planning is read again when its operation runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pyinfra.api import FactBase

# A reader answers a pyinfra fact for the host: ``reader(FactClass, **arguments)``, as
# ``pyinfra.host.get_fact`` does in a deploy.
Reader = Callable[..., Any]

BATCH_MARK = "@@llamarig-fact"


class Batch(FactBase):
    """Several facts' commands in one round trip, each in its own subshell; their output lines
    by request, for each fact's own ``process()`` (``parse_one``). A command that fails is left
    out, so the caller reads that fact on its own and pyinfra reports the failure as usual.
    Use it through ``prefetch``.

    + requests: ``(FactClass, ((argument, value), ...))`` pairs

    .. code:: python

        {0: ["644", "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e  -"]}
    """

    default = dict

    def command(self, requests: tuple) -> str:
        parts = []
        for index, (fact_class, arguments) in enumerate(requests):
            fact = fact_class()
            command = fact.command(**dict(arguments))
            command = getattr(command, "get_raw_value", lambda c=command: c)()
            required = fact.requires_command(**dict(arguments))
            if required:
                required = getattr(required, "get_raw_value", lambda r=required: r)()
                command = (
                    f"if command -v {required} >/dev/null 2>&1; then ( {command} ); "
                    f"else echo {BATCH_MARK}-missing; fi"
                )
            parts.append(f"echo '{BATCH_MARK} {index}'; ( {command}\n); echo \"{BATCH_MARK} $?\"")
        return "\n".join(parts)

    def process(self, output: list[str]) -> dict[int, list[str]]:
        outputs: dict[int, list[str]] = {}
        index, lines = None, []
        for line in output:
            if not line.startswith(BATCH_MARK + " "):
                if index is not None:
                    lines.append(line)
            elif index is None:
                index, lines = int(line.split()[1]), []
            else:
                if line.split()[1] == "0":
                    outputs[index] = lines
                index = None
        return outputs


def parse_one(fact_class, arguments: dict, lines: list[str]):
    """One fact's value from its output lines, as pyinfra makes it (the default when there
    are none, or when its required command is missing)."""
    fact = fact_class()
    fact.command(**arguments)  # some facts keep what their command chose (a marker)
    if not lines or lines == [f"{BATCH_MARK}-missing"]:
        return fact.default()
    return fact.process(lines)


# Facts read in this run, per host: valid until an operation runs a command on any host (hosts
# of one machine see each other's changes). pyinfra 3 keeps no fact cache: every read is a
# round trip, and a stage's fact read while planning is read again when its operation runs.
_known: dict[str, tuple[int, dict]] = {}


def _commands_run(state) -> int:
    """How many operations have run a command so far, on every host."""
    return sum(
        1
        for each in state.inventory
        for op_hash in each.op_hash_order
        if op_hash in state.ops.get(each, {}) and state.ops[each][op_hash].operation_meta.executed
    )


def _cache(host, state) -> dict:
    runs = _commands_run(state)
    seen, values = _known.get(host.name, (-1, {}))
    if seen != runs:
        values = {}
        _known[host.name] = (runs, values)
    return values


def _key(fact_class, arguments: dict) -> tuple:
    return (fact_class, tuple(sorted((name, repr(value)) for name, value in arguments.items())))


def known(fact_class, **arguments):
    """``host.get_fact(fact_class, **arguments)``, read once while nothing has changed."""
    from pyinfra import host, state

    values = _cache(host, state)
    key = _key(fact_class, arguments)
    if key not in values:
        values[key] = host.get_fact(fact_class, **arguments)
    return values[key]


def prefetch(requests: list[tuple[type, dict]]) -> None:
    """Read the facts of ``requests`` (``(FactClass, arguments)``) that are not known yet in
    one round trip, for ``known`` to answer from."""
    from pyinfra import host, state

    values = _cache(host, state)
    missing = [(cls, args) for cls, args in requests if _key(cls, args) not in values]
    if not missing:
        return
    batch = tuple((cls, tuple(sorted(args.items()))) for cls, args in missing)
    outputs = host.get_fact(Batch, requests=batch)
    for index, (cls, args) in enumerate(missing):
        if index in outputs:
            values[_key(cls, args)] = parse_one(cls, args, outputs[index])
