"""Models named the way users name them, deployed for real in the sandbox rig: a Hugging Face
reference (`model: {hf, file, endpoint, token_file}`) and a split GGUF (3 shards).

STAND-IN, stated plainly: the Hub is tests/hubstandin.py on 127.0.0.1 (its API and its 302 to
a "CDN" on another port), serving the real SmolLM2-135M-Instruct Q4_1 (GUIDE §9, the `smollm2`
fixture); `endpoint` points at it, the production default stays https://huggingface.co. The
repo is gated, so the host's download needs the token, which travels only as a root-only
header file. The split set is SmolLM2 rewritten by gguf-py's GGUFWriter(split_max_tensors)
(tests/ggufmodels.split_gguf), the layout llama.cpp's gguf-split writes.

Needs root and the sandbox (see test_sandbox_converge); the nspawn container shares this
machine's loopback, so it reaches the stand-in as this process does.
"""

from __future__ import annotations

import json
import os
import shlex
import urllib.request
from pathlib import Path

import pytest
import yaml

from llamarig.config.lock import LOCK_NAME, read_lock
from llamarig_sandbox import realmodel
from tests import sandboxes
from tests.conftest import PROJECT
from tests.ggufmodels import split_gguf
from tests.hubstandin import HubStandIn, RunningStandIn
from tests.sandboxes import changed_operations, fresh_sandbox, in_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

INVENTORY = PROJECT / "inventory" / "hosts.yml"
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
TOKEN = "hf_standin_token_9f1c2e"
SPLIT_FIRST = "split/SmolLM2-135M-Instruct.Q4_1-00001-of-00003.gguf"
MODELS = "/opt/llamarig/models"


@pytest.fixture(scope="module")
def hub(tmp_path_factory, smollm2):
    """The stand-in Hub with the gated repo: SmolLM2 at its root and its 3 shards in split/."""
    root = tmp_path_factory.mktemp("repo")
    (root / smollm2.name).symlink_to(smollm2)
    split_gguf(smollm2, root / "split", 3)
    stand_in = HubStandIn()
    stand_in.add_repo(REPO, root, gated=True, tokens=(TOKEN,))
    running = RunningStandIn(stand_in)
    yield running
    running.close()


@pytest.fixture(scope="module")
def sandbox_info():
    yield from fresh_sandbox("sandbox-trixie", "trixie", 2222)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("inventory")
    (directory / "token").write_text(TOKEN + "\n")
    (directory / "token").chmod(0o600)
    return directory


def hf_inventory(workdir: Path, hub: RunningStandIn, file: str, **server) -> Path:
    """The sandbox inventory with the model named by a Hugging Face reference to the stand-in
    (and ``server`` settings); models.lock.yml is written beside it."""
    document = yaml.safe_load(INVENTORY.read_text())
    host = document["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    host["model"] = {
        "url": None,
        "sha256": None,
        "hf": REPO,
        "file": file,
        "endpoint": hub.url,
        "token_file": str(workdir / "token"),
    }
    sandboxes.lane_rig(host)
    host["server"].update(server)
    path = workdir / "hosts.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def complete(prompt: str) -> str:
    body = json.dumps({"prompt": prompt, "n_predict": 12, "temperature": 0}).encode()
    request = urllib.request.Request(
        "http://127.0.0.1:8080/completion", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)["content"]


def server_model_argument(info) -> str:
    pid = in_sandbox(info, "systemctl show -P MainPID llama-server")
    argv = in_sandbox(info, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines()
    return argv[argv.index("-m") + 1]


PROMPT = "The capital of France is"
QUESTION = "What is the capital of France? Answer in one word."


def test_a_gated_hf_reference_deploys_with_the_token_only_in_a_root_only_file(
    sandbox_info, hub, workdir
):
    inventory = hf_inventory(workdir, hub, realmodel.NAME)
    hub.stand_in.requests.clear()
    # --diff and --debug: pyinfra shows a new file's content and every command it runs.
    result = sandboxes.deploy(inventory, "--json", "--diff", "--debug")
    assert result.returncode == 0, result.stderr[-6000:]
    assert TOKEN not in result.stdout + result.stderr
    assert server_model_argument(sandbox_info) == f"{MODELS}/{realmodel.NAME}"
    assert "Paris" in complete(PROMPT)

    # The host's curl sent the token to the Hub's resolve URL, and not to the CDN it was
    # redirected to (another port: curl drops a -H Authorization across origins).
    host_gets = [r for r in hub.stand_in.requests if r.method == "GET" and "/resolve/" in r.path]
    cdn_gets = [r for r in hub.stand_in.requests if r.server == "cdn" and r.method == "GET"]
    assert host_gets and all(r.authorized for r in host_gets), host_gets
    assert cdn_gets and not any(r.authorized for r in cdn_gets), cdn_gets
    header = "/etc/llamarig/hub/authorization-header"
    assert in_sandbox(sandbox_info, f"stat -c '%a %U' {header} /etc/llamarig/hub") == (
        "600 root\n700 root"
    )
    unit = in_sandbox(sandbox_info, "cat /etc/systemd/system/llama-server.service")
    journal = in_sandbox(sandbox_info, "journalctl --no-pager -q -u llama-server")
    assert TOKEN not in unit + journal

    [entry] = read_lock(workdir / LOCK_NAME)
    assert entry["reference"]["hf"] == REPO and len(entry["commit"]) == 40
    assert [f["path"] for f in entry["files"]] == [realmodel.NAME]


def test_a_second_converge_of_the_reference_changes_nothing(sandbox_info, hub, workdir):
    inventory = hf_inventory(workdir, hub, realmodel.NAME)
    hub.stand_in.requests.clear()
    results = sandboxes.converge(inventory)
    assert results["totals"]["success"] == 0, changed_operations(results)
    # planned from models.lock.yml: the Hub's API was not asked again
    assert not [r for r in hub.stand_in.requests if r.path.startswith("/api/")]


def world_readable_files_holding(info, *secrets: str) -> str:
    """The world-readable files of the sandbox's root that hold any of ``secrets``."""
    patterns = " ".join(f"-e {shlex.quote(secret)}" for secret in secrets)
    return in_sandbox(
        info,
        "find / -xdev -type f -perm -o=r -size -64M -print0 "
        f"| xargs -0 grep -l -F {patterns} 2>/dev/null || true",
    )


def test_a_changed_token_reaches_the_host_and_no_output(sandbox_info, hub, workdir):
    rotated = "hf_standin_token_rotated_7d3e5a"
    token_file = workdir / "token"
    token_file.write_text(rotated + "\n")
    try:
        result = sandboxes.deploy(hf_inventory(workdir, hub, realmodel.NAME), "--diff", "--debug")
        output = result.stdout + result.stderr
        assert result.returncode == 0, output[-4000:]
        assert TOKEN not in output and rotated not in output
        header = "/etc/llamarig/hub/authorization-header"
        assert in_sandbox(sandbox_info, f"grep -c -F {rotated} {header}") == "1"
        assert world_readable_files_holding(sandbox_info, TOKEN, rotated) == ""
    finally:
        token_file.write_text(TOKEN + "\n")


def test_no_secret_the_rig_holds_reaches_any_output(sandbox_info, hub, workdir):
    """The rig's secrets (a Hub token and an API key; RPC has none) set, then both rotated:
    no deploy (with --diff --debug), `llamarig plan`, `verify` or `complete` prints one, and
    neither the unit, the env file, the journal nor any world-readable file of the host
    holds one."""
    token_file, key_file = workdir / "token", workdir / "api.key"
    keys = ["api_key_8c1f0b6e2d5a4937", "api_key_rotated_51e9a7c3"]
    tokens = [TOKEN, "hf_standin_token_rotated_c04b81"]
    secrets = keys + tokens
    outputs = {}
    try:
        for key, token in zip(keys, tokens, strict=True):
            key_file.write_text(key + "\n")
            key_file.chmod(0o600)
            token_file.write_text(token + "\n")
            inventory = hf_inventory(workdir, hub, realmodel.NAME, api_key_file=str(key_file))
            result = sandboxes.deploy(inventory, "--diff", "--debug")
            assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
            outputs[f"deploy with {key}"] = result.stdout + result.stderr
        for command in (
            ["plan"],
            ["verify"],
            ["complete", "--chat", "--tokens", "16", "--prompt", QUESTION],
        ):
            result = sandboxes.llamarig(inventory, *command)
            assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
            outputs[command[0]] = result.stdout + result.stderr
        assert "Paris" in outputs["complete"]
        places = {
            "unit": "systemctl cat llama-server",
            "env file": "cat /etc/llamarig/llama-server.env",
            "journal": "journalctl --no-pager -q -o cat",
        }
        for place, command in places.items():
            outputs[place] = in_sandbox(sandbox_info, command)
        found = {place: [s for s in secrets if s in text] for place, text in outputs.items()}
        assert not any(found.values()), {place: held for place, held in found.items() if held}
        assert world_readable_files_holding(sandbox_info, *secrets) == ""
        # The rotated secrets reached their root-only files.
        assert in_sandbox(sandbox_info, f"grep -c -F {keys[1]} /etc/llamarig/api-key") == "1"
    finally:
        token_file.write_text(TOKEN + "\n")
        # Back to the keyless rig the other tests ask.
        assert sandboxes.deploy(hf_inventory(workdir, hub, realmodel.NAME)).returncode == 0


def test_a_split_model_brings_its_three_shards_and_serves_from_the_first(
    sandbox_info, hub, workdir
):
    unsplit_answer = complete(PROMPT)
    inventory = hf_inventory(workdir, hub, SPLIT_FIRST)
    results = sandboxes.converge(inventory)
    changed = changed_operations(results)
    shards = [f"{MODELS}/{Path(SPLIT_FIRST).name.replace('00001', f'{n:05d}')}" for n in (1, 2, 3)]
    assert all(any(name.startswith(f"Model {s} ") for name in changed) for s in shards), changed
    listed = in_sandbox(sandbox_info, f"sha256sum {' '.join(shards)}").splitlines()
    recorded = {
        f["path"].rsplit("/", 1)[-1]: f["sha256"]
        for f in read_lock(workdir / LOCK_NAME)[-1]["files"]
    }
    assert {line.split()[1].rsplit("/", 1)[-1]: line.split()[0] for line in listed} == recorded
    assert server_model_argument(sandbox_info) == shards[0]
    assert complete(PROMPT) == unsplit_answer
