"""What a long job on a host reports while it runs: parsers of what the job leaves behind (a build
log with ninja's or make's step counters, the HTTP headers and the growing file of a download)
and the lines a person reads (bytes, rate, ETA, elapsed time). Pure functions, no I/O."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass, field

# ninja's default status `[12/345] Building CXX object ...`; make's `[ 42%] Building ...`.
NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\] ", re.MULTILINE)
MAKE_PERCENT = re.compile(r"^\[\s*(\d{1,3})%\] ", re.MULTILINE)
# What the download job writes to its log before each phase (see operations.fetch_command).
PHASE_MARK = "llamarig-phase: "


@dataclass(frozen=True)
class BuildStep:
    """How far a build is: ``done`` of ``total`` steps (make reports a percentage: total 100)."""

    done: int
    total: int
    unit: str = "steps"

    @property
    def percent(self) -> int:
        return 100 * self.done // self.total if self.total else 0


def last_build_step(log: str) -> BuildStep | None:
    """The last step counter in a build log: ninja's ``[N/M]`` or, failing that, make's
    ``[ P%]``."""
    steps = NINJA_STEP.findall(log)
    if steps:
        done, total = steps[-1]
        return BuildStep(int(done), int(total))
    percents = MAKE_PERCENT.findall(log)
    if percents:
        return BuildStep(int(percents[-1]), 100, unit="%")
    return None


def last_phase(log: str) -> str | None:
    """The phase a job last announced in its log (a line ``llamarig-phase: NAME``)."""
    phases = [
        line[len(PHASE_MARK) :].strip() for line in log.splitlines() if line.startswith(PHASE_MARK)
    ]
    return phases[-1] if phases else None


def expected_size(headers: str) -> int | None:
    """The size of the whole file from the headers curl dumped (``curl -D``), or None when the
    server did not say. Only the last response counts (the ones before were redirects or
    earlier attempts): ``Content-Range: bytes A-B/TOTAL`` of a resumed download, else the
    ``Content-Length`` of a full one."""
    blocks = re.split(r"^HTTP/", headers, flags=re.MULTILINE)
    if len(blocks) < 2:
        return None
    last = blocks[-1]
    status = re.match(r"[\d.]+ (\d{3})", last)
    fields = {}
    for line in last.splitlines()[1:]:
        name, separator, value = line.partition(":")
        if separator:
            fields[name.strip().lower()] = value.strip()
    if "content-range" in fields:
        total = re.fullmatch(r"bytes \d+-\d+/(\d+)", fields["content-range"])
        return int(total.group(1)) if total else None
    if status and status.group(1) == "200" and fields.get("content-length", "").isdigit():
        return int(fields["content-length"])
    return None


@dataclass
class RateMeter:
    """Bytes per second over the last ``window`` seconds of (time, size) samples: a recent rate
    that follows a download's speed without jumping at every poll."""

    window: float = 15.0
    samples: deque = field(default_factory=deque)

    def add(self, seconds: float, size: int) -> None:
        self.samples.append((seconds, size))
        while len(self.samples) > 2 and seconds - self.samples[1][0] >= self.window:
            self.samples.popleft()

    def rate(self) -> float | None:
        if len(self.samples) < 2:
            return None
        (start, first), (end, last) = self.samples[0], self.samples[-1]
        return (last - first) / (end - start) if end > start else None


def format_bytes(size: float) -> str:
    """1536 -> ``1.5 KiB``: binary units, three significant digits."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    unit = 0
    while abs(size) >= 1024 and unit < len(units) - 1:
        size /= 1024
        unit += 1
    if unit == 0:
        return f"{int(size)} B"
    # From 999.5 up, three significant digits round to 1000, which `.3g` writes as 1e+03.
    return f"{size:.3g} {units[unit]}" if size < 999.5 else f"{size:.0f} {units[unit]}"


def format_rate(bytes_per_second: float | None) -> str:
    return "-- B/s" if bytes_per_second is None else f"{format_bytes(bytes_per_second)}/s"


def format_duration(seconds: float) -> str:
    """65 -> ``1m05s``, 3725 -> ``1h02m05s``, 7.4 -> ``7s``."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def download_line(done: int, total: int | None, rate: float | None, elapsed: float) -> str:
    """``1.2 GiB of 4.5 GiB (27%), 45.3 MiB/s, ETA 1m13s, 27s elapsed``."""
    if total:
        left = max(total - done, 0)
        eta = format_duration(left / rate) if rate else "--"
        return (
            f"{format_bytes(done)} of {format_bytes(total)} ({100 * done // total}%), "
            f"{format_rate(rate)}, ETA {eta}, {format_duration(elapsed)} elapsed"
        )
    return f"{format_bytes(done)}, {format_rate(rate)}, {format_duration(elapsed)} elapsed"


def build_line(step: BuildStep | None, elapsed: float) -> str:
    """``[123/456] 26%, 2m03s elapsed``, or ``configuring, 12s elapsed`` before the first step."""
    if step is None:
        return f"configuring, {format_duration(elapsed)} elapsed"
    if step.unit == "%":
        return f"{step.done}%, {format_duration(elapsed)} elapsed"
    return f"[{step.done}/{step.total}] {step.percent}%, {format_duration(elapsed)} elapsed"


@dataclass(frozen=True)
class JobPoll:
    """One look at a detached job on the host (what ``hostjob.HostJob.poll_command`` prints)."""

    state: str  # "running", "done" or "gone" (it ended without an exit status: killed)
    exit_status: int | None
    seconds: int | None  # how long the job has run, by the host's clock
    probe: str  # the operation's own probe, one line (e.g. the partial file's size)
    log_tail: str


def parse_poll(stdout: str) -> JobPoll:
    """Reads ``state running SECONDS`` (or ``state done STATUS SECONDS``, ``state gone``),
    ``probe ...``, then the log's tail after a ``--- log`` line."""
    head, _, log_tail = stdout.partition("--- log\n")
    lines = head.splitlines()
    words = lines[0].split() if lines and lines[0].startswith("state ") else ["state", "gone"]
    numbers = [int(word) for word in words[2:] if word.isdigit()]
    state, exit_status, seconds = words[1], None, None
    if state == "running" and numbers:
        seconds = numbers[0]
    elif state == "done" and numbers:
        exit_status, seconds = numbers[0], (numbers[1] if len(numbers) > 1 else None)
    else:
        state = "running" if state == "running" else "gone"
    probe = next((line[len("probe ") :] for line in lines[1:] if line.startswith("probe ")), "")
    return JobPoll(state, exit_status, seconds, probe.strip(), log_tail)
