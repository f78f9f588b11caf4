"""The device code of a real CUDA build, as the fleet's packing reads it: on the GPU machine,
libggml-cuda of the pinned llama.cpp built for one architecture with the machine's toolkit
(bench/cuda_pack_check.sh), packed by the builder's own command (build_archive.pack_command,
the toolkit's cuobjdump), kept in a fresh cache when it holds code for the architectures its
options name and refused when they name one it lacks; a rig of each GPU generation is asked
whether the binary runs on it. Writes results.json to $OUT.

python3 bench/cuda_pack_check.py BUILD_DIR ARCHITECTURES CUOBJDUMP
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from llamarig.onhost import build_archive
from llamarig.tables.hardware import architecture_runs_on

KEY = "0c1e57098bba-0000000000-000000000000"


def main(build_dir: str, architectures: str, cuobjdump: str) -> dict:
    out = Path(os.environ["OUT"])
    work = Path(tempfile.mkdtemp())
    os.environ["LLAMARIG_BUILD_CACHE"] = str(work / "cache")
    archive, sums, elf = (work / f"build.{suffix}" for suffix in ("tar", "sha256", "elf"))
    command = build_archive.pack_command(build_dir, str(archive), str(sums), cuobjdump, str(elf))
    packed = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
    listing = elf.read_text() if elf.exists() else ""
    found = build_archive.elf_architectures(listing)
    results = {
        "pack_rc": packed.returncode,
        "pack_stderr": packed.stderr[-2000:],
        "cuobjdump_lines": listing.splitlines()[:12],
        "cubins": listing.count("ELF file"),
        "binary_architectures": found,
        "configured": architectures,
    }
    kept = build_archive.store(KEY, archive, sums.read_text(), "b", "p", architectures, listing)
    results["kept"] = {"files": len(kept.files), "binary": kept.binary_architectures}
    archive2 = work / "again.tar"
    shutil.copy(work / "cache" / KEY / build_archive.ARCHIVE, archive2)
    # The options naming one more architecture than the binary holds: refused.
    absent = next(
        a
        for a in ("75-real", "86-real", "90-real")
        if build_archive.unbuilt_architectures(a, found)
    )
    wider = f"{absent};{architectures}"
    try:
        build_archive.store(KEY, archive2, sums.read_text(), "b", "p", wider, listing)
        results["wider_refused"] = None
    except build_archive.CachedBuildError as error:
        results["wider_refused"] = str(error)
    results["runs_on"] = {
        capability: any(architecture_runs_on(f"{sm[3:]}-real", capability) for sm in found)
        for capability in ("8.6", "8.9", "9.0", "10.0", "12.0")
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(*sys.argv[1:])
