"""llama-server options that llamarig plans or guards, and the rig key that sets each.

`server.extra_args` and `server.env` are escape hatches for what llamarig does not plan (sampling,
templates, logging). An option of the table below, given there, would override the plan - the
user's arguments come last and llama.cpp keeps the last value, and a ``LLAMA_ARG_*`` variable
sets an option the plan left at its default - or would put a secret in argv and in the unit and
environment file, which every user of the host can read. Both are refused with the key to set.

Spellings and variables are those of the pinned llama.cpp (common/arg.cpp: each option's names,
its ``--no-...`` negations and ``.set_env(...)``, plus the ``LLAMA_ARG_NO_*`` variable that
get_env() adds for a negatable option); llama.cpp reads ``--name_with_underscores`` as
``--name-with-underscores`` and does not split ``--name=value``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MODEL_FROM_URL = (
    "would make llama-server fetch a model past llamarig's download and checksum: set "
    "`model.url` to the file's https://huggingface.co/OWNER/REPO/resolve/main/FILE.gguf "
    "with `model.sha256`"
)


@dataclass(frozen=True)
class Guarded:
    """One llama-server option: every spelling and variable, and the fix (after `--flag`)."""

    flags: tuple[str, ...]
    env: tuple[str, ...]
    fix: str


GUARDED = (
    Guarded(
        ("-m", "--model"),
        ("LLAMA_ARG_MODEL",),
        "is planned from `model`: set `model.path` (a file on the host) or `model.url` "
        "with `model.sha256`",
    ),
    Guarded(
        ("-mu", "--model-url"),
        ("LLAMA_ARG_MODEL_URL",),
        "is planned from `model`: set `model.url` with `model.sha256` (llamarig downloads "
        "and checks it)",
    ),
    Guarded(
        ("-hf", "-hfr", "--hf-repo", "-hff", "--hf-file", "-dr", "--docker-repo"),
        ("LLAMA_ARG_HF_REPO", "LLAMA_ARG_HF_FILE", "LLAMA_ARG_DOCKER_REPO"),
        _MODEL_FROM_URL,
    ),
    Guarded(
        ("-hft", "--hf-token"),
        ("HF_TOKEN",),
        "is a secret that would be readable in argv and in the unit on the host; llamarig "
        "downloads `model.url` itself, so llama-server needs no token",
    ),
    Guarded(
        ("--host",),
        ("LLAMA_ARG_HOST",),
        "is planned from `server.host`: set `server.host` (a non-loopback host needs "
        "`server.api_key_file`)",
    ),
    Guarded(("--port",), ("LLAMA_ARG_PORT",), "is planned from `server.port`: set `server.port`"),
    Guarded(
        ("--api-key", "--api-key-file"),
        ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE"),
        "would put the API key (or its path) in argv and in the unit, which every user of "
        "the host can read: set `server.api_key_file` (the host gets the key as a systemd "
        "credential)",
    ),
    Guarded(
        ("-c", "--ctx-size"),
        ("LLAMA_ARG_CTX_SIZE",),
        "is planned from `server.ctx`: set `server.ctx` (a number or auto)",
    ),
    Guarded(
        ("-np", "--parallel"),
        ("LLAMA_ARG_N_PARALLEL",),
        "is planned from `server.parallel`: set `server.parallel`",
    ),
    Guarded(
        ("-b", "--batch-size"),
        ("LLAMA_ARG_BATCH",),
        "is planned from `server.batch`: set `server.batch`",
    ),
    Guarded(
        ("-ub", "--ubatch-size"),
        ("LLAMA_ARG_UBATCH",),
        "is planned from `server.ubatch`: set `server.ubatch`",
    ),
    Guarded(
        ("-ctk", "--cache-type-k"),
        ("LLAMA_ARG_CACHE_TYPE_K",),
        "is planned from `server.cache_type_k`: set `server.cache_type_k`",
    ),
    Guarded(
        ("-ctv", "--cache-type-v"),
        ("LLAMA_ARG_CACHE_TYPE_V",),
        "is planned from `server.cache_type_v`: set `server.cache_type_v`",
    ),
    Guarded(
        ("-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified"),
        ("LLAMA_ARG_KV_UNIFIED", "LLAMA_ARG_NO_KV_UNIFIED"),
        "is planned from `server.kv_unified`: set `server.kv_unified: true` or `false`",
    ),
    Guarded(
        ("-bs", "--backend-sampling"),
        ("LLAMA_ARG_BACKEND_SAMPLING",),
        "is planned from `server.backend_sampling`: set `server.backend_sampling: true`",
    ),
    Guarded(
        ("-fa", "--flash-attn"),
        ("LLAMA_ARG_FLASH_ATTN",),
        'is planned from `server.flash_attn`: set `server.flash_attn` ("on", "off" or auto)',
    ),
    Guarded(
        ("-fit", "--fit", "-fitt", "--fit-target", "-fitc", "--fit-ctx"),
        ("LLAMA_ARG_FIT", "LLAMA_ARG_FIT_TARGET", "LLAMA_ARG_FIT_CTX"),
        "would let llama-server resize what llamarig planned (and tensor mode has no --fit): "
        "size the server with `server.ctx` (or auto), `server.gpu_layers` and "
        "`planner.margin_mib`",
    ),
    Guarded(
        ("-lm", "--load-mode"),
        ("LLAMA_ARG_LOAD_MODE",),
        "is planned from `server.load_mode`: set `server.load_mode`",
    ),
    Guarded(
        ("--no-mmap",),
        (),
        "is gone from the pinned llama.cpp (it is `-lm none` now), and the load mode is "
        "planned: set `server.load_mode: none`",
    ),
    Guarded(
        ("--mmap",),
        (),
        "is gone from the pinned llama.cpp (it is `-lm mmap` now), and the load mode is "
        "planned: set `server.load_mode: mmap`",
    ),
    Guarded(
        ("--mlock",),
        (),
        "is gone from the pinned llama.cpp (it is `-lm mlock` now), and the load mode is "
        "planned: set `server.load_mode: mlock` (or mmap+mlock)",
    ),
    Guarded(
        ("-ngl", "--gpu-layers", "--n-gpu-layers"),
        ("LLAMA_ARG_N_GPU_LAYERS",),
        "is planned from `server.gpu_layers`: set `server.gpu_layers` (all, auto or a number)",
    ),
    Guarded(
        ("-sm", "--split-mode"),
        ("LLAMA_ARG_SPLIT_MODE",),
        "is planned from `server.split_mode`: set `server.split_mode`",
    ),
    Guarded(
        ("-ts", "--tensor-split"),
        ("LLAMA_ARG_TENSOR_SPLIT",),
        "is planned from `server.tensor_split`: set `server.tensor_split` (one share per GPU, "
        "in `gpus` order)",
    ),
    Guarded(
        ("-mg", "--main-gpu"),
        ("LLAMA_ARG_MAIN_GPU",),
        "picks a GPU behind llamarig's --device list: with `server.split_mode: none` the first "
        "GPU of `gpus` serves; list the one you want first",
    ),
    Guarded(
        ("-dev", "--device"),
        ("LLAMA_ARG_DEVICE",),
        "is planned from `gpus` (in their order; a 0 share in `server.tensor_split` leaves a "
        "card out): declare the GPUs there",
    ),
    Guarded(
        ("--rpc",),
        ("LLAMA_ARG_RPC",),
        "is planned from `rpc.workers`: set `role: rpc-head` and name the worker hosts there "
        "(their rpc.host and rpc.port)",
    ),
    Guarded(
        ("-t", "--threads"),
        ("LLAMA_ARG_THREADS",),
        "is planned from `server.threads`: set `server.threads`",
    ),
    Guarded(
        ("--spec-type",),
        ("LLAMA_ARG_SPEC_TYPE",),
        "is planned from `server.spec.type`: set `server.spec.type` (e.g. [ngram-mod])",
    ),
    Guarded(
        ("--spec-draft-n-max", "--draft", "--draft-n", "--draft-max"),
        ("LLAMA_ARG_SPEC_DRAFT_N_MAX", "LLAMA_ARG_DRAFT_MAX"),
        "is planned from `server.spec.draft_max` (the pinned llama.cpp spells it "
        "--spec-draft-n-max): set `server.spec.draft_max`",
    ),
    Guarded(
        ("--chat-template-kwargs",),
        ("LLAMA_ARG_CHAT_TEMPLATE_KWARGS",),
        "is planned from `server.chat_template_kwargs`: set it as a mapping, e.g. "
        "{enable_thinking: false}",
    ),
    Guarded(
        ("-a", "--alias"),
        ("LLAMA_ARG_ALIAS",),
        "is planned from `server.alias` (the model's name for clients): set `server.alias`",
    ),
    Guarded(
        ("--metrics",),
        ("LLAMA_ARG_ENDPOINT_METRICS",),
        "is planned from `server.metrics`: set `server.metrics: true`",
    ),
)

GUARDED_FLAGS = {flag: entry for entry in GUARDED for flag in entry.flags}
GUARDED_ENV = {name: entry for entry in GUARDED for name in entry.env}

# `server.sampling`: each key's llama-server option (its every spelling and variable; the
# first flag is the one rendered), in the order the command line carries them. An option is
# planned, and so refused in the escape hatches, only where the rig sets its key.
SAMPLING = {
    key: Guarded(flags, env, f"is planned from `server.sampling.{key}`: set it there only")
    for key, flags, env in (
        ("temperature", ("--temp", "--temperature"), ("LLAMA_ARG_TEMPERATURE",)),
        ("top_k", ("--top-k",), ("LLAMA_ARG_TOP_K",)),
        ("top_p", ("--top-p",), ("LLAMA_ARG_TOP_P",)),
        ("min_p", ("--min-p",), ("LLAMA_ARG_MIN_P",)),
        ("repeat_penalty", ("--repeat-penalty",), ("LLAMA_ARG_REPEAT_PENALTY",)),
        ("presence_penalty", ("--presence-penalty",), ("LLAMA_ARG_PRESENCE_PENALTY",)),
        ("frequency_penalty", ("--frequency-penalty",), ("LLAMA_ARG_FREQUENCY_PENALTY",)),
    )
}


def _planned_sampling(sampling: dict) -> list[Guarded]:
    """The sampling options ``sampling`` (a rig's server.sampling) sets."""
    return [SAMPLING[key] for key, value in sampling.items() if value is not None]


def _guarded_flags(sampling: dict) -> dict[str, Guarded]:
    """Every planned option by its spellings: GUARDED's, and those ``sampling`` sets."""
    planned = _planned_sampling(sampling)
    return GUARDED_FLAGS | {flag: entry for entry in planned for flag in entry.flags}


def _guarded_env(sampling: dict) -> dict[str, Guarded]:
    """Every planned option by its variables: GUARDED's, and those ``sampling`` sets."""
    planned = _planned_sampling(sampling)
    return GUARDED_ENV | {name: entry for entry in planned for name in entry.env}


# Variables the unit's environment gets from llamarig itself (render.service_environment).
RIG_ENV = {
    "HOME": "is the unit's state directory, set by llamarig (/var/lib/SERVICE)",
    "LLAMA_CACHE": "is the unit's cache directory, set by llamarig (/var/cache/SERVICE)",
    "CUDA_DEVICE_ORDER": (
        "is set by llamarig to PCI_BUS_ID, so that --device and -ts follow `gpus` as "
        "nvidia-smi numbers them"
    ),
    "CUDA_VISIBLE_DEVICES": (
        "would renumber the GPUs under llamarig's --device list: choose the GPUs with `gpus` "
        "(a 0 share in `server.tensor_split` leaves a card out)"
    ),
    "XDG_CONFIG_HOME": (
        "would point llama-server at a config.ini of its own (common/arg.cpp reads "
        "${XDG_CONFIG_HOME}/llama.cpp/config.ini before the environment and the command line), "
        "which can set options llamarig leaves unset (--rpc, -dev, -ts, -t): set them as rig keys"
    ),
}
SECRET_SUFFIXES = ("_TOKEN", "_KEY", "_SECRET", "_PASSWORD")
# Upper case: env names are case-sensitive, but `hf_token` is as much a secret as `HF_TOKEN`.
SECRETS = ("PASSWORD", "TOKEN", "SECRET", "API_KEY")

# An argument that is an option name (values such as -1 or 0.5 are not).
_OPTION = re.compile(r"^--?[A-Za-z]")


def option_name(arg: str) -> str:
    """The option an argument names, as llama.cpp looks it up: ``--api_key`` is
    ``--api-key``; ``--host=0.0.0.0`` names ``--host`` (llama.cpp itself would refuse it)."""
    name = re.split(r"[=\s]", arg, maxsplit=1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


def extra_args_problems(extra_args: list[str], sampling: dict) -> list[tuple]:
    """(key path, message) for each argument of `server.extra_args` that overrides the plan
    (``sampling``: the rig's server.sampling) or that llama-server would not read as meant."""
    problems: list[tuple] = []
    guarded = _guarded_flags(sampling)
    for index, arg in enumerate(extra_args):
        if not _OPTION.match(arg):
            continue
        key_path = ("server", "extra_args", index)
        name = option_name(arg)
        entry = guarded.get(name)
        if entry:
            spelled = f"`{arg}`" if arg == name else f"`{arg}` (that is `{name}`)"
            problems.append((key_path, f"{spelled} {entry.fix}"))
        elif re.search(r"\s", arg):
            flag, value = arg.split(None, 1)
            problems.append(
                (
                    key_path,
                    f"{arg!r} is an option and its value in one string, which llama-server "
                    f'reads as one unknown option; give them as two items: [{flag}, "{value}"]',
                )
            )
        elif "=" in arg:
            flag, value = arg.split("=", 1)
            problems.append(
                (
                    key_path,
                    f"{arg!r}: llama-server does not split --option=value (it exits with "
                    f'`invalid argument`); give them as two items: [{flag}, "{value}"]',
                )
            )
    return problems


def env_problems(env: dict, sampling: dict) -> list[tuple]:
    """(key path, message) for each variable of `server.env` that sets a planned option
    (``sampling``: the rig's server.sampling), carries a secret, or is llamarig's own."""
    problems: list[tuple] = []
    guarded = _guarded_env(sampling)
    for name in env:
        key_path = ("server", "env", name)
        entry = guarded.get(name)
        if entry:
            options = "/".join(flag for flag in entry.flags if flag.startswith("--"))
            problems.append(
                (key_path, f"is llama-server's variable for {options}, which {entry.fix}")
            )
        elif name in RIG_ENV:
            problems.append((key_path, f"{RIG_ENV[name]}; remove it from `server.env`"))
        elif name.upper().endswith(SECRET_SUFFIXES) or name.upper() in SECRETS:
            problems.append(
                (
                    key_path,
                    "looks like a secret, and `server.env` lands in the environment file and "
                    "the unit on the host, which every user there can read (and in pyinfra's "
                    "output): keep secrets out of the rig data (the API key goes in "
                    "`server.api_key_file`)",
                )
            )
    return problems


# KV cache types the CUDA backend has a flash-attention kernel for at the pinned llama.cpp
# (ggml_cuda_fattn_kv_type_supported in ggml-cuda/fattn.cu; f32 is converted to f16): tensor
# mode forces flash attention on, so it needs one of these.
CUDA_FA_KV_TYPES = ("f32", "f16", "bf16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
