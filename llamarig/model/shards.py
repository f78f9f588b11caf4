"""Split GGUFs as llama.cpp's gguf-split names them: ``NAME-00001-of-00003.gguf`` ... . A split
model is named by its first shard, and llama.cpp loads the set from that shard's path; the
others sit beside it (same directory, same URL directory) under the same stem."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

_SPLIT = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")


def split_parts(name: str) -> tuple[str, int, int] | None:
    """(stem, shard number from 1, shard count) of a gguf-split shard name, else None."""
    match = _SPLIT.fullmatch(name)
    if not match or not 1 <= int(match["no"]) <= int(match["count"]):
        return None  # not a numbering gguf-split writes: an ordinary file name
    return match["stem"], int(match["no"]), int(match["count"])


def numbering_problem(name: str) -> str | None:
    """What is wrong with a name that has gguf-split's shape but a numbering it never writes
    (shard 0, a shard beyond the count), or None."""
    match = _SPLIT.fullmatch(name)
    if not match or split_parts(name):
        return None
    number, count = int(match["no"]), int(match["count"])
    return (
        f"{name} numbers shard {number} of {count}, which gguf-split never writes (shards are "
        f"numbered from 1 to the count): name the first shard, "
        f"{match['stem']}-00001-of-{max(count, 1):05d}.gguf"
    )


def shard_names(name: str) -> list[str]:
    """Every shard of the set ``name`` belongs to, in order; ``[name]`` for one file."""
    parts = split_parts(name)
    if parts is None:
        return [name]
    stem, _, count = parts
    return [f"{stem}-{n:05d}-of-{count:05d}.gguf" for n in range(1, count + 1)]


def shard_count(name: str) -> int:
    parts = split_parts(name)
    return parts[2] if parts else 1


def sibling_paths(path: str) -> list[str]:
    """The shards of a split model named by ``path`` (a host path, or a path in a repo):
    the same directory, each shard's name."""
    directory, _, name = path.rpartition("/")
    prefix = f"{directory}/" if _ else ""
    return [prefix + shard for shard in shard_names(name)]


def sibling_urls(url: str) -> list[str]:
    """The shards' URLs of a split model named by the URL of its first shard: the same URL
    with the last path part's shard number changed (query and fragment kept)."""
    parts = urlsplit(url)
    directory, _, name = parts.path.rpartition("/")
    return [urlunsplit(parts._replace(path=f"{directory}/{shard}")) for shard in shard_names(name)]
