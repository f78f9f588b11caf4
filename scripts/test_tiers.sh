#!/usr/bin/env bash
# The test tiers of docs/testing.md: `quick` (make test), `all` (make test-all, what CI runs) and
# `soak` (make test-soak: the scenarios under sustained load, by themselves).
# `quick`: one pytest run on two workers (pytest-xdist, `--dist loadgroup`): one worker takes the
# lane of its sandbox scenario (tests/conftest.py, SCENARIO_LANES), the other the unit tests.
# `all`: first the lanes of sandbox scenarios alone on two workers, each worker running a lane to
# the end, then the next lane (a scenario compiles on every CPU: a third worker made that phase
# 23% longer, docs/testing.md), and the unit tests marked `lane_tail` once the last lanes have
# begun (the worker done first takes them); then the scenarios marked `alone`, whose verdicts
# rest on speeds measured here, with the other unit and property tests beside them pinned to
# one CPU: a steady load on one CPU is what those scenarios are proven to tell apart (a build in
# a lane, bursting on every CPU, is not). The sandbox's roots and downloads are prepared beside
# the first phase from the start (network-bound work: mmdebstrap, PyPI); a scenario's `up`
# waits for them.
set -uo pipefail
tier=${1:-} bin=${2:-.venv/bin}
case "$tier" in
  quick) selection=(-m "not heavy") releases=(--release trixie) ;;
  all) selection=(-m "(sandbox and not alone and not soak) or lane_tail") releases=(--release trixie --release bookworm) ;;
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
  --durations=0 --durations-min=5 || status=$?
if [ -n "$prepared" ] && ! wait "$prepared"; then
  echo "llamarig sandbox prepare failed (the scenarios retried it and said why):"
  tail -n 5 "$prepare_log"
fi
# The scenarios whose verdicts rest on speeds measured here run last, without a lane beside them:
# a build in the other lane slows a decode up to 20-fold, more than any slowdown they must tell
# apart. The unit tests run meanwhile on CPU 0 alone, on two workers that share it (their own
# temporary directory; their output follows the scenarios'); once the scenarios are done, the
# workers are given every CPU for the rest.
if [ "$tier" = all ]; then
  pinned=()
  if [ "$(nproc)" -ge 2 ] && command -v taskset >/dev/null; then pinned=(taskset -c 0); fi
  units_log=$(mktemp) units_tmp=$(mktemp -d)
  workers=()
  if [ ${#pinned[@]} != 0 ]; then workers=(-n 2); fi
  "${pinned[@]}" "$bin/pytest" -m "not sandbox and not lane_tail" "${workers[@]}" -rs --durations=10 \
    -p no:cacheprovider --basetemp "$units_tmp" >"$units_log" 2>&1 &
  units=$!
  if [ ${#pinned[@]} = 0 ]; then wait "$units" || status=$?; fi  # one CPU: one after the other
  "$bin/pytest" -m "alone and not soak" -rs --durations=10 || status=$?
  if [ ${#pinned[@]} != 0 ]; then
    for pid in "$units" $(pgrep -P "$units"); do taskset -a -p -c "0-$(($(nproc) - 1))" "$pid"; done \
      >/dev/null 2>&1
    wait "$units" || status=$?
  fi
  echo "=== the unit and property tests (${pinned[*]:-not pinned}${pinned[*]:+, then every CPU}), run beside the alone scenarios ==="
  cat "$units_log"
  rm -rf "$units_log" "$units_tmp"
fi
exit "$status"
