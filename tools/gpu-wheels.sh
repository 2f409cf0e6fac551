#!/usr/bin/env bash
# On a machine with PyPI: download, into .whl/ (git-ignored), the wheels a bare GPU machine lacks to run
# the backend (its image has torch, numpy, scipy, safetensors, huggingface-hub, but not these; gguf for the
# selftest's GGUF files, its own dependencies are huggingface-hub's), for the GPU machine's Python (3.12,
# x86-64). Then carry .whl to it and run tools/gpu-selftest.sh there. Not importlib_metadata, which diffusers
# lists: on Python ≥ 3.8 it imports the standard library's importlib.metadata instead, and the newest
# importlib_metadata needs lazy-importer, which the machine lacks (gpu-paths-2.md B14).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
exclude="$(git rev-parse --git-common-dir)/info/exclude"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d .whl diffusers==0.42.1 yunchang==0.6.4 torchsde==0.2.6 trampoline==0.1.2 gguf==0.19.0
ls .whl
