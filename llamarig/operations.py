"""Custom pyinfra operations. Each reads facts and yields only the commands needed, so a second
run with nothing to do yields nothing (and pyinfra counts it as unchanged)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import time
from io import BytesIO
from pathlib import PurePosixPath
from typing import IO

from pyinfra import host, logger, state
from pyinfra.api import (
    FileUploadCommand,
    FunctionCommand,
    OperationError,
    StringCommand,
    operation,
)
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.files import File, FileContents
from pyinfra.facts.git import GitLocalCommit
from pyinfra.operations.util.files import generate_color_diff

from llamarig.facts import BuildDirectories, FileSha256, JsonFile
from llamarig.llama_args import option_name
from llamarig.render import CURL_AUTH


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
    head = host.get_fact(GitLocalCommit, repo=path)
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
    if host.get_fact(JsonFile, path=marker) == manifest:
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
    yield environment + lock + shlex.join(configure)
    yield environment + lock + shlex.join(build)
    content = shlex.quote(json.dumps(manifest, indent=2, sort_keys=True))
    yield f"printf '%s\\n' {content} > {shlex.quote(marker)}"


@operation()
def fetch_checked(url: str, dest: str, sha256: str):
    """
    Download a file resumably and move it into place only when its sha256 matches.

    + url: http(s) URL
    + dest: final path on the host
    + sha256: expected digest (lowercase hex)

    The download goes to ``dest.part`` (resumed with HTTP ranges after an interruption). A
    complete download with the wrong digest is deleted and the operation fails; the file at
    ``dest`` is only ever replaced by one that matches.

    **Example:**

    .. code:: python

        fetch_checked(
            url="https://example.org/model.gguf",
            dest="/opt/llamarig/models/model.gguf",
            sha256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
        )
    """
    if host.get_fact(FileSha256, path=dest) == sha256:
        host.noop(f"{dest} matches its sha256")
        return
    yield fetch_command(url, dest, sha256)


def fetch_command(url: str, dest: str, sha256: str) -> str:
    """The shell command of ``fetch_checked``: a resumable, checksummed download to ``dest``."""
    part = shlex.quote(dest + ".part")
    q_dest, q_url, q_lock = shlex.quote(dest), shlex.quote(url), shlex.quote(dest + ".lock")
    q_sha256 = shlex.quote(sha256)
    # Every value is one quoted word, in messages too (printf arguments, never inside "...").
    return f"""
# One download at a time: a run killed mid-download can leave its curl running.
exec 9>{q_lock}; flock 9
if [ -f {part} ] && [ "$(sha256sum < {part} | cut -d' ' -f1)" = {q_sha256} ]; then
  printf '%s.part is complete\\n' {q_dest}
else
  # curl exits 33 when the server cannot resume; then start the part over.
  curl -fsSL --retry 3 -C - -o {part} -- {q_url} || {{
    rc=$?; [ $rc -eq 33 ] || exit $rc; rm -f {part}; curl -fsSL --retry 3 -o {part} -- {q_url}; }}
  actual=$(sha256sum < {part} | cut -d' ' -f1)
  if [ "$actual" != {q_sha256} ]; then
    rm -f {part}
    printf 'sha256 mismatch for %s: got %s, expected %s; the download was discarded\\n' \\
      {q_url} "$actual" {q_sha256} >&2
    exit 1
  fi
fi
chmod 0644 {part} && mv -f {part} {q_dest} && rm -f {q_lock}
""".strip()


@operation()
def check_file(path: str, sha256: str | None = None):
    """
    Require a file already on the host, optionally with a given sha256; never changes it.

    + path: absolute path
    + sha256: expected digest, or None to only require the file

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
    actual = host.get_fact(FileSha256, path=path)
    if actual == sha256:
        host.noop(f"{path} matches its sha256")
        return
    found = "does not exist" if actual is None else f"has sha256 {actual}"
    yield fail_command(f"model file {path} {found}; expected sha256 {sha256}")


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


@operation(is_idempotent=False)
def serve_or_roll_back(
    base_url: str,
    service: str,
    timeout: int,
    unit: str,
    env_file: str,
    current: str,
    last_good: str,
):
    """
    Wait until a (re)started llama-server serves; if it does not, put the last version that
    served back (unit, environment file and `current` link), restart it, confirm it serves, and
    fail with the new version's last journal lines.

    + base_url: e.g. ``http://127.0.0.1:8080``
    + service: systemd unit name (journal, restart)
    + timeout: seconds the new version gets to answer /health
    + unit, env_file, current: the unit file, its environment file and the `current` link
    + last_good: directory holding copies of those three from the last version that served;
      refreshed after every successful start

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
    q_service, q_unit, q_env, q_current, q_good, q_url = (
        shlex.quote(value) for value in (service, unit, env_file, current, last_good, base_url)
    )
    # Values reach messages as printf arguments, never inside double quotes.
    yield (
        _serving_check(base_url, service, timeout)
        + f"""
if serving; then
  mkdir -p {q_good}
  cp {q_unit} {q_good}/unit.new && cp {q_env} {q_good}/env.new \\
    && readlink {q_current} > {q_good}/current.new \\
    && for f in unit env current; do mv {q_good}/$f.new {q_good}/$f; done
  printf 'llamarig: %s serves at %s\\n' {q_service} {q_url}
  exit 0
fi
printf 'llamarig: the new version of %s does not serve: %s. Its last journal lines:\\n' \\
  {q_service} "$why" >&2
journalctl -u {q_service} -n 30 --no-pager -o cat >&2
if [ ! -f {q_good}/current ]; then
  echo "llamarig: no earlier version served on this host: nothing to roll back to" >&2
  exit 1
fi
started=$(date +%s)
cp {q_good}/unit {q_unit} && cp {q_good}/env {q_env} \\
  && ln -sfn "$(cat {q_good}/current)" {q_current}.new && mv -T {q_current}.new {q_current}
systemctl daemon-reload
systemctl reset-failed -- {q_service} 2>/dev/null || true
systemctl restart -- {q_service}
if serving; then
  echo "llamarig: rolled back: the last version that served ($(cat {q_good}/current)) serves" \\
    "again after $(( $(date +%s) - started )) s; fix the rig data and deploy again" >&2
else
  printf 'llamarig: the rollback does not serve either: %s\\n' "$why" >&2
fi
exit 1
""".rstrip()
    )


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
    present = host.get_fact(BuildDirectories, path=builds)
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
    address = address.strip("[]")
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
    last journal lines.

    + endpoint: ``host:port`` the service listens on
    + service: systemd unit name (journal)
    + timeout: seconds to wait

    **Example:**

    .. code:: python

        wait_for_port(endpoint="10.0.0.12:50052", service="ggml-rpc-server", timeout=60)
    """
    quoted, q_endpoint = shlex.quote(service), shlex.quote(endpoint)
    yield f"""
deadline=$(( $(date +%s) + {int(timeout)} ))
until {tcp_probe(endpoint)}; do
  if [ $(date +%s) -ge $deadline ] || [ "$(systemctl show -P SubState -- {quoted})" = auto-restart ]
  then
    printf 'llamarig: %s does not accept connections on %s; its journal:\\n' \\
      {quoted} {q_endpoint} >&2
    journalctl -u {quoted} -n 20 --no-pager -o cat >&2; exit 1
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
def restart_service(service: str):
    """
    Restart a systemd service on purpose: its start rate limit (meant for crash loops) is
    reset first, so a run of deliberate deploys is never refused with "start request repeated
    too quickly". Guard it with ``_if=``: it always restarts.

    + service: unit name, e.g. ``llama-server.service``
    """
    quoted = shlex.quote(service)
    yield f"systemctl reset-failed -- {quoted} 2>/dev/null || true; systemctl restart -- {quoted}"


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
    installed = host.get_fact(DebPackages)
    missing = [package for package in packages if package not in installed]
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
    remote = host.get_fact(File, path=dest)
    same_content = bool(remote) and host.get_fact(FileSha256, path=dest) == (
        hashlib.sha256(content).hexdigest()
    )
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
def secret_file(src: str, dest: str):
    """
    Copy a secret (an API key) to a root-only file on the host, only when it differs.

    + src: local file with the secret
    + dest: file on the host, created 0600 before anything is written to it

    Unlike ``files.put`` this never shows the content (pyinfra's ``--diff`` prints what
    ``files.put`` writes) and never leaves a readable copy; like ``atomic_file`` it renames a
    complete copy over the old key.

    **Example:**

    .. code:: python

        secret_file(src="~/.config/llamarig/rig1.key", dest="/etc/llamarig/api-key")
    """
    with open(src, "rb") as handle:
        wanted = hashlib.sha256(handle.read()).hexdigest()
    if host.get_fact(FileSha256, path=dest) == wanted:
        host.noop(f"{dest} is up to date")
        return
    quoted, temporary = shlex.quote(dest), shlex.quote(dest + ATOMIC_SUFFIX)
    # The copy is root-only before a byte is written to it, then renamed over the key.
    yield f"mkdir -p $(dirname {quoted}) && umask 077 && : > {temporary} && chmod 600 {temporary}"
    yield FileUploadCommand(src, dest + ATOMIC_SUFFIX)
    yield f"chown root:root {temporary} && {rename_into_place(dest, '600')}"
