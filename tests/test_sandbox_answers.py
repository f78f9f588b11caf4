"""The answer check on the sandbox rig, for real: SmolLM2-135M-Instruct (the demo's model)
answers the demo's question right, the deploy and `llamarig verify` say so; the random-weight
test model with the same expectation is rolled back by the deploy, naming the answer, and
fails `llamarig verify` by name, as does a stopped service.

This is the one sandbox scenario of `make test` (the quick tier, not marked `heavy`): a first
converge that serves and answers, a second that changes nothing, verify, a rollback.

Stand-ins as in test_sandbox_converge: the models come from the loopback file server, llama.cpp
from a git daemon mirror. Needs root, systemd-nspawn and mmdebstrap.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests import sandboxes
from tests.conftest import PROJECT, pyinfra_env
from tests.sandboxes import changed_operations, fresh_sandbox, in_sandbox, random_model

pytestmark = [pytest.mark.sandbox, pytest.mark.slow]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)

INVENTORY = PROJECT / "inventory" / "hosts.yml"
SERVICE = "llama-server"
QUESTION = "What is the capital of France? Answer in one word."


@pytest.fixture(scope="module")
def sandbox_info():
    yield from fresh_sandbox("sandbox-trixie", "trixie", 2222)


def variant(tmp_path: Path, name: str, **changes) -> Path:
    """A copy of the demo inventory with whole sections of the sandbox host replaced."""
    document = yaml.safe_load(INVENTORY.read_text())
    host = document["all"]["children"]["sandbox"]["hosts"]["sandbox"]
    host.update(changes)
    path = tmp_path / f"{name}.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def chat_answer(question: str = QUESTION) -> str:
    """Ask the service greedily from this machine (nspawn shares the host's network)."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": question}], "max_tokens": 32, "temperature": 0}
    ).encode()
    request = urllib.request.Request(
        "http://127.0.0.1:8080/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["message"]["content"]


def test_smollm2_answers_the_demo_question(sandbox_info):
    expected = yaml.safe_load(INVENTORY.read_text())["all"]["children"]["sandbox"]["hosts"][
        "sandbox"
    ]["expect"]["answers"]
    assert expected == [{"prompt": QUESTION, "chat": True, "contains": "Paris"}]
    result = sandboxes.deploy(INVENTORY)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    checked = re.search(r"1 expected answer\(s\) right at \S+ in ([0-9.]+) s", output)
    assert checked, output[-3000:]
    print(f"deploy: the answer check took {checked.group(1)} s")
    assert "Paris" in chat_answer()

    started = time.monotonic()
    result = sandboxes.verify(INVENTORY, "-v", "-rP")
    print(f"llamarig verify: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stdout[-4000:]
    passed = r"test_expected_answer\[answers\[0\]-\S+\] PASSED"
    assert re.search(passed, result.stdout), result.stdout[-4000:]
    print(re.search(r"expect\.answers\[0\] .* answered right in [0-9.]+ s", result.stdout)[0])

    results = sandboxes.converge(INVENTORY)
    assert results["totals"]["success"] == 0, changed_operations(results)


def test_an_openai_client_asks_the_model_by_its_alias(sandbox_info):
    """What a team's code does: the OpenAI Python client lists the model by the name the rig
    gives it (server.alias, derived from the file name) and asks it by that name."""
    from openai import OpenAI

    client = OpenAI(
        base_url="http://127.0.0.1:8080/v1", api_key="no-key", timeout=120, max_retries=0
    )
    assert [model.id for model in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    reply = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=16,
        temperature=0,
    )
    assert "Paris" in reply.choices[0].message.content, reply


def test_the_demo_ends_with_the_real_answer(sandbox_info):
    """The last line of `make demo`, as the Makefile runs it."""
    makefile = (PROJECT / "Makefile").read_text()
    assert f'llamarig complete --chat --tokens 32 \\\n\t\t--prompt "{QUESTION}"' in makefile
    result = subprocess.run(
        [sys.executable, "-m", "llamarig.cli", "complete", "--chat", "--tokens", "32"]
        + ["--prompt", QUESTION],
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY=str(INVENTORY)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    print(result.stdout)
    answer = re.search(r"^  answer: +'(.*)'$", result.stdout, re.MULTILINE)
    assert answer and "Paris" in answer[1], result.stdout


def test_a_model_that_answers_wrongly_is_rolled_back(sandbox_info, tmp_path):
    unit_before = in_sandbox(sandbox_info, f"cat /etc/systemd/system/{SERVICE}.service")
    wrong = variant(tmp_path, "random", model=random_model(sandbox_info))
    result = sandboxes.deploy(wrong)
    output = result.stdout + result.stderr
    assert result.returncode != 0, "a version that answers wrongly must fail the run"
    assert f"the new version of {SERVICE}.service answers wrongly" in output, output[-4000:]
    assert f"expect.answers[0] ({QUESTION!r}): expected the answer to contain 'Paris'" in output
    seconds = re.search(r"serves again after (\d+) s", output)
    assert seconds, output[-4000:]
    print(f"rollback after a wrong answer: the old version served again in {seconds[1]} s")
    assert in_sandbox(sandbox_info, f"cat /etc/systemd/system/{SERVICE}.service") == unit_before
    assert "Paris" in chat_answer()
    # Nothing is left to repair: the demo rig converges without a change.
    results = sandboxes.converge(INVENTORY)
    assert results["totals"]["success"] == 0, changed_operations(results)


def test_verify_fails_by_name_against_the_random_model(sandbox_info, tmp_path):
    no_answers = variant(
        tmp_path, "random-unchecked", model=random_model(sandbox_info), expect={"answers": []}
    )
    sandboxes.converge(no_answers)
    try:
        wrong = variant(tmp_path, "random", model=random_model(sandbox_info))
        result = sandboxes.verify(wrong, "-v")
        named = re.search(r"AssertionError: (expect\.answers\[0\].*)$", result.stdout, re.M)
        assert named, result.stdout[-4000:]
        print(f"llamarig verify: {named[1]}")
        assert result.returncode != 0, result.stdout[-4000:]
        assert re.search(r"test_expected_answer\[answers\[0\]-\S+\] FAILED", result.stdout)
        assert f"expect.answers[0] ({QUESTION!r}): expected the answer to contain 'Paris', got" in (
            result.stdout
        ), result.stdout[-4000:]
        # Only the answer fails: the random model serves, health and completion pass.
        assert re.search(r"\b1 failed\b", result.stdout), result.stdout[-2000:]
    finally:
        # Back to the demo rig, its speed unmeasured: the record is the random model's, so the
        # look would be SmolLM2's first, taken beside the other lane's build (up to 20-fold
        # slower); the serving unit is the demo's either way.
        sandboxes.converge(
            sandboxes.demo_rig(tmp_path / "hosts-unmeasured.yml", sandboxes.speed_unmeasured)
        )
    assert "Paris" in chat_answer()
    assert changed_operations(sandboxes.converge(INVENTORY)) == []


def test_verify_names_a_stopped_service(sandbox_info):
    # Last in this module: the service comes back started, not necessarily loaded yet.
    sandboxes.assert_verify_names_a_stopped_service(sandbox_info, INVENTORY, SERVICE)
