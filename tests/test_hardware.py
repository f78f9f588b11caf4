import pytest

from llamarig.tables.hardware import (
    ARCHITECTURE_FLOORS,
    PCI_DEVICES,
    check_versions,
    cuda_architecture,
    cuda_architectures,
    gpu_from_pci_id,
    parse_version,
    toolkit_driver_floor,
)


def test_cuda_architecture_rewrites_12x_to_arch_specific():
    assert cuda_architecture("8.6") == "86-real"
    assert cuda_architecture("12.0") == "120a-real"
    assert cuda_architecture("9.0") == "90-real"


def test_cuda_architectures_lowest_first_without_duplicates():
    assert cuda_architectures(["12.0", "8.6", "12.0"]) == "86-real;120a-real"


@pytest.mark.parametrize(
    ("device_id", "name", "vram_mib", "cc"),
    [
        (0x2204, "GeForce RTX 3090", 24576, "8.6"),
        (0x2684, "GeForce RTX 4090", 24564, "8.9"),
        (0x2786, "GeForce RTX 4070", 12282, "8.9"),
        (0x2B85, "GeForce RTX 5090", 32607, "12.0"),
        (0x2C02, "GeForce RTX 5080", 16303, "12.0"),
        (0x27B8, "L4", 23034, "8.9"),
        (0x2335, "H200", 143771, "9.0"),
        (0x2901, "B200", 183359, "10.0"),
    ],
)
def test_pci_table(device_id, name, vram_mib, cc):
    gpu = gpu_from_pci_id(device_id)
    assert (gpu.name, gpu.vram_mib, gpu.compute_capability) == (name, vram_mib, cc)


def test_pci_id_forms():
    assert gpu_from_pci_id("2204") == gpu_from_pci_id(0x2204)
    assert gpu_from_pci_id("0x2c02").name == "GeForce RTX 5080"
    assert gpu_from_pci_id("10de:2c02").name == "GeForce RTX 5080"
    assert gpu_from_pci_id("1002:2c02") is None  # another vendor
    assert gpu_from_pci_id(0x1234) is None


def test_every_family_the_planner_names_is_covered():
    families = {gpu.compute_capability for gpu in PCI_DEVICES.values()}
    assert {"7.5", "8.0", "8.6", "8.9", "9.0", "10.0", "12.0"} <= families
    assert families <= set(ARCHITECTURE_FLOORS)


def test_versions_compare_as_int_tuples():
    assert parse_version("570.26") == parse_version("570.26.0")
    assert parse_version("580.65.06") > parse_version("580.9")
    assert parse_version("12.10") > parse_version("12.9")


def test_toolkit_driver_floors():
    assert toolkit_driver_floor("12.8") == "570.26"
    assert toolkit_driver_floor("12.6") == "550.54.14"  # between rows: the lower row's floor
    assert toolkit_driver_floor("13.0") == "580.65.06"
    assert toolkit_driver_floor("10.2") is None


SEED = ["8.6", "12.0"]


def test_seed_rig_with_nvidia_packages_is_fine():
    assert check_versions(SEED, "12.8", "570.26", True, "nvidia", "nvidia") == []
    assert check_versions(SEED, "13.0", "580.65.06", True, "nvidia", "nvidia") == []


def test_toolkit_too_old_for_sm_120():
    problems = check_versions(SEED, "12.4", "570.26", True, "nvidia", "nvidia")
    assert problems == ["CUDA 12.4 cannot build for sm_120 (Blackwell): it needs CUDA >= 12.8"]


def test_driver_too_old_for_toolkit():
    problems = check_versions(["8.6"], "13.0", "575.51.03", False, "nvidia", "nvidia")
    assert problems == [
        "driver 575.51.03 is too old for CUDA 13.0: it needs >= 580.65.06"
        " (or pick an older toolkit)"
    ]


def test_driver_too_old_for_architecture():
    problems = check_versions(["12.0"], None, "565.57.01", True, "nvidia", "nvidia")
    assert len(problems) == 1 and "needs >= 570.26" in problems[0]


def test_blackwell_with_proprietary_modules():
    problems = check_versions(SEED, "12.8", "570.26", False, "nvidia", "nvidia")
    assert len(problems) == 1
    assert "open kernel modules" in problems[0] and "nvidia-open" in problems[0]


def test_cuda_13_drops_pre_turing():
    problems = check_versions(["6.1", "8.6"], "13.0", "580.65.06", False, "nvidia", "nvidia")
    assert problems == ["CUDA 13.0 dropped compute capability below 7.5 (6.1): use CUDA 12.x"]


def test_open_modules_need_turing():
    problems = check_versions(["6.1"], "12.4", "550.54.14", True, "nvidia", "nvidia")
    assert len(problems) == 1 and "Turing (7.5)" in problems[0]


def test_distro_packages_cannot_serve_blackwell():
    problems = check_versions(SEED, None, None, True, "distro", "distro")
    assert len(problems) == 2
    assert "Debian's packaged driver" in problems[0] and "NVIDIA's repository" in problems[0]
    assert "nvidia-cuda-toolkit" in problems[1] and "12.8" in problems[1]


def test_distro_packages_serve_ampere():
    assert check_versions(["8.6"], "12.4", "550.163.01", True, "distro", "distro") == []
