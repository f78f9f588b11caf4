"""The GGUF header cache (`llamarig.planner.header`): a model's header is read from its host or
its URL once per sha256, then from this machine; the host read starts small. The readers here
are the real facts' process() over the file's real bytes, counted; the URL is the loopback Hub
stand-in (tests/hubstandin.py)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from llamarig.facts.files import FileHead, FileIdentity
from llamarig.model.files import ModelFile
from llamarig.model.gguf import read_gguf_header_file
from llamarig.planner import header as model_header
from llamarig.planner.header import (
    HOST_HEADER_FIRST_READ,
    HOST_HEADER_READ,
    fetch_header,
    host_header,
)
from tests.ggufmodels import llama_metadata, llama_tensors, write_gguf, write_llama
from tests.hubstandin import HubStandIn, RunningStandIn


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def small(tmp_path) -> Path:
    """A model whose header fits the first host read, with a sparse data section behind it."""
    return write_llama(tmp_path / "small.gguf", n_vocab=1000, full_size=True)


@pytest.fixture
def large(tmp_path) -> Path:
    """A model whose header (a 128k vocabulary) is larger than the first host read."""
    shape = (2, 128, 256, 2, 2, 128_000)
    metadata = llama_metadata(*shape, 4096)
    metadata["tokenizer.ggml.tokens"] = [f"token-{index}" for index in range(128_000)]
    path = write_gguf(tmp_path / "large.gguf", "llama", metadata, llama_tensors(*shape), True)
    assert read_gguf_header_file(path).data_offset > HOST_HEADER_FIRST_READ
    return path


class CountingHost:
    """A reader as `llamarig.remote.gather` gets one, on this machine: FileHead of the file
    (each read logged) and FileIdentity by its real command."""

    def __init__(self) -> None:
        self.reads: list[int] = []

    def __call__(self, fact_class, path: str, size: int | None = None):
        if fact_class is FileIdentity:
            command = FileIdentity().command(path=path)
            output = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
            return FileIdentity().process(output.stdout.splitlines())
        assert fact_class is FileHead
        self.reads.append(size)
        if not Path(path).is_file():
            return None
        with open(path, "rb") as model:
            return model.read(size)


def test_the_first_host_read_is_small_and_the_next_plan_reads_nothing(small):
    host = CountingHost()
    file = ModelFile(str(small), None, sha256_of(small))
    first = host_header(host, file)
    assert host.reads == [HOST_HEADER_FIRST_READ]
    assert first == read_gguf_header_file(small)
    assert host_header(host, file) == read_gguf_header_file(small)
    assert host.reads == [HOST_HEADER_FIRST_READ], "the second plan came from the cache"
    kept = model_header.directory() / f"{file.sha256}.gguf-header"
    assert kept.stat().st_size == read_gguf_header_file(small).data_offset


def test_a_large_header_is_read_again_in_full_once(large):
    host = CountingHost()
    file = ModelFile(str(large), None, sha256_of(large))
    assert host_header(host, file) == read_gguf_header_file(large)
    assert host_header(host, file) == read_gguf_header_file(large)
    assert host.reads == [HOST_HEADER_FIRST_READ, HOST_HEADER_READ]


def test_without_a_sha256_the_header_is_kept_by_the_files_identity(small):
    host = CountingHost()
    file = ModelFile(str(small), None, None)
    host_header(host, file)
    host_header(host, file)
    assert host.reads == [HOST_HEADER_FIRST_READ], "unchanged: read once"
    stat = small.stat()
    os.utime(small, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # touched: a new identity
    assert host_header(host, file) == read_gguf_header_file(small)
    assert host.reads == [HOST_HEADER_FIRST_READ] * 2


def test_a_missing_file_is_not_kept(tmp_path):
    host = CountingHost()
    file = ModelFile(str(tmp_path / "absent.gguf"), None, "a" * 64)
    assert host_header(host, file) is None and host_header(host, file) is None
    assert host.reads == [HOST_HEADER_FIRST_READ] * 2


def test_a_damaged_entry_is_passed_by_and_replaced(small):
    digest = sha256_of(small)
    entry = model_header.directory() / f"{digest}.gguf-header"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(small.read_bytes()[:100])  # cut short
    host = CountingHost()
    header = host_header(host, ModelFile(str(small), None, digest))
    assert header == read_gguf_header_file(small) and host.reads == [HOST_HEADER_FIRST_READ]
    assert entry.stat().st_size == header.data_offset


def test_a_cache_that_cannot_be_written_only_costs_the_reads(small, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file-not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("LLAMARIG_HEADER_CACHE", str(blocked / "headers"))
    host = CountingHost()
    file = ModelFile(str(small), None, sha256_of(small))
    assert host_header(host, file) == read_gguf_header_file(small)
    host_header(host, file)
    assert host.reads == [HOST_HEADER_FIRST_READ] * 2


@pytest.mark.parametrize("key", [None, "", "A" * 64, "../" + "a" * 61, "a" * 63])
def test_only_a_sha256_names_an_entry(small, key):
    model_header.keep(key, small.read_bytes(), read_gguf_header_file(small))
    assert model_header.cached(key) is None
    assert not model_header.directory().exists()


def test_the_url_header_is_fetched_once_per_sha256(small):
    stand_in = HubStandIn()
    stand_in.add_repo("org/tiny", small.parent)
    running = RunningStandIn(stand_in)
    try:
        url = f"{running.url}/org/tiny/resolve/main/{small.name}"
        digest = sha256_of(small)
        assert fetch_header(url, sha256=digest) == read_gguf_header_file(small)
        fetched = len(stand_in.requests)
        assert fetched >= 1
        assert fetch_header(url, sha256=digest) == read_gguf_header_file(small)
        assert len(stand_in.requests) == fetched, "the second plan made no request"
        fetch_header(url)  # no sha256: fetched again
        assert len(stand_in.requests) > fetched
    finally:
        running.close()
