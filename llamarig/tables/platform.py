"""Pure knowledge of the operating systems llamarig supports (read from pyinfra's
LinuxDistribution fact)."""

from __future__ import annotations

# (ID, VERSION_ID) -> NVIDIA CUDA repository directory name.
SUPPORTED = {
    ("debian", "12"): "debian12",
    ("debian", "13"): "debian13",
    ("ubuntu", "22.04"): "ubuntu2204",
    ("ubuntu", "24.04"): "ubuntu2404",
}


def os_key(distribution: dict) -> tuple[str, str]:
    meta = distribution.get("release_meta") or {}
    return (meta.get("ID", "").lower(), meta.get("VERSION_ID", ""))


def os_problems(distribution: dict, arch: str) -> list[str]:
    """Why this OS cannot be a rig, or [] when it can."""
    problems = []
    key = os_key(distribution)
    if key not in SUPPORTED:
        pretty = (distribution.get("release_meta") or {}).get("PRETTY_NAME") or "unknown OS"
        supported = ", ".join(f"{name.capitalize()} {version}" for name, version in SUPPORTED)
        problems.append(f"{pretty} is not supported; supported: {supported}")
    if arch not in ("x86_64", "amd64"):
        problems.append(f"architecture {arch} is not supported; llamarig provisions x86_64 hosts")
    return problems


def nvidia_repo_dir(distribution: dict) -> str:
    return SUPPORTED[os_key(distribution)]


def codename(distribution: dict) -> str:
    return (distribution.get("release_meta") or {}).get("VERSION_CODENAME", "")


def is_debian(distribution: dict) -> bool:
    return os_key(distribution)[0] == "debian"
