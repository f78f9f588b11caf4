"""Pure rendering of a rig's build and server configuration from validated rig data.

Everything the deploy writes to a host (cmake command, llama-server arguments, systemd unit,
environment file) comes from here, so it is unit-tested without a host and the deploy, the
`llamarig` CLI and the tests all see the same values.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined

from llamarig import project_dir
from llamarig.config import model_filename
from llamarig.config.addresses import local_url
from llamarig.config.numbers import C_FLOAT, C_INT
from llamarig.config.rules import PRESET_UNSAFE
from llamarig.model.catalog import is_router, model_alias, model_views
from llamarig.onhost.hostpaths import (
    API_KEY_PATH,
    BUILD_COMPLETE_MARKER,
    LAST_GOOD_DIRECTORY,
    OVERHEADS_DIR,
    SYSTEMD_UNIT_DIRECTORY,
)
from llamarig.tables.hardware import cuda_architectures, pci_sort_key
from llamarig.tables.llama_args import SAMPLING

TEMPLATES_DIR = project_dir("files")
RPC_SERVER = "ggml-rpc-server"
# The character-device groups (names in /proc/devices) of the NVIDIA driver that a CUDA process
# opens, for the DeviceAllow= lines of the server and RPC worker units (DevicePolicy=closed):
# `nvidia` and `nvidiactl` share major 195 (/dev/nvidia0.., /dev/nvidiactl), `nvidia-uvm` holds
# /dev/nvidia-uvm and nvidia-uvm-tools, `nvidia-caps` the MIG capability nodes. Each name is
# one that driver 580.159 lists (GUIDE §8); systemd silently ignores a name that /proc/devices
# does not list (the units named `nvidia-frontend`, which that driver no longer registers).
# Left out: nvidia-modeset (display), nvidia-nvswitch and nvidia-nvlink (the fabric manager's),
# nvidia-caps-imex-channels (multi-node NVLink).
NVIDIA_DEVICE_GROUPS = ("nvidia", "nvidiactl", "nvidia-uvm", "nvidia-caps")


def nvcc_path(data: dict) -> str | None:
    """The nvcc the build uses, or None for a CPU build."""
    if data["llama_cpp"]["backend"] != "cuda":
        return None
    cuda = data["cuda"]
    if cuda["nvcc"] != "auto":
        return cuda["nvcc"]
    if cuda["source"] == "distro":
        return "/usr/bin/nvcc"
    return f"/usr/local/cuda-{cuda['version']}/bin/nvcc"


def cuobjdump_path(data: dict) -> str | None:
    """The toolkit's cuobjdump, beside its nvcc (None for a CPU build)."""
    nvcc = nvcc_path(data)
    return f"{nvcc.rsplit('/', 1)[0]}/cuobjdump" if nvcc else None


def cuda_arch_list(data: dict) -> str | None:
    if data["llama_cpp"]["backend"] != "cuda":
        return None
    configured = data["llama_cpp"]["cuda_architectures"]
    # `fleet` not derived (data that did not come through the inventory): this rig's own GPUs.
    if configured not in ("auto", "fleet"):
        return configured
    return cuda_architectures(gpu["compute_capability"] for gpu in data["gpus"])


def _cmake_value(value: Any) -> str:
    if isinstance(value, bool):
        return "ON" if value else "OFF"
    return str(value)


def cmake_options(data: dict) -> dict[str, str]:
    """CMake cache entries of the build: llamarig's choices, then the user's on top."""
    llama_cpp = data["llama_cpp"]
    options: dict[str, str] = {}
    if llama_cpp["backend"] == "cuda":
        options.update(
            GGML_CUDA="ON",
            # The build host's own GPUs are not the target's: never let CMake ask them.
            GGML_NATIVE="OFF",
            CMAKE_CUDA_ARCHITECTURES=cuda_arch_list(data),
            CMAKE_CUDA_COMPILER=nvcc_path(data),
        )
    else:
        options["GGML_CUDA"] = "OFF"
    if data["role"] != "standalone":
        options["GGML_RPC"] = "ON"
    options["GGML_CCACHE"] = _cmake_value(llama_cpp["ccache"])
    options.update({key: _cmake_value(value) for key, value in llama_cpp["cmake_options"].items()})
    return options


def build_targets(data: dict) -> list[str]:
    """What the build makes: an RPC worker needs only ggml-rpc-server."""
    if data["role"] == "rpc-worker":
        return [RPC_SERVER]
    return list(data["llama_cpp"]["targets"])


def build_id(data: dict) -> str:
    """Directory name of a build: commit plus a digest of everything that changes the output."""
    llama_cpp = data["llama_cpp"]
    recipe = {"options": cmake_options(data), "targets": sorted(build_targets(data))}
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    return f"{llama_cpp['commit'][:12]}-{digest}"


def layout(data: dict) -> dict[str, str]:
    """Paths on the host."""
    prefix = PurePosixPath(data["paths"]["prefix"])
    build_dir = prefix / "builds" / build_id(data)
    env_file = PurePosixPath(data["paths"]["env_file"])
    presets = str(env_file.with_name(f"{data['server']['service']}.presets.ini"))
    return {
        "source": str(prefix / "src" / "llama.cpp"),
        "builds": str(prefix / "builds"),
        "build": str(build_dir),
        "build_marker": str(build_dir / BUILD_COMPLETE_MARKER),
        "current": str(prefix / "current"),
        "server_binary": str(prefix / "current" / "bin" / "llama-server"),
        # A router reads its presets again without a restart (each model's file is its own
        # view's): what it read at start, and must predate it, is its unit.
        "model": f"{SYSTEMD_UNIT_DIRECTORY}/{data['server']['service']}.service"
        if is_router(data)
        else data["model"]["path"]
        or str(PurePosixPath(data["paths"]["models"]) / model_filename(data)),
        "presets": presets,
        "unit": f"{SYSTEMD_UNIT_DIRECTORY}/{data['server']['service']}.service",
        "rpc_unit": f"{SYSTEMD_UNIT_DIRECTORY}/{data['rpc']['service']}.service",
        "launcher": str(prefix / "bin" / data["server"]["service"]),
        # Copies of unit, env file and `current` target of the last version that served.
        "last_good": f"{LAST_GOOD_DIRECTORY}/{data['server']['service']}",
        "overheads": OVERHEADS_DIR,
        "env_file": data["paths"]["env_file"],
    }


def cmake_configure_command(data: dict) -> list[str]:
    paths = layout(data)
    options = cmake_options(data)
    return ["cmake", "-S", paths["source"], "-B", paths["build"], "-G", "Ninja"] + [
        f"-D{key}={value}" for key, value in options.items()
    ]


def cmake_build_command(data: dict) -> list[str]:
    jobs = data["llama_cpp"]["jobs"]
    command = ["cmake", "--build", layout(data)["build"], "--target", *build_targets(data)]
    if jobs:
        command += ["--parallel", str(jobs)]
    return command


def build_manifest(data: dict) -> dict:
    """What a finished build records next to its binaries (and `llamarig verify` compares)."""
    return {
        "commit": data["llama_cpp"]["commit"],
        "repo": data["llama_cpp"]["repo"],
        "cmake_options": cmake_options(data),
        "targets": build_targets(data),
    }


def server_args(data: dict) -> list[str]:
    """The complete llama-server command line (without secrets, which go through files): one
    model's, or the router's for a rig of several (``router.router_args``)."""
    if is_router(data):
        return router_args(data)
    server = data["server"]
    paths = layout(data)
    args = [paths["server_binary"], "-m", paths["model"]]
    args += ["--host", server["host"], "--port", str(server["port"])]
    args += [part for option in model_options(data) for part in option if part is not None]
    if server["metrics"]:
        args.append("--metrics")
    args += ["--alias", model_alias(data)]
    args += server["extra_args"]
    return args


# The most entries `models:` may hold (schema.json's maxItems).
MAX_MODELS = 64


def router_args(data: dict) -> list[str]:
    """The command line of llama-server's router for a rig of several models: the listen
    address and the presets file; every model setting is in its preset (a router's own flags
    would win over every preset's), the API key is added by the unit (never forwarded to the
    children, which listen on loopback only)."""
    server = data["server"]
    paths = layout(data)
    args = [paths["server_binary"], "--host", server["host"], "--port", str(server["port"])]
    args += ["--models-preset", paths["presets"]]
    # null: no bound of its own (the plan counts all of them); a number, not 0 (unlimited),
    # which the pinned router refuses beside a model loaded at startup, and not the count of
    # models, which would change the unit, and restart the router, when one is added.
    args += ["--models-max", _integer(server["models_max"] or MAX_MODELS)]
    if server["idle_unload_seconds"]:
        args += ["--sleep-idle-seconds", _integer(server["idle_unload_seconds"])]
    if server["metrics"]:
        args.append("--metrics")
    args += server["extra_args"]
    return args


def preset_sections(data: dict) -> list[dict]:
    """Each model's preset section of a router rig: its name, and its options as (INI key,
    value) pairs, the key a flag without its dashes. Raises ValueError for a value the INI
    cannot carry (the rules refuse those before)."""
    sections = []
    # Those loaded at startup last: the deploy's check after a start loads each model in the
    # file's order, so it leaves them loaded.
    for view in sorted(model_views(data), key=lambda view: view.load_on_startup):
        options = [("m", layout(view.data)["model"])]
        options += [(flag.lstrip("-"), "true" if value is None else value)
                    for flag, value in model_options(view.data)]  # fmt: skip
        options.append(("load-on-startup", "true" if view.load_on_startup else "false"))
        for key, value in options:
            if PRESET_UNSAFE.search(value):
                raise ValueError(f"models[{view.index}] ({view.name}): {key} = {value!r}")
        sections.append({"name": view.name, "options": options})
    return sections


def preset_flags(data: dict) -> list[str]:
    """The llama-server options a router rig's presets set (none for one model), for the
    check against the binary's --help (a key the binary does not know stops the router)."""
    return [
        flag
        for view in model_views(data)
        for flag in ["-m", *(flag for flag, _ in model_options(view.data))]
    ]


def render_presets(data: dict) -> str:
    return render_file("llama-server.presets.ini.j2", sections=preset_sections(data))


def preset_sections_of(lines: list[str]) -> dict[str, list[str]]:
    """The sections of a presets file llamarig wrote (``render.render_presets``), each model's
    name with its option lines as written."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in (line.strip() for line in lines):
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
        elif current is not None and line and not line.startswith(";"):
            current.append(line)
    return sections


def unloaded_by_reload(served: list[str] | None, new: str) -> list[str]:
    """The models a router unloads when it reads the presets ``new`` in place of ``served``
    (the lines of the presets it serves; None: not known, so every one of them may be): those
    whose section changed or is gone, as llama-server's reload decides (server-models.cpp)."""
    wanted = preset_sections_of(new.splitlines())
    if served is None:
        return list(wanted)
    return [
        name for name, options in preset_sections_of(served).items() if wanted.get(name) != options
    ]


def model_options(data: dict) -> list[tuple[str, str | None]]:
    """The options of llama-server that serve one model as planned, each (flag, value) or
    (flag, None): the one-model command line, and a router's preset for the model."""
    server = data["server"]
    if server["split_mode"] == "auto":
        raise ValueError("split_mode auto is resolved by the plan (plan.plan_host) first")
    gpu = data["llama_cpp"]["backend"] == "cuda"
    # Short flags, as in llama.cpp's docs and the seed articles.
    options: list[tuple[str, str | None]] = [
        ("-c", str(server["ctx"])),
        ("-np", _integer(server["parallel"])),
        ("-b", _integer(server["batch"])),
        ("-ub", _integer(server["ubatch"])),
        ("-ctk", server["cache_type_k"]),
        ("-ctv", server["cache_type_v"]),
        ("-lm", server["load_mode"]),
    ]
    endpoints = data["rpc"].get("endpoints") if data["role"] == "rpc-head" else None
    if endpoints:
        options.append(("--rpc", ",".join(endpoints)))
    if gpu or endpoints:
        # RPC devices take layers like GPUs do, also on a head built for the CPU.
        options += [("-ngl", str(server["gpu_layers"])), ("-sm", server["split_mode"])]
        devices, shares = server_devices(data)
        if devices:
            options.append(("-dev", ",".join(devices)))
        if shares is not None:
            options.append(("-ts", ",".join(_number(share) for share in shares)))
    flash_attn = "on" if server["split_mode"] == "tensor" else server["flash_attn"]
    options.append(("-fa", flash_attn))
    if server["split_mode"] == "tensor":
        # --fit is not implemented for tensor mode: the context is sized explicitly.
        options.append(("-fit", "off"))
    if server["kv_unified"]:
        options.append(("-kvu", None))
    if server["backend_sampling"]:
        options.append(("-bs", None))
    if server["threads"]:
        options.append(("-t", _integer(server["threads"])))
    if server["spec"]["type"]:
        options.append(("--spec-type", ",".join(server["spec"]["type"])))
    if server["spec"]["draft_max"] is not None:
        options.append(("--spec-draft-n-max", _integer(server["spec"]["draft_max"])))
    if server["chat_template_kwargs"]:
        kwargs = json.dumps(server["chat_template_kwargs"], separators=(",", ":"), sort_keys=True)
        options.append(("--chat-template-kwargs", kwargs))
    for key, entry in SAMPLING.items():
        if server["sampling"].get(key) is not None:
            options.append((entry.flags[0], _number(server["sampling"][key])))
    return options


def server_devices(data: dict) -> tuple[list[str], list | None]:
    """The CUDA devices llama-server is given (--device) and their shares (-ts)."""
    server = data["server"]
    endpoints = data["rpc"].get("endpoints") if data["role"] == "rpc-head" else None
    # A head's --device would leave out the RPC devices (llama.cpp lists them first).
    devices = cuda_device_names(data["gpus"]) if data["gpus"] and not endpoints else []
    shares = server["tensor_split"]
    if isinstance(shares, list) and devices and 0 in shares:
        # A card left in with a zero share still holds memory (about 2.8 GB in tensor mode):
        # leave it out of --device instead.
        devices = [name for name, share in zip(devices, shares, strict=True) if share]
        shares = [share for share in shares if share]
    if server["split_mode"] == "none":
        # One card: without -dev llama.cpp would still open a context on every GPU.
        devices = devices[:1]
    return devices, shares


def cuda_device_names(gpus: list[dict]) -> list[str]:
    """CUDA device names of the declared GPUs, in the order they are declared.

    The service runs with CUDA_DEVICE_ORDER=PCI_BUS_ID, so CUDA numbers GPUs by PCI bus id,
    as nvidia-smi does. `--device` lists them in declaration order, which is the order
    `tensor_split` follows; without bus ids the declaration is taken to be in bus order.
    """
    if not all(gpu.get("pci_bus_id") for gpu in gpus):
        return [f"CUDA{index}" for index in range(len(gpus))]
    by_bus = sorted(range(len(gpus)), key=lambda i: pci_sort_key(gpus[i]["pci_bus_id"]))
    cuda_index = {declared: rank for rank, declared in enumerate(by_bus)}
    return [f"CUDA{cuda_index[declared]}" for declared in range(len(gpus))]


# Options the pinned llama.cpp renamed: old -> new (with values). Renamed options that land on
# a planned one (--no-mmap, --draft-max) are refused by config instead, with the key to set
# (llama_args.GUARDED); none of these may translate into one of those.
RENAMED_FLAGS = {
    "--draft-min": ["--spec-draft-n-min"],
    "--draft-n-min": ["--spec-draft-n-min"],
}


def translate_renamed(args: list[str]) -> tuple[list[str], list[str]]:
    """Replace renamed options in user-given arguments; return the new list and warnings."""
    translated, warnings = [], []
    for arg in args:
        if arg in RENAMED_FLAGS:
            replacement = RENAMED_FLAGS[arg]
            warnings.append(
                f"server.extra_args: {arg} is gone from the pinned llama.cpp; using "
                f"{' '.join(replacement)} instead (update the rig file)"
            )
            translated += replacement
        else:
            translated.append(arg)
    return translated, warnings


def _number(value: float) -> str:
    """A float option as llama.cpp reads it (std::stof): a whole number without a fraction,
    else Python's shortest repr (``0.7``, ``1e-05``), which strtof reads. A value std::stof
    throws on (not 0 or a normal C float: ``1e-300`` underflows, ``1e39`` overflows) is never
    written: the loader refuses it first (config.numbers)."""
    if not C_FLOAT.holds(value):
        raise ValueError(
            f"{value!r} is not a normal C float, and std::stof cannot read it (the loader "
            "refuses it: config.numbers)"
        )
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _integer(value: int) -> str:
    """An integer option as llama.cpp reads it (std::stoi); one beyond a C int is never
    written: the loader refuses it first (config.numbers)."""
    if not C_INT.holds(value):
        raise ValueError(f"{value} is beyond a C int, and std::stoi cannot read it")
    return str(value)


def _systemd_c_quoted(text: str) -> str:
    """``text`` in double quotes for a unit line that systemd unquotes with C escapes: a
    backslash, a double quote and any control character (which would end the line) escaped."""
    escaped = "".join(
        "\\" + ch if ch in '\\"' else f"\\x{ord(ch):02x}" if ord(ch) < 32 or ord(ch) == 127 else ch
        for ch in text
    )
    return f'"{escaped}"'


def systemd_specifiers(text: str) -> str:
    """``text`` with systemd's specifier character escaped (a value in a unit line where
    systemd expands %-specifiers: a path, an environment assignment)."""
    return text.replace("%", "%%")


def systemd_quote(arg: str) -> str:
    """Quote one argument for an ExecStart= line (systemd's own rules, not the shell's): %% and
    $$ are a literal % and $."""
    escaped = systemd_specifiers(arg).replace("$", "$$")
    if escaped and all(ch.isalnum() or ch in "-_./:,=+@" for ch in escaped):
        return escaped
    return _systemd_c_quoted(escaped)


def systemd_environment(key: str, value: str) -> str:
    """One quoted ``Environment=`` word: systemd unquotes it with C escapes, then expands
    %-specifiers (an unknown one drops the whole assignment); `$` is not expanded there."""
    return _systemd_c_quoted(systemd_specifiers(f"{key}={value}"))


def env_file_assignment(key: str, value: str) -> str:
    """One line of an ``EnvironmentFile=``: in double quotes systemd unescapes exactly
    backslash, double quote, backtick and `$` (as sh does, so the file also reads in sh) and
    expands nothing."""
    escaped = "".join("\\" + ch if ch in '\\"`$' else ch for ch in value)
    return f'{key}="{escaped}"'


def service_environment(data: dict, service: str | None = None) -> dict[str, str]:
    """Environment of a unit (the server's, or ``service``, e.g. the RPC worker's)."""
    service = service or data["server"]["service"]
    environment = {
        # State and cache directories of the unit: llama.cpp needs a writable HOME/cache.
        "HOME": f"/var/lib/{service}",
        "LLAMA_CACHE": f"/var/cache/{service}",
    }
    if data["llama_cpp"]["backend"] == "cuda":
        # -ts, --device and nvidia-smi must agree on GPU numbering (PCI bus order).
        environment["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    environment.update({key: _cmake_value(value) for key, value in data["server"]["env"].items()})
    return environment


def _templates() -> Environment:
    templates = Environment(
        loader=FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    templates.globals.update(
        systemd_environment=systemd_environment, env_file_assignment=env_file_assignment
    )
    templates.filters["systemd_specifiers"] = systemd_specifiers
    return templates


def device_allow(data: dict) -> list[str]:
    """The DeviceAllow= values of a unit: the NVIDIA groups for a CUDA build, none otherwise."""
    if data["llama_cpp"]["backend"] != "cuda":
        return []
    return [f"char-{group} rw" for group in NVIDIA_DEVICE_GROUPS]


def unit_context(data: dict) -> dict:
    """Variables of files/llama-server.service.j2."""
    server = data["server"]
    paths = layout(data)
    return {
        "service": server["service"],
        "exec_start": " ".join(systemd_quote(arg) for arg in server_args(data)),
        "env_file": paths["env_file"],
        "gpu": data["llama_cpp"]["backend"] == "cuda",
        "device_allow": device_allow(data),
        "mlock": "mlock" in server["load_mode"],
        "models_dir": data["paths"]["models"],
        "prefix": data["paths"]["prefix"],
        "api_key_path": API_KEY_PATH if server["api_key_file"] else None,
    }


def rpc_server_args(data: dict) -> list[str]:
    """A worker's ggml-rpc-server command line."""
    rpc = data["rpc"]
    args = [
        f"{layout(data)['current']}/bin/{RPC_SERVER}",
        "-H",
        rpc["host"],
        "-p",
        str(rpc["port"]),
    ]
    if rpc["threads"]:
        args += ["-t", str(rpc["threads"])]
    if rpc["cache"]:
        args.append("-c")
    return args


def render_rpc_unit(data: dict) -> str:
    rpc = data["rpc"]
    return (
        _templates()
        .get_template("ggml-rpc-server.service.j2")
        .render(
            service=rpc["service"],
            exec_start=" ".join(systemd_quote(arg) for arg in rpc_server_args(data)),
            gpu=data["llama_cpp"]["backend"] == "cuda",
            device_allow=device_allow(data),
            environment=service_environment(data, rpc["service"]),
        )
    )


def render_unit(data: dict) -> str:
    return _templates().get_template("llama-server.service.j2").render(**unit_context(data))


def _with_api_key(data: dict, key_path: str) -> list[str]:
    """server_args, plus --api-key-file ``key_path`` when the rig has an API key."""
    args = server_args(data)
    if data["server"]["api_key_file"]:
        args += ["--api-key-file", key_path]
    return args


def unit_command_line(data: dict) -> list[str]:
    """The command line the unit's main process runs (systemd expands %d, the credentials
    directory, in the API key argument)."""
    return _with_api_key(data, f"/run/credentials/{data['server']['service']}.service/api-key")


def running_differs(data: dict, running: dict) -> list[str]:
    """Why the running server is not what the rig data asks for (empty when it is): a run cut
    short after writing the unit, the environment, the link or the model, before the restart."""
    reasons = []
    if running["cmdline"] != unit_command_line(data):
        reasons.append("its command line differs from the unit's")
    binary = f"{layout(data)['build']}/bin/llama-server"
    if running["exe"] != binary:
        reasons.append(f"it runs {running['exe']}, not {binary}")
    environment = service_environment(data)
    if any(running["environ"].get(key) != value for key, value in environment.items()):
        reasons.append("its environment differs from the environment file")
    if running["model_mtime"] > running["started"]:
        reasons.append("the model file changed after it started")
    if running["need_daemon_reload"]:
        reasons.append("systemd has not loaded the current unit file")
    return reasons


def foreground_args(data: dict) -> list[str]:
    """The command line of the server run outside the unit, as root (the launcher, tune's
    temporary servers): the API key read straight from its root-only file."""
    return _with_api_key(data, API_KEY_PATH)


def render_launcher(data: dict) -> str:
    """The launcher script: the unit's command line and environment, run in the foreground.

    `llamarig run` starts it where no systemd runs the server (a container) or to debug a rig;
    it runs as the caller (root), without the unit's sandbox.
    """
    args = foreground_args(data)
    environment = service_environment(data)
    home = shlex.quote(environment["HOME"])
    lines = [
        "#!/bin/sh",
        "# Managed by llamarig: the llama-server command line the deploy planned, as the unit",
        "# runs it, in the foreground (`llamarig run`). Extra arguments are appended.",
        *(f"export {key}={shlex.quote(value)}" for key, value in environment.items()),
        f"mkdir -p {home} && cd {home} || exit 1",
        f'exec {shlex.join(args)} "$@"',
    ]
    return "\n".join(lines) + "\n"


def render_env_file(data: dict) -> str:
    return (
        _templates()
        .get_template("llama-server.env.j2")
        .render(environment=service_environment(data))
    )


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def shell_join(args: list[str]) -> str:
    return shlex.join(args)


NVIDIA_KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"


def render_file(template: str, **variables: Any) -> str:
    """Render one of the templates in files/."""
    return _templates().get_template(template).render(**variables)


def nvidia_keyring_url(data: dict, distribution_dir: str) -> str:
    repo = data["nvidia_repo"]
    return (
        f"{repo['url']}/{distribution_dir}/x86_64/"
        f"{repo['keyring_package']}_{repo['keyring_version']}_all.deb"
    )


def keyring_install_command(data: dict, distribution_dir: str) -> str:
    """Download the repository's keyring package to a fresh private file and install it; the
    URL is one quoted argument."""
    url = shlex.quote(nvidia_keyring_url(data, distribution_dir))
    return (
        f'deb=$(mktemp --suffix=.deb) && curl -fsSL -o "$deb" -- {url} && dpkg -i "$deb"; '
        'status=$?; rm -f "$deb"; exit $status'
    )


def base_url(data: dict) -> str:
    """Where the host itself reaches its server (a wildcard address is reached on loopback)."""
    return local_url(data["server"]["host"], data["server"]["port"])
