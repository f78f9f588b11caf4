"""NVIDIA hardware facts: compute capabilities, CUDA architectures, version floors."""

from collections.abc import Iterable


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
