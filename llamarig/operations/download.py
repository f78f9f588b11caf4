"""Downloads and checksums: a file fetched as a detached job and checked against its
sha256, the records that let a second run skip hashing, and the model's header records."""

from __future__ import annotations

import shlex
import time
from pathlib import Path

from pyinfra import host, logger, state
from pyinfra.api import (
    FunctionCommand,
    operation,
)
from pyinfra.facts.files import File

from llamarig.config import lock as model_lock
from llamarig.facts.cache import known
from llamarig.facts.files import RecordedSha256
from llamarig.onhost import checksums, progress
from llamarig.onhost.hostjob import HostJob, JobCommand
from llamarig.onhost.hostpaths import JOB_DIRECTORY
from llamarig.operations.host import fail


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
      sent with ``curl -H @FILE``, so a token is never in an argv; give it only for a ``url``
      the credential belongs to (the Hub token: ``reference.sends_hub_token``, decided per
      shard), never for another host's; curl drops it on a redirect to another host, scheme
      or port (no ``--location-trusted``)
    + records: the root-only directory of checksum records (``llamarig.onhost.checksums``)

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
    whose digest it records; ``header_file`` (``fetch_checked``'s) goes with ``url`` alone.
    With ``check_dest``, a file already at ``dest`` is hashed first (and recorded) and kept
    when it matches. It writes the response headers (for the expected size) and its phases to
    its output."""
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
    + records: the root-only directory of checksum records (``llamarig.onhost.checksums``)

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
    + records: the root-only directory of checksum records (``llamarig.onhost.checksums``)

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
        yield from fail._inner(f"model file {path} does not exist on the host")
        return
    found = known(RecordedSha256, path=path, records=records)
    if found is None:
        yield from fail._inner(f"model file {path} does not exist; expected sha256 {sha256}")
        return
    recorded = None if rehash else found["sha256"]
    if recorded == sha256:
        host.noop(f"{path} matches its sha256 (recorded, the file unchanged since)")
        return
    fix = "replace the file, or set model.sha256 to the file's digest"
    if recorded:
        yield from fail._inner(
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
