#!/usr/bin/env bash
# One GPU-machine run: build, info, the whole test suite, compute-sanitizer on the CUDA paths,
# the benchmark suite (table, JSON, plot) and the C++ microbenchmarks. Results go to $OUT (the device
# tool's result folder, which returns at most 8 files) or ./gpu-logs; build and stderr logs to
# $LOGS (/tmp), their tails printed on failure.
#   [BENCH_FILTER=P] [BENCH_NOLT=1] [MICROBENCH_ARGS=...] bash bench/gpu_session.sh [pytest -k expression]
set -uo pipefail
OUT=${OUT:-gpu-logs}; LOGS=${LOGS:-/tmp/patchgemm-logs}; mkdir -p "$OUT" "$LOGS"
# NOTE: on the lent GPU image $CXX is /opt/gcc/bin/g++, a wrapper whose extensions segfault whenever
# C++ throws (even a 5-line load_inline op with a failing TORCH_CHECK; /usr/bin/g++ is fine).
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
step() { echo "=== $1"; }
step build
( time python3 -m pip install --no-build-isolation --no-deps -v . ) >"$LOGS/build.log" 2>&1 || { grep -A5 " error" "$LOGS/build.log" | head -60; exit 1; }
grep -E "warning|error" "$LOGS/build.log" | grep -v "^ *WARNING: Running pip" | head -20
cd /tmp  # import the installed package, not the source tree
step info; python3 -m patchgemm info
step tests
python3 -m pytest -q -rs "${OLDPWD}/tests" --ignore="${OLDPWD}/tests/test_fuzz.py" ${1:+-k "$1"} 2>&1 \
  | tee "$OUT/pytest.log" | tail -25
step "fuzz (PATCHGEMM_FUZZ_SEED=${PATCHGEMM_FUZZ_SEED:-default})"
python3 -m pytest -q -s "${OLDPWD}/tests/test_fuzz.py" 2>&1 | tee "$OUT/fuzz.log" | grep -E "problems in|passed|failed|Error" | tail -12
step compute-sanitizer
for tool in memcheck racecheck synccheck; do
  compute-sanitizer --tool $tool --error-exitcode 1 python3 "${OLDPWD}/tests/sanitize_smoke.py" \
    >"$LOGS/sanitizer-$tool.log" 2>&1; echo "$tool exit $?"; tail -3 "$LOGS/sanitizer-$tool.log"
  tail -20 "$LOGS/sanitizer-$tool.log" >>"$OUT/sanitizer.log"
done
step bench
python3 -m patchgemm bench ${BENCH_FILTER:+--filter "$BENCH_FILTER"} --json "$OUT/bench.json" --plot "$OUT/bench.png" \
  2>"$LOGS/bench.err" | tee "$OUT/bench.txt"
step "C++ microbenchmarks"
bash "${OLDPWD}/bench/cpp/run.sh" ${MICROBENCH_ARGS:-} --json "$OUT/microbench.json" 2>"$LOGS/microbench.err" \
  | tee "$OUT/microbench.txt" || tail -30 "$LOGS/microbench.err"
if [ -n "${BENCH_NOLT:-}" ]; then
  step "bench, classic cuBLAS API only (PATCHGEMM_DISABLE_LT=1)"
  PATCHGEMM_DISABLE_LT=1 python3 -m patchgemm bench --filter "G1 bf16" 2>/dev/null | tee "$LOGS/bench-nolt.txt"
fi
if [ -n "${PROFILE:-}" ]; then
  step "profile ($PROFILE)"
  python3 "${OLDPWD}/bench/profile_cases.py" $PROFILE 2>&1 | tee "$LOGS/profile.txt" | grep -E "^==|Self CUDA|^ +[a-zA-Z_:<]" | head -120
fi
