"""Every bad inventory is refused before any connection, cleanly: the loader raises ConfigError
(never another exception), and the problem names the file, the exact key path, what is wrong
and what would be right. A few cases also go through `pyinfra inventory.py` and `llamarig plan`,
which must exit 2 without a traceback.

Each case is one mistake a user can make in a rig file; CASES is the whole table."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from llamarig.config import ConfigError, load_inventory
from tests.conftest import PROJECT, offline, pyinfra_env

SHA = "a" * 64
GPU_3090 = '{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}'
GPU_5080 = '{name: NVIDIA GeForce RTX 5080, vram_mib: 16303, compute_capability: "12.0"}'
GPU_V100 = '{name: Tesla V100-SXM2-32GB, vram_mib: 32768, compute_capability: "7.0"}'

BASE = f"""\
all:
  children:
    rigs:
      hosts:
        rig1:
          ssh: {{host: 192.0.2.1, user: root}}
          gpus:
            - {GPU_3090}
            - {GPU_3090}
          model:
            url: https://example.org/m.gguf
            sha256: "{SHA}"
"""
DEFAULTS = "group_data/all.yml"


def host(*lines: str) -> str:
    """BASE with more settings on rig1 (inserted before its model)."""
    extra = "".join(f"          {line}\n" for line in lines)
    return BASE.replace("          model:\n", f"{extra}          model:\n", 1)


def edit(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def gpus(*models: str, text: str = BASE) -> str:
    """BASE (or ``text``) with rig1's GPUs replaced."""
    listed = "".join(f"            - {model}\n" for model in models)
    return edit(f"            - {GPU_3090}\n            - {GPU_3090}\n", listed, text)


def second_host(settings: str) -> str:
    """BASE with a second host, rig2, in the same group."""
    return BASE + (
        f"        rig2:\n          {settings}\n          gpus: [{GPU_3090}]\n"
        "          model: {path: /srv/m.gguf}\n"
    )


@dataclass(frozen=True)
class Case:
    id: str
    text: str | bytes | None  # None: the file does not exist
    key: str  # the exact key path the problem names; "" for the file as a whole
    words: tuple[str, ...]  # what is wrong and the fix, as the problem must say them
    where: str = ""  # ":LINE" or ":LINE:COLUMN" after the file name
    origin: str | None = None  # the file named; None: the inventory itself


CASES = [
    # --- wrong types ---------------------------------------------------------------------------
    Case(
        "port-is-a-string",
        host("server: {port: eighty}"),
        "hosts.rig1.server.port",
        ("'eighty' is a string", "expected a TCP port"),
    ),
    Case(
        "port-is-a-float",
        host("server: {port: 8080.0}"),
        "hosts.rig1.server.port",
        ("8080.0 is a number with a fraction, not a whole number", "expected a TCP port"),
    ),
    Case(
        "ctx-is-a-list",
        host("server: {ctx: [4096]}"),
        "hosts.rig1.server.ctx",
        ("[4096] is not valid", "expected a context size in tokens"),
    ),
    Case(
        "gpus-is-a-string",
        gpus(text=host()).replace("          gpus:\n", "          gpus: RTX 3090\n"),
        "hosts.rig1.gpus",
        ("'RTX 3090' is a string", "expected a list of GPUs"),
    ),
    Case(
        "ssh-port-quoted",
        edit("{host: 192.0.2.1, user: root}", '{host: 192.0.2.1, port: "22"}'),
        "hosts.rig1.ssh.port",
        ("'22' is a string", "1-65535"),
    ),
    Case(
        "parallel-is-fractional",
        host("server: {parallel: 1.5}"),
        "hosts.rig1.server.parallel",
        ("1.5 is a number with a fraction", "a number of slots"),
    ),
    Case(
        "http-timeout-carries-shell-text",
        host('server: {http_timeouts: {probe: "15; id"}}'),
        "hosts.rig1.server.http_timeouts.probe",
        ("'15; id' is a string", "seconds for /health"),
    ),
    Case(
        "http-timeout-of-zero",
        host("server: {http_timeouts: {connect: 0}}"),
        "hosts.rig1.server.http_timeouts.connect",
        ("0", "seconds to connect"),
    ),
    Case(
        "http-timeout-misspelled",
        host("server: {http_timeouts: {probes: 30}}"),
        "hosts.rig1.server.http_timeouts.probes",
        ("unknown key `probes`", "did you mean `probe`?"),
    ),
    Case(
        "bare-off-is-a-boolean",
        host("server: {flash_attn: off}"),
        "hosts.rig1.server.flash_attn",
        ("False is not allowed", "quote it"),
    ),
    Case(
        "model-rehash-is-a-string",
        edit(f'sha256: "{SHA}"\n', f'sha256: "{SHA}"\n            rehash: "yes"\n'),
        "hosts.rig1.model.rehash",
        ("'yes' is a string", "false, or true to hash every model file on every run"),
    ),
    Case(
        "compute-capability-unquoted",
        gpus("{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: 8.6}", GPU_3090),
        "hosts.rig1.gpus.0.compute_capability",
        ("8.6 is a number", 'a quoted compute capability such as "8.6"'),
    ),
    Case(
        "cuda-version-unquoted",
        host("cuda: {version: 12.8}"),
        "hosts.rig1.cuda.version",
        ("12.8 is a number", "a toolkit version as a quoted string"),
    ),
    Case(
        "driver-open-is-a-string",
        host('driver: {open: "yes"}'),
        "hosts.rig1.driver.open",
        ("'yes' is a string", "expected true for the open kernel modules"),
    ),
    Case(
        "extra-args-not-a-list",
        host("server: {extra_args: --no-warmup}"),
        "hosts.rig1.server.extra_args",
        ("'--no-warmup' is a string", "expected a list of strings"),
    ),
    Case(
        "split-tolerance-nan",
        host("expect: {split_tolerance: .nan}"),
        "hosts.rig1.expect.split_tolerance",
        ("nan is not a finite number", "expected a fraction"),
    ),
    Case(
        "env-name-with-a-hyphen",
        host("server: {env: {CUDA-VISIBLE-DEVICES: '0'}}"),
        "hosts.rig1.server.env.CUDA-VISIBLE-DEVICES",
        ("has the wrong form", "expected a name of letters, digits and _"),
    ),
    Case(
        "target-with-a-space",
        host("llama_cpp: {targets: [llama server]}"),
        "hosts.rig1.llama_cpp.targets.0",
        ("'llama server' has the wrong form", "expected a string, matching"),
    ),
    Case(
        "host-key-checking-unknown",
        edit("{host: 192.0.2.1, user: root}", "{host: 192.0.2.1, host_key_checking: no}"),
        "hosts.rig1.ssh.host_key_checking",
        ("False is not allowed", "strict", "accept-new"),
    ),
    # --- unknown keys ----------------------------------------------------------------------------
    Case(
        "unknown-host-key",
        host("servr: {port: 9000}"),
        "hosts.rig1.servr",
        ("unknown key `servr`", "did you mean `server`?"),
    ),
    Case(
        "unknown-server-key",
        host("server: {ctxx: 8192}"),
        "hosts.rig1.server.ctxx",
        ("unknown key `ctxx`", "did you mean `ctx`?"),
    ),
    Case(
        "unknown-nested-key",
        host("server: {spec: {typ: [ngram-mod]}}"),
        "hosts.rig1.server.spec.typ",
        ("unknown key `typ`", "did you mean `type`?"),
    ),
    Case(
        "unknown-gpu-key",
        gpus("{name: NVIDIA GeForce RTX 3090, vram: 24576, compute_capability: '8.6'}", GPU_3090),
        "hosts.rig1.gpus.0.vram",
        ("unknown key `vram`", "did you mean `vram_mib`?"),
    ),
    Case(
        "unknown-key-in-group-vars",
        edit("    rigs:\n", "    rigs:\n      vars:\n        severs: {port: 9000}\n"),
        "hosts.rig1.severs",
        ("unknown key `severs`", "did you mean `server`?"),
    ),
    Case(
        "unknown-group-key",
        edit("      hosts:\n", "      host:\n"),
        "all.children.rigs.host",
        ("unknown group key", "did you mean `hosts`?"),
    ),
    Case(
        "unknown-top-level-key",
        BASE + "rigs2:\n  hosts: {rig2: {}}\n",
        "rigs2",
        ("unknown top-level key", "goes under `all: children:`"),
    ),
    Case(
        "no-all-at-the-top",
        BASE.replace("all:", "al:", 1),
        "",
        ("no `all:`", "did you mean `all`?"),
    ),
    # --- tensor split ----------------------------------------------------------------------------
    Case(
        "tensor-split-too-many",
        host("server: {tensor_split: [1, 2, 3]}"),
        "hosts.rig1.server.tensor_split",
        ("has 3 entries for 2 declared GPUs", "one share per GPU"),
    ),
    Case(
        "tensor-split-too-few",
        host("server: {split_mode: tensor, tensor_split: [1]}"),
        "hosts.rig1.server.tensor_split",
        ("has 1 entry for 2 declared GPUs", "one share per GPU"),
    ),
    Case(
        "tensor-split-all-zero",
        host("server: {tensor_split: [0, 0]}"),
        "hosts.rig1.server.tensor_split",
        ("needs at least one non-zero share",),
    ),
    Case(
        "tensor-split-negative",
        host("server: {tensor_split: [-1, 2]}"),
        "hosts.rig1.server.tensor_split",
        ("[-1, 2] is not valid", "non-negative numbers, one per GPU"),
    ),
    # --- context ---------------------------------------------------------------------------------
    Case(
        "ctx-negative",
        host("server: {ctx: -4096}"),
        "hosts.rig1.server.ctx",
        ("-4096 is not valid", "from 256 to 16777216"),
    ),
    Case(
        "ctx-zero",
        host("server: {ctx: 0}"),
        "hosts.rig1.server.ctx",
        ("0 is not valid", "from 256 to 16777216"),
    ),
    Case(
        "ctx-absurd",
        host("server: {ctx: 1000000000}"),
        "hosts.rig1.server.ctx",
        ("1000000000 is not valid", "16777216 (16M, above any model's trained context)"),
    ),
    # --- KV cache --------------------------------------------------------------------------------
    Case(
        "kv-type-unknown",
        host("server: {cache_type_k: q8}"),
        "hosts.rig1.server.cache_type_k",
        ("'q8' is not allowed", "a KV cache type: f32, f16, bf16, q8_0"),
    ),
    Case(
        "quantized-v-without-flash-attention",
        host("server: {cache_type_v: q8_0, flash_attn: 'off'}"),
        "hosts.rig1.server.cache_type_v",
        ("quantized V cache", "without flash attention", "set `flash_attn: auto`"),
    ),
    Case(
        "kv-type-tensor-mode-refuses",
        host("server: {split_mode: tensor, cache_type_k: iq4_nl, cache_type_v: iq4_nl}"),
        "hosts.rig1.server.cache_type_v",
        ("`iq4_nl` has no CUDA flash-attention kernel", "`split_mode: tensor`", "q8_0"),
    ),
    Case(
        "tensor-mode-flash-attention-off",
        host("server: {split_mode: tensor, flash_attn: 'off'}"),
        "hosts.rig1.server.flash_attn",
        ("refused by `split_mode: tensor`", "set `on` or `auto`"),
    ),
    Case(
        "row-split",
        host("server: {split_mode: row}"),
        "hosts.rig1.server.split_mode",
        ("does not support split buffers", "use `tensor`"),
    ),
    # --- toolkit and driver against the declared GPUs ---------------------------------------------
    Case(
        "blackwell-with-cuda-12.4",
        gpus(GPU_5080, GPU_3090, text=host('cuda: {version: "12.4"}')),
        "hosts.rig1.cuda.version",
        ("NVIDIA GeForce RTX 5080 (compute 12.0", "needs CUDA 12.8", 'cuda.version: "12.8"'),
    ),
    Case(
        "blackwell-with-proprietary-modules",
        gpus(GPU_5080, GPU_3090, text=host("driver: {open: false}")),
        "hosts.rig1.driver.open",
        ("RTX 5080", "open kernel modules", "set `driver.open: true`"),
    ),
    Case(
        "blackwell-with-debian-toolkit",
        gpus(GPU_5080, GPU_3090, text=host("cuda: {source: distro}")),
        "hosts.rig1.cuda.source",
        ("cannot build for NVIDIA GeForce RTX 5080", "set `cuda.source: nvidia-repo`"),
    ),
    Case(
        "volta-with-cuda-13",
        gpus(GPU_V100, GPU_V100, text=host("driver: {open: false}")),
        "hosts.rig1.cuda.version",
        ("dropped compute capability below 7.5", 'set `cuda.version: "12.9"`'),
        origin=DEFAULTS,  # the default "13.0" is what does not fit; the message says so
    ),
    Case(
        "volta-with-open-modules",
        gpus(GPU_V100, GPU_V100, text=host('cuda: {version: "12.9"}')),
        "hosts.rig1.driver.open",
        ("needs Turing (7.5) or newer, not Tesla V100", "set `driver.open: false`"),
        origin=DEFAULTS,
    ),
    Case(
        "same-gpu-twice",
        gpus(
            "{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: '8.6', "
            "pci_bus_id: '0000:01:00.0'}",
            "{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: '8.6', "
            "pci_bus_id: '01:00.0'}",
        ),
        "hosts.rig1.gpus.1.pci_bus_id",
        ("is also the bus id of gpus.0", "each GPU has its own"),
    ),
    # --- ports -----------------------------------------------------------------------------------
    Case(
        "server-port-is-the-ssh-port",
        edit(
            "{host: 192.0.2.1, user: root}",
            "{host: 192.0.2.1, port: 2222}",
            host("server: {port: 2222}"),
        ),
        "hosts.rig1.server.port",
        ("2222 is also the host's SSH port", "pick another, such as 8080"),
    ),
    Case(
        "two-hosts-one-machine-one-port",
        second_host("ssh: {host: 192.0.2.1, user: admin}"),
        "hosts.rig2.server.port",
        ("8080 is also the server.port of host `rig1`", "same machine (ssh 192.0.2.1 port 22)"),
    ),
    Case(
        "two-hosts-one-machine-one-unit",
        second_host("ssh: {host: 192.0.2.1}\n          server: {port: 8081}"),
        "hosts.rig2.server.service",
        ("llama-server is also the server.service of host `rig1`", "its own server.service"),
    ),
    Case(
        "two-local-hosts",
        edit("{host: 192.0.2.1, user: root}", "{local: true}", second_host("ssh: {local: true}")),
        "hosts.rig2.ssh.local",
        ("`rig1` already converges this machine", "keep one of them"),
    ),
    Case(
        "privileged-port",
        host("server: {port: 80}"),
        "hosts.rig1.server.port",
        ("80 is a privileged port", "such as 8080"),
    ),
    Case(
        "port-above-65535",
        host("server: {port: 70000}"),
        "hosts.rig1.server.port",
        ("70000 is out of range (above 65535)", "1-65535"),
    ),
    Case(
        "ssh-port-zero",
        edit("{host: 192.0.2.1, user: root}", "{host: 192.0.2.1, port: 0}"),
        "hosts.rig1.ssh.port",
        ("0 is out of range (below 1)", "1-65535"),
    ),
    # --- model and checksums ---------------------------------------------------------------------
    Case(
        "sha256-too-short",
        edit(SHA, SHA[:63]),
        "hosts.rig1.model.sha256",
        ("has the wrong form (63 characters)", "64 lowercase hex digits (sha256sum FILE)"),
    ),
    Case(
        "sha256-not-hex",
        edit(SHA, "z" * 64),
        "hosts.rig1.model.sha256",
        ("has the wrong form", "64 lowercase hex digits"),
    ),
    Case(
        "sha256-upper-case",
        edit(SHA, "A" * 64),
        "hosts.rig1.model.sha256",
        ("has the wrong form", "64 lowercase hex digits"),
    ),
    Case(
        "sha256-missing",
        edit(f'            sha256: "{SHA}"\n', ""),
        "hosts.rig1.model.sha256",
        ("is required with `url`", "sha256sum FILE"),
    ),
    Case(
        "model-neither-url-nor-path",
        edit("            url: https://example.org/m.gguf\n", ""),
        "hosts.rig1.model",
        ("has neither `url`, `path` nor `hf`", "set `url`"),
    ),
    Case(
        "model-both-url-and-path",
        BASE + "            path: /srv/m.gguf\n",
        "hosts.rig1.model",
        ("set exactly one of `url`",),
    ),
    Case(
        "model-url-not-http",
        edit("https://example.org/m.gguf", "ftp://example.org/m.gguf"),
        "hosts.rig1.model.url",
        ("has the wrong form", "an http(s) URL"),
    ),
    Case(
        "model-path-relative",
        edit("url: https://example.org/m.gguf", "path: models/m.gguf"),
        "hosts.rig1.model.path",
        ("'models/m.gguf' is not an absolute path", "give the path from /"),
    ),
    Case(
        "commit-is-a-branch",
        host("llama_cpp: {commit: master}"),
        "hosts.rig1.llama_cpp.commit",
        ("'master' has the wrong form", "a full 40-character lowercase commit id"),
    ),
    Case(
        "commit-39-hex",
        host(f"llama_cpp: {{commit: {'0c1e57098bba43ac29e6e3b677cdceebdd22334f'[:39]}}}"),
        "hosts.rig1.llama_cpp.commit",
        ("has the wrong form (39 characters)", "40-character"),
    ),
    # --- API key ---------------------------------------------------------------------------------
    Case(
        "network-listener-without-api-key",
        host("server: {host: 0.0.0.0}"),
        "hosts.rig1.server.host",
        ("0.0.0.0 exposes the API to the network", "set `server.api_key_file`"),
    ),
    Case(
        "api-key-file-missing",
        host("server: {host: 0.0.0.0, api_key_file: /nonexistent/llamarig/rig1.key}"),
        "hosts.rig1.server.api_key_file",
        ("does not exist or is empty", "openssl rand -hex 32"),
    ),
    Case(
        "api-key-file-relative",
        host("server: {host: 0.0.0.0, api_key_file: keys/rig1.key}"),
        "hosts.rig1.server.api_key_file",
        ("'keys/rig1.key' is not valid", "the path (on the machine running llamarig)"),
    ),
    # --- ssh -------------------------------------------------------------------------------------
    Case(
        "ssh-without-host",
        edit("{host: 192.0.2.1, user: root}", "{user: root}"),
        "hosts.rig1.ssh.host",
        ("is missing", "or set `ssh.local: true`"),
    ),
    Case(
        "ssh-local-and-host",
        edit("{host: 192.0.2.1, user: root}", "{host: 192.0.2.1, local: true}"),
        "hosts.rig1.ssh.local",
        ("yet `host` names another", "remove one of them"),
    ),
    # --- the file itself -------------------------------------------------------------------------
    Case("file-missing", None, "", ("file not found", "set RIG_INVENTORY")),
    Case("file-empty", "", "", ("the file is empty", "write `all:`")),
    Case("file-only-comments", "# rig1: to do\n", "", ("the file is empty", "write `all:`")),
    Case(
        "top-level-list",
        "- rig1\n- rig2\n",
        "",
        ("the top level is a list", "a mapping with one key, `all:`"),
    ),
    Case(
        "top-level-string",
        "rig1 192.0.2.1\n",
        "",
        ("the top level is a string", "a mapping with one key, `all:`"),
    ),
    Case(
        "all-is-a-list",
        "all:\n  - rig1\n",
        "all",
        ("is a list", "a mapping of `vars:`, `hosts:` and `children:`"),
    ),
    Case(
        "hosts-is-a-list",
        "all:\n  children:\n    rigs:\n      hosts:\n        - rig1\n",
        "all.children.rigs.hosts",
        ("is a list", "not a list `- rig1`"),
    ),
    Case(
        "children-is-a-list",
        "all:\n  children:\n    - rigs\n",
        "all.children",
        ("is a list", "a mapping of group names to groups"),
    ),
    Case(
        "host-settings-are-a-string",
        edit("        rig1:\n", "        rig1: 192.0.2.1\n        rig0:\n"),
        "hosts.rig1",
        ("is a string", "a mapping such as `ssh: {host: ...}`"),
    ),
    Case(
        "host-name-is-a-number",
        edit("        rig1:\n", "        1:\n"),
        "all.children.rigs.hosts.1",
        ("host name 1 is an integer", 'quote it: "1"'),
    ),
    Case(
        "group-inside-itself",
        BASE + "      children:\n        more:\n          children:\n            rigs:\n",
        "all.children.rigs.children.more",
        ("group `more` contains `rigs` already", "a loop"),
    ),
    Case(
        "yaml-unclosed-brace",
        edit("{host: 192.0.2.1, user: root}", "{host: 192.0.2.1, user: root"),
        "",
        ("YAML syntax error", "flow mapping that starts on line 6", "unclosed bracket"),
        where=":7:",
    ),
    Case(
        "yaml-tab-indent",
        edit("          gpus:\n", "\tgpus:\n"),
        "",
        ("YAML syntax error", "'\\t'", "indent with spaces"),
        where=":7:1",
    ),
    Case(
        "yaml-bad-indent",
        edit("          model:\n", "         model:\n"),
        "",
        ("YAML syntax error", "indentation"),
        where=":10:",
    ),
    Case(
        "yaml-key-twice",
        host("server: {port: 9000}", "server: {ctx: 8192}"),
        "",
        ("the key `server` is given twice", "first on line 10", "merge the two"),
        where=":11:11",
    ),
    Case(
        "yaml-impossible-date",
        host("model: {filename: 2024-13-45}").replace(
            "          model:\n            url", "          x:\n            url", 1
        ),
        "",
        ("cannot read the value '2024-13-45' as timestamp", "quote it"),
        where=":10:",
    ),
    Case(
        "chat-kwargs-date",
        host("server: {chat_template_kwargs: {when: 2024-01-01}}"),
        "hosts.rig1.server.chat_template_kwargs.when",
        ("is a date (quote it to keep it as text), which JSON cannot hold",),
    ),
    Case(
        "chat-kwargs-set",
        host("server: {chat_template_kwargs: {tags: !!set {a, b}}}"),
        "hosts.rig1.server.chat_template_kwargs.tags",
        ("is a set (!!set), which JSON cannot hold", "a string, number, boolean, list"),
    ),
    Case(
        "chat-kwargs-binary",
        host("server: {chat_template_kwargs: {blob: [!!binary aGk=]}}"),
        "hosts.rig1.server.chat_template_kwargs.blob.0",
        ("is binary data (!!binary), which JSON cannot hold",),
    ),
    Case(
        "chat-kwargs-key-not-text",
        host("server: {chat_template_kwargs: {1: one}}"),
        "hosts.rig1.server.chat_template_kwargs.1",
        ("the key 1 is an integer; JSON keys are text", 'quote it ("1")'),
    ),
    Case(
        "chat-kwargs-nan",
        host("server: {chat_template_kwargs: {temperature: .nan}}"),
        "hosts.rig1.server.chat_template_kwargs.temperature",
        ("nan is not a number JSON can hold",),
    ),
    Case(
        "yaml-recursive-alias",
        host("server: &s {chat_template_kwargs: *s}"),
        "",
        ("all.children.rigs.hosts.rig1.server.chat_template_kwargs", "recursive structure"),
    ),
    Case(
        "yaml-alias-bomb",
        "a0: &a0 [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"a{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 9)}]\n" for n in range(1, 9))
        + "all: {hosts: {rig1: {server: {extra_args: *a8}}}}\n",
        "",
        ("expands to more than 100000 values", "write aliases out plainly"),
    ),
    Case(
        "yaml-too-many-values-plainly",
        host("server: {extra_args: [" + ", ".join(["0"] * 100_001) + "]}"),
        "",
        ("all.children.rigs.hosts.rig1.server.extra_args", "more than 100000 values"),
    ),
    Case(
        "larger-than-the-cap",
        BASE + "# " + "x" * (1 << 20) + "\n",
        "",
        ("larger than 1024 KiB", "is it the right file?"),
    ),
    Case(
        "yaml-nested-too-deep",
        "all: {hosts: {rig1: {server: {chat_template_kwargs: {x: "
        + "[" * 100
        + "]" * 100
        + "}}}}}\n",
        "",
        ("nested more than 32 levels deep",),
    ),
    Case(
        "yaml-nested-beyond-the-parser",
        "all: " + "[" * 5000 + "]" * 5000 + "\n",
        "",
        ("YAML nested too deeply to read",),
    ),
    Case(
        "control-character-in-a-setting",
        edit(
            "{host: 192.0.2.1, user: root}", '{host: "192.0.2.1\\n  ProxyCommand sh", user: root}'
        ),
        "hosts.rig1.ssh.host",
        ("contains the control character '\\n'", "one line of plain text"),
    ),
    Case(
        "not-utf8",
        host("ssh: {user: r\xf6ot}").encode("latin-1"),
        "",
        ("not UTF-8 text (byte 0xf6", "save the file as UTF-8"),
        where=":10",
    ),
]


def write(case: Case, directory: Path) -> Path:
    path = directory / "rig.yml"
    if isinstance(case.text, bytes):
        path.write_bytes(case.text)
    elif case.text is not None:
        path.write_text(case.text)
    return path


def expected_prefix(case: Case, path: Path) -> str:
    origin = case.origin or str(path)
    return f"{origin}{case.where}" + (f": {case.key}: " if case.key else "")


def assert_refused_by_name(case: Case, directory: Path) -> None:
    """Loading ``case`` fails with a problem that names its file and key and holds its words."""
    path = write(case, directory)
    with pytest.raises(ConfigError) as caught:
        load_inventory(path)
    prefix = expected_prefix(case, path)
    named = [p for p in caught.value.problems if p.startswith(prefix)]
    assert named, f"no problem starts with {prefix!r}: {caught.value.problems}"
    assert any(all(word in p for word in case.words) for p in named), named


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_with_file_key_and_fix(case, tmp_path):
    path = write(case, tmp_path)
    with pytest.raises(ConfigError) as caught:  # any other exception fails the test
        load_inventory(path)
    problems = caught.value.problems
    assert problems and all(isinstance(p, str) and p.strip() for p in problems)
    for problem in problems:  # every problem names its file first
        assert problem.startswith((str(path), DEFAULTS)), problem
        assert "Traceback" not in problem
    prefix = expected_prefix(case, path)
    named = [p for p in problems if p.startswith(prefix)]
    assert named, f"no problem starts with {prefix!r}: {problems}"
    assert any(all(word in p for word in case.words) for p in named), named


BY_ID = {case.id: case for case in CASES}


def refused_by(command: list[str], case: Case, tmp_path: Path) -> None:
    """``command`` with RIG_INVENTORY naming the case's file exits 2, prints the problem, and
    no traceback."""
    path = write(case, tmp_path)
    result = subprocess.run(
        offline(command),
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY=str(path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output
    assert "llamarig: the rig configuration is not valid:" in result.stderr
    prefix = expected_prefix(case, path)
    lines = [line.strip() for line in result.stderr.splitlines()]
    assert any(line.startswith(prefix) for line in lines), result.stderr


@pytest.mark.parametrize(
    "case_id",
    ["port-is-a-string", "yaml-unclosed-brace", "not-utf8", "two-hosts-one-machine-one-port"],
)
def test_pyinfra_inventory_exits_2_without_traceback(case_id, tmp_path):
    command = [sys.executable, "-m", "pyinfra", "inventory.py", "deploy.py", "--dry"]
    refused_by(command, BY_ID[case_id], tmp_path)


@pytest.mark.parametrize(
    "case_id",
    ["blackwell-with-cuda-12.4", "top-level-list", "hosts-is-a-list", "ctx-absurd"],
)
def test_llamarig_plan_exits_2_without_traceback(case_id, tmp_path):
    """The version gate of a Blackwell GPU is refused when the inventory is loaded, before the
    plan (which checks probed GPUs and the installed driver the same way)."""
    refused_by([sys.executable, "-m", "llamarig.cli", "plan"], BY_ID[case_id], tmp_path)


def test_every_case_is_distinct():
    assert len(BY_ID) == len(CASES)
    texts = [case.text for case in CASES]
    assert len(set(texts)) == len(texts)


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_an_inventory_that_is_not_a_regular_file_is_refused_unread(special, tmp_path):
    """/dev/zero would be read until memory runs out, a FIFO until someone writes to it."""
    if special == "fifo":
        special = tmp_path / "rig.yml"
        os.mkfifo(special)
    with pytest.raises(ConfigError) as caught:
        load_inventory(Path(special))
    assert caught.value.problems == [f"{special}: is not a regular file; name a YAML file"]


def test_an_inventory_that_is_a_directory_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ConfigError) as caught:
        load_inventory(tmp_path)
    assert caught.value.problems == [
        f"{tmp_path}: is a directory; set RIG_INVENTORY to an inventory file in it"
    ]
