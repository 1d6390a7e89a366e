"""``python -m patchgemm tune``: time every implementation over shape sets, keep the records, train the
learned selector on some sets and report every mode's regret on the others.

    python -m patchgemm tune [--random N [--random-start K]] [--model-like N] [--only-channels-last]
                             [--train-on tuning,random,models,families] [--evaluate-on heldout] [--validate K]
                             [--margin M] [--unsure-gap G] [--model PATH] [--json PATH] [--cache-dir DIR]
    python -m patchgemm tune --from-json A.json[,B.json] [--relabel] [--train-device TEXT] [--evaluate-device TEXT] ...
    python -m patchgemm tune --from-json A.json[,B.json] --cross-validate K [--train-device TEXT] ...
    python -m patchgemm tune [--from-json A.json,...] --hold-out-families all|F,... [--margins 0,0.5,1]
                             [--unsure-gaps 0,1.5]
    python -m patchgemm tune ... --records-only --json PATH

Each shape (patchgemm/tools/shapes.py) runs forward and forward + backward twice: under the heuristic, to
note its choice, then under autotune, which times every candidate of every op call it makes and
writes the records to the autotune cache (so a tuned machine's later processes start tuned). The
records of the ``--train-on`` sets train the model; those of the ``--evaluate-on`` sets, which it
never sees, judge it. Regret = t(selected) / t(fastest candidate) per record; reported per mode as
geometric mean, worst case and share of records over 1.2x, with the speedup of each mode over
"always the single best implementation" (per op, the candidate of least mean regret on the training
records, the heuristic's choice where it does not apply). ``--relabel`` re-runs saved records'
shapes under today's heuristic (untimed), so that saved timings judge changed rules.
``--records-only`` writes the records (swept, or read and relabeled) and trains nothing: the records
of a GPU machine come back to be judged and trained on elsewhere.
``--cross-validate K`` judges each training record by a model trained without its shape, so that
choices about training (which records, which options) are made without looking at the held-out sets;
``--validate K`` keeps in the trained model only the ops whose cross-validated choices beat the
heuristic's (the others choose by the heuristic in learned mode); ``--margin M`` leans the trained
model toward PyTorch's own paths (``learned.with_pytorch_margin``); ``--unsure-gap G`` makes the learned
mode time the candidates the model scores within G of the best. ``--hold-out-families`` judges the
modes the way a new model meets them: each model family of ``shapes.FAMILIES`` (and of the tuning and
held-out sets) in turn by a model trained on every other family's records, with the share of records
where a mode's choice is more than 3% slower than PyTorch's fastest path.
"""

import gzip
import json
import math
import random
import statistics
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import selection
from . import learned
from .bench import environment
from .learned import Record
from .shapes import HELDOUT, TUNING, Shape, family_of, family_shapes, model_shapes, problem, random_shapes

SETS = ("tuning", "heldout", "random", "models", "families")
TRAINING_SETS = ("tuning", "random", "models", "families")  # `--train-on`'s default: what the shipped model trains on


def sweep(sets: Dict[str, List[Shape]], device: torch.device, cache_dir: str, log=print) -> List[Record]:
    """Autotunes every shape of the sets (name -> shapes); returns their records, tagged with the sets
    that produced them, the heuristic's choice, the shape and the device."""
    tags: Dict[str, Dict[str, str]] = {}  # (op, signature) -> tags
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    failures: List[str] = []
    with selection.restored_selection():
        for set_name, shapes in sets.items():
            for i, s in enumerate(shapes):
                try:
                    _tune_shape(s, device, cache_dir, set_name, device_name, tags)
                except torch.OutOfMemoryError:
                    log(f"  {s.id}: out of memory, skipped")
                    torch.cuda.empty_cache()
                except RuntimeError as e:  # reported, and the sweep goes on
                    log(f"  {s.id}: FAILED: {e}")
                    failures.append(s.id)
                if (i + 1) % 25 == 0 or i + 1 == len(shapes):
                    log(f"  {set_name}: {i + 1}/{len(shapes)} shapes")
        timed = selection.autotune_records()
    if failures:
        log(f"  {len(failures)} shape(s) failed: {', '.join(failures)}")
    records = []
    for r in learned.parse_records(timed):
        t = tags.get(f"{r.op}\t{r.signature}")
        if t is not None:
            r.tags = dict(t)
            records.append(r)
    return records


def shape_sets(names: List[str], random: int, model_like: int, seed: int = 0, start: int = 0,
               only_channels_last: bool = False) -> Dict[str, List[Shape]]:
    """The named sets' shapes: ``random`` / ``model_like`` shapes of the random and models sequences
    (from the ``start``-th on), and only the channels-last ones where ``only_channels_last``."""
    every = {"tuning": lambda: TUNING, "heldout": lambda: HELDOUT,
             "random": lambda: random_shapes(random, seed)[start:],
             "models": lambda: model_shapes(model_like, seed)[start:],
             "families": family_shapes}
    return {name: [s for s in every[name]() if s.channels_last or not only_channels_last]
            for name in dict.fromkeys(names)}


def _passes(s: Shape, device: torch.device):
    """The shape's forward and forward + backward, as calls on fresh inputs."""
    prob = problem(s, device)
    inputs = prob.make_inputs()
    with torch.no_grad():
        dy = torch.randn_like(prob.ours(**inputs))

    def forward():
        with torch.no_grad():
            prob.ours(**inputs)

    def forward_backward():
        torch.autograd.grad(prob.ours(**inputs), [inputs[k] for k in prob.grad_inputs], dy)

    return forward, forward_backward


def add_sets(tags: Dict[str, str], sets: str) -> None:
    """Adds the comma-separated `sets` to the record tags' "sets" (kept sorted, without repeats)."""
    names = set(filter(None, tags.get("sets", "").split(","))) | set(filter(None, sets.split(",")))
    tags["sets"] = ",".join(sorted(names))


# The candidates that reuse a step's earlier work (patch_embed's patch matrix, in its weight
# gradient). Autotune never times them, and a record's problem may come without that work (a
# training forward timed with the weight gradient that follows it): the heuristic a record is judged
# by is the rules' choice among the others.
_REUSING = ("saved_patches",)


def _heuristic_choices(run, cache_dir: Optional[str] = None) -> Dict[tuple, "selection.Choice"]:
    # (A sweep passes its autotune directory: changing the directory empties autotune's memory,
    # which holds a memory-only sweep's records.)
    selection.set_selection("heuristic", cache_dir=cache_dir)
    known = {c.name for c in selection.kernels()}
    torch.ops.patchgemm._set_selection_testing(True, [n for n in _REUSING if n in known])
    try:
        with selection.explain() as heuristic:
            run()
    finally:
        torch.ops.patchgemm._set_selection_testing(True, [])
    return {(c.op, c.signature): c for c in heuristic}


def set_heuristic(r: Record, name: str) -> None:
    """Tags the record with the heuristic's choice and sets its rule features to match
    (``rules_pick:<name>`` is 1 for the candidate the heuristic runs, 0 for the others)."""
    r.tags["heuristic"] = name
    for k in r.features:
        if k.startswith("rules_pick:"):
            r.features[k] = 1.0 if k == f"rules_pick:{name}" else 0.0


def random_shape_count(shape_ids, prefix: str = "random-") -> int:
    """How many shapes of a random sequence (``random-``: random_shapes, ``model-``: model_shapes)
    records of these shape ids span (such a shape's id ends in its index)."""
    return 1 + max((int(i.rsplit("-", 1)[1]) for i in shape_ids if i and i.startswith(prefix)), default=-1)


def relabel(records: List[Record], device: torch.device, seed: int = 0, shapes: Optional[List[Shape]] = None,
            log=print) -> int:
    """Re-runs each record's shape under today's heuristic (nothing timed) and replaces the record's
    "heuristic" tag and rule features: saved timings then judge changed rules, and train on them.
    Returns how many records were relabeled; a record whose shape no longer produces its signature
    keeps its tags."""
    if shapes is None:  # the sets tune sweeps
        ids = {r.tags.get("shape") for r in records}
        shapes = (TUNING + HELDOUT + random_shapes(random_shape_count(ids), seed)
                  + model_shapes(random_shape_count(ids, "model-"), seed)
                  + family_shapes())
    known = {s.id: s for s in shapes}
    by_shape: Dict[str, List[Record]] = {}
    for r in records:
        by_shape.setdefault(r.tags.get("shape"), []).append(r)
    relabeled = 0
    with selection.restored_selection():
        for shape_id, rs in by_shape.items():
            if shape_id not in known:
                log(f"  {shape_id}: not a known shape, left as it was")
                continue
            choices: Dict[tuple, selection.Choice] = {}
            for run in _passes(known[shape_id], device):
                choices.update(_heuristic_choices(run))
            for r in rs:
                if (r.op, r.signature) in choices:
                    set_heuristic(r, choices[(r.op, r.signature)].chosen)
                    relabeled += 1
    return relabeled


def _tune_shape(s, device, cache_dir, set_name, device_name, tags) -> None:
    for run in _passes(s, device):
        chosen = {key: c.chosen for key, c in _heuristic_choices(run, cache_dir).items()}
        selection.set_selection("autotune", cache_dir=cache_dir)
        with selection.explain() as tuned:
            run()
        for c in tuned:
            t = tags.setdefault(f"{c.op}\t{c.signature}", {"device": device_name, "shape": s.id})
            add_sets(t, set_name)
            if (c.op, c.signature) in chosen:
                t["heuristic"] = chosen[(c.op, c.signature)]


# ---- judging -------------------------------------------------------------------------------------


def _geomean(xs: List[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in xs)) if xs else float("nan")


def single_best(train: List[Record]) -> Dict[str, str]:
    """Per op, the candidate of least geometric-mean regret over the records (the heuristic's choice
    standing in where it does not apply)."""
    best = {}
    for op in sorted({r.op for r in train}):
        rs = [r for r in train if r.op == op and r.tags.get("heuristic") in r.times]
        names = sorted({n for r in rs for n, t in r.times.items() if t is not None})
        if names:
            best[op] = min(names, key=lambda n: _geomean([_regret_or_fallback(r, n) for r in rs]))
    return best


def _pick_or_fallback(r: Record, name: Optional[str]) -> str:
    return name if name is not None and r.times.get(name) is not None else r.tags["heuristic"]


def _regret_or_fallback(r: Record, name: Optional[str]) -> float:
    return r.regret(_pick_or_fallback(r, name))


SLOWER_THAN_PYTORCH = 0.03  # a choice more than 3% slower than PyTorch's fastest path counts as slower


def _vs_pytorch(r: Record, name: str) -> float:
    """t(name) / t(PyTorch's fastest candidate: the aten_* ones) for the record; 1 where none applies."""
    aten = [t for n, t in r.times.items() if n.startswith("aten_") and t is not None]
    return r.times[name] / min(aten) if aten and min(aten) > 0 else 1.0


Choices = Callable[[Record], Tuple[Optional[str], Optional[str]]]  # a record -> (learned, single best)


def judge(records: List[Record], model: Optional[dict] = None, best: Optional[Dict[str, str]] = None,
          choose: Optional[Choices] = None, unsure_gap: float = 0.0) -> List[dict]:
    """Per op and overall: each mode's geometric-mean and worst regret, the learned and single-best
    choices those of `model` (timing the contenders within `unsure_gap`: learned.predict) and `best`,
    or of `choose` (where each record has a model of its own)."""
    if choose is None:
        def choose(r):
            return learned.predict(model, r, unsure_gap), best.get(r.op)
    rows = []
    rs_all = [r for r in records if r.tags.get("heuristic") in r.times]
    for op in sorted({r.op for r in rs_all}) + [None]:
        rs = [r for r in rs_all if op is None or r.op == op]
        picks = [choose(r) for r in rs]
        picked = {"heuristic": [r.tags["heuristic"] for r in rs],
                  "learned": [_pick_or_fallback(r, pick[0]) for r, pick in zip(rs, picks)],
                  "single best": [_pick_or_fallback(r, pick[1]) for r, pick in zip(rs, picks)]}
        modes = {mode: [r.regret(name) for r, name in zip(rs, names)] for mode, names in picked.items()}
        row = {"op": op or "all", "records": len(rs),
               "choices": sum(sum(t is not None for t in r.times.values()) > 1 for r in rs)}
        for mode, regrets in modes.items():
            slower = [_vs_pytorch(r, name) > 1.0 + SLOWER_THAN_PYTORCH for r, name in zip(rs, picked[mode])]
            row[mode] = {"mean": _geomean(regrets), "worst": max(regrets, default=float("nan")),
                         "over_1.2": sum(x > 1.2 for x in regrets) / len(regrets) if regrets else float("nan"),
                         "slower_than_pytorch": sum(slower) / len(slower) if slower else float("nan")}
        row["learned vs single best"] = _geomean([s / l for s, l in zip(modes["single best"], modes["learned"])])
        row["heuristic vs single best"] = _geomean([s / h for s, h in zip(modes["single best"], modes["heuristic"])])
        rows.append(row)
    return rows


def mode_cell(regret: dict) -> str:
    """A mode's "mean / worst / share of records over 1.2x"."""
    return f"{regret['mean']:.3f} / {regret['worst']:.2f} / {regret['over_1.2']:.1%}"


def format_judgement(rows: List[dict], title: str) -> str:
    lines = [title, "| op | records (with a choice) | heuristic mean / worst / > 1.2x | "
             "learned mean / worst / > 1.2x | single best mean / worst / > 1.2x | learned vs single best |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [mode_cell(row[m]) for m in ("heuristic", "learned", "single best")]
        lines.append(f"| {row['op']} | {row['records']} ({row['choices']}) | " + " | ".join(cells)
                     + f" | {row['learned vs single best']:.3f}x |")
    return "\n".join(lines)


def _on_device(r: Record, device_text: Optional[str]) -> bool:
    """Whether the record is of a GPU whose name has `device_text` (any, where None or empty)."""
    return not device_text or device_text in r.tags.get("device", "")


def _select(records: List[Record], sets: List[str], device_text: Optional[str], exclude: List[str] = ()) -> List[Record]:
    out = []
    for r in records:
        mine = set(r.tags.get("sets", "").split(","))
        if mine & set(sets) and not mine & set(exclude) and _on_device(r, device_text):
            out.append(r)
    return out


def _open(path: str, mode: str = "r"):
    """A text file, gzip-compressed where its name ends in .gz (the saved sweeps are)."""
    return gzip.open(path, mode + "t") if path.endswith(".gz") else open(path, mode)


def read_json(path: str):
    with _open(path) as f:
        return json.load(f)


def save(path: str, data: dict) -> None:
    with _open(path, "w") as f:
        json.dump(data, f, separators=(",", ":"))


def load_records(paths: List[str]):
    """Records saved by ``--json`` (the first file's environment with them). A problem measured more
    than once on one GPU (by shapes of two sets, or by two sweeps) is one record, its first (list the
    held-out sweep's file first to judge by its timings), tagged with every set that produced it: a
    problem a held-out shape produced never trains."""
    records: Dict[tuple, Record] = {}
    env: dict = {}
    for path in paths:
        saved = read_json(path)
        env = env or saved.get("environment", {})
        for d in saved["records"]:
            r = Record(**d)
            first = records.setdefault((r.tags.get("device"), r.key), r)
            if first is not r:
                add_sets(first.tags, r.tags.get("sets", ""))
                if "heuristic" not in first.tags and "heuristic" in r.tags:
                    first.tags["heuristic"] = r.tags["heuristic"]
    return list(records.values()), env


def train_and_judge(records: List[Record], train_on: List[str], evaluate_on: List[str],
                    train_device: Optional[str] = None, evaluate_device: Optional[str] = None,
                    model: Optional[dict] = None):
    """The model trained on the ``train_on`` sets' records (of GPUs named ``train_device``), or the
    given `model`, and each mode's regret on those records and on the ``evaluate_on`` sets' records
    (of ``evaluate_device``)."""
    # A record that a held-out shape also produced never trains.
    train = _select(records, train_on, train_device, exclude=evaluate_on)
    test = _select(records, evaluate_on, evaluate_device)
    if model is None:
        devices = ", ".join(sorted({r.tags.get("device", "?") for r in train}))
        model = learned.train(train, description=f"trained on {len(train)} records of the sets "
                              f"{', '.join(train_on)} ({devices})")
    best = single_best(train)
    return model, {"train": judge(train, model, best), "evaluate": judge(test, model, best), "single_best": best}


def cross_validate(records: List[Record], train_on: List[str], folds: int, train_device: Optional[str] = None,
                   evaluate_device: Optional[str] = None, seed: int = 0, **train_options) -> List[dict]:
    """Each mode's regret on the ``train_on`` sets' records, each record judged by a model trained
    without its shape: the shapes (all of a shape's records, of every GPU, together) are dealt into
    `folds` folds at random, and fold k is judged by the model of the other folds' records (of GPUs
    named ``train_device``). This compares training choices without the held-out sets."""
    if folds < 2:
        raise ValueError(f"patchgemm tune: --cross-validate needs at least 2 folds, got {folds}")
    pool = _select(records, train_on, None, exclude=[s for s in SETS if s not in train_on])
    shapes = sorted({r.tags.get("shape", r.key) for r in pool})
    random.Random(seed).shuffle(shapes)
    fold_of = {shape: i % folds for i, shape in enumerate(shapes)}

    def fold(r: Record) -> int:
        return fold_of[r.tags.get("shape", r.key)]

    fitted = []  # per fold: the model and the single best of the other folds' records
    for k in range(folds):
        train = [r for r in _select(pool, train_on, train_device) if fold(r) != k]
        fitted.append((learned.train(train, seed=seed, **train_options), single_best(train)))

    def choose(r: Record):
        model, best = fitted[fold(r)]
        return learned.predict(model, r), best.get(r.op)

    return judge(_select(pool, train_on, evaluate_device), choose=choose)


def record_family(r: Record) -> str:
    """The model family of the shape that produced the record (shapes.family_of)."""
    return family_of(r.tags.get("shape", ""))


NEVER_HELD_OUT = ("random", "model-like")  # generic sequences: training data, not a family of models


def learned_mode(margin: float, unsure_gap: float = 0.0) -> str:
    """A learned mode's name in hold_out_families' rows: "learned +m", with ", timed within g"."""
    return f"learned +{margin:g}" + (f", timed within {unsure_gap:g}" if unsure_gap > 0 else "")


def hold_out_families(records: List[Record], families: Optional[List[str]] = None, margins=(0.0,),
                      train_device: Optional[str] = None, evaluate_device: Optional[str] = None, seed: int = 0,
                      log=print, unsure_gaps=(0.0,), **train_options) -> List[dict]:
    """How each mode does on a model family it never saw: per family F (default: every family of the
    records but the random sequences), the learned model trained on every record of the other
    families (of GPUs named ``train_device``), each ``margin`` of ``learned.with_pytorch_margin``
    applied to it, each with each of ``unsure_gaps`` (0: the prediction alone; g: the contenders
    scored within g of the best timed, learned.predict), and every mode judged on F's records (of
    ``evaluate_device``). Returns, per family, ``judge``'s overall row with a mode per margin and gap
    (learned_mode), "learned" the first of them."""
    by_family: Dict[str, List[Record]] = {}
    for r in records:
        by_family.setdefault(record_family(r), []).append(r)
    names = families or sorted(f for f in by_family if f not in NEVER_HELD_OUT)
    unknown = [f for f in names if f not in by_family]
    if unknown:
        raise ValueError(f"patchgemm tune: no records of the families {', '.join(unknown)}; "
                         f"the records' families are {', '.join(sorted(by_family))}")
    rows = []
    for family in names:
        train = [r for f, rs in by_family.items() if f != family for r in rs if _on_device(r, train_device)]
        test = [r for r in by_family[family] if _on_device(r, evaluate_device)]
        base = learned.train(train, seed=seed, **train_options)
        best = single_best(train)
        modes = [(m, g) for m in margins for g in unsure_gaps]
        judged = [judge(test, learned.with_pytorch_margin(base, m), best, unsure_gap=g)[-1] for m, g in modes]
        row = dict(judged[0], family=family, train_records=len(train))  # (the overall rows)
        row.update({learned_mode(m, g): j["learned"] for (m, g), j in zip(modes, judged)})
        rows.append(row)
        log(f"  {family}: {row['records']} records; heuristic {mode_cell(row['heuristic'])}; "
            + "; ".join(f"{learned_mode(m, g)} {mode_cell(row[learned_mode(m, g)])}" for m, g in modes))
    return rows


def format_families(rows: List[dict], margins, unsure_gaps=(0.0,)) -> str:
    """hold_out_families' rows as a table: per family and mode, mean / worst regret / share of
    records over 1.2x, and the share of records more than 3% slower than PyTorch's fastest path."""
    modes = ["heuristic"] + [learned_mode(m, g) for m in margins for g in unsure_gaps] + ["single best"]
    lines = ["| family held out | records | " + " | ".join(f"{m} mean / worst / > 1.2x / slower than PyTorch"
                                                      for m in modes) + " |",
             "|---|---|" + "---|" * len(modes)]
    for row in rows + [_family_summary(rows, modes)]:
        cells = [f"{mode_cell(row[m])} / {row[m]['slower_than_pytorch']:.1%}" for m in modes]
        lines.append(f"| {row['family']} | {row['records']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _family_summary(rows: List[dict], modes: List[str]) -> dict:
    """The families' mean of each mode's mean regret and share slower, and the worst of the worsts."""
    summary = {"family": "mean over families", "records": sum(r["records"] for r in rows)}
    for m in modes:
        summary[m] = {"mean": statistics.fmean(r[m]["mean"] for r in rows),
                      "worst": max(r[m]["worst"] for r in rows),
                      "over_1.2": statistics.fmean(r[m]["over_1.2"] for r in rows),
                      "slower_than_pytorch": statistics.fmean(r[m]["slower_than_pytorch"] for r in rows)}
    return summary


# A learned op model must beat the rules by more than this share of cross-validated regret: a tie
# (within the timings' noise) keeps the rules, whose choices are explainable and which the model
# misses where it extrapolates (one of equal mean regret picked 1.3x slower grouped GEMMs).
MIN_GAIN_OVER_RULES = 0.005


def drop_unvalidated(model: dict, records: List[Record], train_on: List[str], folds: int,
                     train_device: Optional[str] = None, seed: int = 0) -> Dict[str, str]:
    """Removes from `model` each op whose learned choices do not beat the heuristic's by
    MIN_GAIN_OVER_RULES in `folds`-fold cross-validation over the training records (geometric-mean
    regret): such an op chooses by the heuristic in learned mode. Returns, per op, the verdict (also
    kept in the model as "validation")."""
    verdicts = {}
    for row in cross_validate(records, train_on, folds, train_device, seed=seed):
        op = row["op"]
        if op == "all" or op not in model["ops"]:
            continue
        kept = row["learned"]["mean"] < row["heuristic"]["mean"] * (1.0 - MIN_GAIN_OVER_RULES)
        verdicts[op] = (f"{'kept' if kept else 'dropped'}: cross-validated regret {row['learned']['mean']:.3f}, "
                        f"the heuristic's {row['heuristic']['mean']:.3f}")
        if not kept:
            del model["ops"][op]
    model["validation"] = verdicts
    return verdicts


def main(args) -> int:
    train_on = [s for s in args.train_on.split(",") if s]
    evaluate_on = [s for s in args.evaluate_on.split(",") if s]
    for s in train_on + evaluate_on:
        if s not in SETS:
            raise SystemExit(f"patchgemm tune: unknown set {s!r}; the sets are {', '.join(SETS)}")
    if args.records_only and not args.json:
        raise SystemExit("patchgemm tune: --records-only needs --json PATH")
    if args.from_json:
        records, env = load_records(args.from_json.split(","))
        if args.relabel:
            device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            n = relabel(records, device, args.seed)
            print(f"relabeled {n} of {len(records)} records with today's heuristic on {device}")
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cache_dir = args.cache_dir if args.cache_dir is not None else selection.default_cache_dir()
        sets = shape_sets(train_on + evaluate_on, args.random, args.model_like, args.seed, args.random_start,
                          args.only_channels_last)
        print(f"tuning {', '.join(sets)} on {device} (cache: {cache_dir or 'memory only'})")
        records = sweep(sets, device, cache_dir)
        env = environment(device)
    if args.records_only:
        save(args.json, {"environment": env, "records": [vars(r) for r in records]})
        print(f"{len(records)} records written to {args.json}")
        return 0
    if args.hold_out_families:
        margins = [float(m) for m in args.margins.split(",") if m]
        families = None if args.hold_out_families == "all" else [f for f in args.hold_out_families.split(",") if f]
        gaps = [float(g) for g in args.unsure_gaps.split(",") if g]
        rows = hold_out_families(records, families, margins, args.train_device, args.evaluate_device, args.seed,
                                 unsure_gaps=gaps)
        print(f"\nEach family judged by a model trained on the other families' records (regret = t(selected) / "
              f"t(fastest); slower than PyTorch: > {SLOWER_THAN_PYTORCH:.0%} slower than its fastest aten_* path)")
        print(format_families(rows, margins, gaps))
        if args.json:
            save(args.json, {"environment": env, "hold_out_families": rows, "margins": margins, "unsure_gaps": gaps})
        return 0
    if args.cross_validate:
        rows = cross_validate(records, train_on, args.cross_validate, args.train_device, args.evaluate_device,
                              args.seed)
        print(format_judgement(rows, f"{args.cross_validate}-fold cross-validation over the shapes of "
                                     f"{', '.join(train_on)}: regret = t(selected) / t(fastest)"))
        return 0
    model, report = train_and_judge(records, train_on, evaluate_on, args.train_device, args.evaluate_device)
    if args.validate:
        for op, verdict in drop_unvalidated(model, records, train_on, args.validate, args.train_device,
                                            args.seed).items():
            print(f"{op}: {verdict}")
    if args.margin:
        model = learned.with_pytorch_margin(model, args.margin)
    if args.unsure_gap:
        model["unsure_gap"] = args.unsure_gap  # (the judgement below stays the prediction's)
    if args.validate or args.margin:
        report["evaluate"] = judge(_select(records, evaluate_on, args.evaluate_device), model, report["single_best"])
        report["train"] = judge(_select(records, train_on, args.train_device, exclude=evaluate_on), model,
                                report["single_best"])
    print(format_judgement(report["train"], f"\nTraining records ({', '.join(train_on)}): regret = t(selected) / t(fastest)"))
    print(format_judgement(report["evaluate"], f"\nHeld-out records ({', '.join(evaluate_on)}), never trained on"))
    if args.model:
        learned.save(model, args.model)
        print(f"\nmodel written to {args.model}")
    if args.json:
        save(args.json, {"environment": env, "train_on": train_on, "evaluate_on": evaluate_on, "report": report,
                         "records": [vars(r) for r in records]})
    return 0
