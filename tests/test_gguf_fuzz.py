"""No traceback from a malformed or truncated GGUF header: the header reader and the planner,
fuzzed with hypothesis on the test models of tests/ggufmodels.py. Every outcome is a plan or a
GgufError whose message starts with the file's name; `llamarig plan --model` on such files
exits with the file named and no traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamarig.model.gguf import GgufError, GgufHeader, read_gguf_header, read_gguf_header_file
from llamarig.planner.memory import Device, MemoryPlan, plan_memory
from tests.conftest import PROJECT, offline, pyinfra_env
from tests.ggufmodels import Qwen35Shape, write_llama, write_qwen35

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
SMALL_QWEN = Qwen35Shape(
    n_layer=8, n_embd=512, n_ff=1024, n_vocab=1000, n_head=4, n_head_kv=2, head_dim=64,
    ssm_k_heads=4, ssm_v_heads=8, ssm_head_dim=32,
)  # fmt: skip
NAME = "fuzzed.gguf"
DEVICES = [Device("GPU0", 24576, 512), Device("GPU1", 16303, 512)]


@cache
def model_bytes() -> dict[str, bytes]:
    """The test models' headers: a 2-layer llama and a small qwen35 hybrid with an MTP block."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        return {
            "llama": write_llama(Path(scratch) / "l.gguf").read_bytes(),
            "qwen35": write_qwen35(Path(scratch) / "q.gguf", SMALL_QWEN).read_bytes(),
        }


def plan_or_named_error(header: GgufHeader, split_mode: str, ctx, mtp: int) -> None:
    """The property: the planner returns a plan or a GgufError naming the file; anything
    else propagates and fails the test with its traceback."""
    try:
        result = plan_memory(header, DEVICES, split_mode, "auto", ctx, mtp_draft_n_max=mtp)
    except GgufError as error:
        assert str(error).startswith(f"{NAME}: "), error
    else:
        assert isinstance(result, MemoryPlan)


# Values a corrupt header can hold where the planner expects a count: GGUF's own types.
GGUF_VALUES = st.one_of(
    st.integers(-3, 2**64 - 1),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=4),
    st.lists(st.integers(-2, 600), max_size=12),
    st.lists(st.booleans(), max_size=12),
    st.lists(st.text(max_size=2), max_size=3),
)


@st.composite
def mutated_headers(draw) -> GgufHeader:
    base = read_gguf_header(model_bytes()[draw(st.sampled_from(["llama", "qwen35"]))], NAME)
    metadata, tensors = dict(base.metadata), list(base.tensors)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["set", "delete", "block", "flatten", "drop"]))
        if kind in ("set", "delete"):
            key = draw(st.sampled_from(sorted(metadata)))
            if kind == "delete":
                del metadata[key]
            else:
                metadata[key] = draw(GGUF_VALUES)
        elif tensors:
            index = draw(st.integers(0, len(tensors) - 1))
            tensor = tensors[index]
            if kind == "block":  # a tensor of a block the model may not have
                block = draw(st.integers(0, 2 * len(tensors)))
                tensors[index] = replace(
                    tensor, name=re.sub(r"^blk\.\d+", f"blk.{block}", tensor.name)
                )
            elif kind == "flatten":
                tensors[index] = replace(tensor, shape=tensor.shape[:1])
            else:
                del tensors[index]
    return GgufHeader(base.version, metadata, tensors, base.data_offset, base.alignment, NAME)


PLAN_SETTINGS = (
    st.sampled_from(["tensor", "layer", "none"]),
    st.sampled_from(["auto", 4096]),
    st.sampled_from([0, 3]),
)


@FUZZ
@given(mutated_headers(), *PLAN_SETTINGS)
def test_mutated_header_plans_or_names_the_file(header, split_mode, ctx, mtp):
    plan_or_named_error(header, split_mode, ctx, mtp)


@st.composite
def damaged_bytes(draw) -> bytes:
    data = bytearray(model_bytes()[draw(st.sampled_from(["llama", "qwen35"]))])
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data))) :]  # truncated
    for _ in range(draw(st.integers(0, 3))):  # bytes overwritten, lengths and counts included
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        data[at : at + 8] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@FUZZ
@given(damaged_bytes(), *PLAN_SETTINGS)
def test_damaged_file_reads_and_plans_or_names_the_file(data, split_mode, ctx, mtp):
    try:
        header = read_gguf_header(data, name=NAME)
    except GgufError as error:
        assert str(error).startswith(f"{NAME}: "), error
        return
    plan_or_named_error(header, split_mode, ctx, mtp)


def test_a_tensor_outside_block_count_is_named(tmp_path):
    """The case that was an IndexError in memory.py: blk.2 in a model of two blocks."""
    header = read_gguf_header_file(write_llama(tmp_path / "l.gguf"))
    moved = [replace(t, name=t.name.replace("blk.1.", "blk.2.")) for t in header.tensors]
    broken = replace(header, tensors=moved)
    with pytest.raises(GgufError) as caught:
        plan_memory(broken, DEVICES)
    assert str(caught.value) == (
        f"{header.source}: tensor blk.2.attn_norm.weight belongs to block 2, but "
        "llama.block_count is 2 (blocks 0 to 1); the header is corrupt or truncated (download "
        "the file again, or plan with a good copy: --model PATH)"
    )


def plan_command(model: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        offline([sys.executable, "-m", "llamarig.cli", "plan", "--model", str(model)]),
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY="inventory/example-5080-3090.yml"),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("damage", "status", "words"),
    [
        ("missing", 2, ("--model", "is not a GGUF file on this machine (no such file)")),
        ("truncated", 2, ("truncated at byte 3000 while reading",)),
        ("not-gguf", 2, ("not a GGUF file (magic b'\\x7fELF'",)),
        (
            "block-outside",
            1,
            ("tensor blk.99.attn_norm.weight belongs to block 99", "block_count is 65"),
        ),
    ],
)
def test_llamarig_plan_names_a_bad_model_file(damage, status, words, tmp_path):
    model = tmp_path / f"{damage}.gguf"
    good = write_qwen35(tmp_path / "good.gguf").read_bytes()
    if damage == "truncated":
        model.write_bytes(good[:3000])
    elif damage == "not-gguf":
        model.write_bytes(b"\x7fELF" + bytes(60))
    elif damage == "block-outside":  # the first tensor of the MTP block renamed a block on
        model.write_bytes(good.replace(b"blk.64.attn_norm", b"blk.99.attn_norm", 1))
    result = plan_command(model)
    output = result.stdout + result.stderr
    assert result.returncode == status, output
    assert "Traceback" not in output
    lines = [line.strip() for line in output.splitlines() if str(model) in line]
    assert any(all(word in line for word in words) for line in lines), output
