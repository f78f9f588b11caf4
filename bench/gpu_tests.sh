#!/bin/bash
# The GPU acceptance tests (tests/gpu, marker `gpu`), one command on the one-H200 machine: boot
# a Debian root with systemd as PID 1 there (llamarig_sandbox/systemdroot.py, GUIDE §8) and
# deploy into it over SSH as a user would, then check the rig (tests/gpu/test_h200_systemd.py
# says what, in order). Anywhere else the tests are skipped, saying why.
#
# Carried with the tree (git-ignored here), as for bench/systemd_h200.sh: the root's parts
# (.carry/systemd-root/, parts staged by an earlier call of the lease in /srv/llamarig/stash),
# .carry/llama.cpp.git and .whl/. pytest comes with the machine's image.
# Output: $BENCH_OUT (default /srv/llamarig/out-gpu-tests): pytest.log and logs/. Arguments go to
# pytest (e.g. -k router).
set -euo pipefail
DEFAULT_OUT=/srv/llamarig/out-gpu-tests
source "$(dirname "$0")/device-setup.sh"
export LLAMARIG_GPU_TESTS=1 GPU_TEST_LOGS=$OUT/logs
mkdir -p "$GPU_TEST_LOGS"
python3 -m pytest tests/gpu -m gpu -x -rs -v -p no:cacheprovider --durations=20 "$@" 2>&1 \
  | tee "$OUT/pytest.log"
exit "${PIPESTATUS[0]}"
