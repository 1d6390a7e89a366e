"""`python -m patchgemm bench`: the timer, `--plot` / `--from-json` (the summary arithmetic and the picture)."""

import json
import struct
import time

import pytest

from patchgemm import __main__ as cli
from patchgemm.tools.plot import summarize


def rows():
    # ours, two baselines and a variant of ours; "P1 fwd+bwd" lacks ours and must be left out.
    return [
        dict(case="P1", pass_="fwd", impl="patchgemm", ms=0.5, tflops=1.0, floor_ms=0.25, peak_mb=None, error=""),
        dict(case="P1", pass_="fwd", impl="cuDNN conv", ms=2.0, tflops=1.0, floor_ms=0.25, peak_mb=None, error=""),
        dict(case="P1", pass_="fwd", impl="linear", ms=1.0, tflops=1.0, floor_ms=0.25, peak_mb=None, error=""),
        dict(case="P1", pass_="fwd", impl="patchgemm per stage", ms=0.1, tflops=1.0, floor_ms=0.25, peak_mb=None,
             error=""),
        dict(case="P1", pass_="fwd+bwd", impl="linear", ms=1.0, tflops=1.0, floor_ms=0.5, peak_mb=3.0, error=""),
        dict(case="G1", pass_="fwd", impl="patchgemm", ms=2.0, tflops=1.0, floor_ms=1.0, peak_mb=None, error=""),
        dict(case="G1", pass_="fwd", impl="einsum", ms=None, tflops=None, floor_ms=1.0, peak_mb=None, error="x"),
        dict(case="G1", pass_="fwd", impl="bmm", ms=1.0, tflops=1.0, floor_ms=1.0, peak_mb=None, error=""),
    ]


def test_summary_compares_ours_with_the_fastest_baseline_that_ran():
    s = summarize(rows())
    assert [x.label for x in s] == ["P1 fwd", "G1 fwd"]
    p1, g1 = s
    assert (p1.best_impl, p1.speedup, p1.ours_pct_floor, p1.best_pct_floor) == ("linear", 2.0, 50.0, 25.0)
    assert (g1.best_impl, g1.speedup, g1.ours_pct_floor, g1.best_pct_floor) == ("bmm", 0.5, 50.0, 100.0)


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_from_json_prints_the_table_and_draws_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"environment": {"gpu": "TestGPU", "torch": "x", "date": "d"}, "rows": rows()}))
    out = tmp_path / "out.png"
    assert cli.main(["bench", "--from-json", str(saved), "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "cuDNN conv" in printed and "4.00x" in printed and f"plot written to {out}" in printed
    width, height = png_size(out)
    assert width > 800 and height > 200


def test_plot_with_nothing_to_compare_is_a_clear_error(tmp_path):
    saved = tmp_path / "bench.json"
    saved.write_text(json.dumps({"environment": {}, "rows": rows()[4:5]}))
    with pytest.raises(ValueError, match="nothing to plot"):
        cli.main(["bench", "--from-json", str(saved), "--plot", str(tmp_path / "x.png")])


def test_time_ms_reports_the_median_and_no_separate_host_time_on_the_cpu():
    import torch
    from patchgemm.tools.bench import time_ms

    calls = []
    t = time_ms(lambda i: calls.append(i), torch.device("cpu"), warmup=2, reps=5)
    assert calls == [0, 1, 0, 1, 2, 3, 4]  # warm-ups, then one call per rep with its input index
    assert t.ms >= 0 and t.host_ms is None  # on the CPU the host time is the time: not a column of its own


def test_cpu_turns_pool_every_call_and_report_a_failing_baseline():
    import torch
    from patchgemm.tools import bench

    calls = {"fast": 0, "slow": 0}

    def run(name, ms):
        def call(i):
            calls[name] += 1
            time.sleep(ms / 1e3)
        return call

    def broken(i):
        raise RuntimeError("no such kernel here\nsecond line")

    best, errors = bench._take_turns({"fast": run("fast", 0.2), "slow": run("slow", 2.0), "broken": broken},
                                     torch.device("cpu"))
    assert errors == {"broken": "no such kernel here"}  # its first line, and the others still timed
    assert sorted(best) == ["fast", "slow"]
    # every turn's calls pooled: CPU_ROUNDS turns of at least 3 timed calls each, plus warm-ups
    assert calls["slow"] >= bench.CPU_ROUNDS * 3 and calls["fast"] > calls["slow"]
    assert 0.2 <= best["fast"].ms < best["slow"].ms and best["slow"].ms >= 2.0
    assert best["fast"].host_ms is None


def test_gpu_turns_keep_each_implementations_best_median(monkeypatch):
    import torch
    from patchgemm.tools import bench

    medians = iter([3.0, 5.0, 2.0, 6.0, 4.0, 4.0])  # ROUNDS = 3, each round starting with the next one
    order = []

    def time_ms(fn, device, **kw):
        order.append(fn)
        return bench.Timing(next(medians), 0.1)

    monkeypatch.setattr(bench, "ROUNDS", 3)
    monkeypatch.setattr(bench, "time_ms", time_ms)
    best, errors = bench._take_turns({"a": "a", "b": "b"}, torch.device("cuda"))
    assert order == ["a", "b", "b", "a", "a", "b"]  # none always first
    assert (best["a"].ms, best["b"].ms) == (3.0, 2.0) and best["a"].host_ms == 0.1 and not errors


def test_results_name_the_commit_of_the_checkout_they_ran_from(monkeypatch):
    import pathlib
    import subprocess

    from patchgemm.tools import bench

    root = pathlib.Path(bench.__file__).resolve().parents[2]
    if not (root / ".git").exists():
        pytest.skip("patchgemm is installed here, not imported from a checkout")
    monkeypatch.delenv("PATCHGEMM_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True)
    assert head.returncode == 0 and bench._commit() == head.stdout.strip()
    monkeypatch.setenv("PATCHGEMM_COMMIT", "abc123")  # a copy of the tree without git says which
    assert bench._commit() == "abc123"


def test_filter_names_cases_or_families_not_substrings():
    from patchgemm.tools.bench import _matches

    assert _matches("G1 fp32", "g1") and _matches("G1 fp32", "g1 fp32") and _matches("P3", "p3")
    assert not _matches("G1 fp32", "p3") and not _matches("P10", "p1")


def test_the_cpu_bench_names_atens_conv():
    from patchgemm.tools.bench import _conv_name

    assert _conv_name("cpu") == "ATen conv"
