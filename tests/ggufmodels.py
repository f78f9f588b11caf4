"""Header-realistic GGUF files for tests, written with the ``gguf`` package.

Only the header is written (metadata and tensor infos with real shapes and types), so a file
describing a 27B model is a few KB. With ``full_size=True`` the file is extended, sparsely, to the
size its tensor table implies: zero blocks are valid weights, so llama.cpp can load such a file
(useful to check the planner against a real server's logs).

Shapes are given in ggml order (``ne0`` first: ``(n_embd, n_vocab)`` for ``token_embd``).
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from llamarig.model.gguf import row_size


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    type_name: str  # ggml type name, e.g. "q8_0"

    @property
    def n_bytes(self) -> int:
        n = row_size(self.type_name, self.shape[0])
        for dim in self.shape[1:]:
            n *= dim
        return n


def _value_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, Sequence):
        return GGUFValueType.ARRAY
    raise TypeError(f"no GGUF type for {value!r}")


def _array_item_type(items: Sequence[Any]) -> GGUFValueType:
    first = items[0]
    if isinstance(first, bool):
        return GGUFValueType.BOOL
    if isinstance(first, int):
        return GGUFValueType.INT32
    return _value_type(first)


def write_gguf(
    path: Path,
    arch: str,
    metadata: Mapping[str, Any],
    tensors: Sequence[TensorSpec],
    full_size: bool = False,
) -> Path:
    """Write a GGUF header (and, with ``full_size``, a sparse zero data section) to ``path``.

    Metadata values map to GGUF types by Python type (int -> u32, list of int -> i32 array);
    pass ``(value, GGUFValueType)`` to choose the type explicitly.
    """
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], GGUFValueType):
            value, vtype = value
        else:
            vtype = _value_type(value)
        sub_type = _array_item_type(value) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type)
    for spec in tensors:
        writer.add_tensor_info(
            spec.name,
            tuple(reversed(spec.shape)),  # the writer takes numpy order and reverses it
            np.dtype(np.float32),
            spec.n_bytes,
            raw_dtype=GGMLQuantizationType[spec.type_name.upper()],
        )
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    if full_size:
        alignment = writer.data_alignment
        with open(path, "r+b") as handle:
            header_end = handle.seek(0, 2)
            data_offset = -(-header_end // alignment) * alignment
            data_bytes = sum(-(-spec.n_bytes // alignment) * alignment for spec in tensors)
            handle.truncate(data_offset + data_bytes)
    return path


def llama_tensors(
    n_layer: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_head_kv: int,
    n_vocab: int,
    weight_type: str = "f32",
    tied_embeddings: bool = False,
) -> list[TensorSpec]:
    """The tensor table of a plain llama (llama.cpp's LLM_ARCH_LLAMA layout)."""
    head_dim = n_embd // n_head
    tensors = [TensorSpec("token_embd.weight", (n_embd, n_vocab), weight_type)]
    for il in range(n_layer):
        blk = f"blk.{il}"
        tensors += [
            TensorSpec(f"{blk}.attn_norm.weight", (n_embd,), "f32"),
            TensorSpec(f"{blk}.attn_q.weight", (n_embd, n_head * head_dim), weight_type),
            TensorSpec(f"{blk}.attn_k.weight", (n_embd, n_head_kv * head_dim), weight_type),
            TensorSpec(f"{blk}.attn_v.weight", (n_embd, n_head_kv * head_dim), weight_type),
            TensorSpec(f"{blk}.attn_output.weight", (n_head * head_dim, n_embd), weight_type),
            TensorSpec(f"{blk}.ffn_norm.weight", (n_embd,), "f32"),
            TensorSpec(f"{blk}.ffn_gate.weight", (n_embd, n_ff), weight_type),
            TensorSpec(f"{blk}.ffn_up.weight", (n_embd, n_ff), weight_type),
            TensorSpec(f"{blk}.ffn_down.weight", (n_ff, n_embd), weight_type),
        ]
    tensors.append(TensorSpec("output_norm.weight", (n_embd,), "f32"))
    if not tied_embeddings:
        tensors.append(TensorSpec("output.weight", (n_embd, n_vocab), weight_type))
    return tensors


def llama_metadata(
    n_layer: int,
    n_embd: int,
    n_ff: int,
    n_head: int,
    n_head_kv: int,
    n_vocab: int,
    context_length: int,
) -> dict[str, Any]:
    return {
        "llama.block_count": n_layer,
        "llama.context_length": context_length,
        "llama.embedding_length": n_embd,
        "llama.feed_forward_length": n_ff,
        "llama.attention.head_count": n_head,
        "llama.attention.head_count_kv": n_head_kv,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.dimension_count": n_embd // n_head,
        "llama.vocab_size": n_vocab,
        "tokenizer.ggml.model": "none",
    }


def write_llama(
    path: Path,
    n_layer: int = 2,
    n_embd: int = 128,
    n_ff: int = 256,
    n_head: int = 2,
    n_head_kv: int = 2,
    n_vocab: int = 32000,
    context_length: int = 4096,
    weight_type: str = "f32",
    full_size: bool = False,
) -> Path:
    """A llama-shaped model; the defaults are GUIDE §1's 2-layer test model."""
    return write_gguf(
        path,
        "llama",
        llama_metadata(n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab, context_length),
        llama_tensors(n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab, weight_type),
        full_size,
    )


@dataclass(frozen=True)
class Qwen35Shape:
    """A qwen35 (Qwen3.5/3.6 dense hybrid) shape; defaults are Qwen3.6-27B (GUIDE §4)."""

    n_layer: int = 64  # main layers; MTP blocks come after them
    n_mtp: int = 1
    n_embd: int = 5120
    n_ff: int = 17408
    n_vocab: int = 248320
    n_head: int = 24
    n_head_kv: int = 4
    head_dim: int = 256
    full_attention_interval: int = 4
    ssm_k_heads: int = 16
    ssm_v_heads: int = 48
    ssm_head_dim: int = 128
    ssm_conv_kernel: int = 4
    context_length: int = 262144


def qwen35_metadata(shape: Qwen35Shape) -> dict[str, Any]:
    return {
        "qwen35.block_count": shape.n_layer + shape.n_mtp,
        "qwen35.nextn_predict_layers": shape.n_mtp,
        "qwen35.context_length": shape.context_length,
        "qwen35.embedding_length": shape.n_embd,
        "qwen35.feed_forward_length": shape.n_ff,
        "qwen35.attention.head_count": shape.n_head,
        "qwen35.attention.head_count_kv": shape.n_head_kv,
        "qwen35.attention.key_length": shape.head_dim,
        "qwen35.attention.value_length": shape.head_dim,
        "qwen35.attention.layer_norm_rms_epsilon": 1e-6,
        "qwen35.rope.dimension_count": 64,
        "qwen35.rope.dimension_sections": [11, 11, 10, 0],
        "qwen35.rope.freq_base": 10000000.0,
        "qwen35.full_attention_interval": shape.full_attention_interval,
        "qwen35.ssm.conv_kernel": shape.ssm_conv_kernel,
        "qwen35.ssm.state_size": shape.ssm_head_dim,
        "qwen35.ssm.group_count": shape.ssm_k_heads,
        "qwen35.ssm.time_step_rank": shape.ssm_v_heads,
        "qwen35.ssm.inner_size": shape.ssm_v_heads * shape.ssm_head_dim,
        "qwen35.vocab_size": shape.n_vocab,
        "tokenizer.ggml.model": "none",
    }


def qwen35_tensors(shape: Qwen35Shape, weight_type: str = "q8_0") -> list[TensorSpec]:
    """The tensor table llama.cpp's src/models/qwen35.cpp loads (load_arch_tensors)."""
    s, w = shape, weight_type
    key_dim = s.ssm_k_heads * s.ssm_head_dim
    value_dim = s.ssm_v_heads * s.ssm_head_dim
    q_dim = s.n_head * s.head_dim
    kv_dim = s.n_head_kv * s.head_dim

    def attention(blk: str) -> list[TensorSpec]:
        return [
            TensorSpec(f"{blk}.attn_q.weight", (s.n_embd, 2 * q_dim), w),  # Q and its gate
            TensorSpec(f"{blk}.attn_k.weight", (s.n_embd, kv_dim), w),
            TensorSpec(f"{blk}.attn_v.weight", (s.n_embd, kv_dim), w),
            TensorSpec(f"{blk}.attn_output.weight", (q_dim, s.n_embd), w),
            TensorSpec(f"{blk}.attn_q_norm.weight", (s.head_dim,), "f32"),
            TensorSpec(f"{blk}.attn_k_norm.weight", (s.head_dim,), "f32"),
        ]

    def ffn(blk: str) -> list[TensorSpec]:
        return [
            TensorSpec(f"{blk}.ffn_gate.weight", (s.n_embd, s.n_ff), w),
            TensorSpec(f"{blk}.ffn_up.weight", (s.n_embd, s.n_ff), w),
            TensorSpec(f"{blk}.ffn_down.weight", (s.n_ff, s.n_embd), w),
        ]

    def norms(blk: str) -> list[TensorSpec]:
        return [
            TensorSpec(f"{blk}.attn_norm.weight", (s.n_embd,), "f32"),
            TensorSpec(f"{blk}.post_attention_norm.weight", (s.n_embd,), "f32"),
        ]

    tensors = [TensorSpec("token_embd.weight", (s.n_embd, s.n_vocab), w)]
    for il in range(s.n_layer):
        blk = f"blk.{il}"
        tensors += norms(blk)
        if (il + 1) % s.full_attention_interval == 0:
            tensors += attention(blk)
        else:
            tensors += [
                TensorSpec(f"{blk}.attn_qkv.weight", (s.n_embd, 2 * key_dim + value_dim), w),
                TensorSpec(f"{blk}.attn_gate.weight", (s.n_embd, value_dim), w),
                TensorSpec(
                    f"{blk}.ssm_conv1d.weight", (s.ssm_conv_kernel, 2 * key_dim + value_dim), "f32"
                ),
                TensorSpec(f"{blk}.ssm_dt.bias", (s.ssm_v_heads,), "f32"),
                TensorSpec(f"{blk}.ssm_a", (s.ssm_v_heads,), "f32"),
                TensorSpec(f"{blk}.ssm_beta.weight", (s.n_embd, s.ssm_v_heads), w),
                TensorSpec(f"{blk}.ssm_alpha.weight", (s.n_embd, s.ssm_v_heads), w),
                TensorSpec(f"{blk}.ssm_norm.weight", (s.ssm_head_dim,), "f32"),
                TensorSpec(f"{blk}.ssm_out.weight", (value_dim, s.n_embd), w),
            ]
        tensors += ffn(blk)
    for il in range(s.n_layer, s.n_layer + s.n_mtp):
        blk = f"blk.{il}"
        tensors += norms(blk) + attention(blk) + ffn(blk)
        tensors += [
            TensorSpec(f"{blk}.nextn.eh_proj.weight", (2 * s.n_embd, s.n_embd), w),
            TensorSpec(f"{blk}.nextn.enorm.weight", (s.n_embd,), "f32"),
            TensorSpec(f"{blk}.nextn.hnorm.weight", (s.n_embd,), "f32"),
            TensorSpec(f"{blk}.nextn.shared_head_norm.weight", (s.n_embd,), "f32"),
        ]
    tensors += [
        TensorSpec("output_norm.weight", (s.n_embd,), "f32"),
        TensorSpec("output.weight", (s.n_embd, s.n_vocab), w),
    ]
    return tensors


def write_qwen35(
    path: Path,
    shape: Qwen35Shape = Qwen35Shape(),
    weight_type: str = "q8_0",
    full_size: bool = False,
) -> Path:
    return write_gguf(
        path, "qwen35", qwen35_metadata(shape), qwen35_tensors(shape, weight_type), full_size
    )


def split_gguf(source: Path, directory: Path, shards: int) -> list[Path]:
    """``source`` rewritten as a gguf-split set of ``shards`` files in ``directory``
    (NAME-00001-of-0000N.gguf ...), the layout llama.cpp's gguf-split writes, through gguf-py's
    own ``GGUFWriter(split_max_tensors=...)``: the model's keys in the first shard, the split
    keys in every shard, the tensors (their bytes as they are) spread in order."""
    from gguf import GGUFReader

    reader = GGUFReader(source)
    per_shard = -(-len(reader.tensors) // shards)
    architecture = reader.fields["general.architecture"].contents()
    directory.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(directory / source.name, architecture, split_max_tensors=per_shard)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stem = source.name[: -len(".gguf")]
    written = sorted(directory.glob(f"{stem}-*-of-*.gguf"))
    assert len(written) == shards, written
    return written
