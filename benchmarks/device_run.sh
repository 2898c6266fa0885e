#!/usr/bin/env bash
# Issue #39's prepared device check, as one call of the `run` tool (fits its 600 s; each check is cut to the time
# left, most important first): gpu_check's parts 1, 4 and 5 at llmbus's defaults (token-exactness with every
# graph path; step times; the step profile); parts 1 and 4 again with --full-graphs (whole buckets: exact, and the
# prompt-chunk step's time); then part 3 (served, c=64 idle share) in rounds of the default --launch-depth,
# --launch-depth 2, and --launch-depth 2 with --full-graphs, alternating so that the A/B shares the machine's
# drift. Each run's log, report.json and py-spy files land in OUT/<name>/; the lines printed are each run's rows
# and errors.
#
#   run(command="bash benchmarks/device_run.sh", carry=[".whl"], timeout_s=600)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device_run}
mkdir -p "$out"
python3 benchmarks/device_wheels.py --install > "$out/install.log" 2>&1 || echo "wheel install failed: $out/install.log"

deadline=$((SECONDS + ${BUDGET_S:-580}))

check() {  # name, seconds at most, gpu_check's arguments
  local name=$1 seconds=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$left" -lt 30 ]; then echo "== $name: skipped, ${left}s left"; return; fi
  [ "$seconds" -gt "$left" ] && seconds=$left
  mkdir -p "$out/$name"
  PYTHONUNBUFFERED=1 timeout "$seconds" python3 benchmarks/gpu_check.py "$@" --out "$out/$name/report.json" \
    > "$out/$name/log" 2>&1
  echo "== $name (rc $?): gpu_check.py $*"
  grep -E "^\[|^-- |Error|Traceback" "$out/$name/log" | cut -c1-600
}

check exact 200 --parts 1,4,5
check whole 150 --parts 1,4 --full-graphs
for round in 1 2; do
  check "depth1-$round" 90 --parts 3
  check "depth2-$round" 90 --parts 3 --launch-depth 2
  check "whole-depth2-$round" 90 --parts 3 --launch-depth 2 --full-graphs
done
