"""Building llama.cpp: a checkout at a pinned commit, a CMake build as a detached job
the next run finishes, and old build directories pruned."""

from __future__ import annotations

import json
import shlex
from pathlib import PurePosixPath

from pyinfra import host
from pyinfra.api import (
    operation,
)
from pyinfra.facts.git import GitLocalCommit

from llamarig.facts.build import BuildDirectories
from llamarig.facts.cache import known
from llamarig.facts.files import JsonFile
from llamarig.onhost import progress
from llamarig.onhost.hostjob import HostJob, JobCommand
from llamarig.onhost.hostpaths import JOB_DIRECTORY


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
def prune_builds(
    builds: str,
    keep: int,
    current: str,
    last_good: str | None = None,
    also: tuple[str, ...] = (),
):
    """
    Keep the newest ``keep`` build directories: this run's build, the last one that served,
    then the newest others; delete the rest.

    + builds: the directory holding one directory per build
    + keep: how many builds to keep (at least 1)
    + current: this run's build (kept, and counted as the newest even before it exists)
    + last_good: the build of the last version that served (kept for a rollback)
    + also: this run's other builds (a builder's, one per build key it makes), kept too

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
    kept = list(dict.fromkeys(PurePosixPath(path).name for path in (current, *also)))
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
