"""llamarig: provision and plan llama.cpp inference rigs on NVIDIA GPUs with pyinfra."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
PROJECT_DIR = PACKAGE_DIR.parent
CACHE_DIR = Path("/var/cache/llamarig")
