"""What a llama.cpp build needs and left: commands on PATH, the build directories, the CUDA
toolkit's nvcc."""

from __future__ import annotations

import re
import shlex

from pyinfra.api import FactBase

from llamarig.onhost.hostpaths import (
    BUILD_COMPLETE_MARKER,
)


class MissingCommands(FactBase):
    """The commands of ``commands`` that are not on the host's PATH.

    .. code:: python

        ["ninja"]
    """

    def command(self, commands: list[str]) -> str:
        return (
            "for c in "
            + " ".join(shlex.quote(c) for c in commands)
            + ('; do command -v "$c" >/dev/null 2>&1 || echo "$c"; done; true')
        )

    def process(self, output: list[str]) -> list[str]:
        return [line.strip() for line in output if line.strip()]


class BuildDirectories(FactBase):
    """Build directories under ``path``, newest first (by their completion marker, else the
    directory itself).

    .. code:: python

        ["0c1e57098bba-1a2b3c4d5e", "b8f2e1a0c9d7-5e4d3c2b1a"]
    """

    # A fresh host has no builds directory: empty output, and pyinfra then takes the default.
    default = list

    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return (
            f"[ -d {quoted} ] && for d in {quoted}/*/; do d=${{d%/}}; "
            f'[ -d "$d" ] || continue; m="$d/{BUILD_COMPLETE_MARKER}"; [ -e "$m" ] || m="$d"; '
            'echo "$(stat -c %Y "$m") ${d##*/}"; done | sort -rn; true'
        )

    def process(self, output: list[str]) -> list[str]:
        return [line.split(" ", 1)[1] for line in output if " " in line.strip()]


class NvccVersion(FactBase):
    """The CUDA toolkit version of ``path`` (``nvcc --version``'s release), or None.

    .. code:: python

        "13.0"
    """

    def command(self, path: str = "/usr/local/cuda/bin/nvcc") -> str:
        release = r"s/.*release \([0-9.]*\),.*/\1/p"
        return f"{shlex.quote(path)} --version 2>/dev/null | sed -n '{release}'; true"

    def process(self, output: list[str]) -> str | None:
        version = output[0].strip() if output else ""
        return version if re.fullmatch(r"\d+\.\d+", version) else None


class CpuFlags(FactBase):
    """The CPU's feature flags (the first processor of /proc/cpuinfo), sorted: what a build
    with GGML_NATIVE (`-march=native`) is made for.

    .. code:: python

        ["avx", "avx2", "fma", "sse4_2"]
    """

    default = list

    def command(self) -> str:
        return "grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2; true"

    def process(self, output: list[str]) -> list[str]:
        return sorted({flag for line in output for flag in line.split() if flag.isprintable()})
