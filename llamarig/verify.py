"""`llamarig verify`: run the testinfra suite in llamarig/checks against each host of
RIG_INVENTORY, over ssh:// with strict host-key checking, with expectations from the host's rig
data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from llamarig import PACKAGE_DIR, PROJECT_DIR, render
from llamarig.config import HostConfig
from llamarig.plan import plan_host
from llamarig.remote import SshTarget, gather, shell_reader, ssh_alias

# Inside the package, so an installed llamarig (not only a source checkout) carries it.
SUITE = PACKAGE_DIR / "checks"


def expectations(host_config: HostConfig) -> dict:
    """What the suite checks the host against: the planned data and values derived from it."""
    # The model header resolves `auto` context and split exactly as the deploy did.
    gathered = gather(host_config.data, shell_reader(host_config.data), gpus=False)
    plan = plan_host(host_config.name, host_config.data, **gathered.plan_inputs())
    data = plan.resolved
    return {
        "name": host_config.name,
        "data": data,
        "derived": {
            "base_url": render.base_url(data),
            "nvcc": render.nvcc_path(data),
            "cmake_options": render.cmake_options(data),
            "api_key": bool(data["server"]["api_key_file"]),
            "curl_auth": render.CURL_AUTH,
        },
    }


def verify_host(host_config: HostConfig, pytest_args: list[str]) -> int:
    """Run the suite against one host; returns pytest's exit status."""
    ssh = host_config.data.get("ssh") or {}
    with tempfile.TemporaryDirectory(prefix="llamarig-verify-") as scratch:
        data_file = Path(scratch) / "rig.json"
        data_file.write_text(json.dumps(expectations(host_config)))
        if ssh.get("local"):
            target = ["--hosts=local://"]
        else:
            config = Path(scratch) / "ssh_config"
            alias = ssh_alias(host_config.name)
            config.write_text(SshTarget.of(ssh).ssh_config(alias))
            target = [f"--hosts=ssh://{alias}", f"--ssh-config={config}"]
        command = [
            sys.executable, "-m", "pytest", str(SUITE), *target,
            "-p", "no:cacheprovider", "-rfEs", "--tb=line", *pytest_args,
        ]  # fmt: skip
        print(f"== verify {host_config.name}", flush=True)
        env = {**os.environ, "LLAMARIG_VERIFY_DATA": str(data_file)}
        return subprocess.run(command, cwd=PROJECT_DIR, env=env).returncode
