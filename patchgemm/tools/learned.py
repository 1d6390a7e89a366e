"""The learned selector: one small MLP per op, trained on autotune records, that scores each
implementation for a problem it has never timed (``patchgemm.set_selection("learned")``).

A record (``selection.autotune_records()``, or a cache file's line) holds a problem's features (its
sizes and layout, the dtype, the GPU's SMs, compute capability, L2 size and memory bandwidth) and
every applicable candidate's measured time. The model sees ``log2(1 + feature)``, standardized, and
is trained on soft labels made from the times, as MIOpen's learned selector is: the target weight of
candidate c is ``softmax(-log(t_c / t_fastest) / temperature)`` over the candidates that apply, so a
candidate 2% slower than the fastest is almost as good a label and one 2x slower is not. Records are
weighted by what is at stake (the log of the slowest-to-fastest ratio), the tuning set's more. The
features include, per candidate, whether it applies and whether it is the one the heuristic runs
(the model starts from what the rules know; the C++ side runs the heuristic once per new signature
to find it, since a kernel may decline a problem its table says it supports). At run time the C++ side
(csrc/selection/learned.cpp) computes the same scores and runs the best-scored candidate that applies;
``patchgemm.selection.load_model`` / ``install_model`` read a model file and hand it over.

The model file is JSON: per op its candidates, features, normalization and weights.
"""

import copy
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional

import torch

from .. import selection


@dataclass
class Record:
    """One problem's measurement: every candidate's time in ms (None where it does not apply)."""

    op: str
    flags: str
    signature: str
    chosen: str
    times: Dict[str, Optional[float]]
    features: Dict[str, float]
    tags: Dict[str, str] = field(default_factory=dict)  # e.g. the shape set, the heuristic's choice

    @classmethod
    def parse(cls, line: str) -> "Record":
        op, flags, signature, chosen, times, features = line.rstrip("\n").split("\t")
        pairs = [item.split("=", 1) for item in times.split(";")]
        return cls(op, flags, signature, chosen, {n: None if v == "-" else float(v) for n, v in pairs},
                   {n: float(v) for n, v in (item.split("=", 1) for item in features.split(";") if item)})

    @property
    def key(self) -> str:
        return f"{self.op}\t{self.flags}\t{self.signature}"

    @property
    def fastest_ms(self) -> float:
        return min(t for t in self.times.values() if t is not None)

    def regret(self, name: str) -> float:
        """t(name) / t(fastest)."""
        t = self.times.get(name)
        if t is None:
            raise ValueError(f"{self.op}: {name!r} does not apply to {self.signature}")
        return t / self.fastest_ms if self.fastest_ms > 0 else 1.0


def parse_records(lines: Iterable[str]) -> List[Record]:
    return [Record.parse(line) for line in lines if line.strip() and not line.startswith("#")]


def _value(values: Dict[str, float], feature: str) -> float:
    # A candidate another build lacks neither applies nor is picked (as in learned.cpp).
    if feature not in values and feature.startswith(("applies:", "rules_pick:")):
        return 0.0
    return values[feature]


def _inputs(features: List[str], values: Dict[str, float]) -> List[float]:
    return [math.log2(1.0 + max(_value(values, f), 0.0)) for f in features]


def backends(records: List[Record]) -> List[str]:
    """The backends ("cpu", "cuda", "rocm") whose timings the records are, from the device each was
    measured on (its "device" tag: "cpu" or the GPU's name); empty where one is not tagged (the
    model then scores problems on every backend)."""
    devices = {r.tags.get("device") for r in records}
    if None in devices:
        return []
    return sorted({"cpu" if d == "cpu" else "rocm" if d.startswith("AMD") else "cuda" for d in devices})


# Records of the tuning set (the benchmark suite's cases, the shapes reported slow) weigh this many
# times the others: among some 35,000 records, a handful of a suite case's were outvoted by their
# neighbours (the 3-D unembedding's weight gradient ran 1.22x slower than the rules' choice).
TUNING_WEIGHT = 4.0


def train(records: List[Record], hidden: int = 128, steps: int = 4000, temperature: float = 0.2,
          weight_decay: float = 1e-3, seed: int = 0, description: str = "") -> dict:
    """A model per op from its records (ops whose records never offer a choice get none): full-batch
    Adam, the learning rate decayed to 0 along a cosine (without the decay, frequent shapes such as a
    ViT stem at batch 64 were missed); the tuning set's records weigh TUNING_WEIGHT times."""
    model = {"format": selection.MODEL_FORMAT, "description": description, "ops": {}, "backends": backends(records)}
    by_op: Dict[str, List[Record]] = {}
    for r in records:
        if sum(t is not None for t in r.times.values()) > 1:  # one candidate: nothing to learn
            by_op.setdefault(r.op, []).append(r)
    for op, rs in sorted(by_op.items()):
        candidates = list(dict.fromkeys(n for r in rs for n in r.times))
        features = list(rs[0].features)
        if any(list(r.features) != features for r in rs):
            raise ValueError(f"learned.train: the records of {op} have different features (mixed versions?)")
        model["ops"][op] = _train_op(rs, candidates, features, hidden, steps, temperature, weight_decay, seed)
    return model


def _train_op(rs: List[Record], candidates: List[str], features: List[str], hidden: int, steps: int,
              temperature: float, weight_decay: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor([_inputs(features, r.features) for r in rs], dtype=torch.float64)
    mean, scale = x.mean(0), x.std(0, unbiased=False)
    scale = torch.where(scale > 1e-9, scale, torch.ones_like(scale))
    x = (x - mean) / scale
    log_t = torch.tensor([[math.log(r.times[c]) if r.times.get(c) is not None else math.inf for c in candidates]
                          for r in rs], dtype=torch.float64)
    applies = torch.isfinite(log_t)
    gap = torch.where(applies, log_t - log_t.where(applies, math.inf).min(1, keepdim=True).values, math.inf)
    target = torch.softmax(-gap / temperature, dim=1)
    stakes = gap.where(applies, 0.0).max(1).values.clamp(0.05, 2.0)  # log(slowest / fastest)
    stakes = stakes * torch.tensor([TUNING_WEIGHT if "tuning" in r.tags.get("sets", "").split(",") else 1.0
                                    for r in rs], dtype=torch.float64)
    net = torch.nn.Sequential(torch.nn.Linear(len(features), hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, len(candidates))).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * (1.0 / math.sqrt(p.shape[-1])))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        opt.zero_grad()
        logits = net(x).masked_fill(~applies, -1e9)
        loss = -(stakes * (target * torch.log_softmax(logits, 1)).sum(1)).sum() / stakes.sum()
        loss.backward()
        opt.step()
        schedule.step()
    l1, l2 = net[0], net[2]
    return {"candidates": candidates, "features": features, "hidden": hidden,
            "mean": mean.tolist(), "scale": scale.tolist(),
            "w1": l1.weight.detach().tolist(), "b1": l1.bias.detach().tolist(),
            "w2": l2.weight.detach().tolist(), "b2": l2.bias.detach().tolist(),
            "records": len(rs)}


def scores(op_model: dict, features: Dict[str, float]) -> Dict[str, float]:
    """Each candidate's score (higher: expected faster), as csrc/selection/learned.cpp computes it."""
    x = [(v - m) / s for v, m, s in zip(_inputs(op_model["features"], features), op_model["mean"], op_model["scale"])]
    h = [max(b + sum(w * xi for w, xi in zip(row, x)), 0.0) for row, b in zip(op_model["w1"], op_model["b1"])]
    return {c: b + sum(w * hi for w, hi in zip(row, h))
            for c, row, b in zip(op_model["candidates"], op_model["w2"], op_model["b2"])}


def predict(model: dict, record: Record, unsure_gap: float = 0.0) -> Optional[str]:
    """The candidate the learned mode runs for the record's problem: the best-scored one that applies
    (None without a model for the op). With ``unsure_gap`` > 0, as the learned mode does at run time
    (csrc/selection/registry.h, run_learned): where others that apply score within the gap of the
    best, those contenders are timed and the fastest runs, here the fastest by the record's times."""
    op_model = model["ops"].get(record.op)
    if op_model is None:
        return None
    s = scores(op_model, record.features)
    applicable = [n for n, t in record.times.items() if t is not None]
    best = max(applicable, key=lambda n: s.get(n, -math.inf))
    contenders = [n for n in applicable if s.get(n, -math.inf) >= s.get(best, -math.inf) - unsure_gap]
    return min(contenders, key=lambda n: record.times[n]) if unsure_gap > 0 and len(contenders) > 1 else best


def with_pytorch_margin(model: dict, margin: float) -> dict:
    """A copy of `model` leaning toward PyTorch's own paths: every ``aten_*`` candidate's score is
    raised by ``margin`` (in the scores' units, log-odds of being the fastest), so one of ours runs
    only where the model prefers it by more than the margin. Kept in the model as "pytorch_margin"
    (on top of any margin it had)."""
    out = copy.deepcopy(model)
    for op_model in out["ops"].values():
        op_model["b2"] = [b + margin if c.startswith("aten_") else b
                          for c, b in zip(op_model["candidates"], op_model["b2"])]
    out["pytorch_margin"] = model.get("pytorch_margin", 0.0) + margin
    return out


def save(model: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(model, f, separators=(",", ":"))
    os.replace(tmp, path)
