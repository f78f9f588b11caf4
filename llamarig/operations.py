"""Custom pyinfra operations. Each reads facts and yields only the commands needed, so a second
run with nothing to do yields nothing (and pyinfra counts it as unchanged)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import time
from io import BytesIO
from pathlib import Path, PurePosixPath
from typing import IO

from pyinfra import host, logger, state
from pyinfra.api import (
    FileUploadCommand,
    FunctionCommand,
    OperationError,
    StringCommand,
    operation,
)
from pyinfra.facts.apt import noninteractive_apt
from pyinfra.facts.files import Directory, File, FileContents, Link
from pyinfra.facts.git import GitLocalCommit
from pyinfra.operations.util.files import generate_color_diff

from llamarig import checksums, deploy_record, model_lock, pace, progress
from llamarig.answers import Answer, verdict
from llamarig.answers import check_command as answer_check_command
from llamarig.answers import parse_output as parse_answer_output
from llamarig.facts import (
    APT_UPDATE_STAMP,
    PROBE_CONNECT_S,
    PROBE_MAX_S,
    AptListsAge,
    BuildDirectories,
    FileState,
    JsonFile,
    MeasuredOverheads,
    MokKeyState,
    PackageVersions,
    RecordedSha256,
    ServerProbe,
    UnitState,
    known,
    parse_slot_counts,
    slot_counts_command,
)
from llamarig.hostjob import HostJob, JobCommand
from llamarig.llama_args import option_name
from llamarig.render import CURL_AUTH

# Where a detached job keeps its pid, log and exit status: beside the file it makes, or in
# the build directory.
JOB_DIRECTORY = ".llamarig-job"


@operation()
def git_commit(repo: str, path: str, commit: str):
    """
    Check out one exact commit of a git repository (cloning or fetching only when needed).

    + repo: URL of the remote (https, git, ssh or file)
    + path: the working tree on the host
    + commit: full 40-hex commit id

    pyinfra's ``git.repo`` has no commit argument and re-checks out a tag on every run; this
    compares HEAD with the commit and does nothing when they match.

    **Example:**

    .. code:: python

        git_commit(
            name="llama.cpp at the pinned commit",
            repo="https://github.com/ggml-org/llama.cpp.git",
            path="/opt/llamarig/src/llama.cpp",
            commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f",
        )
    """
    head = known(GitLocalCommit, repo=path)
    if head == commit:
        host.noop(f"{path} is at {commit[:12]}")
        return
    yield from git_checkout_commands(repo, path, commit)


def git_checkout_commands(repo: str, path: str, commit: str) -> list[str]:
    """The commands of ``git_commit`` that check ``commit`` of ``repo`` out into ``path``."""
    q_path, q_repo, q_commit = shlex.quote(path), shlex.quote(repo), shlex.quote(commit)
    git = f"git -C {q_path}"
    return [
        f"mkdir -p {q_path} && {git} init -q",
        # `--`: a URL that starts with `-` is never read as an option.
        f"{git} remote remove origin 2>/dev/null; {git} remote add -- origin {q_repo}",
        # Fetching one commit by id is cheapest; servers that refuse it get a full fetch.
        f"{git} fetch -q --depth 1 origin {q_commit} || {git} fetch -q --tags origin",
        f"{git} -c advice.detachedHead=false checkout -q --force {q_commit}",
        f"{git} clean -q -ffdx",
    ]


@operation()
def cmake_build(
    source: str,
    build_dir: str,
    configure: list[str],
    build: list[str],
    manifest: dict,
    marker: str,
    ccache_dir: str | None = None,
    ccache_basedir: str | None = None,
):
    """
    Configure and build a CMake project into its own directory, once.

    + source: the source tree
    + build_dir: the build directory (keyed by commit and options, so it is never reused for
      another recipe)
    + configure: the ``cmake -S ... -B ...`` command
    + build: the ``cmake --build ...`` command
    + manifest: JSON-able description of the build, written to ``marker`` on success
    + marker: file whose presence (with the same manifest) means the build is complete
    + ccache_dir: compiler cache directory shared by builds
    + ccache_basedir: paths under it are hashed relative, so builds in sibling directories
      (another commit, other options) hit the cache for unchanged sources

    A build that fails or is interrupted leaves no marker, so the next run builds again and
    cmake resumes from the objects already compiled (after any compiler the interrupted run
    left behind has finished: the build holds a lock on its directory).

    **Example:**

    .. code:: python

        cmake_build(
            source="/opt/llamarig/src/llama.cpp",
            build_dir="/opt/llamarig/builds/0c1e57098bba-1a2b3c4d5e",
            configure=["cmake", "-S", "...", "-B", "...", "-DGGML_CUDA=ON"],
            build=["cmake", "--build", "...", "--target", "llama-server"],
            manifest={"commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"},
            marker="/opt/llamarig/builds/0c1e57098bba-1a2b3c4d5e/.llamarig-build.json",
        )
    """
    if known(JsonFile, path=marker) == manifest:
        host.noop(f"build {build_dir} is complete")
        return
    environment = ""
    if ccache_dir:
        environment = f"CCACHE_DIR={shlex.quote(ccache_dir)} "
        if ccache_basedir:
            environment += f"CCACHE_BASEDIR={shlex.quote(ccache_basedir)} CCACHE_NOHASHDIR=1 "
        yield f"mkdir -p {shlex.quote(ccache_dir)}"
    yield f"mkdir -p {shlex.quote(build_dir)}"
    # A run killed mid-build can leave its compiler running: the lock makes the next run wait
    # for it instead of building into the same directory at the same time.
    lock = f"flock {shlex.quote(build_dir + '/.llamarig-build.lock')} "
    content = shlex.quote(json.dumps(manifest, indent=2, sort_keys=True))
    script = " &&\n".join(
        [
            environment + lock + shlex.join(configure),
            environment + lock + shlex.join(build),
            f"printf '%s\\n' {content} > {shlex.quote(marker)}",
        ]
    )
    # Detached and watched: the build's step counter every few seconds, its duration at the end.
    yield JobCommand(
        HostJob(f"{build_dir}/{JOB_DIRECTORY}", script),
        BuildReport().report,
        BuildReport.finish,
        what="build",
    )


class BuildReport:
    """The progress lines of ``cmake_build``: ninja's ``[N/M]`` (or make's percentage) and the
    time so far; the last step seen stays when a poll's log tail shows none (long warnings)."""

    def __init__(self) -> None:
        self.step: progress.BuildStep | None = None

    def report(self, poll: progress.JobPoll, elapsed: float) -> str:
        self.step = progress.last_build_step(poll.log_tail) or self.step
        return progress.build_line(self.step, elapsed)

    @staticmethod
    def finish(poll: progress.JobPoll, elapsed: float) -> str:
        step = progress.last_build_step(poll.log_tail)
        steps = f" ({step.total} steps)" if step and step.unit == "steps" else ""
        return f"built in {progress.format_duration(elapsed)}{steps}"


@operation()
def fetch_checked(
    url: str,
    dest: str,
    sha256: str,
    header_file: str | None = None,
    records: str = checksums.RECORD_DIRECTORY,
):
    """
    Download a file resumably and move it into place only when its sha256 matches.

    + url: http(s) URL
    + dest: final path on the host
    + sha256: expected digest (lowercase hex)
    + header_file: a root-only file on the host of request headers (an Authorization line),
      sent with ``curl -H @FILE``, so a token is never in an argv; curl drops it on a redirect
      to another host or port (no ``--location-trusted``)
    + records: the root-only directory of checksum records (``llamarig.checksums``)

    The download goes to ``dest.part`` (resumed with HTTP ranges after an interruption). A
    complete download with the wrong digest is deleted and the operation fails; the file at
    ``dest`` is only ever replaced by one that matches. The digest is recorded with the file's
    identity: while the file is unchanged, later runs read the record, not the file. A file
    at ``dest`` with no record is hashed (and kept when it matches); one whose record holds
    another digest is downloaded again without being read (``record_checksum`` before this
    operation records a file's digest without counting as a download).

    **Example:**

    .. code:: python

        fetch_checked(
            url="https://example.org/model.gguf",
            dest="/opt/llamarig/models/model.gguf",
            sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        )
    """
    found = known(RecordedSha256, path=dest, records=records)
    recorded = found["sha256"] if found else None
    if recorded == sha256:
        host.noop(f"{dest} matches its sha256 (recorded, the file unchanged since)")
        return
    if recorded and state.is_executing:
        host.log(
            f"{dest} has sha256 {recorded}, expected {sha256}: downloading it again",
            logger.warning,
        )
    # Detached and watched: bytes, rate and ETA every few seconds, the duration at the end.
    job = HostJob(
        f"{dest}{JOB_DIRECTORY}",
        fetch_command(
            url, dest, sha256, header_file, check_dest=bool(found and not recorded), records=records
        ),
        probe=f"stat -c %s {shlex.quote(dest + '.part')}",
    )
    meter = DownloadReport()
    yield JobCommand(job, meter.report, meter.finish, what="download")


class DownloadReport:
    """The progress lines of ``fetch_checked``: the partial file's size (each poll's probe) of
    the size the server announced (the headers curl writes to the job's log)."""

    def __init__(self) -> None:
        self.rate = progress.RateMeter()
        # (time, size) of the first and the last poll that saw the partial file.
        self.first: tuple[float, int] | None = None
        self.last: tuple[float, int] | None = None
        self.total: int | None = None

    def report(self, poll: progress.JobPoll, elapsed: float) -> str:
        self.total = progress.expected_size(poll.log_tail) or self.total
        if poll.probe.isdigit():
            # This machine's clock: finer than the host's whole seconds.
            self.last = (time.monotonic(), int(poll.probe))
            self.first = self.first or self.last
            self.rate.add(*self.last)
        size = self.last[1] if self.last else 0
        if progress.last_phase(poll.log_tail) == "sha256":
            whole = progress.format_bytes(self.total or size)
            return f"checking the sha256 of {whole}, {progress.format_duration(elapsed)} elapsed"
        return progress.download_line(size, self.total, self.rate.rate(), elapsed)

    def finish(self, poll: progress.JobPoll, elapsed: float) -> str:
        total = progress.expected_size(poll.log_tail) or self.total
        took = progress.format_duration(elapsed)
        if total is None:
            return f"checked in {took} (no download was needed)"
        # The average over what this run saw arrive; all of it when the job ended unseen.
        if self.first and self.last and self.last[0] > self.first[0]:
            rate = (self.last[1] - self.first[1]) / (self.last[0] - self.first[0])
        else:
            rate = total / elapsed if elapsed else None
        return (
            f"downloaded {progress.format_bytes(total)} in {took} "
            f"({progress.format_rate(rate)}), sha256 matches"
        )


def fetch_command(
    url: str,
    dest: str,
    sha256: str,
    header_file: str | None = None,
    check_dest: bool = False,
    records: str = checksums.RECORD_DIRECTORY,
) -> str:
    """The shell command of ``fetch_checked``: a resumable, checksummed download to ``dest``,
    whose digest it records. With ``check_dest``, a file already at ``dest`` is hashed first
    (and recorded) and kept when it matches. It writes the response headers (for the expected
    size) and its phases to its output."""
    part = shlex.quote(dest + ".part")
    q_dest, q_url, q_lock = shlex.quote(dest), shlex.quote(url), shlex.quote(dest + ".lock")
    q_sha256 = shlex.quote(sha256)
    headers = f"-H {shlex.quote('@' + header_file)} " if header_file else ""
    record = checksums.write_record_command(dest, q_sha256, records=records)
    existing = ""
    if check_dest:
        existing = f"""
if [ -f {q_dest} ]; then
  echo '{progress.PHASE_MARK}sha256'
  {checksums.hash_and_record_command(dest, records)} || exit 1
  if [ "$actual" = {q_sha256} ]; then
    printf '%s matches its sha256\\n' {q_dest}; rm -f {q_lock}; exit 0
  fi
  printf '%s has sha256 %s, expected %s: downloading it again\\n' {q_dest} "$actual" {q_sha256}
fi"""
    # Every value is one quoted word, in messages too (printf arguments, never inside "...").
    return f"""
# One download at a time: a run killed mid-download can leave its curl running.
exec 9>{q_lock}; flock 9{existing}
if [ -f {part} ] && [ "$(sha256sum < {part} | cut -d' ' -f1)" = {q_sha256} ]; then
  printf '%s.part is complete\\n' {q_dest}
else
  echo '{progress.PHASE_MARK}download'
  # curl exits 33 when the server cannot resume; then start the part over.
  curl -fsSL --retry 3 {headers}-C - -D - -o {part} -- {q_url} || {{
    rc=$?; [ $rc -eq 33 ] || exit $rc; rm -f {part}
    curl -fsSL --retry 3 {headers}-D - -o {part} -- {q_url} || exit $?; }}
  echo '{progress.PHASE_MARK}sha256'
  actual=$(sha256sum < {part} | cut -d' ' -f1)
  if [ "$actual" != {q_sha256} ]; then
    rm -f {part}
    printf 'sha256 mismatch for %s: got %s, expected %s; the download was discarded\\n' \\
      {q_url} "$actual" {q_sha256} >&2
    exit 1
  fi
fi
# Recorded after the last chmod and rename, which change the file's ctime.
chmod 0644 {part} && mv -f {part} {q_dest} && {record} && rm -f {q_lock}
""".strip()


@operation()
def record_checksum(path: str, rehash: bool = False, records: str = checksums.RECORD_DIRECTORY):
    """
    Hash a file that has no valid checksum record and record its digest, whatever it is;
    never fails on a digest (``check_file`` and ``fetch_checked`` act on the record).

    + path: absolute path; nothing is done when no regular file is there
    + rehash: hash it even when its record is valid (the record is written again)
    + records: the root-only directory of checksum records (``llamarig.checksums``)

    Before ``fetch_checked``, it takes the first hash of a file that is already in place (a
    file from before records existed, or one changed on the host) out of the download: a
    digest that matches then changes no download, so nothing restarts because of it.

    **Example:**

    .. code:: python

        record_checksum(path="/opt/llamarig/models/model.gguf")
    """
    found = known(RecordedSha256, path=path, records=records)
    if found is None:
        host.noop(f"{path} does not exist (yet)")
        return
    if found["sha256"] and not rehash:
        host.noop(f"{path} is unchanged since it was hashed")
        return
    yield (
        f"{checksums.hash_and_record_command(path, records)} && "
        f"printf '%s has sha256 %s\\n' {shlex.quote(path)} \"$actual\""
    )


@operation()
def check_file(
    path: str,
    sha256: str | None = None,
    rehash: bool = False,
    records: str = checksums.RECORD_DIRECTORY,
):
    """
    Require a file already on the host, optionally with a given sha256; never changes it.

    + path: absolute path
    + sha256: expected digest, or None to only require the file
    + rehash: hash the file even when a record says it is unchanged since its last hash
    + records: the root-only directory of checksum records (``llamarig.checksums``)

    The file is hashed when it has no valid record (the first run, or the file changed since):
    that run reports a change, the record written; later runs read the record. A record of
    another digest refuses the file without reading it again.

    **Example:**

    .. code:: python

        check_file(path="/srv/models/qwen.gguf", sha256=None)
    """
    if sha256 is None:
        if host.get_fact(File, path=path):
            host.noop(f"{path} exists")
            return
        yield fail_command(f"model file {path} does not exist on the host")
        return
    found = known(RecordedSha256, path=path, records=records)
    if found is None:
        yield fail_command(f"model file {path} does not exist; expected sha256 {sha256}")
        return
    recorded = None if rehash else found["sha256"]
    if recorded == sha256:
        host.noop(f"{path} matches its sha256 (recorded, the file unchanged since)")
        return
    fix = "replace the file, or set model.sha256 to the file's digest"
    if recorded:
        yield fail_command(
            f"model file {path} has sha256 {recorded} (recorded when it was last hashed, the "
            f"file unchanged since); expected sha256 {sha256}: {fix}"
        )
        return
    q_path, q_sha256 = shlex.quote(path), shlex.quote(sha256)
    yield f"""
{checksums.hash_and_record_command(path, records)} || exit 1
if [ "$actual" != {q_sha256} ]; then
  printf 'llamarig: model file %s has sha256 %s; expected sha256 %s: %s\\n' \\
    {q_path} "$actual" {q_sha256} {shlex.quote(fix)} >&2
  exit 1
fi""".strip()


def fail_command(message: str) -> str:
    return f"echo {shlex.quote('llamarig: ' + message)} >&2; exit 1"


@operation(is_idempotent=False)
def fail(message: str):
    """
    Stop the run on this host with a message (for a check that found the host wrong).

    + message: what is wrong and what to do about it
    """
    yield fail_command(message)


def _serving_check(base_url: str, service: str, timeout: int) -> str:
    """Shell function ``serving``: waits until the unit answers /health with 200 and serves a
    4-token completion; returns 1 (with why in $why) when it crashes, or on timeout."""
    q_service = shlex.quote(service)
    health, completion = shlex.quote(f"{base_url}/health"), shlex.quote(f"{base_url}/completion")
    crashed = shlex.quote(f"{service} exited while starting")
    not_ready = shlex.quote(f"{base_url}/health not ready after {int(timeout)} s")
    failed = shlex.quote(f"{base_url}/completion failed")
    return f"""
serving() {{
  deadline=$(( $(date +%s) + {int(timeout)} ))
  until [ "$(curl -s -o /dev/null -w '%{{http_code}}' -- {health})" = 200 ]; do
    # A crash shows as `failed`, or as `auto-restart` while Restart= tries again.
    state="$(systemctl show -P ActiveState -- {q_service})"
    case "$state/$(systemctl show -P SubState -- {q_service})" in
      failed/*|*/auto-restart) why={crashed}; return 1 ;;
    esac
    if [ $(date +%s) -ge $deadline ]; then
      why={not_ready}; return 1
    fi
    sleep 1
  done
  body='{{"prompt": "Hello", "n_predict": 4, "temperature": 0}}'
  answer=$(curl -sf {CURL_AUTH} -H 'Content-Type: application/json' -d "$body" \\
    -- {completion}) || {{ why={failed}; return 1; }}
  case "$answer" in *'"content"'*) ;; *) why="unexpected completion: $answer"; return 1 ;; esac
}}
"""


@operation()
def record_gpu_overheads(
    directory: str, build: str, split_mode: str, gpu_indices: list[int], buffers_mib: list[int]
):
    """
    Record, once per build and split mode, what nvidia-smi shows on each used GPU beyond the
    plan's buffers (CUDA context, cuBLAS and NCCL workspaces), for the planner's next reserve.

    + directory: where the records live (one file ``BUILD.MODE`` each, read by the
      ``MeasuredOverheads`` fact)
    + build, split_mode: what the record is for
    + gpu_indices: nvidia-smi's index of each used GPU, in the plan's device order
    + buffers_mib: llama.cpp's buffers the plan put on each of them (weights, KV, compute)

    A record is never rewritten, so a later start of the same build (a few MiB apart) leaves the
    plan as it is. Call it after a start that served (guard it with ``_if=``).

    **Example:**

    .. code:: python

        record_gpu_overheads(
            directory="/var/lib/llamarig/gpu-overheads",
            build="0c1e57098bba-1a2b3c4d5e",
            split_mode="tensor",
            gpu_indices=[0, 1],
            buffers_mib=[18167, 18167],
        )
    """
    if (build, split_mode) in known(MeasuredOverheads, path=directory):
        host.noop(f"the GPU overhead of {build} in {split_mode} mode is recorded")
        return
    q_dir = shlex.quote(directory)
    record = shlex.quote(f"{directory}/{build}.{split_mode}")
    indices = shlex.quote(" ".join(str(index) for index in gpu_indices))
    buffers = shlex.quote(" ".join(str(mib) for mib in buffers_mib))
    yield (
        f"[ -e {record} ] || {{ mkdir -p {q_dir} && "
        "used=$(nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits) && "
        f"printf '%s\\n' \"$used\" | awk -F', *' -v indices={indices} -v buffers={buffers} "
        '\'{ used[$1] = $2 } END { n = split(indices, i, " "); split(buffers, b, " "); '
        'for (k = 1; k <= n; k++) printf "%s%d", (k > 1 ? " " : ""), used[i[k]] - b[k]; '
        f'print "" }}\' > {record}.new && mv {record}.new {record}; }}'
    )


@operation(is_idempotent=False)
def serve_or_roll_back(
    base_url: str,
    service: str,
    timeout: int,
    unit: str,
    env_file: str,
    current: str,
    last_good: str,
    answers: list[Answer] | None = None,
    max_slowdown: float | None = None,
    drain_timeout: int = 0,
    model: str = "",
):
    """
    Wait until a (re)started llama-server serves, gives every expected answer and decodes
    about as fast as the last version that served; if it does not, put that version back
    (unit, environment file and `current` link), restart it, confirm it serves, and fail with
    why: the new version's last journal lines, the answer it got wrong, or both speeds.

    + base_url: e.g. ``http://127.0.0.1:8080``
    + service: systemd unit name (journal, restart)
    + timeout: seconds the new version gets to answer /health
    + unit, env_file, current: the unit file, its environment file and the `current` link
    + last_good: directory holding copies of those three from the last version that served;
      refreshed after every successful start
    + answers: the rig's ``expect.answers`` (``llamarig.answers.answers``), asked greedily once
      it serves; judged here, on the control machine, as ``llamarig verify`` judges them
    + max_slowdown: the share by which the decode speed (``llamarig.pace``: the best of 3
      greedy completions, 3 more, then the last version measured again and the new one once
      more before a refusal) may fall below the last good version's before the new one is
      rolled back; None: not measured
    + model: what the speed is of (the model file and its checksum): speeds of another model
      are not compared, since a larger model is meant to be slower
    + drain_timeout: before each switch between the versions measured side by side, the most
      seconds to wait for requests in flight to finish (``drain``)

    Only call it when something was (re)started (guard it with ``_if=``): it always runs.

    **Example:**

    .. code:: python

        serve_or_roll_back(
            base_url="http://127.0.0.1:8080",
            service="llama-server",
            timeout=600,
            unit="/etc/systemd/system/llama-server.service",
            env_file="/etc/llamarig/llama-server.env",
            current="/opt/llamarig/current",
            last_good="/var/lib/llamarig/last-good",
        )
    """
    q_service, q_good, q_url = (shlex.quote(value) for value in (service, last_good, base_url))
    check = _serving_check(base_url, service, timeout)
    roll_back = _roll_back(service, unit, env_file, current, last_good)
    # Values reach messages as printf arguments, never inside double quotes.
    yield (
        check
        + f"""
if ! serving; then
  printf 'llamarig: the new version of %s does not serve: %s. Its last journal lines:\\n' \\
    {q_service} "$why" >&2
  journalctl -u {q_service} -n 30 --no-pager -o cat >&2
{roll_back}
fi
"""
    )
    if answers:
        # pyinfra passes (state, host) to a callback whose parameters have those names, and
        # fails the operation when it returns False.
        def ask(state, host) -> bool:
            started = time.monotonic()
            wrong = wrong_answers(host, base_url, answers)
            if not wrong:
                host.log(
                    f"llamarig: {len(answers)} expected answer(s) right at {base_url} "
                    f"in {time.monotonic() - started:.1f} s"
                )
                return True
            for problem in wrong:
                host.log_styled(f"llamarig: {problem}", fg="red", log_func=logger.error)
            why = shlex.quote("; ".join(wrong))
            _, output = host.run_shell_command(
                StringCommand(
                    check
                    + f"""
printf 'llamarig: the new version of %s answers wrongly: %s\\n' {q_service} {why} >&2
{roll_back}
"""
                )
            )
            for line in output.output_lines:
                host.log(line, log_func=logger.error)
            return False

        yield FunctionCommand(ask, (), {})
    if max_slowdown is not None:
        speed_file = shlex.quote(f"{last_good}/{pace.SPEED_FILE}")
        candidate = f"{last_good}/candidate"

        def measure(host, best: float = 0.0) -> float | None:
            """The best decode speed of RUNS completions, or ``best`` (an earlier look) when
            higher; None, the error logged, when a reply has no timings."""
            replies = []
            for _ in range(pace.RUNS):
                command = StringCommand(pace.decode_command(base_url))
                replies.append(host.run_shell_command(command)[1].stdout)
            try:
                return max(best, pace.decode_speed(replies))
            except ValueError as error:
                host.log_styled(f"llamarig: {error}", fg="red", log_func=logger.error)
                return None

        def logged(host, command: str) -> bool:
            succeeded, output = host.run_shell_command(StringCommand(check + command))
            for line in output.output_lines:
                host.log(line, log_func=logger.info if succeeded else logger.error)
            return succeeded

        def keep_pace(state, host) -> bool:
            _, recorded = host.run_shell_command(StringCommand(f"cat {speed_file} 2>/dev/null"))
            last = pace.recorded_speed(recorded.stdout_lines, model)
            speed = measure(host)
            if speed is not None and pace.slowdown(speed, last, max_slowdown):
                speed = measure(host, speed)  # a second look before a rollback
            if speed is None:
                return False
            against_record = pace.slowdown(speed, last, max_slowdown)
            if against_record:
                # The record may come from a quieter moment of the host: the two versions are
                # measured in turns now, so the verdict rests on speeds measured side by side.
                host.log(
                    f"llamarig: the new version {against_record}; measuring the last version "
                    f"that served again, side by side, in turns with the new one (up to "
                    f"{pace.ROUNDS} looks at each)"
                )
                stash = _keep_version(unit, env_file, current, candidate) + " || exit 1\n"
                if not logged(host, stash):
                    return False
                looks = pace.SideBySide(max_slowdown, new=[speed])
                while not looks.done():
                    for version, speeds in ((last_good, looks.last), (candidate, looks.new)):
                        drain(host, base_url, service, drain_timeout)
                        switch = _switch_to(service, unit, env_file, current, version)
                        if not logged(host, switch + f"\nserving || {{\n{roll_back}\n}}\n"):
                            return False
                        look = measure(host)
                        if look is None:
                            logged(host, roll_back)
                            return False
                        speeds.append(look)
                    host.log(
                        f"llamarig: look {len(looks.last)}: the last version decodes at "
                        f"{looks.last[-1]:.1f} tokens/s, the new one at {looks.new[-1]:.1f}"
                    )
                if looks.refused():
                    host.log_styled(
                        f"llamarig: the new version of {service} {looks.verdict(last)}",
                        fg="red",
                        log_func=logger.error,
                    )
                    logged(host, roll_back)
                    return False
                host.log(f"llamarig: the new version {looks.verdict(last)}")
                speed = max(looks.new)
            host.log(
                f"llamarig: decodes at {speed:.1f} tokens/s"
                + (f" (last good {last:.1f})" if last else "")
            )
            record = f"mkdir -p {q_good} && printf '%.1f\\n%s\\n' {speed} {shlex.quote(model)}"
            host.run_shell_command(StringCommand(f"{record} > {speed_file}.new"))
            return True

        yield FunctionCommand(keep_pace, (), {})
    q_speed = shlex.quote(f"{last_good}/{pace.SPEED_FILE}")
    yield (
        _keep_version(unit, env_file, current, last_good)
        + f" && {{ [ ! -f {q_speed}.new ] || mv {q_speed}.new {q_speed}; }}"
        f" && rm -rf {q_good}/candidate"
        f" && printf 'llamarig: %s serves at %s\\n' {q_service} {q_url}"
    )


def _keep_version(unit: str, env_file: str, current: str, directory: str) -> str:
    """A shell command that copies the unit, environment file and `current` link's target
    into ``directory`` (files ``unit``, ``env``, ``current``), each replaced whole; what
    ``_switch_to`` puts back."""
    q_unit, q_env, q_current, q_dir = (
        shlex.quote(value) for value in (unit, env_file, current, directory)
    )
    return (
        f"mkdir -p {q_dir}"
        f" && cp {q_unit} {q_dir}/unit.new && cp {q_env} {q_dir}/env.new"
        f" && readlink {q_current} > {q_dir}/current.new"
        f" && for f in unit env current; do mv {q_dir}/$f.new {q_dir}/$f; done"
    )


def _switch_to(service: str, unit: str, env_file: str, current: str, source: str) -> str:
    """Shell lines that install the unit, environment file and `current` link kept in
    ``source`` (files ``unit``, ``env``, ``current``) and restart the service."""
    q_service, q_unit, q_env, q_current, q_source = (
        shlex.quote(value) for value in (service, unit, env_file, current, source)
    )
    return f"""
cp {q_source}/unit {q_unit} && cp {q_source}/env {q_env} \\
  && ln -sfn "$(cat {q_source}/current)" {q_current}.new && mv -T {q_current}.new {q_current}
systemctl daemon-reload
systemctl reset-failed -- {q_service} 2>/dev/null || true
systemctl restart -- {q_service}
""".strip("\n")


def _roll_back(service: str, unit: str, env_file: str, current: str, last_good: str) -> str:
    """Shell lines (after a ``serving`` function) that put the last version that served back,
    restart it, say whether it serves and exit 1 (the run fails)."""
    q_good = shlex.quote(last_good)
    return f"""
if [ ! -f {q_good}/current ]; then
  echo "llamarig: no earlier version served on this host: nothing to roll back to" >&2
  exit 1
fi
started=$(date +%s)
{_switch_to(service, unit, env_file, current, last_good)}
date -u +%Y-%m-%dT%H:%M:%SZ > {shlex.quote(deploy_record.ROLLED_BACK_PATH)} || true
if serving; then
  echo "llamarig: rolled back: the last version that served ($(cat {q_good}/current)) serves" \\
    "again after $(( $(date +%s) - started )) s; fix the rig data and deploy again" >&2
else
  printf 'llamarig: the rollback does not serve either: %s\\n' "$why" >&2
  exit 1
fi
exit 1
""".strip("\n")


def wrong_answers(host, base_url: str, answers: list[Answer]) -> list[str]:
    """Ask each answer's question on the host; what each wrong one got (none: all right)."""
    wrong = []
    for answer in answers:
        _, output = host.run_shell_command(StringCommand(answer_check_command(base_url, answer)))
        status, body = parse_answer_output(output.stdout)
        problem = verdict(answer, status, body)
        if problem:
            wrong.append(problem)
    return wrong


@operation()
def prune_builds(builds: str, keep: int, current: str, last_good: str | None = None):
    """
    Keep the newest ``keep`` build directories: this run's build, the last one that served,
    then the newest others; delete the rest.

    + builds: the directory holding one directory per build
    + keep: how many builds to keep (at least 1)
    + current: this run's build (kept, and counted as the newest even before it exists)
    + last_good: the build of the last version that served (kept for a rollback)

    **Example:**

    .. code:: python

        prune_builds(
            builds="/opt/llamarig/builds",
            keep=2,
            current="/opt/llamarig/builds/0c1e57098bba-1a2b3c4d5e",
            last_good="/opt/llamarig/builds/9f8e7d6c5b4a-0a1b2c3d4e",
        )
    """
    present = known(BuildDirectories, path=builds)
    kept = [PurePosixPath(current).name]
    rollback_target = PurePosixPath(last_good).name if last_good else None
    if rollback_target in present and rollback_target not in kept:
        kept.append(rollback_target)
    for name in present:  # newest first
        if len(kept) >= keep:
            break
        if name not in kept:
            kept.append(name)
    for name in present:
        if name not in kept:
            yield f"rm -rf {shlex.quote(f'{builds}/{name}')}"


def tcp_probe(endpoint: str) -> str:
    """A shell test that succeeds when ``endpoint`` (host:port, [v6]:port) accepts TCP."""
    address, _, port = endpoint.rpartition(":")
    if len(address) > 1 and address[0] == "[" and address[-1] == "]":
        address = address[1:-1]  # one pair: [v6]
    # Address and port reach bash as its arguments, never as part of its script.
    script = shlex.quote('exec 3<>"/dev/tcp/$1/$2"')
    return (
        f"timeout 3 bash -c {script} tcp-probe {shlex.quote(address)} {shlex.quote(port)} "
        "2>/dev/null"
    )


@operation(is_idempotent=False)
def wait_for_port(endpoint: str, service: str, timeout: int):
    """
    Wait until a (re)started service accepts TCP connections on ``endpoint``; else fail with its
    last journal lines and the sockets that hold its port. Servers that set SO_REUSEADDR
    (ggml-rpc-server, llama-server) still cannot bind a port an outgoing connection holds, even
    in TIME-WAIT, and a port in the kernel's ephemeral range is handed to those: the failure
    says so and names the fix.

    + endpoint: ``host:port`` the service listens on
    + service: systemd unit name (journal)
    + timeout: seconds to wait

    **Example:**

    .. code:: python

        wait_for_port(endpoint="10.0.0.12:50052", service="ggml-rpc-server", timeout=60)
    """
    quoted, q_endpoint = shlex.quote(service), shlex.quote(endpoint)
    port = shlex.quote(endpoint.rpartition(":")[2])
    yield f"""
deadline=$(( $(date +%s) + {int(timeout)} ))
until {tcp_probe(endpoint)}; do
  # A crash loop (auto-restart) or an exit (ggml-rpc-server exits 0 when it cannot bind) ends
  # the wait early.
  state=$(systemctl show --value -p ActiveState -p SubState -- {quoted} | tr '\\n' ' ')
  stopped=""
  case "$state" in *auto-restart*|*inactive*|*failed*) stopped=${{state% }} ;; esac
  if [ -n "$stopped" ] || [ $(date +%s) -ge $deadline ]; then
    if [ -n "$stopped" ]; then
      printf 'llamarig: %s stopped (%s) without accepting connections on %s; its journal:\\n' \\
        {quoted} "$stopped" {q_endpoint} >&2
    else
      printf 'llamarig: %s does not accept connections on %s after %s s; its journal:\\n' \\
        {quoted} {q_endpoint} {int(timeout)} >&2
    fi
    journalctl -u {quoted} -n 20 --no-pager -o cat >&2
    held=$(ss -Htanp "( sport = :"{port}" )" 2>/dev/null)
    if [ -n "$held" ]; then
      printf 'llamarig: sockets on port %s now (one bound elsewhere, or an outgoing' {port} >&2
      printf " connection's, even in TIME-WAIT, stops the bind):\\n%s\\n" "$held" >&2
      read -r low high < /proc/sys/net/ipv4/ip_local_port_range
      if [ {port} -ge "$low" ] && [ {port} -le "$high" ]; then
        printf 'llamarig: port %s lies in the kernel ephemeral range %s-%s, which outgoing' \\
          {port} "$low" "$high" >&2
        printf ' connections take: choose a port below %s, or reserve it' "$low" >&2
        printf ' (sysctl net.ipv4.ip_local_reserved_ports)\\n' >&2
      fi
    fi
    exit 1
  fi
  sleep 1
done
printf 'llamarig: %s listens on %s\\n' {quoted} {q_endpoint}
""".strip()


@operation(is_idempotent=False)
def check_rpc_workers(endpoints: list[str]):
    """
    Fail unless every RPC worker accepts connections from this host: a head restarted without
    its workers cannot load the model, so the run stops before the restart.

    + endpoints: the workers' ``host:port``

    **Example:**

    .. code:: python

        check_rpc_workers(endpoints=["10.0.0.12:50052", "10.0.0.13:50052"])
    """
    checks = "\n".join(
        f'{tcp_probe(endpoint)} || down="$down "{shlex.quote(endpoint)}' for endpoint in endpoints
    )
    yield f"""
down=""
{checks}
if [ -n "$down" ]; then
  echo "llamarig: RPC worker(s) not reachable from this head:$down - converge the workers" \\
    "(their ggml-rpc-server unit) and check the network; the running server was left as it is" >&2
  exit 1
fi
""".strip()


def server_flags(args: list[str]) -> list[str]:
    """The option names in a llama-server command line, as llama.cpp looks them up (``--top_k``
    is ``--top-k``; values such as ``-1`` excluded)."""
    return sorted({option_name(arg) for arg in args[1:] if re.match(r"^--?[A-Za-z]", arg)})


@operation(is_idempotent=False)
def check_server_flags(binary: str, args: list[str]):
    """
    Fail unless the built llama-server knows every option of ``args`` (from its ``--help``).

    + binary: the llama-server of the build about to be used
    + args: the command line the unit will run

    Runs before the `current` link and the unit change, so a flag the binary does not know
    stops the run while the old server keeps serving. Guard it to run only when the build or
    the command line changes.

    **Example:**

    .. code:: python

        check_server_flags(
            binary="/opt/llamarig/builds/0c1e57098bba-1a2b3c4d5e/bin/llama-server",
            args=["llama-server", "-m", "/opt/llamarig/models/m.gguf", "-lm", "none"],
        )
    """
    flags = " ".join(shlex.quote(flag) for flag in server_flags(args))
    q_binary = shlex.quote(binary)
    yield f"""
help=$({q_binary} --help 2>&1) || {{ printf 'llamarig: %s --help failed:\\n' {q_binary} >&2; \\
printf '%s\\n' "$help" | tail -5 >&2; exit 1; }}
unknown=""
for flag in {flags}; do
  printf '%s\\n' "$help" | grep -qE -- "(^|[ ,])$flag([ ,=]|$)" || unknown="$unknown $flag"
done
if [ -n "$unknown" ]; then
  printf 'llamarig: %s does not know:%s - fix server.extra_args (or the setting that adds' \\
    {q_binary} "$unknown" >&2
  echo " it); the unit and the running server were left unchanged" >&2
  exit 1
fi
""".strip()


@operation(is_idempotent=False)
def record_headers(lock: str, read: list, superseded: list):
    """
    Record GGUF headers in ``lock`` (models.lock.yml, on this machine, beside the inventory):
    what the plan read from the model's files, so that a plan made where the model cannot be
    read is this one. Nothing when there is nothing new.

    + lock: the lock file's path on this machine
    + read: ``(key, header)`` pairs (``model_lock.header_key``, ``GgufHeader``)
    + superseded: keys of declared records the files' own headers replace

    **Example:**

    .. code:: python

        record_headers(lock="inventory/models.lock.yml", read=gathered.read, superseded=[])
    """
    if not read:
        return

    def record(state, host) -> bool:
        for key, header in read:
            if model_lock.record_header(Path(lock), key, header, superseded):
                host.log(
                    f"llamarig: recorded the GGUF header of {next(iter(key.values()))} in {lock}"
                )
        return True

    yield FunctionCommand(record, (), {})


# How often a drain polls the slots, and how often it says what it waits for.
DRAIN_POLL_S = 1
DRAIN_REPORT_S = 10


def drain(
    host, base_url: str, service: str, timeout: int, server_host=None, restarting: str = "it"
) -> None:
    """Wait until no slot of the llama-server at ``base_url`` processes a request, at most
    ``timeout`` seconds, saying what it waits for; llama-server has no graceful stop (SIGTERM
    ends the requests in flight), so this is the drain. Returns at once when ``timeout`` is 0
    (server.drain_timeout: do not wait), when nothing is busy or when /slots does not answer (a
    server that is down or hung has nothing to finish). ``server_host``: the host the server
    runs on, where /slots is asked (default ``host``); ``restarting``: what restarts after."""
    if timeout <= 0:
        return
    server_host = server_host or host
    started = time.monotonic()
    reported = None
    while True:
        _, output = server_host.run_shell_command(StringCommand(slot_counts_command(base_url)))
        lines = output.stdout_lines
        total, busy = parse_slot_counts(lines[-1] if lines else "")
        waited = time.monotonic() - started
        if busy == 0:
            if reported is not None:
                host.log(
                    f"llamarig: the requests in flight on {service} finished after "
                    f"{waited:.0f} s: restarting {restarting}"
                )
            return
        if waited >= timeout:
            host.log_styled(
                f"llamarig: {busy} of {total} slots of {service} still busy after {timeout} s "
                f"(server.drain_timeout): restarting {restarting} anyway, cutting {busy} "
                "request(s)",
                fg="yellow",
                log_func=logger.warning,
            )
            return
        if reported is None or waited - reported >= DRAIN_REPORT_S:
            host.log(
                f"llamarig: waiting for {busy} of {total} slots of {service} to finish their "
                f"requests before restarting {restarting} ({timeout - waited:.0f} s left of "
                "server.drain_timeout)"
            )
            reported = waited
        time.sleep(DRAIN_POLL_S)


def connected_host(state, name: str, reason: str):
    """The inventory host ``name``, connected over its own connection (also when this run's
    --limit leaves it out), or None when it cannot be reached."""
    other = state.inventory.get_host(name)
    other.connect(reason=reason, show_errors=False)
    return other if other.connected else None


@operation(is_idempotent=False)
def restart_service(
    service: str,
    drain_url: str | None = None,
    drain_timeout: int = 0,
    drain_host: str | None = None,
    drain_service: str | None = None,
):
    """
    Restart a systemd service on purpose: its start rate limit (meant for crash loops) is
    reset first, so a run of deliberate deploys is never refused with "start request repeated
    too quickly". Guard it with ``_if=``: it always restarts.

    + service: unit name, e.g. ``llama-server.service``
    + drain_url, drain_timeout: a llama-server's base URL and the most seconds to wait for
      its requests in flight to finish before the restart (``drain``); none: no wait
    + drain_host, drain_service: the inventory host that llama-server runs on and its unit,
      when it is not this host's ``service`` (an RPC worker drains its head's server, whose
      requests end when the worker goes away); reached over its own connection

    **Example:**

    .. code:: python

        restart_service(
            service="llama-server.service",
            drain_url="http://127.0.0.1:8080",
            drain_timeout=120,
        )
    """
    if drain_url:

        def drained(state, host) -> bool:
            if not drain_host:
                drain(host, drain_url, service, drain_timeout)
                return True
            server_host = connected_host(
                state, drain_host, f"to drain it before {service} restarts"
            )
            if not server_host:
                host.log_styled(
                    f"llamarig: {drain_host} is not reachable, so its requests in flight on "
                    f"{drain_service} were not waited for: restarting {service}",
                    fg="yellow",
                    log_func=logger.warning,
                )
                return True
            label = f"{drain_service} on {drain_host}"
            drain(host, drain_url, label, drain_timeout, server_host, restarting=service)
            return True

        yield FunctionCommand(drained, (), {})
    yield restart_command(service)


def restart_command(service: str) -> str:
    """Restart ``service`` on purpose: its start rate limit (meant for crash loops) reset first."""
    quoted = shlex.quote(service)
    return f"systemctl reset-failed -- {quoted} 2>/dev/null || true; systemctl restart -- {quoted}"


@operation(is_idempotent=False)
def restart_rpc_head(head: str, service: str, base_url: str, timeout: int, worker: str):
    """
    Restart the head whose RPC worker restarted, over the head's own connection, and wait until
    it serves: the head's llama-server holds its model buffers on the worker, which a restart
    empties, so its next request would abort it (ggml-rpc: "Remote RPC server crashed or
    returned malformed response") and systemd would restart it under the users' requests. A
    head that is not running (stopped, or not deployed yet) is left as it is. Run it after the
    worker's restart, whose drain already waited for the head's requests in flight.

    + head: the inventory host the head runs on
    + service: its llama-server unit, e.g. ``llama-server.service``
    + base_url: where the head reaches its own server, e.g. ``http://127.0.0.1:8080``
    + timeout: seconds the head gets to serve again (its ``server.start_timeout``)
    + worker: what restarted, for the messages, e.g. ``ggml-rpc-server.service``

    **Example:**

    .. code:: python

        restart_rpc_head(
            head="gpu-head",
            service="llama-server.service",
            base_url="http://127.0.0.1:8080",
            timeout=600,
            worker="ggml-rpc-server.service",
        )
    """
    label = f"{service} on {head}"
    quoted = shlex.quote(service)
    not_running = shlex.quote(f"llamarig: {label} is not running: left as it is")
    serves = shlex.quote(f"llamarig: {label}, restarted after {worker}, serves again")
    broken = shlex.quote(f"llamarig: {label}, restarted after {worker}, does not serve: ")
    script = (
        _serving_check(base_url, service, timeout)
        + f"""
if [ "$(systemctl show -P ActiveState -- {quoted})" = inactive ]; then
  echo {not_running}; exit 0
fi
{restart_command(service)}
if serving; then echo {serves}; exit 0; fi
echo {broken}"$why; its journal:"
journalctl -u {quoted} -n 20 --no-pager -o cat
exit 1
"""
    )

    def restarted(state, host) -> bool:
        server_host = connected_host(state, head, f"to restart it after {worker}")
        if not server_host:
            host.log_styled(
                f"llamarig: {head} is not reachable, so {service} there was not restarted after "
                f"{worker}: its next request would abort it; converge {head} or run "
                f"`systemctl restart {service}` there",
                fg="red",
                log_func=logger.error,
            )
            return False
        succeeded, output = server_host.run_shell_command(StringCommand(script))
        for line in output.output_lines:
            host.log(line, log_func=logger.info if succeeded else logger.error)
        return succeeded

    yield FunctionCommand(restarted, (), {})


@operation()
def driver_packages(packages: list[str], dkms_package: str | None = None):
    """
    Install NVIDIA driver packages with apt; when the DKMS module does not build, say why in one
    message and leave apt and dpkg consistent (the half-configured driver packages are purged).

    + packages: the driver packages (with the kernel headers)
    + dkms_package: the package whose DKMS build can fail, e.g. ``nvidia-open-kernel-dkms``

    **Example:**

    .. code:: python

        driver_packages(
            packages=["nvidia-open-kernel-dkms", "nvidia-driver", "linux-headers-amd64"],
            dkms_package="nvidia-open-kernel-dkms",
        )
    """
    installed = known(PackageVersions, packages=sorted(packages))
    missing = [package for package in packages if installed.get(package) is None]
    if not missing:
        host.noop(f"{', '.join(packages)} installed")
        return
    names = " ".join(shlex.quote(package) for package in packages)
    dkms = shlex.quote(dkms_package or "")
    dkms_name = shlex.quote(dkms_package or "the driver")
    yield f"""
export DEBIAN_FRONTEND=noninteractive
log=/var/log/llamarig-driver-install.log
if ! apt-get install -y --no-install-recommends {names} > $log 2>&1; then
  make_log=$(ls -t /var/lib/dkms/*/*/build/make.log 2>/dev/null | head -1)
  kernels=$(ls -d /lib/modules/*/build 2>/dev/null | cut -d/ -f4 | paste -sd' ')
  error=$(grep -m1 -E 'error:' "$make_log" 2>/dev/null || grep -m1 -iE 'error' $log)
  version=$(dpkg-query -W -f='${{Version}}' {dkms} 2>/dev/null)
  # Remove what could not be configured, so apt and dpkg stay usable.
  apt-get purge -y {names} >> $log 2>&1 || true
  dpkg --configure -a >> $log 2>&1; apt-get -f install -y >> $log 2>&1
  printf 'llamarig: the NVIDIA driver did not install: %s ' {dkms_name} >&2
  echo "$version" \
    "failed to build its kernel module for kernel(s) $kernels: $error." \
    "The driver packages were removed again (apt and dpkg are consistent; full log: $log)." \
    "Use driver.source nvidia-repo, or a kernel this packaged driver supports." >&2
  exit 1
fi
""".strip()


def _boot_id(target) -> str | None:
    ok, output = target.run_shell_command(StringCommand("cat /proc/sys/kernel/random/boot_id"))
    return output.stdout.strip() if ok else None


@operation(is_idempotent=False)
def reboot(reboot_timeout: int = 600, interval: int = 2):
    """
    Reboot the host and wait until it is back with a new boot id, then reconnect.

    + reboot_timeout: seconds to wait for the host to come back
    + interval: seconds between reconnection attempts

    pyinfra's ``server.reboot`` confirms the reboot by a lower uptime, which a container (such
    as the sandbox rig in systemd-nspawn) never shows: its /proc/uptime is the host kernel's.
    The boot id changes on every boot, of a machine and of a container alike. Guard with
    ``_if=``: it always reboots.
    """
    before: list[str | None] = []

    # pyinfra passes state and host only to functions whose parameters have these names.
    def remember_boot(state, host):
        before.append(_boot_id(host))

    yield FunctionCommand(remember_boot, (), {})
    # Detached, so the SSH channel closes before the machine goes down.
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")

    def wait_for_new_boot(state, host):
        deadline = time.monotonic() + reboot_timeout
        time.sleep(interval + 1)
        host.disconnect()
        while time.monotonic() < deadline:
            host.connect(show_errors=False)
            if host.connected:
                current = _boot_id(host)
                if current and current != before[0]:
                    return
                host.disconnect()
            time.sleep(interval)
        raise OperationError(f"{host.name} did not come back within {reboot_timeout} s")

    yield FunctionCommand(wait_for_new_boot, (), {})


# The complete copy sits beside its file (a rename is atomic only within one filesystem) under
# a suffix that systemd, modprobe, apt and the shell ignore.
ATOMIC_SUFFIX = ".llamarig-new"


def rename_into_place(dest: str, mode: str) -> str:
    """A shell command that gives the complete copy beside ``dest`` (``dest`` + ATOMIC_SUFFIX)
    its mode and renames it over ``dest``."""
    copy, quoted = shlex.quote(dest + ATOMIC_SUFFIX), shlex.quote(dest)
    # sync: the rename must not reach the disk before the content does.
    return f"chmod {mode} {copy} && sync {copy} && mv -f {copy} {quoted}"


@operation()
def atomic_file(src: IO[str], dest: str, mode: str = "644"):
    """
    Write a file on the host only when its content or mode differ, by renaming a complete copy
    over it: a run cut short leaves the old file or the new one, never part of one.

    + src: the wanted content (a file-like object, e.g. a rendered template)
    + dest: path on the host; its directory is created when missing
    + mode: octal permissions

    ``files.put`` writes over SFTP into the file itself: a deploy killed mid-write left an
    empty systemd unit behind, which would have kept llama-server down after a reboot. Like
    ``files.put``, ``--diff`` shows what changes.

    **Example:**

    .. code:: python

        atomic_file(src=StringIO(unit_text), dest="/etc/systemd/system/llama-server.service")
    """
    # pyinfra runs an operation's body more than once (to plan, then to execute).
    src.seek(0)
    content = src.read().encode()
    remote = known(FileState, path=dest)
    same_content = bool(remote) and remote["sha256"] == hashlib.sha256(content).hexdigest()
    if same_content:
        if remote["mode"] != int(mode):
            yield f"chmod {mode} {shlex.quote(dest)}"
        else:
            host.noop(f"{dest} is up to date")
        return
    if state.config.DIFF:
        current = host.get_fact(FileContents, path=dest) if remote else None
        host.log(f"Will {'modify' if remote else 'create'} {dest}", logger.info)
        for line in generate_color_diff(
            [line + "\n" for line in current or []], content.decode().splitlines(keepends=True)
        ):
            logger.info("  %s", line)
    if not remote:
        yield f"mkdir -p {shlex.quote(str(PurePosixPath(dest).parent))}"
    yield FileUploadCommand(BytesIO(content), dest + ATOMIC_SUFFIX)
    yield rename_into_place(dest, mode)


@operation()
def secret_file(src: str | IO[bytes], dest: str):
    """
    Copy a secret (an API key, a token's header) to a root-only file on the host, only when
    it differs.

    + src: local file with the secret, or a binary stream holding it
    + dest: file on the host, created 0600 before anything is written to it

    Unlike ``files.put`` this never shows the content (pyinfra's ``--diff`` prints what
    ``files.put`` writes) and never leaves a readable copy; like ``atomic_file`` it renames a
    complete copy over the old key.

    **Example:**

    .. code:: python

        secret_file(src="~/.config/llamarig/rig1.key", dest="/etc/llamarig/api-key")
    """
    if hasattr(src, "read"):
        # From the start: pyinfra may run an operation's generator more than once.
        src.seek(0)
        secret = src.read()
    else:
        with open(src, "rb") as handle:
            secret = handle.read()
    if (known(FileState, path=dest) or {}).get("sha256") == hashlib.sha256(secret).hexdigest():
        host.noop(f"{dest} is up to date")
        return
    quoted, temporary = shlex.quote(dest), shlex.quote(dest + ATOMIC_SUFFIX)
    # The copy is root-only before a byte is written to it, then renamed over the key.
    yield f"mkdir -p $(dirname {quoted}) && umask 077 && : > {temporary} && chmod 600 {temporary}"
    yield FileUploadCommand(BytesIO(secret), dest + ATOMIC_SUFFIX)
    yield f"chown root:root {temporary} && {rename_into_place(dest, '600')}"


@operation()
def curl_auth_header(key_file: str, dest: str, rewrite: bool = False):
    """
    Write a root-only curl header file (``Authorization: Bearer <key>``) from the API key on the
    host, for the deploy's own checks (``curl -H @dest``).

    + key_file: the key file on the host (its first line is the key)
    + dest: the header file, 0600
    + rewrite: write it even when it exists (the key changes in this run)

    The key never appears in a process's arguments (printf is a shell builtin), and the file is
    renamed into place: a truncated header would survive every later run.
    """
    if not rewrite and known(File, path=dest):
        host.noop(f"{dest} exists")
        return
    yield (
        f"umask 077; printf 'Authorization: Bearer %s\\n' "
        f'"$(head -n1 {shlex.quote(key_file)})" > {shlex.quote(dest + ATOMIC_SUFFIX)} '
        f"&& {rename_into_place(dest, '600')}"
    )


@operation()
def barrier():
    """
    Change nothing. Hosts that call it from one line of the deploy share it as one operation,
    and pyinfra runs each host's operations in order: so every operation they call before it
    runs, on every host, before any they call after it.
    """
    host.noop("every host before this point is done")
    yield from ()


@operation()
def machine_owner_key(key: str, certificate: str, common_name: str):
    """
    Generate a Machine Owner Key pair on the host for DKMS's module signing: the private key
    readable by root alone (created under umask 077, never leaving the host), the certificate
    in DER form as ``mokutil --import`` wants it. An existing pair is kept (its certificate may
    be enrolled already); a key others can read is made root's alone.

    + key: the private key's path, e.g. ``/var/lib/dkms/mok.key``
    + certificate: the certificate's path, e.g. ``/var/lib/dkms/mok.pub``
    + common_name: the certificate's CN, which ``modinfo -F signer`` shows for a signed module
    """
    existing = host.get_fact(MokKeyState, key=key, certificate=certificate)
    quoted_key, quoted_certificate = shlex.quote(key), shlex.quote(certificate)
    if existing["key_exists"] and existing["certificate_exists"]:
        if existing["key_mode"] != "600":
            yield f"chown root:root {quoted_key} && chmod 600 {quoted_key}"
        else:
            host.noop(f"Machine Owner Key {key} exists")
        return
    subject = shlex.quote(f"/CN={common_name}/")
    yield (
        f"mkdir -p {shlex.quote(str(PurePosixPath(key).parent))} && (umask 077 && "
        "openssl req -new -x509 -nodes -days 36500 -newkey rsa:2048 -sha256 "
        f"-subj {subject} -keyout {quoted_key} -outform DER -out {quoted_certificate}) "
        f"&& chmod 644 {quoted_certificate}"
    )


@operation()
def apt_packages(packages: list[str], no_recommends: bool = False):
    """
    Install the packages of ``packages`` that are missing, with apt-get as pyinfra's
    ``apt.packages`` runs it (non-interactive, keeping changed configuration files); reads only
    these packages' state (``dpkg-query``), never a listing of every installed package.

    + packages: names, or ``name=version`` to pin a version
    + no_recommends: don't install recommended packages

    **Example:**

    .. code:: python

        apt_packages(packages=["cmake", "ninja-build"], no_recommends=True)
    """
    wanted = [package.partition("=") for package in packages]
    installed = known(PackageVersions, packages=sorted({name for name, _, _ in wanted}))
    missing = [
        package
        for package, (name, pinned, version) in zip(packages, wanted, strict=True)
        if installed.get(name) is None or (pinned and installed[name] != version)
    ]
    if not missing:
        host.noop(f"{', '.join(packages)} installed")
        return
    install = "install --no-install-recommends" if no_recommends else "install"
    yield f"{noninteractive_apt(install)} {' '.join(shlex.quote(p) for p in missing)}"


@operation()
def unit_running(unit: str, enabled: bool = True):
    """
    Start a systemd unit that is not running and enable it at boot, as pyinfra's
    ``systemd.service(running=True, enabled=True)``; reads only this unit's state.

    + unit: the unit name, e.g. ``llama-server.service``
    + enabled: enable it at boot too

    **Example:**

    .. code:: python

        unit_running(unit="llama-server.service")
    """
    current = known(UnitState, unit=unit)
    quoted = shlex.quote(unit)
    if current["active"]:
        host.noop(f"{unit} is running")
    else:
        yield f"systemctl start -- {quoted}"
    if enabled and not current["enabled"]:
        yield f"systemctl enable -- {quoted}"


@operation(is_idempotent=False)
def check_unit_active(unit: str, what: str):
    """
    Fail unless a systemd unit is active; changes nothing.

    + unit: the unit name, e.g. ``ggml-rpc-server.service``
    + what: how the success note names it, e.g. ``on 10.0.0.12:50052``

    **Example:**

    .. code:: python

        check_unit_active(unit="ggml-rpc-server.service", what="on 10.0.0.12:50052")
    """
    if known(UnitState, unit=unit)["active"]:
        host.noop(f"{unit} active {what}")
        return
    yield fail_command(f"{unit} is not active (systemctl status {unit})")


@operation(is_idempotent=False)
def check_serving(unit: str, base_url: str):
    """
    Fail unless the unit is active, ``/health`` answers 200 and a 4-token completion succeeds
    (the ``ServerProbe`` fact, from the host itself, every request bounded; with every slot
    busy the completion is not sent and the check passes); changes nothing. Guard it with ``_if=``
    to skip it after a (re)start whose wait checked the same.

    + unit: the server's unit, e.g. ``llama-server.service``
    + base_url: e.g. ``http://127.0.0.1:8080``

    **Example:**

    .. code:: python

        check_serving(unit="llama-server.service", base_url="http://127.0.0.1:8080")
    """
    active = known(UnitState, unit=unit)["active"]
    probe = host.get_fact(ServerProbe, base_url=base_url)
    problems = []
    if not active:
        problems.append(f"{unit} is not active (systemctl status {unit})")
    if probe["health"] == 0:
        problems.append(
            f"{base_url}/health gave no answer within {PROBE_MAX_S} s (connect "
            f"{PROBE_CONNECT_S} s): the server is hung or not listening"
        )
    elif probe["health"] != 200:
        problems.append(f"{base_url}/health answered {probe['health']}, not 200")
    elif probe["completion_ok"] is False:
        problems.append(f"a 4-token {base_url}/completion did not succeed within {PROBE_MAX_S} s")
    if problems:
        yield fail_command("; ".join(problems))
        return
    if probe["completion_ok"] is None:
        host.noop(
            f"{unit} active, /health 200, serving: {probe['busy']} of {probe['slots']} slots "
            "busy (no probe completion sent, it would wait behind them)"
        )
        return
    speed = probe["tokens_per_second"]
    host.noop(
        f"{unit} active, /health 200, completion at "
        + (f"{speed:.1f} tokens/s" if speed is not None else "an unreported speed")
    )


@operation()
def apt_lists_fresh(max_age: int = 3600):
    """
    ``apt-get update`` when the lists are older than ``max_age`` seconds (or were never
    updated through the stamp), as pyinfra's ``apt.update(cache_time=max_age)`` does, from one
    fact rather than two.

    + max_age: seconds the lists stay fresh

    **Example:**

    .. code:: python

        apt_lists_fresh(max_age=3600)
    """
    age = known(AptListsAge)
    if age is not None and age < max_age:
        host.noop("apt is already up to date")
        return
    yield "apt-get update"
    yield f"touch {APT_UPDATE_STAMP}"


@operation()
def symlink(path: str, target: str):
    """
    Point a symbolic link at ``target``, replacing a link that points elsewhere by renaming a
    new one over it (never a moment without the link); its directory is created when missing.

    + path: the link
    + target: what it points at

    **Example:**

    .. code:: python

        symlink(path="/opt/llamarig/current", target="/opt/llamarig/builds/0c1e57098bba-1a2b")
    """
    link = known(Link, path=path)
    if link is False:
        yield fail_command(f"{path} exists and is not a symbolic link")
        return
    if link and link["link_target"] == target:
        host.noop(f"{path} points at {target}")
        return
    new = shlex.quote(path + ATOMIC_SUFFIX)
    parent = shlex.quote(str(PurePosixPath(path).parent))
    yield (
        f"mkdir -p {parent} && ln -sfn {shlex.quote(target)} {new} && "
        f"mv -T {new} {shlex.quote(path)}"
    )


@operation()
def directory(path: str, mode: str, user: str | None = None, group: str | None = None):
    """
    A directory with this mode (and owner), created when missing, as pyinfra's
    ``files.directory`` makes it.

    + path: the directory
    + mode: octal permissions, e.g. ``"755"``
    + user, group: its owner, or None to leave it

    **Example:**

    .. code:: python

        directory(path="/etc/llamarig/hub", mode="700", user="root", group="root")
    """
    info = known(Directory, path=path)
    if info is False:
        yield fail_command(f"{path} exists and is not a directory")
        return
    quoted = shlex.quote(path)
    commands = [] if info else [f"mkdir -p {quoted}"]
    if not info or info["mode"] != int(mode):
        commands.append(f"chmod {mode} {quoted}")
    if (user and (not info or info["user"] != user)) or (
        group and (not info or info["group"] != group)
    ):
        owner = shlex.quote(user or "") + (f":{shlex.quote(group)}" if group else "")
        commands.append(f"chown {owner} {quoted}")
    if not commands:
        host.noop(f"{path} is a directory with mode {mode}")
    yield from commands


@operation()
def absent(path: str):
    """
    No file at ``path`` (a directory there is an error, as for pyinfra's
    ``files.file(present=False)``).

    + path: the file

    **Example:**

    .. code:: python

        absent(path="/etc/llamarig/api-key")
    """
    info = known(File, path=path)
    if info is False:
        yield fail_command(f"{path} exists and is not a file")
    elif info:
        yield f"rm -f {shlex.quote(path)}"
    else:
        host.noop(f"{path} does not exist")
