"""The rules of one host's settings that the schema cannot state: what must be given
together, what contradicts the role, the backend or llama.cpp, and values JSON cannot hold.
The `server:` section's rules live in `server_rules`, the hardware-facing contradictions in
`contradictions`, the version rules in `versions`."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from llamarig.config.addresses import WILDCARD_HOSTS
from llamarig.config.builders import settings_problems as builder_settings_problems
from llamarig.config.contradictions import contradiction_problems
from llamarig.config.expect import answer_problems
from llamarig.config.model_rules import model_problems
from llamarig.config.numbers import number_problems
from llamarig.config.problems import Problem, json_type
from llamarig.config.server_rules import (
    api_key_problems,
    ctx_problems,
    escape_hatch_problems,
    kv_problems,
    port_problems,
    spec_problems,
    split_mode_problems,
    tensor_split_problems,
)
from llamarig.config.shapes import shape_problems
from llamarig.config.versions import version_problems
from llamarig.model.catalog import ModelView, is_router, model_views
from llamarig.model.files import model_files


def semantic_problems(data: dict) -> list[Problem]:
    """Cross-field rules the schema cannot state, each a Problem (blaming the inventory when
    the fix is to add a setting the defaults leave empty), section by section."""
    server, backend = data["server"], data["llama_cpp"]["backend"]
    ssh = data.get("ssh") or {}
    if data["role"] == "gateway":  # no model, build or server of its own: only the gateway's
        return [*_ssh_problems(ssh), *(Problem(*problem) for problem in shape_problems(data))]
    if data["role"] == "builder":  # builds for the rigs: no model, server or GPU of its own
        return [
            *_ssh_problems(ssh),
            *builder_settings_problems(data),
            *(Problem(*problem) for problem in shape_problems(data)),
        ]
    return [
        *_ssh_problems(ssh),
        *port_problems(server, ssh),
        *(_models_problems(data) if is_router(data) else model_problems(data)),
        *split_mode_problems(server, backend),
        *kv_problems(server, backend),
        *tensor_split_problems(data),
        *ctx_problems(server, backend),
        *api_key_problems(server),
        *spec_problems(server["spec"]),
        *_cuda_backend_problems(data),
        *_gpu_list_problems(data["gpus"]),
        *_json_problems(server["chat_template_kwargs"], ("server", "chat_template_kwargs")),
        *_rpc_role_problems(data),
        *(Problem(*problem) for problem in shape_problems(data)),
        # The escape hatches, and settings that contradict each other, llama.cpp or the
        # hardware.
        *escape_hatch_problems(data),
        *contradiction_problems(data),
        *number_problems(data),
        *answer_problems(data),
        *_router_key_problems(data),
    ]


def _ssh_problems(ssh: dict) -> list[Problem]:
    """A host is reached over SSH at `ssh.host`, or is this machine (`ssh.local`): one of them."""
    if not ssh.get("local") and not ssh.get("host"):
        return [
            Problem(
                ("ssh", "host"),
                "is missing: give the address sshd listens on (and usually `port`, `user`, "
                "`key`, `known_hosts`), or set `ssh.local: true` to converge this machine",
                in_inventory=True,
            )
        ]
    if ssh.get("local") and ssh.get("host"):
        return [
            Problem(
                ("ssh", "local"),
                "`local: true` converges this machine, yet `host` names another; "
                "remove one of them",
            )
        ]
    return []


def _cuda_backend_problems(data: dict) -> list[Problem]:
    """A cuda build needs a toolkit, a driver and the GPUs to build for, at versions that fit."""
    if data["llama_cpp"]["backend"] != "cuda":
        return []
    problems: list[Problem] = []
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
    listed = data["llama_cpp"]["cuda_architectures"]
    if listed in ("auto", "fleet") and not data["gpus"]:
        problems.append(
            Problem(
                ("llama_cpp", "cuda_architectures"),
                f"`{listed}` needs the `gpus` "
                'list; declare the GPUs or give a list such as "86-real;120a-real" '
                "(a build host's own GPUs are not the target's)",
            )
        )
    return problems + version_problems(data)


def _router_key_problems(data: dict) -> list[Problem]:
    """The router's settings on a one-model rig."""
    if is_router(data):
        return []
    return [
        Problem(("server", key), "has no effect without `models:` (several models); remove it")
        for key in ROUTER_KEYS
        if data["server"][key] is not None
    ]


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
    given = [key for key in ("url", "path", "hf") if data["model"][key]]
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
    return [
        *problems,
        *_router_rig_problems(data),
        *_model_entries_problems(data),
        *_startup_problems(data),
    ]


def _router_rig_problems(data: dict) -> list[Problem]:
    """The rig-wide settings that serve one model, on a rig of several."""
    server = data["server"]
    problems = []
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
    return problems


def _model_entries_problems(data: dict) -> list[Problem]:
    """Each entry of `models:` on its own, then (when it has no problem of its own) against the
    entries before it: what the router's presets file and the host share between them."""
    problems: list[Problem] = []
    names: dict[str, int] = {}
    files: dict[str, tuple[int, object]] = {}
    tokens: dict[str, int] = {}
    for view in model_views(data):
        own = [*_name_problems(view, names), *_entry_problems(data, view)]
        problems += own
        if own:
            continue
        problems += _preset_problems(view.index, view.data)
        problems += _token_file_problems(view, tokens)
        problems += _shared_file_problems(view, files)
    return problems


def _name_problems(view: ModelView, names: dict[str, int]) -> list[Problem]:
    """Clients pick a model by its name: ``names`` holds each name seen, with its entry."""
    if view.name not in names:
        names[view.name] = view.index
        return []
    return [
        Problem(
            ("models", view.index, "name"),
            f"{view.name!r} is also models[{names[view.name]}]'s name: clients pick a "
            "model by its name, so each must be unique",
        )
    ]


def _entry_problems(data: dict, view: ModelView) -> list[Problem]:
    """The problems of one entry checked as a one-model rig, named by the entry's key path;
    what the rig's own settings cause (named by the rig's own check) is not the entry's."""
    entry = data["models"][view.index]
    plain = {**entry, "server": {}}
    (rig_view,) = model_views({**data, "models": [plain]})
    rig_caused = {(p.path, p.message) for p in semantic_problems(rig_view.data)}
    problems = []
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
    return problems


def _token_file_problems(view: ModelView, tokens: dict[str, int]) -> list[Problem]:
    """The host keeps one Hugging Face token: ``tokens`` holds the token_file of the entries
    before, with the first entry that named it."""
    token = view.data["model"]["token_file"]
    if not token:
        return []
    problems = []
    if tokens and token not in tokens:
        problems.append(
            Problem(
                ("models", view.index, "token_file"),
                f"differs from models[{next(iter(tokens.values()))}]'s: the host keeps one "
                "Hugging Face token, so the models of a rig share one token_file",
            )
        )
    tokens.setdefault(token, view.index)
    return problems


def _shared_file_problems(view: ModelView, files: dict[str, tuple[int, object]]) -> list[Problem]:
    """Two entries may share a file only if it is the same file: ``files`` holds each file of
    the entries before, with its entry and sha256."""
    problems = []
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
    return problems


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
