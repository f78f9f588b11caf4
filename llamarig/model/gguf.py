"""Read a GGUF file's metadata and tensor table without reading tensor data.

The format (ggml/src/gguf.cpp at the pinned llama.cpp commit), little-endian:
magic ``GGUF``, u32 version (2 or 3), u64 tensor count, u64 metadata count, the metadata
key/value pairs, the tensor infos (name, u32 n_dims, u64 dims, u32 ggml type, u64 offset), then
padding to ``general.alignment`` (default 32), then the tensor data. Only the part before the
data is read, so the first few MB of a model (fetched over SSH, say) are enough.
"""

import hashlib
import io
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from llamarig.tables.text import printable

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGML_MAX_DIMS in ggml.h.
MAX_DIMS = 4
# Guards against absurd lengths in a corrupt file before anything is allocated.
MAX_STRING_BYTES = 1 << 28
MAX_ARRAY_ITEMS = 1 << 28
MAX_COUNT = 1 << 24
READ_CHUNK = 1 << 20
# LLAMA_MAX_LAYERS in src/llama-hparams.h: llama.cpp refuses a model with more blocks.
MAX_LAYERS = 512
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")
# Tensors the planner sizes by their second dimension: the embedding and output matrices and
# the FFN weights that tensor mode splits by rows (planner/placement.py's _FFN_SPLIT).
_MATRIX_TENSOR = re.compile(
    r"(token_embd|output)\.weight|blk\.\d+\.ffn_(up|gate|down|gate_up)(_exps|_shexp)?\.weight"
)


class GgufError(ValueError):
    """A file that is not a readable GGUF header; the message names the file and the problem."""


@dataclass(frozen=True)
class GgmlType:
    name: str
    block_size: int
    type_size: int


# Where gguf 0.19.0 and the pinned ggml disagree, ggml's type_traits (ggml/src/ggml.c) and the
# static_asserts of ggml/src/ggml-common.h win; test_gguf_header checks the merged table against
# that source, so a new pin or a new gguf that changes either side fails there.
GGML_OVERRIDES: dict[int, GgmlType] = {
    # block_q8_1 is two ggml_half and 32 quants (ggml-common.h:258-269); gguf-py counts two
    # f32 (4 + 4 + 32 = 40).
    9: GgmlType("Q8_1", 32, 2 + 2 + 32),
    # GGML_TYPE_Q2_0 = 42 (ggml.h:432, ggml-common.h:187-192) is newer than gguf 0.19.0.
    42: GgmlType("Q2_0", 64, 2 + 64 // 4),
}
# ggml_type id -> block size and bytes per block.
GGML_TYPES: dict[int, GgmlType] = {
    int(quant): GgmlType(quant.name, *GGML_QUANT_SIZES[quant]) for quant in GGMLQuantizationType
} | GGML_OVERRIDES
GGML_TYPE_IDS: dict[str, int] = {t.name.lower(): type_id for type_id, t in GGML_TYPES.items()}


def ggml_type(type_id_or_name: int | str) -> GgmlType:
    """The block layout of a ggml type, by id (``8``) or name (``"q8_0"``, any case)."""
    if isinstance(type_id_or_name, str):
        type_id = GGML_TYPE_IDS.get(type_id_or_name.lower())
        if type_id is None:
            raise ValueError(f"unknown ggml type {type_id_or_name!r}")
        return GGML_TYPES[type_id]
    if type_id_or_name not in GGML_TYPES:
        raise ValueError(f"unknown ggml type id {type_id_or_name}")
    return GGML_TYPES[type_id_or_name]


def row_size(type_id_or_name: int | str, n_elements: int) -> int:
    """Bytes of ``n_elements`` consecutive values: ggml_row_size() in ggml.c."""
    t = ggml_type(type_id_or_name)
    if n_elements % t.block_size:
        raise ValueError(f"{n_elements} values are not whole {t.name} blocks of {t.block_size}")
    return n_elements // t.block_size * t.type_size


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous row length (ne0)
    ggml_type: int
    n_bytes: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.ggml_type].name

    @property
    def n_elements(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


# ssm.* dimensions the planner reads (llama-hparams.cpp n_embd_r / n_embd_s).
_SSM_KEYS = ("conv_kernel", "inner_size", "state_size", "group_count", "time_step_rank")


def _ssm_dimension(name: str) -> property:
    """A header property: ``<architecture>.ssm.<name>``, 0 in a model without that key."""
    assert name in _SSM_KEYS, name  # _shape_problem checks exactly these
    return property(lambda header: int(header.arch_value(f"ssm.{name}", 0)))


@dataclass(frozen=True)
class GgufHeader:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    alignment: int = DEFAULT_ALIGNMENT
    source: str = field(default="<bytes>", compare=False)
    # sha256 of the header's bytes as read (the magic to the end of the tensor table): what
    # tells a recorded header (models.lock.yml) from the file's own
    digest: str = field(default="", compare=False)

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    @property
    def data_end(self) -> int:
        """Bytes from the file's start to the end of its last tensor: the file's size as the
        converters write it (convert_hf_to_gguf.py, gguf-split), the download's size."""
        return self.data_offset + max((t.offset + t.n_bytes for t in self.tensors), default=0)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GgufError(f"{self.source}: no general.architecture key")
        return arch

    def arch_value(self, suffix: str, default: Any = None) -> Any:
        """The value of ``<architecture>.<suffix>``, as llama-arch.cpp's LLM_KV names it."""
        return self.metadata.get(f"{self.architecture}.{suffix}", default)

    def _required_int(self, suffix: str) -> int:
        value = self.arch_value(suffix)
        if value is None:
            raise GgufError(f"{self.source}: no {self.architecture}.{suffix} key")
        return int(value)

    @property
    def block_count(self) -> int:
        """All blocks, MTP/NextN blocks included (llama.cpp's n_layer_all)."""
        return self._required_int("block_count")

    @property
    def nextn_predict_layers(self) -> int:
        return int(self.arch_value("nextn_predict_layers", 0))

    @property
    def main_layer_count(self) -> int:
        """Blocks run in the main pass (llama.cpp's n_layer(): n_layer_all - n_layer_nextn)."""
        return self.block_count - self.nextn_predict_layers

    @property
    def context_length(self) -> int:
        return self._required_int("context_length")

    @property
    def embedding_length(self) -> int:
        return self._required_int("embedding_length")

    @property
    def feed_forward_length(self) -> int | list[int] | None:
        return self.arch_value("feed_forward_length")

    @property
    def head_count(self) -> int | list[int]:
        value = self.arch_value("attention.head_count")
        if value is None:
            raise GgufError(f"{self.source}: no {self.architecture}.attention.head_count key")
        return value

    @property
    def head_count_kv(self) -> int | list[int]:
        """KV heads, a list when it varies per layer; defaults to head_count as in llama.cpp."""
        return self.arch_value("attention.head_count_kv", self.head_count)

    def head_count_at(self, layer: int) -> int:
        return _per_layer(self.head_count, layer)

    def head_count_kv_at(self, layer: int) -> int:
        return _per_layer(self.head_count_kv, layer)

    @property
    def key_length(self) -> int:
        """Head size of K; llama.cpp defaults it to n_embd / n_head (of layer 0)."""
        value = self.arch_value("attention.key_length")
        if value is not None:
            return int(value)
        return self.embedding_length // self.head_count_at(0)

    @property
    def value_length(self) -> int:
        value = self.arch_value("attention.value_length")
        if value is not None:
            return int(value)
        return self.key_length

    @property
    def full_attention_interval(self) -> int | None:
        value = self.arch_value("full_attention_interval")
        return None if value is None else int(value)

    @property
    def recurrent_layers(self) -> list[bool] | None:
        """Per-layer ``%s.attention.recurrent_layers`` flags, where the file states them."""
        value = self.arch_value("attention.recurrent_layers")
        return None if value is None else [bool(v) for v in value]

    @property
    def vocab_size(self) -> int:
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and tokens:
            return len(tokens)
        size = self.arch_value("vocab_size")
        if size is not None:
            return int(size)
        embd = self.tensor("token_embd.weight")
        if embd is None:
            raise GgufError(f"{self.source}: vocabulary size unknown")
        return embd.shape[1]

    ssm_conv_kernel = _ssm_dimension("conv_kernel")
    ssm_inner_size = _ssm_dimension("inner_size")
    ssm_state_size = _ssm_dimension("state_size")
    ssm_group_count = _ssm_dimension("group_count")
    ssm_time_step_rank = _ssm_dimension("time_step_rank")

    @property
    def total_tensor_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)

    def check_shape(self) -> None:
        """Raise GgufError naming the file and the first value the planner cannot use: a
        missing or mistyped model dimension, a per-layer list of the wrong length, a tensor of
        a block the model does not have, a matrix with one dimension. A header that passes
        gives every property above a number of the right type."""
        problem = self._shape_problem()
        if problem:
            raise GgufError(
                f"{self.source}: {problem}; the header is corrupt or truncated (download the "
                "file again, or plan with a good copy: --model PATH)"
            )

    def _shape_problem(self) -> str | None:
        if not isinstance(self.metadata.get("general.architecture"), str):
            return "no general.architecture key (a string)"
        arch = self.architecture

        def integer(suffix: str, low: int, high: int | None = None, required: bool = False):
            value = self.arch_value(suffix)
            if value is None:
                return f"no {arch}.{suffix} key" if required else None
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            if not ok or (high is not None and value > high):
                bound = f"{low} to {high}" if high is not None else f"at least {low}"
                return f"{arch}.{suffix} is {_shown(value)}; it must be an integer, {bound}"
            return None

        problem = integer("block_count", 1, MAX_LAYERS, required=True)
        if problem:
            return problem
        n_all = self.block_count
        for suffix, low, high, required in (
            ("nextn_predict_layers", 0, n_all - 1, False),
            ("context_length", 1, None, True),
            ("embedding_length", 1, None, True),
            ("attention.key_length", 1, None, False),
            ("attention.value_length", 1, None, False),
            ("full_attention_interval", 1, None, False),
            ("vocab_size", 1, None, False),
            *((f"ssm.{name}", 0, None, False) for name in _SSM_KEYS),
        ):
            problem = integer(suffix, low, high, required)
            if problem:
                return problem
        for suffix, low, default in (
            ("attention.head_count", 0, None),
            ("attention.head_count_kv", 0, self.arch_value("attention.head_count")),
        ):
            value = self.arch_value(suffix, default)
            counts = value if isinstance(value, list) else [value]
            if value is None or isinstance(value, list) and len(value) != n_all:
                return (
                    f"{arch}.{suffix} is {_shown(value)}; it must be a count or a list of one "
                    f"count per block ({n_all})"
                )
            if not all(isinstance(c, int) and not isinstance(c, bool) and c >= low for c in counts):
                return f"{arch}.{suffix} is {_shown(value)}; counts are integers, at least {low}"
        if self.arch_value("attention.key_length") is None and self.head_count_at(0) < 1:
            return f"{arch}.attention.head_count of block 0 is 0 and no attention.key_length"
        flags = self.arch_value("attention.recurrent_layers")
        if flags is not None and (
            not isinstance(flags, list) or len(flags) < self.main_layer_count
        ):
            return (
                f"{arch}.attention.recurrent_layers is {_shown(flags)}; it must be a list of one "
                f"flag per block ({n_all})"
            )
        tokens = self.metadata.get("tokenizer.ggml.tokens")
        has_vocab = isinstance(tokens, list) and tokens or self.arch_value("vocab_size")
        embedding = self.tensor("token_embd.weight")
        if not has_vocab and (embedding is None or len(embedding.shape) < 2):
            return "no vocabulary size (tokenizer.ggml.tokens, vocab_size or token_embd.weight)"
        for tensor in self.tensors:
            block = _BLOCK_TENSOR.match(tensor.name)
            if block and int(block.group(1)) >= n_all:
                return (
                    f"tensor {tensor.name} belongs to block {block.group(1)}, but "
                    f"{arch}.block_count is {n_all} (blocks 0 to {n_all - 1})"
                )
            if len(tensor.shape) < 2 and _MATRIX_TENSOR.fullmatch(tensor.name):
                return f"tensor {tensor.name} has shape {list(tensor.shape)}; it is a matrix"
        return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# --- consistency of a header that was not read from its file (models.lock.yml's records) ---

# GGML_MAX_NAME in ggml.h: gguf_init_from_file refuses a tensor name of this many bytes or more.
MAX_NAME_BYTES = 64
# The magic, the version and the two counts: the least a header holds before its data.
_FIXED_HEADER_BYTES = 24
_ANY_BLOCK = re.compile(r"(?:^|\.)blk\.(\d+)\.")
_ATTENTION_TENSOR = re.compile(r"blk\.(\d+)\.attn_(q|k|v)\.weight")
_SSM_CONV_TENSOR = re.compile(r"blk\.(\d+)\.ssm_conv1d\.weight")


def tensor_table_problem(header: GgufHeader) -> str | None:
    """What makes ``header``'s tensor table one that no GGUF file holds, or None - what
    gguf_init_from_file checks at the pinned commit and ``read_gguf_header`` computes: an
    alignment that is not a power of two or not general.alignment's (32 when absent), a data
    section not aligned, a tensor name of GGML_MAX_NAME bytes or more, given twice or with
    control characters (no tensor llama.cpp loads has one, and it refuses a file with a tensor
    it does not load), a tensor whose byte count is not its shape's in its type, a tensor
    that does not start where the ones before it end (in order, each padded to the
    alignment). Checks one file alone (a shard of a split model too); names are shown with
    control characters escaped."""
    alignment = header.alignment
    declared = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment < 1 or alignment & (alignment - 1) or alignment != declared:
        return (
            f"its alignment is {alignment}, but general.alignment is {_shown(declared)} (a power "
            f"of two, {DEFAULT_ALIGNMENT} when absent)"
        )
    if header.data_offset < _FIXED_HEADER_BYTES or header.data_offset % alignment:
        return (
            f"its data starts at byte {header.data_offset}, which is not a multiple of its "
            f"alignment {alignment} past the header's {_FIXED_HEADER_BYTES} fixed bytes"
        )
    seen: set[str] = set()
    expected = 0
    for tensor in header.tensors:
        name = printable(tensor.name)
        length = len(tensor.name.encode("utf-8", "surrogateescape"))
        if length >= MAX_NAME_BYTES:
            return f"tensor {name} has a name of {length} bytes (ggml's most: {MAX_NAME_BYTES - 1})"
        if tensor.name in seen:
            return f"tensor {name} is recorded twice"
        if not tensor.name.isprintable():  # llama.cpp's tensor names are plain text
            return f"tensor {printable(repr(tensor.name))} has control characters in its name"
        seen.add(tensor.name)
        layout = GGML_TYPES.get(tensor.ggml_type)
        if layout is not None and layout.block_size > 0 and layout.type_size > 0:
            if tensor.shape[0] % layout.block_size:
                return (
                    f"tensor {name} has rows of {tensor.shape[0]} values, not whole "
                    f"{layout.name} blocks of {layout.block_size}"
                )
            n_bytes = tensor.shape[0] // layout.block_size * layout.type_size
            for dim in tensor.shape[1:]:
                n_bytes *= dim
            if tensor.n_bytes != n_bytes:
                return (
                    f"tensor {name} is recorded as {tensor.n_bytes} bytes, but its shape "
                    f"{list(tensor.shape)} in {layout.name} is {n_bytes} bytes"
                )
        if tensor.offset != expected:
            return (
                f"tensor {name} starts at byte {tensor.offset} of the data, but the tensors "
                f"before it end at byte {expected} (each padded to {alignment}): a GGUF file "
                "holds them in order, one after the other"
            )
        expected += -(-tensor.n_bytes // alignment) * alignment
    return None


def model_problem(header: GgufHeader) -> str | None:
    """What makes ``header`` (a whole model: one file, or a split model's shards merged) one
    that cannot describe the model it claims, or None: a value ``check_shape`` refuses, an
    architecture with control characters (no name llama.cpp knows), a block without any
    tensor, an attention tensor beside no heads (``attention.head_count``/``head_count_kv``
    0 for its block) or a key or value length of 0, an SSM convolution beside an
    ``ssm.conv_kernel``, ``ssm.inner_size`` or ``ssm.state_size`` of 0. Lenient where the
    tensors do not say: a layer with no attention tensors may have no heads (SSM hybrids)."""
    architecture = header.metadata.get("general.architecture")
    if isinstance(architecture, str) and not architecture.isprintable():
        return f"general.architecture {printable(repr(architecture))} is not a name llama.cpp knows"
    problem = header._shape_problem()
    if problem:
        return printable(problem)
    arch, n_all = header.architecture, header.block_count
    blocks = {int(found.group(1)) for t in header.tensors if (found := _ANY_BLOCK.search(t.name))}
    missing = [block for block in range(n_all) if block not in blocks]
    if missing:
        others = f" (nor do {len(missing) - 1} other blocks)" if len(missing) > 1 else ""
        return (
            f"block {missing[0]} has no tensors{others}, but {arch}.block_count is {n_all}: "
            f"every block from 0 to {n_all - 1} has its tensors"
        )
    for tensor in header.tensors:
        attention = _ATTENTION_TENSOR.fullmatch(tensor.name)
        if attention:
            block, which = int(attention.group(1)), attention.group(2)
            kind, heads = (
                ("query", header.head_count_at(block))
                if which == "q"
                else ("KV", header.head_count_kv_at(block))
            )
            key = f"{arch}.attention.head_count{'' if which == 'q' else '_kv'}"
            if heads < 1:
                return f"tensor {tensor.name} needs {kind} heads, but {key} is 0 for block {block}"
            length, what = (
                (header.value_length, "value") if which == "v" else (header.key_length, "key")
            )
            if length < 1:
                return (
                    f"tensor {tensor.name} needs a {what} length, but it is 0 ({arch}."
                    f"embedding_length {header.embedding_length} / {arch}.attention.head_count "
                    f"{header.head_count_at(0)} of block 0, and no {arch}.attention.{what}_length)"
                )
        if _SSM_CONV_TENSOR.fullmatch(tensor.name):
            for name in ("conv_kernel", "inner_size", "state_size"):
                if getattr(header, f"ssm_{name}") < 1:
                    return f"tensor {tensor.name} needs {arch}.ssm.{name}, but it is 0 or absent"
    return None


def _per_layer(value: int | list[int], layer: int) -> int:
    return int(value[layer]) if isinstance(value, list) else int(value)


# struct formats of the fixed-size value types (GGUF_TYPE_SIZE in ggml/src/gguf.cpp)
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}


class _Reader:
    """Sequential little-endian reads over a stream, in chunks, failing clearly at the end."""

    def __init__(self, stream: BinaryIO, source: str) -> None:
        self._stream = stream
        self._source = source
        self._buffer = b""
        self._pos = 0  # within _buffer
        self._consumed = 0  # bytes of the stream before _buffer
        self._hash = hashlib.sha256()  # of the bytes before _buffer

    def digest(self) -> str:
        """sha256 of every byte read so far."""
        hashed = self._hash.copy()
        hashed.update(self._buffer[: self._pos])
        return hashed.hexdigest()

    @property
    def offset(self) -> int:
        return self._consumed + self._pos

    def _ensure(self, n: int, what: str) -> None:
        while len(self._buffer) - self._pos < n:
            chunk = self._stream.read(max(READ_CHUNK, n))
            if not chunk:
                raise GgufError(
                    f"{self._source}: truncated at byte {len(self._buffer) + self._consumed} "
                    f"while reading {what} (the header needs more bytes)"
                )
            self._consumed += self._pos
            self._hash.update(self._buffer[: self._pos])
            self._buffer = self._buffer[self._pos :] + chunk
            self._pos = 0

    def take(self, n: int, what: str) -> bytes:
        self._ensure(n, what)
        data = self._buffer[self._pos : self._pos + n]
        self._pos += n
        return data

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        self._ensure(size, what)
        values = struct.unpack_from("<" + fmt, self._buffer, self._pos)
        self._pos += size
        return values

    def u32(self, what: str) -> int:
        return self.unpack("I", what)[0]

    def u64(self, what: str) -> int:
        return self.unpack("Q", what)[0]

    def string(self, what: str) -> str:
        length = self.u64(f"the length of {what}")
        if length > MAX_STRING_BYTES:
            raise GgufError(f"{self._source}: {what} claims {length} bytes (corrupt file?)")
        raw = self.take(length, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            # tokenizer vocabularies may hold invalid UTF-8 byte pieces; keep them readable
            return raw.decode("utf-8", errors="surrogateescape")

    def value(self, value_type: int, what: str) -> Any:
        if value_type == GGUFValueType.STRING:
            return self.string(what)
        if value_type == GGUFValueType.ARRAY:
            item_type = self.u32(f"the item type of {what}")
            count = self.u64(f"the item count of {what}")
            if count > MAX_ARRAY_ITEMS:
                raise GgufError(f"{self._source}: {what} claims {count} items (corrupt file?)")
            if item_type in _SCALAR_FORMATS:
                return list(self.unpack(f"{count}{_SCALAR_FORMATS[item_type]}", what))
            return [self.value(item_type, what) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise GgufError(f"{self._source}: {what} has unknown value type {value_type}")
        return self.unpack(_SCALAR_FORMATS[value_type], what)[0]


def read_gguf_header(
    source: BinaryIO | bytes | bytearray | memoryview, name: str = ""
) -> GgufHeader:
    """Parse the header from a binary stream positioned at the file's start, or from bytes.

    Reads no further than the header needs (plus at most one read chunk); ``name`` is used in
    error messages.
    """
    if isinstance(source, bytes | bytearray | memoryview):
        stream: BinaryIO = io.BytesIO(bytes(source))
        label = name or "<bytes>"
    else:
        stream = source
        label = name or str(getattr(source, "name", "<stream>"))
    reader = _Reader(stream, label)

    magic = reader.take(4, "the magic")
    if magic != GGUF_MAGIC:
        raise GgufError(f"{label}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    version = reader.u32("the version")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and (version >> 24) in SUPPORTED_VERSIONS:
            raise GgufError(f"{label}: big-endian GGUF is not supported")
        raise GgufError(f"{label}: GGUF version {version} is not supported (2 or 3)")
    n_tensors = reader.u64("the tensor count")
    n_kv = reader.u64("the metadata count")
    if n_tensors > MAX_COUNT or n_kv > MAX_COUNT:
        raise GgufError(f"{label}: {n_tensors} tensors / {n_kv} keys (corrupt file?)")

    metadata: dict[str, Any] = {}
    for index in range(n_kv):
        key = reader.string(f"metadata key #{index}")
        value_type = reader.u32(f"the type of {key}")
        if key in metadata:
            raise GgufError(f"{label}: duplicate metadata key {key}")
        metadata[key] = reader.value(value_type, key)

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GgufError(f"{label}: general.alignment {alignment!r} is not a power of two")

    tensors = list(_read_tensor_infos(reader, n_tensors, label))
    data_offset = -(-reader.offset // alignment) * alignment
    return GgufHeader(version, metadata, tensors, data_offset, alignment, label, reader.digest())


def _read_tensor_infos(reader: _Reader, n_tensors: int, label: str) -> Iterator[TensorInfo]:
    for index in range(n_tensors):
        name = reader.string(f"the name of tensor #{index}")
        n_dims = reader.u32(f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GgufError(f"{label}: tensor {name} has {n_dims} dimensions (1 to {MAX_DIMS})")
        shape = reader.unpack(f"{n_dims}Q", f"the shape of {name}")
        type_id = reader.u32(f"the type of {name}")
        offset = reader.u64(f"the offset of {name}")
        if type_id not in GGML_TYPES:
            raise GgufError(f"{label}: tensor {name} has unknown ggml type {type_id}")
        layout = GGML_TYPES[type_id]
        if shape[0] % layout.block_size:
            raise GgufError(
                f"{label}: tensor {name} row of {shape[0]} is not whole {layout.name} blocks"
            )
        n_bytes = shape[0] // layout.block_size * layout.type_size
        for dim in shape[1:]:
            n_bytes *= dim
        yield TensorInfo(name, tuple(shape), type_id, n_bytes, offset)


SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"


def merge_split(headers: list[GgufHeader]) -> GgufHeader:
    """One header for a split model from its shards' headers, in order: the first shard's
    metadata (gguf-split writes the model's keys there, and only the split keys in the
    others) with every shard's tensors. Raises GgufError naming the shard whose split keys
    disagree with the set: its number, the count, or the total of tensors."""
    if len(headers) == 1 and SPLIT_COUNT not in headers[0].metadata:
        return headers[0]
    count = len(headers)
    tensors: list[TensorInfo] = []
    for index, header in enumerate(headers):
        meta = header.metadata
        found = (meta.get(SPLIT_NO), meta.get(SPLIT_COUNT), meta.get(SPLIT_TENSORS))
        expected = (index, count, headers[0].metadata.get(SPLIT_TENSORS))
        if found != expected:
            raise GgufError(
                f"{header.source}: its split keys are {SPLIT_NO}={found[0]}, "
                f"{SPLIT_COUNT}={found[1]}, {SPLIT_TENSORS}={found[2]}, but as shard "
                f"{index + 1} of {count} it must have {expected[0]}, {expected[1]}, "
                f"{expected[2]}: the shards are not one gguf-split set (download them again)"
            )
        tensors += header.tensors
    declared = headers[0].metadata.get(SPLIT_TENSORS)
    if declared != len(tensors) or len({t.name for t in tensors}) != len(tensors):
        raise GgufError(
            f"{headers[0].source}: {SPLIT_TENSORS} is {declared}, but the {count} shards hold "
            f"{len(tensors)} tensors ({len({t.name for t in tensors})} distinct names): the "
            "set is incomplete or mixed (download the shards again)"
        )
    first = headers[0]
    return GgufHeader(
        first.version,
        first.metadata,
        tensors,
        first.data_offset,
        first.alignment,
        first.source,
        first.digest,
    )


def split_problem(headers: list[GgufHeader]) -> str | None:
    """Why ``headers`` (a split model's shards', in order) are not one gguf-split set, as
    ``merge_split`` refuses them but without its fix (the caller knows where the headers came
    from); None when they are one set, or one file without split keys."""
    if len(headers) == 1 and SPLIT_COUNT not in headers[0].metadata:
        return None
    count, total = len(headers), headers[0].metadata.get(SPLIT_TENSORS)
    for index, header in enumerate(headers):
        meta = header.metadata
        found = (meta.get(SPLIT_NO), meta.get(SPLIT_COUNT), meta.get(SPLIT_TENSORS))
        if found != (index, count, total):
            return printable(
                f"shard {index + 1} of {count} has {SPLIT_NO}={found[0]!r}, {SPLIT_COUNT}="
                f"{found[1]!r}, {SPLIT_TENSORS}={found[2]!r}, where it must have {index}, "
                f"{count}, {total!r}"
            )
    names = [t.name for header in headers for t in header.tensors]
    if total != len(names) or len(set(names)) != len(names):
        return (
            f"{SPLIT_TENSORS} is {printable(repr(total))}, but the {count} shards hold "
            f"{len(names)} tensors ({len(set(names))} distinct names)"
        )
    return None


def read_gguf_header_file(path: str | Path) -> GgufHeader:
    with open(path, "rb") as stream:
        return read_gguf_header(stream, str(path))
