"""Hostile but valid strings converge for real and reach the host literally: a model file name
and a `server.env` value holding spaces, both quotes, `$`, `$(...)`, backticks, `%` specifiers
and a backslash. Each is one argument on every path (curl, sha256sum, the unit's ExecStart, the
env file, the launcher, the facts), so the file on disk, the process's argv and environment,
and systemd's parsed ExecStart all hold exactly what the rig data says; `$(id -u)` or `%n`
expanded anywhere would change them.

A sandbox of its own (trixie, CPU rig, ssh port 2231, server port 8097); the model comes from
the loopback file server, once under `model.filename` and once under a percent-encoded URL.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

from llamarig.config import load_inventory
from llamarig.planner import render
from llamarig_sandbox.layout import WWW_DIR
from llamarig_sandbox.services import MODEL_NAME as SERVED_MODEL
from tests import sandboxes
from tests.sandboxes import changed_operations, fresh_sandbox, in_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

NAME, SSH_PORT, SERVER_PORT = "sandbox-hostile", 2231, 8097
SERVICE = "llama-server"
MODEL_NAME = "llama 'tiny' \"q8\" $HOME $(id -u) `id` 100% %n \\x.gguf"
URL_NAME = 'fetched as $USER\'s "copy" 50% %d.gguf'
ENV = {
    "HOSTILE_VALUE": 'it\'s "quoted" $HOME ${HOME} $(id -u) `id` 100% %n %% \\back',
    "lower_case_name": "  spaced  out  ",
}


def inventory(directory: Path, **model) -> Path:
    """The sandbox rig of inventory/hosts.yml on this module's sandbox, with ``model``."""

    def edit(rig: dict) -> None:
        sandboxes.lane_rig(rig)
        rig["server"].update(port=SERVER_PORT, env=ENV)
        rig["model"].update(model)

    return sandboxes.demo_rig_inventory(directory / "hostile.yml", NAME, SSH_PORT, edit)


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    sandbox = fresh_sandbox(NAME, "trixie", SSH_PORT)
    info = next(sandbox)
    copy = WWW_DIR / URL_NAME
    # The model inventory/hosts.yml serves (and checks by its sha256), under the hostile name.
    shutil.copyfile(WWW_DIR / SERVED_MODEL, copy)
    yield info, tmp_path_factory.mktemp("hostile")
    copy.unlink(missing_ok=True)
    next(sandbox, None)  # takes the sandbox down


def main_pid(info) -> int:
    return int(in_sandbox(info, f"systemctl show -P MainPID {SERVICE}"))


def nul_separated(info, path: str) -> list[str]:
    encoded = in_sandbox(info, f"base64 -w0 {shlex.quote(path)}")
    return base64.b64decode(encoded).decode().split("\0")[:-1]


def exec_start_argv(info) -> list[str]:
    """The unit's ExecStart argv as systemd parsed it (over D-Bus, as JSON: exact strings)."""
    unit = "/org/freedesktop/systemd1/unit/llama_2dserver_2eservice"
    text = in_sandbox(
        info,
        f"busctl --json=short get-property org.freedesktop.systemd1 {unit} "
        "org.freedesktop.systemd1.Service ExecStart",
    )
    return json.loads(text)["data"][0][1]


def models_on_host(info, data: dict) -> list[str]:
    script = f"import json, os; print(json.dumps(sorted(os.listdir({data['paths']['models']!r}))))"
    return json.loads(in_sandbox(info, f"python3 -c {shlex.quote(script)}"))


def complete() -> dict:
    body = json.dumps({"prompt": "Hello", "n_predict": 4, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{SERVER_PORT}/completion", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def assert_served_literally(info, path: Path, file_name: str) -> None:
    data = load_inventory(path).hosts[NAME].data
    model_path = f"{data['paths']['models']}/{file_name}"
    assert render.layout(data)["model"] == model_path
    assert file_name in models_on_host(info, data)
    assert complete()["tokens_predicted"] == 4
    pid = main_pid(info)
    argv = nul_separated(info, f"/proc/{pid}/cmdline")
    assert argv == render.unit_command_line(data)
    assert argv[argv.index("-m") + 1] == model_path
    environ = dict(item.split("=", 1) for item in nul_separated(info, f"/proc/{pid}/environ"))
    assert {key: environ.get(key) for key in ENV} == ENV
    # systemd resolves %% when it loads the unit and $$ when it starts the process.
    assert exec_start_argv(info) == [arg.replace("$", "$$") for arg in render.server_args(data)]
    shown = in_sandbox(info, f"systemctl show -P ExecStart {SERVICE}")
    assert f"argv[]={' '.join(arg.replace('$', '$$') for arg in render.server_args(data))}" in (
        shown
    ) or shlex.split(shown.split("argv[]=", 1)[1].split(" ; ", 1)[0]) == render.server_args(data)


def test_hostile_file_name_and_env_value_converge_literally(hostile):
    info, directory = hostile
    path = inventory(directory, filename=MODEL_NAME)
    results = sandboxes.converge(path)
    assert results["totals"]["error"] == 0
    assert_served_literally(info, path, MODEL_NAME)
    # The launcher (`llamarig run`) holds the same argv and environment, read back by sh.
    data = load_inventory(path).hosts[NAME].data
    launcher = shlex.quote(render.layout(data)["launcher"])
    exec_line = in_sandbox(info, f"tail -n1 {launcher}")
    assert shlex.split(exec_line) == ["exec", *render.server_args(data), "$@"]
    dump = "import json, os; print(json.dumps(dict(os.environ)))"
    exported = in_sandbox(
        info, f'eval "$(grep ^export {launcher})"; python3 -c {shlex.quote(dump)}'
    )
    assert {key: json.loads(exported).get(key) for key in ENV} == ENV


def test_second_converge_changes_nothing(hostile):
    info, directory = hostile
    pid = main_pid(info)
    results = sandboxes.converge(inventory(directory, filename=MODEL_NAME))
    assert results["totals"]["success"] == 0, changed_operations(results)
    assert main_pid(info) == pid


def test_file_name_from_a_percent_encoded_url(hostile):
    info, directory = hostile
    url = f"http://127.0.0.1:8765/{quote(URL_NAME)}"
    path = inventory(directory, url=url, filename=None)
    results = sandboxes.converge(path)
    assert results["totals"]["error"] == 0
    assert_served_literally(info, path, URL_NAME)


def test_a_host_config_file_of_llama_cpp_never_reaches_the_server(hostile):
    """llama.cpp applies /etc/llama.cpp/config.ini before the environment and argv, so such a
    file could set options llamarig leaves unset; the unit hides the directory from the server
    (InaccessiblePaths=), which still starts and serves."""
    info, _ = hostile
    in_sandbox(
        info,
        "mkdir -p /etc/llama.cpp && printf '[*]\\nthreads = 1\\n' > /etc/llama.cpp/config.ini "
        f"&& systemctl restart {SERVICE}",
    )
    try:
        pid = main_pid(info)
        seen = in_sandbox(info, f"ls -A /proc/{pid}/root/etc/llama.cpp; echo end")
        assert seen.splitlines() == ["end"], seen
        assert in_sandbox(info, "cat /etc/llama.cpp/config.ini").startswith("[*]")
        in_sandbox(
            info,
            f"curl -sf --retry 30 --retry-connrefused --retry-delay 1 "
            f"http://127.0.0.1:{SERVER_PORT}/health",
        )
        assert complete()["tokens_predicted"] == 4
    finally:
        in_sandbox(info, f"rm -rf /etc/llama.cpp && systemctl restart {SERVICE}")
