"""The model's files on a host: its file name, each shard of a split model, where each comes
from and the sha256 it must have (always one per file: `shard_digests`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from llamarig.model.shards import shard_count, sibling_paths, sibling_urls
from llamarig.shapes import url_file_name


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
    must be resolved first (`llamarig.model.lock.resolved`), which sets `url` and `sha256`."""
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
