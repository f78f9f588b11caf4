"""Secrets go only to their own host (issue 53, item 1): on a rig whose models hold a gated
Hugging Face model (`token_file`) and a model given by `url:` on another, hostile host, the
commands llamarig would run show each secret only in requests to the host it belongs to, and
a secret no model needs any more is removed by the next converge.

The secrets a rig can hold, one test (or class) each:
- the Hub token (`model.token_file`): only to the configured Hub endpoint (same scheme, host and
  port, under its path), across redirects only as the Hub client sends it;
- the API key (`server.api_key_file`): only to the rig's own llama-server (`render.base_url`).
RPC has no secret: ggml's RPC protocol has no authentication (hence `rpc.allow_public`), so
there is nothing to scope. The gateway's keys do not exist yet.

Nothing here reaches the network: the reference is resolved from a written models.lock.yml,
the host is a recording reader or pyinfra's @local with its operations built, not run."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import urllib.error
from pathlib import Path

import pytest
from pyinfra.api.command import FileUploadCommand, StringCommand

from llamarig.config import load_inventory
from llamarig.config import lock as model_lock
from llamarig.facts import cache as factcache
from llamarig.facts.files import UrlHead
from llamarig.facts.server import ServerProbe, slot_counts_command
from llamarig.model.catalog import model_views
from llamarig.model.files import model_files
from llamarig.onhost import hostpaths
from llamarig.onhost.hostjob import JobCommand
from llamarig.onhost.httpbounds import HttpTimeouts
from llamarig.planner import header as model_header
from llamarig.planner import render
from llamarig.planner.gather import plan_for
from llamarig.serving import answers, draft_tune, pace, status, throughput

TOKEN = "hf_tok3n5ecret"
API_KEY = "sk-rig-key-91"
HUB = "https://huggingface.co"  # the default endpoint: never contacted here
COLLECTOR = "collector.example"  # the hostile host a model entry points at
GATED_FILE = "gated-Q8_0.gguf"
GATED_SHA = "1" * 64
OTHER_SHA = "2" * 64
COMMIT = "c" * 40
GPUS = '[{name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}]'
GATED = f"""\
        - name: gated
          hf: org/gated
          file: {GATED_FILE}
          token_file: '{{token}}'
"""
OTHER = f"""\
        - name: other
          url: https://{COLLECTOR}/m-Q8_0.gguf
          sha256: "{OTHER_SHA}"
          expect:
            answers: [{{prompt: "Capital of France?", contains: Paris}}]
"""


def write_rig(tmp_path: Path, *, gated: bool = True, api_key: bool = False) -> Path:
    """The inventory (host `here`, @local) and the lock beside it; returns the inventory."""
    token = tmp_path / "hf-token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    key = tmp_path / "api-key"
    key.write_text(API_KEY + "\n")
    key.chmod(0o600)
    server = f"server: {{api_key_file: '{key}'}}\n" if api_key else ""
    inventory = tmp_path / "rig.yml"
    inventory.write_text(
        "all:\n  hosts:\n    here:\n      ssh: {local: true}\n"
        f"      gpus: {GPUS}\n"
        + (f"      {server}" if server else "")
        + "      models:\n"
        + (GATED.format(token=token) if gated else "")
        + OTHER
    )
    model_lock.write_entry(
        tmp_path / model_lock.LOCK_NAME,
        {
            "reference": {
                "endpoint": HUB,
                "hf": "org/gated",
                "revision": "main",
                "file": GATED_FILE,
            },
            "commit": COMMIT,
            "requires_token": True,
            "files": [{"path": GATED_FILE, "size": 1 << 20, "sha256": GATED_SHA}],
        },
    )
    return inventory


def resolved_rig(inventory: Path, monkeypatch) -> dict:
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    data = load_inventory(inventory).hosts["here"].data
    return model_lock.resolved(data, inventory.parent / model_lock.LOCK_NAME, update=False)


def hub_url() -> str:
    return f"{HUB}/org/gated/resolve/{COMMIT}/{GATED_FILE}"


# --- the Hub token ---


class TestWhereTheHubTokenGoes:
    @pytest.mark.parametrize(
        ("url", "endpoint", "sent"),
        [
            (f"{HUB}/org/m/resolve/{COMMIT}/m.gguf", HUB, True),
            (f"{HUB}:443/org/m/resolve/{COMMIT}/m.gguf", HUB, False),  # not the endpoint's text
            (f"https://{COLLECTOR}/org/m/resolve/{COMMIT}/m.gguf", HUB, False),
            (f"http://huggingface.co/org/m/resolve/{COMMIT}/m.gguf", HUB, False),  # scheme
            ("https://huggingface.co:8443/org/m/m.gguf", HUB, False),  # port
            (f"https://huggingface.co.{COLLECTOR}/org/m/m.gguf", HUB, False),  # a suffix
            (f"https://huggingface.co@{COLLECTOR}/org/m/m.gguf", HUB, False),  # user info
            (f"https://{COLLECTOR}/?u=https://huggingface.co/org/m.gguf", HUB, False),
            (
                "https://mirror.example/hf/org/m/resolve/main/m.gguf",
                "https://mirror.example/hf",
                True,
            ),
            ("https://mirror.example/other/m.gguf", "https://mirror.example/hf", False),
            ("https://mirror.example/hfx/m.gguf", "https://mirror.example/hf", False),
            ("http://127.0.0.1:8000/org/m/resolve/main/m.gguf", "http://127.0.0.1:8000/", True),
            ("http://127.0.0.1:8001/org/m/resolve/main/m.gguf", "http://127.0.0.1:8000", False),
        ],
    )
    def test_only_a_url_of_the_endpoint_gets_the_token(self, url, endpoint, sent):
        from llamarig.model.reference import sends_hub_token

        model = {"hf": "org/m", "token_file": "/t", "endpoint": endpoint}
        assert sends_hub_token(model, url) is sent
        assert not sends_hub_token({**model, "token_file": None}, url)
        assert not sends_hub_token({**model, "hf": None}, url)

    def test_the_header_read_sends_the_token_only_to_the_hub(self, tmp_path, monkeypatch):
        """`plan --probe`, the deploy and `verify` read each model's GGUF header on this
        machine, else through the host's curl: the token's header file goes only with the Hub's
        URL, never with the URL model's on the other host (before: with both)."""
        data = resolved_rig(write_rig(tmp_path), monkeypatch)
        monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(tmp_path / "cache"))
        fetched: list[tuple[str, str | None]] = []

        def fetch_header(url, token=None, sha256=None):
            fetched.append((url, token))
            raise urllib.error.URLError("not reached in this test")

        monkeypatch.setattr(model_header, "fetch_header", fetch_header)
        url_reads: list[tuple[str, str]] = []

        def reader(fact_class, **arguments):
            if fact_class is UrlHead:
                url_reads.append((arguments["url"], fact_class().command(**arguments)))
            return None  # nothing on the host, no answer from the URL

        plan_for("here", data, reader, gpus=False)
        other = f"https://{COLLECTOR}/m-Q8_0.gguf"
        assert fetched == [(hub_url(), TOKEN), (other, None)]
        assert [url for url, _ in url_reads] == [hub_url(), other]
        for url, command in url_reads:
            assert TOKEN not in command
            carries = hostpaths.HUB_TOKEN_HEADER_PATH in command
            assert carries == url.startswith(f"{HUB}/"), f"{url}: {command}"


def command_text(command) -> str | None:
    if isinstance(command, JobCommand):
        return command.job.script
    if isinstance(command, StringCommand):
        return command.get_raw_value()
    return None


def model_stage(inventory: Path, monkeypatch) -> list[tuple[str, list]]:
    """tasks/model.py's operations for @local as pyinfra renders them (built, not run): each
    operation's name and commands. A fresh state and fact cache, as a new converge has."""
    from tasks import model

    return stage_operations(inventory, monkeypatch, model.deploy)


def stage_operations(inventory: Path, monkeypatch, deploy) -> list[tuple[str, list]]:
    """A stage's operations (``deploy()``, called in a new converge's state for @local): each
    operation's name and commands, built, not run."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.connect import connect_all
    from pyinfra.context import ctx_host, ctx_state

    from llamarig.config.ssh import pyinfra_host
    from llamarig.converge import stage

    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    monkeypatch.setattr(stage, "_rigs", {})
    monkeypatch.setattr(factcache, "_known", {})
    host_config = load_inventory(inventory).hosts["here"]
    pyinfra_inventory = Inventory(([pyinfra_host(host_config)], {}))
    state = State(pyinfra_inventory, Config())
    connect_all(state)
    host = pyinfra_inventory.get_host("@local")
    with ctx_state.use(state), ctx_host.use(host):
        deploy()
        return [
            (
                state.get_op_meta(op_hash).names.pop().split(" | ", 1)[-1],
                list(state.get_op_data_for_host(host, op_hash).command_generator()),
            )
            for op_hash in state.get_op_order()
        ]


def worker_rig(tmp_path: Path) -> Path:
    """An inventory of @local as an RPC worker (a head that became one keeps no secret)."""
    inventory = tmp_path / "rig.yml"
    inventory.write_text(
        "all:\n  hosts:\n    here:\n      ssh: {local: true}\n      role: rpc-worker\n"
        f"      gpus: {GPUS}\n      rpc: {{host: 127.0.0.1}}\n"
    )
    return inventory


def shell_commands(operations: list[tuple[str, list]]) -> list[str]:
    """The shell commands of a stage's operations, in order."""
    return [
        text
        for _, commands in operations
        for command in commands
        if (text := command_text(command)) is not None
    ]


@pytest.fixture
def token_on_host(tmp_path, monkeypatch) -> Path:
    """The token's header file on @local: a path of this test's, not /etc/llamarig."""
    from tasks import model

    directory = tmp_path / "etc-llamarig-hub"
    header = directory / "authorization-header"
    for module, name, value in (
        (hostpaths, "HUB_TOKEN_DIRECTORY", directory),
        (hostpaths, "HUB_TOKEN_HEADER_PATH", header),
        (model, "TOKEN_DIRECTORY", directory),
        (model, "TOKEN_HEADER_FILE", header),
    ):
        monkeypatch.setattr(module, name, str(value))
    return header


class TestTheTokenOnTheHost:
    def test_the_download_sends_the_token_only_to_the_hub(
        self, tmp_path, monkeypatch, token_on_host
    ):
        operations = model_stage(write_rig(tmp_path), monkeypatch)
        commands = [command for _, listed in operations for command in listed]
        uploads = [c for c in commands if isinstance(c, FileUploadCommand)]
        assert [u.dest.removesuffix(hostpaths.ATOMIC_SUFFIX) for u in uploads] == [
            str(token_on_host)
        ]
        assert uploads[0].src.getvalue() == f"Authorization: Bearer {TOKEN}\n".encode()
        shells = [text for c in commands if (text := command_text(c)) is not None]
        assert not any(TOKEN in text for text in shells + [name for name, _ in operations])
        fetches = [text for text in shells if "curl " in text]
        assert len(fetches) == 2
        for fetch in fetches:
            [url] = set(re.findall(r"-- '?(https?://[^\s']+)", fetch))
            assert (f"-H @{token_on_host}" in fetch) == url.startswith(f"{HUB}/"), fetch
        assert any(f"/resolve/{COMMIT}/" in fetch for fetch in fetches)

    def test_a_converge_after_the_gated_model_is_gone_removes_the_token_then_does_nothing(
        self, tmp_path, monkeypatch, token_on_host
    ):
        """The token left on the host by an earlier converge is removed by the first one
        whose rig needs it no more; the next converge changes nothing."""
        token_on_host.parent.mkdir(mode=0o700)
        token_on_host.write_text(f"Authorization: Bearer {TOKEN}\n")
        inventory = write_rig(tmp_path, gated=False)

        def removals() -> list[str]:
            listed = [
                text
                for _, commands in model_stage(inventory, monkeypatch)
                for command in commands
                if (text := command_text(command)) is not None and str(token_on_host) in text
            ]
            assert all(
                text.startswith("rm ") and TOKEN not in text and "curl" not in text
                for text in listed
            ), listed
            return listed

        first = removals()
        assert first, "no operation removes the token the rig no longer needs"
        for text in first:
            subprocess.run(["sh", "-ec", text], check=True, timeout=30)
        assert not token_on_host.exists()
        assert removals() == []  # the second converge: nothing to do

    def test_an_rpc_worker_keeps_no_token(self, tmp_path, monkeypatch, token_on_host):
        token_on_host.parent.mkdir(mode=0o700)
        token_on_host.write_text(f"Authorization: Bearer {TOKEN}\n")
        listed = shell_commands(model_stage(worker_rig(tmp_path), monkeypatch))
        assert listed == [f"rm -f {shlex.quote(str(token_on_host))}"]

    def test_an_rpc_worker_keeps_no_api_key(self, tmp_path, monkeypatch):
        """A head that became a worker: its key and the curl header that sends it are removed,
        since no request from a worker may carry them."""
        from tasks import server

        key, header = tmp_path / "api-key", tmp_path / "api-key.header"
        for path in (key, header):
            path.write_text("sk-left-behind\n")
        monkeypatch.setattr(hostpaths, "API_KEY_PATH", str(key))
        monkeypatch.setattr(hostpaths, "API_KEY_HEADER_PATH", str(header))
        operations = stage_operations(worker_rig(tmp_path), monkeypatch, lambda: server.deploy([]))
        listed = shell_commands(operations)
        assert listed == [f"rm -f {shlex.quote(str(path))}" for path in (key, header)]


# --- the API key ---


URL = re.compile(r"https?://[^\s'\"]+")


def api_key_commands(data: dict, monkeypatch) -> dict[str, str]:
    """Every command llamarig runs on the host that may carry the API key (its header file):
    the deploy's checks and `verify`'s, `status`, `complete`, `tune` (throughput and draft)."""
    from llamarig import cli
    from llamarig.serving import tune

    base, bounds = render.base_url(data), HttpTimeouts.of(data)
    names = tuple(view.name for view in model_views(data))
    commands = {
        "status": status.probe_command(data, 1.0),
        "tune load": throughput.load_command(data, 2, 1),
        "tune draft": draft_tune.draft_request_command(data, "Hello"),
        "deploy pace": pace.decode_command(base, bounds, names[0] if names else None),
        "verify probe": ServerProbe().command(base, bounds, names),
        "drain": slot_counts_command(base, bounds, names),
    }
    for answer in answers.answers(data):
        commands[f"answer {answer.name}"] = answers.check_command(base, answer, bounds)
    slots: list[str] = []
    tune._slots_busy(data, lambda command, timeout: (slots.append(command), (1, "", ""))[1])
    commands["tune slots"] = slots[0]

    completions: list[str] = []

    def run_on_host(host_data, command, timeout=None):
        completions.append(command)
        return subprocess.CompletedProcess([], 0, json.dumps({"content": "ok"}), "")

    monkeypatch.setattr(cli, "run_on_host", run_on_host)
    assert cli.main(["complete", "--prompt", "Hi"]) == 0
    commands["complete"] = completions[0]
    return commands


class TestWhereTheApiKeyGoes:
    def test_the_api_key_goes_only_to_the_rigs_own_server(self, tmp_path, monkeypatch):
        """The key reaches the host as a systemd credential and a root-only header file
        (``-H @``), and every request that sends it is to the rig's own llama-server,
        never to a host the rig data names elsewhere (the model's URL)."""
        data = resolved_rig(write_rig(tmp_path, api_key=True), monkeypatch)
        own = render.base_url(data)
        commands = api_key_commands(data, monkeypatch)
        for what, command in commands.items():
            assert API_KEY not in command and TOKEN not in command, what
            assert hostpaths.HUB_TOKEN_HEADER_PATH not in command, what
            if hostpaths.API_KEY_HEADER_PATH not in command:
                continue
            urls = URL.findall(command)
            assert urls and all(url.startswith(f"{own}/") for url in urls), (what, urls)
            assert COLLECTOR not in command, what
        assert any(what.startswith("answer ") for what in commands)
        assert {
            what for what, command in commands.items() if hostpaths.API_KEY_HEADER_PATH in command
        } == set(commands)
        # Not the Hub token's file either: each secret its own file, each file its own host.
        assert hostpaths.API_KEY_HEADER_PATH != hostpaths.HUB_TOKEN_HEADER_PATH
        assert [f.url for view in model_views(data) for f in model_files(view.data)] == [
            hub_url(),
            f"https://{COLLECTOR}/m-Q8_0.gguf",
        ]
