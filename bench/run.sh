#!/bin/bash
# The GPU benchmark, one command on the project's two-H200 machine (see bench/RESULTS.md):
# it needs `.carry/llama.cpp.git` (a bare mirror of the pinned llama.cpp commit) and `.whl/`
# (pyinfra, testinfra, gguf and their wheels for the machine's Python) carried with the tree.
# Results go to $BENCH_OUT (default /srv/llamarig/out): results.json, overhead.json, logs/,
# RESULTS.md and decode.png, which are then committed under bench/.
set -euo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on the shared machine.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export OUT=${BENCH_OUT:-/srv/llamarig/out}
mkdir -p /srv/llamarig/models "$OUT"
rm -f "$OUT/EXIT"
trap 'echo $? > "$OUT/EXIT"' EXIT
[ -d /srv/llamarig/llama.cpp.git ] || cp -a .carry/llama.cpp.git /srv/llamarig/llama.cpp.git
python3 bench/gpu_bench.py
python3 bench/server_overhead.py
python3 bench/report.py "$OUT/results.json" "$OUT"
