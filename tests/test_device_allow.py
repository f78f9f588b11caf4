"""What the hardened units may open (DevicePolicy=closed + DeviceAllow=): the NVIDIA groups are
data in one place (render.NVIDIA_DEVICE_GROUPS), both units render them alike, and each is a
group that driver 580 lists in /proc/devices and together they cover every node CUDA opens."""

import pytest

from llamarig.config import load_inventory
from llamarig.planner import render
from llamarig.tables.hardware import char_device_groups, device_access_problems
from tests.conftest import PROJECT

# /proc/devices of the one-H200 machine (driver 580.159.04, kernel 6.18), read on 2026-12-01.
PROC_DEVICES_580 = """Character devices:
  1 mem
  4 /dev/vc/0
  4 tty
  5 /dev/tty
 10 misc
136 pts
195 nvidia
195 nvidiactl
203 cpu/cpuid
238 nvidia-uvm
239 nvidia-nvswitch
240 nvidia-nvlink
241 nvidia-caps
242 nvidia-caps-imex-channels
243 hidraw
254 ndctl

Block devices:
  7 loop
253 zram
254 virtblk
"""
# Its NVIDIA device nodes and their majors (`stat -c '%n %t'`).
NODES_580 = {
    "/dev/nvidia0": 195,
    "/dev/nvidiactl": 195,
    "/dev/nvidia-uvm": 238,
    "/dev/nvidia-uvm-tools": 238,
    "/dev/nvidia-caps/nvidia-cap1": 241,
    "/dev/nvidia-caps/nvidia-cap2": 241,
}
# What the units allowed before issue 16: `nvidia-frontend` is no group of driver 580.
OLD_SERVER_LIST = [
    "char-nvidiactl rw",
    "char-nvidia-frontend rw",
    "char-nvidia-uvm rw",
    "char-nvidia-caps rw",
    "char-nvidia-modeset rw",
    "char-nvidia-nvswitch rw",
]

CUDA_PAIR = """
all:
  vars:
    driver: {source: preinstalled}
    cuda: {source: preinstalled, version: "13.0", nvcc: /usr/local/cuda/bin/nvcc}
    gpus: [{name: NVIDIA H200, vram_mib: 143771, compute_capability: "9.0"}]
  children:
    rpc_heads:
      hosts:
        head:
          ssh: {host: 10.0.0.10}
          rpc: {workers: [worker]}
          model: {path: /srv/m.gguf}
    rpc_workers:
      hosts:
        worker:
          ssh: {host: 10.0.0.11}
          rpc: {host: 10.0.0.11}
"""


def device_allow_lines(unit: str) -> list[str]:
    return [line for line in unit.splitlines() if line.startswith("DeviceAllow=")]


@pytest.fixture
def cuda_pair(write_inventory):
    inventory = load_inventory(write_inventory(CUDA_PAIR))
    return inventory.hosts["head"].data, inventory.hosts["worker"].data


def test_server_and_worker_units_allow_exactly_the_nvidia_groups(cuda_pair):
    head, worker = cuda_pair
    expected = [f"DeviceAllow=char-{group} rw" for group in render.NVIDIA_DEVICE_GROUPS]
    server_unit, worker_unit = render.render_unit(head), render.render_rpc_unit(worker)
    assert device_allow_lines(server_unit) == expected
    assert device_allow_lines(worker_unit) == expected
    assert "DevicePolicy=closed" in server_unit and "DevicePolicy=closed" in worker_unit
    assert "nvidia-frontend" not in server_unit + worker_unit


def test_cpu_units_allow_no_device():
    hosts = load_inventory(PROJECT / "inventory" / "sandbox-rpc.yml").hosts
    for unit in (
        render.render_unit(hosts["rpc-head"].data),
        render.render_rpc_unit(hosts["rpc-worker"].data),
    ):
        assert "DevicePolicy=closed" in unit
        assert device_allow_lines(unit) == []


def test_the_groups_are_driver_580s_and_cover_every_node_cuda_opens(cuda_pair):
    head, _ = cuda_pair
    allowed = [value.removeprefix("DeviceAllow=") for value in render.device_allow(head)]
    assert device_access_problems(allowed, PROC_DEVICES_580, NODES_580) == []
    # Nothing beyond those majors: not the fabric manager's, the display's or IMEX's groups.
    groups = char_device_groups(PROC_DEVICES_580)
    allowed_majors = {major for group in render.NVIDIA_DEVICE_GROUPS for major in groups[group]}
    assert allowed_majors == {195, 238, 241}


def test_the_old_list_is_caught_by_its_stale_names():
    problems = device_access_problems(OLD_SERVER_LIST, PROC_DEVICES_580, NODES_580)
    assert len(problems) == 2, problems
    assert (
        "DeviceAllow=char-nvidia-frontend names a group /proc/devices does not list"
        in (problems[0])
    )
    assert "char-nvidia-modeset" in problems[1] and "systemd ignores it" in problems[1]


def test_a_node_no_group_covers_is_named():
    without_uvm = ["char-nvidia rw", "char-nvidiactl rw", "char-nvidia-caps rw"]
    problems = device_access_problems(without_uvm, PROC_DEVICES_580, NODES_580)
    assert problems == [
        "the unit cannot open /dev/nvidia-uvm (major 238, nvidia-uvm in /proc/devices): "
        "no DeviceAllow= entry covers it",
        "the unit cannot open /dev/nvidia-uvm-tools (major 238, nvidia-uvm in /proc/devices): "
        "no DeviceAllow= entry covers it",
    ]


def test_patterns_and_paths_are_matched_as_systemd_does():
    # systemd matches a group name as a pattern against /proc/devices; a path allows one node.
    assert device_access_problems(["char-nvidia* rw"], PROC_DEVICES_580, NODES_580) == []
    by_path = ["char-nvidia* rw", "/dev/vda r"]
    assert device_access_problems(by_path, PROC_DEVICES_580, {"/dev/vda": 254}) == []
    assert device_access_problems(["char-nvidia* rw"], PROC_DEVICES_580, {"/dev/vda": 254}) == [
        "the unit cannot open /dev/vda (major 254, ndctl in /proc/devices): "
        "no DeviceAllow= entry covers it"
    ]


def test_char_device_groups_reads_only_character_devices():
    groups = char_device_groups(PROC_DEVICES_580)
    assert groups["nvidia"] == groups["nvidiactl"] == {195}
    assert groups["nvidia-uvm"] == {238}
    # virtblk (254) is a block device; ndctl shares the number as a character device.
    assert "virtblk" not in groups and "loop" not in groups
    assert groups["ndctl"] == {254}
