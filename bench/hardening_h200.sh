#!/bin/bash
# Issue 27 (item 5), one command on the one-H200 machine: boot bench/systemd_h200.sh's container
# (a Debian root with systemd as PID 1, GUIDE §8), build llama-server for CUDA inside it and run
# it as a unit under files/unit-hardening.j2 plus, one variant at a time, the settings NixOS's
# services.llama-cpp adds (bench/hardening_h200.py says which and what is measured).
#
# Carried with the tree (git-ignored here): .carry/systemd-root/root.tar.xz.part-* (the root,
# bench/systemd-root-pack.sh; parts carried by an earlier call of the same lease wait in
# /srv/llamarig/stash), .carry/llama.cpp.git (a bare mirror of the pinned commit) and .whl/
# (gguf and jsonschema with its needs, for Python 3.12; the machine has the rest).
# Results go to $BENCH_OUT (default /srv/llamarig/out-hardening): results.json and logs/.
set -euo pipefail
DEFAULT_OUT=/srv/llamarig/out-hardening
source "$(dirname "$0")/device-setup.sh"
# The unit runs as a dynamic user, which must reach the binary and the model.
chmod 755 /srv /srv/llamarig /srv/llamarig/models
python3 bench/hardening_h200.py
