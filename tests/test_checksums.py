"""Checksum records (llamarig.onhost.checksums): a model file is hashed once, then its record is
read while the file's identity (device, inode, size, mtime, ctime) is unchanged.

Run for real: the operations by pyinfra against @local and the verify check by pytest against
local://, on temporary directories, with a `sha256sum` first on PATH that logs the file each
call reads (its stdin) before running the real one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llamarig.checks.runner import SUITE
from llamarig.onhost import checksums
from tests.conftest import PROJECT, VENV_BIN
from tests.test_operations import changed, run_deploy, sha256

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("curl", "sha256sum", "stat", "touch")),
    reason="needs curl, sha256sum, GNU stat and touch on this machine",
)

CONTENT = bytes(range(256)) * 4096


class Hashing:
    """A logging `sha256sum` first on PATH: ``calls()`` are the files it read, in order."""

    def __init__(self, directory: Path) -> None:
        real = shutil.which("sha256sum")
        self.bin = directory / "bin"
        self.bin.mkdir()
        self.log = directory / "sha256sum.log"
        wrapper = self.bin / "sha256sum"
        wrapper.write_text(
            "#!/bin/sh\n"
            'printf \'%s\\n\' "$(readlink /proc/$$/fd/0)" >> "$SHA256SUM_LOG"\n'
            f'exec {real} "$@"\n'
        )
        wrapper.chmod(0o755)
        self.env = {
            "PATH": f"{self.bin}:{VENV_BIN}:{os.environ['PATH']}",
            "SHA256SUM_LOG": str(self.log),
        }

    def calls(self) -> list[str]:
        """The files hashed since the last call."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        self.log.unlink(missing_ok=True)
        return lines


@pytest.fixture
def hashing(tmp_path) -> Hashing:
    return Hashing(tmp_path)


def identity(path: Path) -> str:
    """The identity GNU `stat -L -c '%d %i %s %.9Y %.9Z'` gives, from Python's os.stat."""
    info = path.stat()

    def seconds(ns: int) -> str:
        return f"{ns // 10**9}.{ns % 10**9:09d}"

    return (
        f"{info.st_dev} {info.st_ino} {info.st_size} "
        f"{seconds(info.st_mtime_ns)} {seconds(info.st_ctime_ns)}"
    )


def flip_one_byte_keeping_mtime(path: Path) -> None:
    """One byte different, same size, the mtime set back with `touch -d`: only the content and
    the ctime tell."""
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    mtime = f"@{before.st_mtime_ns // 10**9}.{before.st_mtime_ns % 10**9:09d}"
    subprocess.run(["touch", "-m", "-d", mtime, str(path)], check=True)
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns


def record_of(path: Path, records: Path) -> Path:
    return Path(checksums.record_path(str(path), str(records)))


def test_identity_has_nanosecond_mtime_and_ctime(tmp_path):
    """GNU stat's %.9Y/%.9Z (coreutils 9.1 here; 9.7 on trixie, checked in the sandbox)."""
    path = tmp_path / "f"
    path.write_bytes(b"x")
    subprocess.run(["touch", "-m", "-d", "@1700000000.123456789", str(path)], check=True)
    shell = subprocess.run(
        ["sh", "-c", checksums.identity_command(str(path))],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert shell == identity(path)
    assert shell.split()[3] == "1700000000.123456789"


class TestCheckFile:
    """``check_file`` of a file already on the host (``model.path``)."""

    @pytest.fixture
    def model(self, tmp_path) -> Path:
        path = tmp_path / "m dir" / "it's a model.gguf"
        path.parent.mkdir()
        path.write_bytes(CONTENT)
        return path

    def check(self, tmp_path, hashing, model, digest=None, rehash=False):
        body = (
            f"operations.check_file(path={str(model)!r}, sha256={digest or sha256(CONTENT)!r}, "
            f"rehash={rehash}, records={str(tmp_path / 'records')!r})"
        )
        return run_deploy(tmp_path, body, env=hashing.env)

    def test_first_check_hashes_once_and_records_root_only(self, tmp_path, hashing, model):
        code, results, stderr = self.check(tmp_path, hashing, model)
        assert (code, changed(results)) == (0, 1), stderr
        # Once, though pyinfra runs the operation's body twice (to plan, then to execute).
        assert hashing.calls() == [str(model)]
        record = record_of(model, tmp_path / "records")
        assert record.read_text() == f"{sha256(CONTENT)} {identity(model)}\n"
        assert record.stat().st_mode & 0o777 == 0o600
        assert record.parent.stat().st_mode & 0o777 == 0o700

    def test_an_unchanged_file_is_not_hashed_again(self, tmp_path, hashing, model):
        self.check(tmp_path, hashing, model)
        hashing.calls()
        code, results, stderr = self.check(tmp_path, hashing, model)
        assert (code, changed(results)) == (0, 0), stderr
        assert hashing.calls() == []

    def test_one_byte_changed_with_the_mtime_kept_is_hashed_and_refused(
        self, tmp_path, hashing, model
    ):
        self.check(tmp_path, hashing, model)
        hashing.calls()
        flip_one_byte_keeping_mtime(model)
        actual = sha256(model.read_bytes())
        code, _, stderr = self.check(tmp_path, hashing, model)
        assert code != 0
        assert hashing.calls() == [str(model)]
        assert f"model file {model} has sha256 {actual}; expected sha256 {sha256(CONTENT)}" in (
            stderr
        )
        # Known wrong now: the next run refuses it from the record, without reading it.
        code, _, stderr = self.check(tmp_path, hashing, model)
        assert code != 0 and hashing.calls() == []
        assert f"model file {model} has sha256 {actual} (recorded when it was last hashed" in (
            stderr
        )

    def test_a_changed_mtime_is_hashed_again(self, tmp_path, hashing, model):
        self.check(tmp_path, hashing, model)
        hashing.calls()
        # The same content touched: hashed again, accepted, recorded anew.
        subprocess.run(["touch", "-m", "-d", "@1700000000.5", str(model)], check=True)
        code, results, stderr = self.check(tmp_path, hashing, model)
        assert (code, changed(results)) == (0, 1), stderr
        assert hashing.calls() == [str(model)]
        assert self.check(tmp_path, hashing, model)[0] == 0 and hashing.calls() == []
        # Other content of the same size, another mtime: hashed and refused.
        model.write_bytes(CONTENT[::-1])
        code, _, stderr = self.check(tmp_path, hashing, model)
        assert code != 0 and hashing.calls() == [str(model)]
        assert f"has sha256 {sha256(CONTENT[::-1])}" in stderr

    def test_a_record_of_another_digest_is_not_a_match(self, tmp_path, hashing, model):
        self.check(tmp_path, hashing, model)
        hashing.calls()
        record = record_of(model, tmp_path / "records")
        other = sha256(b"another model")
        record.write_text(record.read_text().replace(sha256(CONTENT), other))
        code, _, stderr = self.check(tmp_path, hashing, model)
        assert code != 0 and hashing.calls() == []
        assert f"has sha256 {other} (recorded when it was last hashed" in stderr

    @pytest.mark.parametrize(
        "text",
        ["not a digest 1 2 3 4 5\n", "", "{digest}\n", "{digest} 1 2 3 4.0 5.0\n"],
        ids=["garbage", "empty", "no-identity", "another-identity"],
    )
    def test_a_record_that_does_not_describe_the_file_is_not_trusted(
        self, tmp_path, hashing, model, text
    ):
        self.check(tmp_path, hashing, model)
        hashing.calls()
        record = record_of(model, tmp_path / "records")
        record.write_text(text.format(digest=sha256(CONTENT)))
        code, results, stderr = self.check(tmp_path, hashing, model)
        assert (code, changed(results)) == (0, 1), stderr
        assert hashing.calls() == [str(model)]
        assert record.read_text() == f"{sha256(CONTENT)} {identity(model)}\n"

    def test_rehash_hashes_a_recorded_file(self, tmp_path, hashing, model):
        self.check(tmp_path, hashing, model)
        hashing.calls()
        for _ in range(2):
            code, _, stderr = self.check(tmp_path, hashing, model, rehash=True)
            assert code == 0, stderr
            assert hashing.calls() == [str(model)]
        # And finds a change the record cannot show: the same identity, other content (a
        # record written by hand for a file that was never hashed).
        record = record_of(model, tmp_path / "records")
        record.write_text(f"{sha256(b'other')} {identity(model)}\n")
        code, _, stderr = self.check(tmp_path, hashing, model, digest=sha256(b"other"), rehash=True)
        assert code != 0 and hashing.calls() == [str(model)]
        assert f"has sha256 {sha256(CONTENT)}; expected sha256 {sha256(b'other')}" in stderr


class TestDownload:
    """``record_checksum`` then ``fetch_checked``, as the model stage calls them."""

    def deploy(self, tmp_path, hashing, url, dest, record=True, rehash=False):
        records = str(tmp_path / "records")
        body = ""
        if record:
            body += (
                f"operations.record_checksum(name='record', path={str(dest)!r}, "
                f"rehash={rehash}, records={records!r})\n"
            )
        body += (
            f"operations.fetch_checked(name='fetch', url='{url}/m.gguf', dest={str(dest)!r}, "
            f"sha256='{sha256(CONTENT)}', records={records!r})\n"
        )
        code, results, stderr = run_deploy(tmp_path, body, env=hashing.env)
        names = [op["name"] for op in results["operations"] if op["success"]] if results else []
        return code, names, stderr

    @pytest.fixture
    def served(self, file_server):
        www, url = file_server
        (www / "m.gguf").write_bytes(CONTENT)
        return www, url

    def test_a_download_is_hashed_once_then_never(self, tmp_path, hashing, served):
        _, url = served
        dest = tmp_path / "m.gguf"
        code, names, stderr = self.deploy(tmp_path, hashing, url, dest)
        assert (code, names) == (0, ["fetch"]), stderr
        assert hashing.calls() == [f"{dest}.part"]
        record = record_of(dest, tmp_path / "records")
        assert record.read_text() == f"{sha256(CONTENT)} {identity(dest)}\n"
        code, names, stderr = self.deploy(tmp_path, hashing, url, dest)
        assert (code, names) == (0, []), stderr
        assert hashing.calls() == []

    def test_a_flipped_byte_is_hashed_and_downloaded_again(self, tmp_path, hashing, served):
        _, url = served
        dest = tmp_path / "m.gguf"
        self.deploy(tmp_path, hashing, url, dest)
        hashing.calls()
        flip_one_byte_keeping_mtime(dest)
        wrong = sha256(dest.read_bytes())
        code, names, stderr = self.deploy(tmp_path, hashing, url, dest)
        assert (code, names) == (0, ["record", "fetch"]), stderr
        # The file once (it changed), then the new download: never the same bytes twice.
        assert hashing.calls() == [str(dest), f"{dest}.part"]
        assert dest.read_bytes() == CONTENT
        assert f"{dest} has sha256 {wrong}, expected {sha256(CONTENT)}: downloading it again" in (
            stderr
        )
        code, names, _ = self.deploy(tmp_path, hashing, url, dest)
        assert (code, names, hashing.calls()) == (0, [], [])

    def test_a_good_file_without_a_record_is_kept_and_no_download_changes(
        self, tmp_path, hashing, served
    ):
        www, url = served
        dest = tmp_path / "m.gguf"
        dest.write_bytes(CONTENT)
        (www / "m.gguf").unlink()  # a download would fail
        code, names, stderr = self.deploy(tmp_path, hashing, url, dest)
        # Only the record changed: a server restarted on the download's change stays up.
        assert (code, names) == (0, ["record"]), stderr
        assert hashing.calls() == [str(dest)]
        assert self.deploy(tmp_path, hashing, url, dest)[:2] == (0, [])
        assert hashing.calls() == []

    def test_fetch_checked_alone_checks_a_file_without_a_record_in_its_job(
        self, tmp_path, hashing, served
    ):
        www, url = served
        dest = tmp_path / "m.gguf"
        dest.write_bytes(CONTENT)
        (www / "m.gguf").unlink()
        code, names, stderr = self.deploy(tmp_path, hashing, url, dest, record=False)
        assert (code, names) == (0, ["fetch"]), stderr
        assert hashing.calls() == [str(dest)]
        assert self.deploy(tmp_path, hashing, url, dest, record=False)[:2] == (0, [])

    def test_rehash_hashes_every_run_and_downloads_nothing(self, tmp_path, hashing, served):
        _, url = served
        dest = tmp_path / "m.gguf"
        self.deploy(tmp_path, hashing, url, dest)
        hashing.calls()
        for _ in range(2):
            code, names, stderr = self.deploy(tmp_path, hashing, url, dest, rehash=True)
            assert (code, names) == (0, ["record"]), stderr
            assert hashing.calls() == [str(dest)]


class TestVerifyCheck:
    """The suite's model check (``llamarig verify``), against local://."""

    def verify(self, tmp_path, hashing, model, rehash=False):
        data = {
            "data": {"role": "standalone", "expect": {"answers": []}},
            "model_files": [{"path": str(model), "sha256": sha256(CONTENT)}],
            "rehash": rehash,
            "checksum_records": str(tmp_path / "records"),
        }
        data_file = tmp_path / "rig.json"
        data_file.write_text(json.dumps(data))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                str(SUITE / "test_rig.py"),
                "--hosts=local://",
                "-p",
                "no:cacheprovider",
                "-q",
                "--tb=line",
                "-k",
                "test_model_files_match_their_sha256",
            ],  # fmt: skip
            cwd=PROJECT,
            env={**os.environ, **hashing.env, "LLAMARIG_VERIFY_DATA": str(data_file)},
            capture_output=True,
            text=True,
            timeout=120,
        )
        return result.returncode, result.stdout

    @pytest.fixture
    def model(self, tmp_path, hashing) -> Path:
        path = tmp_path / "m.gguf"
        path.write_bytes(CONTENT)
        body = (
            f"operations.check_file(path={str(path)!r}, sha256={sha256(CONTENT)!r}, "
            f"records={str(tmp_path / 'records')!r})"
        )
        assert run_deploy(tmp_path, body)[0] == 0
        return path

    def test_reads_the_record_and_hashes_only_with_rehash(self, tmp_path, hashing, model):
        code, output = self.verify(tmp_path, hashing, model)
        assert code == 0 and "1 passed" in output, output
        assert hashing.calls() == []
        code, output = self.verify(tmp_path, hashing, model, rehash=True)
        assert code == 0 and "1 passed" in output, output
        assert hashing.calls() == [str(model)]

    def test_names_a_file_the_record_knows_is_wrong(self, tmp_path, hashing, model):
        record = record_of(model, tmp_path / "records")
        other = sha256(b"other")
        record.write_text(record.read_text().replace(sha256(CONTENT), other))
        code, output = self.verify(tmp_path, hashing, model)
        assert code != 0 and hashing.calls() == []
        assert f"model file {model} has sha256 {other} (recorded), expected" in output, output

    def test_hashes_a_changed_file(self, tmp_path, hashing, model):
        flip_one_byte_keeping_mtime(model)
        code, output = self.verify(tmp_path, hashing, model)
        assert code != 0 and hashing.calls() == [str(model)]
        assert f"model file {model} has sha256 {sha256(model.read_bytes())} (hashed)" in output
