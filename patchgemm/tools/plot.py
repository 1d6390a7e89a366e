"""`python -m patchgemm bench --plot out.png`: the suite's results as one picture.

Left: how many times faster patchgemm is than the best PyTorch baseline of each case and pass (log
scale; right of the line at 1x is faster). Right: each one's distance to the floor, as % of floor
speed (100% = at the floor). Needs matplotlib (`pip install patchgemm[bench]`).
"""

from dataclasses import dataclass
from typing import Iterable, List, Mapping, Optional

OURS = "patchgemm"


@dataclass
class Summary:
    """One (case, pass): ours against the fastest baseline that ran."""
    label: str
    ours_ms: float
    best_ms: float
    best_impl: str
    floor_ms: float

    @property
    def speedup(self) -> float:
        return self.best_ms / self.ours_ms

    @property
    def ours_pct_floor(self) -> float:
        return 100 * self.floor_ms / self.ours_ms

    @property
    def best_pct_floor(self) -> float:
        return 100 * self.floor_ms / self.best_ms


def summarize(rows: Iterable[Mapping]) -> List[Summary]:
    """Rows as `bench --json` writes them (case, pass_, impl, ms, floor_ms), in suite order.
    Baselines are the impls not named patchgemm*; variants of ours (e.g. "patchgemm per stage")
    are neither ours nor a baseline."""
    groups = {}
    for r in rows:
        if r.get("ms"):
            groups.setdefault((r["case"], r["pass_"]), []).append(r)
    out = []
    for (case, pass_), rs in groups.items():
        ours = next((r for r in rs if r["impl"] == OURS), None)
        baselines = [r for r in rs if not r["impl"].startswith(OURS)]
        if ours is None or not baselines:
            continue
        best = min(baselines, key=lambda r: r["ms"])
        out.append(Summary(f"{case} {pass_}", ours["ms"], best["ms"], best["impl"], ours["floor_ms"]))
    return out


def plot(rows: Iterable[Mapping], path: str, title: Optional[str] = None) -> List[Summary]:
    """Draws the summary of `rows` into `path` (any format matplotlib writes) and returns it."""
    summaries = summarize(rows)
    if not summaries:
        raise ValueError("nothing to plot: no case has both a patchgemm row and a baseline row")
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install matplotlib (or patchgemm[bench])") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [s.label for s in summaries][::-1]  # the first case on top
    ys = range(len(labels))
    rev = summaries[::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.32 * len(labels) + 1.6), sharey=True)

    speedups = [s.speedup for s in rev]
    left.barh(ys, speedups, color=["#2a9d5c" if v >= 1 else "#d1495b" for v in speedups])
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_xscale("log")
    left.set_yticks(list(ys), labels)
    left.set_xlabel("patchgemm speedup over the best PyTorch baseline (x, log scale)")
    for y, s in zip(ys, rev):
        left.annotate(f"{s.speedup:.2f}x vs {s.best_impl}", (s.speedup, y), xytext=(3, 0),
                      textcoords="offset points", va="center", fontsize=7)
    left.set_xlim(min(min(speedups) / 1.5, 0.5), max(speedups) * 6)

    h = 0.4
    right.barh([y + h / 2 for y in ys], [s.ours_pct_floor for s in rev], h, label="patchgemm", color="#2a6f97")
    right.barh([y - h / 2 for y in ys], [s.best_pct_floor for s in rev], h, label="best PyTorch", color="#bbbbbb")
    right.axvline(100, color="black", linewidth=0.8)
    # Over 100% means the baseline used a faster arithmetic than the floor counts (cuDNN's TF32).
    right.set_xlim(0, max(105, 1.05 * max(max(s.ours_pct_floor, s.best_pct_floor) for s in rev)))
    right.set_xlabel("% of floor speed (floor time / time; 100 = at the floor)")
    right.legend(loc="lower right", fontsize=8)
    for ax in (left, right):
        ax.grid(axis="x", alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return summaries
