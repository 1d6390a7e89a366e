#!/usr/bin/env bash
# Configure, build and run patchgemm_microbench against the torch that python3 imports; arguments
# go to the executable:   bash bench/cpp/run.sh --filter gemm --csv out.csv
# The build lives in build/microbench (PATCHGEMM_MICROBENCH_BUILD overrides); MAX_JOBS caps the
# parallel compiles, TORCH_CUDA_ARCH_LIST the GPU architectures (default: this machine's GPU).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${PATCHGEMM_MICROBENCH_BUILD:-$root/build/microbench}
mkdir -p "$build"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
if ! cmake -S "$root/bench/cpp" -B "$build" "${generator[@]}" -DPython3_EXECUTABLE="$(command -v python3)" \
    >"$build/configure.log" 2>&1; then
  cat "$build/configure.log" >&2
  exit 1
fi
cmake --build "$build" --parallel "${MAX_JOBS:-$(nproc)}" >&2
exec "$build/patchgemm_microbench" "$@"
