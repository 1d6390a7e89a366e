"""The C++ microbenchmarks (bench/cpp): built with CMake against the installed torch, run as a short
smoke pass, and every bad command line answered with one clear line and exit status 2."""

import csv
import json
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUN = ROOT / "bench" / "cpp" / "run.sh"
BUILD = pathlib.Path(os.environ.get("PATCHGEMM_MICROBENCH_BUILD", ROOT / "build" / "microbench"))

# (slow: its CMake build compiles the library again, minutes on a CPU; CI runs it as its own step)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not RUN.exists(), reason="bench/cpp is not in this tree (installed package)")]


@pytest.fixture(scope="module")
def microbench():
    assert shutil.which("cmake"), "the C++ microbenchmarks need cmake (apt install cmake / pip install cmake)"
    build = subprocess.run(["bash", str(RUN), "--list", "--smoke"], capture_output=True, text=True,
                           env={**os.environ, "PATCHGEMM_MICROBENCH_BUILD": str(BUILD)})
    assert build.returncode == 0, build.stderr[-3000:]
    exe = BUILD / "patchgemm_microbench"
    assert exe.exists()

    def run(*args):
        return subprocess.run([str(exe), "--device", "cpu", *args], capture_output=True, text=True, timeout=600)

    return run


def test_smoke_pass_writes_consistent_csv_and_json(microbench, tmp_path):
    out_csv, out_json = tmp_path / "r.csv", tmp_path / "r.json"
    r = microbench("--smoke", "--csv", str(out_csv), "--json", str(out_json))
    assert r.returncode == 0, r.stderr
    results = json.loads(out_json.read_text())["results"]
    families = {x["family"] for x in results}
    assert families == {"gemm", "gather", "scatter", "patch_embed", "patch_weight_grad", "patch_unembed"}
    assert all(x["ms"] > 0 and x["floor_ms"] > 0 and x["gbps"] > 0 for x in results)
    # Each problem's first row is ours; the others report ours' speedup against them.
    ours = {}
    for x in results:
        key = (x["family"], x["dtype"], x["sizes"])
        if key not in ours:
            assert x["impl"] in ("strided_batched", "patchgemm") and x["ours_faster_by"] == 0
            ours[key] = x["ms"]
        else:
            assert x["ours_faster_by"] == pytest.approx(x["ms"] / ours[key], rel=1e-4)
    rows = list(csv.DictReader(out_csv.open()))
    assert [row["id"] for row in rows] == [x["id"] for x in results]
    assert all(row["id"] in r.stdout for row in rows)


def test_filter_list_and_sizes_from_the_command_line(microbench):
    r = microbench("--list", "--filter", "gather/patchgemm,gemm/loop", "--gemm", "8x2x16x24",
                   "--patch", "1x2x4x6x8/2x3x4/5", "--dtype", "fp64")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["gemm/loop/fp64/8x2x16x24", "gather/patchgemm/fp64/1x2x4x6x8/2x3x4/5"]
    r = microbench("--filter", "gather/patchgemm", "--patch", "1x2x4x6x8/2x3x4/5", "--dtype", "fp64",
                   "--reps", "2", "--warmup", "0")
    assert r.returncode == 0, r.stderr
    assert "gather/patchgemm/fp64/1x2x4x6x8/2x3x4/5" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--filter", "nope"], "no problem id matches --filter"),
    (["--gemm", "4x4x4"], "expected BxGxDinxDout"),
    (["--gemm", "4x-4x4x4"], "must be positive integers"),
    (["--gemm", "100000000x100000x1000x1000"], "impossible size"),
    (["--patch", "2x3x30x30/8/16"], "not divisible by the patch size 8"),
    (["--patch", "2x3x32x32/8"], "expected BxCx[Dx][Hx]W/k/E"),
    (["--patch", "2x3x32x32/8x8x8/4"], "the patch size needs 1 or 2 values"),
    (["--dtype", "int8"], "unknown --dtype 'int8'"),
    (["--reps", "0"], "--reps needs an integer >= 1"),
    (["--reps"], "--reps needs a value"),
    (["--bogus"], "unknown option '--bogus'"),
])
def test_bad_input_is_one_clear_line_and_exit_2(microbench, args, message):
    r = microbench("--smoke", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert message in r.stderr and r.stderr.count("\n") == 1 and r.stdout == ""
