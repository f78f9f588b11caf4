"""llamarig: provision and plan llama.cpp inference rigs on NVIDIA GPUs with pyinfra."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_DIR = PACKAGE_DIR.parent
CACHE_DIR = Path("/var/cache/llamarig")


def project_dir(name: str) -> Path:
    """The project's directory ``name`` (group_data, files): the copy an installed package
    carries inside itself (pyproject.toml maps it there), else the source checkout's own."""
    installed = PACKAGE_DIR / name
    return installed if installed.is_dir() else PROJECT_DIR / name
