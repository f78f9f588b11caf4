import io
import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter

from llamarig.model.gguf import (
    GGML_OVERRIDES,
    GGML_TYPES,
    READ_CHUNK,
    GgmlType,
    GgufError,
    ggml_type,
    read_gguf_header,
    read_gguf_header_file,
    row_size,
)
from tests.ggufmodels import Qwen35Shape, write_llama, write_qwen35


def test_type_sizes_are_gguf_py_but_for_the_named_overrides():
    for quant_type, (block_size, type_size) in GGML_QUANT_SIZES.items():
        if quant_type.name == "Q8_1":
            # gguf 0.19.0 says 40 bytes; the pinned ggml has two halves + 32 quants (static_assert)
            assert GGML_TYPES[int(quant_type)].type_size == 36
            continue
        assert GGML_TYPES[int(quant_type)].block_size == block_size, quant_type.name
        assert GGML_TYPES[int(quant_type)].type_size == type_size, quant_type.name
    assert ggml_type("Q2_0") == GGML_TYPES[42] == GgmlType("Q2_0", 64, 18)
    assert ggml_type("Q8_0") == ggml_type(8)
    assert row_size("q8_0", 1024) == 1088
    assert row_size("q4_0", 256) == 144
    with pytest.raises(ValueError):
        row_size("q8_0", 100)


def test_each_override_is_where_gguf_py_differs():
    """An override that gguf-py has come to agree with is stale: drop it."""
    known = {int(t): size for t, size in GGML_QUANT_SIZES.items()}
    for type_id, layout in GGML_OVERRIDES.items():
        assert known.get(type_id) != (layout.block_size, layout.type_size), layout.name


# sizeof() of the scalar types the pinned block structs are made of (ggml.h typedefs)
C_SIZES = {"ggml_half": 2, "ggml_fp16_t": 2, "ggml_bf16_t": 2, "float": 4, "double": 8}
C_SIZES |= {f"{sign}int{bits}_t": bits // 8 for sign in ("", "u") for bits in (8, 16, 32, 64)}


def _pinned_source(mirror: Path, path: str) -> str:
    from llamarig.config import defaults

    commit = defaults()["llama_cpp"]["commit"]
    return subprocess.run(
        ["git", f"--git-dir={mirror}", "show", f"{commit}:{path}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def _c_value(expression: str, macros: dict[str, str]) -> int:
    """An integer constant expression of ggml-common.h, its macros expanded as cpp would."""
    text = re.sub(r"sizeof\((\w+)\)", lambda m: str(C_SIZES[m.group(1)]), expression)
    while (expanded := re.sub(r"\b[A-Z_]\w*\b", lambda m: macros[m.group(0)], text)) != text:
        text = expanded
    assert re.fullmatch(r"[\d\s+*/()-]+", text), (expression, text)
    return eval(text.replace("/", "//"))  # digits and operators only, checked above


def pinned_ggml_types(mirror: Path) -> dict[int, GgmlType]:
    """id -> layout from the pinned tree: the ggml_type enum (ggml.h), type_traits' blck_size
    and type_size (ggml.c), and each block struct's size as its static_assert states it."""
    header = _pinned_source(mirror, "ggml/include/ggml.h")
    traits = _pinned_source(mirror, "ggml/src/ggml.c")
    common = _pinned_source(mirror, "ggml/src/ggml-common.h")
    enum = header[header.index("enum ggml_type {") :]
    enum = enum[: enum.index("};")]
    ids = {name: int(i) for name, i in re.findall(r"^\s*GGML_TYPE_(\w+)\s*=\s*(\d+)", enum, re.M)}
    ids.pop("COUNT")
    macros = {
        name: value.split("//")[0].strip()
        for name, value in re.findall(r"^#define\s+([A-Z_]\w*)[ \t]+(.+)$", common, re.M)
    }
    block_bytes = {
        block: _c_value(expression, macros)
        for block, expression in re.findall(
            r'static_assert\(sizeof\((block_\w+)\) == (.+?), "', common
        )
    }
    found = {}
    start = traits.index("type_traits[GGML_TYPE_COUNT] = {") + len("type_traits[")
    table = traits[start : traits.index("\n};", start)]
    for name, body in re.findall(r"\[GGML_TYPE_(\w+)\] = \{(.*?)\n    \}", table, re.S):
        block_size = re.search(r"\.blck_size\s*=\s*(\w+)", body).group(1)
        struct = re.search(r"\.type_size\s*=\s*sizeof\((\w+)\)", body).group(1)
        type_size = block_bytes[struct] if struct.startswith("block_") else C_SIZES[struct]
        found[ids[name]] = GgmlType(name, _c_value(block_size, macros), type_size)
    assert set(found) == set(ids.values()), "a type of the enum has no type_traits entry"
    return found


def test_type_table_is_the_pinned_ggml(llama_mirror):
    """The merged table (gguf-py plus GGML_OVERRIDES) is, id by id, what the pinned ggml
    source says: a new pin that adds or resizes a type fails here until the table follows."""
    pinned = pinned_ggml_types(llama_mirror)
    assert len(pinned) > 30
    assert pinned[9] == GgmlType("Q8_1", 32, 36)
    assert {i: (t.block_size, t.type_size) for i, t in GGML_TYPES.items()} == {
        i: (t.block_size, t.type_size) for i, t in pinned.items()
    }
    assert {i: t.name.lower() for i, t in GGML_TYPES.items()} == {
        i: t.name.lower() for i, t in pinned.items()
    }


def test_reads_what_gguf_py_reads(tmp_path):
    path = tmp_path / "small.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_int32("test.i32", -5)
    writer.add_uint64("test.u64", 1 << 40)
    writer.add_float32("test.f32", 0.5)
    writer.add_float64("test.f64", 0.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.str", "héllo")
    writer.add_array("test.tokens", ["a", "bc", ""])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_key_value("test.u8s", [1, 2], GGUFValueType.ARRAY, GGUFValueType.UINT8)
    writer.add_tensor("a.weight", np.zeros((3, 64), dtype=np.float32))
    writer.add_tensor("b.weight", np.zeros((5,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    header = read_gguf_header_file(path)
    reference = GGUFReader(path)
    assert header.version == 3
    assert header.metadata["general.architecture"] == "llama"
    assert header.metadata["test.i32"] == -5
    assert header.metadata["test.u64"] == 1 << 40
    assert header.metadata["test.f32"] == 0.5
    assert header.metadata["test.f64"] == 0.25
    assert header.metadata["test.bool"] is True
    assert header.metadata["test.str"] == "héllo"
    assert header.metadata["test.tokens"] == ["a", "bc", ""]
    assert header.metadata["test.ints"] == [1, 2, 3]
    assert header.metadata["test.u8s"] == [1, 2]
    assert header.data_offset == reference.data_offset
    by_name = {t.name: t for t in reference.tensors}
    for t in header.tensors:
        ref = by_name[t.name]
        assert t.shape == tuple(int(d) for d in ref.shape)
        assert t.ggml_type == int(ref.tensor_type)
        assert t.n_bytes == int(ref.n_bytes)
        assert header.data_offset + t.offset == int(ref.data_offset)
    assert header.tensor("a.weight").shape == (64, 3)  # ggml order: row length first


def test_qwen36_shape_properties(tmp_path):
    header = read_gguf_header_file(write_qwen35(tmp_path / "q.gguf"))
    assert header.architecture == "qwen35"
    assert header.block_count == 65 and header.nextn_predict_layers == 1
    assert header.main_layer_count == 64
    assert header.context_length == 262144
    assert header.embedding_length == 5120
    assert header.head_count == 24 and header.head_count_kv == 4
    assert header.key_length == header.value_length == 256
    assert header.full_attention_interval == 4
    assert header.vocab_size == 248320
    assert (header.ssm_conv_kernel, header.ssm_state_size) == (4, 128)
    assert (header.ssm_group_count, header.ssm_time_step_rank, header.ssm_inner_size) == (
        16,
        48,
        6144,
    )
    embd = header.tensor("token_embd.weight")
    assert embd.shape == (5120, 248320) and embd.type_name == "Q8_0"
    assert embd.n_bytes == 248320 * 5120 // 32 * 34
    # a 27B Q8_0 model: about 29 GB of tensors described by a 52 KB header
    assert 28e9 < header.total_tensor_bytes < 30e9
    assert header.data_offset < 64 * 1024


def test_defaults_follow_llama_cpp(tmp_path):
    header = read_gguf_header_file(write_llama(tmp_path / "l.gguf", n_embd=128, n_head=2))
    assert header.key_length == header.value_length == 64  # n_embd / n_head
    assert header.nextn_predict_layers == 0
    assert header.full_attention_interval is None


def test_per_layer_head_counts(tmp_path):
    from tests.ggufmodels import llama_metadata, llama_tensors, write_gguf

    metadata = llama_metadata(2, 128, 256, 2, 2, 100, 4096)
    metadata["llama.attention.head_count_kv"] = [2, 0]
    header = read_gguf_header_file(
        write_gguf(tmp_path / "m.gguf", "llama", metadata, llama_tensors(2, 128, 256, 2, 2, 100))
    )
    assert header.head_count_kv == [2, 0]
    assert header.head_count_kv_at(1) == 0 and header.head_count_at(1) == 2


class CountingReader(io.RawIOBase):
    def __init__(self, path):
        self._file = open(path, "rb")  # noqa: SIM115
        self.bytes_read = 0

    def readable(self):
        return True

    def read(self, n=-1):
        data = self._file.read(n)
        self.bytes_read += len(data)
        return data

    def close(self):
        self._file.close()
        super().close()


def test_reads_only_the_header(tmp_path):
    path = write_qwen35(tmp_path / "q.gguf", Qwen35Shape(n_layer=8), full_size=True)
    stream = CountingReader(path)
    header = read_gguf_header(stream)
    stream.close()
    assert path.stat().st_size > 3e9  # sparse, the size the tensor table implies
    assert stream.bytes_read <= header.data_offset + READ_CHUNK


def test_header_prefix_is_enough(tmp_path):
    path = write_qwen35(tmp_path / "q.gguf")
    data = path.read_bytes()
    header = read_gguf_header(data[: read_gguf_header_file(path).data_offset], name="prefix")
    assert len(header.tensors) == len(read_gguf_header_file(path).tensors)


def test_truncated_header_names_file_and_problem(tmp_path):
    path = write_qwen35(tmp_path / "q.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:20000])
    with pytest.raises(GgufError, match=r"cut\.gguf: truncated at byte 20000 while reading"):
        read_gguf_header_file(cut)


def test_bad_magic(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GgufError, match=r"x\.bin: not a GGUF file"):
        read_gguf_header_file(path)


@pytest.mark.parametrize(
    ("version_bytes", "message"),
    [
        (struct.pack("<I", 1), "GGUF version 1 is not supported"),
        (struct.pack(">I", 3), "big-endian GGUF is not supported"),
    ],
)
def test_unsupported_versions(version_bytes, message):
    with pytest.raises(GgufError, match=message):
        read_gguf_header(b"GGUF" + version_bytes + bytes(16), name="v.gguf")


def test_empty_input():
    with pytest.raises(GgufError, match="empty.gguf: truncated at byte 0 while reading the magic"):
        read_gguf_header(b"", name="empty.gguf")
