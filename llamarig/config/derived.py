"""Settings llamarig derives from others, so that nothing is typed twice: an RPC head's
endpoints and worker GPUs from the worker hosts it names, and the CUDA architecture list of
every rig with `cuda_architectures: fleet` (the model's file name and files are
llamarig.model.files')."""

from __future__ import annotations

from llamarig.config.addresses import local_url
from llamarig.config.hosts import HostConfig
from llamarig.tables.hardware import cuda_architectures

# `llama_cpp.cuda_architectures: fleet`: one list for the GPUs of every rig that says so.
FLEET_ARCHITECTURES = "fleet"

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
                "http_timeouts": dict(server["http_timeouts"]),
                "start_timeout": server["start_timeout"],
            }


def derive_fleet_architectures(hosts: dict[str, HostConfig]) -> None:
    """Resolve `llama_cpp.cuda_architectures: fleet` into one CMAKE_CUDA_ARCHITECTURES list,
    the same on every CUDA rig that sets it: real code for each GPU that any of them declares,
    so they have one build key (planner/fleet.py) and share one build; run after the checks
    passed (each such rig declares its `gpus`)."""
    rigs = [
        host_config
        for host_config in hosts.values()
        if host_config.data["llama_cpp"]["backend"] == "cuda"
        and host_config.data["llama_cpp"]["cuda_architectures"] == FLEET_ARCHITECTURES
    ]
    listed = cuda_architectures(
        gpu["compute_capability"] for host_config in rigs for gpu in host_config.data["gpus"]
    )
    for host_config in rigs:
        host_config.data["llama_cpp"]["cuda_architectures"] = listed
