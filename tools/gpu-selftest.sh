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
python3 -m xdit_backend.cli selftest --out "$out" "$@" 2>&1 | tee "$out/selftest.log"
