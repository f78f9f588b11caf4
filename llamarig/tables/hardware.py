"""NVIDIA hardware facts: compute capabilities, CUDA architectures, version floors.

One table per fact family; the functions below only look things up in them.
"""

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatchcase


def cuda_architecture(compute_capability: str) -> str:
    """One CMake CUDA architecture with real SASS for a compute capability.

    llama.cpp rewrites any plain ``12X`` to ``12Xa`` (the arch-specific feature set), so the
    list states it that way to match what gets built: ``"12.0"`` -> ``"120a-real"``.
    """
    major, minor = compute_capability.split(".")
    arch = f"{int(major)}{int(minor)}"
    if int(major) == 12:
        arch += "a"
    return f"{arch}-real"


def cuda_architectures(compute_capabilities: Iterable[str]) -> str:
    """The ``CMAKE_CUDA_ARCHITECTURES`` value covering every GPU, lowest first, no duplicates."""
    unique = sorted(set(compute_capabilities), key=lambda cc: tuple(int(p) for p in cc.split(".")))
    return ";".join(cuda_architecture(cc) for cc in unique)


# --- GPUs by PCI device id -------------------------------------------------------------------

NVIDIA_PCI_VENDOR = 0x10DE


@dataclass(frozen=True)
class GpuModel:
    name: str
    vram_mib: int  # memory.total as nvidia-smi reports it
    compute_capability: str


# Device ids and names: the PCI ID Repository (pci.ids, pciutils/pciids). VRAM: nvidia-smi's
# memory.total where public nvidia-smi output was found for the card (marked "seen"), otherwise
# the nominal size in MiB, which nvidia-smi reports a few MiB lower on most cards.
PCI_DEVICES: dict[int, GpuModel] = {
    # Turing, 7.5
    0x1E02: GpuModel("TITAN RTX", 24576, "7.5"),
    0x1E04: GpuModel("GeForce RTX 2080 Ti", 11264, "7.5"),
    0x1E07: GpuModel("GeForce RTX 2080 Ti", 11264, "7.5"),
    0x1E81: GpuModel("GeForce RTX 2080 SUPER", 8192, "7.5"),
    0x1E82: GpuModel("GeForce RTX 2080", 8192, "7.5"),
    0x1E87: GpuModel("GeForce RTX 2080", 8192, "7.5"),
    0x1E84: GpuModel("GeForce RTX 2070 SUPER", 8192, "7.5"),
    0x1F02: GpuModel("GeForce RTX 2070", 8192, "7.5"),
    0x1F07: GpuModel("GeForce RTX 2070", 8192, "7.5"),
    0x1F06: GpuModel("GeForce RTX 2060 SUPER", 8192, "7.5"),
    0x1F08: GpuModel("GeForce RTX 2060", 6144, "7.5"),
    0x1F03: GpuModel("GeForce RTX 2060 12GB", 12288, "7.5"),
    0x1EB8: GpuModel("Tesla T4", 15360, "7.5"),
    # Ampere datacenter, 8.0
    0x20B0: GpuModel("A100 SXM4 40GB", 40960, "8.0"),  # seen
    0x20F1: GpuModel("A100 PCIe 40GB", 40960, "8.0"),
    0x20B2: GpuModel("A100 SXM4 80GB", 81920, "8.0"),
    0x20B5: GpuModel("A100 PCIe 80GB", 81920, "8.0"),
    # Ampere GA10x, 8.6
    0x2204: GpuModel("GeForce RTX 3090", 24576, "8.6"),  # seen
    0x2203: GpuModel("GeForce RTX 3090 Ti", 24564, "8.6"),
    0x2208: GpuModel("GeForce RTX 3080 Ti", 12288, "8.6"),
    0x2206: GpuModel("GeForce RTX 3080", 10240, "8.6"),
    0x2216: GpuModel("GeForce RTX 3080 LHR", 10240, "8.6"),
    0x220A: GpuModel("GeForce RTX 3080 12GB", 12288, "8.6"),
    0x2482: GpuModel("GeForce RTX 3070 Ti", 8192, "8.6"),
    0x2484: GpuModel("GeForce RTX 3070", 8192, "8.6"),
    0x2488: GpuModel("GeForce RTX 3070 LHR", 8192, "8.6"),
    0x2486: GpuModel("GeForce RTX 3060 Ti", 8192, "8.6"),
    0x2489: GpuModel("GeForce RTX 3060 Ti LHR", 8192, "8.6"),
    0x2503: GpuModel("GeForce RTX 3060", 12288, "8.6"),  # seen
    0x2504: GpuModel("GeForce RTX 3060 LHR", 12288, "8.6"),
    0x2544: GpuModel("GeForce RTX 3060", 12288, "8.6"),
    0x2487: GpuModel("GeForce RTX 3060", 12288, "8.6"),
    0x24B0: GpuModel("RTX A4000", 16376, "8.6"),
    0x2232: GpuModel("RTX A4500", 20470, "8.6"),
    0x2231: GpuModel("RTX A5000", 24564, "8.6"),
    0x2230: GpuModel("RTX A6000", 49140, "8.6"),  # seen
    0x2235: GpuModel("A40", 46068, "8.6"),
    0x2236: GpuModel("A10", 23028, "8.6"),
    # Ada, 8.9
    0x2684: GpuModel("GeForce RTX 4090", 24564, "8.9"),  # seen
    0x2685: GpuModel("GeForce RTX 4090 D", 24564, "8.9"),
    0x2704: GpuModel("GeForce RTX 4080", 16376, "8.9"),  # seen
    0x2702: GpuModel("GeForce RTX 4080 SUPER", 16376, "8.9"),
    0x2705: GpuModel("GeForce RTX 4070 Ti SUPER", 16376, "8.9"),
    0x2782: GpuModel("GeForce RTX 4070 Ti", 12282, "8.9"),
    0x2783: GpuModel("GeForce RTX 4070 SUPER", 12282, "8.9"),
    0x2786: GpuModel("GeForce RTX 4070", 12282, "8.9"),  # seen
    0x2803: GpuModel("GeForce RTX 4060 Ti", 8188, "8.9"),
    0x2805: GpuModel("GeForce RTX 4060 Ti 16GB", 16380, "8.9"),
    0x2882: GpuModel("GeForce RTX 4060", 8188, "8.9"),
    0x2808: GpuModel("GeForce RTX 4060", 8188, "8.9"),
    0x26B1: GpuModel("RTX 6000 Ada Generation", 49140, "8.9"),  # seen
    0x26B5: GpuModel("L40", 46068, "8.9"),
    0x26B9: GpuModel("L40S", 46068, "8.9"),  # seen
    0x27B8: GpuModel("L4", 23034, "8.9"),
    # Hopper, 9.0
    0x2330: GpuModel("H100 SXM5 80GB", 81559, "9.0"),  # seen
    0x2331: GpuModel("H100 PCIe", 81559, "9.0"),
    0x2321: GpuModel("H100 NVL", 95830, "9.0"),
    0x2335: GpuModel("H200", 143771, "9.0"),  # seen
    # Blackwell datacenter, 10.0
    0x2901: GpuModel("B200", 183359, "10.0"),  # seen
    # Blackwell GB20x, 12.0
    0x2B85: GpuModel("GeForce RTX 5090", 32607, "12.0"),  # seen
    0x2B87: GpuModel("GeForce RTX 5090 D", 32607, "12.0"),
    0x2C02: GpuModel("GeForce RTX 5080", 16303, "12.0"),  # seen
    0x2C05: GpuModel("GeForce RTX 5070 Ti", 16303, "12.0"),
    0x2F04: GpuModel("GeForce RTX 5070", 12227, "12.0"),  # seen
    0x2BB1: GpuModel("RTX PRO 6000 Blackwell Workstation Edition", 97887, "12.0"),
}


# Memory bandwidth in GB/s from NVIDIA's data sheets, by the name nvidia-smi reports (a suffix
# match, so "NVIDIA GeForce RTX 3090" finds "RTX 3090"): the decode roofline of `llamarig tune`.
MEMORY_BANDWIDTH_GBS = {
    "RTX 3090": 936,
    "RTX 3090 Ti": 1008,
    "RTX 4090": 1008,
    "RTX 4080": 717,
    "RTX 5090": 1792,
    "RTX 5080": 960,
    "RTX 5070 Ti": 896,
    "A100 SXM4 80GB": 2039,
    "A100-SXM4-80GB": 2039,
    "H100 80GB HBM3": 3350,
    "H100 SXM5 80GB": 3350,
    "H200": 4800,
    "L40S": 864,
}


def memory_bandwidth_gbs(name: str) -> int | None:
    """The data-sheet memory bandwidth of a GPU by its name, or None when llamarig lacks it."""
    matches = [key for key in MEMORY_BANDWIDTH_GBS if name.endswith(key)]
    return MEMORY_BANDWIDTH_GBS[max(matches, key=len)] if matches else None


def gpu_from_pci_id(device_id: int | str) -> GpuModel | None:
    """The GPU for an NVIDIA PCI device id: ``0x2204``, ``"2204"`` or lspci's ``"10de:2204"``."""
    if isinstance(device_id, str):
        text = device_id.strip().lower()
        vendor, _, device = text.rpartition(":")
        if vendor and int(vendor, 16) != NVIDIA_PCI_VENDOR:
            return None
        device_id = int(device, 16)
    return PCI_DEVICES.get(device_id)


def gpus_from_pci(devices: list[dict]) -> tuple[list[dict], list[str]]:
    """GPU records from PCI device ids (before a driver exists); unknown ids become warnings."""
    gpus, warnings = [], []
    for device in devices:
        model = gpu_from_pci_id(device["device_id"])
        if model is None:
            warnings.append(
                f"PCI device 10de:{device['device_id'][2:]} at {device['bus_id']} is not in "
                "llamarig's table; declare it in `gpus`"
            )
            continue
        gpus.append(
            {
                "name": model.name,
                "vram_mib": model.vram_mib,
                "compute_capability": model.compute_capability,
                "bus_id": device["bus_id"],
            }
        )
    return gpus, warnings


# --- version floors --------------------------------------------------------------------------

Version = tuple[int, ...]


def parse_version(text: str) -> Version:
    """``"580.65.06"`` -> ``(580, 65, 6)``, padded to three parts so that 570.26 == 570.26.0."""
    parts = tuple(int(p) for p in text.strip().split("."))
    return parts + (0,) * (3 - len(parts))


@dataclass(frozen=True)
class ArchitectureFloor:
    family: str
    first_cuda: str
    min_driver: str  # Linux


# compute capability -> first CUDA toolkit that targets it and the Linux driver that runs it.
# 8.6-12.1: GUIDE §2. 7.5 and 8.0: the CUDA 10.0 and 11.0 release notes.
ARCHITECTURE_FLOORS: dict[str, ArchitectureFloor] = {
    "7.5": ArchitectureFloor("Turing", "10.0", "410.48"),
    "8.0": ArchitectureFloor("Ampere (A100)", "11.0", "450.51.05"),
    "8.6": ArchitectureFloor("Ampere", "11.1", "455.23"),
    "8.9": ArchitectureFloor("Ada", "11.8", "520.61.05"),
    "9.0": ArchitectureFloor("Hopper", "11.8", "520.61.05"),
    "10.0": ArchitectureFloor("Blackwell", "12.8", "570.26"),
    "12.0": ArchitectureFloor("Blackwell", "12.8", "570.26"),
    "10.3": ArchitectureFloor("Blackwell", "12.9", "575.51.03"),
    "12.1": ArchitectureFloor("Blackwell", "12.9", "575.51.03"),
}

# CUDA toolkit -> minimum Linux driver (CUDA release notes, table 3). A version between two
# rows needs at least the lower row's driver.
TOOLKIT_DRIVER_FLOORS: dict[str, str] = {
    "11.0": "450.51.05",
    "11.1": "455.23",
    "11.8": "520.61.05",
    "12.0": "525.60.13",
    "12.4": "550.54.14",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}

# CUDA 13.0 removed every target below Turing; the open kernel modules start at Turing too.
CUDA13_MIN_CAPABILITY = "7.5"
OPEN_MODULES_MIN_CAPABILITY = "7.5"
BLACKWELL_MAJORS = (10, 12)

# What Debian itself packages (GUIDE §2); neither can serve Blackwell.
DISTRO_DRIVER_NOTE = "Debian's packaged driver (535 in bookworm, 550 in trixie)"
DISTRO_TOOLKIT_NOTE = "Debian's nvidia-cuda-toolkit (11.8 in bookworm, 12.4 in trixie)"


def is_blackwell(compute_capability: str) -> bool:
    return parse_version(compute_capability)[0] in BLACKWELL_MAJORS


def toolkit_driver_floor(cuda_version: str) -> str | None:
    """The minimum Linux driver for a CUDA toolkit version, or None if older than the table."""
    wanted = parse_version(cuda_version)
    floors = [v for v in TOOLKIT_DRIVER_FLOORS if parse_version(v) <= wanted]
    return TOOLKIT_DRIVER_FLOORS[max(floors, key=parse_version)] if floors else None


class Shortfall(Enum):
    """What keeps a driver/toolkit choice from serving a rig's GPUs."""

    UNKNOWN_CAPABILITY = "a compute capability newer than ARCHITECTURE_FLOORS"
    CUDA_TOO_OLD = "the toolkit cannot build for an architecture"
    CUDA_DROPPED = "the toolkit dropped an architecture"
    DRIVER_TOO_OLD = "the driver is below a floor"
    NEEDS_OPEN_MODULES = "Blackwell with the proprietary kernel modules"
    OPEN_NEEDS_TURING = "the open kernel modules on a GPU before Turing"
    DISTRO_DRIVER = "the distribution's driver for Blackwell"
    DISTRO_TOOLKIT = "the distribution's toolkit for Blackwell"


@dataclass(frozen=True)
class VersionFinding:
    """One shortfall, as data: the plan, the driver stage and the rig checks word it for what
    they probed, the config loader with the key path to fix."""

    kind: Shortfall
    capabilities: tuple[str, ...]  # the compute capabilities it concerns (none: the toolkit's)
    needed: str = ""  # the version that would do: CUDA (CUDA_TOO_OLD) or driver (DRIVER_TOO_OLD)
    what: str = ""  # the architecture family, or what needs the driver floor


def version_findings(
    compute_capabilities: Iterable[str],
    cuda_version: str | None,
    driver_version: str | None,
    open_modules: bool | None,
    driver_source: str,
    cuda_source: str,
) -> list[VersionFinding]:
    """What keeps a driver/toolkit choice from serving these GPUs; [] means OK.

    ``cuda_version``/``driver_version`` None means not chosen yet, ``open_modules`` None no
    driver installed (their checks are skipped); ``driver_source``/``cuda_source`` are
    ``"distro"`` for the distribution's packages (anything else: NVIDIA's)."""
    capabilities = sorted(set(compute_capabilities), key=parse_version)
    blackwell = tuple(cc for cc in capabilities if is_blackwell(cc))
    findings: list[VersionFinding] = []

    def below(floor: str) -> tuple[str, ...]:
        return tuple(cc for cc in capabilities if parse_version(cc) < parse_version(floor))

    for cc in capabilities:
        if cc not in ARCHITECTURE_FLOORS and parse_version(cc) > parse_version("12.1"):
            findings.append(VersionFinding(Shortfall.UNKNOWN_CAPABILITY, (cc,)))
    if cuda_version is not None:
        cuda = parse_version(cuda_version)
        for cc in capabilities:
            floor = ARCHITECTURE_FLOORS.get(cc)
            if floor and cuda < parse_version(floor.first_cuda):
                findings.append(
                    VersionFinding(Shortfall.CUDA_TOO_OLD, (cc,), floor.first_cuda, floor.family)
                )
        if cuda >= parse_version("13.0") and below(CUDA13_MIN_CAPABILITY):
            findings.append(VersionFinding(Shortfall.CUDA_DROPPED, below(CUDA13_MIN_CAPABILITY)))
    if driver_version is not None:
        for needed, what, needed_by in driver_floors(capabilities, cuda_version):
            if parse_version(driver_version) < parse_version(needed):
                findings.append(VersionFinding(Shortfall.DRIVER_TOO_OLD, needed_by, needed, what))
    if blackwell and open_modules is not None and not open_modules:
        findings.append(VersionFinding(Shortfall.NEEDS_OPEN_MODULES, blackwell))
    if open_modules and below(OPEN_MODULES_MIN_CAPABILITY):
        findings.append(
            VersionFinding(Shortfall.OPEN_NEEDS_TURING, below(OPEN_MODULES_MIN_CAPABILITY))
        )
    if blackwell and driver_source == "distro":
        findings.append(VersionFinding(Shortfall.DISTRO_DRIVER, blackwell))
    if blackwell and cuda_source == "distro":
        findings.append(VersionFinding(Shortfall.DISTRO_TOOLKIT, blackwell))
    return findings


def chosen_versions(data: dict) -> dict:
    """The toolkit and driver choice of rig data, as `version_findings` and `check_versions`
    take it (all but the GPUs and the installed driver's version)."""
    cuda, driver = data["cuda"], data["driver"]
    return {
        "cuda_version": cuda["version"] if cuda["source"] != "none" else None,
        "open_modules": driver["open"],
        "driver_source": driver["source"],
        "cuda_source": cuda["source"],
    }


def check_versions(
    compute_capabilities: Iterable[str],
    cuda_version: str | None,
    driver_version: str | None,
    open_modules: bool,
    driver_source: str,
    cuda_source: str,
) -> list[str]:
    """Problems with a driver/toolkit choice for these GPUs, each with its fix; [] means OK
    (`version_findings` worded for what was probed on a host)."""
    findings = version_findings(
        compute_capabilities, cuda_version, driver_version, open_modules, driver_source, cuda_source
    )
    return [_worded(finding, cuda_version, driver_version) for finding in findings]


def _worded(finding: VersionFinding, cuda_version: str | None, driver_version: str | None) -> str:
    listed = ", ".join(finding.capabilities)
    match finding.kind:
        case Shortfall.UNKNOWN_CAPABILITY:
            return f"compute capability {listed} is newer than this table knows; check it"
        case Shortfall.CUDA_TOO_OLD:
            return (
                f"CUDA {cuda_version} cannot build for sm_{listed.replace('.', '')} "
                f"({finding.what}): it needs CUDA >= {finding.needed}"
            )
        case Shortfall.CUDA_DROPPED:
            return (
                f"CUDA {cuda_version} dropped compute capability below "
                f"{CUDA13_MIN_CAPABILITY} ({listed}): use CUDA 12.x"
            )
        case Shortfall.DRIVER_TOO_OLD:
            fix = "" if finding.capabilities else " (or pick an older toolkit)"
            return (
                f"driver {driver_version} is too old for {finding.what}: it needs >= "
                f"{finding.needed}{fix}"
            )
        case Shortfall.NEEDS_OPEN_MODULES:
            return (
                f"Blackwell GPUs ({listed}) work only with the open kernel modules: "
                "install nvidia-open, not the proprietary cuda-drivers"
            )
        case Shortfall.OPEN_NEEDS_TURING:
            return (
                f"the open kernel modules need Turing (7.5) or newer, not {listed}: "
                "use the proprietary modules"
            )
        case Shortfall.DISTRO_DRIVER:
            return (
                f"{DISTRO_DRIVER_NOTE} cannot drive Blackwell (needs >= 570.26 with open "
                "modules): install the driver from NVIDIA's repository"
            )
        case Shortfall.DISTRO_TOOLKIT:
            return (
                f"{DISTRO_TOOLKIT_NOTE} cannot build for Blackwell (needs CUDA >= 12.8): "
                "install the toolkit from NVIDIA's repository"
            )


def driver_floors(
    compute_capabilities: Iterable[str], cuda_version: str | None
) -> list[tuple[str, str, tuple[str, ...]]]:
    """The least Linux driver each part of a rig needs: (version, what needs it, the compute
    capabilities it is for), for the toolkit (``cuda_version``; None: no toolkit, and its row
    names no capability) and each GPU's architecture."""
    floors = []
    if cuda_version is not None:
        needed = toolkit_driver_floor(cuda_version)
        if needed:
            floors.append((needed, f"CUDA {cuda_version}", ()))
    for cc in sorted(set(compute_capabilities), key=parse_version):
        floor = ARCHITECTURE_FLOORS.get(cc)
        if floor:
            floors.append((floor.min_driver, f"compute capability {cc} ({floor.family})", (cc,)))
    return floors


# Words that differ between nvidia-smi and the PCI table ("NVIDIA GeForce RTX 3090" vs
# "GeForce RTX 3090"); names are compared without them.
VENDOR_WORDS = frozenset({"nvidia", "geforce"})


def _vendorless_words(name: str) -> list[str]:
    return [word for word in name.lower().split() if word not in VENDOR_WORDS]


def same_gpu_name(one: str, other: str) -> bool:
    return _vendorless_words(one) == _vendorless_words(other)


def gpu_named(name: str) -> GpuModel | None:
    """The table's GPU of that name (vendor words aside), or None when unknown."""
    for model in PCI_DEVICES.values():
        if same_gpu_name(model.name, name):
            return model
    return None


_ARCH = re.compile(r"^(\d+)(\d)([af]?)(-real|-virtual)?$")


def architecture_runs_on(arch: str, compute_capability: str) -> bool:
    """Whether one CMAKE_CUDA_ARCHITECTURES entry gives a GPU of ``compute_capability`` code
    that runs on it: SASS of the same major and a minor not above its own (an arch-specific
    ``a`` target only on its exact capability, a family ``f`` target on its major), after
    llama.cpp's rewrite of a plain ``12X`` to ``12Xa``. PTX alone (``-virtual``) does not
    count: an sm_120 card JIT-compiling another architecture's PTX gave gibberish (GUIDE
    §7.10)."""
    match = _ARCH.match(arch)
    if not match or match.group(4) == "-virtual":
        return False
    major, minor, variant = int(match.group(1)), int(match.group(2)), match.group(3)
    if major == 12 and not variant:
        variant = "a"
    gpu_major, gpu_minor = parse_version(compute_capability)[:2]
    if major != gpu_major or minor > gpu_minor:
        return False
    return variant != "a" or minor == gpu_minor


# --- device access of the hardened units (DevicePolicy=closed) -------------------------------


def char_device_groups(proc_devices: str) -> dict[str, set[int]]:
    """The character-device groups of a /proc/devices text: name -> majors. Several names may
    share a major (driver 580 lists 195 as both ``nvidia`` and ``nvidiactl``)."""
    groups: dict[str, set[int]] = {}
    in_char_section = False
    for line in proc_devices.splitlines():
        words = line.split()
        if line.startswith("Character devices:"):
            in_char_section = True
        elif line.startswith("Block devices:"):
            in_char_section = False
        elif in_char_section and len(words) == 2 and words[0].isdigit():
            groups.setdefault(words[1], set()).add(int(words[0]))
    return groups


def device_access_problems(
    allowed: Iterable[str], proc_devices: str, needed: dict[str, int]
) -> list[str]:
    """What is wrong with a unit's DeviceAllow= entries (``char-NAME rw`` or ``/dev/PATH rw``,
    as `systemctl show -P DeviceAllow` prints them) on a host with this /proc/devices, for the
    device nodes a CUDA process opens (``needed``: path -> major): group names the host does not
    list (systemd matches them as patterns against /proc/devices and silently drops a name
    that matches nothing), and needed nodes that no entry lets the unit open."""
    groups = char_device_groups(proc_devices)
    problems, majors, paths = [], set(), set()
    for entry in allowed:
        node = entry.split()[0]
        if node.startswith("/dev/"):
            paths.add(node)
            continue
        pattern = node.removeprefix("char-")
        matched = [name for name in groups if fnmatchcase(name, pattern)]
        if not matched:
            problems.append(
                f"DeviceAllow={node} names a group /proc/devices does not list (listed: "
                f"{', '.join(sorted(groups))}): systemd ignores it"
            )
        majors.update(major for name in matched for major in groups[name])
    for path, major in sorted(needed.items()):
        if path not in paths and major not in majors:
            names = sorted(name for name, group in groups.items() if major in group)
            problems.append(
                f"the unit cannot open {path} (major {major}, {'/'.join(names) or 'unlisted'} "
                "in /proc/devices): no DeviceAllow= entry covers it"
            )
    return problems


def pci_sort_key(bus_id: str) -> tuple[int, ...]:
    """Numeric order of a PCI bus id ("0000:01:00.0" or "00000000:01:00.0" or "01:00.0")."""
    domain, bus, rest = (["0000"] + bus_id.split(":"))[-3:]
    device, function = rest.split(".")
    return tuple(int(part, 16) for part in (domain, bus, device, function))
