"""llamarig's custom pyinfra operations, run for real by pyinfra against @local on temporary
directories: they change what differs, report no change on a second run, and fail safely."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from urllib.parse import quote

import pytest

from llamarig import operations
from tests.conftest import pyinfra_env

pytestmark = pytest.mark.skipif(
    not all(shutil.which(tool) for tool in ("curl", "git", "cmake", "sha256sum")),
    reason="needs curl, git, cmake and sha256sum on this machine",
)


def run_deploy(
    tmp_path: Path, body: str, *options: str, env: dict | None = None
) -> tuple[int, dict | None, str]:
    """Run a deploy file made of `body` with pyinfra against @local (``env``: more variables)."""
    deploy = tmp_path / "deploy_under_test.py"
    deploy.write_text("from llamarig import operations\n" + textwrap.dedent(body))
    result = subprocess.run(
        [sys.executable, "-m", "pyinfra", "-y", "--json", *options, "@local", str(deploy)],
        cwd=tmp_path,
        env=pyinfra_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = json.loads(result.stdout)["results"] if result.stdout.strip() else None
    return result.returncode, results, result.stderr


def changed(results: dict) -> int:
    return results["totals"]["success"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# A hostile but valid name (GNU sha256sum escapes a name with a backslash in its output, which
# pyinfra's Sha256File never matched: such a model was downloaded on every run).
HOSTILE_NAME = 'it\'s "a" $(id) `id` 100% %n \\x.gguf'


@pytest.mark.parametrize("name", ["m.gguf", HOSTILE_NAME])
def test_fetch_checked_downloads_once(tmp_path, file_server, name):
    www, url = file_server
    content = bytes(range(256)) * 4096
    (www / name).write_bytes(content)
    dest = tmp_path / "models" / name
    dest.parent.mkdir()
    body = (
        f"operations.fetch_checked(url={url + '/' + quote(name)!r}, dest={str(dest)!r}, "
        f"sha256='{sha256(content)}', records='{tmp_path}/records')"
    )
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert changed(results) == 1
    assert dest.read_bytes() == content
    assert not Path(f"{dest}.part").exists()
    code, results, stderr = run_deploy(tmp_path, body)
    assert (code, changed(results)) == (0, 0)


def test_fetch_checked_resumes_a_partial_download(tmp_path, file_server):
    www, url = file_server
    content = b"0123456789" * 100_000
    (www / "m.gguf").write_bytes(content)
    dest = tmp_path / "m.gguf"
    # A previous run was interrupted halfway: only the rest is fetched. The kept half is
    # deliberately different, so a resumed download (and only a resumed one) ends up with
    # these bytes in front and must then be refused by the checksum.
    Path(f"{dest}.part").write_bytes(b"X" * 500_000)
    body = (
        f"operations.fetch_checked(url='{url}/m.gguf', dest='{dest}', sha256='{sha256(content)}', "
        f"records='{tmp_path}/records')"
    )
    code, _, stderr = run_deploy(tmp_path, body)
    assert code != 0
    assert "sha256 mismatch" in stderr
    assert sha256(b"X" * 500_000 + content[500_000:]) in stderr
    assert not dest.exists() and not Path(f"{dest}.part").exists()
    # The next run starts over and succeeds.
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert dest.read_bytes() == content


def test_fetch_checked_never_replaces_a_good_file_with_a_bad_download(tmp_path, file_server):
    www, url = file_server
    good = b"good model" * 1000
    (www / "m.gguf").write_bytes(b"corrupted" * 1000)
    dest = tmp_path / "m.gguf"
    dest.write_bytes(good)
    wanted = sha256(b"a newer model")
    body = (
        f"operations.fetch_checked(url='{url}/m.gguf', dest='{dest}', sha256='{wanted}', "
        f"records='{tmp_path}/records')"
    )
    code, results, stderr = run_deploy(tmp_path, body)
    assert code != 0 and "sha256 mismatch" in stderr
    assert dest.read_bytes() == good


def test_check_file(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    records = f"records='{tmp_path}/records'"
    body = f"operations.check_file(path='{model}', sha256='{sha256(b'weights')}', {records})"
    # The first check hashes and records (a change), the second reads the record.
    code, results, stderr = run_deploy(tmp_path, body)
    assert (code, changed(results)) == (0, 1), stderr
    code, results, stderr = run_deploy(tmp_path, body)
    assert (code, changed(results)) == (0, 0), stderr
    body = f"operations.check_file(path='{model}', sha256='{sha256(b'other')}', {records})"
    code, _, stderr = run_deploy(tmp_path, body)
    assert code != 0 and f"model file {model} has sha256 {sha256(b'weights')}" in stderr
    code, _, stderr = run_deploy(tmp_path, f"operations.check_file(path='{tmp_path}/none')")
    assert code != 0 and "does not exist" in stderr


def git(*args: str, cwd: Path) -> str:
    command = ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", *args]
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def remote(tmp_path) -> tuple[Path, list[str]]:
    """A repository with two commits; returns its path and the commit ids."""
    repo = tmp_path / "remote"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    commits = []
    for text in ("one", "two"):
        (repo / "file.txt").write_text(text)
        git("add", "file.txt", cwd=repo)
        git("commit", "-qm", text, cwd=repo)
        commits.append(git("rev-parse", "HEAD", cwd=repo).strip())
    return repo, commits


def test_git_commit_checks_out_exact_commits(tmp_path, remote):
    repo, (first, second) = remote
    work = tmp_path / "checkout"

    def deploy(commit):
        body = f"operations.git_commit(repo='file://{repo}', path='{work}', commit='{commit}')"
        return run_deploy(tmp_path, body)

    code, results, stderr = deploy(first)
    assert (code, changed(results)) == (0, 1), stderr
    assert (work / "file.txt").read_text() == "one"
    code, results, stderr = deploy(first)
    assert (code, changed(results)) == (0, 0), stderr
    (work / "stray.o").write_text("left over")
    code, results, stderr = deploy(second)
    assert (code, changed(results)) == (0, 1), stderr
    assert git("rev-parse", "HEAD", cwd=work).strip() == second
    assert (work / "file.txt").read_text() == "two"
    assert not (work / "stray.o").exists()


def test_cmake_build_builds_once_and_retries_a_failed_build(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    (source / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(hello C)\nadd_executable(hello hello.c)\n"
    )
    (source / "hello.c").write_text("int main(void) { return 0 }\n")  # missing ';'
    build = tmp_path / "build"
    marker = build / ".done.json"
    body = f"""
    operations.cmake_build(
        source='{source}', build_dir='{build}',
        configure=['cmake', '-S', '{source}', '-B', '{build}'],
        build=['cmake', '--build', '{build}', '--target', 'hello'],
        manifest={{'recipe': 1}}, marker='{marker}',
    )
    """
    code, _, _ = run_deploy(tmp_path, body)
    assert code != 0
    assert not marker.exists()
    (source / "hello.c").write_text("int main(void) { return 0; }\n")
    code, results, stderr = run_deploy(tmp_path, body)
    assert (code, changed(results)) == (0, 1), stderr
    assert (build / "hello").exists()
    assert json.loads(marker.read_text()) == {"recipe": 1}
    code, results, stderr = run_deploy(tmp_path, body)
    assert (code, changed(results)) == (0, 0), stderr
    # Another recipe with the same marker path is not taken for done.
    code, results, stderr = run_deploy(tmp_path, body.replace("'recipe': 1", "'recipe': 2"))
    assert (code, changed(results)) == (0, 1), stderr


def test_atomic_file_replaces_by_rename_and_only_when_it_differs(tmp_path):
    dest = tmp_path / "etc" / "unit.service"

    def write(text: str, mode: str, *options: str):
        body = f"""
            from io import StringIO
            operations.atomic_file(src=StringIO({text!r}), dest='{dest}', mode='{mode}')
        """
        code, results, stderr = run_deploy(tmp_path, body, *options)
        assert code == 0, stderr
        return changed(results), stderr

    assert write("ExecStart=a\n", "644")[0] == 1
    assert dest.read_text() == "ExecStart=a\n" and dest.stat().st_mode & 0o777 == 0o644
    assert write("ExecStart=a\n", "644")[0] == 0
    # A mode change alone is made in place.
    inode = dest.stat().st_ino
    assert write("ExecStart=a\n", "755")[0] == 1
    assert dest.stat().st_ino == inode and dest.stat().st_mode & 0o777 == 0o755
    # New content arrives as a new file renamed over the old one: a reader (systemd, apt, a
    # reboot after a killed run) sees the old text or the new, never a truncated file.
    count, stderr = write("ExecStart=b\n", "755", "--diff")
    assert count == 1 and dest.read_text() == "ExecStart=b\n"
    assert dest.stat().st_ino != inode and dest.stat().st_mode & 0o777 == 0o755
    assert "- ExecStart=a" in stderr and "+ ExecStart=b" in stderr, stderr
    assert sorted(path.name for path in dest.parent.iterdir()) == ["unit.service"]


def test_prune_builds_keeps_current_last_good_and_newest(tmp_path):
    import os

    builds = tmp_path / "builds"
    for age, name in enumerate(["newest", "second", "third", "oldest"]):
        (builds / name).mkdir(parents=True)
        marker = builds / name / ".llamarig-build.json"
        marker.write_text("{}")
        os.utime(marker, (1_000_000 - age * 100, 1_000_000 - age * 100))
    body = f"""
    operations.prune_builds(
        name="prune", builds="{builds}", keep=2,
        current="{builds}/fresh", last_good="{builds}/third",
    )
    """
    # This run's build ("fresh", not built yet) and the rollback target ("third") stay.
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert sorted(p.name for p in builds.iterdir()) == ["third"]
    assert changed(results) == 1

    (builds / "fresh").mkdir()
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert changed(results) == 0, "a second run must delete nothing"
    assert sorted(p.name for p in builds.iterdir()) == ["fresh", "third"]

    # After a good start the rollback target is this run's build: the previous one stays.
    body = f"""
    operations.prune_builds(
        name="prune", builds="{builds}", keep=2,
        current="{builds}/fresh", last_good="{builds}/fresh",
    )
    """
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert changed(results) == 0
    assert sorted(p.name for p in builds.iterdir()) == ["fresh", "third"]

    body = f"""
    operations.prune_builds(name="prune", builds="{builds}", keep=1, current="{builds}/fresh")
    """
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert sorted(p.name for p in builds.iterdir()) == ["fresh"]

    # A builder's run made several builds (one per key): each is kept, whatever `keep` says.
    for name in ("key-2", "key-3", "older"):
        (builds / name).mkdir()
    body = f"""
    operations.prune_builds(name="prune", builds="{builds}", keep=2, current="{builds}/fresh",
                            also=("{builds}/key-2", "{builds}/key-3"))
    """
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert sorted(p.name for p in builds.iterdir()) == ["fresh", "key-2", "key-3"]


def planned_commands(tmp_path: Path, call: str) -> list[str]:
    """The commands an operation's body yields on @local, read through pyinfra's real facts
    (``call``: the operation's ``_inner`` call, evaluated in the deploy file)."""
    out = tmp_path / "commands.json"
    body = f"""
        import json
        commands = [str(command) for command in operations.{call}]
        open({str(out)!r}, "w").write(json.dumps(commands))
    """
    code, _, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    return json.loads(out.read_text())


def test_apt_packages_installs_only_the_missing_with_pyinfras_options(tmp_path):
    commands = planned_commands(
        tmp_path,
        'apt_packages._inner(packages=["dpkg", "no-such-package-llamarig", "dpkg=0.0-pinned"],'
        " no_recommends=True)",
    )
    assert commands == [
        "DEBIAN_FRONTEND=noninteractive apt-get -y "
        '-o Dpkg::Options::="--force-confdef" -o Dpkg::Options::="--force-confold" '
        "install --no-install-recommends no-such-package-llamarig dpkg=0.0-pinned"
    ]


def test_apt_packages_yields_nothing_when_installed(tmp_path):
    assert planned_commands(tmp_path, 'apt_packages._inner(packages=["dpkg"])') == []
    code, results, stderr = run_deploy(
        tmp_path, 'operations.apt_packages(name="dpkg", packages=["dpkg"])\n'
    )
    assert code == 0, stderr
    assert changed(results) == 0


def test_unit_running_starts_and_enables_a_stopped_unit(tmp_path):
    # No systemd answers here: the unit reads as stopped and disabled.
    assert planned_commands(tmp_path, 'unit_running._inner(unit="no such.service")') == [
        "systemctl start -- 'no such.service'",
        "systemctl enable -- 'no such.service'",
    ]


def test_check_unit_active_fails_for_a_stopped_unit(tmp_path):
    code, _, stderr = run_deploy(
        tmp_path,
        'operations.check_unit_active(name="check", unit="absent.service", what="here")\n',
    )
    assert code != 0
    assert "absent.service is not active (systemctl status absent.service)" in stderr


def test_symlink_points_once_and_repoints_by_rename(tmp_path):
    link, first, second = tmp_path / "links" / "current", tmp_path / "a", tmp_path / "b"
    body = 'operations.symlink(name="current", path={!r}, target={!r})\n'
    for target in (first, first, second):
        code, results, stderr = run_deploy(tmp_path, body.format(str(link), str(target)))
        assert code == 0, stderr
        assert link.is_symlink() and Path(link.readlink()) == target
    assert changed(results) == 1
    code, results, _ = run_deploy(tmp_path, body.format(str(link), str(second)))
    assert changed(results) == 0
    link.unlink()
    link.mkdir()
    code, _, stderr = run_deploy(tmp_path, body.format(str(link), str(second)))
    assert code != 0 and "exists and is not a symbolic link" in stderr


def test_directory_is_made_with_its_mode_then_left(tmp_path):
    path = tmp_path / "models dir"
    body = f'operations.directory(name="models", path={str(path)!r}, mode="750")\n'
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert changed(results) == 1 and oct(path.stat().st_mode & 0o777) == "0o750"
    code, results, _ = run_deploy(tmp_path, body)
    assert changed(results) == 0
    path.chmod(0o700)
    code, results, _ = run_deploy(tmp_path, body)
    assert changed(results) == 1 and oct(path.stat().st_mode & 0o777) == "0o750"


def test_absent_removes_a_file_and_refuses_a_directory(tmp_path):
    path = tmp_path / "api-key"
    path.write_text("secret\n")
    body = f'operations.absent(name="no key", path={str(path)!r})\n'
    code, results, stderr = run_deploy(tmp_path, body)
    assert code == 0, stderr
    assert changed(results) == 1 and not path.exists()
    code, results, _ = run_deploy(tmp_path, body)
    assert changed(results) == 0
    path.mkdir()
    code, _, stderr = run_deploy(tmp_path, body)
    assert code != 0 and "exists and is not a file" in stderr


def test_facts_read_while_planning_are_read_again_only_after_a_change(tmp_path):
    # Two operations read the same file's state: the second one, after the first changed
    # nothing, reads no more (one command for both in --debug); after a change it reads again.
    path = tmp_path / "unit"
    path.write_text("same\n")
    body = "from io import StringIO\n" + "".join(
        f"operations.atomic_file(name={name!r}, src=StringIO({text!r}), dest={str(path)!r})\n"
        for name, text in (("a", "same\n"), ("b", "same\n"), ("c", "new\n"), ("d", "new\n"))
    )
    code, results, stderr = run_deploy(tmp_path, body, "--debug")
    assert code == 0, stderr
    reads = [
        line for line in stderr.splitlines() if "Running command" in line and "sha256sum" in line
    ]
    assert len(reads) == 2, reads
    assert changed(results) == 1 and path.read_text() == "new\n"


def run_wait_for_port(
    tmp_path: Path, port: int, state: str = "inactive\\ndead", timeout: int = 600
) -> subprocess.CompletedProcess:
    """wait_for_port's script run by bash; systemctl and journalctl are shims (no systemd here)
    that answer as for a worker in ``state`` (by default one that could not bind and exited:
    the 10 minutes it may wait end at once, since an exited unit ends the wait)."""
    shims = tmp_path / "bin"
    shims.mkdir(exist_ok=True)
    for tool, answer in (
        ("systemctl", state),
        ("journalctl", "Failed to create server socket"),
    ):
        (shims / tool).write_text(f"#!/bin/sh\nprintf '{answer}\\n'\n")
        (shims / tool).chmod(0o755)
    (script,) = operations.wait_for_port._inner(
        endpoint=f"127.0.0.1:{port}", service="ggml-rpc-server.service", timeout=timeout
    )
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, text=True, timeout=30
    )


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2) to list sockets")
def test_wait_for_port_names_the_connection_that_holds_the_port(tmp_path):
    # What once failed a CI run: ggml-rpc-server could not bind 127.0.0.1:50052, SO_REUSEADDR
    # notwithstanding, because an outgoing loopback connection had been handed that port. Here
    # a connection holds a port the kernel picked from its ephemeral range; nothing listens on it.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            held = client.getsockname()[1]
            result = run_wait_for_port(tmp_path, held)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert "Failed to create server socket" in lines, result.stderr
    assert any(line.startswith("ESTAB") and f"127.0.0.1:{held} " in line for line in lines), (
        result.stderr
    )
    low, _ = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    assert f"port {held} lies in the kernel ephemeral range {low}-" in result.stderr
    assert f"choose a port below {low}, or reserve it" in result.stderr


def test_wait_for_port_says_nothing_of_sockets_when_none_holds_the_port(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        free = listener.getsockname()[1]
    result = run_wait_for_port(tmp_path, free)
    assert result.returncode == 1
    # The shim's service is inactive: the wait ends at once, saying so, not after its 600 s.
    assert (
        "ggml-rpc-server.service stopped (inactive dead) without accepting connections"
        in result.stderr
    )
    assert "sockets on port" not in result.stderr and "ephemeral" not in result.stderr


def test_wait_for_port_of_a_service_still_starting_ends_at_its_timeout(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        free = listener.getsockname()[1]
    result = run_wait_for_port(tmp_path, free, state="activating\\nstart", timeout=1)
    assert result.returncode == 1
    assert (
        f"ggml-rpc-server.service does not accept connections on 127.0.0.1:{free} after 1 s"
        in result.stderr
    )
    assert "stopped" not in result.stderr
