"""Reading YAML: PyYAML's safe loader made strict (no key given twice, a scalar it cannot
convert reported at its line), every way a file can fail as a ConfigError naming it, limits on
what a document may expand to, and the documented defaults read once."""

from __future__ import annotations

import copy
import os
import stat
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from llamarig.config.paths import DEFAULTS_PATH, INVENTORY_ENV
from llamarig.config.problems import ConfigError


class _RigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with a scalar it cannot convert (``2024-13-45`` read as a date,
    ``!!int abc``) reported as a syntax error at its line instead of a bare ValueError, and a
    key given twice in one mapping refused (PyYAML would silently keep the last one: a second
    `server:` under a host would drop the first)."""

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: dict[tuple, Any] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.composer.ComposerError(
                    "while reading a mapping",
                    node.start_mark,
                    f"the key `{key_node.value}` is given twice in one mapping (first on line "
                    f"{seen[key].line + 1}) and YAML would keep only the last; merge the two",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return node

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except Exception as error:  # PyYAML's constructors raise ValueError, IndexError, ...
            shown = f" {node.value!r}" if isinstance(node, yaml.ScalarNode) else ""
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"cannot read the value{shown} as {node.tag.rsplit(':', 1)[-1]} ({error}); "
                "quote it to keep it as text",
                node.start_mark,
            ) from None


# Far beyond any inventory (a few levels deep, a few hundred values), far below what would
# exhaust the recursion limit or memory of the checks that walk the data.
MAX_DEPTH = 32
MAX_VALUES = 100_000


# An inventory is a few KiB: the cap keeps a wrong file (a model, a log, /dev/zero) from being
# read whole into memory before it is refused.
MAX_FILE_BYTES = 1 << 20


def _read_capped(path: Path, limit: int) -> bytes:
    try:
        # O_NONBLOCK: opening a FIFO would wait for a writer before it could be refused.
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(
            [f"{path}: file not found (set {INVENTORY_ENV} to an inventory file)"]
        ) from None
    except OSError as error:
        raise ConfigError(
            [f"{path}: cannot be read ({error.strerror or error}); fix its permissions or path"]
        ) from None
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        os.close(descriptor)
        if stat.S_ISDIR(mode):
            raise ConfigError(
                [f"{path}: is a directory; set {INVENTORY_ENV} to an inventory file in it"]
            )
        raise ConfigError([f"{path}: is not a regular file; name a YAML file"])
    with os.fdopen(descriptor, "rb") as stream:
        try:
            raw = stream.read(limit + 1)
        except OSError as error:
            raise ConfigError(
                [f"{path}: cannot be read ({error.strerror or error}); fix the file"]
            ) from None
    if len(raw) > limit:
        raise ConfigError(
            [
                f"{path}: larger than {limit // 1024} KiB, the most llamarig reads of a YAML "
                "file; is it the right file? (an inventory is a few KiB)"
            ]
        )
    return raw


def load_yaml(path: Path, limit: int = MAX_FILE_BYTES) -> Any:
    """Parse a YAML file of at most ``limit`` bytes; every way it can fail becomes a
    ConfigError naming the file (and the line and column where YAML knows them)."""
    raw = _read_capped(path, limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise ConfigError(
            [
                f"{path}:{line}: not UTF-8 text (byte 0x{raw[error.start]:02x} at offset "
                f"{error.start}); save the file as UTF-8"
            ]
        ) from None
    try:
        return yaml.load(text, Loader=_RigLoader)  # a SafeLoader: no Python objects
    except yaml.reader.ReaderError as error:
        line = text[: error.position].count("\n") + 1
        column = error.position - (text.rfind("\n", 0, error.position) + 1) + 1
        character = error.character
        character = chr(character) if isinstance(character, int) else character
        raise ConfigError(
            [
                f"{path}:{line}:{column}: YAML cannot contain the character {ascii(character)} "
                f"({error.reason}); remove it or write it as an escape in a double-quoted string"
            ]
        ) from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        problem = getattr(error, "problem", None) or str(error)
        context = getattr(error, "context", None)
        context_mark = getattr(error, "context_mark", None)
        if context and context_mark and (not mark or context_mark.line != mark.line):
            problem += f" ({context} that starts on line {context_mark.line + 1})"
        if "'\\t'" in problem:
            problem += "; indent with spaces: YAML does not allow tabs there"
        elif "; " not in problem:
            problem += (
                "; fix the YAML there (indentation, a missing `:`, an unclosed bracket or "
                "quote; quote a value that starts with a special character)"
            )
        raise ConfigError([f"{path}{where}: YAML syntax error: {problem}"]) from None
    except RecursionError:
        raise ConfigError(
            [
                f"{path}: YAML nested too deeply to read; an inventory needs a few levels "
                "(all: children: GROUP: hosts: NAME: settings)"
            ]
        ) from None


def shape_problem(document: Any) -> str | None:
    """What makes a parsed document unfit to walk, or None: a structure that refers to itself
    (``&a [*a]``), nesting beyond MAX_DEPTH, or aliases expanding beyond MAX_VALUES values."""
    count = 0
    stack: list[tuple[Any, tuple, frozenset]] = [(document, (), frozenset())]
    while stack:
        value, key_path, ancestors = stack.pop()
        count += 1
        dotted = ".".join(str(part) for part in key_path[:MAX_DEPTH]) or "the top level"
        if count > MAX_VALUES:
            return (
                f"{dotted}: the document holds or expands to more than {MAX_VALUES} values; "
                "an inventory needs a few hundred (write aliases out plainly)"
            )
        if not isinstance(value, dict | list):
            continue
        if id(value) in ancestors:
            return (
                f"{dotted}: an alias refers to a mapping or list that contains it (a "
                "recursive structure); settings must be a tree: use the alias elsewhere"
            )
        if len(key_path) >= MAX_DEPTH:
            return f"{dotted}: nested more than {MAX_DEPTH} levels deep; no setting needs that"
        inner = ancestors | {id(value)}
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((child, (*key_path, key), inner) for key, child in items)
    return None


def defaults() -> dict:
    """The documented defaults of group_data/all.yml (a fresh copy)."""
    return copy.deepcopy(_defaults_cached())


@cache
def _defaults_cached() -> dict:
    return load_yaml(DEFAULTS_PATH)
