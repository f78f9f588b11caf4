"""`llamarig run`: starts the host's launcher (the planned command line) in the foreground;
and the host choice (--host) the other commands share."""

import subprocess
import sys

import pytest

from tests.conftest import PROJECT, offline, pyinfra_env

RIG = """
all:
  hosts:
    here:
      ssh: {{local: true}}
      driver: {{source: none}}
      cuda: {{source: none}}
      paths: {{prefix: {prefix}}}
      llama_cpp: {{backend: cpu}}
      model: {{path: /srv/models/m.gguf}}
      server: {{supervisor: {supervisor}, ctx: 2048, split_mode: none}}
"""


def run_cli(inventory, *args, command="run"):
    return subprocess.run(
        offline([sys.executable, "-m", "llamarig.cli", command, *args]),
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY=str(inventory)),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_run_execs_the_launcher_with_extra_arguments(write_inventory, tmp_path):
    prefix = tmp_path / "opt"
    launcher = prefix / "bin" / "llama-server"
    launcher.parent.mkdir(parents=True)
    # A stand-in launcher: the deploy writes the real one (test_render checks its content).
    launcher.write_text('#!/bin/sh\necho "launcher pid $$ args: $*"\n')
    launcher.chmod(0o755)
    inventory = write_inventory(RIG.format(prefix=prefix, supervisor="none"))
    result = run_cli(inventory, "--", "-lv", "4")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("args: -lv 4")
    assert result.stderr == ""

    inventory = write_inventory(RIG.format(prefix=prefix, supervisor="systemd"))
    result = run_cli(inventory)
    assert "systemctl stop llama-server first" in result.stderr


def test_run_without_a_launcher_fails_and_says_so(write_inventory, tmp_path):
    inventory = write_inventory(RIG.format(prefix=tmp_path / "none", supervisor="none"))
    result = run_cli(inventory)
    assert result.returncode == 1
    assert f"no launcher {tmp_path}/none/bin/llama-server: run the deploy first" in result.stderr


@pytest.mark.parametrize("command", ["plan", "complete", "verify"])
def test_a_host_the_inventory_lacks_is_refused_by_name(write_inventory, tmp_path, command):
    inventory = write_inventory(RIG.format(prefix=tmp_path / "opt", supervisor="none"))
    result = run_cli(inventory, "--host", "elsewhere", command=command)
    assert result.returncode == 2
    assert result.stderr == f"llamarig: no host 'elsewhere' in {inventory}\n"
    assert result.stdout == ""
