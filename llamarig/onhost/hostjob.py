"""A long command run detached on the host and watched from here: pyinfra shows a command's
output only with -v and only when it ends, so an operation that builds for ten minutes or
downloads 30 GB would be silent. Instead the operation yields a ``JobCommand``: it starts the
script under setsid/nohup with its output in a log file and its exit status in a file (an SSH
connection that drops does not kill it), polls the job through the host's connector every few
seconds, logs a progress line (host name first, at pyinfra's default verbosity) and, when the
job ends, its duration, or the log's tail when it failed."""

from __future__ import annotations

import hashlib
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

from paramiko import SSHException
from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand

from llamarig.onhost.progress import JobPoll, format_duration, parse_poll

POLL_SECONDS = 1.0
PRINT_SECONDS = 3.0
# How long a lost connection may stay lost before the operation gives up (the job goes on).
RECONNECT_SECONDS = 120.0
# Each of the job's own commands is quick; one that hangs is a dead connection.
COMMAND_TIMEOUT_SECONDS = 60
LOG_TAIL_BYTES = 6000
FAILURE_TAIL_LINES = 25

# Whether the process in the pid file $1 runs: a zombie does not (it has ended, and its new
# parent may be slow to reap it, as some container inits are).
ALIVE = """alive() {
  p=$(cat "$1" 2>/dev/null) && [ -n "$p" ] || return 1
  case $p in *[!0-9]*) return 1 ;; esac
  s=$(cat "/proc/$p/stat" 2>/dev/null) || return 1
  s=${s##*) }; [ "${s%% *}" != Z ]
}"""


@dataclass(frozen=True)
class HostJob:
    """A shell script run detached on the host, its files in ``directory`` (``pid``, ``log``,
    ``rc``, ``id``). ``probe`` is a shell command whose one line of output each poll carries to
    the reporter (say, a partial file's size)."""

    directory: str
    script: str
    probe: str = "true"

    @property
    def id(self) -> str:
        return hashlib.sha256(self.script.encode()).hexdigest()[:16]

    def start_command(self) -> str:
        """Starts the job, or attaches to the same job still running from an earlier,
        interrupted run (it holds the operation's lock; a second copy would only wait for it)."""
        job = shlex.quote(self.directory)
        rc = shlex.quote(self.directory + "/rc")
        # The subshell keeps an `exit` in the script from skipping the exit status; the status
        # file also says how long the job ran (`STATUS SECONDS`).
        started = shlex.quote(self.directory + "/started")
        wrapper = (
            f"(\n{self.script}\n)\n"
            f"echo $? $(($(date +%s) - $(cat {started}))) > {rc}.tmp && mv -f {rc}.tmp {rc}"
        )
        return f"""
{ALIVE}
if [ "$(cat {job}/id 2>/dev/null)" = {self.id} ] && [ ! -f {rc} ] && alive {job}/pid; then
  echo attached
else
  rm -rf {job} && mkdir -p {job} && echo {self.id} > {job}/id && date +%s > {job}/started
  setsid nohup sh -c {shlex.quote(wrapper)} > {job}/log 2>&1 < /dev/null &
  echo $! > {job}/pid
  echo started
fi
""".strip()

    def poll_command(self) -> str:
        job = shlex.quote(self.directory)
        # The status file is the job's last act: present, the job is done; absent and the job
        # not alive, it was killed (unless it ended between the two looks: the second one).
        return f"""
{ALIVE}
if [ -f {job}/rc ]; then echo "state done $(cat {job}/rc)"
elif alive {job}/pid; then echo "state running $(($(date +%s) - $(cat {job}/started)))"
elif [ -f {job}/rc ]; then echo "state done $(cat {job}/rc)"
else echo state gone; fi
printf 'probe %s\\n' "$({self.probe} 2>/dev/null | head -n 1)"
echo '--- log'
tail -c {LOG_TAIL_BYTES} {job}/log 2>/dev/null || true
""".strip()

    def cleanup_command(self) -> str:
        return f"rm -rf {shlex.quote(self.directory)}"


class JobCommand(FunctionCommand):
    """Runs a ``HostJob`` to its end: ``report(poll, elapsed)`` reads every poll and returns the
    progress line (logged every PRINT_SECONDS), ``finish(poll, elapsed)`` the closing line. The
    job's commands get the operation's connector arguments (``_sudo``, ``_env``...), like its
    other commands."""

    def __init__(
        self,
        job: HostJob,
        report: Callable[[JobPoll, float], str],
        finish: Callable[[JobPoll, float], str],
        what: str,
    ):
        super().__init__(run_job, (job, report, finish, what), {})

    @property
    def job(self) -> HostJob:
        return self.args[0]

    def execute(self, state, host, connector_arguments):
        return self.function(state, host, connector_arguments, *self.args, **self.kwargs)

    def __repr__(self):
        return f"JobCommand({self.args[3]}, {self.job.directory})"


def _run(host, connector_arguments, command: str) -> tuple[bool, str]:
    arguments = {**connector_arguments, "_timeout": COMMAND_TIMEOUT_SECONDS}
    ok, output = host.run_shell_command(StringCommand(command), **arguments)
    return ok, output.stdout


def _poll(host, connector_arguments, job: HostJob) -> JobPoll:
    """One poll; a dropped connection is reopened (the job goes on meanwhile) for up to
    RECONNECT_SECONDS, then the operation fails."""
    deadline = time.monotonic() + RECONNECT_SECONDS
    while True:
        try:
            ok, stdout = _run(host, connector_arguments, job.poll_command())
            if ok:
                return parse_poll(stdout)
            problem = "the poll command failed"
        except (OSError, EOFError, SSHException) as error:
            problem = f"the connection failed ({error})"
        if time.monotonic() > deadline:
            raise ConnectionError(
                f"{problem}; the job goes on on the host (log: {job.directory}/log), "
                "and the next run waits for it"
            )
        host.log_styled(f"{problem}; reconnecting", fg="yellow", log_func=logger.warning)
        time.sleep(POLL_SECONDS)
        host.disconnect()
        host.connect(show_errors=False)


def run_job(state, host, connector_arguments, job, report, finish, what) -> bool:
    started = time.monotonic()
    ok, stdout = _run(host, connector_arguments, job.start_command())
    if not ok:
        host.log_styled(f"{what}: could not start: {stdout}", fg="red", log_func=logger.error)
        return False
    if stdout.strip() == "attached":
        host.log(f"{what}: attached to the job an earlier run left running ({job.directory})")
    printed = -PRINT_SECONDS  # the first poll's line at once: the job has begun
    # The first poll right away: it sees the job's starting point (a resumed download's size).
    while True:
        try:
            poll = _poll(host, connector_arguments, job)
        except ConnectionError as error:
            host.log_styled(f"{what}: {error}", fg="red", log_func=logger.error)
            return False
        now = time.monotonic()
        # The host's clock counts from the job's start, also for a job this run attached to.
        elapsed = now - started if poll.seconds is None else poll.seconds
        if poll.state == "running":
            line = report(poll, elapsed)
            if now - printed >= PRINT_SECONDS - POLL_SECONDS / 2:
                host.log(f"{what}: {line}")
                printed = now
            time.sleep(POLL_SECONDS)
            continue
        if poll.exit_status == 0:
            host.log_styled(f"{what}: {finish(poll, elapsed)}", fg="green")
            _run(host, connector_arguments, job.cleanup_command())
            return True
        why = "was killed" if poll.state == "gone" else f"failed (exit status {poll.exit_status})"
        host.log_styled(
            f"{what} {why} after {format_duration(elapsed)}; full log: {job.directory}/log",
            fg="red",
            log_func=logger.error,
        )
        for line in poll.log_tail.splitlines()[-FAILURE_TAIL_LINES:]:
            host.log(f"  {line}", log_func=logger.error)
        return False
