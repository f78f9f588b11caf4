"""`llamarig verify`: run the testinfra suite in llamarig/checks against each host of
RIG_INVENTORY, over ssh:// with strict host-key checking, with expectations from the host's rig
data."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from llamarig import PACKAGE_DIR, PROJECT_DIR, render
from llamarig.cli import ssh_config_value
from llamarig.config import HostConfig, expand_path, strict_host_key_checking
from llamarig.plan import plan_host

# Inside the package, so an installed llamarig (not only a source checkout) carries it.
SUITE = PACKAGE_DIR / "checks"


def ssh_config(name: str, ssh: dict) -> str:
    """An ssh_config block for testinfra's ssh backend (never paramiko://, which does not
    check host keys)."""
    lines = [
        f"Host {name}",
        f"  HostName {ssh['host']}",
        f"  Port {ssh.get('port', 22)}",
        # yes, or accept-new where the user opted in (ssh.host_key_checking), as for pyinfra
        f"  StrictHostKeyChecking {strict_host_key_checking(ssh)}",
        "  BatchMode yes",
    ]
    if "user" in ssh:
        lines.append(f"  User {ssh['user']}")
    if "key" in ssh:
        key = ssh_config_value(expand_path(ssh["key"]))
        lines += [f"  IdentityFile {key}", "  IdentitiesOnly yes"]
    if "known_hosts" in ssh:
        lines.append(f"  UserKnownHostsFile {ssh_config_value(expand_path(ssh['known_hosts']))}")
    return "\n".join(lines) + "\n"


def ssh_alias(name: str) -> str:
    """The ssh_config alias of an inventory host: one word whatever the host's name holds."""
    return "llamarig-" + re.sub(r"[^A-Za-z0-9._-]", "_", name)


def expectations(host_config: HostConfig) -> dict:
    """What the suite checks the host against: the planned data and values derived from it."""
    from llamarig.cli import host_header

    # The model header resolves `auto` context and split exactly as the deploy did.
    header, note = (None, "")
    if host_config.data["llama_cpp"]["backend"] == "cuda":
        header, note = host_header(host_config.data, contact=True)
    plan = plan_host(host_config.name, host_config.data, header, note)
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
            config.write_text(ssh_config(alias, ssh))
            target = [f"--hosts=ssh://{alias}", f"--ssh-config={config}"]
        command = [
            sys.executable, "-m", "pytest", str(SUITE), *target,
            "-p", "no:cacheprovider", "-rfEs", "--tb=line", *pytest_args,
        ]  # fmt: skip
        print(f"== verify {host_config.name}", flush=True)
        env = {**os.environ, "LLAMARIG_VERIFY_DATA": str(data_file)}
        return subprocess.run(command, cwd=PROJECT_DIR, env=env).returncode
