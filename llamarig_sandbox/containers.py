"""A working root booted with systemd as PID 1 in a systemd-nspawn container: the command line,
the supervisor that restarts it on a reboot, waiting for the boot over SSH, finding its
processes, and halting it (killing what hangs)."""

import signal
import subprocess
import sys
import time
from pathlib import Path

from llamarig_sandbox.layout import (
    CCACHE_DIR,
    SANDBOX_CCACHE_PATH,
    private_apt_archives,
    sandbox_paths,
)
from llamarig_sandbox.processes import (
    SandboxError,
    live_pid,
    log_tail,
    process_cmdline,
    read_pid,
    say,
    signal_all,
    wait_until,
)
from llamarig_sandbox.sshaccess import SandboxInfo, ssh

# systemd-nspawn exits with 133 when the container asks for a reboot.
NSPAWN_REBOOT_EXIT = 133
BOOT_TIMEOUT_S = 120
SHUTDOWN_TIMEOUT_S = 60


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


def _supervisor_pid(name: str) -> int | None:
    return live_pid(sandbox_paths(name)["pid"], "_supervise", f"--machine={name}")


def is_running(name: str) -> bool:
    """Whether the supervisor of sandbox `name` (and so, normally, the sandbox) is alive."""
    return _supervisor_pid(name) is not None


def up_or_booting(name: str) -> bool:
    """Whether sandbox `name` runs, or its `up` has started its supervisor, which may not have
    exec'd yet (its command line is still its parent's, so is_running cannot tell)."""
    paths = sandbox_paths(name)
    pid = read_pid(paths["pid"])
    return is_running(name) or (
        pid is not None and paths["state"].exists() and Path(f"/proc/{pid}").exists()
    )


def sandbox_pids(name: str) -> list[int]:
    """Live supervisor and systemd-nspawn processes of sandbox `name`."""
    pids = []
    for proc_dir in Path("/proc").glob("[0-9]*"):
        cmdline = process_cmdline(int(proc_dir.name))
        if f"--machine={name}" in cmdline and (
            "_supervise" in cmdline or Path(cmdline[0]).name == "systemd-nspawn"
        ):
            pids.append(int(proc_dir.name))
    return pids


def start_supervisor(name: str, release: str, root: Path) -> subprocess.Popen:
    """Boot sandbox `name` under its supervisor (sandbox.py's `_supervise`, in a session of
    its own), logging to the sandbox's log file; its pid goes to the sandbox's pid file."""
    paths = sandbox_paths(name)
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


def wait_for_boot(info: SandboxInfo, supervisor: subprocess.Popen) -> None:
    """Wait until systemd in the sandbox reports the boot finished, over SSH."""
    log_path = sandbox_paths(info.name)["log"]
    deadline = time.monotonic() + BOOT_TIMEOUT_S
    while time.monotonic() < deadline:
        # Not is_running(): until the supervisor execs, its pid shows this process's argv.
        if supervisor.poll() is not None:
            raise SandboxError(
                f"sandbox {info.name} stopped while booting: {log_tail(log_path, 1)}"
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


def stop_sandbox_processes(name: str) -> None:
    """SIGTERM the supervisor, which halts the container, and wait; kill whatever hangs.

    Without a supervisor (it was killed), a systemd-nspawn left behind is signalled directly.
    """
    if not sandbox_pids(name):
        return
    supervisor = _supervisor_pid(name)
    signal_all([supervisor] if supervisor else sandbox_pids(name), signal.SIGTERM)
    if not wait_until(lambda: not sandbox_pids(name), SHUTDOWN_TIMEOUT_S, interval_s=0.5):
        say(f"{name} did not halt within {SHUTDOWN_TIMEOUT_S} s; killing it")
        signal_all(sandbox_pids(name), signal.SIGKILL)
        wait_until(lambda: not sandbox_pids(name), 10)


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
