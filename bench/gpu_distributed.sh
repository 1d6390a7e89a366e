#!/usr/bin/env bash
# One run on a machine of several GPUs: build, the group-parallel benchmark over every GPU, the
# NCCL scenarios of tests/distributed_worker.py, then the test files named as arguments (optional).
# Each step is cut at STEP_LIMIT_S seconds. Results go to $OUT (the device tool's result folder) or
# ./gpu-logs.
#   [STEP_LIMIT_S=...] bash bench/gpu_distributed.sh [test_file.py ...]
set -uo pipefail
OUT=${OUT:-gpu-logs}; LOGS=${LOGS:-/tmp/patchgemm-logs}; mkdir -p "$OUT" "$LOGS"
# NOTE: see gpu_session.sh: the image's default $CXX wrapper breaks C++ exceptions in extensions.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
# NVLink multicast stays off: a program using it can take the host's shared GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
limit=${STEP_LIMIT_S:-240}
root=$(pwd); gpus=$(nvidia-smi -L | wc -l)
step() { echo "=== $1 ($(date +%T))"; }
step "build on $gpus GPUs, MAX_JOBS=$MAX_JOBS"
( time python3 -m pip install --no-build-isolation --no-deps -v . ) >"$LOGS/build.log" 2>&1 \
  || { grep -A5 " error" "$LOGS/build.log" | head -60; exit 1; }
tail -3 "$LOGS/build.log"
cd /tmp  # import the installed package, not the source tree
step "bench/distributed.py, $gpus ranks"
timeout "$limit" python3 -m torch.distributed.run --nproc-per-node "$gpus" "$root/bench/distributed.py" \
  --json "$OUT/distributed.json" 2>"$LOGS/bench.err" || tail -20 "$LOGS/bench.err"
step "tests/distributed_worker.py $gpus nccl"
mkdir -p "$OUT/nccl"
timeout "$limit" python3 "$root/tests/distributed_worker.py" "$gpus" nccl "$OUT/nccl" >"$LOGS/worker.log" 2>&1 \
  || tail -20 "$LOGS/worker.log"
python3 - "$OUT/nccl" "$gpus" <<'PY'
import json, pathlib, sys
out, world = pathlib.Path(sys.argv[1]), int(sys.argv[2])
for rank in range(world):
    path = out / f"rank{rank}.json"
    if not path.exists():
        print(f"rank {rank}: no results"); continue
    results = json.loads(path.read_text())
    bad = {k: v for k, v in results.items() if v != "ok"}
    print(f"rank {rank}: {len(results) - len(bad)}/{len(results)} scenarios ok", *(f"\n  {k}: {v[:400]}" for k, v in bad.items()))
PY
if [ $# -gt 0 ]; then
  step "pytest $*"
  timeout "$limit" python3 -m pytest -q -x $(printf "$root/tests/%s " "$@") 2>&1 | tee "$OUT/pytest.log" | tail -8
fi
