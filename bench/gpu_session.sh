#!/usr/bin/env bash
# One GPU-machine run: build, info, then the steps asked for (default: all but heldout):
#   tests       the whole test suite (pytest -k "$PYTEST_K" if set; PYTEST_ARGS, e.g. "-n 12"),
#               TEST_RUNS times in a row (default 1), each run's log kept
#   fuzz        tests/test_fuzz.py (small problems), then tests/test_at_scale.py's large problems
#               for SCALE_SECONDS (default 120)
#   sanitizer   compute-sanitizer memcheck / racecheck / synccheck on tests/sanitize_smoke.py: its
#               small shapes, then (--scale) every candidate of ours on multi-wave problems, one
#               process per tool and family, side by side (SANITIZE_MODES="small scale",
#               SANITIZE_TOOLS="memcheck racecheck synccheck", SANITIZE_FAMILIES: the --scale
#               families or family:op, default all; SANITIZE_ONCE=1: each candidate on one
#               multi-wave problem, its family's smallest); each run stops after SANITIZE_SECONDS
#               (default 540) and says so
#   bench       the benchmark suite (table, JSON, plot; BENCH_FILTER=P)
#   microbench  the C++ microbenchmarks (MICROBENCH_ARGS=...)
#   tune        python -m patchgemm tune $TUNE_ARGS (memory-only cache), records to $OUT/tune.json.gz
#   heldout     bench/heldout.py $HELDOUT_ARGS (default: --set all), JSON to $OUT/heldout.json
#   models      python -m patchgemm bench --models, JSON to $OUT/models.json
#   fp8         bench/fp8.py (FP8 grouped linear against bf16 and PyTorch's FP8), JSON to $OUT/fp8.json
#   fp8sweep    bench/fp8_sweep.py (where FP8 pays: 90 dense shapes, then 17 ragged ones), JSON to
#               $OUT/fp8-sweep.json and $OUT/fp8-sweep-ragged.json
#   run         bash -c "$RUN" from /tmp ($SRC: the tree), after the install and with this script's
#               environment (its $CXX above all: a command run outside this script lacks it, and the
#               image's own breaks the C++ that AOTInductor and extensions compile)
# Results go to $OUT (the device tool's result folder) or ./gpu-logs; build and stderr logs to $LOGS
# (/tmp), their tails printed on failure. SAVE_WHEEL=1 also leaves the built wheel in $OUT/wheel,
# in parts of at most 15 MB (the device tool returns files of up to 16 MiB), to carry to later runs;
# WHEEL=folder installs the wheel those parts make (or WHEEL=file.whl that wheel) instead of building,
# WHEEL=installed uses the patchgemm installed already (runs of this script side by side);
# with it, OVERLAY=1 copies this tree's Python files over the installed ones (Python-only changes
# tested without a rebuild; the compiled library stays the wheel's). The results' JSON
# names the commit measured from git, or from PATCHGEMM_COMMIT=<hash> where the tree is a copy.
#   [STEPS="tests bench"] [WHEEL=...] [SAVE_WHEEL=1] bash bench/gpu_session.sh
set -uo pipefail
OUT=${OUT:-gpu-logs}; LOGS=${LOGS:-/tmp/patchgemm-logs}; mkdir -p "$OUT" "$LOGS"
STEPS=" ${STEPS-tests fuzz sanitizer bench microbench} "  # unset: these; empty: none (install only)
# NOTE: on the lent GPU image $CXX is /opt/gcc/bin/g++, a wrapper whose extensions segfault whenever
# C++ throws (even a 5-line load_inline op with a failing TORCH_CHECK; /usr/bin/g++ is fine).
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-$(nproc)} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
step() { echo "=== $1"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
step build
if [ "${WHEEL:-}" = installed ]; then  # another run of this script installed it: use that
  echo "using the installed patchgemm"
elif [ -n "${WHEEL:-}" ]; then
  if [ -d "$WHEEL" ]; then  # parts written by SAVE_WHEEL=1
    mkdir -p "$LOGS/wheel" && cat "$WHEEL"/part-* >"$LOGS/wheel/$(cat "$WHEEL/name")" && WHEEL="$LOGS/wheel/$(cat "$WHEEL/name")"
  fi
  python3 -m pip install --no-deps --force-reinstall "$WHEEL" >"$LOGS/build.log" 2>&1 || { tail -20 "$LOGS/build.log"; exit 1; }
  if [ -n "${OVERLAY:-}" ]; then
    site=$(cd /tmp && python3 -c "import os, patchgemm; print(os.path.dirname(patchgemm.__file__))")
    (cd patchgemm && find . \( -name '*.py' -o -name '*.json' \) -exec cp --parents {} "$site" \;) && echo "overlaid $site"
  fi
else
  ( time python3 -m pip wheel --no-build-isolation --no-deps -v -w "$LOGS/wheel" . ) >"$LOGS/build.log" 2>&1 \
    || { grep -A5 " error" "$LOGS/build.log" | head -60; exit 1; }
  grep -E "warning|error" "$LOGS/build.log" | grep -v "^ *WARNING: Running pip" | head -20
  tail -3 "$LOGS/build.log" | grep real
  python3 -m pip install --no-deps --force-reinstall "$LOGS"/wheel/patchgemm-*.whl >>"$LOGS/build.log" 2>&1 || exit 1
  if [ -n "${SAVE_WHEEL:-}" ]; then
    whl=$(ls "$LOGS"/wheel/patchgemm-*.whl | head -1)
    mkdir -p "$OUT/wheel" && basename "$whl" >"$OUT/wheel/name" && split -b 15000000 -d "$whl" "$OUT/wheel/part-"
  fi
fi
SRC=$PWD
if [ -z "${PATCHGEMM_COMMIT:-}" ] && PATCHGEMM_COMMIT=$(git rev-parse --short=12 HEAD 2>/dev/null); then
  # A tree that differs from that HEAD (edits not committed, or a copy beside an older .git) says so.
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && PATCHGEMM_COMMIT+="+dirty"
  export PATCHGEMM_COMMIT
fi
cd /tmp  # import the installed package, not the source tree
step info; python3 -m patchgemm info
if want tests; then
  for run in $(seq 1 "${TEST_RUNS:-1}"); do
    step "tests (run $run of ${TEST_RUNS:-1})"
    python3 -m pytest -q -rs ${PYTEST_ARGS:-} "$SRC/tests" --ignore="$SRC/tests/test_fuzz.py" \
      ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/pytest-$run.log" | tail -25
  done
fi
if want fuzz; then
  step "fuzz (PATCHGEMM_FUZZ_SEED=${PATCHGEMM_FUZZ_SEED:-default})"
  python3 -m pytest -q -s "$SRC/tests/test_fuzz.py" 2>&1 | tee "$OUT/fuzz.log" | grep -E "problems in|passed|failed|Error" | tail -12
  PATCHGEMM_SCALE_SECONDS=${SCALE_SECONDS:-120} python3 -m pytest -q -s "$SRC/tests/test_at_scale.py" \
    -k large_patch_problems 2>&1 | tee -a "$OUT/fuzz.log" | grep -E "large patch|passed|failed|Error" | tail -12
fi
if want sanitizer; then
  step compute-sanitizer
  tools=${SANITIZE_TOOLS:-memcheck racecheck synccheck}
  families=${SANITIZE_FAMILIES:-patch grouped_linear pointwise ragged swiglu instance_norm}
  for mode in ${SANITIZE_MODES:-small scale}; do
    # One process per tool (and, at scale, per family), side by side: the sanitizers are slow
    # on multi-wave problems and the GPU has room for all of them at once.
    runs=$([ $mode = scale ] && echo $families || echo all)
    for tool in $tools; do
      # synccheck instruments only our kernels (names in namespace patchgemm): instrumenting
      # every library kernel it starts with takes longer than a device call. racecheck cannot
      # be filtered so: with --kernel-name, the unchecked cuBLAS kernels fail to launch under it
      # ("failed to handle a hardware exception"); split its runs by op (family:op) instead.
      filter=$([ $tool = synccheck ] && echo "--kernel-name kns=patchgemm")
      for run in $runs; do
        log="$LOGS/sanitizer-$mode-$tool-$run.log"
        timeout ${SANITIZE_SECONDS:-540} compute-sanitizer --tool $tool $filter --error-exitcode 1 \
          python3 "$SRC/tests/sanitize_smoke.py" $([ $mode = scale ] && echo --scale ${SANITIZE_ONCE:+--once} $run) \
          >"$log" 2>&1 || echo "(exit $?)" >>"$log" &
      done
    done
    wait
    for tool in $tools; do
      for run in $runs; do
        log="$LOGS/sanitizer-$mode-$tool-$run.log"
        echo "$mode $tool $run: $(tail -1 "$log")"
        { echo "== $mode $tool $run"; grep -E "Race reported|access at|Error|Invalid" "$log" | sed -E 's/\+0x[0-9a-f]+.*//' \
            | sort | uniq -c | sort -rn | head -40; grep -E "^  [a-z_0-9]+=" "$log"; tail -3 "$log"; } >>"$OUT/sanitizer.log"
        echo "  reports in patchgemm kernels: $(grep -E "Race reported|access at|Error" "$log" | grep -c patchgemm)"
      done
    done
  done
fi
if want bench; then
  step bench
  python3 -m patchgemm bench ${BENCH_FILTER:+--filter "$BENCH_FILTER"} --json "$OUT/bench.json" --plot "$OUT/bench.png" \
    2>"$LOGS/bench.err" | tee "$OUT/bench.txt"
fi
if want microbench; then
  step "C++ microbenchmarks"
  bash "$SRC/bench/cpp/run.sh" ${MICROBENCH_ARGS:-} --json "$OUT/microbench.json" 2>"$LOGS/microbench.err" \
    | tee "$OUT/microbench.txt" || tail -30 "$LOGS/microbench.err"
fi
if want tune; then
  step "tune (${TUNE_ARGS:-defaults})"
  python3 -m patchgemm tune ${TUNE_ARGS:-} --cache-dir "" --json "$OUT/tune.json.gz" 2>"$LOGS/tune.err" \
    | tee "$OUT/tune.txt" | grep -vE "^  (tuning|random|models|heldout): [0-9]+/" ; tail -5 "$LOGS/tune.err"
fi
if want heldout; then
  step "held-out shapes (${HELDOUT_ARGS:---set all})"
  python3 "$SRC/bench/heldout.py" ${HELDOUT_ARGS:---set all} --json "$OUT/heldout.json" 2>"$LOGS/heldout.err" \
    >"$OUT/heldout.txt"; tail -16 "$OUT/heldout.txt"; tail -5 "$LOGS/heldout.err"
fi
if want models; then
  step "models"
  python3 -m patchgemm bench --models --json "$OUT/models.json" 2>"$LOGS/models.err" | tee "$OUT/models.txt"
fi
if want fp8; then
  step "fp8"
  python3 "$SRC/bench/fp8.py" --json "$OUT/fp8.json" 2>"$LOGS/fp8.err" | tee "$OUT/fp8.txt"; tail -5 "$LOGS/fp8.err"
fi
if want fp8sweep; then
  step "fp8sweep"
  python3 "$SRC/bench/fp8_sweep.py" --json "$OUT/fp8-sweep.json" 2>"$LOGS/fp8-sweep.err" | tee "$OUT/fp8-sweep.txt"
  python3 "$SRC/bench/fp8_sweep.py" --ragged --json "$OUT/fp8-sweep-ragged.json" 2>>"$LOGS/fp8-sweep.err" \
    | tee "$OUT/fp8-sweep-ragged.txt"
  tail -5 "$LOGS/fp8-sweep.err"
fi
if want run; then
  step "run: ${RUN:-}"
  SRC=$SRC bash -c "${RUN:?STEPS has run but RUN is empty}"
fi
