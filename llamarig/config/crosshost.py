"""Rules across the hosts of one inventory: an RPC head's workers, workers lent twice or
unreachable, and hosts of one machine that would collide on it."""

from __future__ import annotations

from typing import Any

from llamarig.config.addresses import is_loopback
from llamarig.config.builders import SERVES_NO_MODEL
from llamarig.config.derived import DERIVED_RPC_KEYS, worker_gpus
from llamarig.config.hosts import HostConfig
from llamarig.config.problems import Problem, did_you_mean, located


def rpc_inventory_problems(hosts: dict[str, HostConfig]) -> list[str]:
    """Each head's workers are rpc-worker hosts of this inventory (their addresses become the
    head's rpc.endpoints, derived.derive_rpc), and its split and `auto` settings fit them."""
    problems = []
    for host_config in hosts.values():
        rpc = host_config.data["rpc"]
        derived = [key for key in DERIVED_RPC_KEYS if key in rpc]
        if derived:
            problems.extend(
                located(
                    host_config,
                    Problem(("rpc", key), DERIVED_RPC_KEYS[key], in_inventory=True),
                )
                for key in derived
            )
            continue
        if host_config.data["role"] != "rpc-head":
            continue
        for name in rpc["workers"]:
            worker = hosts.get(name)
            if worker is None or worker.data["role"] != "rpc-worker":
                what = (
                    f"not a host of this inventory ({did_you_mean(name, list(hosts))})"
                    if worker is None
                    else f"a `{worker.data['role']}` host"
                )
                problems.append(
                    located(
                        host_config,
                        Problem(
                            ("rpc", "workers"),
                            f"names `{name}`, which is {what}; a head's workers are hosts with "
                            "`role: rpc-worker`",
                            in_inventory=True,
                        ),
                    )
                )
        lent_gpus = worker_gpus(host_config, hosts)
        server = host_config.data["server"]
        split, devices = server["tensor_split"], len(lent_gpus) + len(host_config.data["gpus"])
        all_declared = all(name in hosts and hosts[name].data["gpus"] for name in rpc["workers"])
        if isinstance(split, list) and all_declared and len(split) != devices:
            problems.append(
                located(
                    host_config,
                    Problem(
                        ("server", "tensor_split"),
                        f"has {len(split)} shares for {devices} devices: the workers' "
                        f"{len(lent_gpus)} GPUs first (rpc.workers order), then this host's "
                        f"{len(host_config.data['gpus'])}",
                        in_inventory=True,
                    ),
                )
            )
        if "auto" in (server["ctx"], server["tensor_split"]):
            cpu_workers = [
                name for name in rpc["workers"] if name in hosts and not hosts[name].data["gpus"]
            ]
            if host_config.data["llama_cpp"]["backend"] != "cuda" or cpu_workers:
                problems.append(
                    located(
                        host_config,
                        Problem(
                            ("server", "ctx" if server["ctx"] == "auto" else "tensor_split"),
                            "`auto` plans GPU memory across hosts: it needs a cuda head and the "
                            "`gpus` of every worker"
                            + (
                                f" (not declared on {', '.join(cpu_workers)})"
                                if cpu_workers
                                else ""
                            )
                            + "; or give numbers (llama.cpp puts the workers' devices first, in "
                            "rpc.workers order, then the head's GPUs)",
                            in_inventory=True,
                        ),
                    )
                )
    return problems


def machine_box(data: dict) -> str:
    """The box a host's SSH address names, port aside: every loopback name and address (and
    pyinfra's @local) is this machine, whose containers share its loopback."""
    ssh = data["ssh"]
    if ssh.get("local") or is_loopback(ssh["host"]):
        return "this machine"
    return ssh["host"].lower().rstrip(".")


def _machine(data: dict) -> tuple:
    """What identifies the machine a host's settings reach: pyinfra's @local, or the SSH
    address (127.0.0.1, ::1 and localhost alike) and port."""
    ssh = data["ssh"]
    if ssh.get("local"):
        return ("@local",)
    box = machine_box(data)
    return ("127.0.0.1" if box == "this machine" else box, ssh.get("port", 22))


def rpc_topology_problems(hosts: dict[str, HostConfig]) -> list[str]:
    """RPC layouts that cannot work: a worker lent to two heads, two workers of one machine
    on one port (or unit), a loopback worker address that a head on another box cannot reach."""
    problems = []
    head_of: dict[str, str] = {}
    for head in hosts.values():
        if head.data["role"] != "rpc-head":
            continue
        for name in head.data["rpc"]["workers"]:
            worker = hosts.get(name)
            if worker is None or worker.data["role"] != "rpc-worker":
                continue  # named by rpc_inventory_problems
            if name in head_of:
                problems.append(
                    located(
                        head,
                        Problem(
                            ("rpc", "workers"),
                            f"names `{name}`, which is already a worker of `{head_of[name]}`; "
                            "ggml-rpc-server lends its devices to one head: give each head its own "
                            "workers",
                            in_inventory=True,
                        ),
                    )
                )
                continue
            head_of[name] = head.name
            address = worker.data["rpc"]["host"]
            if is_loopback(address) and machine_box(worker.data) != machine_box(head.data):
                problems.append(
                    located(
                        worker,
                        Problem(
                            ("rpc", "host"),
                            f"{address} is loopback, which head `{head.name}` on another box "
                            f"({machine_box(head.data)}) cannot reach: bind the private address of "
                            f"{machine_box(worker.data)} that the head reaches, e.g. 10.0.0.12",
                        ),
                    )
                )
    owners: dict[tuple, HostConfig] = {}
    for worker in hosts.values():
        if worker.data["role"] != "rpc-worker":
            continue
        machine = _machine(worker.data)
        for key in ("port", "service"):
            value = worker.data["rpc"][key]
            other = owners.setdefault((machine, key, value), worker)
            if other is not worker:
                problems.append(
                    located(
                        worker,
                        Problem(
                            ("rpc", key),
                            f"{value} is also the rpc.{key} of worker `{other.name}`, which is the "
                            "same machine; give each worker on one machine its own rpc.port and "
                            "rpc.service",
                            in_inventory=True,
                        ),
                    )
                )
    return problems


def shared_machine_problems(host_configs: list[HostConfig]) -> list[str]:
    """Hosts of one inventory that reach the same machine must not collide on it: one @local,
    and per machine distinct server ports, unit names and environment files."""
    problems = []
    by_machine: dict[tuple, list[HostConfig]] = {}
    for host_config in host_configs:
        by_machine.setdefault(_machine(host_config.data), []).append(host_config)
    for machine, members in by_machine.items():
        first = members[0]
        if machine == ("@local",):
            problems.extend(
                located(
                    other,
                    Problem(
                        ("ssh", "local"),
                        f"host `{first.name}` already converges this machine with `local: true` "
                        "(pyinfra has one @local); keep one of them",
                        in_inventory=True,
                    ),
                )
                for other in members[1:]
            )
            continue
        for key_path, what in (
            (("server", "port"), "server.port"),
            (("server", "service"), "server.service"),
            (("paths", "env_file"), "paths.env_file"),
        ):
            owners: dict[Any, HostConfig] = {}
            # A gateway alone or a builder runs no llama-server: its server settings are unused.
            for host_config in (m for m in members if m.data["role"] not in SERVES_NO_MODEL):
                value = host_config.data[key_path[0]][key_path[1]]
                if value in owners:
                    problems.append(
                        located(
                            host_config,
                            Problem(
                                key_path,
                                f"{value} is also the {what} of host `{owners[value].name}`, which "
                                f"is the same machine (ssh {machine[0]} port {machine[1]}); give "
                                f"each host on one machine its own {what}",
                                in_inventory=True,
                            ),
                        )
                    )
                else:
                    owners[value] = host_config
    return problems
