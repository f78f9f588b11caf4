"""Settings that would slip past the plan or cannot work, refused before any connection with
the key path and the fix (issue 12, items 2 and 4): `extra_args` and `env` that set what
llamarig plans or carry a secret, and settings that contradict each other, llama.cpp or the
hardware. Same table form as tests/test_bad_input.py; each case is one mistake."""

from __future__ import annotations

import re
import subprocess

import pytest

from llamarig.config import load_inventory
from llamarig.tables.llama_args import GUARDED, GUARDED_ENV
from tests.test_bad_input import (
    GPU_3090,
    GPU_5080,
    Case,
    assert_refused_by_name,
    edit,
    gpus,
    host,
)


def extra_args(*args: str) -> str:
    listed = ", ".join(f'"{arg}"' for arg in args)
    return host(f"server: {{extra_args: [{listed}]}}")


def env(name: str, value: str = "x") -> str:
    return host(f'server: {{env: {{{name}: "{value}"}}}}')


# A head with two workers, all on their own boxes; {…} fields vary per case.
RPC = """\
all:
  vars:
    driver: {{source: none}}
    cuda: {{source: none}}
    llama_cpp: {{backend: cpu}}
  children:
    rpc_heads:
      hosts:
        head:
          ssh: {{host: {head_ssh}}}
          rpc: {{workers: [worker1, worker2]}}
          model: {{path: /srv/m.gguf}}
{second_head}    rpc_workers:
      hosts:
        worker1:
          ssh: {{host: 10.0.0.11}}
          rpc: {{host: {worker1_rpc}, port: 50052}}
        worker2:
          ssh: {{host: {worker2_ssh}}}
          rpc: {{host: 10.0.0.12, port: {worker2_port}{worker2_extra}}}
"""


def rpc(**changes: str) -> str:
    fields = dict(
        head_ssh="10.0.0.10",
        second_head="",
        worker1_rpc="10.0.0.11",
        worker2_ssh="10.0.0.12",
        worker2_port="50053",
        worker2_extra="",
    )
    return RPC.format(**{**fields, **changes})


SECOND_HEAD = """\
        head2:
          ssh: {host: 10.0.0.20}
          rpc: {workers: [worker2]}
          model: {path: /srv/m.gguf}
"""

CASES = [
    # --- item 2: extra_args that override the plan -----------------------------------------
    Case(
        "extra-args-host",
        extra_args("--host", "0.0.0.0"),
        "hosts.rig1.server.extra_args.0",
        ("`--host` is planned from `server.host`", "set `server.host`", "api_key_file"),
    ),
    Case(
        "extra-args-api-key",
        extra_args("--api-key", "sekrit"),
        "hosts.rig1.server.extra_args.0",
        ("`--api-key`", "in argv and in the unit", "set `server.api_key_file`"),
    ),
    Case(
        "extra-args-flag-equals-value",
        extra_args("--port=9000"),
        "hosts.rig1.server.extra_args.0",
        ("`--port=9000` (that is `--port`)", "set `server.port`"),
    ),
    Case(
        "extra-args-underscore-spelling",
        extra_args("--n_gpu_layers", "10"),
        "hosts.rig1.server.extra_args.0",
        ("(that is `--n-gpu-layers`)", "set `server.gpu_layers`"),
    ),
    Case(
        "extra-args-short-alias",
        extra_args("--temp", "0.7", "-c", "8192"),
        "hosts.rig1.server.extra_args.2",
        ("`-c` is planned from `server.ctx`", "set `server.ctx`"),
    ),
    Case(
        "extra-args-negation",
        extra_args("--no-kv-unified"),
        "hosts.rig1.server.extra_args.0",
        ("`--no-kv-unified`", "set `server.kv_unified: true` or `false`"),
    ),
    Case(
        "extra-args-device",
        extra_args("-dev", "CUDA1"),
        "hosts.rig1.server.extra_args.0",
        ("`-dev` is planned from `gpus`", "leaves a card out"),
    ),
    Case(
        "extra-args-renamed-no-mmap",
        extra_args("--no-mmap"),
        "hosts.rig1.server.extra_args.0",
        ("`--no-mmap` is gone", "set `server.load_mode: none`"),
    ),
    Case(
        "extra-args-renamed-draft-max",
        extra_args("--draft-max", "4"),
        "hosts.rig1.server.extra_args.0",
        ("`--draft-max`", "set `server.spec.draft_max`"),
    ),
    Case(
        "extra-args-hf-repo",
        extra_args("-hf", "Qwen/Qwen3-8B-GGUF"),
        "hosts.rig1.server.extra_args.0",
        ("past llamarig's download and checksum", "/resolve/main/FILE.gguf", "model.sha256"),
    ),
    Case(
        "extra-args-fit",
        extra_args("-fit", "on"),
        "hosts.rig1.server.extra_args.0",
        ("resize what llamarig planned", "`server.ctx`"),
    ),
    Case(
        "extra-args-flag-and-value-in-one-string",
        extra_args("--seed 42"),
        "hosts.rig1.server.extra_args.0",
        ("an option and its value in one string", '[--seed, "42"]'),
    ),
    Case(
        "extra-args-guarded-flag-and-value-in-one-string",
        extra_args("--host 0.0.0.0"),
        "hosts.rig1.server.extra_args.0",
        ("(that is `--host`)", "set `server.host`"),
    ),
    Case(
        "extra-args-unguarded-equals",
        extra_args("--seed=42"),
        "hosts.rig1.server.extra_args.0",
        ("does not split --option=value", "invalid argument", '[--seed, "42"]'),
    ),
    # --- item 2: env that sets the plan, carries a secret or is llamarig's own ---------------
    Case(
        "env-llama-arg-ctx",
        env("LLAMA_ARG_CTX_SIZE", "8192"),
        "hosts.rig1.server.env.LLAMA_ARG_CTX_SIZE",
        ("llama-server's variable for --ctx-size", "set `server.ctx`"),
    ),
    Case(
        "env-llama-arg-host",
        env("LLAMA_ARG_HOST", "0.0.0.0"),
        "hosts.rig1.server.env.LLAMA_ARG_HOST",
        ("variable for --host", "set `server.host`"),
    ),
    Case(
        "env-llama-arg-negated",
        env("LLAMA_ARG_NO_KV_UNIFIED", "1"),
        "hosts.rig1.server.env.LLAMA_ARG_NO_KV_UNIFIED",
        ("--kv-unified/--no-kv-unified", "server.kv_unified"),
    ),
    Case(
        "env-llama-api-key",
        env("LLAMA_API_KEY", "sekrit"),
        "hosts.rig1.server.env.LLAMA_API_KEY",
        ("--api-key", "set `server.api_key_file`"),
    ),
    Case(
        "env-hf-token",
        env("HF_TOKEN", "hf_abc"),
        "hosts.rig1.server.env.HF_TOKEN",
        ("--hf-token", "is a secret", "llama-server needs no token"),
    ),
    Case(
        "env-token-suffix",
        env("GITHUB_TOKEN", "ghp_abc"),
        "hosts.rig1.server.env.GITHUB_TOKEN",
        ("looks like a secret", "every user there can read", "keep secrets out"),
    ),
    Case(
        "env-password-suffix",
        env("DB_PASSWORD", "hunter2"),
        "hosts.rig1.server.env.DB_PASSWORD",
        ("looks like a secret",),
    ),
    Case(
        "env-secret-in-lower-case",
        env("hf_token", "hf_abc"),
        "hosts.rig1.server.env.hf_token",
        ("looks like a secret",),
    ),
    Case(
        "env-config-file-of-its-own",
        env("XDG_CONFIG_HOME", "/tmp/cfg"),
        "hosts.rig1.server.env.XDG_CONFIG_HOME",
        ("config.ini", "remove it from `server.env`"),
    ),
    Case(
        "env-cuda-visible-devices",
        env("CUDA_VISIBLE_DEVICES", "1"),
        "hosts.rig1.server.env.CUDA_VISIBLE_DEVICES",
        ("renumber the GPUs", "choose the GPUs with `gpus`"),
    ),
    Case(
        "env-set-by-llamarig",
        env("CUDA_DEVICE_ORDER", "FASTEST_FIRST"),
        "hosts.rig1.server.env.CUDA_DEVICE_ORDER",
        ("set by llamarig to PCI_BUS_ID", "remove it from `server.env`"),
    ),
    # --- item 4: settings that contradict each other, llama.cpp or the hardware ----------------
    Case(
        "split-none-with-tensor-split",
        host("server: {split_mode: none, tensor_split: [1, 1]}"),
        "hosts.rig1.server.tensor_split",
        ("`split_mode: none` serves from one", "remove tensor_split (null)"),
    ),
    Case(
        "parallel-above-llama-max-seq",
        host("server: {parallel: 300}"),
        "hosts.rig1.server.parallel",
        ("300 slots", "LLAMA_MAX_SEQ", "set at most 256"),
    ),
    Case(
        "gpu-name-and-capability-disagree",
        gpus('{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "12.0"}'),
        "hosts.rig1.gpus.0.compute_capability",
        ("is not that of NVIDIA GeForce RTX 3090, which is 8.6", 'compute_capability: "8.6"'),
    ),
    Case(
        "vram-in-gib",
        gpus('{name: NVIDIA GeForce RTX 3090, vram_mib: 24, compute_capability: "8.6"}'),
        "hosts.rig1.gpus.0.vram_mib",
        ("24 looks like GiB", "24 GiB is 24576 MiB"),
    ),
    Case(
        "vram-in-bytes",
        gpus('{name: NVIDIA GeForce RTX 3090, vram_mib: 25769803776, compute_capability: "8.6"}'),
        "hosts.rig1.gpus.0.vram_mib",
        ("looks like bytes", "are 24576 MiB", "give MiB"),
    ),
    Case(
        "driver-branch-below-toolkit",
        host("driver: {branch: 570}"),
        "hosts.rig1.driver.branch",
        ("570 is below what CUDA 13.0 needs (driver 580.65.06", "set `driver.branch: 580`"),
    ),
    Case(
        "driver-branch-below-gpu",
        gpus(GPU_5080, text=host('cuda: {version: "12.8"}', "driver: {branch: 560}")),
        "hosts.rig1.driver.branch",
        ("compute capability 12.0 (Blackwell) needs (driver 570.26", "driver.branch: 580"),
    ),
    Case(
        "cuda-architectures-miss-a-gpu",
        gpus(GPU_3090, GPU_5080, text=host('llama_cpp: {cuda_architectures: "86-real"}')),
        "hosts.rig1.llama_cpp.cuda_architectures",
        ("no code that runs on NVIDIA GeForce RTX 5080 (compute 12.0", 'add "120a-real"'),
    ),
    Case(
        "cuda-architectures-121-for-a-120-card",
        gpus(GPU_5080, text=host('llama_cpp: {cuda_architectures: "89-real;121-real"}')),
        "hosts.rig1.llama_cpp.cuda_architectures",
        ("12X is built as 12Xa, which runs only on 12.X", 'add "120a-real"'),
    ),
    Case(
        "cuda-architectures-ptx-only",
        host('llama_cpp: {cuda_architectures: "80-virtual"}'),
        "hosts.rig1.llama_cpp.cuda_architectures",
        ("PTX alone is not enough", 'add "86-real"'),
    ),
    Case(
        "cmake-option-overrides-architectures",
        host('llama_cpp: {cmake_options: {CMAKE_CUDA_ARCHITECTURES: "86"}}'),
        "hosts.rig1.llama_cpp.cmake_options.CMAKE_CUDA_ARCHITECTURES",
        ("is derived by llamarig", "set `llama_cpp.cuda_architectures` instead"),
    ),
    Case(
        "cmake-option-overrides-native",
        host("llama_cpp: {cmake_options: {GGML_NATIVE: true}}"),
        "hosts.rig1.llama_cpp.cmake_options.GGML_NATIVE",
        ("is derived by llamarig", "GPUs are not the target's"),
    ),
    Case(
        "targets-without-llama-server",
        host("llama_cpp: {targets: [llama-bench]}"),
        "hosts.rig1.llama_cpp.targets",
        ("lacks llama-server", "`standalone` host", "add it"),
    ),
    Case(
        "nvcc-of-another-toolkit",
        host("cuda: {nvcc: /usr/local/cuda-12.8/bin/nvcc}"),
        "hosts.rig1.cuda.nvcc",
        ("the nvcc of CUDA 12.8", 'but `cuda.version` is "13.0"', "set `cuda.nvcc: auto`"),
    ),
    Case(
        "models-inside-the-checkout",
        host("paths: {models: /opt/llamarig/src/llama.cpp/models}"),
        "hosts.rig1.paths.models",
        ("inside /opt/llamarig/src/llama.cpp", "git clean -ffdx", "keep models outside"),
    ),
    Case(
        "model-path-inside-the-builds",
        edit(
            'url: https://example.org/m.gguf\n            sha256: "' + "a" * 64 + '"',
            "path: /opt/llamarig/builds/old/m.gguf",
        ),
        "hosts.rig1.model.path",
        ("inside /opt/llamarig/builds", "llama_cpp.keep_builds"),
    ),
    Case(
        "pci-bus-id-unquoted",
        gpus(
            '{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6", '
            "pci_bus_id: 0000:01:00.0}"
        ),
        "hosts.rig1.gpus.0.pci_bus_id",
        ("60.0 is a number", "base 60", "quote it"),
    ),
    Case(
        "model-url-file-scheme",
        edit("https://example.org/m.gguf", "file:///srv/models/m.gguf"),
        "hosts.rig1.model.url",
        ("is a local file", "use `model.path`"),
    ),
    Case(
        "model-url-hugging-face-blob",
        edit("https://example.org/m.gguf", "https://huggingface.co/o/r/blob/main/m.gguf"),
        "hosts.rig1.model.url",
        ("(/blob/), which serves HTML", "use /resolve/", "huggingface.co/o/r/resolve/main"),
    ),
    # --- item 4: RPC layouts that cannot work ----------------------------------------------
    Case(
        "rpc-worker-under-two-heads",
        rpc(second_head=SECOND_HEAD),
        "hosts.head2.rpc.workers",
        ("names `worker2`, which is already a worker of `head`", "its own workers"),
    ),
    Case(
        "rpc-two-workers-of-one-box-on-one-port",
        rpc(worker2_ssh="10.0.0.11", worker2_port="50052"),
        "hosts.worker2.rpc.port",
        ("50052 is also the rpc.port of worker `worker1`", "same machine"),
    ),
    Case(
        "rpc-loopback-worker-on-another-box",
        rpc(worker1_rpc="127.0.0.1"),
        "hosts.worker1.rpc.host",
        ("127.0.0.1 is loopback", "head `head` on another box (10.0.0.10)", "private address"),
    ),
    Case(
        "rpc-public-worker-address",
        rpc(worker1_rpc="8.8.8.8"),
        "hosts.worker1.rpc.host",
        ("8.8.8.8 is a public address", "no authentication", "`rpc.allow_public: true`"),
    ),
    Case(
        "localhost-and-127-are-one-machine",
        edit("{host: 192.0.2.1, user: root}", "{host: 127.0.0.1, port: 2222}")
        + "        rig2:\n          ssh: {host: localhost, port: 2222}\n"
        "          server: {service: other, port: 8080}\n"
        "          paths: {env_file: /etc/llamarig/other.env}\n"
        f"          gpus: [{GPU_3090}]\n"
        "          model: {path: /srv/m.gguf}\n",
        "hosts.rig2.server.port",
        ("8080 is also the server.port of host `rig1`", "same machine (ssh 127.0.0.1 port 2222)"),
    ),
]

BY_ID = {case.id: case for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_rule_is_refused_with_file_key_and_fix(case, tmp_path):
    assert_refused_by_name(case, tmp_path)


def test_every_case_is_distinct():
    assert len(BY_ID) == len(CASES)
    assert len({case.text for case in CASES}) == len(CASES)


def test_escape_hatches_still_carry_what_llamarig_does_not_plan(tmp_path):
    """Sampling, logging and unrelated variables pass; `--no-host` (host buffers) is not the
    negation of `--host`, and a value that looks like an option is not read as one."""
    text = host(
        "server:",
        "  extra_args: [--temp, '0.7', --no-host, -lv, '4', --tags, 'team-a', --no-warmup]",
        "  env: {NCCL_NVLS_ENABLE: '0', LLAMA_ARG_TEMPERATURE: '0.6', GGML_CUDA_GRAPHS: '1'}",
    )
    path = tmp_path / "rig.yml"
    path.write_text(text)
    server = load_inventory(path).hosts["rig1"].data["server"]
    assert server["extra_args"][:3] == ["--temp", "0.7", "--no-host"]
    assert server["env"]["NCCL_NVLS_ENABLE"] == "0"


def test_public_worker_address_with_the_opt_in(tmp_path):
    path = tmp_path / "rig.yml"
    path.write_text(
        rpc(worker1_rpc="8.8.8.8", worker2_extra=", allow_public: true").replace(
            "port: 50052}", "port: 50052, allow_public: true}"
        )
    )
    hosts = load_inventory(path).hosts
    assert hosts["head"].data["rpc"]["endpoints"][0] == "8.8.8.8:50052"


def test_containers_sharing_loopback_may_use_a_loopback_worker(tmp_path):
    """The sandbox layout: head and worker are containers reached on 127.0.0.1 at two SSH
    ports, sharing this machine's loopback."""
    path = tmp_path / "rig.yml"
    path.write_text(
        rpc(head_ssh="127.0.0.1", worker1_rpc="127.0.0.1").replace(
            "ssh: {host: 10.0.0.11}", "ssh: {host: localhost, port: 2227}"
        )
    )
    hosts = load_inventory(path).hosts
    assert hosts["head"].data["rpc"]["endpoints"][0] == "127.0.0.1:50052"


@pytest.mark.parametrize(
    ("architectures", "capability"),
    [("80-real", "8.6"), ("86", "8.6"), ("120f-real", "12.1"), ("120-real", "12.0")],
)
def test_architectures_that_run_on_the_gpu_pass(tmp_path, architectures, capability):
    """SASS of the same major and a lower minor runs (8.0 on 8.6), a family target runs on its
    major; a plain 120 is built as 120a, which runs on 12.0."""
    gpu = f'{{name: Some GPU, vram_mib: 24576, compute_capability: "{capability}"}}'
    path = tmp_path / "rig.yml"
    path.write_text(gpus(gpu, text=host(f'llama_cpp: {{cuda_architectures: "{architectures}"}}')))
    assert load_inventory(path).hosts["rig1"].data["llama_cpp"]["cuda_architectures"]


REMOVED_BEFORE_THE_PIN = {"--no-mmap", "--mmap", "--mlock"}


def test_guarded_spellings_are_those_of_the_pinned_arg_cpp(llama_mirror):
    """Every spelling and variable of the table is in the pinned common/arg.cpp (read from the
    local mirror of the pinned commit), and each option's table row lists all its spellings."""
    from llamarig.config import defaults

    commit = defaults()["llama_cpp"]["commit"]
    shown = subprocess.run(
        ["git", f"--git-dir={llama_mirror}", "show", f"{commit}:common/arg.cpp"],
        capture_output=True,
        text=True,
        check=True,
    )
    # each option's names, and its negations: common_arg({"-x", "--xx"}, {"--no-xx"}, ...
    declared = [
        {name for group in match for name in re.findall(r'"([^"]+)"', group)}
        for match in re.findall(r"common_arg\(\s*\{([^}]*)\}\s*,\s*(?:\{([^}]*)\})?", shown.stdout)
    ]
    variables = set(re.findall(r'set_env\("([^"]+)"\)', shown.stdout))
    for entry in GUARDED:
        for flag in set(entry.flags) - REMOVED_BEFORE_THE_PIN:
            options = [names for names in declared if flag in names]
            assert options, flag
            for names in options:  # no spelling of the option is missing from its row
                assert names <= set(entry.flags), (flag, names - set(entry.flags))
    for name in GUARDED_ENV:
        assert name.replace("LLAMA_ARG_NO_", "LLAMA_ARG_") in variables, name
