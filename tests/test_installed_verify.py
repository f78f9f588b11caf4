"""`llamarig verify` and `llamarig plan` from a non-editable install, run outside the source
tree: the installed package carries the testinfra suite it runs (llamarig/checks), the documented
defaults (group_data/) and the templates (files/), not the checkout's."""

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.conftest import PROJECT, offline

RIG = """
all:
  hosts:
    here:
      ssh: {local: true}
      driver: {source: none}
      cuda: {source: none}
      llama_cpp: {backend: cpu}
      model: {path: /srv/models/m.gguf}
      server: {supervisor: none, ctx: 2048, split_mode: none}
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("installed"))


def install(tmp_path: Path) -> Path:
    """A fresh venv with llamarig installed from a copy of the package (non-editable), its
    dependencies (and pip) reached through a .pth line to this venv's site-packages, so nothing
    is downloaded. Returns the venv's bin directory."""
    if importlib.util.find_spec("setuptools.command.bdist_wheel") is None:
        pytest.skip("needs setuptools>=70.1 in this venv (the dev extra: pip install -e '.[dev]')")
    source = tmp_path / "source"
    source.mkdir()
    shutil.copy(PROJECT / "pyproject.toml", source)
    for directory in source_directories():
        shutil.copytree(
            PROJECT / directory, source / directory, ignore=shutil.ignore_patterns("__pycache__")
        )
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    # A path named in a .pth file joins sys.path after the venv's own site-packages, and the
    # .pth files in it (this venv's editable hook of llamarig) are not run.
    (Path(purelib) / "project-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        offline([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                 str(source)]),
        check=True, cwd=tmp_path, capture_output=True,
    )  # fmt: skip
    return venv / "bin"


def source_directories() -> set[str]:
    """The checkout's top-level directories that pyproject.toml builds its packages from."""
    setuptools = tomllib.loads((PROJECT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools.get("package-dir", {})
    return {mapped.get(package, package.split(".")[0]) for package in setuptools["packages"]}


def run_installed(bin_dir: Path, argv: list, cwd: Path, **env) -> subprocess.CompletedProcess:
    """``argv`` run offline in ``cwd`` (outside the source tree) with the install's bin first."""
    return subprocess.run(
        offline(argv),
        cwd=cwd,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(cwd), **env},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def assert_rig_suite_collected(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout + result.stderr
    collected = [line for line in result.stdout.splitlines() if "test_rig.py::" in line]
    assert any(
        line.endswith("llamarig/checks/test_rig.py::test_os_is_supported[local]")
        for line in collected
    ), result.stdout
    assert len(collected) > 20, result.stdout
    # From the installed package, not from the checkout.
    assert str(PROJECT) not in result.stdout + result.stderr, result.stdout


def test_installed_package_carries_the_rig_suite(installed, tmp_path):
    """runner.SUITE of the installed package lies in it, and the suite's imports work from
    there: pytest collects every check, run as `llamarig verify` runs it."""
    script = "from llamarig.checks.runner import SUITE; print(SUITE)"
    located = run_installed(installed, [installed / "python", "-c", script], tmp_path)
    suite = Path(located.stdout.strip())
    assert located.returncode == 0, located.stderr
    assert suite.is_relative_to(installed.parent) and (suite / "test_rig.py").is_file(), suite
    result = run_installed(
        installed,
        [installed / "python", "-m", "pytest", suite, "--hosts=local://", "-p", "no:cacheprovider",
         "--collect-only", "-q"],
        tmp_path,
    )  # fmt: skip
    assert_rig_suite_collected(result)


def test_installed_verify_runs_the_rig_suite_outside_the_source_tree(installed, tmp_path):
    (tmp_path / "rig.yml").write_text(RIG)
    result = run_installed(
        installed, [installed / "llamarig", "verify", "--", "--collect-only", "-q"], tmp_path,
        RIG_INVENTORY=str(tmp_path / "rig.yml"),
    )  # fmt: skip
    assert_rig_suite_collected(result)


def test_installed_plan_reads_the_defaults_and_templates_it_carries(installed, tmp_path):
    """`llamarig plan --unit` outside the source tree: the defaults the host leaves out (the
    pinned commit in the build directory) and the rendered unit come from the installed package."""
    (tmp_path / "rig.yml").write_text(RIG)
    result = run_installed(
        installed, [installed / "llamarig", "plan", "--unit"], tmp_path,
        RIG_INVENTORY=str(tmp_path / "rig.yml"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    commit = yaml.safe_load((PROJECT / "group_data" / "all.yml").read_text())["llama_cpp"]["commit"]
    assert f"/opt/llamarig/builds/{commit[:12]}-" in result.stdout, result.stdout
    assert "[Service]\nType=exec\n" in result.stdout, result.stdout
    assert "ProtectSystem=strict" in result.stdout, result.stdout  # the included hardening block
    assert str(PROJECT) not in result.stdout + result.stderr, result.stdout


def test_installed_package_carries_every_file_of_group_data_and_files(installed):
    """The wheel's copies of group_data/ and files/ are the checkout's files, all of them and
    byte for byte: one file each, no second copy to keep in step."""
    purelib = next(installed.parent.glob("lib/python*/site-packages"))
    for directory in ("group_data", "files"):
        names = files_in(PROJECT / directory)
        assert names, directory
        assert files_in(purelib / "llamarig" / directory) == names, directory
        for name in names:
            shipped = purelib / "llamarig" / directory / name
            assert shipped.read_bytes() == (PROJECT / directory / name).read_bytes(), name


def files_in(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.is_file())
