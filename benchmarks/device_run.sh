#!/usr/bin/env bash
# Issue #39's prepared device check, as one call of the `run` tool (about 6 minutes on an H100): gpu_check's parts
# 1, 4 and 5 at llmbus's defaults (token-exactness with every graph path; step times; the step profile), then
# part 3 (served, c=64 idle share) four times, alternating the default --launch-depth with --launch-depth 2 so
# that the A/B shares the machine's drift. Each run's log, report.json and py-spy files land in OUT/<name>/; the
# lines printed are each run's rows and errors.
#
#   run(command="bash benchmarks/device_run.sh", carry=[".whl"], timeout_s=600)
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/device_run}
mkdir -p "$out"
python3 benchmarks/device_wheels.py --install > "$out/install.log" 2>&1 || echo "wheel install failed: $out/install.log"

check() {  # name, seconds, gpu_check's arguments
  local name=$1 seconds=$2
  shift 2
  mkdir -p "$out/$name"
  PYTHONUNBUFFERED=1 timeout "$seconds" python3 benchmarks/gpu_check.py "$@" --out "$out/$name/report.json" \
    > "$out/$name/log" 2>&1
  echo "== $name (rc $?): gpu_check.py $*"
  grep -E "^\[|^-- |Error|Traceback" "$out/$name/log" | cut -c1-600
}

check exact 200 --parts 1,4,5
for round in 1 2; do
  check "depth1-$round" 90 --parts 3
  check "depth2-$round" 90 --parts 3 --launch-depth 2
done
