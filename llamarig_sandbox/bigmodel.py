"""A large model file on a sandbox without a large download: a real GGUF (SmolLM2) followed by
a sparse tail of zeros up to the size wanted, written straight into the sandbox's root.

llama.cpp at the pinned commit only checks that every tensor lies inside the file
(src/llama-model-loader.h: ``offs + ggml_nbytes(tensor) > file->size()`` is refused) and gguf.cpp
reads the header and the tensors' own bytes, so trailing bytes are allowed: the padded file
loads and answers like the original. On disk it takes the original's blocks only; read, the
tail is zeros (what a checksum of the whole file must read through).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from llamarig import CACHE_DIR

DIGEST_CACHE_DIR = CACHE_DIR / "bench"
_ZEROS = bytes(1 << 24)


def padded_sha256(source: Path, size: int, cache_dir: Path = DIGEST_CACHE_DIR) -> str:
    """The sha256 of ``source`` followed by zeros up to ``size`` bytes, computed from the
    source alone (the padded file is never read) and cached by the source's digest and size:
    16 GiB of zeros take about ten seconds to hash here."""
    head = hashlib.sha256(source.read_bytes())
    if size < source.stat().st_size:
        raise ValueError(f"{size} bytes is smaller than {source} ({source.stat().st_size} bytes)")
    cached = cache_dir / f"{head.hexdigest()}-{size}.sha256"
    if cached.is_file():
        return cached.read_text().strip()
    remaining = size - source.stat().st_size
    zeros = memoryview(_ZEROS)
    while remaining:
        chunk = min(remaining, len(zeros))
        head.update(zeros[:chunk])
        remaining -= chunk
    digest = head.hexdigest()
    cache_dir.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(cached.name + ".partial")
    partial.write_text(digest + "\n")
    partial.rename(cached)
    return digest


def place_padded(source: Path, dest: Path, size: int) -> None:
    """Write ``source`` to ``dest`` (a path on this machine, e.g. inside a sandbox's root) and
    extend it with a hole to ``size`` bytes; readable by all, like a model a user placed."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    shutil.copyfile(source, partial)
    os.truncate(partial, size)
    partial.chmod(0o644)
    partial.rename(dest)


def allocated_bytes(path: Path) -> int:
    """Bytes ``path`` takes on disk (a sparse file: far less than its size)."""
    return path.stat().st_blocks * 512
