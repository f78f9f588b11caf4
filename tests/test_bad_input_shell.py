"""Strings in the wrong shape are refused before any connection, each with the key path and the
fix (llamarig/config/shapes.py): addresses, URLs, paths, package names and versions, file names,
unit names, and invisible or look-alike characters. One case per class, in the pattern of
tests/test_bad_input.py (write an inventory, load it, find the exact key path and the words)."""

from __future__ import annotations

import pytest
import yaml

from llamarig.config import load_inventory
from tests.test_bad_input import (
    BASE,
    Case,
    assert_refused_by_name,
    edit,
    host,
)

SSH = "{host: 192.0.2.1, user: root}"


def ssh(settings: str) -> str:
    return edit(SSH, settings)


def model(line: str) -> str:
    """BASE with one more line in rig1's model."""
    sha = f'            sha256: "{"a" * 64}"\n'
    return edit(sha, f"{sha}            {line}\n")


def worker(rpc_host: str) -> str:
    """BASE plus an rpc-worker host whose rpc.host is ``rpc_host``."""
    return BASE + (
        "        worker1:\n          ssh: {host: 192.0.2.2}\n          role: rpc-worker\n"
        f"          rpc: {{host: {rpc_host}}}\n"
    )


CASES = [
    # --- addresses ----------------------------------------------------------------------------
    Case(
        "ssh-host-command-substitution",
        ssh('{host: "$(touch /tmp/x)", user: root}'),
        "hosts.rig1.ssh.host",
        ("is not an IP address or a host name", "RFC 1123"),
    ),
    Case(
        "ssh-host-is-an-option",
        ssh('{host: "-oProxyCommand=touch /tmp/x", user: root}'),
        "hosts.rig1.ssh.host",
        ("starts with `-`", "read as an option"),
    ),
    Case(
        "ssh-host-with-user",
        ssh("{host: root@192.0.2.1}"),
        "hosts.rig1.ssh.host",
        ("holds a user", "put `root` in `ssh.user` and `192.0.2.1` here"),
    ),
    Case(
        "ssh-host-with-user-and-port",
        ssh("{host: 'root@192.0.2.1:2222'}"),
        "hosts.rig1.ssh.host",
        ("holds a user and a port", "`root` in `ssh.user`, 2222 in `ssh.port` and `192.0.2.1`"),
    ),
    Case(
        "ssh-host-with-user-and-bracketed-port",
        ssh("{host: 'root@[2001:db8::10]:2222'}"),
        "hosts.rig1.ssh.host",
        (
            "put `root` in `ssh.user`",
            "without brackets: 2001:db8::10",
            "put the port 2222 in `ssh.port`",
        ),
    ),
    Case(
        "ssh-host-with-port",
        ssh("{host: '192.0.2.1:2222', user: root}"),
        "hosts.rig1.ssh.host",
        ("holds a port", "put 2222 in `ssh.port` and `192.0.2.1` here"),
    ),
    Case(
        "ssh-host-in-brackets",
        ssh("{host: '[2001:db8::1]:2222', user: root}"),
        "hosts.rig1.ssh.host",
        ("is in brackets", "write the address without brackets: 2001:db8::1", "`ssh.port`"),
    ),
    Case(
        "ssh-host-is-a-url",
        ssh("{host: 'ssh://192.0.2.1', user: root}"),
        "hosts.rig1.ssh.host",
        ("is a URL", "give only the address"),
    ),
    Case(
        "ssh-host-bad-ipv4",
        ssh("{host: 192.0.2.300, user: root}"),
        "hosts.rig1.ssh.host",
        ("is not a valid IPv4 address",),
    ),
    Case(
        "ssh-host-wildcard",
        ssh("{host: 0.0.0.0, user: root}"),
        "hosts.rig1.ssh.host",
        ("is not an address to connect to",),
    ),
    Case(
        "ssh-user-with-address",
        ssh("{host: 192.0.2.1, user: root@192.0.2.1}"),
        "hosts.rig1.ssh.user",
        ("holds an address", "put it in `ssh.host`"),
    ),
    Case(
        "ssh-user-is-an-option",
        ssh("{host: 192.0.2.1, user: '-lroot'}"),
        "hosts.rig1.ssh.user",
        ("is not a login name", "e.g. root"),
    ),
    Case(
        "server-host-command-substitution",
        host("server: {host: '$(touch /tmp/x)'}"),
        "hosts.rig1.server.host",
        ("is not an IP address or a host name",),
    ),
    Case(
        "server-host-with-port",
        host("server: {host: '127.0.0.1:8080'}"),
        "hosts.rig1.server.host",
        ("holds a port", "put 8080 in `server.port`"),
    ),
    Case(
        "server-host-star",
        host("server: {host: '*', api_key_file: /etc/hostname}"),
        "hosts.rig1.server.host",
        ("`*` is not an address", "0.0.0.0"),
    ),
    Case(
        "server-host-ipv6-zone",
        host("server: {host: 'fe80::1%eth0', api_key_file: /etc/hostname}"),
        "hosts.rig1.server.host",
        ("IPv6 zone",),
    ),
    Case(
        "rpc-host-with-port",
        worker("'10.0.0.12:50052'"),
        "hosts.worker1.rpc.host",
        ("holds a port", "put 50052 in `rpc.port`"),
    ),
    Case(
        "rpc-host-command-substitution",
        worker("'10.0.0.12$(touch /tmp/x)'"),
        "hosts.worker1.rpc.host",
        ("is not an IP address or a host name",),
    ),
    # --- URLs ---------------------------------------------------------------------------------
    Case(
        "model-url-with-a-space",
        edit("https://example.org/m.gguf", "https://example.org/my model.gguf"),
        "hosts.rig1.model.url",
        ("contains a space", "percent-encode it (%20)"),
    ),
    Case(
        "model-url-without-host",
        edit("https://example.org/m.gguf", "https:///m.gguf"),
        "hosts.rig1.model.url",
        ("has no host",),
    ),
    Case(
        "model-url-bad-character",
        edit("https://example.org/m.gguf", '"https://example.org/m`id`.gguf"'),
        "hosts.rig1.model.url",
        ("contains '`'", "percent-encode it"),
    ),
    Case(
        "model-url-file-name-is-a-path",
        edit("https://example.org/m.gguf", "https://example.org/x%2F..%2Fm.gguf"),
        "hosts.rig1.model.url",
        ("the file name taken from the URL", "is a path", "set `model.filename`"),
    ),
    Case(
        "nvidia-repo-over-http",
        host("nvidia_repo: {url: 'http://mirror.example.org/cuda'}"),
        "hosts.rig1.nvidia_repo.url",
        ("is not a https URL", "installed as root", "`nvidia_repo.allow_insecure: true`"),
    ),
    Case(
        "nvidia-repo-url-injection",
        host("nvidia_repo: {url: 'https://x.org/$(touch /tmp/x) -o /etc/passwd'}"),
        "hosts.rig1.nvidia_repo.url",
        ("contains a space",),
    ),
    Case(
        "keyring-package-injection",
        host("nvidia_repo: {keyring_package: 'cuda-keyring;reboot'}"),
        "hosts.rig1.nvidia_repo.keyring_package",
        ("is not a Debian package name", "e.g. cuda-keyring"),
    ),
    Case(
        "keyring-version-with-epoch",
        host("nvidia_repo: {keyring_version: '1:1.1-1'}"),
        "hosts.rig1.nvidia_repo.keyring_version",
        ("is not a Debian version", "no epoch", "e.g. 1.1-1"),
    ),
    Case(
        "llama-repo-is-an-option",
        host("llama_cpp: {repo: '--upload-pack=touch /tmp/x'}"),
        "hosts.rig1.llama_cpp.repo",
        ("starts with `-`", "git reads as an option"),
    ),
    Case(
        "llama-repo-remote-helper",
        host("llama_cpp: {repo: 'ext::sh -c touch% /tmp/x'}"),
        "hosts.rig1.llama_cpp.repo",
        ("git remote helper", "can run commands"),
    ),
    Case(
        "llama-repo-unknown-scheme",
        host("llama_cpp: {repo: 'ftp://example.org/llama.cpp.git'}"),
        "hosts.rig1.llama_cpp.repo",
        ("is not a https or ssh or git or file URL", "git@host:path"),
    ),
    # --- paths --------------------------------------------------------------------------------
    Case(
        "path-with-tilde",
        host("paths: {models: ~/models}"),
        "hosts.rig1.paths.models",
        ("`~` is expanded only in", "`ssh.key`", "give the absolute path on the host"),
    ),
    Case(
        "path-with-variable",
        host("paths: {prefix: /opt/$USER}"),
        "hosts.rig1.paths.prefix",
        ("`$` is not expanded", "write the path out"),
    ),
    Case(
        "path-not-normalised",
        host("paths: {ccache: /var/cache/../cache//llamarig/}"),
        "hosts.rig1.paths.ccache",
        ("is not normalised", "write /var/cache/llamarig"),
    ),
    Case(
        "model-path-with-backslash",
        edit("url: https://example.org/m.gguf", "path: 'C:\\models\\m.gguf'").replace(
            f'            sha256: "{"a" * 64}"\n', ""
        ),
        "hosts.rig1.model.path",
        ("contains a backslash", "use `/`"),
    ),
    Case(
        "nvcc-relative-dots",
        host("cuda: {nvcc: /usr/local/cuda/./bin/nvcc}"),
        "hosts.rig1.cuda.nvcc",
        ("is not normalised", "write /usr/local/cuda/bin/nvcc"),
    ),
    Case(
        "ssh-key-with-variable",
        ssh("{host: 192.0.2.1, user: root, key: $HOME/.ssh/id_ed25519}"),
        "hosts.rig1.ssh.key",
        ("`$` is not expanded", "`~` works"),
    ),
    # --- file and unit names ------------------------------------------------------------------
    Case(
        "model-filename-with-directory",
        model("filename: models/m.gguf"),
        "hosts.rig1.model.filename",
        ("is a path", "give only the file name", "`paths.models`"),
    ),
    Case(
        "model-filename-is-an-option",
        model("filename: '-rf.gguf'"),
        "hosts.rig1.model.filename",
        ("starts with `-`", "rename it"),
    ),
    Case(
        "service-is-an-option",
        host("server: {service: '-llama'}"),
        "hosts.rig1.server.service",
        ("starts with '-'", "a unit name starts with a letter or digit"),
    ),
    Case(
        "service-with-its-suffix",
        host("server: {service: llama-server.service}"),
        "hosts.rig1.server.service",
        ("ends in `.service`, which llamarig adds", "write 'llama-server'"),
    ),
    Case(
        "nvidia-repo-url-with-the-distribution",
        host(
            "nvidia_repo: {url: "
            "'https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/'}"
        ),
        "hosts.rig1.nvidia_repo.url",
        (
            "already names a distribution (debian12/x86_64)",
            "give the base, https://developer.download.nvidia.com/compute/cuda/repos",
        ),
    ),
    # --- invisible and look-alike characters --------------------------------------------------
    Case(
        "zero-width-space-in-a-setting",
        ssh('{host: "192.0.2.1\\u200b", user: root}'),
        "hosts.rig1.ssh.host",
        ("contains U+200B ZERO WIDTH SPACE", "one line of plain text"),
    ),
    Case(
        "non-breaking-space-in-a-value",
        host('server: {env: {GREETING: "a\\u00a0b"}}'),
        "hosts.rig1.server.env.GREETING",
        ("contains U+00A0 NO-BREAK SPACE",),
    ),
    Case(
        "format-character-in-a-key",
        host('server: {env: {"GREETING\\u2060": "a"}}'),
        "hosts.rig1.server.env.GREETING\\u2060",
        ("contains U+2060 WORD JOINER",),
    ),
    Case(
        "right-to-left-override-in-a-file-name",
        model('filename: "m\\u202egguf.gguf"'),
        "hosts.rig1.model.filename",
        ("contains U+202E RIGHT-TO-LEFT OVERRIDE",),
    ),
    Case(
        "cyrillic-letter-in-an-enum",
        host('server: {split_mode: "l\\u0430yer"}'),
        "hosts.rig1.server.split_mode",
        ("is not allowed", "U+0430 CYRILLIC SMALL LETTER A", "type it in ASCII"),
    ),
    Case(
        "tab-in-a-setting",
        host('server: {extra_args: ["--seed\\t42"]}'),
        "hosts.rig1.server.extra_args.0",
        ("contains the control character '\\t' (U+0009)",),
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_string_in_the_wrong_shape_is_refused_with_key_and_fix(case, tmp_path):
    assert_refused_by_name(case, tmp_path)


# Hostile but valid: each loads, and keeps its value exactly.
VALID = [
    (model("filename: 'it''s \"a\" $(id) `id` 100% %n \\x.gguf'"), ("model", "filename")),
    (host("server: {env: {lower_name: \"a 'b' $HOME 100% %n\"}}"), ("server", "env")),
    (host("paths: {models: \"/srv/my models/(q8) 'x' 100%\"}"), ("paths", "models")),
    (host("nvidia_repo: {url: 'http://127.0.0.1/repo', allow_insecure: true}"), ("nvidia_repo",)),
    (host("llama_cpp: {repo: 'git@github.com:ggml-org/llama.cpp.git'}"), ("llama_cpp", "repo")),
    (ssh("{host: 2001:db8::1, user: deploy.user, key: '~/keys/rig 1%'}"), ("ssh",)),
    (host("server: {host: '::', api_key_file: /etc/hostname}"), ("server", "host")),
]


@pytest.mark.parametrize(("text", "key_path"), VALID, ids=[str(v[1]) for v in VALID])
def test_hostile_but_valid_strings_load(text, key_path, tmp_path):
    path = tmp_path / "rig.yml"
    path.write_text(text)
    value = load_inventory(path).hosts["rig1"].data
    written = yaml.safe_load(text)["all"]["children"]["rigs"]["hosts"]["rig1"]
    for part in key_path:
        value, written = value[part], written[part]
    if isinstance(written, dict):
        assert {key: value[key] for key in written} == written
    else:
        assert value == written
