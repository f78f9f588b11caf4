"""Property-based: the loader never crashes. Whatever an inventory file holds - a schema-valid
host from hypothesis-jsonschema, nested junk where groups, hosts, vars and settings go, a valid
host with junk at known key paths, random text or bytes - loading it either succeeds or raises
ConfigError with non-empty problems; no other exception, ever. What loads also maps to pyinfra
hosts and passes through the pre-connection checks without an exception.

EXAMPLES examples per property, derandomized (the same examples on every run, so CI is
reproducible), without a deadline (a slow CI machine must not fail a property)."""

from __future__ import annotations

import copy
import struct
import tempfile
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema
from jsonschema import Draft202012Validator

from llamarig.config import (
    ConfigError,
    connection_problems,
    load_inventory,
    rig_data,
    schema,
)
from llamarig.config.ssh import pyinfra_host
from llamarig.planner import render

EXAMPLES = 250
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
    ],
)

VALID_HOST = {
    "ssh": {"host": "192.0.2.1", "user": "root"},
    "gpus": [
        {"name": "NVIDIA GeForce RTX 3090", "vram_mib": 24576, "compute_capability": "8.6"},
        {"name": "NVIDIA GeForce RTX 5080", "vram_mib": 16303, "compute_capability": "12.0"},
    ],
    "model": {"url": "https://example.org/m.gguf", "sha256": "a" * 64},
    "server": {"split_mode": "tensor", "tensor_split": [2, 3], "cache_type_k": "q8_0"},
}


def _schema_paths(node: dict, prefix: tuple = ()) -> list[tuple]:
    """Every key path the schema names (``("server", "spec", "type")``, ...)."""
    paths = []
    for key, sub in node.get("properties", {}).items():
        paths.append((*prefix, key))
        paths += _schema_paths(sub, (*prefix, key))
    return paths


SCHEMA_PATHS = _schema_paths(schema())
KNOWN_KEYS = sorted({part for path in SCHEMA_PATHS for part in path} | {"all", "rig1", "local"})

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=16)
    | st.sampled_from(["auto", "0.0.0.0", "~", "/", "12.0", "q8_0", "tensor", "", "ssh"])
)
keys = st.sampled_from(KNOWN_KEYS) | st.text(max_size=10) | st.integers() | st.booleans()
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(keys | st.sampled_from(["hosts", "vars", "children"]), inner, max_size=4)
    ),
    max_leaves=24,
)


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory(prefix="llamarig-props-") as directory:
        yield Path(directory)


def write_yaml(directory: Path, document: Any) -> Path:
    path = directory / "rig.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False, allow_unicode=True))
    return path


def loads_or_refuses(path: Path) -> None:
    """The property: ConfigError with problems, or an inventory that maps to pyinfra hosts."""
    try:
        inventory = load_inventory(path)
    except ConfigError as error:
        assert error.problems, "ConfigError without problems"
        assert all(isinstance(p, str) and p.strip() for p in error.problems), error.problems
        event("refused")
        return
    event("loaded")
    for host_config in inventory.hosts.values():
        pyinfra_host(host_config)
    connection_problems(inventory)


def _bounded(node: Any) -> Any:
    """The schema with every list, open mapping and free string capped at a few entries or
    characters: what it accepts, the real schema accepts too, and drawing it is cheaper."""
    if isinstance(node, list):
        return [_bounded(item) for item in node]
    if not isinstance(node, dict):
        return node
    bounded = {key: _bounded(value) for key, value in node.items()}
    types = node.get("type", [])
    types = types if isinstance(types, list) else [types]
    if "array" in types:
        bounded.setdefault("maxItems", 3)
    if "object" in types and node.get("additionalProperties") is not False:
        bounded.setdefault("maxProperties", 3)
    if "string" in types and "pattern" not in node:
        bounded.setdefault("maxLength", 24)
    return bounded


def _printable(value: Any) -> Any:
    """``value`` with control characters taken out of its strings (refused in any setting)."""
    if isinstance(value, str):
        return "".join(ch for ch in value if unicodedata.category(ch) != "Cc")
    if isinstance(value, list):
        return [_printable(item) for item in value]
    if isinstance(value, dict):
        return {_printable(key): _printable(item) for key, item in value.items()}
    return value


# The keywords of a closed mapping and of a list that `_schema_valid` draws itself.
CLOSED_MAPPING_KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "description", "title",
    "$schema", "$id", "$defs",
}  # fmt: skip
LIST_KEYWORDS = {"type", "items", "minItems", "maxItems", "description"}


def _schema_valid(node: dict, definitions: dict) -> st.SearchStrategy:
    """Instances of ``node``: a closed mapping (its properties named, no others allowed) is a
    mapping of valid properties, drawn key by key, and a list one of valid items; anything
    else is hypothesis-jsonschema's.
    hypothesis-jsonschema rebuilds a mapping's strategies on every draw, a fixed dictionary
    builds them once (the property: 51 s before, 28 s after, 2026-12-06)."""
    if (
        node.get("type") == "object"
        and node.get("additionalProperties") is False
        and "properties" in node
        and set(node) <= CLOSED_MAPPING_KEYWORDS
    ):
        required = set(node.get("required", ()))
        drawn = {key: _schema_valid(sub, definitions) for key, sub in node["properties"].items()}
        return st.fixed_dictionaries(
            {key: value for key, value in drawn.items() if key in required},
            optional={key: value for key, value in drawn.items() if key not in required},
        )
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        if set(node) <= LIST_KEYWORDS:
            return st.lists(
                _schema_valid(node["items"], definitions),
                min_size=node.get("minItems", 0),
                max_size=node.get("maxItems"),
            )
    return from_schema({**node, "$defs": definitions})


GENERATION_SCHEMA = _bounded(schema())
VALID_INSTANCES = _schema_valid(GENERATION_SCHEMA, GENERATION_SCHEMA["$defs"])


@PROPERTY
@given(host=VALID_INSTANCES, where=st.sampled_from(["host", "vars"]), fix=st.booleans())
def test_schema_valid_hosts_load_or_are_refused(scratch, host, where, fix):
    Draft202012Validator(schema()).validate(host)
    if fix:  # settle what the cross-field rules check, so that some hosts load and map
        host = _printable(host)
        host["ssh"] = {**host["ssh"], "host": "192.0.2.1", "local": False}
        host["model"] = {**host["model"], "url": None, "path": "/srv/m.gguf"}
        host["llama_cpp"]["backend"] = "cpu"
        host["server"].update(
            host="127.0.0.1", port=8080, api_key_file=None, split_mode="none",
            tensor_split=None, ctx=4096, flash_attn="auto", spec={"type": [], "draft_max": None},
        )  # fmt: skip
    group = {"hosts": {"rig1": host}} if where == "host" else {"vars": host, "hosts": {"rig1": {}}}
    loads_or_refuses(write_yaml(scratch, {"all": {"children": {"rigs": group}}}))


PLACES = [
    lambda j: j,
    lambda j: {"all": j},
    lambda j: {"all": {"hosts": j}},
    lambda j: {"all": {"children": j}},
    lambda j: {"all": {"vars": j, "hosts": {"rig1": VALID_HOST}}},
    lambda j: {"all": {"children": {"rigs": {"hosts": {"rig1": j}}}}},
    lambda j: {"all": {"children": {"rigs": {"vars": j, "hosts": {"rig1": None}}}}},
    lambda j: {"all": {"children": {"rigs": j}}},
]


@PROPERTY
@given(value=junk, place=st.sampled_from(range(len(PLACES))))
def test_junk_anywhere_loads_or_is_refused(scratch, value, place):
    loads_or_refuses(write_yaml(scratch, PLACES[place](value)))


def _set(data: dict, path: tuple, value: Any) -> None:
    node = data
    for key in path[:-1]:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    if value is _set:
        node.pop(path[-1], None)
    else:
        node[path[-1]] = value


@PROPERTY
@given(
    changes=st.lists(
        st.tuples(st.sampled_from(SCHEMA_PATHS), junk | st.just(_set)), min_size=1, max_size=4
    ),
    hosts=st.integers(min_value=1, max_value=3),
)
def test_valid_host_with_junk_at_known_keys_loads_or_is_refused(scratch, changes, hosts):
    host = copy.deepcopy(VALID_HOST)
    for path, value in changes:
        _set(host, path, value)
    # Several hosts with the same settings are also the same machine: the cross-host rules run.
    members = {f"rig{index}": copy.deepcopy(host) for index in range(1, hosts + 1)}
    loads_or_refuses(write_yaml(scratch, {"all": {"children": {"rigs": {"hosts": members}}}}))


@PROPERTY
@given(host_data=st.dictionaries(st.sampled_from(KNOWN_KEYS) | keys, junk, max_size=8))
def test_rig_data_validates_or_refuses(host_data):
    """The deploy's own check of pyinfra host data (stage.py, without inventory.py)."""
    try:
        rig_data(host_data)
    except ConfigError as error:
        assert error.problems


YAML_PIECES = [
    "all:", "hosts:", "children:", "vars:", "rig1:", "server:", "ctx:", "port:", "ssh:",
    "\n", "\n  ", "\n    ", "  ", "\t", "- ", "{", "}", "[", "]", ", ", ": ", "'", '"', "#",
    "&a ", "*a", "<<: *a", "!!int ", "!!float ", "!!binary ", "!!set ", "!!python/object ",
    "? ", "|", ">", "---\n", "...\n", "%YAML 1.1\n", "2024-13-45", "0x1F", "1e400", ".nan",
    "~", "null", "yes", "off", "12.0", "\\u0000", "\x85", "\ufeff", "\x00", "é",
]  # fmt: skip


@PROPERTY
@given(
    content=st.text(max_size=200)
    | st.binary(max_size=200)
    | st.lists(st.sampled_from(YAML_PIECES), max_size=40).map("".join)
)
def test_any_file_content_loads_or_is_refused(scratch, content):
    path = scratch / "rig.yml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8", errors="surrogatepass")
    loads_or_refuses(path)


# --- issue 53: text that decodes to what the loader refuses, and numbers at the C types' edges.
# Cheaper than the properties above: each draws one change to one valid host.
EDGES = settings(PROPERTY, max_examples=60)
INT_MAX = 2**31 - 1
FLT_MIN = struct.unpack("<f", struct.pack("<I", 0x00800000))[0]
FLT_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]

# What a setting may not hold, typed or encoded: control and format characters, and every
# space and line break but the plain space (shapes._invisible).
invisible = st.characters(categories=["Cc", "Cf", "Zl", "Zp", "Zs"]).filter(lambda ch: ch != " ")


def _percent_encoded(character: str, lower: bool) -> str:
    encoded = "".join(f"%{byte:02X}" for byte in character.encode("utf-8"))
    return encoded.lower() if lower else encoded


def _put(data: Any, path: tuple, value: Any) -> None:
    """``value`` at ``path`` in ``data``, through mappings (made where missing) and lists."""
    for key in path[:-1]:
        data = data[key] if isinstance(data, list) else data.setdefault(key, {})
    data[path[-1]] = value


def _problems(path: Path) -> list[str]:
    try:
        load_inventory(path)
    except ConfigError as error:
        return error.problems
    return []


def _router(host: dict, url: str) -> dict:
    """``host`` serving two models, the first from ``url``."""
    router = copy.deepcopy(host)
    router.pop("model")
    router["llama_cpp"] = {"backend": "cpu"}
    router["server"] = {"threads": 2, "split_mode": "none"}
    router["models"] = [
        {"name": "a", "url": url, "sha256": "a" * 64},
        {"name": "b", "path": "/srv/models/b.gguf"},
    ]
    return router


@EDGES
@given(
    character=invisible,
    lower=st.booleans(),
    part=st.sampled_from(["name", "directory", "query", "fragment"]),
    encoded=st.booleans(),
    in_router=st.booleans(),
)
def test_a_url_that_holds_an_invisible_character_encoded_or_escaped_is_refused(
    scratch, character, lower, part, encoded, in_router
):
    """Typed (YAML writes it as an escape) or percent-encoded, in any part of a model's URL:
    refused, naming the key and the code point."""
    text = _percent_encoded(character, lower) if encoded else character
    url = {
        "name": f"https://example.org/models/m{text}.gguf",
        "directory": f"https://example.org/m{text}/m.gguf",
        "query": f"https://example.org/m.gguf?revision={text}",
        "fragment": f"https://example.org/m.gguf#{text}",
    }[part]
    host = copy.deepcopy(VALID_HOST)
    if in_router:
        host, key = _router(host, url), "hosts.rig1.models.0.url: "
    else:
        host["model"]["url"], key = url, "hosts.rig1.model.url: "
    problems = _problems(write_yaml(scratch, {"all": {"hosts": {"rig1": host}}}))
    code_point = f"U+{ord(character):04X}"
    assert any(key in p and code_point in p for p in problems), problems
    # The refusal shows the character escaped, never raw.
    assert all(p.isprintable() for p in problems), problems


@EDGES
@given(
    character=invisible,
    key=st.sampled_from(
        [("server", "alias"), ("model", "filename"), ("paths", "models"), ("server", "service")]
    ),
)
def test_a_string_that_holds_an_escaped_invisible_character_is_refused(scratch, character, key):
    host = copy.deepcopy(VALID_HOST)
    value = {"alias": "m{}x", "filename": "m{}.gguf", "models": "/srv/m{}", "service": "l{}s"}
    _put(host, key, value[key[-1]].format(character))
    problems = _problems(write_yaml(scratch, {"all": {"hosts": {"rig1": host}}}))
    named = f"hosts.rig1.{'.'.join(key)}: "
    assert any(named in p and f"U+{ord(character):04X}" in p for p in problems), problems
    assert all(p.isprintable() for p in problems), problems


# Each integer key that reaches a command line as text, where on a host it is set, and what
# else the host needs for the key to be used.
INT_KEYS = {
    ("server", "batch"): {},
    ("server", "ubatch"): {},
    ("server", "threads"): {},
    ("server", "gpu_layers"): {},
    ("server", "spec", "draft_max"): {("server", "spec", "type"): ["ngram-mod"]},
    ("llama_cpp", "jobs"): {},
    ("server", "start_timeout"): {},
    ("server", "models_max"): "router",
    ("server", "idle_unload_seconds"): "router",
    ("models", 1, "server", "batch"): "router",
    ("models", 1, "server", "parallel"): "router",
}
# The flags llama.cpp reads with std::stoi (-ts and the sampling floats with std::stof).
STOI_FLAGS = {
    "--port", "-c", "-np", "-b", "-ub", "-ngl", "-t", "--spec-draft-n-max", "--top-k",
    "--models-max", "--sleep-idle-seconds", "-p",
}  # fmt: skip
STOF_FLAGS = {
    "-ts", "--temp", "--top-p", "--min-p", "--repeat-penalty", "--presence-penalty",
    "--frequency-penalty",
}  # fmt: skip


def _read_as_llama_cpp_does(args: list[str]) -> None:
    """Every value of a numeric option in ``args`` read as llama.cpp reads it (raises where
    std::stoi or std::stof would throw)."""
    from tests.test_bad_input_numbers import std_stof, std_stoi

    for flag, value in zip(args, args[1:], strict=False):
        if flag in STOI_FLAGS and value not in ("auto", "all"):
            std_stoi(value)
        elif flag in STOF_FLAGS:
            for part in value.split(","):
                std_stof(part)


def _rendered(data: dict) -> list[str]:
    """Every command line and preset option the rig's llama-server gets, flattened."""
    if data.get("models"):
        return render.server_args(data) + [
            part
            for section in render.preset_sections(data)
            for key, value in section["options"]
            for part in (f"-{key}" if len(key) <= 3 else f"--{key}", value)
        ]
    return render.server_args(data)


@EDGES
@given(
    key=st.sampled_from(list(INT_KEYS)),
    value=st.sampled_from([INT_MAX, INT_MAX + 1, 2**32, 2**63, 10**30])
    | st.integers(min_value=INT_MAX - 3, max_value=INT_MAX + 3),
)
def test_an_integer_is_accepted_up_to_a_c_int_and_refused_beyond(scratch, key, value):
    """2^31-1 loads and renders as std::stoi reads it; 2^31 and beyond is refused by name."""
    host = copy.deepcopy(VALID_HOST)
    host["server"].update(split_mode="layer", ctx=4096)
    needs = INT_KEYS[key]
    if needs == "router":
        host = _router(host, "https://example.org/a.gguf")
        host["models"][1]["server"] = {"ctx": 2048}
    else:
        for path, setting in needs.items():
            _put(host, path, setting)
    _put(host, key, value)
    path = write_yaml(scratch, {"all": {"hosts": {"rig1": host}}})
    named = f"hosts.rig1.{'.'.join(map(str, key))}: "
    if key[-1] == "parallel":  # also llama.cpp's most sequences (256): refused at any of these
        assert any(named in p for p in _problems(path))
        return
    if value > INT_MAX:
        problems = _problems(path)
        assert any(named in p and "at most 2147483647" in p for p in problems), problems
        event("refused beyond a C int")
        return
    event("loaded within a C int")
    data = load_inventory(path).hosts["rig1"].data
    _read_as_llama_cpp_does(_rendered(data))


def _next_float32(value: float, up: bool) -> float:
    """The float32 next to ``value`` (a float32), toward +inf or -inf."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    return struct.unpack("<f", struct.pack("<I", bits + (1 if up == (value >= 0) else -1)))[0]


FLOAT_KEYS = [
    ("server", "sampling", "temperature"),
    ("server", "sampling", "top_p"),
    ("server", "sampling", "min_p"),
    ("server", "sampling", "repeat_penalty"),
    ("server", "sampling", "presence_penalty"),
    ("server", "sampling", "frequency_penalty"),
    ("server", "tensor_split", 0),
]
EDGE_FLOATS = [
    0.0, FLT_MIN, -FLT_MIN, FLT_MIN * 0.5, -FLT_MIN * 0.5, _next_float32(FLT_MIN, up=False),
    5e-324, 1e-300, 1.0e-38, 1.2e-38, FLT_MAX, _next_float32(FLT_MAX, up=False), 1e39,
    FLT_MAX * (1 + 2**-20), 0.5, 1e-5,
]  # fmt: skip


def _normal_float32(value: float) -> bool:
    return value == 0 or FLT_MIN <= abs(value) <= FLT_MAX


@EDGES
@given(key=st.sampled_from(FLOAT_KEYS), value=st.sampled_from(EDGE_FLOATS) | st.floats())
def test_a_float_is_accepted_only_as_a_normal_c_float(scratch, key, value):
    """A value std::stof reads (0 or a normal float32) loads, if the key's range allows it,
    and renders as std::stof reads it; one it throws on is refused by name."""
    host = copy.deepcopy(VALID_HOST)
    host["server"].update(split_mode="layer", tensor_split=[2, 3], ctx=4096)
    _put(host, key, value)
    path = write_yaml(scratch, {"all": {"hosts": {"rig1": host}}})
    # A share is named by its index, or (by the schema) the list.
    named = "hosts.rig1." + ".".join(str(part) for part in key if part != 0)
    problems = _problems(path)
    if not _normal_float32(value) or value != value:
        assert any(named in p for p in problems), problems
        event("refused: not a normal C float")
        return
    if problems:  # a C float, but outside the key's own range
        assert any(named in p for p in problems), problems
        event("refused: outside the key's range")
        return
    event("loaded")
    _read_as_llama_cpp_does(_rendered(load_inventory(path).hosts["rig1"].data))
