"""Helpers of the sandbox integration tests: run the real deploy and `llamarig verify` against
an inventory, run commands in a sandbox, boot one for a test module."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import yaml

from llamarig import CACHE_DIR
from tests.conftest import PROJECT, pyinfra_env


def _deploy_call(inventory: Path, extra: tuple[str, ...]) -> dict:
    """The arguments of `pyinfra -y inventory.py deploy.py` with RIG_INVENTORY=inventory."""
    return {
        "args": [sys.executable, "-m", "pyinfra", "-y", *extra, "inventory.py", "deploy.py"],
        "cwd": PROJECT,
        "env": _env(inventory),
        "text": True,
    }


def _env(inventory: Path) -> dict:
    """The commands' environment: the inventory, and the control machine's build cache beside
    it (each scenario's own, so no scenario gets another's build)."""
    return pyinfra_env(
        RIG_INVENTORY=str(inventory), LLAMARIG_BUILD_CACHE=str(build_cache(inventory))
    )


def build_cache(inventory: Path) -> Path:
    """The control machine's build cache of the scenario whose inventory is ``inventory``."""
    return inventory.parent / "build-cache"


def deploy(
    inventory: Path, *extra: str, timeout: int = 3600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run `pyinfra -y inventory.py deploy.py` for real with RIG_INVENTORY=inventory (and the
    variables ``env``)."""
    call = _deploy_call(inventory, extra)
    call["env"].update(env or {})
    return subprocess.run(**call, capture_output=True, timeout=timeout)


def deploy_watched(inventory: Path, on_line: Callable[[str], None]) -> tuple[int, str]:
    """The deploy above, each line of its output (stdout and stderr) handed to ``on_line`` as
    it comes; its exit status and whole output."""
    return _watched(_deploy_call(inventory, ()), on_line)


def _watched(call: dict, on_line: Callable[[str], None]) -> tuple[int, str]:
    # Each line as it is written, not when a pipe's buffer fills: a watcher acts on the moment.
    call["env"]["PYTHONUNBUFFERED"] = "1"
    lines = []
    with subprocess.Popen(**call, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as run:
        for line in run.stdout:
            lines.append(line)
            on_line(line)
    return run.returncode, "".join(lines)


def failure_lines(result: subprocess.CompletedProcess, most: int = 80) -> str:
    """What a failed deploy said of its failure: the lines that name an error, a refusal or a
    traceback (its output's tail alone is pyinfra's table of results)."""
    output = (result.stdout + result.stderr).splitlines()
    said = [line for line in output if re.search(r"rror|llamarig:|Traceback|xception", line)]
    return "\n".join(said[-most:])


def converge(inventory: Path, env: dict | None = None) -> dict:
    """A deploy that must succeed; returns pyinfra's JSON results."""
    result = deploy(inventory, "--json", env=env)
    assert result.returncode == 0, f"deploy failed:\n{result.stderr[-6000:]}"
    return json.loads(result.stdout)["results"]


def changed_operations(results: dict) -> list[str]:
    """Names of the operations that changed something (without their "tasks/x.py | " part)."""
    return [op["name"].split(" | ", 1)[-1] for op in results["operations"] if op["success"]]


def verify(inventory: Path, *pytest_args: str) -> subprocess.CompletedProcess:
    return llamarig(inventory, "verify", "--", *pytest_args)


def llamarig(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    """`llamarig ARGS` with RIG_INVENTORY=inventory."""
    return subprocess.run(**_llamarig_call(inventory, args), capture_output=True, timeout=600)


def _llamarig_call(inventory: Path, args: tuple[str, ...]) -> dict:
    return {
        "args": [sys.executable, "-m", "llamarig.cli", *args],
        "cwd": PROJECT,
        "env": _env(inventory),
        "text": True,
    }


def assert_verify_names_a_stopped_service(info, inventory: Path, service: str) -> None:
    """`llamarig verify` of the rig with ``service`` stopped fails naming it (and only what
    a stopped service breaks); the service is started again whatever happens."""
    in_sandbox(info, f"systemctl stop {service}")
    try:
        result = verify(inventory)
        assert result.returncode != 0
        assert "test_service_active_enabled_and_restarting" in result.stdout
        assert f"{service} is not running" in result.stdout
        assert "test_service_hardening" not in result.stdout.split("short test summary")[-1]
    finally:
        start_again(info, service)


def start_again(info, service: str) -> None:
    """Start ``service`` after a test stopped it. A start that fails is told with its result
    and journal, then tried once more after `systemctl reset-failed`: once in a CI run
    (2026-12-05, systemd 257.13) a start right after verify failed "because of unavailable
    resources", which 40 stops and starts and 4 with verify between did not repeat; the cause
    is in the warning that the retry leaves, and a second failure fails the test with it."""
    from llamarig_sandbox import sshaccess

    first = sshaccess.ssh(info, f"systemctl start {service}", timeout=300)
    if first.returncode == 0:
        return
    why = sshaccess.ssh(
        info,
        f"systemctl show -p Result -p NRestarts {service}; "
        f"journalctl -u {service} -n 25 --no-pager -o short-monotonic",
        timeout=60,
    ).stdout
    second = sshaccess.ssh(
        info, f"systemctl reset-failed {service}; systemctl start {service}", timeout=300
    )
    assert second.returncode == 0, f"{service} did not start again: {second.stderr}\n{why}"
    warnings.warn(
        f"{service} started only at the second try: {first.stderr.strip()}\n{why}", stacklevel=2
    )


def speed_unmeasured(rig: dict) -> dict:
    """``rig`` (one host's data) with the decode speed left unmeasured after a restart
    (server.max_slowdown: null). For the scenarios that test something else while the other
    lane compiles beside them: there the slowdown guard's looks in turns take minutes (up to 8
    looks of 3 completions each, a decode up to 20-fold slower beside a build), and its verdict
    would rest on that load. test_sandbox_slowdown tests the guard, by itself."""
    rig.setdefault("server", {})["max_slowdown"] = None
    return rig


def lane_rig(rig: dict) -> dict:
    """``rig`` as the scenarios in lanes run it: its speed unmeasured (``speed_unmeasured``)
    and one decode thread (server.threads: 1), since a second thread spins at each token's
    barrier while the other lane's build holds the other CPU (llama-server took 403 CPU-seconds
    of a warm CI run with two threads, 256 with one; 2026-12-06)."""
    speed_unmeasured(rig)["server"]["threads"] = 1
    return rig


def demo_rig(path: Path, adapt: Callable[[dict], dict]) -> Path:
    """inventory/hosts.yml with its rig passed through ``adapt``, written to ``path``."""
    document = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    adapt(document["all"]["children"]["sandbox"]["hosts"]["sandbox"])
    path.write_text(yaml.safe_dump(document))
    return path


def random_model(info) -> dict:
    """The `model` section of the random-weight test model the sandbox ``info`` serves."""
    return {"url": info.test_model_url, "sha256": info.test_model_sha256}


def serving_the_random_model(host: dict, info) -> dict:
    """``host`` (one host's data) serving the random-weight test model instead of its own,
    with no answer to check (random weights answer nothing). For the scenarios whose time is
    mostly decoding and which assert nothing of the model: on one thread it decodes about
    18 times as fast as SmolLM2 (1,365-1,434 against 76-79 tokens/s, 2026-12-06)."""
    host["model"] = random_model(info)
    host.pop("expect", None)
    return host


def demo_rig_inventory(path: Path, name: str, ssh_port: int, edit: Callable[[dict], None]) -> Path:
    """inventory/hosts.yml's sandbox rig moved onto sandbox ``name`` (its SSH port and
    known_hosts), changed by ``edit`` and written to ``path``."""
    document = yaml.safe_load((PROJECT / "inventory" / "hosts.yml").read_text())
    hosts = document["all"]["children"]["sandbox"]["hosts"]
    rig = hosts.pop("sandbox")
    rig["ssh"].update(port=ssh_port, known_hosts=str(CACHE_DIR / "sandbox" / name / "known_hosts"))
    edit(rig)
    hosts[name] = rig
    path.write_text(yaml.safe_dump(document))
    return path


def new_api_key(directory: Path, name: str = "rig") -> tuple[str, Path]:
    """A fresh API key and the root-only file ``directory/NAME.key`` that holds it (what
    ``server.api_key_file``, a gateway's user or its ``rig_key_file`` names)."""
    key = secrets.token_hex(24)
    key_file = directory / f"{name}.key"
    key_file.write_text(key + "\n")
    key_file.chmod(0o600)
    return key, key_file


def in_sandbox(info, command: str) -> str:
    """Run a shell command in the sandbox over SSH; it must succeed; returns its stdout."""
    from llamarig_sandbox import sshaccess

    result = sshaccess.ssh(info, command, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def fresh_sandbox(name: str, release: str, ssh_port: int):
    """Boot a fresh sandbox (one left running is replaced); a generator for fixtures."""
    from llamarig_sandbox import sandbox

    sandbox.down(name)
    info = sandbox.up(release=release, name=name, ssh_port=ssh_port)
    yield info
    sandbox.down(name)


def fresh_sandboxes(hosts: dict[str, tuple[str, int]]):
    """Boot a fresh sandbox per host (name -> (release, SSH port)), in order; a generator for
    fixtures that yields each one's info by name and takes every one it booted down after."""
    booted = []
    try:
        infos = {}
        for name, (release, ssh_port) in hosts.items():
            booted.append(fresh_sandbox(name, release, ssh_port))
            infos[name] = next(booted[-1])
        yield infos
    finally:
        for sandbox in booted:
            next(sandbox, None)  # takes the sandbox down


def compilers(info) -> str:
    """The compilers and build tools on the sandbox's PATH, one path a line ("" for none)."""
    return in_sandbox(info, "for c in cc c++ gcc g++ cmake ninja; do command -v $c; done; true")


def build_files(info, directory: str = "/opt/llamarig/current") -> dict[str, str]:
    """The sha256 of each file under ``directory``/bin (the running build's: `current`), by
    name."""
    listing = in_sandbox(info, f"cd {directory}/bin && sha256sum $(find . -type f)")
    pairs = (line.split() for line in listing.splitlines())
    return {name.removeprefix("./"): digest for digest, name in pairs}
