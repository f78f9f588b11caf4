"""Schema and cross-field validation of rig inventories, and how mistakes are reported."""

import subprocess
import sys

import paramiko
import pytest

from llamarig.config import ConfigError, load_inventory
from llamarig.config.lock import LOCK_NAME
from llamarig.config.problems import Problem, located
from tests.conftest import PROJECT, offline, pyinfra_env

MINIMAL = """
all:
  children:
    rigs:
      hosts:
        rig1:
          ssh: {host: 192.0.2.1, user: root}
          gpus:
            - {name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}
            - {name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}
          model:
            url: https://example.org/m.gguf
            sha256: "%s"
""" % ("a" * 64)


def problems_of(write_inventory, text: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_inventory(write_inventory(text))
    return caught.value.problems


def test_shipped_inventories_are_valid():
    # models.lock.yml sits beside them: the record of their models, not an inventory
    paths = sorted(p for p in (PROJECT / "inventory").glob("*.yml") if p.name != LOCK_NAME)
    assert len(paths) >= 4
    for path in paths:
        assert load_inventory(path).hosts, path


def test_defaults_fill_what_the_host_leaves_out(write_inventory):
    rig = load_inventory(write_inventory(MINIMAL)).hosts["rig1"].data
    assert rig["server"]["host"] == "127.0.0.1"
    assert rig["llama_cpp"]["commit"] == "0c1e57098bba43ac29e6e3b677cdceebdd22334f"
    assert rig["driver"] == {
        "source": "nvidia-repo",
        "branch": 580,
        "open": True,
        "secure_boot": "auto",
    }


def test_group_vars_merge_deeply_and_host_wins(write_inventory):
    text = MINIMAL.replace(
        "    rigs:\n",
        "    rigs:\n      vars:\n        server: {ctx: 8192, port: 9000}\n",
    ).replace("          model:", "          server: {port: 9100}\n          model:")
    server = load_inventory(write_inventory(text)).hosts["rig1"].data["server"]
    assert (server["ctx"], server["port"], server["parallel"]) == (8192, 9100, 1)


def test_wrong_type_names_file_key_and_fix(write_inventory):
    path = write_inventory(with_host_keys("server: {tensor_split: [2, x]}"))
    (problem,) = problems_of(write_inventory, path.read_text())
    assert problem.startswith(f"{path}: hosts.rig1.server.tensor_split:")
    assert "'x'" in problem and "one per GPU" in problem


def test_unknown_key_suggests_the_right_one(write_inventory):
    (problem,) = problems_of(write_inventory, with_host_keys("server: {ctxx: 4}"))
    assert "hosts.rig1.server.ctxx: unknown key `ctxx`; did you mean `ctx`?" in problem


def test_every_problem_is_reported_at_once(write_inventory):
    text = with_host_keys("reboot: sometimes\n          server: {port: 70000}")
    problems = problems_of(write_inventory, text)
    assert any("hosts.rig1.reboot:" in p and "never, if-needed, always" in p for p in problems)
    assert any("hosts.rig1.server.port:" in p and "1-65535" in p for p in problems)


def test_yaml_syntax_error_gives_line(write_inventory):
    (problem,) = problems_of(write_inventory, "all:\n  children: [\n")
    assert "YAML syntax error" in problem and ":3:" in problem


def with_host_keys(text: str) -> str:
    """MINIMAL with more keys on rig1 (inserted before its model)."""
    return MINIMAL.replace("          model:", f"          {text}\n          model:", 1)


@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        (with_host_keys("server: {split_mode: row}"), "server.split_mode", "split buffers"),
        (with_host_keys("server: {tensor_split: [1, 2, 3]}"), "server.tensor_split", "3 entries"),
        (
            with_host_keys("server: {split_mode: tensor, flash_attn: 'off'}"),
            "server.flash_attn",
            "forces flash",
        ),
        (
            with_host_keys("server: {spec: {type: [none, ngram-mod], draft_max: null}}"),
            "server.spec.type",
            "[]",
        ),
        (with_host_keys("cuda: {source: none}"), "cuda.source", "backend` is `cuda`"),
        (with_host_keys("llama_cpp: {commit: main}"), "llama_cpp.commit", "40-character"),
        (MINIMAL + "            path: /srv/m.gguf\n", "model", "exactly one of"),
    ],
)
def test_cross_field_rules(write_inventory, text, key, words):
    problems = problems_of(write_inventory, text)
    assert any(f"hosts.rig1.{key}:" in p and words in p for p in problems), problems


def test_defaults_file_is_blamed_for_defaults(write_inventory):
    # No GPUs declared with the default cuda backend: `cuda_architectures: auto` comes from
    # the defaults file, so the message names that file.
    text = MINIMAL.replace(
        """          gpus:
            - {name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}
            - {name: NVIDIA GeForce RTX 3090, vram_mib: 24576, compute_capability: "8.6"}
""",
        "",
    )
    (problem,) = problems_of(write_inventory, text)
    assert problem.startswith("group_data/all.yml: hosts.rig1.llama_cpp.cuda_architectures:")


def test_a_model_key_left_at_its_placeholder_is_blamed_on_the_inventory(write_inventory):
    """A gated repo without `token_file` ("set model.token_file"): the fix goes where the user
    wrote `model:`, not into the defaults file, whose model keys are empty placeholders."""
    path = write_inventory(
        MINIMAL.replace(
            '            url: https://example.org/m.gguf\n            sha256: "%s"\n' % ("a" * 64),
            "            hf: org/gated\n            quant: Q8_0\n",
        )
    )
    host = load_inventory(path).hosts["rig1"]
    problem = located(host, Problem(("model", "token_file"), "set model.token_file"))
    assert problem == f"{path}: hosts.rig1.model.token_file: set model.token_file"
    assert host.origins[("model", "token_file")] == "group_data/all.yml"


def dry_run(inventory) -> subprocess.CompletedProcess:
    """`pyinfra inventory.py deploy.py --dry` with RIG_INVENTORY=inventory."""
    return subprocess.run(
        offline([sys.executable, "-m", "pyinfra", "inventory.py", "deploy.py", "--dry"]),
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY=str(inventory)),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_inventory_py_refuses_bad_config_without_traceback(write_inventory):
    path = write_inventory(with_host_keys("server: {port: x}"))
    result = dry_run(path)
    assert result.returncode == 2
    assert f"{path}: hosts.rig1.server.port:" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_missing_key_file_is_named_before_connecting(write_inventory, tmp_path):
    path = write_inventory(
        MINIMAL.replace(
            "{host: 192.0.2.1, user: root}", f"{{host: 192.0.2.1, key: {tmp_path}/nokey}}"
        )
    )
    result = dry_run(path)
    assert result.returncode == 2
    assert f"hosts.rig1.ssh.key: the private key {tmp_path}/nokey does not exist" in result.stderr


def test_example_rig_dry_run_fails_only_on_the_connection(home):
    """The seed rig's inventory is valid and its deploy gets as far as connecting: to
    192.0.2.10, a documentation address, from a network namespace with no route out, so the
    connection fails at once and no packet leaves. The rig names no `ssh.known_hosts`, so its
    key must be in ~/.ssh/known_hosts (of the test's $HOME) to get that far."""
    (home / ".ssh").mkdir()
    key = paramiko.RSAKey.generate(1024)
    (home / ".ssh" / "known_hosts").write_text(f"192.0.2.10 ssh-rsa {key.get_base64()}\n")
    result = dry_run("inventory/example-5080-3090.yml")
    output = result.stdout + result.stderr
    assert result.returncode == 1
    assert "[rig1] Could not connect" in output
    assert "No hosts remaining" in output
    assert "not valid" not in output and "Traceback" not in output


def test_network_listener_needs_an_api_key(write_inventory, tmp_path):
    problems = problems_of(write_inventory, with_host_keys("server: {host: 0.0.0.0}"))
    assert any("hosts.rig1.server.host:" in p and "api_key_file" in p for p in problems)
    missing = tmp_path / "none.key"
    problems = problems_of(
        write_inventory, with_host_keys(f"server: {{host: 0.0.0.0, api_key_file: {missing}}}")
    )
    assert any(f"{missing} does not exist or is empty" in p for p in problems)
    key = tmp_path / "rig.key"
    key.write_text("s3cret-key\n")
    path = write_inventory(with_host_keys(f"server: {{host: 0.0.0.0, api_key_file: {key}}}"))
    assert load_inventory(path).hosts["rig1"].data["server"]["api_key_file"] == str(key)
