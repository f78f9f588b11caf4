"""models.lock.yml as untrusted input (issue 53, item 3): a recorded header that lies (a tensor
whose bytes are not its shape's, a block without its tensors, a tensor recorded twice, a `size`
short of the tensors, no KV heads beside K and V) is refused before it is planned; a record is
bounded after decompression; a lock that is not one (merge-conflict markers, not YAML, a
directory) is refused naming the file and the fix, by `llamarig plan` and by a dry deploy before
it connects; whatever of the lock reaches a message is shown with control characters escaped."""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import lzma
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamarig.config import load_inventory
from llamarig.config import lock as model_lock
from llamarig.config.lock import record_header, recorded_header
from llamarig.model.gguf import GgufError, read_gguf_header_file
from llamarig.planner.gather import gather
from llamarig.planner.plan import plan_host
from tests.conftest import PROJECT, offline, pyinfra_env
from tests.ggufmodels import Qwen35Shape, split_gguf, write_llama, write_qwen35

# Nothing answers there: a plan reads the model's header from the lock alone.
MODEL_URL = "http://127.0.0.1:9/m.gguf"
FIX = "delete that entry of `headers:`; `llamarig lock` records it again"


def host_data() -> dict:
    """The H200 rig, its model given by URL and sha256 (set by the test)."""
    path = PROJECT / "inventory" / "gpu-h200-systemd.yml"
    return copy.deepcopy(load_inventory(path).hosts["h200-systemd"].data)


def llama(path: Path, n_vocab: int = 32000, full_size: bool = False) -> Path:
    """A small llama whose plan fits an H200 with room to spare (``full_size``: with its
    zero weights, which gguf-split copies)."""
    return write_llama(path, 4, 256, 512, 4, 2, n_vocab, 131072, "q8_0", full_size)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rig(tmp_path: Path, digests: list[str], url: str = MODEL_URL) -> Path:
    """An inventory in tmp_path of the H200 rig serving the model at ``url`` (RIG_INVENTORY;
    the lock goes beside it), reachable by no one: ssh to TEST-NET, no key needed."""
    document = yaml.safe_load((PROJECT / "inventory" / "gpu-h200-systemd.yml").read_text())
    host = document["all"]["children"]["gpu"]["hosts"]["h200-systemd"]
    host["ssh"] = {"host": "192.0.2.1", "user": "root", "host_key_checking": "accept-new"}
    host["model"] = {"url": url, "sha256": digests[0] if len(digests) == 1 else digests}
    path = tmp_path / "rig.yml"
    path.write_text(yaml.safe_dump(document))
    return path


def honest_lock(tmp_path: Path) -> tuple[Path, Path, str]:
    """(inventory, lock, sha256): the small llama's header recorded as `llamarig lock` does."""
    model = llama(tmp_path / "m.gguf")
    digest = sha256_of(model)
    lock = tmp_path / model_lock.LOCK_NAME
    record_header(lock, {"sha256": digest}, read_gguf_header_file(model))
    return rig(tmp_path, [digest]), lock, digest


def unpacked(record: str) -> dict:
    return json.loads(lzma.decompress(base64.b64decode(record)))


def packed(document: object) -> str:
    return base64.b64encode(lzma.compress(json.dumps(document).encode())).decode()


def relayout(document: dict) -> dict:
    """The tensors' offsets laid out again as a GGUF writer does (in order, each padded to the
    alignment), so that a forged table is otherwise self-consistent."""
    offset, alignment = 0, max(document["alignment"], 1)
    for tensor in document["tensors"]:
        tensor[4] = offset
        offset += -(-tensor[3] // alignment) * alignment
    return document


def data_end(document: dict) -> int:
    """Where a record's last tensor ends: the `size` its entry gives."""
    last = document["tensors"][-1] if document["tensors"] else [None, None, None, 0, 0]
    return document["data_offset"] + last[4] + last[3]


def forge(lock: Path, record: Callable[[dict], object] = lambda _: None, **entry: object):
    """Rewrite the lock's first header entry: ``record`` edits its decoded document (then laid
    out again, and the entry's `size` set to match), ``entry`` sets the entry's own keys."""
    document = yaml.safe_load(lock.read_text())
    first = document["headers"][0]
    decoded = unpacked(first["record"])
    record(decoded)
    first["record"] = packed(relayout(decoded))
    first["size"] = data_end(decoded)
    first.update(entry)
    lock.write_text(yaml.safe_dump(document))


def llamarig(inventory: Path, *args: str) -> subprocess.CompletedProcess:
    return _offline(inventory, [sys.executable, "-m", "llamarig.cli", *args])


def dry_deploy(inventory: Path) -> subprocess.CompletedProcess:
    return _offline(
        inventory, [sys.executable, "-m", "pyinfra", "-y", "inventory.py", "deploy.py", "--dry"]
    )


def _offline(inventory: Path, argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` in the project, without a network, on ``inventory`` and a header cache of its
    own."""
    return subprocess.run(
        offline(argv),
        cwd=PROJECT,
        env=pyinfra_env(
            RIG_INVENTORY=str(inventory), LLAMARIG_HEADER_CACHE=str(inventory.parent / "cache")
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """The output of a command that refused with exit 2, naming ``words``, without a
    traceback, a plan, or a raw escape character."""
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and ": fits" not in output, output
    assert "\x1b" not in output, output
    for word in words:
        assert word in output, (word, output)
    return output


# --- forged header facts ------------------------------------------------------------------


def every_tensor_one_byte(document: dict) -> None:
    for tensor in document["tensors"]:
        tensor[3] = 1


def no_block_tensors(document: dict) -> None:
    document["tensors"] = [t for t in document["tensors"] if not t[0].startswith("blk.")]


def a_block_without_tensors(document: dict) -> None:
    document["tensors"] = [t for t in document["tensors"] if not t[0].startswith("blk.2.")]


def a_tensor_twice(document: dict) -> None:
    document["tensors"].append(list(document["tensors"][3]))


def no_kv_heads(document: dict) -> None:
    document["metadata"]["llama.attention.head_count_kv"] = 0


def huge_head_count(document: dict) -> None:
    # n_embd // n_head is 0: a key length of 0 makes every K and V row 0 bytes
    document["metadata"]["llama.attention.head_count"] = 1 << 20


FORGED = {
    "every-tensor-1-byte": (every_tensor_one_byte, {}, ["token_embd.weight", "8704000"]),
    "no-block-tensors": (no_block_tensors, {}, ["block 0", "llama.block_count is 4"]),
    "a-block-without-tensors": (a_block_without_tensors, {}, ["block 2"]),
    "a-tensor-twice": (a_tensor_twice, {}, ["blk.0.attn_k.weight", "twice"]),
    "size-below-the-tensors": (lambda _: None, {"size": 1000}, ["size 1000"]),
    "no-kv-heads-beside-k-and-v": (no_kv_heads, {}, ["head_count_kv", "blk.0.attn_k.weight"]),
    "a-key-length-of-0": (huge_head_count, {}, ["key length", "blk.0.attn_q.weight"]),
}


@pytest.mark.parametrize("case", FORGED)
def test_forged_header_facts_are_refused_naming_the_lock_entry(tmp_path, case):
    """Planned as true before, and `plan` said "fits"; now refused before planning."""
    inventory, lock, digest = honest_lock(tmp_path)
    assert llamarig(inventory, "plan").returncode == 0  # the honest record plans
    edit, entry, words = FORGED[case]
    forge(lock, edit, **entry)
    refused(llamarig(inventory, "plan"), str(lock), f"header of {digest}", FIX, *words)


def test_a_forged_shard_set_is_refused_as_a_whole(tmp_path, monkeypatch):
    """Each shard's record is consistent alone; together the set lacks block 1's tensors."""
    shards = split_gguf(llama(tmp_path / "m.gguf", 4096, True), tmp_path / "shards", 3)
    digests = [sha256_of(shard) for shard in shards]
    lock = tmp_path / model_lock.LOCK_NAME
    for shard, digest in zip(shards, digests, strict=True):
        record_header(lock, {"sha256": digest}, read_gguf_header_file(shard))
    inventory = rig(tmp_path, digests, f"http://127.0.0.1:9/{shards[0].name}")
    monkeypatch.setenv("RIG_INVENTORY", str(inventory))
    monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(tmp_path / "cache"))
    data = host_data()
    data["model"].update(url=f"http://127.0.0.1:9/{shards[0].name}", path=None, sha256=digests)
    assert gather(data, None, gpus=False).header.block_count == 4  # the honest set

    document = yaml.safe_load(lock.read_text())
    entries = {entry["file"]["sha256"]: entry for entry in document["headers"]}
    decoded = [unpacked(entries[digest]["record"]) for digest in digests]
    for shard in decoded:
        shard["tensors"] = [t for t in shard["tensors"] if not t[0].startswith("blk.1.")]
    for digest, shard in zip(digests, decoded, strict=True):
        shard["metadata"]["split.tensors.count"] = sum(len(s["tensors"]) for s in decoded)
        entries[digest]["record"] = packed(relayout(shard))
        entries[digest]["size"] = data_end(shard)
    lock.write_text(yaml.safe_dump(document))
    with pytest.raises(GgufError) as caught:
        gather(data, None, gpus=False)
    message = str(caught.value)
    assert str(lock) in message and digests[0] in message and "block 1" in message, message
    assert "`llamarig lock` records them again" in message


# --- bounds -------------------------------------------------------------------------------


BOMB = """
import base64, json, lzma, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
from llamarig.model.gguf import GgufError
from llamarig.config.lock import recorded_header
try:
    recorded_header(__import__("pathlib").Path(sys.argv[1]), {"sha256": sys.argv[2]})
except GgufError as error:
    print("refused:", error)
"""


def test_a_record_that_decompresses_far_beyond_its_size_is_refused(tmp_path):
    """A record of 100 KB claiming 1,000 arrays of 4 million items each: 32 GB of memory
    once expanded (a MemoryError before, under a 3 GiB limit; without one, the machine's)."""
    _, lock, digest = honest_lock(tmp_path)
    metadata = {f"k{index}": {"trimmed_array_length": 1 << 22} for index in range(1000)}
    bomb = {"version": 3, "alignment": 32, "data_offset": 64, "metadata": metadata, "tensors": []}
    document = yaml.safe_load(lock.read_text())
    document["headers"][0]["record"] = packed(bomb)
    lock.write_text(yaml.safe_dump(document))
    result = subprocess.run(
        [sys.executable, "-c", BOMB, str(lock), digest],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "Traceback" not in output, output
    assert output.startswith(f"refused: {lock} (header of {digest})"), output
    assert "items" in output and FIX in output, output


def test_an_oversized_record_is_refused_as_the_lock_entry_not_blamed_on_the_url(tmp_path):
    """Dropped silently before: the plan went on to the URL and blamed it."""
    inventory, lock, digest = honest_lock(tmp_path)
    document = yaml.safe_load(lock.read_text())
    oversized = base64.b64encode(lzma.compress(b" " * (40 << 20))).decode()
    document["headers"][0]["record"] = oversized
    lock.write_text(yaml.safe_dump(document))
    output = refused(
        llamarig(inventory, "plan"), str(lock), f"header of {digest}", "expands beyond", FIX
    )
    assert MODEL_URL not in output and "PROVISIONAL" not in output, output


# --- a lock that is not one ---------------------------------------------------------------


def conflict_markers(lock: Path) -> None:
    lines = lock.read_text().splitlines(keepends=True)
    start = next(index for index, line in enumerate(lines) if line.startswith("headers:"))
    lines[start:start] = ["<<<<<<< HEAD\n"]
    lines += ["=======\n", "headers: []\n", ">>>>>>> theirs\n"]
    lock.write_text("".join(lines))


def not_yaml(lock: Path) -> None:
    lock.write_text("headers: [\n  {file: {sha256: 0}\n")


def a_directory(lock: Path) -> None:
    lock.unlink()
    lock.mkdir()
    (lock / "x").write_text("x")


NOT_A_LOCK = {
    "conflict-markers": (conflict_markers, ["merge-conflict markers"]),
    "not-yaml": (not_yaml, ["YAML"]),
    "a-directory": (a_directory, ["is a directory"]),
}


@pytest.mark.parametrize("case", NOT_A_LOCK)
def test_a_lock_that_is_not_one_is_refused_by_plan_naming_the_file(tmp_path, case):
    """A traceback before, blaming `model.hf` on a `url:` rig."""
    inventory, lock, _ = honest_lock(tmp_path)
    spoil, words = NOT_A_LOCK[case]
    spoil(lock)
    output = refused(llamarig(inventory, "plan"), str(lock), *words)
    assert "model.hf" not in output, output


@pytest.mark.parametrize("case", [*NOT_A_LOCK, "every-tensor-1-byte"])
def test_a_dry_deploy_refuses_a_broken_lock_before_connecting(tmp_path, case):
    """The dry deploy connected before, and refused (or not) only in the host's stages."""
    inventory, lock, digest = honest_lock(tmp_path)
    if case in NOT_A_LOCK:
        spoil, words = NOT_A_LOCK[case]
        spoil(lock)
    else:
        edit, entry, words = FORGED[case]
        forge(lock, edit, **entry)
        words = [*words, f"header of {digest}"]
    output = refused(dry_deploy(inventory), "llamarig: the rig configuration is not valid:")
    assert "Connecting to hosts" not in output and str(lock) in output, output
    for word in words:
        assert word in output, (word, output)


# --- escapes ------------------------------------------------------------------------------


def escape_in_architecture(document: dict) -> None:
    document["metadata"]["general.architecture"] = "ll\x1b]0;owned\x07ama"


def escape_in_a_tensor_name(document: dict) -> None:
    tensor = document["tensors"][1]
    tensor[0], tensor[3] = "blk.0.attn_q.weight\x1b[2J\u202e", 1


ESCAPES = {
    "architecture": (escape_in_architecture, {}, "ll\\x1b]0;owned\\x07ama"),
    "tensor-name": (escape_in_a_tensor_name, {}, "blk.0.attn_q.weight\\x1b[2J\\u202e"),
    "declared-source": (
        lambda _: None,
        {"declared": "the card\x1b[31m", "digest": None},
        "the card\\x1b[31m",
    ),
}


@pytest.mark.parametrize("case", ESCAPES)
def test_escape_sequences_from_the_lock_are_shown_escaped_in_the_refusal(tmp_path, case):
    inventory, lock, _ = honest_lock(tmp_path)
    edit, entry, shown = ESCAPES[case]
    forge(lock, edit, **entry)
    if entry.get("digest", "") is None:  # a declared entry has no digest
        document = yaml.safe_load(lock.read_text())
        del document["headers"][0]["digest"]
        lock.write_text(yaml.safe_dump(document))
    output = refused(llamarig(inventory, "plan"), str(lock), shown)
    assert "\u202e" not in output and "\x07" not in output, output


# --- honest records pass ------------------------------------------------------------------


def test_honest_records_pass_the_checks(tmp_path, monkeypatch):
    """A plain model, a hybrid with MTP blocks (qwen35: attention every 4th block, SSM
    tensors in the others) and a split set: recorded, checked, planned as the files are."""
    monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(tmp_path / "cache"))
    small_qwen = Qwen35Shape(n_layer=8, n_embd=512, n_ff=1024, n_vocab=4096)
    models = {
        "llama": [llama(tmp_path / "llama.gguf")],
        "qwen35": [write_qwen35(tmp_path / "qwen.gguf", small_qwen)],
        "split": split_gguf(llama(tmp_path / "whole.gguf", 4096, True), tmp_path / "shards", 3),
    }
    for name, files in models.items():
        directory = tmp_path / name
        directory.mkdir()
        digests = [sha256_of(file) for file in files]
        lock = directory / model_lock.LOCK_NAME
        for file, digest in zip(files, digests, strict=True):
            record_header(lock, {"sha256": digest}, read_gguf_header_file(file))
        monkeypatch.setenv("RIG_INVENTORY", str(rig(directory, digests)))
        data = host_data()
        url = f"http://127.0.0.1:9/{files[0].name}"
        data["model"].update(url=url, path=None, sha256=digests if len(files) > 1 else digests[0])
        found = gather(data, None, gpus=False)
        assert found.header is not None and found.header_source == str(lock), name
        assert [t.name for t in found.header.tensors] == [
            t.name for file in files for t in read_gguf_header_file(file).tensors
        ]
        if name != "split":
            from_file = plan_host("h", copy.deepcopy(data), read_gguf_header_file(files[0]))
            from_lock = plan_host("h", copy.deepcopy(data), found.header)
            assert json.dumps(from_file.to_json()) == json.dumps(from_lock.to_json())


def test_the_shipped_lock_passes_the_checks():
    """The example rigs' lock (a declared Qwen3.6-27B header) plans as before."""
    shipped = PROJECT / "inventory" / model_lock.LOCK_NAME
    for entry in yaml.safe_load(shipped.read_text())["headers"]:
        assert recorded_header(shipped, entry["file"]) is not None


# --- any forgery: the same plan, or refused naming the lock ---------------------------------


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> tuple[Path, dict, str, str]:
    """(directory, rig data, the honest record's lock text, the honest plan as JSON)."""
    directory = tmp_path_factory.mktemp("forgeries")
    _, lock, digest = honest_lock(directory)
    data = host_data()
    data["model"].update(url=MODEL_URL, path=None, sha256=digest)
    plan = plan_host("h", copy.deepcopy(data), read_gguf_header_file(directory / "m.gguf"))
    return directory, data, lock.read_text(), json.dumps(plan.to_json())


MUTATIONS = [
    "n_bytes",
    "shape",
    "type",
    "offset",
    "duplicate",
    "drop",
    "rename",
    "head_count",
    "head_count_kv",
    "key_length",
    "block_count",
    "size",
    "alignment",
    "general.name",
]


def mutated(document: dict, entry: dict, kind: str, index: int, value: int) -> None:
    """One forgery of ``kind`` at tensor ``index`` with ``value``. The heads are forged only
    to values a record cannot have beside its tensors (a number of heads in range is a fact
    of the file alone: the deploy's own read of the file replaces such a record); "general.name"
    changes nothing the planner reads."""
    tensors, metadata = document["tensors"], document["metadata"]
    tensor = tensors[index % len(tensors)]
    if kind == "n_bytes":
        tensor[3] = value
    elif kind == "shape":
        tensor[1][value % len(tensor[1])] = value
    elif kind == "type":
        tensor[2] = value % 43
    elif kind == "offset":
        tensor[4] = value
    elif kind == "duplicate":
        tensors.insert(value % len(tensors), list(tensor))
    elif kind == "drop":
        tensors.remove(tensor)
    elif kind == "rename":
        tensor[0] = f"blk.{value}.attn_k.weight"
    elif kind == "head_count":  # 0, or more heads than the embedding has values
        metadata["llama.attention.head_count"] = 0 if value % 2 else 257 + value
    elif kind in ("head_count_kv", "key_length"):
        metadata[f"llama.attention.{kind}"] = 0
    elif kind == "block_count":
        metadata["llama.block_count"] = value % 8
    elif kind == "size":
        entry["size"] = value
    elif kind == "alignment":
        document["alignment"] = value % 130
    else:
        metadata["general.name"] = f"forged {value}"


# Values of the wrong kind (a number where the planner reads one only as itself: a number in
# range is a fact the file alone can contradict).
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.lists(st.integers(-2, 3), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(-1, 2), max_size=2),
)
JUNK_PLACES = ["version", "alignment", "data_offset", "metadata", "tensor", "tensor item"]


def junked(document: dict, place: str, index: int, junk: object) -> None:
    """``junk`` in ``place``: a top-level value, a metadata value, a tensor or a part of one
    but its name (a tensor renamed is a fact of the file alone: which names an architecture
    loads is llama.cpp's; "rename" forges the names a record cannot have)."""
    tensors, metadata = document["tensors"], document["metadata"]
    if place == "metadata":
        metadata[sorted(metadata)[index % len(metadata)]] = junk
    elif place == "tensor":
        tensors[index % len(tensors)] = junk
    elif place == "tensor item":
        tensors[index % len(tensors)][1 + index % 4] = junk
    else:
        document[place] = junk


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(MUTATIONS + JUNK_PLACES),
    index=st.integers(0, 1 << 10),
    value=st.integers(0, 1 << 40),
    junk=JUNK,
    layout=st.booleans(),
)
def test_any_forged_record_plans_the_same_or_is_refused_naming_the_lock(
    honest, kind, index, value, junk, layout
):
    directory, data, text, plan = honest
    lock = directory / model_lock.LOCK_NAME
    document = yaml.safe_load(text)
    entry = document["headers"][0]
    decoded = unpacked(entry["record"])
    if kind in JUNK_PLACES:
        junked(decoded, kind, index, junk)
    else:
        mutated(decoded, entry, kind, index, value)
    relaid = layout and kind in MUTATIONS and kind not in ("offset", "alignment")
    entry["record"] = packed(relayout(decoded) if relaid else decoded)
    lock.write_text(yaml.safe_dump(document))
    saved = {name: os.environ.get(name) for name in ("RIG_INVENTORY", "LLAMARIG_HEADER_CACHE")}
    os.environ["RIG_INVENTORY"] = str(directory / "rig.yml")
    os.environ["LLAMARIG_HEADER_CACHE"] = str(directory / "cache")
    try:
        found = gather(copy.deepcopy(data), None, gpus=False)
    except GgufError as error:
        message = str(error)
        assert str(lock) in message and "`llamarig lock` records" in message, message
        assert "\x1b" not in message
        return
    finally:
        for name, value_before in saved.items():
            if value_before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value_before
    assert found.header is not None and found.header_source == str(lock), (kind, found)
    again = plan_host("h", copy.deepcopy(data), found.header)
    assert json.dumps(again.to_json()) == plan, (kind, index, value)
