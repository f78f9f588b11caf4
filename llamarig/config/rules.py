"""The rules of one host's settings that the schema cannot state: what must be given
together, what contradicts the role, the backend or llama.cpp, and values JSON cannot hold.
The hardware-facing contradictions live in `contradictions`, the version rules in `versions`."""

from __future__ import annotations

import math
from typing import Any

from llamarig import llama_args
from llamarig.config.addresses import WILDCARD_HOSTS, is_loopback
from llamarig.config.contradictions import contradiction_problems
from llamarig.config.expect import answer_problems
from llamarig.config.model_rules import model_problems
from llamarig.config.paths import expand_path, local_file_text
from llamarig.config.problems import Problem, json_type
from llamarig.config.versions import version_problems
from llamarig.memory import CUDA_FA_KV_TYPES
from llamarig.shapes import shape_problems

UNQUANTIZED_KV_TYPES = ("f32", "f16", "bf16")


def semantic_problems(data: dict) -> list[Problem]:
    """Cross-field rules the schema cannot state, each a Problem (blaming the inventory when
    the fix is to add a setting the defaults leave empty)."""
    problems: list[Problem] = []
    server, gpus = data["server"], data["gpus"]
    backend = data["llama_cpp"]["backend"]

    ssh = data.get("ssh") or {}
    if not ssh.get("local") and not ssh.get("host"):
        problems.append(
            Problem(
                ("ssh", "host"),
                "is missing: give the address sshd listens on (and usually `port`, `user`, "
                "`key`, `known_hosts`), or set `ssh.local: true` to converge this machine",
                in_inventory=True,
            )
        )
    if ssh.get("local") and ssh.get("host"):
        problems.append(
            Problem(
                ("ssh", "local"),
                "`local: true` converges this machine, yet `host` names another; "
                "remove one of them",
            )
        )
    if not ssh.get("local") and ssh.get("host") and server["port"] == ssh.get("port", 22):
        problems.append(
            Problem(
                ("server", "port"),
                f"{server['port']} is also the host's SSH port (ssh.port); llama-server cannot "
                "bind the port sshd listens on: pick another, such as 8080",
            )
        )

    if server["port"] < 1024 and server.get("supervisor", "systemd") == "systemd":
        problems.append(
            Problem(
                ("server", "port"),
                f"{server['port']} is a privileged port, and the unit runs llama-server as an "
                "unprivileged dynamic user without CAP_NET_BIND_SERVICE, so it cannot bind it; "
                "use a port from 1024 up, such as 8080 (put a reverse proxy in front for 80/443)",
            )
        )

    problems += model_problems(data)

    split_mode = server["split_mode"]
    if split_mode == "row":
        problems.append(
            Problem(
                ("server", "split_mode"),
                "`row` no longer works with CUDA at the "
                "pinned llama.cpp (it fails at load with `does not support split "
                "buffers`); use `tensor` (splits every layer, fastest on two cards) or "
                "`layer` (pipeline)",
            )
        )
    if split_mode == "tensor" and server["flash_attn"] == "off":
        problems.append(
            Problem(
                ("server", "flash_attn"),
                "`off` is refused by `split_mode: tensor`, "
                "which forces flash attention; set `on` or `auto`",
            )
        )
    if split_mode == "tensor" and backend == "cpu":
        problems.append(
            Problem(
                ("server", "split_mode"),
                "`tensor` needs GPU devices; a cpu build "
                "exits at load (LLAMA_SPLIT_MODE_TENSOR needs >= 1 devices); use `none`",
            )
        )
    problems += _kv_problems(server, split_mode, backend)
    split = server["tensor_split"]
    if isinstance(split, list):
        if not any(split):
            problems.append(
                Problem(("server", "tensor_split"), "needs at least one non-zero share")
            )
        # A head's split also covers its workers' devices (checked across the inventory).
        if gpus and len(split) != len(gpus) and data["role"] != "rpc-head":
            problems.append(
                Problem(
                    ("server", "tensor_split"),
                    f"has {len(split)} {'entry' if len(split) == 1 else 'entries'} for "
                    f"{len(gpus)} declared GPUs; give one share per GPU, in `gpus` order",
                )
            )
    if split is not None and backend == "cpu" and data["role"] != "rpc-head":
        problems.append(
            Problem(("server", "tensor_split"), "applies to GPUs only; set null for a cpu build")
        )
    if server["ctx"] == "auto" and backend == "cpu":
        problems.append(
            Problem(("server", "ctx"), "`auto` plans GPU memory; give a number for a cpu build")
        )

    if not is_loopback(server["host"]) and not server["api_key_file"]:
        problems.append(
            Problem(
                ("server", "host"),
                f"{server['host']} exposes the API to the network; set `server.api_key_file` to "
                "a file holding an API key, or listen on 127.0.0.1",
            )
        )
    if server["api_key_file"]:
        key_file = expand_path(server["api_key_file"])
        if not local_file_text(key_file).strip():
            problems.append(
                Problem(
                    ("server", "api_key_file"),
                    f"{key_file} does not exist or is empty; write the "
                    "key to it (e.g. openssl rand -hex 32 > FILE; chmod 600 FILE)",
                )
            )

    spec_types = server["spec"]["type"]
    if "none" in spec_types and len(spec_types) > 1:
        problems.append(
            Problem(
                ("server", "spec", "type"),
                "`none` cannot be combined with other types; use [] for no speculative decoding",
            )
        )
    if server["spec"]["draft_max"] is not None and not spec_types:
        problems.append(
            Problem(
                ("server", "spec", "draft_max"),
                "has no effect without `spec.type`; "
                "set a type such as [ngram-mod] or remove draft_max",
            )
        )

    if backend == "cuda":
        if data["cuda"]["source"] == "none":
            problems.append(
                Problem(
                    ("cuda", "source"),
                    "is `none` but `llama_cpp.backend` is `cuda`; "
                    "choose a toolkit source or build for the cpu",
                )
            )
        if data["driver"]["source"] == "none":
            problems.append(
                Problem(
                    ("driver", "source"),
                    "is `none` but `llama_cpp.backend` is "
                    "`cuda`; choose a driver source or build for the cpu",
                )
            )
        if data["llama_cpp"]["cuda_architectures"] == "auto" and not gpus:
            problems.append(
                Problem(
                    ("llama_cpp", "cuda_architectures"),
                    "`auto` needs the `gpus` "
                    'list; declare the GPUs or give a list such as "86-real;120a-real" '
                    "(a build host's own GPUs are not the target's)",
                )
            )
        problems += version_problems(data)
    problems += _gpu_list_problems(gpus)
    problems += _json_problems(server["chat_template_kwargs"], ("server", "chat_template_kwargs"))
    problems += _rpc_role_problems(data)
    problems += [Problem(*problem) for problem in shape_problems(data)]
    # The escape hatches, and settings that contradict each other, llama.cpp or the hardware.
    problems += [
        Problem(*problem) for problem in llama_args.extra_args_problems(server["extra_args"])
    ]
    problems += [Problem(*problem) for problem in llama_args.env_problems(server["env"])]
    problems += contradiction_problems(data)
    problems += answer_problems(data)
    return problems


def _rpc_role_problems(data: dict) -> list[Problem]:
    """One host's RPC settings against its role (the workers' names are checked across the
    inventory by crosshost.rpc_inventory_problems)."""
    role, rpc = data["role"], data["rpc"]
    problems: list[Problem] = []
    if role == "rpc-worker":
        if rpc["host"] is None:
            problems.append(
                Problem(
                    ("rpc", "host"),
                    "is missing: an rpc-worker binds ggml-rpc-server to a private address the "
                    "head reaches, e.g. 10.0.0.12 (the RPC protocol has no authentication, so "
                    "never a public one)",
                    in_inventory=True,
                )
            )
        elif rpc["host"] in WILDCARD_HOSTS:
            problems.append(
                Problem(
                    ("rpc", "host"),
                    f"{rpc['host']!r} would expose ggml-rpc-server, which has no "
                    "authentication, on every interface; name the private address the head "
                    "reaches, e.g. 10.0.0.12",
                )
            )
        if rpc["workers"]:
            problems.append(
                Problem(("rpc", "workers"), "is for an rpc-head; a worker lends its devices to one")
            )
    elif rpc["workers"] and role != "rpc-head":
        problems.append(
            Problem(
                ("role",),
                f"is `{role}` but rpc.workers lists {', '.join(rpc['workers'])}; set "
                "`role: rpc-head` to use them, or remove rpc.workers",
            )
        )
    elif role == "rpc-head":
        if not rpc["workers"]:
            problems.append(
                Problem(
                    ("rpc", "workers"),
                    "is empty: an rpc-head names its worker hosts from this inventory, e.g. "
                    "[worker1]",
                    in_inventory=True,
                )
            )
        if data["server"]["split_mode"] not in ("layer", "auto"):
            problems.append(
                Problem(
                    ("server", "split_mode"),
                    f"`{data['server']['split_mode']}` does not span hosts: RPC devices take "
                    "whole layers; use `layer`",
                )
            )
    return problems


def _json_problems(value: Any, key_path: tuple) -> list[Problem]:
    """What JSON cannot hold, in a setting passed as JSON: YAML's dates, sets and binary, a
    key that is not a string (`1:`, `true:`, `null:` would reach llama.cpp renamed) and a
    float that is not a number (.nan, .inf), each with its key path."""
    if isinstance(value, dict):
        problems = []
        for key, item in value.items():
            if not isinstance(key, str):
                problems.append(
                    Problem(
                        (*key_path, key),
                        f"the key {key!r} is {json_type(key)}; JSON keys are text: quote it "
                        f'("{key}")',
                    )
                )
            problems += _json_problems(item, (*key_path, key))
        return problems
    if isinstance(value, list):
        return [
            p for index, item in enumerate(value) for p in _json_problems(item, (*key_path, index))
        ]
    if isinstance(value, float) and not math.isfinite(value):
        return [Problem(key_path, f"{value} is not a number JSON can hold; give a finite number")]
    if value is None or isinstance(value, str | int | float):
        return []
    return [
        Problem(
            key_path,
            f"is {json_type(value)}, which JSON cannot hold (the value is passed to llama-server "
            "as JSON); write it as a string, number, boolean, list or mapping",
        )
    ]


def _kv_problems(server: dict, split_mode: str, backend: str) -> list[Problem]:
    """KV cache types llama.cpp refuses with these attention and split settings."""
    problems: list[Problem] = []
    type_v = server["cache_type_v"]
    if type_v not in UNQUANTIZED_KV_TYPES and server["flash_attn"] == "off":
        problems.append(
            Problem(
                ("server", "cache_type_v"),
                f"`{type_v}` is a quantized V cache, which llama.cpp refuses without flash "
                "attention (`quantized V cache requires flash_attn`), and `flash_attn` is "
                "`off`; set `flash_attn: auto` or a V type of f16, bf16 or f32",
            )
        )
    if split_mode == "tensor" and backend == "cuda":
        for key in ("cache_type_k", "cache_type_v"):
            if server[key] not in CUDA_FA_KV_TYPES:
                problems.append(
                    Problem(
                        ("server", key),
                        f"`{server[key]}` has no CUDA flash-attention kernel at the pinned "
                        "llama.cpp, and `split_mode: tensor` forces flash attention on the GPUs; "
                        f"use one of {', '.join(CUDA_FA_KV_TYPES[1:])} (q8_0 halves the KV)",
                    )
                )
    return problems


def _gpu_list_problems(gpus: list[dict]) -> list[Problem]:
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for index, gpu in enumerate(gpus):
        bus_id = gpu.get("pci_bus_id")
        if bus_id is None:
            continue
        # 0000:01:00.0, 00000000:01:00.0 and 01:00.0 are the same slot.
        slot = bus_id.lower().rsplit(":", 2)
        slot = ":".join([slot[0].lstrip("0") if len(slot) == 3 else "", *slot[-2:]])
        if slot in seen:
            problems.append(
                Problem(
                    ("gpus", index, "pci_bus_id"),
                    f"{bus_id} is also the bus id of gpus.{seen[slot]}; each GPU has its own "
                    "(nvidia-smi --query-gpu=pci.bus_id --format=csv lists them)",
                )
            )
        else:
            seen[slot] = index
    return problems
