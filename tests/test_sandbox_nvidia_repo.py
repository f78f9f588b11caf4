"""The `nvidia-repo` source against a repository with the layout of NVIDIA's CUDA repository.

NVIDIA's repository is not reachable from here, so this test builds a STAND-IN of it and serves
it on loopback: a flat `debian13/x86_64/` repository with a signed InRelease, the keyring package
`cuda-keyring_1.1-1_all.deb` (the repository's key and a one-line .list, like NVIDIA's), and
STAND-IN packages named like NVIDIA's meta packages (`nvidia-open` of branches 580 and 590,
`cuda-toolkit-13-0`) that install nothing but their own names. Only `nvidia_repo.url` differs
from production; the deploy's code path is the production one.

It proves: the keyring is installed and the repository is trusted through it alone
(deb822 `Signed-By`), branch pinning holds (590 is in the repository and not taken), the
packages install, and a second run changes nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from llamarig import CACHE_DIR
from tests import sandboxes
from tests.sandboxes import (
    changed_operations,
    converge,
    demo_rig_inventory,
    fresh_sandbox,
    in_sandbox,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.slow, pytest.mark.heavy]

if os.geteuid() != 0:
    pytest.skip("the sandbox rig needs root (systemd-nspawn)", allow_module_level=True)
if not all(shutil.which(tool) for tool in ("gpg", "dpkg-deb", "dpkg-scanpackages")):
    pytest.skip("needs gpg, dpkg-deb and dpkg-scanpackages (dpkg-dev)", allow_module_level=True)

NAME = "sandbox-nvidia-repo"
STANDIN_DIR = CACHE_DIR / "www" / "nvidia-standin"
STANDIN_URL = "http://127.0.0.1:8765/nvidia-standin"
REPO_DIR = "debian13"
KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"


def build_deb(out: Path, package: str, version: str, files: dict[str, bytes]) -> None:
    root = out.parent / f"build-{package}-{version}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: {version}\nArchitecture: all\n"
        "Maintainer: llamarig tests <tests@llamarig.invalid>\n"
        f"Description: STAND-IN for NVIDIA's {package} (llamarig test, installs nothing real)\n"
    )
    for path, content in files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "-b", str(root), str(out)],
        check=True,
        capture_output=True,
    )
    shutil.rmtree(root)


def build_standin_repository() -> None:
    shutil.rmtree(STANDIN_DIR, ignore_errors=True)
    repo = STANDIN_DIR / REPO_DIR / "x86_64"
    repo.mkdir(parents=True)
    gnupg = STANDIN_DIR / "gnupg"
    gnupg.mkdir(mode=0o700)
    gpg = ["gpg", "--homedir", str(gnupg), "--batch", "--pinentry-mode", "loopback"]
    subprocess.run(
        [*gpg, "--passphrase", "", "--quick-gen-key", "llamarig stand-in <x@llamarig.invalid>",
         "ed25519", "sign", "never"],
        check=True, capture_output=True,
    )  # fmt: skip
    key = subprocess.run([*gpg, "--export"], check=True, capture_output=True).stdout
    source_list = f"deb [signed-by={KEYRING}] {STANDIN_URL}/{REPO_DIR}/x86_64/ /\n".encode()
    build_deb(
        repo / "cuda-keyring_1.1-1_all.deb",
        "cuda-keyring",
        "1.1-1",
        {KEYRING: key, f"/etc/apt/sources.list.d/cuda-{REPO_DIR}-x86_64.list": source_list},
    )
    for package, version in (
        ("nvidia-open", "580.95.05-1"),
        ("nvidia-open", "590.48.01-1"),
        ("cuda-toolkit-13-0", "13.0.2-1"),
    ):
        build_deb(repo / f"{package}_{version}_all.deb", package, version, {})
    packages = subprocess.run(
        ["dpkg-scanpackages", "--multiversion", "."],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    (repo / "Packages").write_bytes(packages)
    digest = hashlib.sha256(packages).hexdigest()
    (repo / "Release").write_text(
        "Origin: llamarig stand-in\nLabel: STAND-IN of NVIDIA's CUDA repository\n"
        "Architectures: all amd64\nDate: Mon, 30 Nov 2026 00:00:00 UTC\n"
        f"SHA256:\n {digest} {len(packages)} Packages\n"
    )
    subprocess.run(
        [*gpg, "--passphrase", "", "--clearsign", "-o", str(repo / "InRelease"),
         str(repo / "Release")],
        check=True, capture_output=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def standin_rig(tmp_path_factory):
    sandbox = fresh_sandbox(NAME, "trixie", 2225)
    info = next(sandbox)
    build_standin_repository()

    def edit(rig: dict) -> None:
        rig.update(
            driver={"source": "nvidia-repo", "branch": 580},
            cuda={"source": "nvidia-repo", "version": "13.0"},
            # A stand-in on loopback over http: the explicit opt-in for a repository without TLS.
            nvidia_repo={"url": STANDIN_URL, "allow_insecure": True},
        )
        rig["server"]["port"] = 8083
        sandboxes.lane_rig(rig)  # this scenario is about the repository

    inventory = demo_rig_inventory(
        tmp_path_factory.mktemp("inventory") / "standin.yml", NAME, 2225, edit
    )
    yield info, inventory
    next(sandbox, None)  # takes the sandbox down
    shutil.rmtree(STANDIN_DIR, ignore_errors=True)


def test_keyring_signed_by_pinning_and_packages(standin_rig):
    info, inventory = standin_rig
    converge(inventory)
    assert in_sandbox(info, "dpkg-query -W -f='${Version}' cuda-keyring") == "1.1-1"
    sources = in_sandbox(info, "cat /etc/apt/sources.list.d/llamarig-nvidia-cuda.sources")
    assert (
        f"Signed-By: {KEYRING}" in sources and f"URIs: {STANDIN_URL}/{REPO_DIR}/x86_64/" in sources
    )
    # The keyring package's own .list is gone: one source, trusted through one key.
    assert in_sandbox(info, f"ls /etc/apt/sources.list.d/cuda-{REPO_DIR}-x86_64.list || true") == ""
    assert in_sandbox(info, "dpkg-query -W -f='${Version}' nvidia-open") == "580.95.05-1"
    available = in_sandbox(info, "apt-cache madison nvidia-open")
    assert "590.48.01-1" in available, "the newer branch should be in the repository"
    assert (
        in_sandbox(info, "dpkg-query -W -f='${Status}' cuda-toolkit-13-0") == "install ok installed"
    )


def test_second_run_changes_nothing(standin_rig):
    _, inventory = standin_rig
    results = converge(inventory)
    assert results["totals"]["success"] == 0, changed_operations(results)
