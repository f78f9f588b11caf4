# Sourced by the one-H200 scripts (bench/systemd_h200.sh, bench/hardening_h200.sh) after
# `set -euo pipefail`, with DEFAULT_OUT set: the carried wheels (.whl/, for Python 3.12) on
# PYTHONPATH, $OUT ($BENCH_OUT, else DEFAULT_OUT) made, its EXIT file written with the script's
# exit status, and the carried llama.cpp mirror (.carry/llama.cpp.git) in /srv/llamarig.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
export OUT=${BENCH_OUT:-$DEFAULT_OUT}
mkdir -p /srv/llamarig/models "$OUT"
rm -f "$OUT/EXIT"
trap 'echo $? > "$OUT/EXIT"' EXIT
[ -d /srv/llamarig/llama.cpp.git ] || cp -a .carry/llama.cpp.git /srv/llamarig/llama.cpp.git
