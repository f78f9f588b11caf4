"""The GPU acceptance rig takes the lent machine's card (bench.gpu_bench.this_card_rig): the
device lease may lend an H100 where the shipped rig names an H200. nvidia-smi is a stand-in
script here (no GPU), printing what the real one prints on each card."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from bench import gpu_bench

SHIPPED_RIG = Path(__file__).resolve().parents[1] / "inventory" / "gpu-h200-systemd.yml"


def shipped_host() -> dict:
    return yaml.safe_load(SHIPPED_RIG.read_text())["all"]["children"]["gpu"]["hosts"][
        "h200-systemd"
    ]


@pytest.fixture
def card(tmp_path, monkeypatch):
    """Makes nvidia-smi answer as the given card; the derived rigs land in tmp_path."""
    monkeypatch.setattr(gpu_bench, "WORK", tmp_path)

    def lend(line: str) -> None:
        smi = tmp_path / "bin" / "nvidia-smi"
        smi.parent.mkdir(exist_ok=True)
        smi.write_text(f"#!/bin/sh\necho '{line}'\n")
        smi.chmod(0o755)
        monkeypatch.setenv("PATH", f"{smi.parent}{os.pathsep}{os.environ['PATH']}")

    return lend


def test_an_h100_gets_its_name_memory_architecture_and_a_floor_scaled_by_bandwidth(card):
    card("NVIDIA H100 80GB HBM3, 81559, 9.0")
    overrides = gpu_bench.this_card_rig(shipped_host())
    assert overrides["gpus"] == [
        {"name": "NVIDIA H100 80GB HBM3", "vram_mib": 81559, "compute_capability": "9.0"}
    ]
    assert overrides["llama_cpp"] == {"cuda_architectures": "90-real"}
    # 150 tokens/s on the H200's 4.8 TB/s is 104 on the H100's 3.35.
    assert overrides["expect"] == {"min_tokens_per_second": 104}
    path = gpu_bench.derived_inventory(SHIPPED_RIG, "h200-systemd", overrides)
    data = gpu_bench.host_data(path)
    assert data["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert data["gpus"][0]["vram_mib"] == 81559
    assert data["llama_cpp"]["cuda_architectures"] == "90-real"
    assert data["expect"]["min_tokens_per_second"] == 104
    assert data["llama_cpp"]["repo"] == shipped_host()["llama_cpp"]["repo"], "the rest is kept"


def test_the_shipped_card_keeps_its_floor(card):
    card("NVIDIA H200, 143771, 9.0")
    overrides = gpu_bench.this_card_rig(shipped_host())
    assert overrides["gpus"][0]["vram_mib"] == 143771
    assert overrides["expect"] == {"min_tokens_per_second": 150}


def test_a_card_of_unknown_bandwidth_has_its_speed_left_unchecked(card):
    card("NVIDIA B200, 183359, 10.0")
    overrides = gpu_bench.this_card_rig(shipped_host())
    assert overrides["llama_cpp"] == {"cuda_architectures": "100-real"}
    assert overrides["expect"] == {"min_tokens_per_second": None}
