"""The GPU memory the server holds against the plan: an error above MEMORY_TOLERANCE is a rig
whose plan cannot be trusted (a card planned to the brim fails late, at a long request). A
router holds what the plans of the models loaded now add up to."""

from __future__ import annotations

import json

import pytest

MEMORY_TOLERANCE = 0.03


def test_gpu_memory_is_as_planned(host, rig, gpus, server_pid):
    planned = rig.get("memory")
    if not planned:
        pytest.skip("no GPU memory plan for this rig (CPU build, RPC head, router or unplanned)")
    assert_as_planned(host, planned, "the plan")


def test_gpu_memory_of_the_loaded_models_is_as_planned(host, rig, gpus, api):
    per_model = rig.get("model_memory")
    if not per_model:
        pytest.skip("not a router with a GPU memory plan per model")
    code, text = api("/models")
    assert code == 200, f"the router's /models answered {code}: {text[-300:]}"
    loaded = [
        entry["id"]
        for entry in json.loads(text)["data"]
        if (entry.get("status") or {}).get("value") == "loaded" and entry["id"] in per_model
    ]
    if not loaded:
        pytest.skip("the router has no model loaded now (server.idle_unload_seconds)")
    summed: dict[int, dict] = {}
    for name in loaded:
        for device in per_model[name]:
            entry = summed.setdefault(device["index"], {**device, "planned_mib": 0})
            entry["planned_mib"] += device["planned_mib"]
    planned = [summed[index] for index in sorted(summed)]
    assert_as_planned(host, planned, f"the plans of the models loaded ({', '.join(loaded)})")


def assert_as_planned(host, planned: list[dict], what: str) -> None:
    """nvidia-smi's memory used on each planned GPU within MEMORY_TOLERANCE of ``planned``."""
    result = host.run("nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits")
    assert result.rc == 0, f"nvidia-smi fails: {result.stderr.strip()}"
    used = {
        int(index): int(mib)
        for index, mib in (line.split(",") for line in result.stdout.splitlines() if line.strip())
    }
    rows, off = [], []
    for device in planned:
        have = used[device["index"]]
        error = (device["planned_mib"] - have) / have
        row = f"GPU {device['index']} ({device['name']}): planned {device['planned_mib']} MiB, "
        row += f"nvidia-smi {have} MiB ({error:+.1%})"
        rows.append(row)
        if abs(error) > MEMORY_TOLERANCE:
            off.append(row)
    print("; ".join(rows))
    assert not off, (
        f"GPU memory differs from {what} by more than {MEMORY_TOLERANCE:.0%}: "
        + "; ".join(off)
        + ". The deploy records what the GPUs hold beyond the plan after a start of a new "
        "build; with planner.reserve_mib: auto the next plan uses it (or set the reserve)"
    )
