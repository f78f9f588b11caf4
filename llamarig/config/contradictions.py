"""Settings that contradict each other, llama.cpp or the hardware: each rule
refuses one kind of setting that cannot work as written."""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import PurePosixPath

from llamarig.config.problems import Problem, shown
from llamarig.config.versions import driver_branch_problems
from llamarig.tables import hardware
from llamarig.tables.packages import DKMS_SOURCES

# llama.cpp's most sequences per context (LLAMA_MAX_SEQ, src/llama-cparams.h at the pinned
# commit): `-np` above it fails at context creation (n_seq_max > 256).
LLAMA_MAX_SEQ = 256
# More MiB than any GPU has (the largest in the hardware table has about 180 GiB): a vram_mib
# above it was written in bytes or KiB.
MAX_PLAUSIBLE_VRAM_MIB = 4 << 20
# CMake cache entries llamarig derives, and the rig key that sets each.
DERIVED_CMAKE_OPTIONS = {
    "GGML_CUDA": "`llama_cpp.backend` (cuda or cpu)",
    "GGML_NATIVE": (
        "`llama_cpp.cuda_architectures` (llamarig turns GGML_NATIVE off: the build host's own "
        "GPUs are not the target's)"
    ),
    "CMAKE_CUDA_ARCHITECTURES": "`llama_cpp.cuda_architectures`",
    "CMAKE_CUDA_COMPILER": "`cuda.nvcc` (or `cuda.version` with `nvcc: auto`)",
    "GGML_RPC": "`role` (rpc-head and rpc-worker build with RPC)",
    "GGML_CCACHE": "`llama_cpp.ccache`",
}
_TOOLKIT_NVCC = re.compile(r"/cuda-(\d+\.\d+)/")


def contradiction_problems(data: dict) -> list[Problem]:
    """Each rule below refuses one kind of setting that cannot work as written."""
    return [
        *_split_mode_none_problems(data["server"]),
        *_secure_boot_problems(data["driver"]),
        *_parallel_problems(data["server"]),
        *_gpu_table_problems(data["gpus"]),
        *driver_branch_problems(data),
        *_cuda_architecture_problems(data),
        *_cmake_option_problems(data["llama_cpp"]["cmake_options"]),
        *_target_problems(data),
        *_nvcc_problems(data),
        *_model_location_problems(data),
        *_rpc_address_problems(data),
    ]


def _split_mode_none_problems(server: dict) -> list[Problem]:
    """One GPU serves with `split_mode: none`: a split over several contradicts it (a list
    with one non-zero share only picks that card)."""
    split = server["tensor_split"]
    if server["split_mode"] == "none" and split == "auto":
        return [
            Problem(
                ("server", "tensor_split"),
                "`auto` plans a split over GPUs, but `split_mode: none` serves from one (the "
                "first of `gpus`): remove tensor_split (null), or set `split_mode: auto`",
            )
        ]
    if server["split_mode"] != "none" or not isinstance(split, list):
        return []
    if sum(1 for share in split if share) < 2:
        return []
    return [
        Problem(
            ("server", "tensor_split"),
            f"{shown(split)} splits the model over GPUs, but `split_mode: none` serves from "
            "one (the first of `gpus`): remove tensor_split (null), or set `split_mode: layer` "
            "or `tensor`",
        )
    ]


def _secure_boot_problems(driver: dict) -> list[Problem]:
    """`sign` signs the module llamarig builds with DKMS; a driver it does not install has
    none to sign."""
    if driver["secure_boot"] != "sign" or driver["source"] in DKMS_SOURCES:
        return []
    return [
        Problem(
            ("driver", "secure_boot"),
            f"`sign` signs the kernel module that llamarig builds, but `driver.source: "
            f"{driver['source']}` installs none: remove secure_boot (a preinstalled driver is "
            "signed by whoever installed it), or set driver.source to nvidia-repo or distro",
        )
    ]


def _parallel_problems(server: dict) -> list[Problem]:
    if server["parallel"] <= LLAMA_MAX_SEQ:
        return []
    return [
        Problem(
            ("server", "parallel"),
            f"{server['parallel']} slots are more than llama.cpp's {LLAMA_MAX_SEQ} sequences "
            "per context (LLAMA_MAX_SEQ; it fails at load with n_seq_max > 256): set at most "
            f"{LLAMA_MAX_SEQ}",
        )
    ]


def _gpu_table_problems(gpus: list[dict]) -> list[Problem]:
    """Declared GPUs against the hardware table: the capability of a known name, and memory
    that was written in bytes."""
    problems: list[Problem] = []
    for index, gpu in enumerate(gpus):
        model = hardware.gpu_named(gpu["name"])
        if model and model.compute_capability != gpu["compute_capability"]:
            problems.append(
                Problem(
                    ("gpus", index, "compute_capability"),
                    f'"{gpu["compute_capability"]}" is not that of {gpu["name"]}, which is '
                    f'{model.compute_capability}: set `compute_capability: "'
                    f'{model.compute_capability}"` (or fix the name; nvidia-smi '
                    "--query-gpu=name,compute_cap --format=csv shows both)",
                )
            )
        for key in ("vram_mib", "usable_mib"):
            value = gpu.get(key)
            if value is not None and value > MAX_PLAUSIBLE_VRAM_MIB:
                problems.append(
                    Problem(
                        ("gpus", index, key),
                        f"{value} is more MiB than any GPU has: it looks like bytes "
                        f"({value} bytes are {value >> 20} MiB); give MiB, as nvidia-smi "
                        "--query-gpu=memory.total --format=csv reports them",
                    )
                )
    return problems


def _cuda_architecture_problems(data: dict) -> list[Problem]:
    """An explicit architecture list must hold code that runs on every declared GPU."""
    listed = data["llama_cpp"]["cuda_architectures"]
    # `fleet` becomes a list with code for every declared GPU (derived.py).
    if listed in ("auto", "fleet") or data["llama_cpp"]["backend"] != "cuda":
        return []
    archs = listed.split(";")
    problems: list[Problem] = []
    for gpu in data["gpus"]:
        cc = gpu["compute_capability"]
        if not any(hardware.architecture_runs_on(arch, cc) for arch in archs):
            problems.append(
                Problem(
                    ("llama_cpp", "cuda_architectures"),
                    f'"{listed}" has no code that runs on {gpu["name"]} (compute {cc}; 12X '
                    "is built as 12Xa, which runs only on 12.X, and PTX alone is not enough): "
                    f'add "{hardware.cuda_architecture(cc)}", or set `auto`',
                )
            )
    return problems


def _cmake_option_problems(options: dict) -> list[Problem]:
    return [
        Problem(
            ("llama_cpp", "cmake_options", name),
            f"is derived by llamarig, and this would override it: set "
            f"{DERIVED_CMAKE_OPTIONS[name]} instead",
        )
        for name in options
        if name in DERIVED_CMAKE_OPTIONS
    ]


def _target_problems(data: dict) -> list[Problem]:
    if data["role"] == "rpc-worker" or "llama-server" in data["llama_cpp"]["targets"]:
        return []
    return [
        Problem(
            ("llama_cpp", "targets"),
            f"{shown(data['llama_cpp']['targets'])} lacks llama-server, which this "
            f"`{data['role']}` host serves with: add it (e.g. [llama-server, llama-bench])",
        )
    ]


def _nvcc_problems(data: dict) -> list[Problem]:
    cuda = data["cuda"]
    match = _TOOLKIT_NVCC.search(cuda["nvcc"])
    if cuda["source"] == "none" or not match or match.group(1) == cuda["version"]:
        return []
    return [
        Problem(
            ("cuda", "nvcc"),
            f"{cuda['nvcc']} is the nvcc of CUDA {match.group(1)}, but `cuda.version` is "
            f'"{cuda["version"]}": set `cuda.nvcc: auto` (or the version that path holds)',
        )
    ]


def _model_location_problems(data: dict) -> list[Problem]:
    """Model files must live where no deploy step deletes them, and URLs must name the file."""
    problems: list[Problem] = []
    prefix = PurePosixPath(os.path.normpath(data["paths"]["prefix"]))
    wiped = {
        prefix / "src" / "llama.cpp": "the llama.cpp checkout, which `git clean -ffdx` empties "
        "on every update",
        prefix / "builds": "the build directories, which llamarig deletes past "
        "`llama_cpp.keep_builds`",
    }
    for key_path, value in (
        (("paths", "models"), data["paths"]["models"]),
        (("model", "path"), data["model"]["path"]),
    ):
        if not value:
            continue
        where = PurePosixPath(os.path.normpath(value))
        for directory, what in wiped.items():
            if where == directory or directory in where.parents:
                problems.append(
                    Problem(
                        key_path,
                        f"{value} is inside {directory}, {what}; keep models outside "
                        f"{prefix}/src and {prefix}/builds (the default is {prefix}/models)",
                    )
                )
    url = data["model"]["url"] or ""
    if re.match(r"^https?://(www\.)?huggingface\.co/", url) and "/blob/" in url:
        problems.append(
            Problem(
                ("model", "url"),
                "is a Hugging Face page (/blob/), which serves HTML, not the file: use "
                f"/resolve/ ({url.replace('/blob/', '/resolve/', 1)})",
            )
        )
    return problems


def _rpc_address_problems(data: dict) -> list[Problem]:
    """The RPC protocol has no authentication: a worker binds a private address, unless the
    user says the network in between is theirs (rpc.allow_public)."""
    rpc = data["rpc"]
    if data["role"] != "rpc-worker" or not rpc["host"] or rpc["allow_public"]:
        return []
    try:
        address = ipaddress.ip_address(rpc["host"])
    except ValueError:
        return []  # a name: where it points is not known before connecting
    if address.is_private or address.is_link_local or address.is_loopback:
        return []
    return [
        Problem(
            ("rpc", "host"),
            f"{rpc['host']} is a public address, and ggml-rpc-server has no authentication or "
            "encryption: bind a private, link-local or loopback address the head reaches "
            "(e.g. 10.0.0.12), or set `rpc.allow_public: true` if the network in between is "
            "yours alone",
        )
    ]
