#!/usr/bin/env bash
# The lowest torch pyproject.toml allows (torch>=X), built and tested on the CPU: a venv with that
# torch (PyPI's x86_64 wheel is a CUDA build, which runs on a machine without a GPU), the CPU flavour
# built against it in a clone of the checkout (the checkout's own editable install keeps its
# library), its info, then the test suite.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
floor=$(sed -n 's/.*"torch>=\([0-9.]*\)".*/\1/p' "$root/pyproject.toml")
[ -n "$floor" ] || { echo "floor: no torch>=X in pyproject.toml"; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "torch==$floor.*" setuptools wheel
git clone -q "$root" "$work/src"
cd "$work/src"
PATCHGEMM_BUILD=cpu "$work/venv/bin/pip" install -q --no-build-isolation -e ".[test]"
"$work/venv/bin/python" -m patchgemm info
"$work/venv/bin/python" -m pytest -q tests
