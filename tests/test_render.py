"""What the deploy writes for a rig: cmake command, llama-server arguments, unit and env file."""

import copy
import shlex

import pytest

from llamarig.config import load_inventory
from llamarig.model import catalog
from llamarig.onhost import hostpaths
from llamarig.planner import render
from tests.conftest import PROJECT


@pytest.fixture
def seed_rig() -> dict:
    """The seed rig as rendered after its plan: `split_mode: auto` resolves to tensor on its
    two cards (tests/test_split_mode_auto.py)."""
    data = load_inventory(PROJECT / "inventory" / "example-5080-3090.yml").hosts["rig1"].data
    data["server"]["split_mode"] = "tensor"
    return data


@pytest.fixture
def sandbox_rig() -> dict:
    return load_inventory(PROJECT / "inventory" / "hosts.yml").hosts["sandbox"].data


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_seed_rig_server_flags(seed_rig):
    args = render.server_args(seed_rig)
    assert args[0] == "/opt/llamarig/current/bin/llama-server"
    assert (flag_value(args, "-sm"), flag_value(args, "-ts")) == ("tensor", "2,3")
    assert flag_value(args, "--spec-type") == "ngram-mod,draft-mtp"
    assert flag_value(args, "--spec-draft-n-max") == "3"
    assert (flag_value(args, "-ctk"), flag_value(args, "-ctv")) == ("q8_0", "q8_0")
    assert "-kvu" in args
    assert flag_value(args, "-lm") == "none"
    assert "--no-mmap" not in args and "--draft-max" not in args
    assert flag_value(args, "-c") == "229376"
    assert (flag_value(args, "-fa"), flag_value(args, "-fit")) == ("on", "off")
    assert flag_value(args, "--chat-template-kwargs") == '{"preserve_thinking":true}'
    assert args[-2:] == ["--repeat-penalty", "1.0"]


def test_seed_rig_devices_follow_declaration_not_slot_order(seed_rig):
    # The 5080 (bus 07) is declared first, the 3090 (bus 01) second: with CUDA_DEVICE_ORDER=
    # PCI_BUS_ID the 3090 is CUDA0, so the 2 share lands on the 5080 as the seed intended.
    args = render.server_args(seed_rig)
    assert flag_value(args, "-dev") == "CUDA1,CUDA0"
    assert render.service_environment(seed_rig)["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_single_gpu_mode_names_one_device_and_no_split(seed_rig):
    rig = copy.deepcopy(seed_rig)
    rig["server"].update(split_mode="none", tensor_split=None)
    args = render.server_args(rig)
    assert flag_value(args, "-sm") == "none"
    assert flag_value(args, "-dev") == "CUDA1"  # the first declared card, the 5080
    assert "-ts" not in args


def test_devices_without_bus_ids_are_in_declared_order():
    gpus = [{"name": "a"}, {"name": "b"}, {"name": "c"}]
    assert render.cuda_device_names(gpus) == ["CUDA0", "CUDA1", "CUDA2"]


def test_seed_rig_cmake(seed_rig):
    command = render.cmake_configure_command(seed_rig)
    assert command[:2] == ["cmake", "-S"]
    options = dict(arg[2:].split("=", 1) for arg in command if arg.startswith("-D"))
    assert options["CMAKE_CUDA_ARCHITECTURES"] == "86-real;120a-real"
    assert options["GGML_CUDA_NCCL"] == "OFF"
    assert options["GGML_CUDA_FA_QUANTS"] == "all"
    assert "GGML_CUDA_FA_ALL_QUANTS" not in options
    assert options["GGML_CUDA"] == "ON" and options["GGML_NATIVE"] == "OFF"
    assert options["CMAKE_CUDA_COMPILER"] == "/usr/local/cuda-13.0/bin/nvcc"
    assert render.cmake_build_command(seed_rig)[-3:] == ["--target", "llama-server", "llama-bench"]


def test_cpu_rig_has_no_gpu_flags(sandbox_rig):
    args = render.server_args(sandbox_rig)
    assert not {"-sm", "-ts", "-ngl", "-dev", "-fit"} & set(args)
    assert render.cmake_options(sandbox_rig)["GGML_CUDA"] == "OFF"
    assert "CUDA_DEVICE_ORDER" not in render.service_environment(sandbox_rig)


def test_build_id_tracks_commit_and_options_only(seed_rig):
    other = copy.deepcopy(seed_rig)
    other["server"]["ctx"] = 4096
    assert render.build_id(other) == render.build_id(seed_rig)
    other["llama_cpp"]["commit"] = "1" * 40
    assert render.build_id(other) != render.build_id(seed_rig)
    assert render.build_id(other).startswith("111111111111-")
    other = copy.deepcopy(seed_rig)
    other["llama_cpp"]["cmake_options"]["GGML_CUDA_NCCL"] = True
    assert render.build_id(other) != render.build_id(seed_rig)


def test_unit_is_hardened_and_runs_the_rendered_command(seed_rig):
    unit = render.render_unit(seed_rig)
    exec_line = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    # Without % or $ in the arguments, systemd's quoting reads back like the shell's.
    assert shlex.split(exec_line.removeprefix("ExecStart=")) == render.server_args(seed_rig)
    for setting in (
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=\n",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "SystemCallFilter=@system-service",
        "DevicePolicy=closed",
        "DeviceAllow=char-nvidia-uvm rw",
        "Restart=on-failure",
        "EnvironmentFile=/etc/llamarig/llama-server.env",
    ):
        assert setting in unit


def test_cpu_unit_allows_no_devices(sandbox_rig):
    unit = render.render_unit(sandbox_rig)
    assert "DevicePolicy=closed" in unit and "DeviceAllow" not in unit
    assert "LimitMEMLOCK" not in unit


@pytest.mark.parametrize(
    ("arg", "quoted"),
    [
        ("-c", "-c"),
        ("/opt/x/llama-server", "/opt/x/llama-server"),
        ('{"a":1}', '"{\\"a\\":1}"'),
        ("100%", '"100%%"'),
        ("$HOME", '"$$HOME"'),
        ("two words", '"two words"'),
        ("", '""'),
    ],
)
def test_systemd_quote(arg, quoted):
    assert render.systemd_quote(arg) == quoted


def test_env_file_quotes_values(sandbox_rig):
    rig = copy.deepcopy(sandbox_rig)
    rig["server"]["env"] = {"GREETING": 'say "hi"'}
    text = render.render_env_file(rig)
    assert 'GREETING="say \\"hi\\""' in text
    assert 'LLAMA_CACHE="/var/cache/llama-server"' in text


def test_zero_share_gpu_is_left_out_of_the_devices(seed_rig):
    rig = copy.deepcopy(seed_rig)
    rig["server"]["tensor_split"] = [0, 1]
    args = render.server_args(rig)
    assert (flag_value(args, "-dev"), flag_value(args, "-ts")) == ("CUDA0", "1")


def test_api_key_reaches_the_service_as_a_credential(sandbox_rig, tmp_path):
    key = tmp_path / "rig.key"
    key.write_text("s3cret-key\n")
    rig = copy.deepcopy(sandbox_rig)
    rig["server"].update(host="0.0.0.0", api_key_file=str(key))
    unit = render.render_unit(rig)
    assert "LoadCredential=api-key:/etc/llamarig/api-key" in unit
    assert "--api-key-file %d/api-key" in unit
    text = unit + render.render_env_file(rig) + " ".join(render.server_args(rig))
    assert "s3cret" not in text and "--api-key " not in text


def test_launcher_runs_the_units_command_line_and_environment(seed_rig, tmp_path):
    """`llamarig run` executes the launcher: same arguments and environment as the unit."""
    seed_rig = copy.deepcopy(seed_rig)
    seed_rig["server"]["env"] = {"NCCL_NVLS_ENABLE": "0", "ODD": "a b $HOME"}
    text = render.render_launcher(seed_rig)
    lines = text.splitlines()
    assert lines[0] == "#!/bin/sh"
    exec_line = next(line for line in lines if line.startswith("exec "))
    assert shlex.split(exec_line)[1:-1] == render.server_args(seed_rig)
    assert exec_line.endswith('"$@"')
    exports = dict(
        shlex.split(line)[1].split("=", 1) for line in lines if line.startswith("export ")
    )
    assert exports == render.service_environment(seed_rig)
    assert "--api-key-file" not in text

    key = tmp_path / "key"
    key.write_text("s3cret-value\n")
    seed_rig["server"]["api_key_file"] = str(key)
    text = render.render_launcher(seed_rig)
    assert f"--api-key-file {hostpaths.API_KEY_PATH}" in text
    assert "s3cret" not in text


def test_running_server_is_compared_with_the_rig(sandbox_rig, tmp_path):
    """What tells the deploy that a run was cut short before the restart."""
    build = render.layout(sandbox_rig)["build"]
    running = {
        "pid": 1,
        "need_daemon_reload": False,
        "exe": f"{build}/bin/llama-server",
        "started": 2000,
        "cmdline": render.unit_command_line(sandbox_rig),
        "environ": {**render.service_environment(sandbox_rig), "INVOCATION_ID": "x"},
        "model_mtime": 1000,
    }
    assert render.running_differs(sandbox_rig, running) == []

    stale = {
        **running,
        "cmdline": [*running["cmdline"][:-1], "--other"],
        "exe": "/opt/llamarig/builds/old/bin/llama-server",
        "environ": {},
        "model_mtime": 3000,
        "need_daemon_reload": True,
    }
    reasons = render.running_differs(sandbox_rig, stale)
    assert len(reasons) == 5, reasons

    key = tmp_path / "key"
    key.write_text("k\n")
    keyed = copy.deepcopy(sandbox_rig)
    keyed["server"]["api_key_file"] = str(key)
    assert render.unit_command_line(keyed)[-2:] == [
        "--api-key-file",
        "/run/credentials/llama-server.service/api-key",
    ]


def test_an_unplanned_split_mode_is_never_rendered(seed_rig):
    seed_rig["server"]["split_mode"] = "auto"
    with pytest.raises(ValueError, match="resolved by the plan"):
        render.server_args(seed_rig)


@pytest.mark.parametrize(
    ("model", "alias"),
    [
        ({"url": "http://h/SmolLM2-135M-Instruct.Q4_1.gguf"}, "SmolLM2-135M-Instruct"),
        ({"url": "http://h/Qwen2.5-32B-Instruct-IQ2_XXS.gguf"}, "Qwen2.5-32B-Instruct"),
        ({"url": "http://h/m-Q4_K_M-00001-of-00003.gguf"}, "m"),
        ({"url": "http://h/x.BF16.gguf"}, "x"),
        ({"path": "/srv/tiny-llama.gguf"}, "tiny-llama"),
        (
            {"hf": "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "file": "a.gguf"},
            "SmolLM2-135M-Instruct",
        ),
        # a file name that is valid but no name for clients: made one, without a comma
        ({"url": "http://h/a,b 'c' $(id).gguf"}, "a-b-c-id"),
    ],
)
def test_the_model_alias_is_a_name_clients_can_type(model, alias):
    data = {
        "server": {"alias": None},
        "model": {"hf": None, "filename": None, "url": None, "path": None, **model},
    }
    assert catalog.model_alias(data) == alias
    data["server"]["alias"] = "qwen3.6-27b"
    assert catalog.model_alias(data) == "qwen3.6-27b"


def test_the_alias_is_on_the_command_line_and_an_unsafe_one_is_refused(write_inventory):
    from llamarig.config import ConfigError

    base = """all:
  hosts:
    rig1:
      ssh: {host: 10.0.0.1}
      model: {path: /srv/m.gguf}
      driver: {source: none}
      cuda: {source: none}
      llama_cpp: {backend: cpu}
"""
    rig = base + "      server: {alias: team/qwen-27b, split_mode: none}\n"
    data = load_inventory(write_inventory(rig)).hosts["rig1"].data
    args = render.server_args(data)
    assert args[args.index("--alias") + 1] == "team/qwen-27b"
    for hostile in ("a,b", "two words", "$(id)", "-lv"):
        with pytest.raises(ConfigError) as caught:
            load_inventory(write_inventory(base + f"      server: {{alias: '{hostile}'}}\n"))
        assert "hosts.rig1.server.alias" in "\n".join(caught.value.problems)


# The CMake entries that set the compiler's flags: where two trixie sandbox rigs differ in one,
# the second build misses every object of the ccache the first filled.
COMPILER_FLAG_OPTIONS = ("CMAKE_BUILD_TYPE", "CMAKE_C_FLAGS_RELEASE", "CMAKE_CXX_FLAGS_RELEASE")


def test_the_trixie_sandbox_rigs_compile_with_the_same_flags(sandbox_rig):
    rpc = load_inventory(PROJECT / "inventory" / "sandbox-rpc.yml").hosts
    demo = {key: render.cmake_options(sandbox_rig).get(key) for key in COMPILER_FLAG_OPTIONS}
    assert demo["CMAKE_CXX_FLAGS_RELEASE"] == "-O1 -DNDEBUG"
    for name in ("rpc-head", "rpc-worker"):
        options = render.cmake_options(rpc[name].data)
        assert {key: options.get(key) for key in COMPILER_FLAG_OPTIONS} == demo, name
