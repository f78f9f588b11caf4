#!/usr/bin/env bash
# The test tiers of docs/testing.md: `quick` (make test), `all` (make test-all, what CI runs) and
# `soak` (make test-soak: the scenarios under sustained load, by themselves).
# One pytest run on two workers (pytest-xdist, `--dist loadgroup`): a worker takes a lane of
# sandbox scenarios (tests/conftest.py, SCENARIO_LANES) and runs it to the end, the other the
# unit tests one by one, then the next lane. The sandbox's roots and downloads are prepared
# beside them from the start (network-bound work: debootstrap, PyPI); a scenario's `up` waits
# for them. Two workers, not one per CPU: a scenario compiles on every CPU (a third worker made
# the main phase 23% longer, docs/testing.md). Then, in `all`, the scenarios marked `alone`, by
# themselves.
set -uo pipefail
tier=${1:-} bin=${2:-.venv/bin}
case "$tier" in
  quick) selection=(-m "not heavy") releases=(--release trixie) ;;
  all) selection=(-m "not alone and not soak") releases=(--release trixie --release bookworm) ;;
  soak) exec "$bin/pytest" -m soak -rs -s --durations=10 ;;
  *) echo "usage: $0 quick|all|soak [VENV_BIN]" >&2; exit 2 ;;
esac
prepared=""
if [ "$(id -u)" = 0 ]; then
  prepare_log=$(mktemp)
  "$bin/llamarig" sandbox prepare "${releases[@]}" >"$prepare_log" 2>&1 &
  prepared=$!
fi
status=0
"$bin/pytest" "${selection[@]}" -n 2 --dist loadgroup --no-loadscope-reorder -rs \
  --durations=30 || status=$?
if [ -n "$prepared" ] && ! wait "$prepared"; then
  echo "llamarig sandbox prepare failed (the scenarios retried it and said why):"
  tail -n 5 "$prepare_log"
fi
# The scenarios whose verdicts rest on speeds measured here run last, by themselves: a build
# in the other lane slows a decode up to 20-fold, more than any slowdown they must tell apart.
if [ "$tier" = all ]; then
  "$bin/pytest" -m "alone and not soak" -rs --durations=10 || status=$?
fi
exit "$status"
