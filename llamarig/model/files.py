"""The model's files on a host: its file name, each shard of a split model, where each comes
from and the sha256 it must have (always one per file: `shard_digests`).

Split GGUFs as llama.cpp's gguf-split names them: ``NAME-00001-of-00003.gguf`` ... . A split
model is named by its first shard, and llama.cpp loads the set from that shard's path; the
others sit beside it (same directory, same URL directory) under the same stem."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import unquote, urlsplit, urlunsplit

from llamarig.tables.text import printable

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
    first = f"{match['stem']}-00001-of-{max(count, 1):05d}.gguf"
    return (
        f"{printable(name)} numbers shard {number} of {count}, which gguf-split never writes "
        f"(shards are numbered from 1 to the count): name the first shard, {printable(first)}"
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


def url_file_name(url: str) -> str:
    """The file name a URL names: its path's last part, percent-decoded (as a browser saves
    it). Decoded, it may hold what the URL could not hold typed (``%00``, ``%1B``): the loader
    checks it decoded (shapes.file_name_problem, shapes.decoded_invisible), and a message
    shows it through ``text.printable``."""
    try:
        path = urlsplit(url).path
    except ValueError:
        path = url
    return unquote(path.rstrip("/").rsplit("/", 1)[-1])


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


def model_filename(data: dict) -> str:
    """File name of the model on the host: explicit, else the URL's or path's last part."""
    model = data["model"]
    if model["filename"]:
        return model["filename"]
    if model["url"]:
        return url_file_name(model["url"])
    return (model["path"] or "").rstrip("/").rsplit("/", 1)[-1]


def model_source_name(model: dict) -> str | None:
    """The file name the model is named by: the URL's or path's last part, or the file's in a
    Hugging Face repo (None for a `quant`, known only once resolved)."""
    if model["url"]:
        return url_file_name(model["url"])
    source = model["path"] or model["file"]
    return source.rstrip("/").rsplit("/", 1)[-1] if source else None


@dataclass(frozen=True)
class ModelFile:
    """One file of the model on the host: the whole model, or one shard of a split one."""

    dest: str  # its path on the host
    url: str | None  # where it is downloaded from; None for a file already on the host
    sha256: str | None  # None: a file on the host that is not checked


def model_files(data: dict) -> list[ModelFile]:
    """The model's files in order (the first is what llama-server is given): one, or each shard
    of a split model beside the first, with the sha256 given for it. A Hugging Face reference
    must be resolved first (`llamarig.config.lock.resolved`), which sets `url` and `sha256`."""
    model = data["model"]
    count = shard_count(model_source_name(model) or "")
    digests = shard_digests(model, count)
    if model["path"]:
        return [
            ModelFile(path, None, digest)
            for path, digest in zip(sibling_paths(model["path"]), digests, strict=True)
        ]
    directory = PurePosixPath(data["paths"]["models"])
    urls = sibling_urls(model["url"]) if count > 1 else [model["url"]]
    names = [url_file_name(url) for url in urls] if count > 1 else [model_filename(data)]
    return [
        ModelFile(str(directory / name), url, digest)
        for name, url, digest in zip(names, urls, digests, strict=True)
    ]


def shard_digests(model: dict, count: int) -> list[str | None]:
    """The sha256 given for each of a model's ``count`` files (None where none is given)."""
    sha256 = model.get("sha256")
    return list(sha256) if isinstance(sha256, list) else [sha256] * count
