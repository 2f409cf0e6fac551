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
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m xdit_backend.cli selftest --out "$out" "$@" 2>&1 | tee "$out/selftest.log"
