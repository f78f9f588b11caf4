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

from llamarig import PACKAGE_DIR, PROJECT_DIR
from llamarig.config import HostConfig, inventory_path
from llamarig.config.builders import SERVES_NO_MODEL
from llamarig.config.gateways import runs_gateway
from llamarig.config.problems import Problem, located
from llamarig.config.ssh import SshTarget, ssh_alias
from llamarig.model.catalog import served_data
from llamarig.model.files import model_files
from llamarig.model.reference import HubError
from llamarig.onhost import checksums, hostpaths
from llamarig.operations.gateway import fingerprint
from llamarig.planner import gateway, render
from llamarig.planner.gather import host_plan

# Inside the package, so an installed llamarig (not only a source checkout) carries it.
SUITE = PACKAGE_DIR / "checks"


def expectations(
    host_config: HostConfig, rehash: bool = False, inventory: Path | None = None
) -> dict:
    """What the suite checks the host against: the planned data and values derived from it,
    and the gateway's (``inventory``: the file beside which the deploy copied its certificate,
    default RIG_INVENTORY); ``rehash``: hash the model files even where a checksum record says
    they are unchanged. A gateway alone (`role: gateway`) or a builder has no model and is not
    planned."""
    data = host_config.data
    checked = (
        gateway_expectations(host_config, inventory or inventory_path())
        if runs_gateway(data)
        else None
    )
    if data["role"] in SERVES_NO_MODEL:
        return {
            "name": host_config.name,
            "data": data,
            "memory": None,
            "model_memory": {},
            "model_files": [],
            "rehash": rehash,
            "checksum_records": checksums.RECORD_DIRECTORY,
            "derived": None,  # the rig checks skip (conftest.llama_rig)
            "gateway": checked,
        }
    # A Hugging Face reference as the deploy resolved it (models.lock.yml); the GPUs and the
    # model header resolve `auto` context, split mode and ratio exactly as the deploy did.
    plan = host_plan(host_config)
    data = plan.resolved
    memory = _planned_devices(plan)
    # A router's models each with their own plan: what each holds per GPU once loaded.
    model_memory = {
        model.view.name: devices
        for model in plan.models
        if (devices := _planned_devices(model.plan))
    }
    served = [] if data["role"] == "rpc-worker" else served_data(data)
    files = list({file.dest: file for model in served for file in model_files(model)}.values())
    return {
        "name": host_config.name,
        "data": data,
        "memory": memory,
        "model_memory": model_memory,
        "model_files": [{"path": file.dest, "sha256": file.sha256} for file in files],
        "rehash": rehash,
        "checksum_records": checksums.RECORD_DIRECTORY,
        "derived": {
            "base_url": render.base_url(data),
            "nvcc": render.nvcc_path(data),
            "cmake_options": render.cmake_options(data),
            "api_key": bool(data["server"]["api_key_file"]),
            "curl_auth": hostpaths.CURL_AUTH,
        },
        "gateway": checked,
    }


def gateway_expectations(host_config: HostConfig, inventory: Path) -> dict:
    """What test_gateway checks a gateway against, besides its data: each user's name and the
    SHA-256 of their key as the users' map holds it (never a key: this is written to a file),
    and the fingerprint of the certificate copy beside ``inventory`` (None: no copy)."""
    users = [
        dict(zip(("sha256", "name"), line.split(" ", 1), strict=True))
        for line in gateway.users_map(host_config.data).splitlines()
        if not line.startswith("#")
    ]
    copy = inventory.parent / gateway.CERTIFICATES_DIR / f"{host_config.name}.crt"
    certificate = None
    if copy.is_file():
        try:
            found = fingerprint(copy.read_text(errors="replace"))
        except ValueError:
            found = None  # no PEM certificate: the check fails, naming the copy
        certificate = {"path": str(copy), "fingerprint": found}
    return {"users": users, "certificate_copy": certificate}


def _planned_devices(plan) -> list[dict] | None:
    """The MiB ``plan`` puts on each GPU, by nvidia-smi's index; None where it plans none."""
    indices = plan.planned_gpu_indices
    if not indices:
        return None
    return [
        {"index": index, "name": device.name, "planned_mib": device.planned_mib}
        for index, device in zip(indices, plan.memory.devices, strict=True)
    ]


def verify_host(host_config: HostConfig, pytest_args: list[str], rehash: bool = False) -> int:
    """Run the suite against one host; returns pytest's exit status. ``rehash``: hash every
    model file, not trusting the checksum records."""
    ssh = host_config.data.get("ssh") or {}
    try:
        expected = expectations(host_config, rehash)
    except HubError as error:
        print(f"llamarig: {located(host_config, Problem(error.key_path, error.message))}")
        return 2
    with tempfile.TemporaryDirectory(prefix="llamarig-verify-") as scratch:
        data_file = Path(scratch) / "rig.json"
        data_file.write_text(json.dumps(expected))
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
