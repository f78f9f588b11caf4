"""A model file's GGUF header as models.lock.yml records it: what the planner reads, trimmed
and compressed, so that a plan made where the model cannot be read (a CI runner, a laptop
offline) is the plan the deploy makes.

Trimmed: an array of more than LONG_ARRAY items (the tokenizer's tokens, scores, types and
merges: most of a header's bytes) is kept as its length only, which is all the planner asks of
it (the vocabulary size); per-layer arrays, every other value and the whole tensor table stay.
The rest is JSON, compressed with lzma and written as base64. A record also holds the digest of
the header bytes it was made from (``GgufHeader.digest``), which tells a stale record from the
file's own header when the deploy reads that.

A record comes from a file the user commits, so it is read as untrusted input: bounded before
and after decompression (the text, the JSON it expands to, the lzma decoder's memory, the
arrays it claims in all, its keys and tensors), checked into the shapes the planner expects,
and checked for consistency - a tensor table no GGUF file holds (``tensor_table_problem``), a
`size` its tensors do not end at, and for a whole model (not a shard of a split one, which
`lock.merged_records` checks with the other shards) the facts ``model_problem`` checks."""

from __future__ import annotations

import base64
import binascii
import json
import lzma
import re
from typing import Any

from llamarig.model.gguf import (
    GGML_TYPES,
    MAX_DIMS,
    SPLIT_COUNT,
    GgufError,
    GgufHeader,
    TensorInfo,
    model_problem,
    tensor_table_problem,
)

FORMAT = 1
LONG_ARRAY = 4096
# Bounds on what a record may expand to: a 27B model's record is about 40 KiB (the tensor
# table); a header of 10,000 tensors stays well under these.
MAX_RECORD_CHARS = 4 << 20
MAX_JSON_BYTES = 32 << 20
# The longest array a record may claim: vocabularies run to a few hundred thousand tokens.
MAX_TRIMMED_LENGTH = 1 << 22
# ... and all its arrays together (a tokenizer's tokens, scores, types and merges: about 1.3
# million items for a vocabulary of 262,144): each item is a slot in memory once decoded.
MAX_TRIMMED_TOTAL = 1 << 23
# Keys and tensors: a header has about 50 keys and a few thousand tensors at most (Qwen3.6-27B:
# 866 tensors).
MAX_KEYS = 1 << 16
MAX_TENSORS = 1 << 17
# The lzma decoder's memory: `encode`'s preset needs about 9 MiB; a forged stream may ask for
# a dictionary of 1.5 GiB.
MAX_DECODER_MEMORY = 64 << 20
_TRIMMED = "trimmed_array_length"
_DIGEST = re.compile(r"[0-9a-f]{64}")


def encode(header: GgufHeader) -> str:
    """``header`` trimmed, as lzma-compressed JSON in base64."""
    metadata = {
        key: {_TRIMMED: len(value)}
        if isinstance(value, list) and len(value) > LONG_ARRAY
        else value
        for key, value in header.metadata.items()
    }
    document = {
        "version": header.version,
        "alignment": header.alignment,
        "data_offset": header.data_offset,
        "metadata": metadata,
        "tensors": [
            [t.name, list(t.shape), t.ggml_type, t.n_bytes, t.offset] for t in header.tensors
        ],
    }
    packed = lzma.compress(json.dumps(document, separators=(",", ":")).encode())
    return base64.b64encode(packed).decode("ascii")


def decode(record: str, digest: str, name: str, size: int | None = None) -> GgufHeader:
    """The header ``record`` (``encode``'s text) holds, with ``digest`` as its digest ("" for a
    declared header, made from a model's published configuration rather than read); a long
    array comes back as that many None items. ``size``: the file's size its lock entry
    records (where its tensors end), checked against them. Raises GgufError, naming ``name``,
    for a record that is not one, or one that contradicts itself."""

    def broken(why: str) -> GgufError:
        return GgufError(f"{name}: the recorded header {why}")

    if not isinstance(record, str) or len(record) > MAX_RECORD_CHARS:
        raise broken(f"is not base64 text of at most {MAX_RECORD_CHARS} characters")
    if not isinstance(digest, str) or (digest and not _DIGEST.fullmatch(digest)):
        raise broken("has a digest that is not 64 hex digits")
    try:
        packed = base64.b64decode(record, validate=True)
        unpacker = lzma.LZMADecompressor(memlimit=MAX_DECODER_MEMORY)
        text = unpacker.decompress(packed, max_length=MAX_JSON_BYTES)
    except (binascii.Error, lzma.LZMAError, ValueError) as error:
        raise broken(f"cannot be decoded ({error})") from None
    if not unpacker.eof:
        raise broken(f"is incomplete or expands beyond {MAX_JSON_BYTES} bytes")
    try:
        document = json.loads(text)
    except ValueError as error:
        raise broken(f"cannot be decoded ({error})") from None
    except RecursionError:
        raise broken("cannot be decoded (nested too deeply)") from None
    try:
        header = _header(document, digest, name)
    except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as error:
        raise broken(f"is not a header record ({type(error).__name__}: {error})") from None
    problem = tensor_table_problem(header)
    if problem is None and size is not None:
        problem = _size_problem(header, size)
    count = header.metadata.get(SPLIT_COUNT)
    if problem is None and not (isinstance(count, int) and count > 1):  # a whole model
        problem = model_problem(header)
    if problem:
        raise broken(f"is inconsistent: {problem}")
    return header


def _size_problem(header: GgufHeader, size: int) -> str | None:
    """A file's size is where its last tensor ends (what the lock records), or at most that
    tensor's padding beyond; a file without tensors (a vocabulary) may end before the
    alignment of its data section."""
    if header.data_end <= size < header.data_end + header.alignment or not header.tensors:
        return None
    return (
        f"its size {size} is not the file's: its tensors end at byte {header.data_end} "
        f"(the data from byte {header.data_offset})"
    )


def _header(document: dict, digest: str, name: str) -> GgufHeader:
    version, alignment, data_offset = (
        _count(document[key]) for key in ("version", "alignment", "data_offset")
    )
    if len(document["metadata"]) > MAX_KEYS or len(document["tensors"]) > MAX_TENSORS:
        raise ValueError(
            f"{len(document['metadata'])} keys and {len(document['tensors'])} tensors (at most "
            f"{MAX_KEYS} and {MAX_TENSORS})"
        )
    trimmed = {
        key: _count(value[_TRIMMED])
        for key, value in document["metadata"].items()
        if isinstance(value, dict)
    }
    for key, length in trimmed.items():  # every claim checked before any is made
        if length > MAX_TRIMMED_LENGTH:
            raise ValueError(f"{key} claims {length} items")
    if sum(trimmed.values()) > MAX_TRIMMED_TOTAL:
        raise ValueError(
            f"its {len(trimmed)} arrays claim {sum(trimmed.values())} items in all (at most "
            f"{MAX_TRIMMED_TOTAL})"
        )
    metadata: dict[str, Any] = {}
    for key, value in document["metadata"].items():
        metadata[key] = [None] * trimmed[key] if key in trimmed else _plain(value)
    tensors = []
    for tensor_name, shape, ggml_type, n_bytes, offset in document["tensors"]:
        if (
            not isinstance(tensor_name, str)
            or ggml_type not in GGML_TYPES
            or not 1 <= len(shape) <= MAX_DIMS
        ):
            raise ValueError(f"tensor {tensor_name!r}")
        dims = tuple(_count(dim) for dim in shape)
        tensors.append(TensorInfo(tensor_name, dims, ggml_type, _count(n_bytes), _count(offset)))
    return GgufHeader(version, metadata, tensors, data_offset, alignment, name, digest)


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{value!r} is not a count")
    return value


def _plain(value: Any) -> Any:
    """A metadata value as GGUF has them: a number, a bool, a string, or a list of them."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, bool | int | float | str):
        return value
    raise ValueError(f"{value!r} is not a GGUF value")


def differences(declared: GgufHeader, read: GgufHeader) -> list[str]:
    """What a declared header says otherwise than the file's own: each metadata value (an array
    by its length where the record kept only that) and the tensor table."""

    def plain(value: Any) -> Any:
        return ("array of", len(value)) if isinstance(value, list) and len(value) > 64 else value

    found = []
    for key in sorted(set(declared.metadata) | set(read.metadata)):
        mine, theirs = plain(declared.metadata.get(key)), plain(read.metadata.get(key))
        if mine != theirs:
            found.append(f"{key}: {mine!r} declared, {theirs!r} in the file")
    if declared.tensors != read.tensors:
        names = {t.name: t for t in declared.tensors}
        other = next((t for t in read.tensors if names.get(t.name) != t), None)
        found.append(
            f"tensors: {len(declared.tensors)} declared, {len(read.tensors)} in the file"
            + (f" (first that differs: {other.name} {other.shape})" if other else "")
        )
    return found
