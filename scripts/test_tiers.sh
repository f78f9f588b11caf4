#!/usr/bin/env bash
# The test tiers of docs/testing.md: `quick` (make test) and `all` (make test-all, what CI runs).
# The unit and property tests run on every CPU (pytest-xdist) while the sandbox's roots and
# downloads are prepared beside them (network-bound work: debootstrap, PyPI); the sandbox
# scenarios then run one at a time, since they share loopback ports and the machine's CPUs.
set -uo pipefail
tier=${1:-} bin=${2:-.venv/bin}
case "$tier" in
  quick) scenarios="sandbox and not heavy" releases=(--release trixie) ;;
  all) scenarios="sandbox" releases=(--release trixie --release bookworm) ;;
  *) echo "usage: $0 quick|all [VENV_BIN]" >&2; exit 2 ;;
esac
prepared=""
if [ "$(id -u)" = 0 ]; then
  prepare_log=$(mktemp)
  "$bin/llamarig" sandbox prepare "${releases[@]}" >"$prepare_log" 2>&1 &
  prepared=$!
fi
status=0
"$bin/pytest" -m "not sandbox" -n auto -rs --durations=15 || status=$?
if [ -n "$prepared" ] && ! wait "$prepared"; then
  echo "llamarig sandbox prepare failed (the scenarios retry it and say why):"
  tail -n 5 "$prepare_log"
fi
"$bin/pytest" -m "$scenarios" -rs --durations=0 || status=$?
exit "$status"
