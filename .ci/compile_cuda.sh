#!/usr/bin/env bash
# Compile every CUDA source with nvcc against the installed torch's headers, and every C++ source
# with PATCHGEMM_WITH_CUDA defined (the CUDA branches the CPU build leaves out), so a CUDA build break
# cannot land from a machine without a GPU (python_module.cpp, the Python binding, has none). A CPU torch wheel ships ATen's CUDA headers but not the
# cuBLAS/cuSPARSE/cuSOLVER headers they include (taken from NVIDIA's wheels) nor one generated
# config header (a one-line shim). Compile only: there is no libtorch_cuda to link against here. The
# -D flags are the ones torch.utils.cpp_extension passes to nvcc (no implicit 16-bit conversions);
# sm_90a, as setup.py builds 9.0, so the wgmma kernels compile too.
set -euo pipefail
command -v nvcc >/dev/null || { echo "compile_cuda: nvcc not found"; exit 1; }
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
torch_dir=$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__))")
python3 -m pip download -q --no-deps -d "$work/wheels" \
  nvidia-cublas==13.1.0.3 nvidia-cusparse==12.9.4.2 nvidia-cusolver==12.4.1.2
python3 - "$work" <<'PY'
import pathlib, sys, zipfile
work = pathlib.Path(sys.argv[1])
for wheel in (work / "wheels").glob("*.whl"):
    with zipfile.ZipFile(wheel) as z:
        z.extractall(work / "headers", [n for n in z.namelist() if "/include/" in n])
PY
cublas_include=$(dirname "$(find "$work/headers" -name cublas_v2.h | head -1)")
mkdir -p "$work/shim/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$work/shim/c10/cuda/impl/cuda_cmake_macros.h"
for src in $(find "$root/csrc" \( -name "*.cu" -o -name "*.cpp" \) ! -name python_module.cpp | sort); do
  echo "nvcc -c ${src#$root/}"
  nvcc -c "$src" -o "$work/out.o" -std=c++20 -gencode=arch=compute_90a,code=sm_90a -DPATCHGEMM_SM90A -DPATCHGEMM_WITH_CUDA \
    -I"$root/csrc" -I"$work/shim" -I"$torch_dir/include" \
    -I"$torch_dir/include/torch/csrc/api/include" -I"$cublas_include" \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
    -D__CUDA_NO_HALF2_OPERATORS__ -diag-suppress 20013,20015
done
echo "compile_cuda: ok"
