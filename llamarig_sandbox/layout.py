"""Where the sandbox rig keeps what it builds, fetches and runs, and the lock over each thing
there. Everything lives under CACHE_DIR:

    roots/<release>        pristine mmdebstrap root, built once, never booted
    run/<name>             working copy of it that a sandbox boots (.pid: supervisor, .log)
    sandbox/               SSH client key; sandbox/<name>/: known_hosts and state
    downloads/ mirror/     llama.cpp source (PyPI sdist) and its bare git mirror
    www/                   files the file server serves (the real model, the random test model)
    services/              pid and log files of the file server and git daemon
    apt-archives/<release> ccache/<release>   bound into sandboxes so rebuilds are cheap

A sandbox shares the host's network: its sshd and the host services listen on LOOPBACK.
"""

from pathlib import Path

from llamarig import CACHE_DIR
from llamarig_sandbox.locks import held

LOOPBACK = "127.0.0.1"

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


def sandbox_paths(name: str) -> dict[str, Path]:
    """Sandbox `name`'s working root, its supervisor's pid and log files, and what `up`
    recorded of it (its state and pinned host key)."""
    return {
        "root": RUN_DIR / name,
        "pid": RUN_DIR / f"{name}.pid",
        "log": RUN_DIR / f"{name}.log",
        "state": SANDBOX_DIR / name / "sandbox.json",
        "known_hosts": SANDBOX_DIR / name / "known_hosts",
    }


def private_apt_archives(name: str) -> Path:
    """Sandbox `name`'s own apt archive directory: two sandboxes running apt at once would
    fight over one directory's lock (real boxes never share it)."""
    return SANDBOX_DIR / name / "apt-archives"


def lock(what: str):
    """One lock per thing two `up`, `down` or `prepare` at once (the test tiers' two lanes and
    `prepare` beside them) could build, remove or start twice: a sandbox by its name, a
    release's base root and apt archive, the host services. Each is held only while its own
    thing is touched, so one lane's boot or teardown never waits behind another's."""
    return held(SANDBOX_DIR / "locks" / f"{what}.lock")


def sandbox_lock(name: str):
    return lock(f"sandbox-{name}")


def release_lock(release: str):
    return lock(f"release-{release}")


def services_lock():
    """Starting or stopping the file server and git daemon, and a sandbox's supervisor: `down`
    stops the services when no other sandbox is up or on its way up."""
    return lock("services")
