"""Settings llamarig derives from others, so that nothing is typed twice: the model's file
name and its files (every shard of a split model), and an RPC head's endpoints and worker GPUs
from the worker hosts it names."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath

from llamarig.config.addresses import local_url
from llamarig.config.hosts import HostConfig
from llamarig.model.shards import shard_count, sibling_paths, sibling_urls
from llamarig.shapes import url_file_name

# Keys of `rpc` that only derive_rpc writes, each with what to do instead.
_FROM_WORKERS = (
    "is derived from rpc.workers (their rpc.host:rpc.port and gpus); name the workers and "
    "declare their settings there instead"
)
DERIVED_RPC_KEYS = {
    "endpoints": _FROM_WORKERS,
    "worker_gpus": _FROM_WORKERS,
    "head": "is derived from the head whose rpc.workers names this worker; name it there instead",
}


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
    sha256 = model["sha256"]
    digests = sha256 if isinstance(sha256, list) else [sha256] * count
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


def rpc_workers(head: HostConfig, hosts: dict[str, HostConfig]) -> list[HostConfig]:
    """The hosts a head's rpc.workers names that are rpc-workers of this inventory, in order
    (the others are refused by the cross-host checks)."""
    named = (hosts.get(name) for name in head.data["rpc"]["workers"])
    return [worker for worker in named if worker and worker.data["role"] == "rpc-worker"]


def worker_gpus(head: HostConfig, hosts: dict[str, HostConfig]) -> list[dict]:
    """The GPUs of a head's workers, each with its worker's name, as llama.cpp orders the
    devices (rpc.workers order, before the head's own)."""
    return [
        {"worker": worker.name, **gpu}
        for worker in rpc_workers(head, hosts)
        for gpu in worker.data["gpus"]
    ]


def rpc_endpoint(worker: HostConfig) -> str:
    """``host:port`` of a worker's ggml-rpc-server (an IPv6 address in brackets)."""
    address = worker.data["rpc"]["host"]
    address = f"[{address}]" if ":" in address else address
    return f"{address}:{worker.data['rpc']['port']}"


def derive_rpc(hosts: dict[str, HostConfig]) -> None:
    """Write each head's rpc.endpoints and rpc.worker_gpus (so --rpc is never typed twice)
    and each worker's rpc.head (the server it drains before it restarts, and restarts after
    it); run after the checks passed."""
    for head in hosts.values():
        if head.data["role"] != "rpc-head":
            continue
        rpc = head.data["rpc"]
        rpc["endpoints"] = [rpc_endpoint(worker) for worker in rpc_workers(head, hosts)]
        rpc["worker_gpus"] = worker_gpus(head, hosts)
        server = head.data["server"]
        for worker in rpc_workers(head, hosts):
            # What the worker's restart drains first: the head's requests in flight, which
            # end when the worker they run on goes away; then the head restarts too.
            worker.data["rpc"]["head"] = {
                "name": head.name,
                "url": local_url(server["host"], server["port"]),
                "service": f"{server['service']}.service",
                "drain_timeout": server["drain_timeout"],
                "start_timeout": server["start_timeout"],
            }
