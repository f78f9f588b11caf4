"""The GGUF headers models.lock.yml records (llamarig.model.header_record, model_lock): a plan made
from the record is the plan made from the file's header, byte for byte; a plan made from
neither is provisional and says so; a record is untrusted input."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llamarig.config import load_inventory
from llamarig.config import lock as model_lock
from llamarig.config.lock import header_key, record_header, recorded_header
from llamarig.model import header_record
from llamarig.model.files import model_files
from llamarig.model.gguf import GgufError, read_gguf_header_file
from llamarig.planner import render
from llamarig.planner.gather import gather
from llamarig.planner.plan import plan_host
from tests.conftest import PROJECT, offline, pyinfra_env
from tests.ggufmodels import (
    Qwen35Shape,
    qwen35_metadata,
    qwen35_tensors,
    split_gguf,
    write_gguf,
    write_llama,
)

# Qwen3.6's vocabulary: the array a record keeps as its length only.
QWEN_VOCAB = 248_320


def inventory_host(name: str, host: str) -> dict:
    return copy.deepcopy(load_inventory(PROJECT / "inventory" / name).hosts[host].data)


@pytest.fixture(scope="module")
def qwen27b(tmp_path_factory) -> Path:
    """Qwen3.6-27B Q8_0's header as the file has it: its tensor table and a vocabulary of
    QWEN_VOCAB tokens."""
    shape = Qwen35Shape()
    metadata = qwen35_metadata(shape)
    metadata["tokenizer.ggml.tokens"] = [f"token{index}" for index in range(QWEN_VOCAB)]
    path = tmp_path_factory.mktemp("models") / "qwen36-27b-q8_0.gguf"
    return write_gguf(path, "qwen35", metadata, qwen35_tensors(shape, "q8_0"))


@pytest.fixture(scope="module")
def llama_8b(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama-8b-q8_0.gguf"
    return write_llama(path, 32, 4096, 14336, 32, 8, 128256, 131072, "q8_0")


@pytest.fixture(scope="module")
def llama_32b(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llama-32b-q8_0.gguf"
    return write_llama(path, 64, 5120, 27648, 40, 8, 152064, 131072, "q8_0")


def through_the_record(path: Path):
    header = read_gguf_header_file(path)
    return header_record.decode(header_record.encode(header), header.digest, "record")


def same_plan(name: str, data: dict, path: Path) -> None:
    from_file = plan_host(name, copy.deepcopy(data), read_gguf_header_file(path))
    from_record = plan_host(name, copy.deepcopy(data), through_the_record(path))
    assert from_file.report() == from_record.report()
    assert json.dumps(from_file.to_json()) == json.dumps(from_record.to_json())
    assert render.render_unit(from_file.resolved) == render.render_unit(from_record.resolved)
    assert from_file.memory is not None and not from_file.blind


def test_the_seed_rig_plans_the_same_from_its_record(qwen27b):
    seed = inventory_host("example-5080-3090.yml", "rig1")
    same_plan("rig1", seed, qwen27b)
    plan = plan_host("rig1", seed, through_the_record(qwen27b))
    assert plan.resolved["server"]["split_mode"] == "tensor" and plan.fits


def test_the_8b_and_32b_rigs_plan_the_same_from_their_records(llama_8b, llama_32b):
    same_plan("h200", inventory_host("gpu-h200-systemd.yml", "h200-systemd"), llama_8b)
    # ctx and tensor_split `auto`: the record decides the context and the split as the file does
    same_plan("h200x2", inventory_host("gpu-h200x2-mixed.yml", "h200x2-mixed"), llama_32b)
    same_plan("h200x2", inventory_host("gpu-h200x2.yml", "h200x2"), llama_32b)


def test_a_27b_record_is_small_and_keeps_what_the_planner_asks(qwen27b):
    header = read_gguf_header_file(qwen27b)
    record = header_record.encode(header)
    print(
        f"Qwen3.6-27B Q8_0: header {qwen27b.stat().st_size:,} bytes, {len(header.tensors)} "
        f"tensors; record {len(record):,} characters"
    )
    assert len(record) < 64 << 10, len(record)  # most of the header is the vocabulary
    decoded = header_record.decode(record, header.digest, "record")
    assert decoded.vocab_size == header.vocab_size == QWEN_VOCAB
    assert decoded.tensors == header.tensors and decoded.data_offset == header.data_offset
    short = {k: v for k, v in header.metadata.items() if not isinstance(v, list) or len(v) < 99}
    assert {k: decoded.metadata[k] for k in short} == short
    assert decoded.digest == header.digest


def lock_inventory(tmp_path: Path, file_server, model: Path, **model_settings) -> Path:
    """The seed rig with its model served on loopback (and its sha256), in tmp_path."""
    root, base = file_server
    (root / model.name).write_bytes(model.read_bytes())
    document = yaml.safe_load((PROJECT / "inventory" / "example-5080-3090.yml").read_text())
    host = document["all"]["children"]["rigs"]["hosts"]["rig1"]
    host["model"] = {
        "url": f"{base}/{model.name}",
        "sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
        **model_settings,
    }
    path = tmp_path / "rig.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def llamarig(inventory: Path, *args: str, net: bool = False) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "llamarig.cli", *args]
    return subprocess.run(
        argv if net else offline(argv),
        cwd=PROJECT,
        env=pyinfra_env(RIG_INVENTORY=str(inventory), LLAMARIG_HEADER_CACHE=str(inventory.parent)),
        capture_output=True,
        text=True,
    )


def test_llamarig_lock_records_what_an_offline_plan_then_reads(tmp_path, file_server, qwen27b):
    inventory = lock_inventory(tmp_path, file_server, qwen27b)
    lock = tmp_path / model_lock.LOCK_NAME
    result = llamarig(inventory, "lock", net=True)
    assert result.returncode == 0, result.stderr
    assert f"rig1: recorded the header of {hashlib.sha256(qwen27b.read_bytes()).hexdigest()}" in (
        result.stdout
    )
    assert llamarig(inventory, "lock", net=True).stdout.endswith("every model file already\n")
    for cached in tmp_path.glob("*.gguf-header"):
        cached.unlink()  # the header cache is only a cache: the plan below reads the lock

    planned = llamarig(inventory, "plan", "--json")
    assert planned.returncode == 0, planned.stderr
    host = json.loads(planned.stdout)["hosts"]["rig1"]
    assert host["split_mode"] == "tensor" and host["provisional"] == []
    assert len(host["devices"]) == 2 and all(d["planned_mib"] > 0 for d in host["devices"])

    lock.unlink()
    provisional = llamarig(inventory, "plan")
    assert provisional.returncode == 3, provisional.stdout + provisional.stderr
    assert "== rig1: PROVISIONAL" in provisional.stdout
    assert (
        "provisional: split mode, memory per GPU, MTP drafting (the model's MTP layers) chosen "
        "without the model's GGUF header (cannot read the GGUF header from http://127.0.0.1"
    ) in provisional.stdout
    assert llamarig(inventory, "plan", "--allow-provisional").returncode == 0


def test_a_split_model_plans_from_its_shards_records(tmp_path, file_server, monkeypatch):
    root, base = file_server
    shards = split_gguf(write_llama(tmp_path / "tiny.gguf", full_size=True), root, 3)
    data = inventory_host("gpu-h200-systemd.yml", "h200-systemd")
    data["model"].update(
        url=f"{base}/{shards[0].name}",
        path=None,
        sha256=[hashlib.sha256(shard.read_bytes()).hexdigest() for shard in shards],
        filename=None,
    )
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all: {}\n")
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(tmp_path / "cache"))
    read = gather(data, None, gpus=False)
    assert [key for key, _ in read.read] == [header_key(file) for file in model_files(data)]
    for key, header in read.read:
        assert record_header(tmp_path / model_lock.LOCK_NAME, key, header)
    # Each shard's entry carries the shard's size, readable beside its compressed record.
    entries = yaml.safe_load((tmp_path / model_lock.LOCK_NAME).read_text())["headers"]
    sizes = {entry["file"]["sha256"]: entry["size"] for entry in entries}
    assert sizes == {hashlib.sha256(s.read_bytes()).hexdigest(): s.stat().st_size for s in shards}
    for shard in shards:
        shard.unlink()  # neither the URL nor the cache has them now
    (tmp_path / "cache").rename(tmp_path / "gone")
    from_lock = gather(data, None, gpus=False)
    assert from_lock.read == [] and from_lock.header_source.endswith(model_lock.LOCK_NAME)
    first = plan_host("h200", copy.deepcopy(data), read.header)
    second = plan_host("h200", copy.deepcopy(data), from_lock.header)
    assert json.dumps(first.to_json()) == json.dumps(second.to_json())


def test_a_changed_file_on_the_host_replaces_its_stale_record(tmp_path, llama_8b, monkeypatch):
    data = inventory_host("gpu-h200-systemd.yml", "h200-systemd")
    data["model"].update(url=None, path="/srv/models/m.gguf", sha256=None, filename=None)
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all: {}\n")
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(tmp_path / "cache"))
    lock = tmp_path / model_lock.LOCK_NAME
    old = tmp_path / "old.gguf"
    write_llama(old, 2)
    record_header(lock, {"host_path": "/srv/models/m.gguf"}, read_gguf_header_file(old))
    # Offline, the record plans; with the host at hand, the host's own file wins.
    assert gather(data, None, gpus=False).header.block_count == 2
    on_host = llama_8b.read_bytes()

    def reader(fact, **arguments):
        name = fact.__name__
        if name == "FileIdentity":
            return "2049 12 9 1 1"
        if name == "FileHead":
            return on_host[: arguments["size"]]
        return None

    found = gather(data, reader, gpus=False)
    assert found.header.block_count == 32
    assert [key for key, _ in found.read] == [{"host_path": "/srv/models/m.gguf"}]
    assert any(
        "the recorded header of /srv/models/m.gguf is not the file's" in w for w in found.warnings
    )
    record_header(lock, *found.read[0])
    assert recorded_header(lock, {"host_path": "/srv/models/m.gguf"}).block_count == 32


def entry_text(record: str, digest: str = "a" * 64, key: str = "sha256: " + "b" * 64) -> str:
    return f"headers:\n- file: {{{key}}}\n  digest: '{digest}'\n  format: 1\n  record: '{record}'\n"


def packed(document: object) -> str:
    return base64.b64encode(lzma.compress(json.dumps(document).encode())).decode()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (entry_text("not base64!"), "the recorded header cannot be decoded"),
        (entry_text(base64.b64encode(b"plain").decode()), "cannot be decoded"),
        (entry_text(packed({"version": 3})), "is not a header record (KeyError"),
        (
            entry_text(
                packed(
                    {
                        "version": 3,
                        "alignment": 32,
                        "data_offset": 64,
                        "tensors": [],
                        "metadata": {"tokenizer.ggml.tokens": {"trimmed_array_length": 1 << 40}},
                    }
                )
            ),
            "claims 1099511627776 items",
        ),  # fmt: skip
        (
            entry_text(base64.b64encode(lzma.compress(b"[" * (40 << 20))).decode()),
            "expands beyond 33554432 bytes",
        ),
        (
            entry_text(
                packed(
                    {
                        "version": 3,
                        "alignment": 32,
                        "data_offset": 64,
                        "metadata": {},
                        "tensors": [["t", [32, 1], 999, 4, 0]],
                    }
                )
            ),
            "is not a header record",
        ),  # fmt: skip
    ],
)
def test_a_broken_record_is_refused_naming_the_lock_and_the_fix(tmp_path, text, words):
    lock = tmp_path / model_lock.LOCK_NAME
    lock.write_text(text)
    with pytest.raises(GgufError) as caught:
        recorded_header(lock, {"sha256": "b" * 64})
    message = str(caught.value)
    assert str(lock) in message and words in message, message
    assert "delete that entry of `headers:`; `llamarig lock` records it again" in message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("headers: {}", "has a `headers:` that is not a list"),
        (
            "headers: [{file: {sha256: x}}]",
            "not a mapping of `file`, `format`, `record`, `size` and one of `digest`",
        ),
        (entry_text("x", key="host_path: relative/m.gguf"), "is not {sha256: 64 hex digits}"),
        (entry_text("x", digest="$(id)"), "digest '$(id)' is not 64 hex digits"),
        (entry_text("x") + "  size: $(id)\n", "size '$(id)' is not a number of bytes"),
        (entry_text("x") + "  size: -1\n", "size -1 is not a number of bytes"),
        (entry_text("x") + "  size: true\n", "size True is not a number of bytes"),
    ],
)
def test_a_malformed_headers_list_is_refused_naming_the_file(tmp_path, text, words):
    lock = tmp_path / model_lock.LOCK_NAME
    lock.write_text(text)
    with pytest.raises(model_lock.HubError) as caught:
        recorded_header(lock, {"sha256": "b" * 64})
    assert str(lock) in caught.value.message and words in caught.value.message


def test_recording_keeps_the_references_and_replaces_only_its_own_entry(tmp_path, llama_8b):
    lock = tmp_path / model_lock.LOCK_NAME
    reference = {
        "reference": {
            "endpoint": "https://huggingface.co",
            "hf": "o/r",
            "revision": "main",
            "file": "m.gguf",
        },
        "commit": "c" * 40,
        "requires_token": False,
        "files": [{"path": "m.gguf", "size": 1, "sha256": "d" * 64}],
    }
    model_lock.write_entry(lock, reference)
    header = read_gguf_header_file(llama_8b)
    key = {"sha256": "d" * 64}
    assert record_header(lock, key, header)
    assert not record_header(lock, key, header)  # the same header: the file is left alone
    assert model_lock.read_lock(lock) == [reference]
    assert recorded_header(lock, key).block_count == 32
    assert lock.read_text().startswith("# The commits llamarig resolved")
    # A lock written before entries carried the file's size gets it with the next record.
    document = yaml.safe_load(lock.read_text())
    assert document["headers"][0].pop("size") == header.data_end > header.data_offset
    lock.write_text(yaml.safe_dump(document))
    assert record_header(lock, key, header)
    assert model_lock.header_entry(lock, key)["size"] == header.data_end
    assert not record_header(lock, key, header)


def test_the_host_reads_the_header_where_this_machine_cannot(
    tmp_path, file_server, qwen27b, monkeypatch
):
    """The model's URL is out of this machine's reach (stand-in: its header read raises, as
    behind a proxy that refuses) but not of the host's: the host's curl reads the header
    (a local host here, through the shell reader the CLI uses), so the first plan is already
    the final one - and the deploy's first converge installs the final unit."""
    import urllib.error

    from llamarig.planner import header as model_header
    from llamarig.planner.gather import shell_reader

    root, base = file_server
    (root / qwen27b.name).write_bytes(qwen27b.read_bytes())
    data = inventory_host("example-5080-3090.yml", "rig1")
    data["ssh"] = {"local": True}
    data["model"].update(
        url=f"{base}/{qwen27b.name}", sha256=hashlib.sha256(qwen27b.read_bytes()).hexdigest()
    )
    data["paths"]["models"] = str(tmp_path / "models")  # not downloaded yet
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all: {}\n")
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))

    def unreachable(url, *_, **__):
        raise urllib.error.URLError(f"this machine cannot reach {url}")

    monkeypatch.setattr(model_header, "fetch_header", unreachable)
    blind = gather(data, None, gpus=False)
    assert blind.header is None and "this machine cannot reach" in blind.header_note
    assert plan_host("rig1", copy.deepcopy(data), blind.header).blind

    found = gather(data, shell_reader(data), gpus=False)
    assert found.header is not None, found.header_note
    assert [key for key, _ in found.read] == [{"sha256": data["model"]["sha256"]}]
    final = plan_host("rig1", copy.deepcopy(data), found.header)
    direct = plan_host("rig1", copy.deepcopy(data), read_gguf_header_file(qwen27b))
    assert not final.blind and final.report() == direct.report()
    assert final.resolved["server"]["split_mode"] == "tensor"


def test_the_seed_rig_plans_whole_offline_from_its_declared_header(tmp_path):
    """The shipped lock declares Qwen3.6-27B's header for the seed's URL (built from its
    published configuration: scripts/declared_headers.py): offline, with no header cache, the
    seed plans -sm tensor -ts 2,3 with its memory per GPU; without the lock it is provisional."""
    seed = PROJECT / "inventory" / "example-5080-3090.yml"
    result = llamarig(seed, "plan", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    host = json.loads(result.stdout)["hosts"]["rig1"]
    assert host["split_mode"] == "tensor" and host["tensor_split"] == [2, 3]
    assert host["provisional"] == [] and host["fits"]
    assert [d["name"] for d in host["devices"]] == [
        "NVIDIA GeForce RTX 5080",
        "NVIDIA GeForce RTX 3090",
    ]
    assert all(device["planned_mib"] > 10_000 for device in host["devices"])
    report = llamarig(seed, "plan").stdout
    assert "the model's header is declared, not read: " in report
    assert "Qwen/Qwen3.6-27B's model card and config.json" in report

    alone = tmp_path / "example-5080-3090.yml"
    alone.write_text(seed.read_text())
    provisional = llamarig(alone, "plan")
    assert provisional.returncode == 3 and "== rig1: PROVISIONAL" in provisional.stdout


def test_the_declared_headers_are_what_the_script_writes():
    result = subprocess.run(
        [sys.executable, "-m", "scripts.declared_headers", "--check"],
        cwd=PROJECT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_declared_header_is_checked_against_the_file_and_replaced(
    tmp_path, file_server, llama_8b, monkeypatch
):
    root, base = file_server
    (root / llama_8b.name).write_bytes(llama_8b.read_bytes())
    data = inventory_host("gpu-h200-systemd.yml", "h200-systemd")
    url = f"{base}/{llama_8b.name}"
    data["model"].update(
        url=url, path=None, sha256=hashlib.sha256(llama_8b.read_bytes()).hexdigest()
    )
    inventory = tmp_path / "hosts.yml"
    inventory.write_text("all: {}\n")
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    lock = tmp_path / model_lock.LOCK_NAME
    wrong = write_llama(tmp_path / "wrong.gguf", 30, 4096, 14336, 32, 8, 128256, 131072, "q8_0")
    model_lock.declare_header(lock, url, read_gguf_header_file(wrong), "a wrong model card")

    found = gather(data, None, gpus=False)  # the URL answers: the file's header is read
    assert found.header.block_count == 32
    [warning] = [w for w in found.warnings if "declared from a wrong model card" in w]
    assert "the file's header differs: llama.block_count: 30 declared, 32 in the file" in warning
    assert "tensors: 273 declared, 291 in the file" in warning
    assert found.superseded == [{"url": url}]
    key, header = found.read[0]
    assert record_header(lock, key, header, found.superseded)
    assert recorded_header(lock, {"url": url}) is None  # the declaration is gone
    assert recorded_header(lock, key).block_count == 32
    assert gather(data, None, gpus=False).read == []  # recorded: nothing new to record


def test_the_deploy_records_what_its_plan_read_once_the_files_are_checked(tmp_path, llama_8b):
    """The deploy's recording is an operation after the model stage's downloads (a file that
    fails its sha256 ends the run before it; a dry run executes none), on this machine."""
    from types import SimpleNamespace

    from llamarig import operations

    lock = tmp_path / model_lock.LOCK_NAME
    nothing = operations.record_headers._inner(lock=str(lock), read=[], superseded=[])
    assert list(nothing) == []
    key = {"sha256": "d" * 64}
    read = [(key, read_gguf_header_file(llama_8b))]
    [command] = operations.record_headers._inner(lock=str(lock), read=read, superseded=[])
    assert not lock.exists(), "planned, not yet run"
    said: list[str] = []
    assert command.function(None, SimpleNamespace(log=said.append))
    assert recorded_header(lock, key).block_count == 32
    assert said == [f"llamarig: recorded the GGUF header of {'d' * 64} in {lock}"]
