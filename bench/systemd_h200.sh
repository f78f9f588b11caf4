#!/bin/bash
# Issue 16, one command on the one-H200 machine: boot a Debian root with systemd and sshd as
# PID 1 of a container (bench/systemd-root.sh, GUIDE §8) and run the real deploy into it over
# SSH, with the hardened unit, verify, a restart, a rollback, decode speeds and memory
# (bench/systemd_h200.py says what and in which order).
#
# Carried with the tree (git-ignored here): .carry/systemd-root/root.tar.xz.part-* (the root,
# bench/systemd-root-pack.sh; parts carried by an earlier call of the same lease wait in
# /srv/llamarig/stash), .carry/llama.cpp.git (a bare mirror of the pinned commit) and .whl/
# (pyinfra, testinfra, gguf, jsonschema, paramiko and their wheels for Python 3.12).
# Results go to $BENCH_OUT (default /srv/llamarig/out-systemd): results.json and logs/.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export OUT=${BENCH_OUT:-/srv/llamarig/out-systemd}
mkdir -p /srv/llamarig/models "$OUT"
rm -f "$OUT/EXIT"
trap 'echo $? > "$OUT/EXIT"' EXIT
[ -d /srv/llamarig/llama.cpp.git ] || cp -a .carry/llama.cpp.git /srv/llamarig/llama.cpp.git
python3 bench/systemd_h200.py
