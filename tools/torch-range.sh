#!/usr/bin/env bash
# The compatibility subset on other torch releases than CI's pinned one: the unit tests, the compat and
# mesh tests, loading sharded (FSDP2 on meta, filled with each rank's rows), one world-2 backend parity per
# parallel method (flux-tiny: ulysses, ring, cfg, dp, PipeFusion, and each with its weights sharded), and the GPU
# selftest's CPU dry run (its code on this torch before a GPU's time is spent on it). Each release gets its own venv under $XDIT_TORCH_VENVS
# (default ~/.cache/xdit-torch-range), kept for the next run; pip's cache keeps the wheels.
#
#   tools/torch-range.sh              # the oldest supported (2.7.1) and the newest release (2.15.0)
#   tools/torch-range.sh 2.11.0       # the GPU machines' torch
#   tools/torch-range.sh 2.7.1 2.14.1 # where a pip constraint caps torch (this project's CI machines: 2.14.1)
#
# Here (no index but PyPI) these are CUDA builds, which run on the CPU: about 3 GB each with their
# nvidia packages; docs/benchmarks.md has the measured install time. CI runs the pinned CPU build only.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.7.1 2.15.0)
root=${XDIT_TORCH_VENVS:-$HOME/.cache/xdit-torch-range}
subset=(tests/unit tests/ranks/test_compat.py tests/ranks/test_mesh_groups.py tests/ranks/test_shard.py
        tests/ranks/test_sharded_loading.py "tests/ranks/test_gguf.py::test_stored_weights_shard_with_fsdp2_on_their_rows"
        "tests/backend/test_parity.py::test_layout_equals_serial"
        "tests/backend/test_selftest.py::test_the_cpu_dry_run_runs_every_section_and_none_fails")
failed=()
for version in "${versions[@]}"; do
  venv="$root/torch-$version"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  began=$SECONDS
  "$venv/bin/python" -m pip install --quiet "torch==$version"  # first and pinned: nothing below may move it
  "$venv/bin/python" -m pip install --quiet -e ".[test,gguf]"
  echo "torch $version: installed in $((SECONDS - began)) s"
  "$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$version', torch.__version__"
  echo "== torch $version"
  # (on 2.7, whose FSDP2 gathers a float8 block as float8, which gloo cannot, the tests with a sharded float8 block
  # leave it out and say so: a skip in tests/ranks/test_shard.py, the scaled-fp8 file in tests/ranks/test_gguf.py)
  "$venv/bin/python" -m pytest -q -n 2 -p no:cacheprovider "${subset[@]}" \
      -k "not test_layout_equals_serial or (flux-tiny and world2)" || failed+=("$version")
done
[ ${#failed[@]} -eq 0 ] || { echo "FAILED on torch ${failed[*]}"; exit 1; }
echo "passed on torch ${versions[*]}"
