"""Several models behind one llama-server (issue 30), for real on a sandbox rig: SmolLM2 and
the random-weight test model served by llama-server's router mode under the hardened unit,
from a presets file llamarig writes. Both are listed by GET /v1/models under their names and
answer a request each (SmolLM2: Paris, asked by the deploy through the router, and by the
OpenAI client); a second converge changes nothing and `llamarig verify` checks each model's
answers; a third entry (SmolLM2's file under another name and context) downloads nothing and
touches no other model's file, and the converge after it changes nothing.

Stand-ins as in test_sandbox_converge: the models come from the loopback file server, llama.cpp
from a git daemon mirror. Needs root, systemd-nspawn and mmdebstrap.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests import sandboxes
from tests.sandboxes import changed_operations, fresh_sandbox, in_sandbox

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

NAME, SSH_PORT, SERVER_PORT = "sandbox-router", 2234, 8100
BASE_URL = f"http://127.0.0.1:{SERVER_PORT}"
SMOLLM2_FILE = "/opt/llamarig/models/SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2 cut after 20 MB: its header reads (the plan is made), its tensors do not load.
BROKEN_FILE = "/srv/broken.gguf"


# A 2 GiB Turing card, declared: each model fits on it alone, all of them at once do not.
SMALL_GPU = {"name": "NVIDIA T400", "vram_mib": 2048, "compute_capability": "7.5"}


def inventory(
    path: Path,
    info,
    third: bool = False,
    broken: bool = False,
    small_gpu: bool = False,
    smollm2_top_k: int | None = None,
) -> Path:
    """The demo rig with its model and answers moved into `models:`, beside the test model."""

    def edit(rig: dict) -> None:
        smollm2 = {"name": "smollm2", **rig.pop("model"), "load_on_startup": True}
        # 2,048 tokens a slot: room for a stream that outlasts a converge.
        smollm2["server"] = {"ctx": 4096, "parallel": 2}
        smollm2["expect"] = {"answers": rig.pop("expect")["answers"]}
        if smollm2_top_k:
            smollm2["server"]["sampling"] = {"top_k": smollm2_top_k}
        tiny = {
            "name": "tiny-random",
            **sandboxes.random_model(info),
            # Its own default sampling, in its preset section.
            "server": {"ctx": 1024, "parallel": 1, "sampling": {"temperature": 0.5, "top_k": 10}},
        }
        rig["models"] = [smollm2, tiny]
        if third:
            rig["models"].append(
                {**{k: v for k, v in smollm2.items() if k != "expect"}, "name": "smollm2-short",
                 "load_on_startup": False, "server": {"ctx": 512, "parallel": 1}}
            )  # fmt: skip
        if broken:
            rig["models"].append({"name": "broken", "path": BROKEN_FILE})
        if small_gpu:
            rig.update(driver={"source": "distro"}, cuda={"source": "distro"}, gpus=[SMALL_GPU])
            rig["llama_cpp"]["backend"] = "cuda"
        rig["server"]["port"] = SERVER_PORT
        sandboxes.lane_rig(rig)

    return sandboxes.demo_rig_inventory(path, NAME, SSH_PORT, edit)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    sandbox = fresh_sandbox(NAME, "trixie", SSH_PORT)
    info = next(sandbox)
    yield info, tmp_path_factory.mktemp("router")
    next(sandbox, None)  # takes the sandbox down


def request(path: str, body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"}
    with urllib.request.urlopen(
        urllib.request.Request(BASE_URL + path, data, headers), timeout=300
    ) as reply:
        return json.load(reply)


def file_identities(info) -> str:
    return in_sandbox(info, "stat -c '%n %i %Y' /opt/llamarig/models/*.gguf")


def test_one_router_serves_both_models_by_name(rig):
    info, directory = rig
    path = inventory(directory / "router.yml", info)
    result = sandboxes.deploy(path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    # The deploy asked SmolLM2's answer of the router, by the model's name.
    assert re.search(r"1 expected answer\(s\) right at \S+", output), output[-3000:]

    unit = in_sandbox(info, "systemctl cat llama-server.service")
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert "--models-preset /etc/llamarig/llama-server.presets.ini" in exec_start
    assert " -m " not in exec_start and " -c " not in exec_start, exec_start
    presets = in_sandbox(info, "cat /etc/llamarig/llama-server.presets.ini")
    assert "[smollm2]" in presets and "[tiny-random]" in presets, presets
    assert f"m = {SMOLLM2_FILE}" in presets and "c = 1024" in presets, presets
    assert "temp = 0.5" in presets and "top-k = 10" in presets, presets

    listed = [model["id"] for model in request("/v1/models")["data"]]
    assert sorted(listed) == ["smollm2", "tiny-random"], listed
    question = {"role": "user", "content": "What is the capital of France? Answer in one word."}
    reply = request(
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [question], "max_tokens": 16, "temperature": 0},
    )
    assert "Paris" in reply["choices"][0]["message"]["content"], reply
    # The test model's weights are random: it answers, with nonsense.
    reply = request("/completion", {"model": "tiny-random", "prompt": "Hello", "n_predict": 8})
    assert reply["tokens_predicted"] == 8, reply
    # The child serving it took its sampling defaults from the preset (llama-server's /props,
    # proxied by the router to the model's own server).
    params = request("/props?model=tiny-random")["default_generation_settings"]["params"]
    assert (params["temperature"], params["top_k"]) == (0.5, 10), params

    from openai import OpenAI

    client = OpenAI(base_url=f"{BASE_URL}/v1", api_key="no-key", timeout=300, max_retries=0)
    answer = client.chat.completions.create(
        model="smollm2", messages=[question], max_tokens=16, temperature=0
    )
    assert "Paris" in answer.choices[0].message.content, answer

    assert changed_operations(sandboxes.converge(path)) == []
    status = sandboxes.llamarig(path, "status", "--window", "1")
    assert status.returncode == 0, status.stdout + status.stderr
    assert "models   2 models from /etc/llamarig/llama-server.presets.ini" in status.stdout
    # The deploy's check after the start loaded both; the router tells each one's state.
    assert "model    smollm2: loaded" in status.stdout, status.stdout
    assert "model    tiny-random: loaded" in status.stdout, status.stdout
    verified = sandboxes.verify(path, "-v")
    assert verified.returncode == 0, verified.stdout[-4000:]
    assert re.search(
        r"test_expected_answer\[models\[0\]\.answers\[0\]\S*\] PASSED", verified.stdout
    ), verified.stdout[-4000:]


def stream(model: str, tokens: int, said: dict) -> None:
    """A streamed completion of ``tokens`` tokens; ``said`` gets the tokens, the first chunk's
    time and the error, if any."""
    body = {"model": model, "prompt": "Once upon a time", "n_predict": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}  # fmt: skip
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    said["tokens"] = 0
    try:
        req = urllib.request.Request(BASE_URL + "/completion", data, headers)
        with urllib.request.urlopen(req, timeout=600) as reply:
            for line in reply:
                if line.startswith(b"data: {"):
                    said.setdefault("first", time.monotonic())
                    chunk = json.loads(line[len(b"data: ") :])
                    said["tokens"] = chunk.get("tokens_predicted", said["tokens"] + 1)
    except Exception as error:  # noqa: BLE001 - whatever cut the stream is the finding
        said["error"] = repr(error)


def streaming_started(model: str, tokens: int) -> tuple[threading.Thread, dict]:
    """A stream (``stream``) on its thread, once its first chunk came (within 120 s)."""
    said: dict = {}
    streaming = threading.Thread(target=stream, args=(model, tokens, said))
    streaming.start()
    deadline = time.monotonic() + 120
    while "first" not in said and "error" not in said and time.monotonic() < deadline:
        time.sleep(0.1)
    return streaming, said


def test_a_third_model_restarts_nothing_and_fetches_nothing(rig):
    """Adding a model only changes the presets: the router reads them again, and a stream
    from SmolLM2 running through the converge ends whole."""
    info, directory = rig
    before = file_identities(info)
    pid = in_sandbox(info, "systemctl show -P MainPID llama-server.service")
    path = inventory(directory / "router3.yml", info, third=True)
    streaming, said = streaming_started("smollm2", 2000)
    applied = changed_operations(sandboxes.converge(path))
    still_streaming = streaming.is_alive()
    streaming.join(600)
    assert any(op.startswith("Model presets") for op in applied), applied
    assert any(op.startswith("Reload the router's presets") for op in applied), applied
    assert not [op for op in applied if op.startswith("Restart")], applied
    assert in_sandbox(info, "systemctl show -P MainPID llama-server.service") == pid
    assert still_streaming, f"the stream ended before the converge did: {said}"
    assert "error" not in said and said["tokens"] == 2000, said
    assert not [op for op in applied if op.startswith(("Model /", "Checksum of"))], applied
    assert file_identities(info) == before
    listed = sorted(model["id"] for model in request("/v1/models")["data"])
    assert listed == ["smollm2", "smollm2-short", "tiny-random"], listed
    reply = request("/completion", {"model": "smollm2-short", "prompt": "Paris is", "n_predict": 4})
    assert reply["tokens_predicted"] == 4, reply
    assert changed_operations(sandboxes.converge(path)) == []


def test_a_model_that_does_not_load_rolls_the_router_back_naming_it(rig):
    info, directory = rig
    in_sandbox(info, f"head -c 20000000 {SMOLLM2_FILE} > {BROKEN_FILE}")
    result = sandboxes.deploy(inventory(directory / "broken.yml", info, third=True, broken=True))
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    assert "/completion of model broken failed" in output, output[-4000:]
    assert "rolled back: the last version that served" in output, output[-4000:]
    # The presets that served are back, and so is every model in them.
    presets = in_sandbox(info, "cat /etc/llamarig/llama-server.presets.ini")
    assert "[broken]" not in presets and "[smollm2-short]" in presets, presets
    listed = sorted(model["id"] for model in request("/v1/models")["data"])
    assert listed == ["smollm2", "smollm2-short", "tiny-random"], listed
    status = sandboxes.llamarig(directory / "router3.yml", "status", "--window", "1")
    assert "model    smollm2-short: " in status.stdout, status.stdout
    question = {"role": "user", "content": "What is the capital of France? Answer in one word."}
    reply = request(
        "/v1/chat/completions",
        {"model": "smollm2", "messages": [question], "max_tokens": 16, "temperature": 0},
    )
    assert "Paris" in reply["choices"][0]["message"]["content"], reply
    # The rig data without the broken entry is what serves: nothing to change.
    assert changed_operations(sandboxes.converge(directory / "router3.yml")) == []


def test_a_changed_model_is_unloaded_only_once_its_requests_end(rig):
    """A changed preset unloads that model's server (llama-server's reload stops its child):
    the converge first waits for the request it serves, within server.drain_timeout, so the
    stream running through it ends whole; then the model serves with its new setting."""
    info, directory = rig
    pid = in_sandbox(info, "systemctl show -P MainPID llama-server.service")
    path = inventory(directory / "router-top-k.yml", info, third=True, smollm2_top_k=40)
    streaming, said = streaming_started("smollm2", 1200)
    result = sandboxes.deploy(path)
    output = result.stdout + result.stderr
    streaming.join(600)
    assert result.returncode == 0, output[-4000:]
    assert "error" not in said and said["tokens"] == 1200, said
    assert (
        "slots of llama-server.service to finish their requests before restarting the "
        "model(s) whose presets changed (smollm2)" in output
    ), output[-4000:]
    assert "the requests in flight on llama-server.service finished after" in output
    assert in_sandbox(info, "systemctl show -P MainPID llama-server.service") == pid
    params = request("/props?model=smollm2")["default_generation_settings"]["params"]
    assert params["top_k"] == 40, params
    assert changed_operations(sandboxes.converge(path)) == []


# Where the deploy writes: a refused plan must leave every one of them as it was.
WRITTEN_PLACES = "/etc /opt /usr/local /var/lib/llamarig /var/lib/dpkg"


def test_models_that_cannot_fit_together_are_refused_before_the_host_is_touched(rig):
    """The rig moved onto a declared 2 GiB GPU: each model fits on it alone, the three that
    may be loaded at once do not. The sandbox has no GPU, so the one refusal names that too;
    the deploy stops before any stage, and the rig serves on as it was."""
    info, directory = rig
    pid = in_sandbox(info, "systemctl show -P MainPID llama-server.service")
    in_sandbox(info, "touch /run/llamarig-before-refusal")
    path = inventory(directory / "small-gpu.yml", info, third=True, small_gpu=True)

    planned = sandboxes.llamarig(path, "plan")
    assert planned.returncode != 0, planned.stdout
    assert f"== {NAME}: REFUSED" in planned.stdout, planned.stdout
    assert re.search(r"NVIDIA T400 +\d+ +\d+ +2048 +[1-9]\d*", planned.stdout), planned.stdout

    result = sandboxes.deploy(path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-4000:]
    found = re.search(
        r"the models that may be loaded at once \(([^)]+)\) do not fit together: "
        r"NVIDIA T400 lacks (\d+) MiB \((\d+) needed, 2048 there\)",
        output,
    )
    assert found, output[-4000:]
    assert sorted(found[1].split(", ")) == ["smollm2", "smollm2-short", "tiny-random"]
    assert int(found[2]) == int(found[3]) - 2048 > 0
    assert "no NVIDIA GPU on the PCI bus" in output, output[-4000:]
    # Each model alone fits: the refusal is about the models together, not one of them.
    assert "does not fit in GPU memory" not in output, output[-4000:]

    touched = in_sandbox(
        info, f"find {WRITTEN_PLACES} -newer /run/llamarig-before-refusal 2>/dev/null || true"
    )
    assert touched == "", touched
    assert in_sandbox(info, "systemctl show -P MainPID llama-server.service") == pid
    reply = request("/completion", {"model": "tiny-random", "prompt": "Hello", "n_predict": 4})
    assert reply["tokens_predicted"] == 4, reply
