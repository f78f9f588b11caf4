"""Property-based: every string of the rig data that reaches a command stays one literal
argument, or the loader refuses it before connecting (GUIDE §11).

Hostile strings (shell and systemd syntax, quotes, `%` specifiers, control, format and
look-alike characters) go into each field that reaches a command. What the loader accepts is
rendered through the real render functions and command builders, and read back by the rules of
whoever reads it: systemd's unit and environment-file rules (written out below from systemd's
source, src/basic/extract-word.c and env-file.c), a real `sh` for the env file and the launcher,
real OpenSSH (`ssh -G`) for ssh argv and ssh_config, and real bash for the deploy's shell
commands, whose external commands are shims that record the argv they get. A second property
feeds the builders arbitrary text without validation (defence in depth).

Derandomized, bounded examples, no deadline (as tests/test_config_properties.py)."""

from __future__ import annotations

import copy
import os
import shlex
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from llamarig import operations
from llamarig.config import ConfigError, load_inventory
from llamarig.config.ssh import SshTarget, ssh_alias, ssh_config_value
from llamarig.facts.server import ServerProbe
from llamarig.planner import render
from tests.conftest import default_http_timeouts

PROPERTY = settings(
    max_examples=int(os.environ.get("SHELL_EXAMPLES", 60)),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# --- readers: systemd's rules ---------------------------------------------------------------

C_ESCAPES = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t", "r": "\r", "s": " "}


def systemd_words(text: str) -> list[str]:
    """Words of a unit setting as extract_first_word(EXTRACT_UNQUOTE|EXTRACT_CUNESCAPE) reads
    them. Raises on what it does not model (so an unexpected spelling fails the test)."""
    words, word, i, quoted, in_word = [], [], 0, False, False
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            nxt = text[i + 1]
            if nxt == "x":
                word.append(chr(int(text[i + 2 : i + 4], 16)))
                i += 4
            else:
                word.append(C_ESCAPES[nxt])
                i += 2
            in_word = True
            continue
        if ch == '"':
            quoted, in_word = not quoted, True
        elif ch == "'" and not quoted:
            raise AssertionError(f"unexpected single quote in {text!r}")
        elif ch in " \t" and not quoted:
            if in_word:
                words.append("".join(word))
            word, in_word = [], False
        else:
            word.append(ch)
            in_word = True
        i += 1
    assert not quoted, f"unclosed quote in {text!r}"
    if in_word:
        words.append("".join(word))
    return words


def resolve_specifiers(word: str) -> str:
    """systemd's %-specifiers: %% is %, any other % would be expanded (a test failure)."""
    parts = word.split("%%")
    assert all("%" not in part for part in parts), f"an unescaped specifier in {word!r}"
    return "%".join(parts)


def resolve_dollars(word: str) -> str:
    """ExecStart's variables at exec time: $$ is $, any other $ would be substituted."""
    parts = word.split("$$")
    assert all("$" not in part for part in parts), f"an unescaped $ in {word!r}"
    return "$".join(parts)


def unit_setting(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(f"{key}=")]


def exec_start(unit: str) -> list[str]:
    (line,) = unit_setting(unit, "ExecStart")
    return [resolve_dollars(resolve_specifiers(word)) for word in systemd_words(line)]


def env_file_values(text: str) -> dict[str, str]:
    """An EnvironmentFile= as systemd's parse_env_file_internal reads one (the states used by
    `KEY="..."` lines and comments)."""
    values = {}
    for line in text.split("\n"):
        if not line or line[0] in "#;":
            continue
        key, _, rest = line.partition("=")
        assert rest.startswith('"') and rest.endswith('"'), line
        value, i, body = [], 0, rest[1:-1]
        while i < len(body):
            if body[i] == "\\":
                nxt = body[i + 1]
                value.append(nxt if nxt in '"\\`$' else "\\" + nxt)
                i += 2
            else:
                assert body[i] != '"', f"an unescaped quote in {line!r}"
                value.append(body[i])
                i += 1
        values[key.strip()] = "".join(value)
    return values


# --- readers: a real shell, real OpenSSH, shims ---------------------------------------------


def sh_environment(script: str) -> dict[str, str]:
    """The environment a real sh has after running ``script`` (from an empty one)."""
    result = subprocess.run(
        ["sh", "-c", f"{script}\nexec env -0"],
        env={"PATH": "/usr/bin:/bin"},
        capture_output=True,
        check=True,
    )
    pairs = (item.split("=", 1) for item in result.stdout.decode().split("\0")[:-1])
    return {k: v for k, v in pairs if k not in ("PATH", "PWD", "SHLVL", "_")}


def ssh_resolved(argv: list[str]) -> dict[str, list[str]]:
    """What OpenSSH makes of an ssh command line (``ssh -G``: no connection)."""
    result = subprocess.run(
        [argv[0], "-G", *argv[1:]], capture_output=True, text=True, check=True, timeout=10
    )
    resolved: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        key, _, value = line.partition(" ")
        resolved.setdefault(key, []).append(value)
    return resolved


SHIMMED = ("curl", "systemctl", "journalctl", "timeout", "git", "dpkg", "sleep")


class Shims:
    """A PATH whose external commands record their argv (NUL-separated, one file per call)."""

    def __init__(self, directory: Path):
        self.bin, self.calls = directory / "bin", directory / "calls"
        self.bin.mkdir(parents=True)
        self.calls.mkdir()
        for name in SHIMMED:
            shim = self.bin / name
            shim.write_text(
                '#!/bin/sh\nprintf \'%s\\0\' "${0##*/}" "$@" > "$SHIM_CALLS/$(date +%s%N)-$$"\n'
                'case "${0##*/}" in curl) echo 000 ;; esac\nexit 1\n'
            )
            shim.chmod(0o755)

    def run(self, script: str) -> tuple[list[list[str]], str]:
        for call in self.calls.iterdir():
            call.unlink()
        result = subprocess.run(
            ["bash", "-c", script],
            env={"PATH": f"{self.bin}:/usr/bin:/bin", "SHIM_CALLS": str(self.calls)},
            capture_output=True,
            text=True,
            timeout=30,
        )
        calls = sorted(self.calls.iterdir(), key=lambda call: int(call.name.split("-")[0]))
        argvs = [call.read_bytes().decode().split("\0")[:-1] for call in calls]
        return argvs, result.stdout + result.stderr

    def calls_of(self, script: str, command: str) -> tuple[list[list[str]], str]:
        argvs, output = self.run(script)
        return [argv[1:] for argv in argvs if argv[0] == command], output


# --- the rig data -----------------------------------------------------------------------------

SHA = "a" * 64
HEAD = {
    "ssh": {"host": "192.0.2.1", "user": "root", "known_hosts": "/kh"},
    "llama_cpp": {"backend": "cpu"},
    "driver": {"source": "none"},
    "cuda": {"source": "none"},
    "model": {"url": "https://example.org/m.gguf", "sha256": SHA},
    "server": {"ctx": 2048, "split_mode": "none"},
}
WORKER = {
    "ssh": {"host": "192.0.2.2", "user": "root"},
    "role": "rpc-worker",
    "llama_cpp": {"backend": "cpu"},
    "driver": {"source": "none"},
    "cuda": {"source": "none"},
    "rpc": {"host": "10.0.0.12"},
}

# Each field that reaches a command: (host, key path); a value goes where the path points.
FIELDS = [
    ("rig1", ("ssh", "host")),
    ("rig1", ("ssh", "user")),
    ("rig1", ("ssh", "key")),
    ("rig1", ("ssh", "known_hosts")),
    ("rig1", ("server", "host")),
    ("worker1", ("rpc", "host")),
    ("rig1", ("nvidia_repo", "url")),
    ("rig1", ("nvidia_repo", "keyring_package")),
    ("rig1", ("nvidia_repo", "keyring_version")),
    ("rig1", ("llama_cpp", "repo")),
    ("rig1", ("model", "url")),
    ("rig1", ("model", "filename")),
    ("rig1", ("paths", "prefix")),
    ("rig1", ("paths", "models")),
    ("rig1", ("paths", "ccache")),
    ("rig1", ("paths", "env_file")),
    ("rig1", ("server", "env", "HOSTILE")),
    ("rig1", ("server", "extra_args", 0)),
    ("rig1", ("llama_cpp", "cmake_options", "HOSTILE")),
]

HOSTILE_CHARACTERS = (
    "ab09 -_./:@%$`'\"\\;|&<>(){}[]*?!#~=,+^\t\n" + "\u200b\u00a0\u0430\ufeff\u202eé"
)
hostile_text = st.text(alphabet=HOSTILE_CHARACTERS, min_size=1, max_size=20)
PREFIXES = ["", "/", "/opt/", "https://example.org/", "http://127.0.0.1/", "-", "~/", "x.gguf"]
hostile_values = st.one_of(
    hostile_text,
    st.builds(lambda prefix, text: prefix + text, st.sampled_from(PREFIXES), hostile_text),
    st.builds(lambda text: f"{text}.gguf", hostile_text),
)

# Hostile but valid: values of each field's shape made of the characters shells and systemd
# treat specially (most are accepted, and must then stay literal).
VISIBLE = "ab09 -_.:@%`'\";|&<>(){}[]*?!#~=,+^" + "é"
visible = st.text(alphabet=VISIBLE, min_size=1, max_size=12)
segment = visible.filter(lambda text: text not in (".", "..") and "/" not in text)
host_path = st.lists(segment, min_size=1, max_size=3).map(lambda parts: "/" + "/".join(parts))
URL_SAFE = "ab09-._~:@!$&'()*+,;=%"
SHAPED = {
    "path": host_path,
    "local": st.one_of(host_path, host_path.map(lambda path: "~" + path)),
    "file": visible.filter(lambda name: "/" not in name and not name.startswith("-")).map(
        lambda name: f"{name}.gguf"
    ),
    "url": st.text(alphabet=URL_SAFE, max_size=16).map(
        lambda tail: f"https://example.org/x{tail}.gguf"
    ),
    "text": st.text(alphabet=VISIBLE + "$\\", min_size=1, max_size=16),
}
KIND = {
    ("ssh", "key"): "local",
    ("ssh", "known_hosts"): "local",
    ("model", "filename"): "file",
    ("model", "url"): "url",
    ("nvidia_repo", "url"): "url",
    ("llama_cpp", "repo"): "url",
    ("server", "env", "HOSTILE"): "text",
    ("server", "extra_args", 0): "text",
    ("llama_cpp", "cmake_options", "HOSTILE"): "text",
}
shaped_fields = st.sampled_from([f for f in FIELDS if f[1] in KIND or f[1][0] == "paths"])
shaped = shaped_fields.flatmap(
    lambda field: st.tuples(st.just(field), SHAPED[KIND.get(field[1], "path")])
)

# The reviewed defects, as named examples.
REGRESSIONS = [
    (("rig1", ("server", "host")), "$(touch /tmp/llamarig-pwned)"),
    (("worker1", ("rpc", "host")), "10.0.0.12$(touch /tmp/llamarig-pwned)"),
    (("rig1", ("nvidia_repo", "url")), "https://x.org/`touch /tmp/llamarig-pwned`"),
    (("rig1", ("nvidia_repo", "keyring_package")), "cuda-keyring;touch /tmp/llamarig-pwned"),
    (("rig1", ("nvidia_repo", "keyring_version")), "1.1-1 -o /etc/passwd"),
    (("rig1", ("model", "url")), 'https://example.org/"$(touch /tmp/llamarig-pwned)".gguf'),
    (("rig1", ("paths", "models")), '/opt/"$(touch /tmp/llamarig-pwned)"'),
    (("rig1", ("ssh", "host")), "-oProxyCommand=touch /tmp/llamarig-pwned"),
    (("rig1", ("server", "env", "HOSTILE")), "100% %n $HOME"),
    (("rig1", ("model", "filename")), 'it\'s "a" $(id) `id` 100% %n \\x.gguf'),
]


def inventory_text(field: tuple, value) -> str:
    name, key_path = field
    hosts = {"rig1": copy.deepcopy(HEAD), "worker1": copy.deepcopy(WORKER)}
    if name == "worker1":
        hosts["rig1"].update(role="rpc-head", rpc={"workers": ["worker1"]})
        hosts["rig1"]["server"]["split_mode"] = "layer"
    node = hosts[name]
    for part in key_path[:-1]:
        node = node.setdefault(part, [] if part == "extra_args" else {})
    if isinstance(node, list):
        node.append(value)
    else:
        node[key_path[-1]] = value
    return yaml.safe_dump({"all": {"children": {"rigs": {"hosts": hosts}}}}, allow_unicode=True)


def loaded(tmp_path: Path, field: tuple, value) -> dict | None:
    """The host data of ``field``'s host, or None when the loader refused the value, which it
    must then name by its key path."""
    path = tmp_path / "rig.yml"
    path.write_text(inventory_text(field, value), encoding="utf-8")
    try:
        inventory = load_inventory(path)
    except ConfigError as error:
        name, key_path = field
        dotted = f"hosts.{name}." + ".".join(str(part) for part in key_path)
        related = (dotted, f"hosts.{name}.model.filename") if key_path[-1] == "url" else (dotted,)
        assert any(f": {key}:" in p for p in error.problems for key in related), error.problems
        return None
    return inventory.hosts


# --- what each accepted value must survive ------------------------------------------------


def check_server(data: dict, shims: Shims, scratch: Path) -> None:
    unit = render.render_unit(data)
    assert exec_start(unit) == render.server_args(data)
    (env_file,) = unit_setting(unit, "EnvironmentFile")
    assert resolve_specifiers(env_file) == data["paths"]["env_file"]
    environment = render.service_environment(data)
    env_text = render.render_env_file(data)
    assert env_file_values(env_text) == environment
    assert sh_environment(f"set -a\n{env_text}") == environment
    launcher = render.render_launcher(data)
    assert shlex.split(launcher.splitlines()[-1]) == ["exec", *render.server_args(data), "$@"]
    exports = "\n".join(line for line in launcher.splitlines() if line.startswith("export "))
    assert sh_environment(exports) == environment

    configure, build = render.cmake_configure_command(data), render.cmake_build_command(data)
    for command in (configure, build):
        assert shlex.split(shlex.join(command)) == command

    base_url = render.base_url(data)
    curls, _ = shims.calls_of(ServerProbe().command(base_url, default_http_timeouts()), "curl")
    assert curls[0][-2:] == ["--", f"{base_url}/health"]
    assert curls[1][-2:] == ["--", f"{base_url}/slots"]
    assert curls[2][-2:] == ["--", f"{base_url}/completion"]

    dest = str(scratch) + render.layout(data)["model"]
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    model = data["model"]
    fetch = operations.fetch_command(model["url"], dest, SHA, records=f"{scratch}/records")
    curls, output = shims.calls_of(fetch, "curl")
    assert curls and curls[0][-4:] == ["-o", f"{dest}.part", "--", model["url"]], output

    repo = data["llama_cpp"]["repo"]
    source = str(scratch) + render.layout(data)["source"]
    script = "\n".join(operations.git_checkout_commands(repo, source, "0" * 40))
    gits, _ = shims.calls_of(script, "git")
    assert ["-C", source, "remote", "add", "--", "origin", repo] in gits

    url = render.nvidia_keyring_url(data, "debian13")
    curls, _ = shims.calls_of(render.keyring_install_command(data, "debian13"), "curl")
    assert curls[0][-2:] == ["--", url] and curls[0][:2] == ["-fsSL", "-o"]

    paths = {key: str(scratch) + render.layout(data)[key] for key in ("unit", "env_file")}
    rollback = operations.serve_or_roll_back._inner(
        base_url, "llama-server.service", 0, paths["unit"], paths["env_file"],
        str(scratch / "current"), str(scratch / "good"), default_http_timeouts(),
    )  # fmt: skip
    curls, output = shims.calls_of("".join(rollback), "curl")
    assert curls[0][-2:] == ["--", f"{base_url}/health"]
    assert f"does not serve: {base_url}/health not ready after 0 s." in output


def check_ssh(name: str, data: dict, tmp_path: Path) -> None:
    ssh = data["ssh"]
    argv = SshTarget.of(ssh).argv()
    destination = f"{ssh['user']}@{ssh['host']}" if "user" in ssh else ssh["host"]
    assert argv[-2:] == ["--", destination]
    resolved = ssh_resolved(argv)
    assert resolved["hostname"] == [ssh["host"].lower()] and resolved["port"] == ["22"]
    if "user" in ssh:
        assert resolved["user"] == [ssh["user"]]
    if "known_hosts" in ssh:
        assert resolved["userknownhostsfile"] == [os.path.expanduser(ssh["known_hosts"])]
    if "key" in ssh:  # ssh -G shows identity files before their %-tokens are expanded
        assert os.path.expanduser(ssh["key"]).replace("%", "%%") in resolved["identityfile"]
    config = tmp_path / "ssh_config"
    config.write_text(SshTarget.of(ssh).ssh_config(ssh_alias(name)))
    from_config = ssh_resolved(["ssh", "-F", str(config), ssh_alias(name)])
    for key in ("hostname", "port", "user", "userknownhostsfile", "identityfile"):
        assert from_config.get(key) == resolved.get(key), key


def check_worker(data: dict, head: dict, shims: Shims) -> None:
    unit = render.render_rpc_unit(data)
    assert exec_start(unit) == render.rpc_server_args(data)
    environment = dict(
        resolve_specifiers(word).split("=", 1)
        for line in unit_setting(unit, "Environment")
        for word in systemd_words(line)
    )
    assert environment == render.service_environment(data, data["rpc"]["service"])
    endpoints = head["rpc"]["endpoints"]
    probes, output = shims.calls_of(
        "".join(operations.check_rpc_workers._inner(endpoints)), "timeout"
    )
    address = data["rpc"]["host"]
    assert probes == [["3", "bash", "-c", 'exec 3<>"/dev/tcp/$1/$2"', "tcp-probe", address,
                       str(data["rpc"]["port"])]]  # fmt: skip
    assert f"not reachable from this head: {endpoints[0]} - " in output


@PROPERTY
@given(case=st.one_of(st.tuples(st.sampled_from(FIELDS), hostile_values), shaped))
@example(case=REGRESSIONS[0])
@example(case=REGRESSIONS[1])
@example(case=REGRESSIONS[2])
@example(case=REGRESSIONS[3])
@example(case=REGRESSIONS[4])
@example(case=REGRESSIONS[5])
@example(case=REGRESSIONS[6])
@example(case=REGRESSIONS[7])
@example(case=REGRESSIONS[8])
@example(case=REGRESSIONS[9])
def test_a_hostile_value_is_refused_or_stays_one_literal_argument(tmp_path, case):
    field, value = case
    scratch = Path(tempfile.mkdtemp(dir=tmp_path))
    hosts = loaded(scratch, field, value)
    event(f"{'refused' if hosts is None else 'accepted'}: {'.'.join(map(str, field[1]))}")
    if hosts is None:
        return
    shims = Shims(scratch / "shims")
    head, worker = hosts["rig1"].data, hosts["worker1"].data
    check_server(head, shims, scratch)
    check_ssh("rig1", head, scratch)
    if head["role"] == "rpc-head":
        check_worker(worker, head, shims)
    assert not Path("/tmp/llamarig-pwned").exists()


def test_the_named_regressions_are_refused_where_they_reach_a_shell(tmp_path):
    """The reviewed injections are all refused by the loader (not only quoted)."""
    for field, value in REGRESSIONS[:8]:
        assert loaded(tmp_path, field, value) is None, (field, value)
    for field, value in REGRESSIONS[8:]:
        assert loaded(tmp_path, field, value) is not None, (field, value)


# --- without validation: the builders quote whatever they get -------------------------------

any_text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"),
    min_size=1,
    max_size=24,
)
one_line = any_text.filter(lambda text: "\n" not in text and "\r" not in text)


@PROPERTY
@given(text=any_text)
def test_unit_and_env_file_quoting_round_trips_any_text(text):
    assert resolve_dollars(resolve_specifiers(systemd_words(render.systemd_quote(text))[0])) == (
        text
    )
    (word,) = systemd_words(render.systemd_environment("KEY", text))
    assert resolve_specifiers(word) == f"KEY={text}"
    line = render.env_file_assignment("KEY", text)
    if "\n" not in text:
        assert env_file_values(line) == {"KEY": text}
    assert sh_environment(f"set -a\n{line}") == {"KEY": text}


@PROPERTY
# name is a file name and a port too (the text after an endpoint's last colon).
@given(text=one_line, name=one_line.filter(lambda t: "/" not in t and ":" not in t))
def test_shell_commands_pass_any_text_as_one_argument(tmp_path, text, name):
    shims = Shims(Path(tempfile.mkdtemp(dir=tmp_path)))
    dest = str(shims.bin.parent / name)
    records = str(shims.bin.parent / "records")
    curls, output = shims.calls_of(
        operations.fetch_command(text, dest, text, records=records), "curl"
    )
    assert curls[0][-4:] == ["-o", f"{dest}.part", "--", text], output
    probes, _ = shims.calls_of(operations.tcp_probe(f"{text}:{name}"), "timeout")
    bracketed = len(text) > 1 and text[0] == "[" and text[-1] == "]"
    assert probes[0][-2:] == [text[1:-1] if bracketed else text, name]
    curls, output = shims.calls_of(
        "".join(
            operations.serve_or_roll_back._inner(
                text, name, 0, dest, dest, dest, dest, default_http_timeouts()
            )
        ),
        "curl",
    )
    assert curls[0][-2:] == ["--", f"{text}/health"]
    assert f"the new version of {name} does not serve: {text}/health not ready" in output
    curls, _ = shims.calls_of(ServerProbe().command(text, default_http_timeouts()), "curl")
    assert curls[0][-1] == f"{text}/health"


@PROPERTY
@given(text=one_line.filter(lambda t: t.strip() == t and t.isprintable() and "#" not in t))
def test_ssh_config_values_round_trip_through_openssh(tmp_path, text):
    """Printable text (the loader refuses control characters: ssh_config has no escape for
    them)."""
    path = f"/{text}"
    argv = ["ssh", "-o", f"UserKnownHostsFile={ssh_config_value(path)}", "--", "192.0.2.1"]
    assert ssh_resolved(argv)["userknownhostsfile"] == [path]


def test_ssh_ends_its_options_before_the_destination():
    argv = SshTarget.of({"host": "192.0.2.1", "user": "root", "port": 2222}).argv("-t")
    assert argv[-3:] == ["-t", "--", "root@192.0.2.1"]


@pytest.mark.parametrize("name", ["rig 1", "rig;touch /tmp/x", "-oProxyCommand=x", "a\tb"])
def test_the_verify_alias_of_any_host_name_is_one_ssh_config_word(name, tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text(
        SshTarget.of({"host": "192.0.2.1", "user": "root"}).ssh_config(ssh_alias(name))
    )
    resolved = ssh_resolved(["ssh", "-F", str(config), ssh_alias(name)])
    assert resolved["hostname"] == ["192.0.2.1"] and resolved["user"] == ["root"]
