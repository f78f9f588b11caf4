"""Problems and their words: what a check finds (a key path and a message), the error that
carries them, and the helpers every check words its message with."""

from __future__ import annotations

import datetime
import difflib
import reprlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from llamarig.tables.text import printable

if TYPE_CHECKING:
    from llamarig.config.hosts import HostConfig


class ConfigError(Exception):
    """One or more user mistakes in the rig configuration, each a full sentence of one line:
    a key or value quoted in it is the user's text, so it is shown escaped
    (``llamarig.tables.text``) wherever the error is printed."""

    def __init__(self, problems: list[str]):
        self.problems = [printable(problem) for problem in problems]
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class Problem:
    """One mistake in a host's settings: where (the key path under the host) and what."""

    path: tuple
    message: str
    # The fix is in the inventory (a setting the defaults leave empty, hosts that collide),
    # not in the file that set the key.
    in_inventory: bool = False


def origin_of(host_config: HostConfig, key_path: tuple, in_inventory: bool = False) -> str:
    """The file to fix: the one that set the key (or its nearest parent); ``in_inventory``:
    the inventory, for what only it can fix (a missing setting, hosts that collide)."""
    if in_inventory:
        return host_config.origins.get((), "?")
    if key_path[:1] == ("model",) and len(key_path) > 1:
        # The defaults' model keys are empty placeholders, not defaults: whatever is wrong with
        # a model is fixed where the user wrote `model:`.
        key_path = key_path[:1]
    for length in range(len(key_path), -1, -1):
        origin = host_config.origins.get(tuple(key_path[:length]))
        if origin:
            return origin
    return "?"


def located(host_config: HostConfig, problem: Problem) -> str:
    """The problem as the sentence the user reads: file, key path under the host, message."""
    dotted = ".".join(str(part) for part in problem.path)
    origin = origin_of(host_config, problem.path, problem.in_inventory)
    return f"{origin}: hosts.{host_config.name}.{dotted}: {problem.message}"


# Values are shown as the YAML gave them, but never at length: a wrong value can be a whole
# tree, and aliases can make it a large one.
_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 80, 80
_repr.maxlist = _repr.maxdict = _repr.maxset = _repr.maxtuple = 6


def shown(value: Any) -> str:
    return _repr.repr(value)


def json_type(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
        type(None): "null",
        bytes: "binary data (!!binary)",
        set: "a set (!!set)",
        datetime.date: "a date (quote it to keep it as text)",
        datetime.datetime: "a timestamp (quote it to keep it as text)",
    }
    return names.get(type(value), type(value).__name__)


def did_you_mean(key: Any, known: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1)
    return f"did you mean `{close[0]}`?" if close else f"known keys: {', '.join(known)}"
