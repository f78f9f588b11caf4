"""Where the rig configuration lives: llamarig's own files (schema, documented defaults), the
inventory chosen by ``RIG_INVENTORY``, and the user's local files named in it."""

from __future__ import annotations

import os
from pathlib import Path

from llamarig import PACKAGE_DIR, PROJECT_DIR, project_dir

SCHEMA_PATH = PACKAGE_DIR / "schema.json"
# The documented defaults; group_data/GROUP.yml beside it holds each group's.
DEFAULTS_PATH = project_dir("group_data") / "all.yml"
DEFAULT_INVENTORY = "inventory/hosts.yml"
INVENTORY_ENV = "RIG_INVENTORY"


def inventory_path() -> Path:
    """The inventory file chosen by ``RIG_INVENTORY``, relative to the project by default."""
    chosen = Path(os.environ.get(INVENTORY_ENV) or DEFAULT_INVENTORY)
    if not chosen.is_absolute() and not chosen.exists():
        chosen = PROJECT_DIR / chosen
    return chosen


def expand_path(path: str) -> str:
    """``~`` and ``~user`` expanded; a path that cannot be (an unknown user) is kept as given."""
    try:
        return os.path.expanduser(path)
    except (ValueError, KeyError, OSError):
        return path


def local_file_text(path: str) -> str:
    """The start of a local key file, or "" when it is missing, unreadable or not a file."""
    try:
        if not os.path.isfile(path):
            return ""
        with open(path, encoding="utf-8", errors="replace") as key_file:
            return key_file.read(65536)
    except (OSError, ValueError):
        return ""
