"""The CLI's own arguments are user input like the rig data: every subcommand refuses a
malformed or hostile value of any of its arguments before it starts a process or opens a
connection, exits non-zero, and never shows a traceback.

In-process, hypothesis draws the values and every way out of the process is recorded
(subprocess, exec; sockets are refused by the conftest's network guard). Then one run of the
real command line in a network namespace of its own, with a logging `ssh` first on PATH,
proves that none of the refused calls started anything."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamarig import cli
from llamarig.config.shapes import host_name_problem
from tests.conftest import PROJECT, offline, pyinfra_env

# A rig whose every command would contact the box (192.0.2.10, TEST-NET-1: never routed) were
# its arguments accepted; its model is a host path, so `plan` reads nothing over the network.
INVENTORY = """\
all:
  hosts:
    rig1:
      ssh: {host: 192.0.2.10, user: root}
      gpus: [{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}]
      model: {path: /srv/models/m.gguf}
"""

HOSTILE = [
    "",
    "-x",
    "--help",
    "@local",
    "@chroot/tmp",
    "../../tmp/evil",
    "$(id)",
    "`id`",
    "a;touch /tmp/pwned",
    "a b",
    "rig\u200b1",
    "rig1\n",
    "\u202erig1",
    "x" * 300,
    "-oProxyCommand=touch /tmp/pwned",
]

host_names = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(min_size=1, max_size=80).filter(lambda t: "\0" not in t),
).filter(lambda name: host_name_problem(name) is not None)

minutes = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True)
    .filter(lambda m: math.isnan(m) or not 0 < m <= cli.MAX_TUNE_MINUTES)
    .map(repr),
    st.sampled_from(["", "ten", "1e9", "-5", "0", "nan", "inf", "1,5", "$(id)"]),
)

tokens = st.one_of(
    st.integers().filter(lambda n: not 0 < n <= cli.MAX_COMPLETION_TOKENS).map(str),
    st.sampled_from(["", "16.0", "1e3", " 16", "sixteen", "-1", "$(id)"]),
)

sha256s = st.one_of(
    st.sampled_from(["0123abcd", "A" * 64, "g" * 64, "0" * 63, "0" * 65, "$(id)"]),
    st.text(max_size=70).filter(lambda t: len(t) != 64 and "\0" not in t),
)

ports = st.one_of(
    st.integers().filter(lambda p: not 0 < p < 65536).map(str),
    st.sampled_from(["", "ssh", "22.5", "0x16", "$(id)"]),
)

addresses = st.sampled_from(
    [
        "-oProxyCommand=touch /tmp/pwned",
        "root@192.0.2.10",
        "192.0.2.10:2222",
        "[2001:db8::10]:2222",
        "192.0.2.300",
        "a b",
        "$(id)",
        "host\nProxyCommand x",
        "",
    ]
)


@contextmanager
def no_way_out(monkeypatch_context, tmp_path: Path):
    """Every process start and exec recorded and refused, RIG_INVENTORY a valid rig."""
    started: list = []

    def refuse(*args, **kwargs):
        started.append(args[:1])
        raise AssertionError(f"started {args[:1]!r} for a refused argument")

    inventory = tmp_path / "rig.yml"
    inventory.write_text(INVENTORY)
    with monkeypatch_context() as patch:
        patch.setenv("RIG_INVENTORY", str(inventory))
        for name in ("run", "Popen", "check_output", "call"):
            patch.setattr(subprocess, name, refuse)
        for name in ("execv", "execvp", "execve", "system"):
            patch.setattr(os, name, refuse)
        yield started


def refused(argv: list[str], capsys) -> str:
    """Run the CLI in-process on ``argv``; the exit status must be non-zero. Returns stderr."""
    try:
        status = cli.main(argv)
    except SystemExit as stop:  # argparse refuses an argument with status 2
        status = stop.code
    captured = capsys.readouterr()
    assert status not in (0, None), (argv, captured.err)
    assert "Traceback" not in captured.err
    return captured.err


ALWAYS = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture]}


@settings(max_examples=40, **ALWAYS)
@given(
    command=st.sampled_from(["plan", "complete", "verify", "tune", "run"]),
    name=host_names,
)
def test_a_hostile_host_is_refused_by_every_command(command, name, tmp_path, capsys):
    with no_way_out(pytest.MonkeyPatch.context, tmp_path) as started:
        err = refused([command, f"--host={name}"], capsys)
    assert started == [] and "--host" in err and "is not a host name" in err


@settings(max_examples=30, **ALWAYS)
@given(value=minutes)
def test_tune_refuses_a_time_bound_that_is_not_one(value, tmp_path, capsys):
    with no_way_out(pytest.MonkeyPatch.context, tmp_path) as started:
        err = refused(["tune", f"--minutes={value}"], capsys)
    assert started == [] and "--minutes" in err and "is not a time bound" in err


@settings(max_examples=30, **ALWAYS)
@given(value=tokens)
def test_complete_refuses_a_token_count_that_is_not_one(value, tmp_path, capsys):
    with no_way_out(pytest.MonkeyPatch.context, tmp_path) as started:
        err = refused(["complete", f"--tokens={value}"], capsys)
    assert started == [] and "--tokens" in err and "is not a number of tokens" in err


@pytest.mark.parametrize("prompt", ["", "x" * (cli.MAX_PROMPT_CHARACTERS + 1)])
def test_complete_refuses_a_prompt_it_cannot_send(prompt, tmp_path, capsys):
    with no_way_out(pytest.MonkeyPatch.context, tmp_path) as started:
        err = refused(["complete", f"--prompt={prompt}"], capsys)
    assert started == [] and "--prompt" in err


@pytest.mark.parametrize("model", ["/nonexistent/m.gguf", "/dev/zero", "/"])
def test_plan_refuses_a_model_that_is_not_a_file(model, tmp_path, capsys):
    with no_way_out(pytest.MonkeyPatch.context, tmp_path) as started:
        err = refused(["plan", "--model", model], capsys)
    assert started == [] and "--model" in err and "is not a GGUF file" in err


INIT_ARGUMENTS = {
    # after `--`, so that a name like `--help` reaches the name's own check
    "NAME": lambda value: ["--local", "--", value],
    "--address": lambda value: ["rig1", f"--address={value}"],
    "--port": lambda value: ["rig1", "--address=192.0.2.10", f"--port={value}"],
    "--sha256": lambda value: [
        "rig1",
        "--local",
        "--model=https://e.org/m.gguf",
        f"--sha256={value}",
    ],
    "--key": lambda value: ["rig1", "--address=192.0.2.10", f"--key=/nonexistent/{value}"],
}


@settings(max_examples=60, **ALWAYS)
@given(
    case=st.one_of(
        st.tuples(st.just("NAME"), host_names),
        st.tuples(st.just("--address"), addresses),
        st.tuples(st.just("--port"), ports),
        st.tuples(st.just("--sha256"), sha256s),
        st.tuples(st.just("--key"), st.sampled_from(["k", "id_ed25519", "$(id)"])),
    )
)
def test_init_refuses_each_bad_argument_before_contacting_the_box(case, tmp_path, capsys):
    argument, value = case
    with no_way_out(pytest.MonkeyPatch.context, tmp_path) as started:
        err = refused(["init", *INIT_ARGUMENTS[argument](value)], capsys)
    assert started == []
    assert argument in err or "is not a host name" in err, err


@pytest.mark.parametrize(
    ("output", "words"),
    [("/", "is a directory"), ("/nonexistent/rig.yml", "there is no directory /nonexistent")],
)
def test_init_refuses_an_output_it_cannot_write(output, words, tmp_path, capsys):
    with no_way_out(pytest.MonkeyPatch.context, tmp_path) as started:
        err = refused(["init", "rig1", "--local", f"--output={output}"], capsys)
    assert started == [] and "--output: " in err and words in err


# One refused call per command and argument, through the real command line.
COMMAND_LINES = [
    ["plan", "--host=@local"],
    ["plan", "--model=/dev/zero"],
    ["complete", "--host=../x"],
    ["complete", "--tokens=-1"],
    ["verify", "--host=-oProxyCommand=x"],
    ["tune", "--minutes=nan"],
    ["tune", "--minutes=-5"],
    ["tune", "--host=$(id)"],
    ["run", "--host=@chroot/tmp"],
    ["init", "-x", "--address=192.0.2.10"],
    ["init", "rig1", "--address=-oProxyCommand=touch /tmp/pwned"],
    ["init", "rig1", "--address=192.0.2.10", "--port=70000"],
    ["init", "rig1", "--local", "--model=https://e.org/m.gguf", "--sha256=0123abcd"],
    ["init", "rig1", "--address=192.0.2.10", "--known-hosts=/nonexistent"],
]

DRIVER = """\
import json, sys
from llamarig import cli
results = []
for argv in json.loads(sys.argv[1]):
    try:
        status = cli.main(argv)
    except SystemExit as stop:
        status = stop.code
    results.append(status)
print(json.dumps(results))
"""


def test_refused_command_lines_start_nothing_in_a_network_namespace(tmp_path):
    log = tmp_path / "ssh.log"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ssh", "scp", "sftp"):  # a logging stand-in: any call is a failure
        stand_in = bin_dir / tool
        stand_in.write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\nexit 255\n')
        stand_in.chmod(0o755)
    inventory = tmp_path / "rig.yml"
    inventory.write_text(INVENTORY)
    env = pyinfra_env(RIG_INVENTORY=str(inventory))
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    result = subprocess.run(
        offline([sys.executable, "-c", DRIVER, json.dumps(COMMAND_LINES)]),
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    statuses = json.loads(result.stdout.splitlines()[-1])
    assert dict(zip(map(" ".join, COMMAND_LINES), statuses, strict=True)) == {
        " ".join(argv): 2 for argv in COMMAND_LINES
    }, result.stderr
    assert "Traceback" not in result.stderr
    assert not log.exists(), log.read_text()
