"""Random-weight GGUF models with the shapes of real ones, for decode benchmarks.

Decode speed depends on tensor shapes and types, not on the values, so a Llama-3-8B-shaped
and a 32.5B-shaped Q8_0 model with random weights measure what the real ones would. Each takes
its tokenizer (Llama 3's BPE, 128256 tokens) from the vocabulary GGUF in the llama.cpp tree, so
llama-server serves it like any model. The quants are random bytes under a small fixed scale
(never zeros: those can run faster than real data); norms are ones.

    python3 bench/models.py OUT_DIR VOCAB_GGUF [NAME ...]
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from llamarig_sandbox.testmodel import copy_tokenizer  # noqa: E402

Q8_0_BLOCK = 32
Q8_0_BLOCK_BYTES = 34  # an f16 scale, then 32 int8 quants
# f16 0.0005: small weights keep activations finite through 64 random layers.
Q8_0_SCALE = np.array([0.0005], dtype=np.float16).view(np.uint8)


@dataclass(frozen=True)
class LlamaShape:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    context_length: int


SHAPES = {
    # Llama 3 8B.
    "llama-8b": LlamaShape(32, 4096, 14336, 32, 8, 131072),
    # A 32.5B dense llama (Qwen2.5-32B's body): 64 layers, 5120 wide, GQA 40/8.
    "llama-32b": LlamaShape(64, 5120, 27648, 40, 8, 131072),
}


def tensor_shapes(shape: LlamaShape, n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and ggml shapes (ne0 first), in file order."""
    head_dim = shape.n_embd // shape.n_head
    e, kv = shape.n_embd, shape.n_head_kv * head_dim
    tensors = [("token_embd.weight", (e, n_vocab))]
    for layer in range(shape.n_layer):
        blk = f"blk.{layer}"
        tensors += [
            (f"{blk}.attn_norm.weight", (e,)),
            (f"{blk}.attn_q.weight", (e, e)),
            (f"{blk}.attn_k.weight", (e, kv)),
            (f"{blk}.attn_v.weight", (e, kv)),
            (f"{blk}.attn_output.weight", (e, e)),
            (f"{blk}.ffn_norm.weight", (e,)),
            (f"{blk}.ffn_gate.weight", (e, shape.n_ff)),
            (f"{blk}.ffn_up.weight", (e, shape.n_ff)),
            (f"{blk}.ffn_down.weight", (shape.n_ff, e)),
        ]
    tensors += [("output_norm.weight", (e,)), ("output.weight", (e, n_vocab))]
    return tensors


def tensor_bytes(ggml_shape: tuple[int, ...]) -> int:
    if len(ggml_shape) == 1:
        return 4 * ggml_shape[0]  # f32 norm
    rows = int(np.prod(ggml_shape[1:]))
    return rows * (ggml_shape[0] // Q8_0_BLOCK) * Q8_0_BLOCK_BYTES


def _random_q8_0(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    blocks = rng.integers(0, 256, size=(n_blocks, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :2] = Q8_0_SCALE
    return blocks.reshape(-1)


def write_model(path: Path, name: str, vocab_gguf: Path, seed: int = 0) -> int:
    """Write the model ``name`` of SHAPES to ``path`` (via a .partial file); returns its size."""
    shape = SHAPES[name]
    partial = path.with_name(path.name + ".partial")
    writer = GGUFWriter(partial, arch="llama")
    writer.add_name(f"llamarig random {name} Q8_0")
    writer.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape.n_embd // shape.n_head)
    writer.add_rope_freq_base(500000.0)
    n_vocab = copy_tokenizer(writer, GGUFReader(vocab_gguf))
    writer.add_vocab_size(n_vocab)
    tensors = tensor_shapes(shape, n_vocab)
    for tensor_name, ggml_shape in tensors:
        quantized = len(ggml_shape) > 1
        writer.add_tensor_info(
            tensor_name,
            tuple(reversed(ggml_shape)),
            np.dtype(np.float32),  # with raw_dtype set, the shape is in elements
            tensor_bytes(ggml_shape),
            raw_dtype=GGMLQuantizationType.Q8_0 if quantized else GGMLQuantizationType.F32,
        )
    writer.write_header_to_file(partial)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()

    alignment = writer.data_alignment
    rng = np.random.default_rng(seed)
    # One pool of random blocks, written from a moving offset: every tensor gets random bytes
    # without generating 34 GB of randomness.
    pool = _random_q8_0((256 << 20) // Q8_0_BLOCK_BYTES, rng)
    ones = np.ones(1 << 16, dtype=np.float32).tobytes()
    with open(partial, "r+b") as out:
        out.seek(0, os.SEEK_END)
        for _name, ggml_shape in tensors:
            out.write(b"\0" * (-out.tell() % alignment))
            size = tensor_bytes(ggml_shape)
            if len(ggml_shape) == 1:
                out.write(ones[:size])
                continue
            offset = int(rng.integers(0, len(pool) // Q8_0_BLOCK_BYTES)) * Q8_0_BLOCK_BYTES
            while size:
                chunk = pool[offset : offset + size]
                out.write(chunk.tobytes())
                size -= len(chunk)
                offset = 0
        out.write(b"\0" * (-out.tell() % alignment))
    os.replace(partial, path)
    return path.stat().st_size


def main(argv: list[str]) -> int:
    out_dir, vocab, *names = argv
    for name in names or SHAPES:
        path = Path(out_dir) / f"{name}-q8_0.gguf"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            size = write_model(path, name, Path(vocab))
            print(f"{path}: {size / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
