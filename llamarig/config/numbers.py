"""Numbers as the programs that read them can: every number of the rig data that reaches a
command line as text (llama-server's and its router's presets, ggml-rpc-server's, the build's,
the deploy's shell) within the C type its reader converts it to, so that no program exits at
start on a value the loader passed.

llama.cpp reads an integer option with ``std::stoi`` (common/arg.cpp: an int option's handler
gets ``std::stoi(value)``; ``-ngl`` takes auto and all, else ``std::stoi``) and a float one
with ``std::stof`` (the sampling options, each ``-ts`` share). ``std::stoi`` throws beyond a
C int; ``std::stof`` throws beyond a C float's range and on underflow (``strtof`` sets ERANGE
for a nonzero magnitude below the smallest normal float: ``1e-300`` is not read as 0); either
way llama-server exits at start. ggml-rpc-server reads ``-p`` and ``-t`` with ``std::stoi``
too, ninja its ``-j`` into a C int, and the deploy's shell waits with integer arithmetic.

``C_TYPES`` holds the bounds, ``NUMBERS`` which key reaches which reader as which type; the
schema keeps each key's own range (a port's 1-65535), which may only be narrower.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

from llamarig.config.problems import Problem
from llamarig.tables.llama_args import SAMPLING

# IEEE 754 single precision, as its bits say: the smallest normal and the largest finite.
FLT_MIN = struct.unpack("<f", struct.pack("<I", 0x00800000))[0]
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


@dataclass(frozen=True)
class CType:
    """A C type a program reads a number into: its bounds and, for a float, the smallest
    nonzero magnitude it reads without underflow (its smallest normal)."""

    name: str
    low: int | float
    high: int | float
    smallest: float = 0.0

    def holds(self, value: int | float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if value != 0 and abs(value) < self.smallest:
            return False
        return self.low <= value <= self.high

    def stated(self) -> str:
        """The range in words; for a float rounded inward (1.1755e-38 is above the smallest
        normal, 3.4028e+38 below the largest), so that every value it names is read."""
        if self.smallest:
            return f"0, and magnitudes from {self.smallest:.4e} to {self.high:.4e}"
        return f"{self.low} to {self.high}"


C_INT = CType("int", -(2**31), 2**31 - 1)
C_FLOAT = CType("float", -FLT_MAX, FLT_MAX, FLT_MIN)
C_TYPES = {"int": C_INT, "float": C_FLOAT}
# Every item of a list, in a key path.
EACH = "*"


@dataclass(frozen=True)
class Number:
    """One key whose number reaches a program as text, the C type it is read into, how (a
    clause that ends "into one") and what happens when the type cannot hold it."""

    key_path: tuple
    c_type: CType
    reads: str
    fails: str


def _server(key: str, option: str, c_type: CType = C_INT) -> Number:
    """A setting llama-server gets as ``option`` (its argv, or a router's preset)."""
    conversion = "std::stof" if c_type is C_FLOAT else "std::stoi"
    beyond = "them" if c_type is C_FLOAT else "it"
    return Number(
        ("server", *key.split(".")),
        c_type,
        f"llama-server reads {option} with {conversion} into one",
        f"which throws beyond {beyond}, and llama-server exits at start",
    )


NUMBERS = (
    _server("port", "--port"),
    _server("ctx", "-c (--ctx-size)"),
    _server("parallel", "-np (--parallel)"),
    _server("batch", "-b (--batch-size)"),
    _server("ubatch", "-ub (--ubatch-size)"),
    _server("gpu_layers", "-ngl (--gpu-layers)"),
    _server("threads", "-t (--threads)"),
    _server("spec.draft_max", "--spec-draft-n-max"),
    _server("tensor_split.*", "each share of -ts (--tensor-split)", C_FLOAT),
    *(
        _server(f"sampling.{key}", entry.flags[0], C_INT if key == "top_k" else C_FLOAT)
        for key, entry in SAMPLING.items()
    ),
    _server("models_max", "--models-max"),
    _server("idle_unload_seconds", "--sleep-idle-seconds"),
    *(
        Number(
            ("rpc", key),
            C_INT,
            f"ggml-rpc-server reads {flag} with std::stoi into one",
            "which throws beyond it, and the worker exits at start",
        )
        for key, flag in (("port", "-p"), ("threads", "-t"))
    ),
    Number(
        ("llama_cpp", "jobs"),
        C_INT,
        "ninja reads the -j of `cmake --build --parallel` with strtol into one",
        "and cuts a larger one short",
    ),
    Number(
        ("server", "start_timeout"),
        C_INT,
        "the deploy adds it to the clock's seconds in shell arithmetic, and llamarig keeps "
        "every number it hands a program within one",
        "beyond which the deadline may overflow",
    ),
)


def _values(data: Any, key_path: tuple, found: tuple = ()) -> list[tuple[tuple, Any]]:
    """(key path, value) of every number at ``key_path`` (EACH: every item of a list)."""
    if not key_path:
        numeric = isinstance(data, int | float) and not isinstance(data, bool)
        return [(found, data)] if numeric else []
    key, rest = key_path[0], key_path[1:]
    if key == EACH:
        items = enumerate(data) if isinstance(data, list) else ()
        return [pair for index, item in items for pair in _values(item, rest, (*found, index))]
    if not isinstance(data, dict) or key not in data:
        return []
    return _values(data[key], rest, (*found, key))


def number_problem(number: Number, value: int | float) -> str | None:
    """Why ``number``'s reader cannot read ``value``, with the range it can, or None."""
    c_type = number.c_type
    if c_type.holds(value):
        return None
    if c_type is C_FLOAT:
        return (
            f"{value!r} is not a number a C float holds ({c_type.stated()}): {number.reads}, "
            f"{number.fails}; set 0 or a value in that range"
        )
    fix = f"at most {c_type.high}" if value > c_type.high else f"at least {c_type.low}"
    return (
        f"{value} is out of a C int's range ({c_type.stated()}): {number.reads}, "
        f"{number.fails}; set {fix}"
    )


def number_problems(data: dict) -> list[Problem]:
    """Every number of ``data`` (one host's rig data, or one model's view of it) that its
    reader cannot read, by key path."""
    return [
        Problem(key_path, problem)
        for number in NUMBERS
        for key_path, value in _values(data, number.key_path)
        if (problem := number_problem(number, value))
    ]
