"""The rules of one host's `server:` section that the schema cannot state: the ports it may
bind, the split and KV cache settings llama.cpp refuses together, what an API on the network
needs, speculative decoding, and the escape hatches against what the rig sets."""

from __future__ import annotations

from llamarig.config.addresses import is_loopback
from llamarig.config.paths import expand_path, local_file_text
from llamarig.config.problems import Problem
from llamarig.tables import llama_args
from llamarig.tables.llama_args import CUDA_FA_KV_TYPES

UNQUANTIZED_KV_TYPES = ("f32", "f16", "bf16")


def port_problems(server: dict, ssh: dict) -> list[Problem]:
    """The ports llama-server cannot bind: sshd's, and a privileged one under systemd."""
    problems: list[Problem] = []
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
    return problems


def split_mode_problems(server: dict, backend: str) -> list[Problem]:
    """Split modes the pinned llama.cpp refuses, or refuses with these settings."""
    split_mode = server["split_mode"]
    problems: list[Problem] = []
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
    return problems


def kv_problems(server: dict, backend: str) -> list[Problem]:
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
    if server["split_mode"] == "tensor" and backend == "cuda":
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


def tensor_split_problems(data: dict) -> list[Problem]:
    """A split gives one share per declared GPU, some of them non-zero, and only to GPUs."""
    split, gpus = data["server"]["tensor_split"], data["gpus"]
    problems: list[Problem] = []
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
    if split is not None and data["llama_cpp"]["backend"] == "cpu" and data["role"] != "rpc-head":
        problems.append(
            Problem(("server", "tensor_split"), "applies to GPUs only; set null for a cpu build")
        )
    return problems


def ctx_problems(server: dict, backend: str) -> list[Problem]:
    """`ctx: auto` is the largest context that fits the GPUs, which a cpu build has none of."""
    if server["ctx"] == "auto" and backend == "cpu":
        return [
            Problem(("server", "ctx"), "`auto` plans GPU memory; give a number for a cpu build")
        ]
    return []


def api_key_problems(server: dict) -> list[Problem]:
    """An API on the network needs a key, and a key file names a file that holds one."""
    problems: list[Problem] = []
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
    return problems


def spec_problems(spec: dict) -> list[Problem]:
    """`server.spec`: `none` stands alone, and a draft length needs a type to draft with."""
    problems: list[Problem] = []
    if "none" in spec["type"] and len(spec["type"]) > 1:
        problems.append(
            Problem(
                ("server", "spec", "type"),
                "`none` cannot be combined with other types; use [] for no speculative decoding",
            )
        )
    if spec["draft_max"] is not None and not spec["type"]:
        problems.append(
            Problem(
                ("server", "spec", "draft_max"),
                "has no effect without `spec.type`; "
                "set a type such as [ngram-mod] or remove draft_max",
            )
        )
    return problems


def escape_hatch_problems(data: dict) -> list[Problem]:
    """`server.extra_args` and `server.env`, against what the rig sets. The escape hatches are
    the router's on a rig of several models: a model's own sampling is guarded there too."""
    server = data["server"]
    sampling = dict(server["sampling"])
    for entry in data.get("models") or []:
        sampling.update((entry.get("server") or {}).get("sampling") or {})
    found = [
        *llama_args.extra_args_problems(server["extra_args"], sampling),
        *llama_args.env_problems(server["env"], sampling),
    ]
    return [Problem(*problem) for problem in found]
