"""The default selection against the best PyTorch path, on shapes outside the benchmark suite.

    python bench/heldout.py [--set heldout|tuning|families|all|channels-last|drawn] [--count N] [--seed S]
                            [--filter TEXT] [--selection MODE] [--candidates] [--kernels] [--json PATH]
                            [--markdown PATH]

The shape sets, ``TUNING`` (rules may be fitted to these), ``HELDOUT`` (never tuned on) and
``FAMILIES`` (model families: the default choice is judged on each with it left out of training),
live in ``patchgemm/tools/shapes.py``, which explains the split; ``channels-last`` is
``shapes.channels_last_shapes`` (``--count`` channels-last embeddings, default 50, each with its
transpose), apart from ``all``. ``drawn`` (apart from ``all`` too) is ``--count`` shapes of
``shapes.model_shapes`` and as many of ``shapes.random_shapes``, drawn with ``--seed`` (default 1;
the shipped model's training records were drawn with seed 0): shapes nobody picked. ``--selection`` runs ours under that mode (default: the package's);
the learned mode's timing budget restarts with each shape, as in a process of its own.
The report ends with a table per model family: the share of ratios below 0.97.

For each shape and pass (forward; forward + backward with the gradients the layer needs), the GPU
time (the sum of the kernel times the profiler records: the host's time does not count) of
patchgemm's default choice is compared with every PyTorch path in the same run (the convolution
as ``nn.Conv*d`` calls it, the reshape + ``nn.Linear`` rewrite with the conv's output memory format,
as a drop-in must return it, ``bmm`` / ``baddbmm``): ratio = best
PyTorch time / ours, so above 1 is faster. On a GPU each call's span is also measured (events around
it, the host ahead: the idle gaps between its kernels count, as in a model's step) and the report
gives the calls below 0.97x that ratio too. ``--candidates`` also times every candidate
of every op the pass runs, forced one at a time, and for a patch embedding's forward + backward
every pairing of its forward and weight gradient (what the rules are fitted from); ``--kernels``
prints the kernels of one call of ours and of each PyTorch path (where a difference comes from).
"""

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

import patchgemm
from patchgemm.tools.bench import environment, input_sets, kernel_ms, time_ms
from patchgemm.tools.shapes import (HELDOUT, TUNING, Problem, Shape, channels_last_shapes, family_of, family_shapes,
                              model_shapes, problem, random_shapes)

ROUNDS, REPS, SPAN_REPS = 3, 10, 20  # see measure()


# ---- measuring -----------------------------------------------------------------------------------


@dataclass
class Result:
    id: str
    set: str
    op: str
    pass_: str
    dtype: str
    ours_ms: float
    torch_ms: Dict[str, Optional[float]]
    chosen: Dict[str, str]  # op -> the candidate the default selection ran
    candidates_ms: Dict[str, Dict[str, Optional[float]]] = field(default_factory=dict)
    how: Dict[str, str] = field(default_factory=dict)  # op -> how it was chosen (explain's `how`)
    # On a GPU, each call's span: events around it with the host ahead (bench.time_ms), so the idle
    # gaps between its kernels count, as they do in a model's step; the ratio's GPU time leaves them out.
    ours_span_ms: Optional[float] = None
    torch_span_ms: Dict[str, Optional[float]] = field(default_factory=dict)

    @property
    def best_torch(self) -> Tuple[str, float]:
        return min(((n, t) for n, t in self.torch_ms.items() if t is not None), key=lambda p: p[1])

    @property
    def ratio(self) -> float:
        return self.best_torch[1] / self.ours_ms

    @property
    def span_ratio(self) -> Optional[float]:
        """The best PyTorch path's span / ours (None where spans were not measured)."""
        spans = [t for t in self.torch_span_ms.values() if t is not None]
        return min(spans) / self.ours_span_ms if spans and self.ours_span_ms else None


def _runner(prob: Problem, sets, fn, pass_: str, dy):
    if pass_ == "fwd":
        def run(i):
            with torch.no_grad():
                return fn(**sets[i % len(sets)])
    else:
        def run(i):
            inputs = sets[i % len(sets)]
            return torch.autograd.grad(fn(**inputs), [inputs[k] for k in prob.grad_inputs], dy)
    return run


def kernel_list(fn, device: torch.device, reps: int = 5) -> List[Tuple[str, float]]:
    """The device events of one call of fn(i), as (name, µs) averaged over `reps` calls, in order."""
    for i in range(3):
        fn(i)
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(i)
        torch.cuda.synchronize(device)
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    per_call = len(events) // reps
    return [(e.name, sum(events[j * per_call + k].time_range.elapsed_us() for j in range(reps)) / reps)
            for k, e in enumerate(events[:per_call])]


def measure(s: Shape, set_name: str, device: torch.device, candidates: bool, kernels: bool = False) -> List[Result]:
    prob = problem(s, device)
    sets = input_sets(prob.make_inputs, device)
    with torch.no_grad():
        dy = torch.randn_like(prob.ours(**sets[0]))
    results = []
    for pass_ in ("fwd", "fwd+bwd"):
        run = _runner(prob, sets, prob.ours, pass_, dy)
        with patchgemm.explain() as chosen:
            run(0)
        # Ours and PyTorch's paths take turns, ROUNDS times, and each keeps its best median: a drift
        # of the GPU's clock or of the machine's load then cannot favour whichever ran first.
        runs = {"ours": run, **{name: _runner(prob, sets, fn, pass_, dy) for name, fn in prob.torch_paths.items()}}
        best: Dict[str, Optional[float]] = {}
        spans: Dict[str, Optional[float]] = {}
        for _ in range(ROUNDS):
            for name, fn in runs.items():
                try:
                    best[name] = min(kernel_ms(fn, device, reps=REPS), best.get(name) or math.inf)
                    if device.type == "cuda":
                        spans[name] = min(time_ms(fn, device, reps=SPAN_REPS).ms, spans.get(name) or math.inf)
                except RuntimeError:  # a PyTorch path this torch / GPU lacks
                    best[name] = spans[name] = None
        ours = best.pop("ours")
        torch_ms = best
        ours_span = spans.pop("ours", None)
        if kernels and device.type == "cuda":
            for name, fn in runs.items():
                if best.get(name, ours) is None:
                    continue
                listed = kernel_list(fn, device)
                print(f"-- {s.id} {pass_} {name}: {len(listed)} kernels, {sum(t for _, t in listed):.1f} us")
                for kname, us in listed:
                    print(f"   {us:8.2f} us  {kname[:110]}")
        r = Result(s.id, set_name, s.op, pass_, s.dtype, ours, torch_ms,
                   {c.op: c.chosen for c in chosen}, how={c.op: c.how for c in chosen},
                   ours_span_ms=ours_span, torch_span_ms=spans)
        if candidates:
            forcings = {op: [{op: c.name} for c in patchgemm.kernels(op)]
                        for op in ([s.op] if pass_ == "fwd" else prob.backward_ops)}
            # patch_embed's forward (patch_unembed's dx: the embedding of grad_y) and the weight
            # gradient that may multiply its patch matrix, as a pair
            if pass_ == "fwd+bwd" and "patch_embed" in [s.op, *prob.backward_ops]:
                forcings["patch_embed+patch_weight_grad"] = [
                    {"patch_embed": f.name, "patch_weight_grad": w.name}
                    for f in patchgemm.kernels("patch_embed") for w in patchgemm.kernels("patch_weight_grad")]
            for key, forced in forcings.items():
                r.candidates_ms[key] = {}
                for names in forced:
                    name = "+".join(names.values())
                    try:
                        with patchgemm.force(**names):
                            r.candidates_ms[key][name] = kernel_ms(run, device, reps=REPS)
                    except RuntimeError:  # a forced candidate does not apply
                        r.candidates_ms[key][name] = None
        results.append(r)
    return results


# ---- reporting -----------------------------------------------------------------------------------


def _geomean(ratios: List[float]) -> float:
    return math.exp(statistics.fmean(math.log(x) for x in ratios))


def summary(results: List[Result]) -> List[dict]:
    """Per set, op and pass: how the ratios (best PyTorch / ours) are distributed."""
    groups: Dict[Tuple[str, str, str], List[Result]] = {}
    for r in results:
        groups.setdefault((r.set, r.op, r.pass_), []).append(r)
    rows = []
    for (set_name, op, pass_), rs in groups.items():
        ratios = [r.ratio for r in rs]
        rows.append({"set": set_name, "op": op, "pass": pass_, "n": len(rs), "min": min(ratios),
                     "median": statistics.median(ratios),
                     "geomean": _geomean(ratios),
                     "below_0.97": [r.id for r in rs if r.ratio < 0.97]})
    return rows


def family_summary(results: List[Result]) -> List[dict]:
    """Per model family (shapes.family_of): the ratios' count, share below 0.97, geometric mean and
    minimum, forward and forward + backward together."""
    groups: Dict[str, List[float]] = {}
    for r in results:
        groups.setdefault(family_of(r.id), []).append(r.ratio)
    return [{"family": family, "n": len(ratios), "below_0.97": sum(x < 0.97 for x in ratios) / len(ratios),
             "geomean": _geomean(ratios), "min": min(ratios)}
            for family, ratios in sorted(groups.items())]


def format_family_summary(rows: List[dict]) -> str:
    lines = ["| family | ratios | below 0.97x | geomean | min |", "|---|---|---|---|---|"]
    for f in rows:
        lines.append(f"| {f['family']} | {f['n']} | {f['below_0.97']:.0%} | {f['geomean']:.2f}x | {f['min']:.2f}x |")
    return "\n".join(lines)


def format_results(results: List[Result]) -> str:
    head = f"{'set':<8} {'shape':<36} {'pass':<8} {'ours ms':>9} {'best PyTorch':>22} {'ratio':>6}  chosen"
    lines = [head, "-" * len(head)]
    for r in results:
        name, t = r.best_torch
        chosen = ", ".join(f"{op}={c}" for op, c in r.chosen.items())
        lines.append(f"{r.set:<8} {r.id:<36} {r.pass_:<8} {r.ours_ms:>9.4f} {f'{t:.4f} ({name})':>22} "
                     f"{r.ratio:>5.2f}x  {chosen}")
        for op, times in r.candidates_ms.items():
            shown = ", ".join(f"{n} {t:.4f}" for n, t in times.items() if t is not None)
            lines.append(f"{'':<45}{op}: {shown}")
    return "\n".join(lines)


def format_summary(rows: List[dict], names: bool = True) -> str:
    """The per set, op and pass table; the shapes below 0.97x by name, or (`names` False) counted."""
    lines = ["| set | op | pass | shapes | min | median | geomean | below 0.97x |", "|---|---|---|---|---|---|---|---|"]
    for s in rows:
        below = (", ".join(s["below_0.97"]) or "none") if names else str(len(s["below_0.97"]))
        lines.append(f"| {s['set']} | {s['op']} | {s['pass']} | {s['n']} | {s['min']:.2f}x | {s['median']:.2f}x | "
                     f"{s['geomean']:.2f}x | {below} |")
    return "\n".join(lines)


def format_markdown(results: List[Result], env: dict) -> str:
    mode = env.get("selection", "heuristic")
    command = env.get("command", f"python bench/heldout.py --set all --selection {mode}")
    lines = [f"`{command}`. Ratio = the best "
             f"PyTorch path's GPU time / patchgemm's choice in {mode} mode (above 1: faster).", "",
             format_summary(summary(results), names=False), "", "Per model family (fwd and fwd+bwd ratios together):",
             "", format_family_summary(family_summary(results)), "",
             "The calls below 0.97x the best PyTorch path (every call is in the JSON); `with gaps`: the ratio "
             "of the calls' spans, the idle gaps between a call's kernels counted (events around each call, "
             "the host ahead), where measured:", "",
             "| set | shape | pass | patchgemm ms | best PyTorch ms | ratio | with gaps | chosen |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.ratio >= 0.97:
            continue
        name, t = r.best_torch
        chosen = ", ".join(f"{op}={c}" for op, c in r.chosen.items())
        gaps = "-" if r.span_ratio is None else f"{r.span_ratio:.2f}x"
        lines.append(f"| {r.set} | {r.id} | {r.pass_} | {r.ours_ms:.4f} | {t:.4f} ({name}) | {r.ratio:.2f}x | "
                     f"{gaps} | {chosen} |")
    spans = [r.span_ratio for r in results if r.span_ratio is not None]
    if spans:
        lines += ["", f"With the gaps counted, {sum(x < 0.97 for x in spans)} of {len(spans)} calls are below 0.97x "
                  f"(geomean {_geomean(spans):.2f}x, min {min(spans):.2f}x)."]
    return "\n".join(lines) + "\n"


def fresh_timing_budget() -> None:
    """The learned mode's timing budget (selection.LEARNED_TIMING_BUDGET_MS a process) restarts, as for
    a model run in a process of its own: one process measures every shape here, and a spent budget
    would leave the later shapes to the prediction alone."""
    current = patchgemm.selection._selection
    if current["mode"] == "learned":
        patchgemm.set_selection("learned", cache_dir=current["cache_dir"], model=current["model"],
                                unsure_gap=current["unsure_gap"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", choices=["heldout", "tuning", "families", "all", "channels-last", "drawn"],
                        default="all")
    parser.add_argument("--selection", help="the selection mode ours runs under (default: the package's)")
    parser.add_argument("--count", type=int, default=50,
                        help="--set channels-last: embeddings; --set drawn: model-like shapes, and as many random ones")
    parser.add_argument("--seed", type=int, default=1, help="--set drawn: the seed the shapes are drawn with")
    parser.add_argument("--filter", help="only shapes whose id contains this text (comma-separated: any of them)")
    parser.add_argument("--candidates", action="store_true", help="also time every candidate, forced")
    parser.add_argument("--kernels", action="store_true", help="print the kernels of ours and each PyTorch path")
    parser.add_argument("--device", help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sets = {"tuning": TUNING, "heldout": HELDOUT, "families": family_shapes()}
    if args.set == "channels-last":
        sets = {"channels-last": channels_last_shapes(args.count)}
    elif args.set == "drawn":
        sets = {"drawn": model_shapes(args.count, args.seed) + random_shapes(args.count, args.seed)}
    wanted = [f.strip() for f in (args.filter or "").split(",") if f.strip()]
    chosen = [(name, s) for name, shapes in sets.items() if args.set in (name, "all") for s in shapes
              if not wanted or any(f in s.id for f in wanted)]
    if not chosen:
        print(f"heldout: no shape matches --filter {args.filter!r}")
        return 2
    if args.selection:
        patchgemm.set_selection(args.selection)
    torch.manual_seed(0)
    results = []
    for set_name, s in chosen:
        fresh_timing_budget()
        results += measure(s, set_name, device, args.candidates, args.kernels)
        print(format_results(results[-2:]).split("\n", 2)[2], flush=True)
    print(format_results(results))
    print(format_summary(summary(results)))
    print(format_family_summary(family_summary(results)))
    env = dict(environment(device), selection=patchgemm.get_selection())
    sizes = {"drawn": f" --count {args.count} --seed {args.seed}", "channels-last": f" --count {args.count}"}
    env["command"] = (f"python bench/heldout.py --set {args.set}{sizes.get(args.set, '')}"
                      + (f" --filter {args.filter}" if args.filter else "") + f" --selection {env['selection']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": [dict(asdict(r), ratio=r.ratio) for r in results]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(results, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
