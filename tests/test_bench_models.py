"""bench/models.py: the random-weight benchmark models are valid GGUF files llama.cpp can read,
with the declared shapes, Q8_0 blocks under the fixed scale and random (non-zero) quants."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from bench import models
from llamarig.model.gguf import read_gguf_header


@pytest.fixture
def vocab_gguf(tmp_path):
    """A vocabulary-only GGUF: 300 tokens of a llama SPM tokenizer."""
    path = tmp_path / "vocab.gguf"
    writer = GGUFWriter(path, arch="llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(300)])
    writer.add_token_scores([0.0] * 300)
    writer.add_token_types([1] * 300)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_shape(monkeypatch):
    monkeypatch.setitem(models.SHAPES, "tiny", models.LlamaShape(2, 64, 128, 4, 2, 2048))
    return "tiny"


def test_written_model_reads_back_with_shapes_types_and_random_quants(
    tmp_path, tiny_shape, vocab_gguf
):
    path = tmp_path / "tiny.gguf"
    size = models.write_model(path, tiny_shape, vocab_gguf)
    assert size == path.stat().st_size and not path.with_name("tiny.gguf.partial").exists()

    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    expected = dict(models.tensor_shapes(models.SHAPES[tiny_shape], n_vocab))
    assert set(tensors) == set(expected)
    for name, shape in expected.items():
        tensor = tensors[name]
        assert tuple(int(n) for n in tensor.shape) == shape, name
        quantized = len(shape) > 1
        assert tensor.tensor_type == (
            GGMLQuantizationType.Q8_0 if quantized else GGMLQuantizationType.F32
        )
        raw = np.asarray(tensor.data).view(np.uint8).reshape(-1)
        if quantized:
            blocks = raw.reshape(-1, models.Q8_0_BLOCK_BYTES)
            assert (blocks[:, :2] == models.Q8_0_SCALE).all(), name
            quants = blocks[:, 2:]
            assert len(np.unique(quants)) > 200, f"{name}: quants are not random"
        else:
            assert (raw.view(np.float32) == 1.0).all(), name

    header = read_gguf_header(path.read_bytes(), name=str(path))
    assert header.architecture == "llama"
    assert header.block_count == 2
    assert header.data_offset + sum(t.n_bytes for t in header.tensors) <= size


def test_shapes_are_the_claimed_sizes():
    """8B and 32.5B parameters (Q8_0: 34 bytes per 32 weights)."""
    for name, billions in (("llama-8b", 8.0), ("llama-32b", 32.5)):
        weights = sum(
            int(np.prod(shape)) for _, shape in models.tensor_shapes(models.SHAPES[name], 128256)
        )
        assert abs(weights / 1e9 - billions) < 0.1, (name, weights)
