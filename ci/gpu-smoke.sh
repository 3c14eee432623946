#!/usr/bin/env bash
# The first thing to run on a GPU machine (a GPU session, the image's default command): one line
# per step, PASS or FAIL with what it saw, then the conformance suite on CUDA.
#
#   bash ci/gpu-smoke.sh              # PYTHON=... picks the interpreter (default python3)
#   PROFILE=standard bash ci/gpu-smoke.sh -n 2   # arguments after the script go to `gradparity run`
#
# Exit status: 0 every step passed; 1 a step failed (its line says why; the steps after it do
# not run); 3 no GPU on this machine (torch sees no CUDA device: nothing GPU-specific was checked).
# It installs nothing: torch (a CUDA build of the pinned torch==2.13.0) must be there; the project
# is used from this checkout (PYTHONPATH) when it is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
REPORT_DIR="${REPORT_DIR:-reports/gpu}"
STEPS=(torch refimpl gpu ddp suite)
n=0

step() {  # step NAME COMMAND...: run it, print PASS/FAIL with its last line, stop on failure
  local name="$1"; shift
  n=$((n + 1))
  local log rc
  log="$(mktemp)"
  "$@" >"$log" 2>&1
  rc=$?
  local said
  said="$(grep -v '^\s*$' "$log" | tail -n 1)"
  if [ "$rc" -eq 0 ]; then
    echo "[$n/${#STEPS[@]}] PASS $name: $said"
  elif [ "$rc" -eq 3 ] && [ "$name" = gpu ]; then
    echo "[$n/${#STEPS[@]}] NO GPU $name: $said"
    echo "gpu-smoke: no GPU present; $((n - 1)) CPU step(s) passed, GPU steps not run (exit 3)"
    rm -f "$log"; exit 3
  else
    cat "$log"
    echo "[$n/${#STEPS[@]}] FAIL $name: $said"
    echo "gpu-smoke: failed at step $n ($name); the output above is that step's (exit 1)"
    rm -f "$log"; exit 1
  fi
  rm -f "$log"
}

suite() {  # the suite on CUDA; the pytest plugin is registered by hand when the project is not installed
  local plugin=()
  if ! "$PYTHON" -c "import importlib.metadata as m, sys; sys.exit(0 if m.entry_points(group='pytest11', name='gradparity') else 1)"; then
    plugin=(-- -p conformance.frontends.plugin)
  fi
  "$PYTHON" -m conformance.frontends.cli run --device cuda --profile "${PROFILE:-quick}" --report-dir "$REPORT_DIR" "$@" "${plugin[@]}" \
    && echo "the ${PROFILE:-quick} profile passed on CUDA (reports in $REPORT_DIR)"
}

step torch "$PYTHON" ci/gpu_smoke.py torch
step refimpl "$PYTHON" ci/gpu_smoke.py refimpl
step gpu "$PYTHON" ci/gpu_smoke.py gpu
step ddp "$PYTHON" ci/gpu_smoke.py ddp
step suite suite "$@"
echo "gpu-smoke: all ${#STEPS[@]} steps passed (exit 0)"
