"""The JSON schema of a host's rig data: its validator, made strict about numbers, and each
schema error worded as the user's mistake with its fix."""

from __future__ import annotations

import json
import math
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator, validators

from llamarig.config.hosts import HostConfig
from llamarig.config.paths import SCHEMA_PATH
from llamarig.config.problems import Problem, did_you_mean, json_type, located, shown
from llamarig.config.shapes import foreign_characters, invisible_characters


@cache
def schema() -> dict:
    return json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))


def _is_integer(checker, instance) -> bool:
    # JSON Schema counts 8080.0 as an integer; a port, a size or a count written that way would
    # reach command lines and URLs as "8080.0".
    return isinstance(instance, int) and not isinstance(instance, bool)


def _is_number(checker, instance) -> bool:
    # .nan and .inf pass every minimum/maximum comparison; no setting means them.
    if isinstance(instance, float):
        return math.isfinite(instance)
    return _is_integer(checker, instance)


_RigValidator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _is_integer, "number": _is_number}
    ),
)


def schema_problems(host_config: HostConfig) -> list[str]:
    """Every schema error of one host, worded, in key-path order."""
    errors = _RigValidator(schema()).iter_errors(host_config.data)
    problems = []
    for error in sorted(errors, key=lambda e: _path_key(e.path)):
        problems.extend(_describe_schema_error(host_config, error))
    return problems


def _path_key(key_path) -> list[tuple[int, Any]]:
    """A sort key for key paths that mix list indexes and mapping keys of any type."""
    return [(0, part, "") if isinstance(part, int) else (1, 0, str(part)) for part in key_path]


def _expected(subschema: Any) -> str:
    """What a schema asks for, in words: its description, else its type, values or form."""
    if not isinstance(subschema, dict):
        return ""
    if subschema.get("description"):
        return subschema["description"]
    parts = []
    if "enum" in subschema:
        parts.append("one of " + ", ".join(map(str, subschema["enum"])))
    if "type" in subschema:
        types = subschema["type"] if isinstance(subschema["type"], list) else [subschema["type"]]
        parts.append(" or ".join(f"{'an' if t[0] in 'aeiou' else 'a'} {t}" for t in types))
    if "pattern" in subschema:
        parts.append(f"matching {subschema['pattern']}")
    if "minimum" in subschema:
        parts.append(f"at least {subschema['minimum']}")
    if "maximum" in subschema:
        parts.append(f"at most {subschema['maximum']}")
    return ", ".join(parts)


def _describe_schema_error(host_config: HostConfig, error) -> list[str]:
    key_path = tuple(error.absolute_path)
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed), key=lambda key: (str(key), repr(key)))
        parts = []
        for key in extra:
            if isinstance(key, str):
                hint = did_you_mean(key, allowed)
                wrong = f"unknown key `{key}`{invisible_characters(key) or foreign_characters(key)}"
            else:
                hint = f"keys are names such as {', '.join(allowed[:3])}"
                wrong = f"the key {shown(key)} is {json_type(key)}, not a name"
            parts.append(located(host_config, Problem((*key_path, key), f"{wrong}; {hint}")))
        return parts
    if error.validator == "required":
        missing = error.message.split("'")[1] if "'" in error.message else ""
        fix = f"add `{missing}`" if missing else "add it"
        return [
            located(host_config, Problem(key_path, f"{error.message}; {fix}", in_inventory=True))
        ]
    if "propertyNames" in error.schema_path:
        # The instance is the offending key itself: name it in the path.
        name = error.instance
        text = (
            f"the name {shown(name)} has the wrong form"
            f"{_named_characters(name) if isinstance(name, str) else ''}; expected a name "
            f"{_expected(error.schema)}"
        )
        return [located(host_config, Problem((*key_path, name), text))]
    description = error.schema.get("description") if isinstance(error.schema, dict) else None
    expected = description or _expected(error.schema)
    if error.validator == "enum":
        wrong = f"{shown(error.instance)} is not allowed"
        if isinstance(error.instance, str):
            wrong += _named_characters(error.instance)
        expected = description or "one of " + ", ".join(map(str, error.validator_value))
    elif error.validator == "type":
        if isinstance(error.instance, float) and not math.isfinite(error.instance):
            wrong = f"{shown(error.instance)} is not a finite number"
        elif isinstance(error.instance, float) and "integer" in str(error.validator_value):
            wrong = f"{shown(error.instance)} is a number with a fraction, not a whole number"
        else:
            wrong = f"{shown(error.instance)} is {json_type(error.instance)}"
    elif error.validator == "pattern":
        wrong = f"{shown(error.instance)} has the wrong form"
        if "{" in error.validator_value:  # a fixed length, such as a checksum's or a commit's
            wrong += f" ({len(error.instance)} characters)"
        wrong += invisible_characters(error.instance)
    elif error.validator in ("minimum", "exclusiveMinimum"):
        wrong = f"{shown(error.instance)} is out of range (below {error.validator_value})"
    elif error.validator in ("maximum", "exclusiveMaximum"):
        wrong = f"{shown(error.instance)} is out of range (above {error.validator_value})"
    elif (
        error.validator in ("minLength", "minItems")
        and error.validator_value > 1
        and (len(error.instance) > 0)
    ):
        noun = "characters" if error.validator == "minLength" else "items"
        wrong = (
            f"{shown(error.instance)} has {len(error.instance)}, fewer than "
            f"{error.validator_value} {noun}"
        )
    elif error.validator in ("minLength", "minItems"):
        wrong = f"{shown(error.instance)} is empty"
    else:
        wrong = f"{shown(error.instance)} is not valid"
    text = _known_mistake(key_path, error.validator, error.instance)
    text = text or (f"{wrong}; expected {expected}" if expected else wrong)
    return [located(host_config, Problem(key_path, text))]


def _named_characters(text: str) -> str:
    """What makes a string that looks right wrong: an invisible character, else a foreign
    one (a Cyrillic а in `layer`), named; or ""."""
    return invisible_characters(text) or foreign_characters(text)


def _known_mistake(key_path: tuple, validator: str, value: Any) -> str | None:
    """The message for a schema error that has a well-known cause, or None."""
    key = key_path[-1] if key_path else None
    if key == "pci_bus_id" and validator == "type" and isinstance(value, int | float):
        return (
            f"{shown(value)} is a number: YAML 1.1 reads an unquoted bus id such as "
            '01:00.0 as base 60; quote it (pci_bus_id: "0000:01:00.0")'
        )
    if key in ("vram_mib", "usable_mib") and validator == "minimum" and 0 < value < 1024:
        return (
            f"{value} looks like GiB, and the key is in MiB: {value} GiB is {value * 1024} MiB "
            "(nvidia-smi --query-gpu=memory.total --format=csv shows the exact MiB)"
        )
    if key_path == ("model", "url") and isinstance(value, str) and value.startswith("file:"):
        return (
            f"{shown(value)} is a local file, and `url` is downloaded over http(s): use "
            "`model.path` for a file already on the host"
        )
    return None
