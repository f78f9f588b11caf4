"""The sandbox rig: a Debian system booted with systemd-nspawn that llamarig can converge over SSH.

A sandbox shares the host's network. Its sshd listens on 127.0.0.1:<ssh port>, and two services
on the host stand in for the internet: a file server with the models (the "model hub") and a
git daemon with a llama.cpp mirror at the pinned commit. Everything lives under CACHE_DIR:

    roots/<release>        pristine mmdebstrap root, built once, never booted
    run/<name>             working copy of it that a sandbox boots (.pid: supervisor, .log)
    sandbox/               SSH client key; sandbox/<name>/: known_hosts and state
    downloads/ mirror/     llama.cpp source (PyPI sdist) and its bare git mirror
    www/                   files the file server serves (the real model, the random test model)
    services/              pid and log files of the file server and git daemon
    apt-archives/<release> ccache/<release>   bound into sandboxes so rebuilds are cheap

CLI: `llamarig sandbox up|down|status [--release R] [--name N] [--ssh-port P] ...` (or
`llamarig-sandbox ...`, the same); `llamarig sandbox prepare [--release R ...]` builds the roots
and fetches what is served without booting anything.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from llamarig import CACHE_DIR
from llamarig.config import defaults
from llamarig.config.ssh import SshTarget
from llamarig_sandbox import realmodel
from llamarig_sandbox.locks import held
from llamarig_sandbox.testmodel import sha256_file, write_test_model

RELEASES = ("trixie", "bookworm")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = (
    "systemd-sysv,udev,dbus,openssh-server,python3,ca-certificates,kmod,iproute2,curl,ccache"
)
# The compiler each release's kernel headers name (CC in their .kernelvariables): a sandbox
# runs it through ccache, so the DKMS builds of the heavy scenarios (bookworm, Secure Boot,
# trixie) share compiled objects across sandboxes and runs. The deploy's commands are the
# production ones: the box merely has a compiler cache in front of gcc, as a build host may.
KERNEL_COMPILERS = {"trixie": "gcc-14", "bookworm": "gcc-12"}
DEFAULT_SSH_PORT = 2222
DEFAULT_HTTP_PORT = 8765
DEFAULT_GIT_PORT = 9418
LOOPBACK = "127.0.0.1"

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

ROOTS_DIR = CACHE_DIR / "roots"
RUN_DIR = CACHE_DIR / "run"
SANDBOX_DIR = CACHE_DIR / "sandbox"
DOWNLOADS_DIR = CACHE_DIR / "downloads"
MIRROR_DIR = CACHE_DIR / "mirror"
WWW_DIR = CACHE_DIR / "www"
SERVICES_DIR = CACHE_DIR / "services"
APT_ARCHIVES_DIR = CACHE_DIR / "apt-archives"
CCACHE_DIR = CACHE_DIR / "ccache"
LLAMA_MIRROR = MIRROR_DIR / "llama.cpp.git"
KEY_PATH = SANDBOX_DIR / "id_ed25519"
# Where the sandbox sees the host's ccache directory (group_data's paths.ccache).
SANDBOX_CCACHE_PATH = "/var/cache/llamarig/ccache"

# systemd-nspawn exits with 133 when the container asks for a reboot.
NSPAWN_REBOOT_EXIT = 133
BOOT_TIMEOUT_S = 120
SHUTDOWN_TIMEOUT_S = 60
SERVICE_START_TIMEOUT_S = 10
SSH_CONNECT_TIMEOUT_S = 10
# A working root on a tmpfs (see _roots_in_memory): on hosts with at least 20 GiB, each root
# capped at 12 GiB. The converged bookworm rig, with Debian's driver, CUDA toolkit, DKMS build
# and llama.cpp, takes 7.2 GiB, and a trixie rig beside it 1.2 (a CI run, 2026-12-06).
ROOTS_IN_MEMORY_MIN_KIB = 20 * 1024 * 1024
ROOT_TMPFS_SIZE = "12g"

# Host commands the sandbox needs, and the Debian package providing each.
HOST_COMMANDS = {
    "mmdebstrap": "mmdebstrap",
    "systemd-nspawn": "systemd-container",
    "git": "git",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
}

_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


class SandboxError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits 2."""


@dataclass(frozen=True)
class SandboxInfo:
    """How to reach a running sandbox and what it is served."""

    name: str
    release: str
    ssh_port: int
    key_path: str
    known_hosts_path: str
    root_dir: str
    model_url: str
    model_sha256: str
    test_model_url: str
    test_model_sha256: str
    git_url: str


# --- small pure helpers (unit-tested) ---------------------------------------------------------


def known_hosts_line(public_key: str, port: int, host: str = LOOPBACK) -> str:
    """Render the known_hosts line pinning `public_key` (an .pub file's text) for host:port."""
    fields = public_key.split()
    if len(fields) < 2:
        raise ValueError("not an OpenSSH public key")
    host_pattern = host if port == 22 else f"[{host}]:{port}"
    return f"{host_pattern} {fields[0]} {fields[1]}\n"


def sshd_dropin(port: int) -> str:
    """sshd configuration for a sandbox: key-only root login on loopback at `port`."""
    return (
        f"Port {port}\n"
        f"ListenAddress {LOOPBACK}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
    )


def hosts_file(name: str) -> str:
    """/etc/hosts for a sandbox whose hostname is `name`."""
    return (
        "127.0.0.1\tlocalhost\n"
        f"127.0.1.1\t{name}\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\tip6-allnodes\n"
        "ff02::2\tip6-allrouters\n"
    )


_STANZA_KEYWORDS = ("iface", "auto", "mapping", "source", "source-directory", "allow-")


def drop_dhcp_stanzas(interfaces: str) -> str:
    """Remove ifupdown `iface X inet dhcp` stanzas and the auto lines that bring them up.

    Inside a sandbox sharing the host's network, DHCP would make networking.service wait for
    minutes and then fail.
    """
    dhcp_interfaces = {
        words[1]
        for words in (line.split() for line in interfaces.splitlines())
        if len(words) >= 4 and words[0] == "iface" and words[3] == "dhcp"
    }
    kept: list[str] = []
    in_dropped_stanza = False
    for line in interfaces.splitlines(keepends=True):
        words = line.split()
        if not words or words[0].startswith("#"):
            kept.append(line)
            continue
        if words[0].startswith(_STANZA_KEYWORDS):
            in_dropped_stanza = False
        if words[0] == "iface" and words[1] in dhcp_interfaces:
            in_dropped_stanza = True
            continue
        if in_dropped_stanza:
            continue
        if words[0] == "auto" or words[0].startswith("allow-"):
            remaining = [word for word in words[1:] if word not in dhcp_interfaces]
            if not remaining:
                continue
            if len(remaining) < len(words) - 1:
                line = " ".join([words[0], *remaining]) + "\n"
        kept.append(line)
    return "".join(kept)


def private_apt_archives(name: str) -> Path:
    """Sandbox `name`'s own apt archive directory: two sandboxes running apt at once would
    fight over one directory's lock (real boxes never share it)."""
    return SANDBOX_DIR / name / "apt-archives"


def _link_debs(source: Path, target: Path) -> None:
    """Hard-link the .deb files of `source` that `target` lacks (one filesystem: no copies)."""
    target.mkdir(parents=True, exist_ok=True)
    for deb in source.glob("*.deb"):
        if not (target / deb.name).exists():
            try:
                os.link(deb, target / deb.name)
            except OSError:
                shutil.copy2(deb, target / deb.name)


def nspawn_command(name: str, release: str, root: Path) -> list[str]:
    """The systemd-nspawn command line that boots sandbox `name` from `root`."""
    return [
        "systemd-nspawn",
        "--register=no",
        "--keep-unit",
        "--console=passive",
        "-b",
        "-D",
        str(root),
        f"--machine={name}",
        f"--bind={private_apt_archives(name)}:/var/cache/apt/archives",
        f"--bind={CCACHE_DIR / release}:{SANDBOX_CCACHE_PATH}",
    ]


def model_url(http_port: int, name: str = MODEL_NAME) -> str:
    """URL of a model on the file server (the real one unless named), as seen from a sandbox
    or the host."""
    return f"http://{LOOPBACK}:{http_port}/{name}"


def git_url(git_port: int) -> str:
    """URL of the llama.cpp mirror on the git daemon."""
    return f"git://{LOOPBACK}:{git_port}/{LLAMA_MIRROR.name}"


# --- process and port helpers ------------------------------------------------------------------


def _say(message: str) -> None:
    print(f"sandbox: {message}", file=sys.stderr, flush=True)


def _run(argv: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; on failure raise SandboxError naming `what` and the last error line."""
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        detail = lines[-1] if lines else f"exit status {result.returncode}"
        raise SandboxError(f"{what} failed: {detail}")
    return result


def _process_cmdline(pid: int) -> list[str]:
    """argv of a live process, or [] when there is none (or it is a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def _live_pid(pid_file: Path, *markers: str) -> int | None:
    """The pid in `pid_file` if that process lives and its argv contains every marker.

    The markers guard against a recycled pid belonging to some unrelated process.
    """
    pid = _read_pid(pid_file)
    if pid is None:
        return None
    cmdline = _process_cmdline(pid)
    if cmdline and all(marker in cmdline for marker in markers):
        return pid
    return None


def _port_in_use(port: int) -> bool:
    """Whether something already listens on (or holds) the loopback TCP port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR so connections lingering in TIME_WAIT do not count as "in use".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def _accepts_connections(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        return probe.connect_ex((LOOPBACK, port)) == 0


def _wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def _log_tail(log_path: Path, lines: int = 5) -> str:
    try:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in tail)


def _remove_tree(path: Path) -> None:
    """Delete a root directory tree without crossing into anything mounted inside it.

    An interrupted mmdebstrap can leave /proc and /sys mounted in its target; a working root
    may be a tmpfs of its own (_prepare_working_root), unmounted here too.
    """
    if not path.exists():
        return
    own = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        mount_points = [line.split()[1] for line in mounts]
    for mount_point in sorted(mount_points, key=len, reverse=True):
        if mount_point.startswith(own + "/") or mount_point == own:
            subprocess.run(["umount", "-l", mount_point], check=False)
    _run(["rm", "-rf", "--one-file-system", str(path)], f"removing {path}")


def _lock(what: str):
    """One lock per thing two `up`, `down` or `prepare` at once (the test tiers' two lanes and
    `prepare` beside them) could build, remove or start twice: a sandbox by its name, a
    release's base root and apt archive, the host services. Each is held only while its own
    thing is touched, so one lane's boot or teardown never waits behind another's."""
    return held(SANDBOX_DIR / "locks" / f"{what}.lock")


def _sandbox_lock(name: str):
    return _lock(f"sandbox-{name}")


def _release_lock(release: str):
    return _lock(f"release-{release}")


def _services_lock():
    """Starting or stopping the file server and git daemon, and a sandbox's supervisor: `down`
    stops the services when no other sandbox is up or on its way up."""
    return _lock("services")


def _require_root() -> None:
    if os.geteuid() != 0:
        raise SandboxError(
            "the sandbox must be managed as root (it uses mmdebstrap and systemd-nspawn)"
        )


def _check_name(name: str) -> None:
    if not _NAME_PATTERN.fullmatch(name):
        raise SandboxError(
            f"invalid sandbox name {name!r}: use lowercase letters, digits and '-' (max 63)"
        )


def _check_release(release: str) -> None:
    if release not in RELEASES:
        raise SandboxError(f"unknown release {release!r}: choose one of {', '.join(RELEASES)}")


# --- host preparation --------------------------------------------------------------------------


def ensure_host_tools() -> None:
    """Install, with apt, the host packages whose commands are missing."""
    with _lock("host-tools"):
        _install_host_tools()


def _install_host_tools() -> None:
    missing = sorted({pkg for cmd, pkg in HOST_COMMANDS.items() if shutil.which(cmd) is None})
    if not missing:
        return
    _say(f"installing host packages: {' '.join(missing)}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    _run(["apt-get", "update"], "apt-get update", env=env)
    _run(
        ["apt-get", "install", "-y", "--no-install-recommends", *missing],
        f"apt-get install {' '.join(missing)}",
        env=env,
    )


def ensure_base_root(release: str) -> Path:
    """Build the pristine root for `release` with mmdebstrap, once; return its path.

    It is built in `<release>.partial` and renamed when complete, so an interrupted build is
    started over rather than reused.
    """
    with _release_lock(release):
        return _build_base_root(release)


def _build_base_root(release: str) -> Path:
    root = ROOTS_DIR / release
    if root.is_dir():
        return root
    partial = ROOTS_DIR / f"{release}.partial"
    log_path = ROOTS_DIR / f"{release}.log"
    _remove_tree(partial)
    ROOTS_DIR.mkdir(parents=True, exist_ok=True)
    _say(f"building the {release} base root with mmdebstrap (a minute; log {log_path})")
    started = time.monotonic()
    with open(log_path, "w") as log:
        result = subprocess.run(
            [
                "mmdebstrap",
                "--variant=minbase",
                f"--include={BASE_PACKAGES}",
                # Kept as debootstrap kept them: a root boots with apt's lists in place.
                "--skip=cleanup/apt/lists",
                release,
                str(partial),
                DEBIAN_MIRROR,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    if result.returncode != 0:
        raise SandboxError(
            f"mmdebstrap {release} failed (exit {result.returncode}): {_log_tail(log_path, 1)}"
            f" (full log: {log_path})"
        )
    _drop_dhcp_config(partial)
    _write_machine_id(partial)
    partial.rename(root)
    _say(f"{release} base root built in {time.monotonic() - started:.0f} s")
    return root


def _write_machine_id(root: Path) -> None:
    """Give the root the machine id debootstrap's systemd left: mmdebstrap leaves it empty,
    which makes a boot the first one (systemd's presets applied anew to every unit)."""
    (root / "etc/machine-id").write_text(f"{uuid.uuid4().hex}\n")


def _drop_dhcp_config(root: Path) -> None:
    network_dir = root / "etc/network"
    for config in [network_dir / "interfaces", *sorted(network_dir.glob("interfaces.d/*"))]:
        if config.is_file():
            text = config.read_text()
            cleaned = drop_dhcp_stanzas(text)
            if cleaned != text:
                config.write_text(cleaned)


def ensure_ssh_key() -> Path:
    """Generate the sandbox SSH client key pair once; return the private key's path."""
    with _lock("ssh-key"):
        if KEY_PATH.exists():
            return KEY_PATH
        SANDBOX_DIR.mkdir(parents=True, exist_ok=True)
        _run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "llamarig-sandbox",
                "-f",
                str(KEY_PATH),
            ],
            "ssh-keygen",
        )
    return KEY_PATH


def _ensure_sdist() -> Path:
    """Download the llama-cpp-python sdist once and verify its checksum."""
    sdist = DOWNLOADS_DIR / f"{SDIST_NAME}.tar.gz"
    if sdist.exists() and sha256_file(sdist) == SDIST_SHA256:
        return sdist
    DOWNLOADS_DIR.mkdir(parents=True, exist_ok=True)
    partial = sdist.with_name(sdist.name + ".partial")
    _say(f"downloading {SDIST_URL}")
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
    _say("creating the llama.cpp git mirror from the sdist")
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
        _remove_tree(partial)
        _run(
            ["git", "clone", "--quiet", "--bare", f"{scratch}/{vendor}", str(partial)], "git clone"
        )
        _pin_master(partial)
        shutil.copyfile(f"{scratch}/{vendor}/models/{VOCAB_NAME}", vocab)
    _remove_tree(LLAMA_MIRROR)
    partial.rename(LLAMA_MIRROR)
    return vocab


def _pin_master(repo: Path) -> None:
    """Make `master` (and HEAD) the pinned commit and drop every other ref and the origin."""
    git = ["git", f"--git-dir={repo}"]
    _run([*git, "update-ref", "refs/heads/master", LLAMA_CPP_COMMIT], "git update-ref")
    _run([*git, "symbolic-ref", "HEAD", "refs/heads/master"], "git symbolic-ref")
    refs = _run([*git, "for-each-ref", "--format=%(refname)"], "git for-each-ref").stdout.split()
    for ref in refs:
        if ref != "refs/heads/master":
            _run([*git, "update-ref", "-d", ref], "git update-ref -d")
    _run([*git, "config", "--remove-section", "remote.origin"], "git config")


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
        _say(f"taking {realmodel.NAME} out of {realmodel.PACKAGE} {realmodel.VERSION} (PyPI)")
    try:
        realmodel.ensure(DOWNLOADS_DIR, WWW_DIR)
    except realmodel.RealModelError as error:
        raise SandboxError(str(error)) from error
    return realmodel.SHA256


# --- host services: file server and git daemon --------------------------------------------------


def _service_paths(service: str, port: int) -> tuple[Path, Path]:
    return SERVICES_DIR / f"{service}-{port}.pid", SERVICES_DIR / f"{service}-{port}.log"


def _file_server_pid(port: int) -> int | None:
    return _live_pid(
        _service_paths("fileserver", port)[0], "llamarig_sandbox.fileserver", str(port)
    )


def _git_daemon_pid(port: int) -> int | None:
    return _live_pid(_service_paths("git-daemon", port)[0], f"--port={port}")


def _check_port_free(port: int, purpose: str) -> None:
    if _port_in_use(port):
        raise SandboxError(f"port {port} (for the {purpose}) is already in use on {LOOPBACK}")


def ensure_file_server(port: int) -> None:
    """Serve WWW_DIR on 127.0.0.1:`port` unless our file server already does."""
    if _file_server_pid(port):
        return
    _check_port_free(port, "file server")
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
    if not _wait_until(
        lambda: _accepts_connections(port) or server.poll() is not None, SERVICE_START_TIMEOUT_S
    ):
        raise SandboxError(
            f"the file server did not start listening on port {port} (log {log_path})"
        )
    if server.poll() is not None:
        raise SandboxError(f"the file server exited: {_log_tail(log_path, 1)}")


def ensure_git_daemon(port: int) -> None:
    """Export the git mirrors on git://127.0.0.1:`port`/ unless our git daemon already does."""
    if _git_daemon_pid(port):
        return
    _check_port_free(port, "git daemon")
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
    if not _wait_until(lambda: _accepts_connections(port), SERVICE_START_TIMEOUT_S):
        raise SandboxError(f"git daemon did not start listening on port {port} (log {log_path})")


def stop_services() -> None:
    """Stop every file server and git daemon the sandboxes started."""
    for pid_file in sorted(SERVICES_DIR.glob("*.pid")):
        port = pid_file.stem.rsplit("-", 1)[-1]
        if pid_file.name.startswith("fileserver-"):
            pid = _live_pid(pid_file, "llamarig_sandbox.fileserver")
        else:
            pid = _live_pid(pid_file, f"--port={port}")
        if pid:
            os.kill(pid, signal.SIGTERM)
            _wait_until(lambda pid=pid: not _process_cmdline(pid), SERVICE_START_TIMEOUT_S)
        pid_file.unlink(missing_ok=True)


# --- sandbox lifecycle --------------------------------------------------------------------------


def _paths(name: str) -> dict[str, Path]:
    return {
        "root": RUN_DIR / name,
        "pid": RUN_DIR / f"{name}.pid",
        "log": RUN_DIR / f"{name}.log",
        "state": SANDBOX_DIR / name / "sandbox.json",
        "known_hosts": SANDBOX_DIR / name / "known_hosts",
    }


def _supervisor_pid(name: str) -> int | None:
    return _live_pid(_paths(name)["pid"], "_supervise", f"--machine={name}")


def is_running(name: str) -> bool:
    """Whether the supervisor of sandbox `name` (and so, normally, the sandbox) is alive."""
    return _supervisor_pid(name) is not None


def _load_state(name: str) -> dict | None:
    """What `up` recorded about sandbox `name`: SandboxInfo's fields plus the service ports."""
    try:
        return json.loads(_paths(name)["state"].read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class ServedModels:
    """SandboxInfo's model fields."""

    model_url: str
    model_sha256: str
    test_model_url: str
    test_model_sha256: str


def _served_models(http_port: int) -> ServedModels:
    """Both models in the served directory (and the llama.cpp mirror the test model's
    vocabulary comes from), with their URLs on the file server at ``http_port``."""
    test_model_sha256 = ensure_test_model(ensure_llama_mirror())
    return ServedModels(
        model_url=model_url(http_port),
        model_sha256=ensure_real_model(),
        test_model_url=model_url(http_port, TEST_MODEL_NAME),
        test_model_sha256=test_model_sha256,
    )


def _info_from_state(state: dict) -> SandboxInfo:
    return SandboxInfo(**{field: state[field] for field in SandboxInfo.__dataclass_fields__})


def _prepare_working_root(
    name: str, release: str, base_root: Path, ssh_port: int, in_memory: bool
) -> Path:
    """Copy the base root afresh (onto a tmpfs of its own if ``in_memory``) and configure its
    SSH access and identity."""
    root = _paths(name)["root"]
    _remove_tree(root)
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    root.mkdir()
    if in_memory:
        _run(
            ["mount", "-t", "tmpfs", "-o", f"mode=0755,size={ROOT_TMPFS_SIZE}", "tmpfs", str(root)],
            "mounting a tmpfs for the working root",
        )
    _run(["cp", "-a", "--reflink=auto", f"{base_root}/.", str(root)], "copying the base root")

    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    ssh_dir.chmod(0o700)
    authorized_keys = ssh_dir / "authorized_keys"
    authorized_keys.write_text(Path(f"{KEY_PATH}.pub").read_text())
    authorized_keys.chmod(0o600)
    (root / "etc/ssh/sshd_config.d").mkdir(parents=True, exist_ok=True)
    (root / "etc/ssh/sshd_config.d/llamarig.conf").write_text(sshd_dropin(ssh_port))
    (root / "etc/hostname").write_text(f"{name}\n")
    (root / "etc/hosts").write_text(hosts_file(name))
    (root / SANDBOX_CCACHE_PATH.lstrip("/")).mkdir(parents=True, exist_ok=True)
    _cache_kernel_compiler(root, release)
    _quick_dpkg(root)
    for host_dir in (APT_ARCHIVES_DIR / release / "partial", CCACHE_DIR / release):
        host_dir.mkdir(parents=True, exist_ok=True)
    # Seeded from the release's shared archive; what it downloads goes back there on `down`.
    with _release_lock(release):
        _link_debs(APT_ARCHIVES_DIR / release, private_apt_archives(name))
    (private_apt_archives(name) / "partial").mkdir(exist_ok=True)
    return root


def _roots_in_memory(meminfo: Path = Path("/proc/meminfo")) -> bool:
    """Whether working roots go on a tmpfs of their own: on a host with the memory for it
    (ROOTS_IN_MEMORY_MIN_KIB), unless LLAMARIG_SANDBOX_ROOTS_ON_DISK is 1. A root is rebuilt,
    never repaired, so it need not survive the host; on ext4, every file a root's dpkg, git or
    compiler creates searched the inode bitmaps past the inodes of roots deleted just before
    (`recently_deleted`, a third of an apt install's CPU time)."""
    on_disk = os.environ.get("LLAMARIG_SANDBOX_ROOTS_ON_DISK", "")
    if on_disk not in ("", "0", "1"):
        raise SandboxError(
            f"LLAMARIG_SANDBOX_ROOTS_ON_DISK is {on_disk!r}: set it to 1 to keep the sandbox"
            " roots on disk, or to 0 (or leave it unset) to put them in memory"
        )
    if on_disk == "1":
        return False
    total_kib = int(meminfo.read_text().splitlines()[0].split()[1])  # "MemTotal: N kB"
    return total_kib >= ROOTS_IN_MEMORY_MIN_KIB


def _cache_kernel_compiler(root: Path, release: str) -> None:
    """Put ccache in front of the kernel headers' compiler (a masquerading link on PATH before
    /usr/bin) with its cache in the host's ccache directory. A root built before ccache was
    among the base packages is left as it is."""
    if not (root / "usr/bin/ccache").is_file():
        return
    (root / "etc/ccache.conf").write_text(f"cache_dir = {SANDBOX_CCACHE_PATH}\n")
    link = root / "usr/local/bin" / KERNEL_COMPILERS[release]
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to("/usr/bin/ccache")
    # apt runs dpkg, and so the DKMS build of a driver package's postinst, with its own PATH
    # (DPkg::Path, /usr/sbin:/usr/bin:/sbin:/bin), which would skip the link: every such build
    # compiled all 192 objects afresh (108 s on a quiet 2-core machine).
    (root / "etc/apt/apt.conf.d/50llamarig-sandbox-ccache").write_text(
        'DPkg::Path "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";\n'
    )


def _quick_dpkg(root: Path) -> None:
    """dpkg without an fsync per unpacked file (as Debian's container images set it): a
    sandbox that dies is rebuilt from its base root, never repaired. Unpacking Debian's CUDA
    toolkit took 70 s with the fsyncs."""
    (root / "etc/dpkg/dpkg.cfg.d/llamarig-sandbox-unsafe-io").write_text("force-unsafe-io\n")


def _pin_host_key(name: str, root: Path, ssh_port: int) -> Path:
    """Write known_hosts from the root's own host key (read from disk, no keyscan)."""
    known_hosts = _paths(name)["known_hosts"]
    known_hosts.parent.mkdir(parents=True, exist_ok=True)
    public_key = (root / "etc/ssh/ssh_host_ed25519_key.pub").read_text()
    known_hosts.write_text(known_hosts_line(public_key, ssh_port))
    return known_hosts


def _start_supervisor(name: str, release: str, root: Path) -> subprocess.Popen:
    paths = _paths(name)
    with open(paths["log"], "w") as log:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "llamarig_sandbox.sandbox",
                "_supervise",
                "--",
                *nspawn_command(name, release, root),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd="/",
            start_new_session=True,
        )
    paths["pid"].write_text(f"{supervisor.pid}\n")
    return supervisor


def _ssh_command(info: SandboxInfo) -> list[str]:
    """The ssh command line for the sandbox: the rig's own (`SshTarget`, host key pinned), with
    only the sandbox key offered and a bounded connect while it boots."""
    target = SshTarget(
        host=LOOPBACK,
        port=info.ssh_port,
        user="root",
        key=info.key_path,
        known_hosts=info.known_hosts_path,
    )
    return target.argv("-o", "IdentitiesOnly=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}")


def ssh(
    info: SandboxInfo, command: str, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """Run a shell command in the sandbox over SSH (host key pinned); capture text output."""
    return subprocess.run(
        [*_ssh_command(info), command],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
    )


def _wait_for_boot(info: SandboxInfo, supervisor: subprocess.Popen) -> None:
    """Wait until systemd in the sandbox reports the boot finished, over SSH."""
    log_path = _paths(info.name)["log"]
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        # Not is_running(): until the supervisor execs, its pid shows this process's argv.
        if supervisor.poll() is not None:
            raise SandboxError(
                f"sandbox {info.name} stopped while booting: {_log_tail(log_path, 1)}"
            )
        try:
            result = ssh(
                info,
                "systemctl is-system-running --wait",
                timeout=max(1.0, deadline - time.monotonic()),
            )
        except subprocess.TimeoutExpired:
            break
        if result.stdout.strip() in ("running", "degraded"):
            return
        time.sleep(1)
    raise SandboxError(
        f"sandbox {info.name} did not finish booting within {BOOT_TIMEOUT_S} s (log {log_path});"
        f" it is left running for inspection: `llamarig sandbox down --name {info.name}`"
    )


def prepare(releases: tuple[str, ...] = ("trixie",)) -> None:
    """Build what a sandbox boots from and is served, without booting one: the base roots of
    ``releases``, the SSH key, the llama.cpp mirror and both models. The slow part of a cold
    `up` (mmdebstrap, downloads) is network-bound, so the test tiers run this beside the unit
    tests; a later `up` finds it all in place. The roots and the models are made at once, each
    under its own lock: a lane's first `up` waits only for its own release's root."""
    _require_root()
    for release in releases:
        _check_release(release)
    ensure_host_tools()
    ensure_ssh_key()
    jobs = [lambda: _served_models(DEFAULT_HTTP_PORT)]
    jobs += [lambda release=release: ensure_base_root(release) for release in releases]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def up(
    release: str = "trixie",
    name: str | None = None,
    ssh_port: int = DEFAULT_SSH_PORT,
    http_port: int = DEFAULT_HTTP_PORT,
    git_port: int = DEFAULT_GIT_PORT,
) -> SandboxInfo:
    """Boot sandbox `name` (default sandbox-<release>) and its host services; say how to reach it.

    Idempotent: for a sandbox that already runs, it only makes sure the services run.
    Raises SandboxError for problems the user can fix (not root, port taken, mmdebstrap failed).
    """
    _require_root()
    _check_release(release)
    name = name or f"sandbox-{release}"
    _check_name(name)
    with _sandbox_lock(name):
        state = _load_state(name) if is_running(name) else None
        if state:
            # The models are the served ones now (a sandbox booted by an older llamarig
            # recorded others).
            state.update(asdict(_served_models(state["http_port"])))
            with _services_lock():
                ensure_file_server(state["http_port"])
                ensure_git_daemon(state["git_port"])
            return _info_from_state(state)
        if _sandbox_pids(name):
            raise SandboxError(
                f"{name} is half running (no supervisor or no state file);"
                f" clean it up with `llamarig sandbox down --name {name}`"
            )

        # Fail on a taken port or a bad setting before spending minutes on the rest.
        in_memory = _roots_in_memory()
        _check_port_free(ssh_port, "sandbox's sshd")
        if not _file_server_pid(http_port):
            _check_port_free(http_port, "file server")
        if not _git_daemon_pid(git_port):
            _check_port_free(git_port, "git daemon")

        ensure_host_tools()
        base_root = ensure_base_root(release)
        ensure_ssh_key()
        models = _served_models(http_port)

        _say(f"starting {name}")
        started = time.monotonic()
        root = _prepare_working_root(name, release, base_root, ssh_port, in_memory)
        known_hosts = _pin_host_key(name, root, ssh_port)
        info = SandboxInfo(
            name=name,
            release=release,
            ssh_port=ssh_port,
            key_path=str(KEY_PATH),
            known_hosts_path=str(known_hosts),
            root_dir=str(root),
            **asdict(models),
            git_url=git_url(git_port),
        )
        _paths(name)["state"].write_text(
            json.dumps({**asdict(info), "http_port": http_port, "git_port": git_port}, indent=2)
        )
        # The supervisor's pid file is written before another `down` may look (see `down`).
        with _services_lock():
            ensure_file_server(http_port)
            ensure_git_daemon(git_port)
            supervisor = _start_supervisor(name, release, root)
        _wait_for_boot(info, supervisor)
        _say(f"{name} booted in {time.monotonic() - started:.0f} s")
        return info


def down(name: str) -> None:
    """Stop sandbox `name` and delete its working root; stop the services if none is left.

    Idempotent: a sandbox that is not running is only cleaned up.
    """
    _require_root()
    _check_name(name)
    paths = _paths(name)
    with _sandbox_lock(name):
        _stop_sandbox_processes(name)
        release = (_load_state(name) or {}).get("release")
        if release:
            with _release_lock(release):
                _link_debs(private_apt_archives(name), APT_ARCHIVES_DIR / release)
        _remove_tree(paths["root"])
        paths["pid"].unlink(missing_ok=True)
        paths["log"].unlink(missing_ok=True)
        shutil.rmtree(SANDBOX_DIR / name, ignore_errors=True)
        with _services_lock():
            if not any(_up_or_booting(pid_file.stem) for pid_file in RUN_DIR.glob("*.pid")):
                stop_services()


def _up_or_booting(name: str) -> bool:
    """Whether sandbox `name` runs, or its `up` has started its supervisor, which may not have
    exec'd yet (its command line is still its parent's, so is_running cannot tell)."""
    paths = _paths(name)
    pid = _read_pid(paths["pid"])
    return is_running(name) or (
        pid is not None and paths["state"].exists() and Path(f"/proc/{pid}").exists()
    )


def _sandbox_pids(name: str) -> list[int]:
    """Live supervisor and systemd-nspawn processes of sandbox `name`."""
    pids = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        cmdline = _process_cmdline(int(proc_dir.name))
        if f"--machine={name}" in cmdline and (
            "_supervise" in cmdline or Path(cmdline[0]).name == "systemd-nspawn"
        ):
            pids.append(int(proc_dir.name))
    return pids


def signal_all(pids: list[int], signum: int) -> None:
    """Send ``signum`` to each of ``pids``; one that has exited meanwhile is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _stop_sandbox_processes(name: str) -> None:
    """SIGTERM the supervisor, which halts the container, and wait; kill whatever hangs.

    Without a supervisor (it was killed), a systemd-nspawn left behind is signalled directly.
    """
    if not _sandbox_pids(name):
        return
    supervisor = _supervisor_pid(name)
    signal_all([supervisor] if supervisor else _sandbox_pids(name), signal.SIGTERM)
    if not _wait_until(lambda: not _sandbox_pids(name), SHUTDOWN_TIMEOUT_S, interval_s=0.5):
        _say(f"{name} did not halt within {SHUTDOWN_TIMEOUT_S} s; killing it")
        signal_all(_sandbox_pids(name), signal.SIGKILL)
        _wait_until(lambda: not _sandbox_pids(name), 10)


def supervise(command: list[str]) -> int:
    """Run `command` (systemd-nspawn) and restart it whenever it exits with 133 (a reboot).

    SIGTERM or SIGINT is passed on to the command, which then halts the container; the
    supervisor returns the command's exit status (128 + N for death by signal N).
    """
    stopping = False
    child: subprocess.Popen | None = None

    def stop(_signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    returncode = 0
    while not stopping:
        print(f"supervisor: starting {' '.join(command)}", flush=True)
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        if stopping:  # the signal came while the child was starting
            child.send_signal(signal.SIGTERM)
        returncode = child.wait()
        print(f"supervisor: exit status {returncode}", flush=True)
        if returncode != NSPAWN_REBOOT_EXIT:
            break
    # Like a shell, report death by signal N as 128 + N (Popen gives -N).
    return 128 - returncode if returncode < 0 else returncode


# --- command line ------------------------------------------------------------------------------


def _print_status(info: SandboxInfo) -> None:
    ssh_line = shlex.join(_ssh_command(info))
    print(f"sandbox {info.name} ({info.release}) is running")
    print(f"  ssh:   {ssh_line}")
    print(f"  model: {info.model_url} sha256 {info.model_sha256}")
    print(f"  test model (random weights): {info.test_model_url} sha256 {info.test_model_sha256}")
    print(f"  git:   {info.git_url} (master = {LLAMA_CPP_COMMIT})")
    print(f"  root:  {info.root_dir}")


def status(name: str) -> SandboxInfo | None:
    """The running sandbox's SandboxInfo, or None when it is not running."""
    _require_root()
    _check_name(name)
    state = _load_state(name) if is_running(name) else None
    return _info_from_state(state) if state else None


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Manage the systemd-nspawn sandbox rig."
    )
    parser.add_argument("action", choices=("up", "down", "status", "prepare"))
    parser.add_argument(
        "--release",
        action="append",
        choices=RELEASES,
        help="trixie (default) or bookworm; `prepare` takes it more than once",
    )
    parser.add_argument("--name", help="sandbox name (default: sandbox-<release>)")
    parser.add_argument("--ssh-port", type=int, default=DEFAULT_SSH_PORT)
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT)
    parser.add_argument("--git-port", type=int, default=DEFAULT_GIT_PORT)
    return parser


def main(argv: list[str] | None = None, prog: str = "llamarig-sandbox") -> int:
    """CLI entry: `up`, `down` or `status`; exit 0 on success, 2 on a user error, 3 when down.
    `llamarig sandbox ...` calls it with its own name as ``prog``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_supervise"]:
        command = argv[2:] if argv[1:2] == ["--"] else argv[1:]
        return supervise(command)
    parser = _parser(prog)
    args = parser.parse_args(argv)
    releases = tuple(dict.fromkeys(args.release or ["trixie"]))
    if len(releases) > 1 and args.action != "prepare":
        parser.error("--release is given once, except to `prepare`")
    release = releases[0]
    name = args.name or f"sandbox-{release}"
    try:
        if args.action == "prepare":
            prepare(releases)
            print(f"sandbox: prepared {', '.join(releases)} (nothing booted)")
        elif args.action == "up":
            info = up(release, name, args.ssh_port, args.http_port, args.git_port)
            _print_status(info)
        elif args.action == "down":
            down(name)
            print(f"sandbox {name} is down")
        else:
            info = status(name)
            if info is None:
                print(f"sandbox {name} is not running")
                return 3
            _print_status(info)
    except SandboxError as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
