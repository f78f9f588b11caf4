"""Numbers a program cannot read, and text that percent-decoding smuggles past the loader
(issue 53, items 2 and 4), refused before any connection with the file, the key path and the
fix: an integer beyond the C type llama.cpp reads it into (std::stoi: a C int), a float that
is not a normal C float (std::stof throws on underflow and overflow), more models loaded at
startup than the router may hold, a control or format character that a model URL holds
percent-encoded, and a split model's shards given one digest twice. Same table form as
tests/test_bad_input.py; each case is one mistake."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from llamarig.config import ConfigError, load_inventory, schema
from llamarig.config.inventory import tuned_path
from llamarig.config.shapes import file_name_problem
from llamarig.model.catalog import SERVER_KEYS
from llamarig.model.files import url_file_name
from llamarig.planner import render
from llamarig.planner.plan import plan_host
from tests.test_bad_input import SHA, Case, assert_refused_by_name, edit, host

INT_MAX = 2**31 - 1
SHA_B, SHA_C = "b" * 64, "c" * 64

# A router rig (`models:`) on a CPU build: {SERVER} is its server settings, {STARTUP} whether
# its second model is loaded at startup too, {CODE} more settings of that model.
ROUTER = f"""\
all:
  children:
    rigs:
      hosts:
        rig1:
          ssh: {{host: 192.0.2.1, user: root}}
          llama_cpp: {{backend: cpu}}
          server: {{threads: 2, SERVER}}
          models:
            - name: chat
              url: https://example.org/chat.Q4_K_M.gguf
              sha256: "{SHA}"
              load_on_startup: true
            - name: code
              path: /srv/models/code.gguf
              load_on_startup: STARTUP
              server: {{ctx: 2048CODE}}
"""


def router(server: str = "models_max: 2", startup: str = "false", code: str = "") -> str:
    return ROUTER.replace("SERVER", server).replace("STARTUP", startup).replace("CODE", code)


def url(value: str) -> str:
    """The base rig with its model at ``value``."""
    return edit("url: https://example.org/m.gguf", f"url: {value}")


CASES = [
    # --- item 4: integers beyond the C int llama.cpp reads them into (std::stoi) --------------
    Case(
        "batch-beyond-a-c-int",
        host(f"server: {{batch: {INT_MAX + 1}}}"),
        "hosts.rig1.server.batch",
        ("2147483648", "-b", "std::stoi", "C int", "set at most 2147483647"),
    ),
    Case(
        "ubatch-beyond-a-c-int",
        host("server: {ubatch: 4294967296}"),
        "hosts.rig1.server.ubatch",
        ("4294967296", "-ub", "std::stoi", "set at most 2147483647"),
    ),
    Case(
        "threads-beyond-a-c-int",
        host("server: {threads: 99999999999}"),
        "hosts.rig1.server.threads",
        ("99999999999", "-t", "std::stoi", "set at most 2147483647"),
    ),
    Case(
        "gpu-layers-beyond-a-c-int",
        host(f"server: {{gpu_layers: {INT_MAX + 1}}}"),
        "hosts.rig1.server.gpu_layers",
        ("-ngl", "std::stoi", "set at most 2147483647"),
    ),
    Case(
        "draft-max-beyond-a-c-int",
        host(f"server: {{spec: {{type: [ngram-mod], draft_max: {INT_MAX + 1}}}}}"),
        "hosts.rig1.server.spec.draft_max",
        ("--spec-draft-n-max", "std::stoi", "set at most 2147483647"),
    ),
    Case(
        "build-jobs-beyond-a-c-int",
        host(f"llama_cpp: {{jobs: {INT_MAX + 1}}}"),
        "hosts.rig1.llama_cpp.jobs",
        ("--parallel", "C int", "set at most 2147483647"),
    ),
    Case(
        "start-timeout-beyond-a-c-int",
        host(f"server: {{start_timeout: {2**63}}}"),
        "hosts.rig1.server.start_timeout",
        ("9223372036854775808", "C int", "set at most 2147483647"),
    ),
    Case(
        "models-max-beyond-a-c-int",
        router(f"models_max: {INT_MAX + 1}"),
        "hosts.rig1.server.models_max",
        ("2147483648", "--models-max", "std::stoi", "set at most 2147483647"),
    ),
    Case(
        "idle-unload-beyond-a-c-int",
        router(f"idle_unload_seconds: {2**32}"),
        "hosts.rig1.server.idle_unload_seconds",
        ("4294967296", "--sleep-idle-seconds", "std::stoi", "set at most 2147483647"),
    ),
    Case(
        "a-models-batch-beyond-a-c-int",
        router(code=f", batch: {INT_MAX + 1}"),
        "hosts.rig1.models.1.server.batch",
        ("2147483648", "-b", "std::stoi", "set at most 2147483647"),
    ),
    # --- item 4: floats that are not a normal C float (std::stof throws) ----------------------
    Case(
        "min-p-underflows-a-c-float",
        host("server: {sampling: {min_p: 1.0e-300}}"),
        "hosts.rig1.server.sampling.min_p",
        ("1e-300", "--min-p", "std::stof", "C float", "1.1755e-38 to 3.4028e+38", "set 0 or"),
    ),
    Case(
        "presence-penalty-is-subnormal",
        host("server: {sampling: {presence_penalty: -1.0e-40}}"),
        "hosts.rig1.server.sampling.presence_penalty",
        ("-1e-40", "--presence-penalty", "std::stof", "1.1755e-38 to 3.4028e+38"),
    ),
    Case(
        "tensor-split-share-overflows-a-c-float",
        host("server: {split_mode: layer, tensor_split: [1.0e+39, 1]}"),
        "hosts.rig1.server.tensor_split.0",
        ("1e+39", "-ts", "std::stof", "1.1755e-38 to 3.4028e+38"),
    ),
    Case(
        "a-models-temperature-underflows",
        router(code=", sampling: {temperature: 1.0e-45}"),
        "hosts.rig1.models.1.server.sampling.temperature",
        ("1e-45", "--temp", "std::stof", "1.1755e-38 to 3.4028e+38"),
    ),
    # --- item 4: models loaded at startup beyond models_max ----------------------------------
    Case(
        "two-models-at-startup-one-at-once",
        router("models_max: 1", startup="true"),
        "hosts.rig1.server.models_max",
        (
            "1, but 2 models load at startup (chat, code)",
            "raise models_max to at least 2",
            "load_on_startup: false",
        ),
    ),
    # --- item 2: characters that percent-decoding would let past the loader -------------------
    Case(
        "url-percent-encodes-nul",
        url("https://example.org/m%00.gguf"),
        "hosts.rig1.model.url",
        ("%00", "U+0000", "remove it"),
    ),
    Case(
        "url-percent-encodes-next-line",
        url("https://example.org/m%C2%85x.gguf"),
        "hosts.rig1.model.url",
        ("%C2%85", "U+0085", "remove it"),
    ),
    Case(
        "url-percent-encodes-a-bidi-override",
        url("https://example.org/m%E2%80%AEfuggu.gguf"),
        "hosts.rig1.model.url",
        ("%E2%80%AE", "U+202E RIGHT-TO-LEFT OVERRIDE", "remove it"),
    ),
    Case(
        "url-percent-encodes-an-escape-sequence",
        url("https://example.org/m%1B[2J.gguf"),
        "hosts.rig1.model.url",
        ("%1B", "U+001B", "remove it"),
    ),
    Case(
        "url-query-percent-encodes-a-line-break",
        url("https://example.org/m.gguf?x=%0a"),
        "hosts.rig1.model.url",
        ("%0a", "U+000A", "remove it"),
    ),
    Case(
        "a-models-url-percent-encodes-an-escape",
        ROUTER.replace("SERVER", "models_max: 2")
        .replace("STARTUP", "false")
        .replace("CODE", "")
        .replace("chat.Q4_K_M.gguf", "chat%1B]0;x%07.gguf"),
        "hosts.rig1.models.0.url",
        ("%1B", "U+001B", "remove it"),
    ),
    # --- leftover: a split model's shards with one digest twice -------------------------------
    Case(
        "split-sha256-repeated",
        edit(
            f'url: https://example.org/m.gguf\n            sha256: "{SHA}"',
            "url: https://example.org/m-00001-of-00003.gguf\n"
            f'            sha256: ["{SHA_B}", "{SHA_C}", "{SHA_B}"]',
        ),
        "hosts.rig1.model.sha256.2",
        ("is also sha256[0]", "two shards cannot have the same content", "each shard's own"),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_number_or_decoded_text_is_refused_with_file_key_and_fix(case, tmp_path):
    assert_refused_by_name(case, tmp_path)


def test_the_router_base_loads(tmp_path):
    """The router every case above changes loads as it is (so each case is one mistake)."""
    path = tmp_path / "rig.yml"
    path.write_text(router(f"models_max: {INT_MAX}, idle_unload_seconds: {INT_MAX}"))
    data = load_inventory(path).hosts["rig1"].data
    assert data["server"]["models_max"] == INT_MAX


def test_a_tuned_batch_beyond_a_c_int_is_refused_naming_the_tuned_file(tmp_path):
    inventory = tmp_path / "rig.yml"
    inventory.write_text(host())
    tuned = tuned_path(inventory, "rig1")
    tuned.parent.mkdir()
    tuned.write_text(f"server: {{batch: {INT_MAX + 1}, ubatch: 512}}\n")
    with pytest.raises(ConfigError) as caught:
        load_inventory(inventory)
    prefix = f"{tuned}: hosts.rig1.server.batch: "
    named = [p for p in caught.value.problems if p.startswith(prefix)]
    assert named and "set at most 2147483647" in named[0], caught.value.problems


def test_the_file_name_taken_from_a_url_is_checked_decoded():
    """url_file_name decodes; what it gives is checked as a typed name would be."""
    name = url_file_name("https://example.org/m%00x%1B[2J.gguf")
    problem = file_name_problem(name)
    assert problem and "U+0000" in problem, problem
    assert "\x00" not in problem and "\x1b" not in problem


# std::stof and std::stoi as llama.cpp calls them: strtof/strtol, throwing where nothing was
# read or errno is ERANGE (and, for stoi, where the long does not fit an int).
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_LIBC.strtof.restype = ctypes.c_float
_LIBC.strtof.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]


def std_stof(text: str) -> float:
    end = ctypes.c_char_p()
    ctypes.set_errno(0)
    value = _LIBC.strtof(text.encode(), ctypes.byref(end))
    if ctypes.get_errno() or end.value == text.encode():
        raise ValueError(f"std::stof throws on {text!r}")
    return value


_LIBC.strtol.restype = ctypes.c_long
_LIBC.strtol.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]


def std_stoi(text: str) -> int:
    end = ctypes.c_char_p()
    ctypes.set_errno(0)
    value = _LIBC.strtol(text.encode(), ctypes.byref(end), 10)
    if ctypes.get_errno() or end.value == text.encode() or not -(2**31) <= value < 2**31:
        raise ValueError(f"std::stoi throws on {text!r}")
    return value


def test_render_writes_floats_as_std_stof_reads_them_and_never_one_it_cannot():
    """Every normal C float is written in a form std::stof reads back; the loader refuses the
    others, and render refuses to write one rather than write what llama-server exits on."""
    for value in (1e-05, 0.1, 0.7, -0.5, 1.1755e-38, 3.4028e38, 2.0, 1e20, 0.0, 7):
        assert std_stof(render._number(value)) == pytest.approx(value, rel=1e-6)
    for value in (1e-300, -1e-40, 1e39, 4e38, 2**200):
        with pytest.raises(ValueError, match="std::stof"):
            render._number(value)


def test_the_plan_prints_a_probed_gpu_name_escaped(tmp_path):
    """A box's nvidia-smi output is untrusted: an escape sequence in a GPU's name is shown,
    not obeyed."""
    path = tmp_path / "rig.yml"
    path.write_text(
        edit("          gpus:\n", "          llama_cpp: {backend: cpu}\n          gpus:\n")
    )
    data = load_inventory(path).hosts["rig1"].data
    data["gpus"] = []
    probed = [
        {"name": "GPU\x1b]0;owned\x07\x1b[2J", "vram_mib": 24576, "compute_capability": "8.6"}
    ]
    report = plan_host("rig1", data, None, probed_gpus=probed).report()
    assert "\x1b" not in report and "\x07" not in report, report
    assert "GPU\\x1b]0;owned\\x07\\x1b[2J" in report


def _schema_of(key_path: tuple) -> dict:
    node = schema()
    for key in key_path:
        if key == "*":  # the items of the key's list branch
            node = next(b for b in node.get("oneOf", [node]) if b.get("type") == "array")
            node = node["items"]
        else:
            node = node["properties"][key]
    return node


def _numeric_branches(node: dict) -> list[dict]:
    """The parts of a key's schema that accept a number (a oneOf's numeric branch, a list's
    items)."""
    types = node.get("type", [])
    types = types if isinstance(types, list) else [types]
    found = [node] if {"integer", "number"} & set(types) else []
    for branch in node.get("oneOf", []):
        found += _numeric_branches(branch)
    return found


def test_every_number_of_the_table_is_a_numeric_key_within_its_c_type():
    """The table of numbers read as C types names keys the schema has, each accepting numbers,
    and the schema's own range of each (a port's 1-65535) lies within the C type: the schema
    narrows, never widens. A key a router's model sets is the same key in models[N].server."""
    from llamarig.config.numbers import NUMBERS

    model_server = schema()["properties"]["models"]["items"]["properties"]["server"]
    for number in NUMBERS:
        branches = _numeric_branches(_schema_of(number.key_path))
        assert branches, number.key_path
        for branch in branches:
            for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if bound in branch:
                    assert number.c_type.low <= branch[bound] <= number.c_type.high, branch
        if number.key_path[0] == "server" and number.key_path[1] in SERVER_KEYS:
            assert number.key_path[1] in model_server["properties"], number.key_path
