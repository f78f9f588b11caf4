import os
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent


@pytest.fixture
def project() -> Path:
    return PROJECT


@pytest.fixture
def write_inventory(tmp_path):
    """Write an inventory YAML file and return its path."""

    def write(text: str, name: str = "hosts.yml") -> Path:
        path = tmp_path / name
        path.write_text(text)
        return path

    return write


def pyinfra_env(**extra) -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}:{env['PATH']}"
    env.update(extra)
    return env
