"""A tiny deterministic llama GGUF with random weights, for serving tests.

The model is shaped like a real llama (2 layers, n_embd 128, 2 heads of 64) so llama-server loads
it with the stock llama architecture, and it borrows its tokenizer from a vocabulary-only GGUF
shipped in the llama.cpp tree. About 33 MB, almost all of it the embedding and output matrices.
"""

import hashlib
import os
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType

N_LAYERS = 2
N_EMBD = 128
N_HEAD = 2
N_HEAD_KV = 2
HEAD_DIM = N_EMBD // N_HEAD
N_FF = 256
CONTEXT_LENGTH = 2048
RMS_NORM_EPS = 1e-5
ROPE_FREQ_BASE = 10000.0
# Small weights keep activations and logits finite through the random network.
WEIGHT_SCALE = 0.02

TOKENIZER_PREFIX = "tokenizer.ggml."


def copy_tokenizer(writer: GGUFWriter, vocab: GGUFReader) -> int:
    """Copy every tokenizer.ggml.* key from the vocabulary GGUF; return the token count."""
    n_vocab = 0
    for key, field in vocab.fields.items():
        if not key.startswith(TOKENIZER_PREFIX):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
        if key == TOKENIZER_PREFIX + "tokens":
            n_vocab = len(field.data)
    if not n_vocab:
        raise ValueError("vocabulary GGUF has no tokenizer.ggml.tokens")
    return n_vocab


def _tensor_shapes(n_vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """Tensor names and numpy shapes, in file order.

    numpy shapes are GGUF/ggml shapes reversed: llama.cpp's `{n_embd, n_vocab}` is numpy's
    (n_vocab, n_embd).
    """
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (n_vocab, N_EMBD))]
    for layer in range(N_LAYERS):
        prefix = f"blk.{layer}."
        shapes += [
            (prefix + "attn_norm.weight", (N_EMBD,)),
            (prefix + "attn_q.weight", (HEAD_DIM * N_HEAD, N_EMBD)),
            (prefix + "attn_k.weight", (HEAD_DIM * N_HEAD_KV, N_EMBD)),
            (prefix + "attn_v.weight", (HEAD_DIM * N_HEAD_KV, N_EMBD)),
            (prefix + "attn_output.weight", (N_EMBD, HEAD_DIM * N_HEAD)),
            (prefix + "ffn_norm.weight", (N_EMBD,)),
            (prefix + "ffn_gate.weight", (N_FF, N_EMBD)),
            (prefix + "ffn_down.weight", (N_EMBD, N_FF)),
            (prefix + "ffn_up.weight", (N_FF, N_EMBD)),
        ]
    shapes += [("output_norm.weight", (N_EMBD,)), ("output.weight", (n_vocab, N_EMBD))]
    return shapes


def write_test_model(
    path: str | os.PathLike, vocab_gguf_path: str | os.PathLike, seed: int = 0
) -> str:
    """Write the tiny llama GGUF to `path` and return its sha256 hex digest.

    The same vocabulary file and seed always give the same bytes. The file is written beside
    `path` and renamed into place, so a reader never sees a half-written model.
    """
    path = Path(path)
    vocab = GGUFReader(vocab_gguf_path)
    partial = path.with_name(path.name + ".partial")

    writer = GGUFWriter(partial, arch="llama")
    writer.add_name("llamarig tiny test llama")
    writer.add_file_type(LlamaFileType.ALL_F32)
    writer.add_context_length(CONTEXT_LENGTH)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYERS)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(RMS_NORM_EPS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(ROPE_FREQ_BASE)
    n_vocab = copy_tokenizer(writer, vocab)
    writer.add_vocab_size(n_vocab)

    rng = np.random.default_rng(seed)
    for name, shape in _tensor_shapes(n_vocab):
        if name.endswith("norm.weight"):
            # RMS-norm gains of one, as a freshly initialised model has.
            tensor = np.ones(shape, dtype=np.float32)
        else:
            tensor = rng.standard_normal(shape, dtype=np.float32) * np.float32(WEIGHT_SCALE)
        writer.add_tensor(name, tensor)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    digest = sha256_file(partial)
    os.replace(partial, path)
    return digest


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 hex digest of a file's contents."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
