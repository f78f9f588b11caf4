"""The rig's work on the host: the error a user can act on (SandboxError) and the rig's
progress lines, commands whose failure is such an error, processes found by their pid files
(checked against recycled pids) and signalled, loopback ports probed, and root trees removed
without crossing into what is mounted inside them."""

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from llamarig_sandbox.layout import LOOPBACK


class SandboxError(Exception):
    """A failure the user can act on; the CLI prints it as one line and exits 2."""


def say(message: str) -> None:
    print(f"sandbox: {message}", file=sys.stderr, flush=True)


def run(argv: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """Run a command; on failure raise SandboxError naming `what` and the last error line."""
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        detail = lines[-1] if lines else f"exit status {result.returncode}"
        raise SandboxError(f"{what} failed: {detail}")
    return result


def process_cmdline(pid: int) -> list[str]:
    """argv of a live process, or [] when there is none (or it is a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def live_pid(pid_file: Path, *markers: str) -> int | None:
    """The pid in `pid_file` if that process lives and its argv contains every marker.

    The markers guard against a recycled pid belonging to some unrelated process.
    """
    pid = read_pid(pid_file)
    if pid is None:
        return None
    cmdline = process_cmdline(pid)
    if cmdline and all(marker in cmdline for marker in markers):
        return pid
    return None


def signal_all(pids: list[int], signum: int) -> None:
    """Send ``signum`` to each of ``pids``; one that has exited meanwhile is skipped."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def port_in_use(port: int) -> bool:
    """Whether something already listens on (or holds) the loopback TCP port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # SO_REUSEADDR so connections lingering in TIME_WAIT do not count as "in use".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return True
    return False


def check_port_free(port: int, purpose: str) -> None:
    if port_in_use(port):
        raise SandboxError(f"port {port} (for the {purpose}) is already in use on {LOOPBACK}")


def accepts_connections(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.settimeout(1)
        return probe.connect_ex((LOOPBACK, port)) == 0


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def log_tail(log_path: Path, lines: int = 5) -> str:
    try:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in tail)


def remove_tree(path: Path) -> None:
    """Delete a root directory tree without crossing into anything mounted inside it.

    An interrupted mmdebstrap can leave /proc and /sys mounted in its target; a working root
    may be a tmpfs of its own (roots.prepare_working_root), unmounted here too.
    """
    if not path.exists():
        return
    own = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        mount_points = [line.split()[1] for line in mounts]
    for mount_point in sorted(mount_points, key=len, reverse=True):
        if mount_point.startswith(own + "/") or mount_point == own:
            subprocess.run(["umount", "-l", mount_point], check=False)
    run(["rm", "-rf", "--one-file-system", str(path)], f"removing {path}")
