"""The host services that stand in for the internet, and what they serve: a file server with
the models (the "model hub": the real model that answers and the random-weight test model) and
a git daemon with a llama.cpp mirror at the pinned commit, both on loopback."""

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from llamarig import CACHE_DIR
from llamarig.config import defaults
from llamarig_sandbox import realmodel
from llamarig_sandbox.layout import (
    DOWNLOADS_DIR,
    LLAMA_MIRROR,
    LOOPBACK,
    MIRROR_DIR,
    SERVICES_DIR,
    WWW_DIR,
)
from llamarig_sandbox.locks import held
from llamarig_sandbox.processes import (
    SandboxError,
    accepts_connections,
    check_port_free,
    live_pid,
    log_tail,
    process_cmdline,
    remove_tree,
    run,
    say,
    wait_until,
)
from llamarig_sandbox.testmodel import sha256_file, write_test_model

# llama.cpp source: the llama-cpp-python sdist vendors the pinned tree with a shallow .git. The
# pin is written once, in group_data/all.yml; a pin the sdist lacks fails at `git update-ref`.
LLAMA_CPP_COMMIT = defaults()["llama_cpp"]["commit"]
SDIST_NAME = "llama_cpp_python-0.3.36"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/ec/e9/"
    "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
    "llama_cpp_python-0.3.36.tar.gz"
)
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
VOCAB_NAME = "ggml-vocab-llama-spm.gguf"
# What the sandbox serves: a real model that answers (the demo's, and what tests that need
# "a model" use), and the random-weight test model for tests that need its shape.
MODEL_NAME = realmodel.NAME
TEST_MODEL_NAME = "tiny-llama.gguf"

SERVICE_START_TIMEOUT_S = 10


def model_url(http_port: int, name: str = MODEL_NAME) -> str:
    """URL of a model on the file server (the real one unless named), as seen from a sandbox
    or the host."""
    return f"http://{LOOPBACK}:{http_port}/{name}"


def git_url(git_port: int) -> str:
    """URL of the llama.cpp mirror on the git daemon."""
    return f"git://{LOOPBACK}:{git_port}/{LLAMA_MIRROR.name}"


# --- what is served: the llama.cpp mirror and the models ----------------------------------------


def _ensure_sdist() -> Path:
    """Download the llama-cpp-python sdist once and verify its checksum."""
    sdist = DOWNLOADS_DIR / f"{SDIST_NAME}.tar.gz"
    if sdist.exists() and sha256_file(sdist) == SDIST_SHA256:
        return sdist
    DOWNLOADS_DIR.mkdir(parents=True, exist_ok=True)
    partial = sdist.with_name(sdist.name + ".partial")
    say(f"downloading {SDIST_URL}")
    try:
        with urllib.request.urlopen(SDIST_URL, timeout=60) as response, open(partial, "wb") as out:
            shutil.copyfileobj(response, out, 1 << 20)
    except OSError as error:
        raise SandboxError(f"downloading the llama.cpp sdist failed: {error}") from error
    actual = sha256_file(partial)
    if actual != SDIST_SHA256:
        partial.unlink()
        raise SandboxError(f"llama.cpp sdist checksum mismatch: got {actual}, want {SDIST_SHA256}")
    partial.rename(sdist)
    return sdist


def ensure_llama_mirror() -> Path:
    """Create the bare llama.cpp mirror (branch master at the pinned commit) and keep the vocab.

    Returns the vocabulary GGUF's path, which the test model borrows its tokenizer from.
    """
    with held(DOWNLOADS_DIR / ".mirror.lock"):
        return _make_llama_mirror()


def _make_llama_mirror() -> Path:
    vocab = DOWNLOADS_DIR / VOCAB_NAME
    if LLAMA_MIRROR.is_dir() and vocab.is_file():
        return vocab
    sdist = _ensure_sdist()
    say("creating the llama.cpp git mirror from the sdist")
    vendor = f"{SDIST_NAME}/vendor/llama.cpp"
    # Only the submodule's git dir, the .git file pointing at it, and the vocabulary are needed.
    wanted = (
        f"{SDIST_NAME}/.git/modules/vendor/llama.cpp/",
        f"{vendor}/.git",
        f"{vendor}/models/{VOCAB_NAME}",
    )
    MIRROR_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix="sdist-") as scratch:
        with tarfile.open(sdist) as archive:
            members = [
                member
                for member in archive
                if member.name in wanted or member.name.startswith(wanted[0])
            ]
            archive.extractall(scratch, members=members, filter="data")
        partial = MIRROR_DIR / (LLAMA_MIRROR.name + ".partial")
        remove_tree(partial)
        run(["git", "clone", "--quiet", "--bare", f"{scratch}/{vendor}", str(partial)], "git clone")
        _pin_master(partial)
        shutil.copyfile(f"{scratch}/{vendor}/models/{VOCAB_NAME}", vocab)
    remove_tree(LLAMA_MIRROR)
    partial.rename(LLAMA_MIRROR)
    return vocab


def _pin_master(repo: Path) -> None:
    """Make `master` (and HEAD) the pinned commit and drop every other ref and the origin."""
    git = ["git", f"--git-dir={repo}"]
    run([*git, "update-ref", "refs/heads/master", LLAMA_CPP_COMMIT], "git update-ref")
    run([*git, "symbolic-ref", "HEAD", "refs/heads/master"], "git symbolic-ref")
    refs = run([*git, "for-each-ref", "--format=%(refname)"], "git for-each-ref").stdout.split()
    for ref in refs:
        if ref != "refs/heads/master":
            run([*git, "update-ref", "-d", ref], "git update-ref -d")
    run([*git, "config", "--remove-section", "remote.origin"], "git config")


def ensure_test_model(vocab: Path) -> str:
    """Write the test model into the served directory once; return its sha256."""
    with held(DOWNLOADS_DIR / f".{TEST_MODEL_NAME}.lock"):
        return _write_test_model(vocab)


def _write_test_model(vocab: Path) -> str:
    model = WWW_DIR / TEST_MODEL_NAME
    checksum_file = WWW_DIR / f"{TEST_MODEL_NAME}.sha256"
    if model.is_file() and checksum_file.is_file():
        return checksum_file.read_text().split()[0]
    WWW_DIR.mkdir(parents=True, exist_ok=True)
    sha256 = write_test_model(model, vocab) if not model.is_file() else sha256_file(model)
    checksum_file.write_text(f"{sha256}  {TEST_MODEL_NAME}\n")
    return sha256


def ensure_real_model() -> str:
    """Put the real model into the served directory (from the downloads cache, or PyPI on a
    cold cache); return its sha256."""
    if not (WWW_DIR / realmodel.NAME).is_file():
        say(f"taking {realmodel.NAME} out of {realmodel.PACKAGE} {realmodel.VERSION} (PyPI)")
    try:
        realmodel.ensure(DOWNLOADS_DIR, WWW_DIR)
    except realmodel.RealModelError as error:
        raise SandboxError(str(error)) from error
    return realmodel.SHA256


@dataclass(frozen=True)
class ServedModels:
    """SandboxInfo's model fields."""

    model_url: str
    model_sha256: str
    test_model_url: str
    test_model_sha256: str


def served_models(http_port: int) -> ServedModels:
    """Both models in the served directory (and the llama.cpp mirror the test model's
    vocabulary comes from), with their URLs on the file server at ``http_port``."""
    test_model_sha256 = ensure_test_model(ensure_llama_mirror())
    return ServedModels(
        model_url=model_url(http_port),
        model_sha256=ensure_real_model(),
        test_model_url=model_url(http_port, TEST_MODEL_NAME),
        test_model_sha256=test_model_sha256,
    )


# --- the services: file server and git daemon ---------------------------------------------------


def _service_paths(service: str, port: int) -> tuple[Path, Path]:
    return SERVICES_DIR / f"{service}-{port}.pid", SERVICES_DIR / f"{service}-{port}.log"


def file_server_pid(port: int) -> int | None:
    return live_pid(_service_paths("fileserver", port)[0], "llamarig_sandbox.fileserver", str(port))


def git_daemon_pid(port: int) -> int | None:
    return live_pid(_service_paths("git-daemon", port)[0], f"--port={port}")


def ensure_file_server(port: int) -> None:
    """Serve WWW_DIR on 127.0.0.1:`port` unless our file server already does."""
    if file_server_pid(port):
        return
    check_port_free(port, "file server")
    pid_file, log_path = _service_paths("fileserver", port)
    SERVICES_DIR.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llamarig_sandbox.fileserver",
                "--root",
                str(WWW_DIR),
                "--port",
                str(port),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd="/",
            start_new_session=True,
        )
    pid_file.write_text(f"{server.pid}\n")
    if not wait_until(
        lambda: accepts_connections(port) or server.poll() is not None, SERVICE_START_TIMEOUT_S
    ):
        raise SandboxError(
            f"the file server did not start listening on port {port} (log {log_path})"
        )
    if server.poll() is not None:
        raise SandboxError(f"the file server exited: {log_tail(log_path, 1)}")


def ensure_git_daemon(port: int) -> None:
    """Export the git mirrors on git://127.0.0.1:`port`/ unless our git daemon already does."""
    if git_daemon_pid(port):
        return
    check_port_free(port, "git daemon")
    pid_file, log_path = _service_paths("git-daemon", port)
    SERVICES_DIR.mkdir(parents=True, exist_ok=True)
    pid_file.unlink(missing_ok=True)
    with open(log_path, "a") as log:
        # --detach makes git daemon log to syslog; the log file only catches startup errors.
        subprocess.run(
            [
                "git",
                "daemon",
                "--reuseaddr",
                "--export-all",
                f"--base-path={MIRROR_DIR}",
                f"--listen={LOOPBACK}",
                f"--port={port}",
                "--detach",
                f"--pid-file={pid_file}",
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd="/",
            check=False,
        )
    if not wait_until(lambda: accepts_connections(port), SERVICE_START_TIMEOUT_S):
        raise SandboxError(f"git daemon did not start listening on port {port} (log {log_path})")


def stop_services() -> None:
    """Stop every file server and git daemon the sandboxes started."""
    for pid_file in sorted(SERVICES_DIR.glob("*.pid")):
        port = pid_file.stem.rsplit("-", 1)[-1]
        if pid_file.name.startswith("fileserver-"):
            pid = live_pid(pid_file, "llamarig_sandbox.fileserver")
        else:
            pid = live_pid(pid_file, f"--port={port}")
        if pid:
            os.kill(pid, signal.SIGTERM)
            wait_until(lambda pid=pid: not process_cmdline(pid), SERVICE_START_TIMEOUT_S)
        pid_file.unlink(missing_ok=True)
