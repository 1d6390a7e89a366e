"""Selection modes: autotune times every candidate that applies, keeps the fastest and caches it on disk
(round trip, corrupt and stale files, two processes writing at once, CUDA-graph capture, torch.compile);
the learned selector trains on the records and runs on the CPU; bad mode and implementation names
are clear errors."""

import glob
import gzip
import json
import math
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from patchgemm import selection
from patchgemm.tools import learned, tune
from patchgemm.ops import ops
from patchgemm.tools.shapes import _MAX_ELEMENTS, HELDOUT, _embed, _grouped, _unembed, model_shapes, problem
from conftest import DEVICES, assert_close_to_ref, needs_gpu, randn


@pytest.fixture
def autotune(tmp_path):
    """Autotune into a fresh cache directory; heuristic again afterwards, nothing remembered."""
    patchgemm.set_selection("autotune", cache_dir=str(tmp_path))
    yield str(tmp_path)
    patchgemm.set_selection("heuristic")
    ops._forget_selections()


def cache_file(directory):
    files = glob.glob(os.path.join(directory, "autotune-*.tsv"))
    assert len(files) == 1, files
    return files[0]


def grouped_case(device, batch=8, groups=3, din=16, dout=24, dtype=torch.float32):
    x = randn(batch, groups, din, dtype=dtype, device=device)
    w = randn(groups, dout, din, dtype=dtype, device=device)
    b = randn(groups, dout, dtype=dtype, device=device)
    ref = torch.einsum("bgi,goi->bgo", x.double(), w.double()) + b.double()
    return x, w, b, ref


def run_explained(fn, *args):
    with patchgemm.explain() as e:
        out = fn(*args)
    return out, e


@pytest.mark.parametrize("device", DEVICES)
def test_autotune_times_caches_and_reads_back(autotune, device):
    x, w, b, ref = grouped_case(device)
    y, first = run_explained(patchgemm.grouped_linear, x, w, b)
    assert_close_to_ref(y, ref, torch.float32)
    (c,) = first
    assert c.how == "autotune: timed now"
    applicable = {v.name for v in c.candidates if v.status != "unsupported"}
    assert c.chosen in applicable and all(v.reason.endswith(" ms") for v in c.candidates if v.name in applicable)
    path = cache_file(autotune)
    with open(path) as f:
        lines = f.read().splitlines()
    assert lines[0] == "# patchgemm autotune records, format 1" and lines[1].startswith("# environment: ")
    (record,) = learned.parse_records(lines[2:])
    assert record.op == "grouped_linear" and record.chosen == c.chosen
    assert record.fastest_ms == record.times[c.chosen] and record.features["groups"] == 3

    # Remembered in memory, then read back from the file once memory is forgotten.
    y, second = run_explained(patchgemm.grouped_linear, x, w, b)
    assert_close_to_ref(y, ref, torch.float32)
    assert second[0].chosen == c.chosen and second[0].how == f"autotune: cached in {path}"
    ops._forget_selections()
    _, third = run_explained(patchgemm.grouped_linear, x, w, b)
    assert third[0].chosen == c.chosen and third[0].how == f"autotune: cached in {path}"


@needs_gpu
def test_rule_features_name_the_candidate_the_heuristic_runs(autotune):
    # "tiny" passes its table's checks and its rule here but its kernel declines the problem (patches
    # of 192 elements): the record's rule features name what the heuristic ran instead, as the
    # learned mode computes them.
    x = randn(2, 3, 64, 64, device="cuda", dtype=torch.bfloat16)
    w = randn(16, 3, 8, 8, device="cuda", dtype=torch.bfloat16)
    patchgemm.set_selection("heuristic")
    _, (h,) = run_explained(lambda: patchgemm.patch_embed(x, w, None))
    assert h.chosen != "tiny" and any(v.name == "tiny" and v.status == "unsupported" for v in h.candidates)
    patchgemm.set_selection("autotune", cache_dir=autotune)
    run_explained(lambda: patchgemm.patch_embed(x, w, None))
    with open(cache_file(autotune)) as f:
        (record,) = learned.parse_records(f.read().splitlines()[2:])
    assert record.features["applies:tiny"] == 1.0
    assert [k for k, v in record.features.items() if k.startswith("rules_pick:") and v] == [f"rules_pick:{h.chosen}"]


def test_autotune_never_chooses_an_inapplicable_candidate(autotune):
    # A hierarchical token order: only the gather + GEMM path applies on the CPU.
    x = randn(2, 3, 8, 8)
    w = randn(16, 3, 2, 2)
    y, e = run_explained(lambda: ops.patch_embed(x, w, None, True, [2, 2, 2, 2]))
    (c,) = e
    unsupported = {v.name for v in c.candidates if v.status == "unsupported"}
    assert c.chosen == "gather_gemm" and {"aten_conv", "aten_linear", "view_gemm"} <= unsupported
    assert all(v.reason for v in c.candidates if v.status == "unsupported")

    # A record naming a candidate that does not apply (another build's, or edited) is not followed.
    path = cache_file(autotune)
    with open(path) as f:
        lines = f.read().splitlines()
    fields = lines[2].split("\t")
    fields[3], fields[4] = "aten_conv", fields[4].replace("aten_conv=-", "aten_conv=0.001")
    with open(path, "w") as f:
        f.write("\n".join(lines[:2] + ["\t".join(fields)]) + "\n")
    ops._forget_selections()
    y2, e2 = run_explained(lambda: ops.patch_embed(x, w, None, True, [2, 2, 2, 2]))
    assert e2[0].chosen == "gather_gemm" and "does not apply" in e2[0].how and e2[0].how.startswith("heuristic")
    torch.testing.assert_close(y2, y)


def test_corrupt_and_stale_cache_files_are_ignored_with_a_warning(autotune, capfd):
    # C++ warnings from custom ops reach stderr (torch.ops installs no Python warning handler).
    def warned(text):
        err = capfd.readouterr().err
        assert text in err and err.count("patchgemm autotune") == 1, err

    x, w, b, ref = grouped_case("cpu")
    patchgemm.grouped_linear(x, w, b)
    path = cache_file(autotune)
    with open(path) as f:
        lines = f.read().splitlines()

    with open(path, "w") as f:
        f.write("\x00garbage\nnot a record\n")
    ops._forget_selections()
    y, e = run_explained(patchgemm.grouped_linear, x, w, b)
    warned("not an autotune cache file or is corrupt")
    assert_close_to_ref(y, ref, torch.float32)
    assert e[0].how == "autotune: timed now"
    with open(path) as f:  # rewritten whole and valid
        assert len(learned.parse_records(f.read().splitlines()[2:])) == 1

    with open(path, "w") as f:  # a valid header, one good line, two broken ones
        f.write("\n".join(lines[:3] + ["grouped_linear\tflags\tsig", lines[2].replace("=", "~")]) + "\n")
    ops._forget_selections()
    _, e = run_explained(patchgemm.grouped_linear, x, w, b)
    warned("skipped 2 corrupt line")
    assert e[0].how.startswith("autotune: cached")

    with open(path, "w") as f:  # another environment's records
        f.write("\n".join([lines[0], "# environment: some other GPU"] + lines[2:]) + "\n")
    ops._forget_selections()
    _, e = run_explained(patchgemm.grouped_linear, x, w, b)
    warned("written for another environment")
    assert e[0].how == "autotune: timed now"


def test_unwritable_cache_keeps_choices_in_memory(tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    patchgemm.set_selection("autotune", cache_dir=str(blocker / "cache"))
    try:
        x, w, b, ref = grouped_case("cpu")
        y = patchgemm.grouped_linear(x, w, b)
        assert "cannot write the cache file" in capfd.readouterr().err
        assert_close_to_ref(y, ref, torch.float32)
        _, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert e[0].how.startswith("autotune: cached")
    finally:
        patchgemm.set_selection("heuristic")
        ops._forget_selections()


WRITER = textwrap.dedent("""
    import sys, torch, patchgemm
    patchgemm.set_selection("autotune", cache_dir=sys.argv[1])
    first = int(sys.argv[2])
    for din in range(first, first + 12):
        x, w = torch.randn(4, 2, din), torch.randn(2, 8, din)
        patchgemm.grouped_linear(x, w)
""")


def test_two_processes_write_one_cache(tmp_path):
    # From another directory: the installed package, not the source tree.
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(first)], stderr=subprocess.PIPE,
                              cwd=str(tmp_path)) for first in (1, 101)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()
    with open(cache_file(str(tmp_path))) as f:
        records = learned.parse_records(f.read().splitlines()[2:])
    dins = sorted(int(r.features["k"]) for r in records)
    assert dins == list(range(1, 13)) + list(range(101, 113))


def test_selection_is_stable_under_torch_compile(autotune):
    x, w, b, ref = grouped_case("cpu")
    eager, e = run_explained(patchgemm.grouped_linear, x, w, b)
    compiled = torch.compile(patchgemm.grouped_linear, fullgraph=True)
    for _ in range(2):
        y, e2 = run_explained(compiled, x, w, b)
        assert_close_to_ref(y, ref, torch.float32)
        assert [c.chosen for c in e2] == [e[0].chosen] and e2[0].how.startswith("autotune: cached")


def _constant_model(op, candidates):
    """A learned model for `op` alone that scores every candidate 0 (so the rules' order decides)."""
    return {"format": selection.MODEL_FORMAT, "backends": [], "ops": {op: {
        "candidates": candidates, "features": ["applies:" + candidates[0]], "hidden": 1, "mean": [0.0],
        "scale": [1.0], "w1": [[0.0]], "b1": [0.0], "w2": [[0.0]] * len(candidates), "b2": [0.0] * len(candidates)}}}


@needs_gpu
def test_no_timing_during_cuda_graph_capture(autotune, tmp_path):
    x, w, b, ref = grouped_case("cuda", batch=24)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())

    def captured_call():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), patchgemm.explain() as e:
            with torch.cuda.graph(graph, stream=stream):
                y = patchgemm.grouped_linear(x, w, b)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_ref(y, ref, torch.float32)
        return e[0].how

    assert captured_call() == "heuristic (autotune: no timing during CUDA-graph capture)"
    assert not glob.glob(os.path.join(autotune, "autotune-*.tsv"))
    # Learned runs the heuristic to make a new choice: not inside a graph, which would keep both.
    # (A model of grouped_linear's own: the shipped one may leave that op to the rules.)
    path = tmp_path / "model.json"
    path.write_text(json.dumps(_constant_model("grouped_linear", ["strided_batched", "aten_bmm"])))
    patchgemm.set_selection("learned", cache_dir="", model=str(path))
    assert captured_call() == "heuristic (learned: no new choice during CUDA-graph capture)"


# ---- modes and names -----------------------------------------------------------------------------


def test_bad_modes_and_names_are_clear_errors():
    with pytest.raises(ValueError, match="neither a mode .* nor an implementation name"):
        patchgemm.set_selection("fastest")
    with pytest.raises(ValueError, match="mode must be one of"):
        patchgemm.set_selection("")
    with pytest.raises(RuntimeError, match="cannot read the model file"):
        patchgemm.set_selection("learned", model="/nonexistent/model.json")
    assert patchgemm.get_selection() == "heuristic"


def test_an_implementation_name_pins_it_where_it_exists():
    x, w, b, ref = grouped_case("cpu")
    assert patchgemm.set_selection("aten_bmm") == "heuristic"
    try:
        y, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert_close_to_ref(y, ref, torch.float32)
        assert e[0].chosen == "aten_bmm" and e[0].forced
        _, e = run_explained(lambda: patchgemm.patch_embed(randn(1, 2, 4, 4), randn(8, 2, 2, 2)))
        assert not e[0].forced  # patch_embed has no aten_bmm: its heuristic
    finally:
        assert patchgemm.set_selection("heuristic") == "aten_bmm"
    _, e = run_explained(patchgemm.grouped_linear, x, w, b)
    assert not e[0].forced


def test_selection_from_the_environment(tmp_path):
    code = ("import patchgemm, torch; print(patchgemm.get_selection()); "
            "e = patchgemm.explain(patchgemm.grouped_linear, torch.randn(2, 2, 4), torch.randn(2, 3, 4)); "
            "print(e[0].how)")
    env = dict(os.environ, PATCHGEMM_SELECTION="autotune", PATCHGEMM_CACHE_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["autotune", "autotune: timed now"]
    assert glob.glob(os.path.join(str(tmp_path), "autotune-cpu-*.tsv"))


# ---- the learned selector ------------------------------------------------------------------------

SHAPES = {
    "train": [_grouped(f"g{i}", (b, g, d), o, dtype="fp32", bias=i % 2 == 0)
              for i, (b, g, d, o) in enumerate([(4, 2, 8, 8), (64, 4, 32, 16), (16, 8, 64, 64), (2, 3, 5, 7)])]
    + [_embed("e1", (2, 3, 8, 8), 16, (2, 2), "fp32"), _embed("e2", (2, 4, 16, 16), 8, (4, 4), "fp32", tokens=True),
       _unembed("u1", (2, 8, 4, 4), 3, (2, 2), "fp32")],
    "test": [_grouped("g-test", (32, 4, 16), 16, dtype="fp32"), _embed("e-test", (1, 3, 8, 8), 8, (4, 4), "fp32")],
}


def test_tune_sweep_trains_a_model_that_runs_on_the_cpu(tmp_path):
    records = tune.sweep(SHAPES, torch.device("cpu"), str(tmp_path), log=lambda *a: None)
    assert patchgemm.get_selection() == "heuristic"
    ops._forget_selections()
    ops_seen = {r.op for r in records}
    assert {"grouped_linear", "grouped_linear_grad_input", "patch_embed", "patch_weight_grad"} <= ops_seen
    for r in records:
        assert r.tags["sets"] and r.tags["device"] == "cpu" and r.tags["heuristic"] in r.times
        # The rule features name the candidate the heuristic ran (autotune runs it: a kernel may
        # decline a problem its table supports), as the learned mode computes them.
        picks = [k for k, v in r.features.items() if k.startswith("rules_pick:") and v]
        assert picks == [f"rules_pick:{r.tags['heuristic']}"]
        assert r.chosen == min((t, n) for n, t in r.times.items() if t is not None)[1]
    train = tune._select(records, ["train"], None, exclude=["test"])
    test = tune._select(records, ["test"], None)
    model = learned.train(train, steps=200)
    assert set(model["ops"]) <= ops_seen and model["ops"] and model["backends"] == ["cpu"]
    rows = tune.judge(test, model, tune.single_best(train))
    assert rows[-1]["op"] == "all" and rows[-1]["records"] == len(test)
    for row in rows:
        for mode in ("heuristic", "learned", "single best"):
            # (a geometric mean of one value comes back through exp(log): allow its rounding)
            assert row[mode]["mean"] >= 1.0 and row[mode]["worst"] >= row[mode]["mean"] * (1 - 1e-12)

    # Relabeling re-derives each record's heuristic choice and rule features from today's rules.
    originals = [(dict(r.tags), dict(r.features)) for r in records]
    for r in records:
        r.tags["heuristic"] = "stale"
        r.features.update({k: 1.0 - v for k, v in r.features.items() if k.startswith("rules_pick:")})
    shapes = SHAPES["train"] + SHAPES["test"]
    assert tune.relabel(records, torch.device("cpu"), shapes=shapes, log=lambda *a: None) == len(records)
    assert [(r.tags, r.features) for r in records] == originals
    assert patchgemm.get_selection() == "heuristic"

    # Saved as `tune --json` saves, judged again from the file and rendered into RESULTS.md.
    saved = tmp_path / "tune-cpu.json"
    saved.write_text(json.dumps({"environment": {"device": "cpu"}, "train_on": ["train"], "evaluate_on": ["test"],
                                 "report": {"train": rows, "evaluate": rows}, "records": [vars(r) for r in records]}))
    again, _ = tune.load_records([str(saved)])
    compressed = tmp_path / "tune-cpu.json.gz"  # the saved sweeps are gzip-compressed
    compressed.write_bytes(gzip.compress(saved.read_bytes()))
    assert [vars(r) for r in tune.load_records([str(compressed)])[0]] == [vars(r) for r in again]
    _, report = tune.train_and_judge(again, ["train"], ["test"], model=model)  # (training is checked above)
    assert report["evaluate"][-1]["records"] == len(test)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
    import results

    assert results.main([str(saved), "--out", str(tmp_path / "RESULTS.md")]) == 0
    assert "## Selection modes, regret" in (tmp_path / "RESULTS.md").read_text()
    # `tune --records-only` writes the records alone (a GPU's sweep, trained on elsewhere): read back
    # whole, and no section of their own.
    from patchgemm.__main__ import main as cli

    only = tmp_path / "tune-records.json.gz"
    assert cli(["tune", "--from-json", str(saved), "--records-only", "--json", str(only)]) == 0
    assert [vars(r) for r in tune.load_records([str(only)])[0]] == [vars(r) for r in again]
    assert results.main([str(only), "--out", str(tmp_path / "RESULTS.md")]) == 0
    assert "## Selection" not in (tmp_path / "RESULTS.md").read_text()

    # Installed, the C++ side picks what the Python mirror predicts.
    path = str(tmp_path / "model.json")
    learned.save(model, path)
    patchgemm.set_selection("learned", cache_dir="", model=path)
    try:
        x, w, b, ref = grouped_case("cpu", batch=32, groups=4, din=16, dout=16)
        y, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert_close_to_ref(y, ref, torch.float32)
        (c,) = e
        (r,) = [r for r in test if r.op == "grouped_linear" and r.signature == c.signature]
        expected = learned.predict(model, r)
        if expected is None:
            assert c.how == "heuristic (learned: no usable model for grouped_linear)"
        else:
            assert c.how == "learned: predicted now" and c.chosen == expected
        _, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert e[0].chosen == c.chosen
    finally:
        patchgemm.set_selection("heuristic")
        ops._forget_selections()


def test_tune_sweep_in_memory_keeps_every_shapes_records():
    # With no cache directory the records live in memory only, which each shape's heuristic pass
    # empties: the sweep keeps them shape by shape.
    records = tune.sweep({"test": SHAPES["test"]}, torch.device("cpu"), "", log=lambda *a: None)
    assert {r.tags["shape"] for r in records} == {s.id for s in SHAPES["test"]}
    assert {r.op for r in records} >= {"grouped_linear", "grouped_linear_grad_input", "patch_embed"}


def test_tune_sweep_gives_back_the_selection_in_force(tmp_path):
    mine, sweeps = tmp_path / "mine", tmp_path / "sweep"
    patchgemm.set_selection("autotune", cache_dir=str(mine))
    try:
        tune.sweep({"test": SHAPES["test"][:1]}, torch.device("cpu"), str(sweeps), log=lambda *a: None)
        assert patchgemm.get_selection() == "autotune"
        ops._forget_selections()
        x, w, b, _ = grouped_case("cpu", batch=5)  # a signature the sweep did not time
        _, chosen = run_explained(patchgemm.grouped_linear, x, w, b)
        assert [c.how for c in chosen] == ["autotune: timed now"]
        assert "grouped_linear\t" in pathlib.Path(cache_file(str(mine))).read_text()  # not the sweep's
    finally:
        patchgemm.set_selection("heuristic")
        ops._forget_selections()


def test_learned_without_a_model_keeps_the_choices_autotune_remembered():
    """Learned mode for an op its model does not cover runs the heuristic, except where a choice is
    remembered for the signature (here timed by autotune in this process): that choice stands."""
    x, w, b, ref = grouped_case("cpu", batch=6)
    patchgemm.set_selection("autotune", cache_dir="")
    try:
        _, timed = run_explained(patchgemm.grouped_linear, x, w, b)
        assert [c.how for c in timed] == ["autotune: timed now"]
        ops._set_learned_model("grouped_linear", [], [], 0, [], [])  # no model for the op
        patchgemm.set_selection("learned", cache_dir="")
        y, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert_close_to_ref(y, ref, torch.float32)
        assert [(c.chosen, c.how) for c in e] == [(timed[0].chosen, "autotune: timed in this process")]
        other = grouped_case("cpu", batch=7)[:3]  # a signature nothing remembers
        _, e = run_explained(patchgemm.grouped_linear, *other)
        assert e[0].how == "heuristic (learned: no usable model for grouped_linear)"
    finally:
        patchgemm.set_selection("heuristic")
        selection.install_model(selection.load_model())
        ops._forget_selections()


def test_the_shipped_model_leaves_the_cpu_to_the_rules_and_predicts_where_allowed():
    model = selection.load_model()
    assert model["ops"] and model["description"] and model["backends"] == ["cuda"]
    x, w = randn(2, 3, 32, 32), randn(64, 3, 4, 4)
    patchgemm.set_selection("learned", cache_dir="", unsure_gap=0)  # (the prediction alone)
    try:
        y, e = run_explained(lambda: patchgemm.patch_embed(x, w, None))
        torch.testing.assert_close(y, F.conv2d(x, w, stride=4), rtol=1e-4, atol=1e-4)
        assert e[0].how == "heuristic (learned: no usable model for patch_embed)"  # GPU timings only
        # Allowed on every backend, it predicts on the CPU too: the candidates a CPU build lacks
        # count as not applying.
        selection.install_model(dict(model, backends=[]))
        ops._forget_selections()
        y, e = run_explained(lambda: patchgemm.patch_embed(x, w, None))
        torch.testing.assert_close(y, F.conv2d(x, w, stride=4), rtol=1e-4, atol=1e-4)
        assert e[0].how == "learned: predicted now" and e[0].chosen in {"gather_gemm", "aten_conv"}
    finally:
        patchgemm.set_selection("heuristic")
        ops._forget_selections()


def tie_model(op, candidates, lead):
    """A model scoring `candidates` of `op` 0 but the last, `lead` above them, on every problem."""
    scores = [0.0] * (len(candidates) - 1) + [lead]
    # one feature (an "applies:" one: missing is 0), one hidden unit, all weights 0: b2 is the score
    ops._set_learned_model(op, candidates, ["applies:nothing"], 1, [0.0, 1.0, 0.0, 0.0] + [0.0] * len(candidates)
                           + scores, [])


def test_learned_times_the_contenders_it_cannot_tell_apart():
    """Where candidates score within the unsure gap of the best, the first call of a signature times
    them (in memory) and later calls take that choice; a lead above the gap is predicted; with the
    timing budget spent, and under deterministic algorithms, the prediction alone decides."""
    x, w, b, ref = grouped_case("cpu", batch=5)
    contenders = ["strided_batched", "aten_bmm"]
    try:
        patchgemm.set_selection("learned", cache_dir="", unsure_gap=1.0)
        tie_model("grouped_linear", contenders, 0.3)
        y, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert_close_to_ref(y, ref, torch.float32)
        assert e[0].how.startswith("learned: unsure between the contenders, timed now") and e[0].chosen in contenders
        timed = {v.name: v.reason for v in e[0].candidates if v.name in contenders}
        assert all(r.endswith(" ms") for r in timed.values()), str(e)
        # The fastest, or PyTorch's path (aten_bmm) where within 5% or 1 us of it, and explain says
        # which. (The times are printed to 1e-4 ms.)
        ms = {name: float(r.split()[0]) for name, r in timed.items()}
        fastest = min(ms.values())
        if e[0].how.endswith("; PyTorch's path, within 5% or 1 us of the fastest"):
            assert e[0].chosen == "aten_bmm" and ms["aten_bmm"] <= max(1.05 * fastest, fastest + 1e-3) + 1e-4, str(e)
        else:
            assert ms[e[0].chosen] <= fastest + 1e-4, str(e)
        assert all(v.status != "chosen" or v.name in contenders for v in e[0].candidates)
        _, again = run_explained(patchgemm.grouped_linear, x, w, b)
        assert (again[0].chosen, again[0].how) == (e[0].chosen, "learned: contenders timed earlier in this process")

        patchgemm.set_selection("learned", cache_dir="", unsure_gap=0.2)  # the lead, 0.3, is above it
        ops._forget_selections()
        tie_model("grouped_linear", contenders, 0.3)
        _, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert (e[0].chosen, e[0].how) == ("aten_bmm", "learned: predicted now")

        ops._set_learned_unsure_gap(1.0, 0.0)  # no time to spend: the prediction decides
        ops._forget_selections()
        _, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert (e[0].chosen, e[0].how) == ("aten_bmm", "learned: predicted now")

        patchgemm.set_selection("learned", cache_dir="", unsure_gap=1.0)
        ops._forget_selections()
        tie_model("grouped_linear", contenders, 0.3)
        with DeterministicAlgorithms():
            y, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert (e[0].chosen, e[0].how) == ("aten_bmm", "learned: predicted now")
        assert_close_to_ref(y, ref, torch.float32)
    finally:
        patchgemm.set_selection("heuristic")
        selection.install_model(selection.load_model())
        ops._forget_selections()


def test_where_unsure_learned_times_pytorchs_paths_too():
    """Contenders the model cannot tell apart are timed with PyTorch's own paths that apply, which
    it scored far below them (here: does not know)."""
    x = randn(4, 3, 8, 8)  # one patch per sample: x is its own patch matrix (view_gemm)
    w = randn(16, 3, 8, 8) / 8
    try:
        patchgemm.set_selection("learned", cache_dir="", unsure_gap=1.0)
        tie_model("patch_embed", ["view_gemm", "gather_gemm"], 0.3)
        with patchgemm.explain() as e:
            y = patchgemm.patch_embed(x, w, out_format="tokens")
        ref = F.conv2d(x.double(), w.double(), stride=8).flatten(2).transpose(1, 2)
        assert_close_to_ref(y, ref, torch.float32)
        assert e[0].how.startswith("learned: unsure between the contenders, timed now"), str(e)
        timed = {v.name for v in e[0].candidates if v.reason.endswith(" ms")}
        assert timed == {"view_gemm", "gather_gemm", "aten_linear", "aten_conv"}, str(e)
    finally:
        patchgemm.set_selection("heuristic")
        selection.install_model(selection.load_model())
        ops._forget_selections()


@needs_gpu
def test_without_a_model_learned_times_every_candidate_on_the_gpu():
    """On a GPU, an op the model does not cover times every candidate that applies once per
    signature, taking PyTorch's path
    where it is within 5% or 1 us of the fastest, else the rules' pick where it is, else the
    fastest; the choice is remembered for the signature. Without timing (no budget, or
    deterministic algorithms) the rules' pick stands."""
    x, w, b, ref = grouped_case("cuda", batch=1000, groups=3, din=333, dout=77)
    try:
        patchgemm.set_selection("learned", cache_dir="")
        y, e = run_explained(patchgemm.grouped_linear, x, w, b)
        assert_close_to_ref(y, ref, torch.float32)
        assert e[0].how.startswith("learned: no model for grouped_linear; every candidate timed now"), str(e)
        timed = {v.name: float(v.reason[:-3]) for v in e[0].candidates if v.reason.endswith(" ms")}
        assert {"strided_batched", "aten_bmm", "cublaslt_algo1"} <= set(timed), str(e)
        fastest = min(timed.values())
        within = max(1.05 * fastest, fastest + 1e-3)
        near, far = (lambda n: timed[n] <= within + 1e-4), (lambda n: timed[n] >= within - 1e-4)  # (0.1 us printed)
        chosen = e[0].chosen
        if chosen == "aten_bmm":
            assert near("aten_bmm"), str(e)
        elif chosen == "strided_batched":
            assert far("aten_bmm") and near("strided_batched"), str(e)
        else:
            assert far("aten_bmm") and far("strided_batched") and timed[chosen] <= fastest + 1e-4, str(e)
        _, again = run_explained(patchgemm.grouped_linear, x, w, b)
        assert [(c.chosen, c.how) for c in again] == [(e[0].chosen, "learned: no model; timed earlier in this process")]
        ops._forget_selections()
        patchgemm.set_selection("learned", cache_dir="", unsure_gap=0)  # no timing: the rules alone
        _, rules = run_explained(patchgemm.grouped_linear, x, w, b)
        assert [(c.chosen, c.how) for c in rules] == [
            ("strided_batched", "heuristic (learned: no usable model for grouped_linear)")]
    finally:
        patchgemm.set_selection("heuristic")
        ops._forget_selections()


def patch_training_case(device):
    """x [4, 3, 32, 32], k = 8, E = 32, float32, and its float64 forward and dW for grad_y = y."""
    x = randn(4, 3, 32, 32, device=device)
    w = randn(32, 3, 8, 8, device=device) / 8
    b = randn(32, device=device)
    w64 = w.double().requires_grad_()
    y64 = F.conv2d(x.double(), w64, b.double(), stride=8).flatten(2).transpose(1, 2)
    (dw64,) = torch.autograd.grad(y64, [w64], y64.detach())
    return x, w, b, y64.detach(), dw64


def train_step_explained(x, w, b):
    """patch_embed into tokens with w requiring grad, and dW for grad_y = y, under explain()."""
    w = w.detach().requires_grad_()
    with patchgemm.explain() as e:
        y = patchgemm.patch_embed(x, w, b, out_format="tokens")
        (dw,) = torch.autograd.grad(y, [w], y.detach())
    # The weight gradients run while the forward was timed are not the step's: explain shows its own.
    assert [c.op for c in e] == ["patch_embed", "patch_weight_grad"], str(e)
    return y, dw, e[:1]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["autotune", "learned"])
def test_a_training_forward_is_chosen_with_its_weight_gradient(mode, device, tmp_path):
    """Where its weight gradient follows, patch_embed's forward is timed together with that
    gradient (some forwards leave the patch matrix it multiplies), remembered apart from the same
    forward in inference; the learned mode times every forward that leaves such a matrix beside
    the one it predicts. The results are those of the float64 reference either way."""
    x, w, b, y64, dw64 = patch_training_case(device)
    try:
        patchgemm.set_selection(mode, cache_dir=str(tmp_path) if mode == "autotune" else "", unsure_gap=1.0)
        if mode == "learned":  # a clear lead for PyTorch's convolution, which leaves no patch matrix
            tie_model("patch_embed", ["aten_linear", "gather_gemm", "aten_conv"], 5.0)
        with patchgemm.explain() as e:  # inference: nothing requires grad
            y = patchgemm.patch_embed(x, w, b, out_format="tokens")
        assert_close_to_ref(y, y64, torch.float32)
        assert "weight gradient follows" not in e[0].signature, str(e)
        if mode == "learned":
            assert (e[0].chosen, e[0].how) == ("aten_conv", "learned: predicted now"), str(e)

        y, dw, e = train_step_explained(x, w, b)
        assert_close_to_ref(y, y64, torch.float32)
        assert_close_to_ref(dw, dw64, torch.float32, what="dW")
        assert len(e) == 1 and "weight gradient follows" in e[0].signature, str(e)
        timed_now = "learned: unsure between the contenders, timed now" if mode == "learned" else "autotune: timed now"
        assert e[0].how.startswith(timed_now + " with the step that follows"), str(e)
        # Every forward that applies is timed: those the model scores far below the best too,
        # where they leave the patch matrix (aten_linear does not apply to fp32 on CUDA).
        applies = {v.name for v in e[0].candidates if v.status != "unsupported"}
        timed = {v.name for v in e[0].candidates if v.reason.endswith(" ms")}
        assert {"gather_gemm", "aten_conv"} <= timed and applies & {"aten_linear"} <= timed, str(e)

        y, dw, again = train_step_explained(x, w, b)  # remembered, and the result is the same
        assert again[0].chosen == e[0].chosen and "timed now" not in again[0].how, str(again)
        assert_close_to_ref(dw, dw64, torch.float32, what="dW")
    finally:
        patchgemm.set_selection("heuristic")
        selection.install_model(selection.load_model())
        ops._forget_selections()


class DeterministicAlgorithms:
    def __enter__(self):
        self.before = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.before)


@pytest.mark.parametrize("gap", [-1, float("nan"), float("inf"), "1", True])
def test_a_bad_unsure_gap_is_a_clear_error(gap):
    with pytest.raises(ValueError, match="unsure_gap must be a number >= 0"):
        patchgemm.set_selection("learned", unsure_gap=gap)


def test_the_shipped_model_times_where_it_is_unsure():
    assert selection.load_model().get("unsure_gap", 0) > 0


def test_bad_model_files_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 99, "ops": {}}')
    with pytest.raises(RuntimeError, match="not a model file of format 1"):
        selection.load_model(str(bad))
    with pytest.raises(RuntimeError, match="expected .* parameters"):
        ops._set_learned_model("grouped_linear", ["strided_batched"], ["m"], 2, [0.0, 1.0], [])


def test_model_shapes_are_a_reproducible_sequence_apart_from_the_held_out_set():
    shapes = model_shapes(400, seed=0)
    assert shapes[:100] == model_shapes(100, seed=0)  # --random-start and relabel count on prefixes
    assert shapes != model_shapes(400, seed=1)
    assert tune.random_shape_count({s.id for s in shapes}, "model-") == 400
    assert {s.id.split("-")[1] for s in shapes} == {"stem", "down", "head"}
    held_out = {(s.op, s.x, s.width, s.kernel, s.dtype, s.tokens, s.channels_last) for s in HELDOUT}
    assert not [s.id for s in shapes if (s.op, s.x, s.width, s.kernel, s.dtype, s.tokens, s.channels_last) in held_out]
    assert any(s.x[1] % 8 for s in shapes if s.op == "patch_embed" and not s.channels_last and s.x[1] > 3)
    for s in shapes:
        c_in = s.x[-1] if s.tokens and s.op == "patch_unembed" else s.x[1]
        grid = s.grid if s.tokens else s.x[2:]
        size = [g * k for g, k in zip(grid, s.kernel)] if s.op == "patch_unembed" else s.x[2:]
        assert len(size) == len(s.kernel) and all(n % k == 0 for n, k in zip(size, s.kernel)), s
        out = s.width * math.prod(size) if s.op == "patch_unembed" else s.width * math.prod(n // k for n, k in zip(size, s.kernel))
        assert max(math.prod(s.x), s.x[0] * out) <= _MAX_ELEMENTS and c_in >= 1, s
    small = next(s for s in shapes if s.op == "patch_embed" and math.prod(s.x) < 1 << 16)
    inputs = problem(small, torch.device("cpu")).make_inputs()  # the sweep can build its inputs
    assert inputs["x"].shape == small.x


def _synthetic_records():
    """Two GPUs' records of 8 training shapes and 1 shape the held-out set also produced: candidate
    "a" is faster when m is small, "b" when it is large."""
    records = []
    for i in range(9):
        m = 2.0 ** i
        for gpu in ("GPU A", "GPU B"):
            sets = "heldout,tuning" if i == 8 else "tuning"
            records.append(learned.Record(
                "grouped_linear", "", f"(m {m})", "a", {"a": 1.0 + m / 64, "b": 1.0 + 4 / m},
                {"m": m, "device_sms": 100.0 if gpu == "GPU A" else 132.0},
                {"shape": f"s{i}", "device": gpu, "sets": sets, "heuristic": "a"}))
    return records


def test_validation_drops_the_ops_whose_model_does_not_beat_the_rules(monkeypatch):
    """grouped_linear's rule ("a") loses on large m, which the model learns: kept. patch_embed's rule is
    always right, so its model can at best match it: dropped, and learned mode runs the rule there."""
    records = _synthetic_records()
    for r in _synthetic_records():
        r.op, r.times = "patch_embed", {"a": 1.0, "b": 2.0}
        records.append(r)
    real_train = learned.train
    monkeypatch.setattr(learned, "train", lambda rs, **options: real_train(rs, **{**options, "steps": 300}))
    model = learned.train(tune._select(records, ["tuning"], None, exclude=["heldout"]))
    assert set(model["ops"]) == {"grouped_linear", "patch_embed"}
    verdicts = tune.drop_unvalidated(model, records, ["tuning"], 4)
    assert set(model["ops"]) == {"grouped_linear"}, verdicts
    assert verdicts["grouped_linear"].startswith("kept") and verdicts["patch_embed"].startswith("dropped")
    assert model["validation"] == verdicts
    embed = [r for r in records if r.op == "patch_embed"]
    assert all(learned.predict(model, r) is None for r in embed)  # no model: the heuristic runs
    assert tune.judge(embed, model, {})[-1]["learned"]["mean"] == 1.0


def test_validation_keeps_a_model_only_where_it_beats_the_rules_by_more_than_a_tie(monkeypatch):
    """A model whose cross-validated regret ties the rules' (within MIN_GAIN_OVER_RULES) is dropped."""
    heuristic = 1.030
    means = {"tie": heuristic * (1 - tune.MIN_GAIN_OVER_RULES / 2),
             "win": heuristic * (1 - 2 * tune.MIN_GAIN_OVER_RULES)}
    rows = [{"op": op, "learned": {"mean": mean}, "heuristic": {"mean": heuristic}} for op, mean in means.items()]
    monkeypatch.setattr(tune, "cross_validate", lambda *args, **kwargs: rows + [{"op": "all"}])
    model = {"ops": {"tie": {}, "win": {}}}
    verdicts = tune.drop_unvalidated(model, [], ["tuning"], 5)
    assert set(model["ops"]) == {"win"}
    assert verdicts["tie"].startswith("dropped") and verdicts["win"].startswith("kept"), verdicts


def test_the_sweep_can_be_limited_to_channels_last_shapes():
    every = tune.shape_sets(["tuning", "heldout", "random", "models"], 400, 400)
    only = tune.shape_sets(["tuning", "heldout", "random", "models"], 400, 400, only_channels_last=True)
    assert list(only) == list(every)
    for name, shapes in only.items():
        assert shapes == [s for s in every[name] if s.channels_last] and shapes, name
    assert tune.shape_sets(["random"], 400, 0, start=100)["random"] == every["random"][100:]


def test_a_problem_saved_twice_is_one_record_of_both_sets(tmp_path):
    records = _synthetic_records()
    again = learned.Record(**json.loads(json.dumps(vars(records[0]))))  # the same problem, swept again
    again.tags.update(sets="heldout", shape="h0")
    paths = []
    for i, rs in enumerate([records, [again]]):
        paths.append(str(tmp_path / f"tune-{i}.json"))
        pathlib.Path(paths[-1]).write_text(json.dumps({"environment": {"run": i}, "records": [vars(r) for r in rs]}))
    loaded, env = tune.load_records(paths)
    assert env == {"run": 0} and len(loaded) == len(records)
    assert loaded[0].tags["sets"] == "heldout,tuning" and loaded[0].tags["shape"] == "s0"
    assert loaded[0] not in tune._select(loaded, ["tuning"], None, exclude=["heldout"])


def test_cross_validation_judges_each_record_by_a_model_without_its_shape(monkeypatch):
    records = _synthetic_records()
    real_train, real_predict, trained_on = learned.train, learned.predict, {}

    def train(rs, **options):
        model = real_train(rs, steps=50, **{k: v for k, v in options.items() if k != "steps"})
        trained_on[id(model)] = {r.tags["shape"] for r in rs}
        assert all(r.tags["device"] == "GPU A" for r in rs)  # --train-device
        return model

    def predict(model, r):
        assert r.tags["shape"] not in trained_on[id(model)]
        return real_predict(model, r)

    monkeypatch.setattr(learned, "train", train)
    monkeypatch.setattr(learned, "predict", predict)
    rows = tune.cross_validate(records, ["tuning"], 4, train_device="GPU A")
    assert len(trained_on) == 4
    assert all("s8" not in shapes for shapes in trained_on.values())  # held-out shapes never train
    assert rows[-1]["op"] == "all" and rows[-1]["records"] == 16  # every training record judged once
    assert rows[-1]["heuristic"]["worst"] == max(r.regret("a") for r in records[:16])
    for mode in ("heuristic", "learned", "single best"):
        assert rows[-1][mode]["mean"] >= 1.0 - 1e-12
    monkeypatch.undo()
    judged_b = tune.cross_validate(records, ["tuning"], 2, evaluate_device="GPU B", steps=50)
    assert judged_b[-1]["records"] == 8
    with pytest.raises(ValueError, match="at least 2 folds"):
        tune.cross_validate(records, ["tuning"], 1)


def _family_records():
    """Records of two model families and of the random sequence: PyTorch's "aten_bmm" is faster where
    m is small, "ours" where it is large; the heuristic always runs "ours"."""
    records = []
    for family, sizes in (("dit", range(0, 6)), ("moe", range(3, 9)), ("random", range(0, 9))):
        for i in sizes:
            m = 2.0 ** i
            shape = f"random-{i}" if family == "random" else f"{family}/s{i}"
            records.append(learned.Record(
                "grouped_linear", "", f"({family} m {m})", "ours", {"aten_bmm": 1.0 + 4 / m, "ours": 1.0 + m / 64},
                {"m": m}, {"shape": shape, "device": "GPU A", "sets": "families", "heuristic": "ours"}))
    return records


def test_each_family_is_judged_by_a_model_that_never_saw_it(monkeypatch):
    records = _family_records()
    real_train, trained_on = learned.train, []

    def train(rs, **options):
        trained_on.append({tune.record_family(r) for r in rs})
        return real_train(rs, **{**options, "steps": 200})

    monkeypatch.setattr(learned, "train", train)
    rows = tune.hold_out_families(records, margins=(0.0, 100.0), log=lambda *a: None)
    assert [row["family"] for row in rows] == ["dit", "moe"]  # the random sequence is never held out
    assert trained_on == [{"moe", "random"}, {"dit", "random"}]
    for row in rows:
        assert row["records"] == 6 and row["train_records"] == len(records) - 6
        # the heuristic ("ours") is slower than PyTorch by more than 3% wherever 1 + m/64 > 1.03 (1 + 4/m)
        expected = sum(1 + m / 64 > 1.03 * (1 + 4 / m) for m in (r.features["m"] for r in records
                                                                  if tune.record_family(r) == row["family"]))
        assert row["heuristic"]["slower_than_pytorch"] == pytest.approx(expected / 6)
        # a margin of 100 always runs PyTorch's path: never slower than it
        assert row["learned +100"]["slower_than_pytorch"] == 0.0
        assert row["learned"] == row["learned +0"]
    table = tune.format_families(rows, (0.0, 100.0))
    assert "| dit | 6 |" in table and "| mean over families | 12 |" in table
    with pytest.raises(ValueError, match="no records of the families nope"):
        tune.hold_out_families(records, ["nope"])


def test_an_unsure_gap_judges_the_fastest_of_the_contenders(monkeypatch):
    """learned.predict with an unsure gap picks, among the candidates scored within it of the best,
    the fastest by the record's times; hold_out_families reports it as a mode of its own."""
    records = _family_records()
    model = learned.train(records, steps=50)
    for r in records:
        s = learned.scores(model["ops"]["grouped_linear"], r.features)
        fastest = min(r.times, key=r.times.get)
        predicted = learned.predict(model, r)
        assert learned.predict(model, r, unsure_gap=abs(s["aten_bmm"] - s["ours"]) + 1e-9) == fastest
        assert learned.predict(model, r, unsure_gap=abs(s["aten_bmm"] - s["ours"]) / 2) == predicted
    real_train = learned.train
    monkeypatch.setattr(learned, "train", lambda rs, **o: real_train(rs, **{**o, "steps": 100}))
    rows = tune.hold_out_families(records, margins=(0.0,), unsure_gaps=(0.0, 1e9), log=lambda *a: None)
    for row in rows:
        assert row["learned +0, timed within 1e+09"]["worst"] == 1.0  # every choice timed: the fastest
    table = tune.format_families(rows, (0.0,), (0.0, 1e9))
    assert "learned +0, timed within 1e+09 mean" in table


def test_a_margin_raises_only_pytorchs_scores():
    records = _family_records()
    model = learned.train(records, steps=50)
    leaning = learned.with_pytorch_margin(model, 0.5)
    assert leaning["pytorch_margin"] == 0.5 and model.get("pytorch_margin") is None
    for r in records:
        before, after = (learned.scores(m["ops"]["grouped_linear"], r.features) for m in (model, leaning))
        assert after["aten_bmm"] == pytest.approx(before["aten_bmm"] + 0.5) and after["ours"] == before["ours"]
