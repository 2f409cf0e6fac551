#!/usr/bin/env bash
# On a GPU machine, from the repository root: install the carried wheels (tools/gpu-wheels.sh) beside the
# machine's own torch, then run the GPU smoke suite; figures and the log go to ${OUT:-selftest-out}.
# Extra arguments go to `xdit-backend selftest` (e.g. --only attention families).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-selftest-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/xdit-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/xdit-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1  # the ranks import this checkout
# The backends the selftest, bench and demo start run in their own sessions (they outlive a killed selftest,
# holding GPU memory): stop any left from an earlier run before measuring, and this run's on exit or a signal
# (review gpu-paths-2 B5). `stop` loads no torch: a second per socket.
stop_leftovers() {
    for sock in /tmp/xdit-selftest-*/backend.sock /tmp/xdit-bench-*/backend.sock /tmp/xdit-demo-*/backend.sock; do
        [ -S "$sock" ] && python3 -m xdit_backend.cli stop --socket "$sock" >/dev/null 2>&1
    done
    return 0
}
stop_leftovers
trap stop_leftovers EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
# A device call has a time limit (10 minutes on the machines lent here): the selftest starts no section whose
# planned time (runner.SECTIONS) is more than what is left of XDIT_SELFTEST_BUDGET_S, counted from this script's
# start (570: a 600 s call less the margin for an overrun and the backends' stop), and names those it left.
budget=$(( ${XDIT_SELFTEST_BUDGET_S:-570} - SECONDS ))
python3 -m xdit_backend.cli selftest --out "$out" --budget-s "$budget" "$@" 2>&1 | tee "$out/selftest.log"
