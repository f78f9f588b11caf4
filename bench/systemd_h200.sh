#!/bin/bash
# Issue 16's measurements, one command on the one-H200 machine: boot a Debian root with systemd
# and sshd as PID 1 of a container (llamarig_sandbox/systemdroot.py, GUIDE §8), deploy into it
# over SSH, then decode speeds through the unit, the launcher and llama-bench, and memory against
# the plan (bench/systemd_h200.py says what). What must hold is bench/gpu_tests.sh's (tests/gpu).
#
# Carried with the tree (git-ignored here): .carry/systemd-root/root.tar.xz.part-* (the root,
# bench/systemd-root-pack.sh; parts carried by an earlier call of the same lease wait in
# /srv/llamarig/stash), .carry/llama.cpp.git (a bare mirror of the pinned commit) and .whl/
# (pyinfra, testinfra, gguf, jsonschema, paramiko and their wheels for Python 3.12).
# Results go to $BENCH_OUT (default /srv/llamarig/out-systemd): results.json and logs/.
set -euo pipefail
DEFAULT_OUT=/srv/llamarig/out-systemd
source "$(dirname "$0")/device-setup.sh"
python3 bench/systemd_h200.py
