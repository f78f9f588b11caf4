"""The rules of one host's settings that the schema cannot state: what must be given
together, what contradicts the role, the backend or llama.cpp, and values JSON cannot hold.
The hardware-facing contradictions live in `contradictions`, the version rules in `versions`."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from llamarig.config.addresses import WILDCARD_HOSTS, is_loopback
from llamarig.config.contradictions import contradiction_problems
from llamarig.config.expect import answer_problems
from llamarig.config.model_rules import model_problems
from llamarig.config.numbers import number_problems
from llamarig.config.paths import expand_path, local_file_text
from llamarig.config.problems import Problem, json_type
from llamarig.config.shapes import shape_problems
from llamarig.config.versions import version_problems
from llamarig.model.catalog import is_router, model_views
from llamarig.model.files import model_files
from llamarig.tables import llama_args
from llamarig.tables.llama_args import CUDA_FA_KV_TYPES

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

    problems += _models_problems(data) if is_router(data) else model_problems(data)

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
    # The escape hatches are the router's on a rig of several models: a model's own sampling
    # is guarded there too.
    sampling = dict(server["sampling"])
    for entry in data.get("models") or []:
        sampling.update((entry.get("server") or {}).get("sampling") or {})
    problems += [
        Problem(*problem)
        for problem in llama_args.extra_args_problems(server["extra_args"], sampling)
    ]
    problems += [Problem(*problem) for problem in llama_args.env_problems(server["env"], sampling)]
    problems += contradiction_problems(data)
    problems += number_problems(data)
    problems += answer_problems(data)
    if not is_router(data):
        problems += [
            Problem(("server", key), "has no effect without `models:` (several models); remove it")
            for key in ROUTER_KEYS
            if server[key] is not None
        ]
    return problems


# What llama.cpp's preset INI cannot carry in a value: it ends a value at ; or # (a comment)
# and at a line break, and has no quoting.
PRESET_UNSAFE = re.compile(r"[;#\r\n]")


def _preset_problems(index: int, data: dict) -> list[Problem]:
    """The values of one model's preset section that llama.cpp's INI parser would cut: its
    file's path and its chat template arguments (the others are numbers and fixed words)."""
    problems = []
    for file in model_files(data)[:1]:
        if PRESET_UNSAFE.search(file.dest):
            key = "path" if data["model"]["path"] else "filename"
            problems.append(
                Problem(
                    ("models", index, key),
                    f"{file.dest!r} holds ; or #, which llama.cpp's presets file reads as a "
                    "comment: give the file a name without them",
                )
            )
    kwargs = json.dumps(data["server"]["chat_template_kwargs"])
    if PRESET_UNSAFE.search(kwargs):
        problems.append(
            Problem(
                ("models", index, "server", "chat_template_kwargs"),
                "holds ; or # (or a line break), which llama.cpp's presets file cannot carry: "
                "leave them out of the values",
            )
        )
    return problems


# The rig-wide settings of a router rig (`models:`).
ROUTER_KEYS = ("models_max", "idle_unload_seconds")


def _models_problems(data: dict) -> list[Problem]:
    """A router rig's own rules, then each entry of `models:` checked as a one-model rig is,
    its problems named by the entry's key path."""
    problems = []
    model, server = data["model"], data["server"]
    given = [key for key in ("url", "path", "hf") if model[key]]
    if given:
        problems.append(
            Problem(
                ("model", given[0]),
                "a rig serves `model:` or `models:`, not both: move this model into `models:` "
                "as an entry with a `name`",
            )
        )
    if data["role"] != "standalone":
        # Its entries are not checked further: a worker's model is never checked or fetched.
        return problems + [
            Problem(
                ("models",),
                f"an {data['role']} serves one model: `models:` is for a "
                "standalone rig (role: standalone)",
            )  # fmt: skip
        ]
    if server["supervisor"] != "systemd":
        problems.append(
            Problem(
                ("server", "supervisor"),
                "is none, but several models are served by llama-server's router, which "
                "llamarig runs under systemd only: set supervisor: systemd or serve one `model:`",
            )
        )
    if server["alias"] is not None:
        problems.append(
            Problem(
                ("server", "alias"),
                "names the one model of a rig; with `models:` each entry's `name` is what "
                "clients send: remove server.alias",
            )
        )
    if data["expect"]["answers"]:
        problems.append(
            Problem(
                ("expect", "answers"),
                "with `models:` an answer is asked of one model: move each under the model it "
                "asks, as models[N].expect.answers",
            )
        )
    names: dict[str, int] = {}
    files: dict[str, tuple[int, object]] = {}
    tokens: dict[str, int] = {}
    for view in model_views(data):
        entry = data["models"][view.index]
        if view.name in names:
            problems.append(
                Problem(
                    ("models", view.index, "name"),
                    f"{view.name!r} is also models[{names[view.name]}]'s name: clients pick a "
                    "model by its name, so each must be unique",
                )
            )
        names.setdefault(view.name, view.index)
        # What the rig's own settings cause (named by the rig's own check) is not the entry's.
        plain = {**entry, "server": {}}
        (rig_view,) = model_views({**data, "models": [plain]})
        rig_caused = {(p.path, p.message) for p in semantic_problems(rig_view.data)}
        for problem in semantic_problems(view.data):
            path = problem.path
            if path[:1] == ("model",):
                path = ("models", view.index, *path[1:])
            elif path[:2] == ("expect", "answers"):
                path = ("models", view.index, *path)
            elif (path, problem.message) in rig_caused:
                continue
            elif path[:1] == ("server",) and path[1:2] and path[1] in (entry.get("server") or {}):
                path = ("models", view.index, *path)
            else:
                path = ("models", view.index, "server")  # the entry's settings with the rig's
            problems.append(Problem(path, problem.message, problem.in_inventory))
        if any(p.path[:2] == ("models", view.index) for p in problems):
            continue
        problems += _preset_problems(view.index, view.data)
        token = view.data["model"]["token_file"]
        if token and tokens and token not in tokens:
            problems.append(
                Problem(
                    ("models", view.index, "token_file"),
                    f"differs from models[{next(iter(tokens.values()))}]'s: the host keeps one "
                    "Hugging Face token, so the models of a rig share one token_file",
                )
            )
        if token:
            tokens.setdefault(token, view.index)
        for file in model_files(view.data):
            earlier = files.setdefault(file.dest, (view.index, file.sha256))
            if earlier[0] != view.index and earlier[1] != file.sha256:
                problems.append(
                    Problem(
                        ("models", view.index),
                        f"its file {file.dest} is also models[{earlier[0]}]'s, with another "
                        "sha256: give one of them another `filename`",
                    )
                )
    return problems + _startup_problems(data)


def _startup_problems(data: dict) -> list[Problem]:
    """The models loaded at startup must fit under `models_max`: the router holds at most
    that many at once, so loading one more at startup unloads another (the plan would count
    a set of models that is never loaded together)."""
    most = data["server"]["models_max"]
    startup = [view.name for view in model_views(data) if view.load_on_startup]
    if most is None or len(startup) <= most:
        return []
    return [
        Problem(
            ("server", "models_max"),
            f"{most}, but {len(startup)} models load at startup ({', '.join(startup)}): the "
            f"router holds at most {most} at once, so loading one unloads another; raise "
            f"models_max to at least {len(startup)}, or set load_on_startup: false on some",
        )
    ]


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
