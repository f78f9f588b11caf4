"""The models a rig serves: the one of `model:`, or each entry of `models:` (llama-server's
router mode) seen as the one-model rig data the rest of llamarig already plans, fetches, checks
and asks (`ModelView.data`), so every model goes through the same code as a one-model rig."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from llamarig.model.files import model_filename

# What a model's `name` may be (schema.json says the same): clients send it as `model`, and it
# names a section of llama.cpp's presets file.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# What an entry of `models:` takes of `model:` (how the model is named and fetched).
MODEL_KEYS = (
    "url",
    "path",
    "sha256",
    "filename",
    "hf",
    "file",
    "quant",
    "revision",
    "endpoint",
    "token_file",
    "rehash",
)
# The server settings a model may set for itself: what llama.cpp's router takes per preset.
# The listen address, key, threads, metrics and the escape hatches stay the router's.
SERVER_KEYS = (
    "ctx",
    "allow_ctx_beyond_trained",
    "split_mode",
    "tensor_split",
    "gpu_layers",
    "flash_attn",
    "cache_type_k",
    "cache_type_v",
    "kv_unified",
    "backend_sampling",
    "parallel",
    "batch",
    "ubatch",
    "spec",
    "chat_template_kwargs",
    "sampling",
)


@dataclass(frozen=True)
class ModelView:
    """One model of a router rig: its entry's index and name, and the rig data as if it were
    the rig's one model (its own server settings over the rig's, its own answers)."""

    index: int
    name: str
    data: dict
    load_on_startup: bool


def is_router(data: dict) -> bool:
    """True for a rig of several models (`models:`), served by llama-server's router."""
    return bool(data.get("models"))


def model_views(data: dict) -> list[ModelView]:
    """Each entry of ``data``'s `models:` as a one-model rig's data (none for a one-model rig)."""
    base = {key: value for key, value in data.items() if key != "models"}
    views = []
    for index, entry in enumerate(data.get("models") or []):
        view = copy.deepcopy(base)
        view["models"] = []
        view["model"].update({key: entry[key] for key in MODEL_KEYS if key in entry})
        own = copy.deepcopy(entry.get("server") or {})
        for merged in ("spec", "sampling"):  # a model's own keys over the rig's
            if merged in own:
                own[merged] = {**view["server"][merged], **own[merged]}
        view["server"].update(own)
        view["server"]["alias"] = entry["name"]
        view["expect"]["answers"] = copy.deepcopy((entry.get("expect") or {}).get("answers", []))
        views.append(ModelView(index, entry["name"], view, bool(entry.get("load_on_startup"))))
    return views


def with_views(data: dict, views: list[ModelView]) -> dict:
    """``data`` with each entry of `models:` taking what its view now holds: the model as
    resolved (a Hugging Face reference's URL and sha256) and the server settings as planned."""
    out = copy.deepcopy(data)
    for view in views:
        entry = out["models"][view.index]
        entry.update({key: view.data["model"][key] for key in MODEL_KEYS})
        entry["server"] = {key: copy.deepcopy(view.data["server"][key]) for key in SERVER_KEYS}
    return out


def served_data(data: dict) -> list[dict]:
    """The one-model rig data of every model ``data`` serves: its views, or ``data`` itself."""
    return [view.data for view in model_views(data)] if is_router(data) else [data]


# A quantization as GGUF file names carry it: Q4_1, Q4_K_M, IQ2_XXS, Q8_0, F16, BF16, MXFP4 ...
_QUANT_SUFFIX = re.compile(
    r"[-._](?:I?Q\d(?:_[0-9A-Z]+)*|[BM]?F(?:16|32)|MXFP4|TQ\d_\d)$", re.IGNORECASE
)


def model_alias(data: dict) -> str:
    """The model's name for clients: ``server.alias``, else the Hugging Face repo's name
    without ``-GGUF``, else the model file's name without ``.gguf``, its shard number and its
    quantization; characters outside letters, digits and ``._-`` become ``-`` (llama-server
    splits aliases at commas)."""
    if data["server"]["alias"]:
        return data["server"]["alias"]
    model = data["model"]
    if model.get("hf"):
        name = re.sub(r"[-_.]gguf$", "", model["hf"].rsplit("/", 1)[-1], flags=re.IGNORECASE)
    else:
        name = re.sub(r"\.gguf$", "", model_filename(data), flags=re.IGNORECASE)
        name = re.sub(r"-\d{5}-of-\d{5}$", "", name)
        name = _QUANT_SUFFIX.sub("", name)
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-._")
    return name[:128] or "model"
