"""What the GPUs hold beyond the plan's buffers, measured on the rig after a start and fed back
to the planner: the recording command (run by a real shell), the fact that reads the records,
and the reserve the next plan takes from them.

This machine has no GPU: the recording runs against a stand-in `nvidia-smi` on the PATH that
prints what the real one prints for `--query-gpu=index,memory.used --format=csv,noheader,nounits`
(bench/systemd_h200.sh runs the real one)."""

from __future__ import annotations

import copy
import os
import subprocess

import pytest

from llamarig.config import load_inventory
from llamarig.facts.gpu import MeasuredOverheads
from llamarig.model.gguf import read_gguf_header_file
from llamarig.planner import render
from llamarig.planner.plan import MEASURED_MARGIN_MIB, plan_host
from tests.conftest import PROJECT
from tests.ggufmodels import write_llama
from tests.test_operations import run_deploy


def _record(directory, tmp_path, smi_output: str | None, split_mode: str = "tensor"):
    """Run record_gpu_overheads with pyinfra against @local, a stand-in nvidia-smi first on
    the PATH; returns (exit status, the operation's changed count)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        f"#!/bin/sh\nprintf '{smi_output}'\n" if smi_output is not None else "#!/bin/sh\nexit 9\n"
    )
    smi.chmod(0o755)
    status, results, _ = run_deploy(
        tmp_path,
        f"""
        operations.record_gpu_overheads(
            name="record", directory={str(directory)!r}, build="b1", split_mode={split_mode!r},
            gpu_indices=[1, 0], buffers_mib=[10000, 11000],
        )
        """,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}"},
    )
    return status, (results or {}).get("totals", {}).get("success")


def _facts(directory) -> dict:
    """The MeasuredOverheads fact, its command run by sh on this machine."""
    fact = MeasuredOverheads()
    result = subprocess.run(
        ["sh", "-c", fact.command(path=str(directory))], capture_output=True, text=True
    )
    lines = result.stdout.splitlines()
    return fact.process(lines) if lines else fact.default()


def test_the_record_is_per_gpu_in_the_plans_order_and_written_once(tmp_path):
    records = tmp_path / "gpu overheads"
    assert _facts(records) == {}
    assert _record(records, tmp_path, "0, 12000\\n1, 13100\\n") == (0, 1)
    # GPU 1 first, as the plan lists it: 13100 - 10000, then 12000 - 11000.
    assert (records / "b1.tensor").read_text() == "3100 1000\n"
    assert _facts(records) == {("b1", "tensor"): [3100, 1000]}
    # A later start of the same build: nothing to do, nothing rewritten.
    assert _record(records, tmp_path, "0, 12050\\n1, 13160\\n") == (0, 0)
    assert _facts(records) == {("b1", "tensor"): [3100, 1000]}, "a record was rewritten"
    _record(records, tmp_path, "0, 11500\\n1, 12500\\n", split_mode="layer")
    assert _facts(records)[("b1", "layer")] == [2500, 500]


def test_no_record_when_nvidia_smi_fails(tmp_path):
    status, _ = _record(tmp_path / "records", tmp_path, None)
    assert status != 0 and not (tmp_path / "records" / "b1.tensor").exists()


def test_a_record_llamarig_did_not_write_is_ignored(tmp_path):
    (tmp_path / "b1.tensor").write_text("lots of memory\n")
    (tmp_path / "b2.none").write_text("569\n")
    assert _facts(tmp_path) == {("b2", "none"): [569]}


@pytest.fixture(scope="module")
def header(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "llama-8b.gguf"
    return read_gguf_header_file(write_llama(path, 32, 4096, 14336, 32, 8, 128256, 131072, "q8_0"))


@pytest.fixture
def h200_pair() -> dict:
    data = load_inventory(PROJECT / "inventory" / "gpu-h200x2.yml").hosts["h200x2"].data
    data = copy.deepcopy(data)
    data["server"]["split_mode"] = "tensor"
    data["planner"]["reserve_mib"] = "auto"
    data["llama_cpp"]["cmake_options"]["GGML_CUDA_NCCL"] = True
    return data


def _reserves(plan) -> set[int]:
    return {device.reserve_mib for device in plan.memory.devices}


def test_the_next_plan_reserves_what_the_rig_measured(h200_pair, header):
    build = render.build_id(plan_host("h", h200_pair, header).resolved)
    measured = {(build, "tensor"): [1907, 1945]}
    plan = plan_host("h", h200_pair, header, measured_overheads=measured)
    assert _reserves(plan) == {1945 + MEASURED_MARGIN_MIB}
    note = next(n for n in plan.notes if n.startswith("reserve "))
    assert "1945 MiB measured on this rig" in note and "the default would be 2048" in note


@pytest.mark.parametrize(
    "measured",
    [
        {("another-build", "tensor"): [1000, 1000]},  # an older build
        {("BUILD", "layer"): [1000, 1000]},  # another mode
        {("BUILD", "tensor"): [1000]},  # another number of GPUs
        {("BUILD", "tensor"): [1000, -5]},  # nonsense
    ],
)
def test_a_record_of_something_else_is_not_used(h200_pair, header, measured):
    build = render.build_id(plan_host("h", h200_pair, header).resolved)
    measured = {(build if b == "BUILD" else b, mode): v for (b, mode), v in measured.items()}
    plan = plan_host("h", h200_pair, header, measured_overheads=measured)
    assert _reserves(plan) == {2048}, plan.notes


def test_an_explicit_reserve_wins_and_the_plan_shows_the_measurement(h200_pair, header):
    h200_pair["planner"]["reserve_mib"] = 2560
    build = render.build_id(plan_host("h", h200_pair, header).resolved)
    plan = plan_host("h", h200_pair, header, measured_overheads={(build, "tensor"): [1907, 1907]})
    assert _reserves(plan) == {2560}
    assert any(
        "planner.reserve_mib (1907 MiB measured on this rig" in note for note in plan.notes
    ), plan.notes


def test_the_planned_gpus_are_named_by_their_nvidia_smi_index(h200_pair, header):
    assert plan_host("h", h200_pair, header).planned_gpu_indices == [0, 1]
    h200_pair["server"]["tensor_split"] = [0, 1]  # the first card left out of --device
    assert plan_host("h", h200_pair, header).planned_gpu_indices == [1]
    cpu = load_inventory(PROJECT / "inventory" / "hosts.yml").hosts["sandbox"].data
    assert plan_host("sandbox", cpu, None).planned_gpu_indices is None
