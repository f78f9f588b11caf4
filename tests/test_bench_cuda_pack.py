"""bench/cuda_pack_check.py without a GPU: a build directory shaped like a CUDA build and a
cuobjdump stand-in printing the listing recorded from a real build (bench/runs/multiarch), so
the script the GPU machine runs is known to work before device time is spent on it."""

from __future__ import annotations

import json

from bench import cuda_pack_check
from tests.conftest import PROJECT

MULTIARCH = PROJECT / "bench" / "runs" / "multiarch" / "results.json"


def test_the_check_keeps_what_the_binary_holds_and_refuses_one_more(tmp_path, monkeypatch):
    build = tmp_path / "build"
    (build / "bin").mkdir(parents=True)
    (build / "bin" / "libggml-cuda.so").write_bytes(b"\x7fELF cuda")
    listing = tmp_path / "listing"
    listing.write_text("\n".join(json.loads(MULTIARCH.read_text())["build"]["cuobjdump"]) + "\n")
    stand_in = tmp_path / "cuobjdump"
    stand_in.write_text(f'#!/bin/sh\n[ "$1" = --list-elf ] && cat {listing}\n')
    stand_in.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    results = cuda_pack_check.main(str(build), "86-real;90-real;120a-real", str(stand_in))
    assert results["pack_rc"] == 0, results["pack_stderr"]
    assert results["kept"]["binary"] == ["sm_86", "sm_90", "sm_120a"]
    assert "not for sm_75" in results["wider_refused"]
    assert results["runs_on"] == {"8.6": True, "8.9": True, "9.0": True, "10.0": False,
                                  "12.0": True}  # fmt: skip
    assert json.loads((out / "results.json").read_text()) == results
