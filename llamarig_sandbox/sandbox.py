"""The sandbox rig: a Debian system booted with systemd-nspawn that llamarig can converge over SSH,
and its command line.

A sandbox shares the host's network. Its sshd listens on 127.0.0.1:<ssh port>, and two services
on the host stand in for the internet: a file server with the models (the "model hub") and a
git daemon with a llama.cpp mirror at the pinned commit (services.py). A sandbox boots a working
copy of its release's base root (roots.py) in a container (containers.py) and is reached over
SSH (sshaccess.py); layout.py maps where all of it is kept. This module brings them together:
`prepare`, `up`, `down` and `status`.

CLI: `llamarig sandbox up|down|status [--release R] [--name N] [--ssh-port P] ...` (or
`llamarig-sandbox ...`, the same); `llamarig sandbox prepare [--release R ...]` builds the roots
and fetches what is served without booting anything.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from llamarig_sandbox.containers import (
    is_running,
    sandbox_pids,
    start_supervisor,
    stop_sandbox_processes,
    supervise,
    up_or_booting,
    wait_for_boot,
)
from llamarig_sandbox.layout import (
    APT_ARCHIVES_DIR,
    KEY_PATH,
    RUN_DIR,
    SANDBOX_DIR,
    private_apt_archives,
    release_lock,
    sandbox_lock,
    sandbox_paths,
    services_lock,
)
from llamarig_sandbox.processes import SandboxError, check_port_free, remove_tree, say
from llamarig_sandbox.roots import (
    RELEASES,
    ensure_base_root,
    ensure_host_tools,
    link_debs,
    prepare_working_root,
    roots_in_memory,
)
from llamarig_sandbox.services import (
    LLAMA_CPP_COMMIT,
    ensure_file_server,
    ensure_git_daemon,
    file_server_pid,
    git_daemon_pid,
    git_url,
    served_models,
    stop_services,
)
from llamarig_sandbox.sshaccess import SandboxInfo, ensure_ssh_key, pin_host_key, ssh_command

DEFAULT_SSH_PORT = 2222
DEFAULT_HTTP_PORT = 8765
DEFAULT_GIT_PORT = 9418

_NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


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


def _load_state(name: str) -> dict | None:
    """What `up` recorded about sandbox `name`: SandboxInfo's fields plus the service ports."""
    try:
        return json.loads(sandbox_paths(name)["state"].read_text())
    except (OSError, ValueError):
        return None


def _info_from_state(state: dict) -> SandboxInfo:
    return SandboxInfo(**{field: state[field] for field in SandboxInfo.__dataclass_fields__})


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
    jobs = [lambda: served_models(DEFAULT_HTTP_PORT)]
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
    with sandbox_lock(name):
        state = _load_state(name) if is_running(name) else None
        if state:
            # The models are the served ones now (a sandbox booted by an older llamarig
            # recorded others).
            state.update(asdict(served_models(state["http_port"])))
            with services_lock():
                ensure_file_server(state["http_port"])
                ensure_git_daemon(state["git_port"])
            return _info_from_state(state)
        if sandbox_pids(name):
            raise SandboxError(
                f"{name} is half running (no supervisor or no state file);"
                f" clean it up with `llamarig sandbox down --name {name}`"
            )

        # Fail on a taken port or a bad setting before spending minutes on the rest.
        in_memory = roots_in_memory()
        check_port_free(ssh_port, "sandbox's sshd")
        if not file_server_pid(http_port):
            check_port_free(http_port, "file server")
        if not git_daemon_pid(git_port):
            check_port_free(git_port, "git daemon")

        ensure_host_tools()
        base_root = ensure_base_root(release)
        ensure_ssh_key()
        models = served_models(http_port)

        say(f"starting {name}")
        started = time.monotonic()
        root = prepare_working_root(name, release, base_root, ssh_port, in_memory)
        known_hosts = pin_host_key(name, root, ssh_port)
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
        sandbox_paths(name)["state"].write_text(
            json.dumps({**asdict(info), "http_port": http_port, "git_port": git_port}, indent=2)
        )
        # The supervisor's pid file is written before another `down` may look (see `down`).
        with services_lock():
            ensure_file_server(http_port)
            ensure_git_daemon(git_port)
            supervisor = start_supervisor(name, release, root)
        wait_for_boot(info, supervisor)
        say(f"{name} booted in {time.monotonic() - started:.0f} s")
        return info


def down(name: str) -> None:
    """Stop sandbox `name` and delete its working root; stop the services if none is left.

    Idempotent: a sandbox that is not running is only cleaned up.
    """
    _require_root()
    _check_name(name)
    paths = sandbox_paths(name)
    with sandbox_lock(name):
        stop_sandbox_processes(name)
        release = (_load_state(name) or {}).get("release")
        if release:
            with release_lock(release):
                link_debs(private_apt_archives(name), APT_ARCHIVES_DIR / release)
        remove_tree(paths["root"])
        paths["pid"].unlink(missing_ok=True)
        paths["log"].unlink(missing_ok=True)
        shutil.rmtree(SANDBOX_DIR / name, ignore_errors=True)
        with services_lock():
            if not any(up_or_booting(pid_file.stem) for pid_file in RUN_DIR.glob("*.pid")):
                stop_services()


# --- command line ------------------------------------------------------------------------------


def _print_status(info: SandboxInfo) -> None:
    ssh_line = shlex.join(ssh_command(info))
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
