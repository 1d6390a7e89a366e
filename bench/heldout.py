"""The default selection against the best PyTorch path, on shapes outside the benchmark suite.

    python bench/heldout.py [--set heldout|tuning|all] [--filter TEXT] [--candidates]
                            [--json PATH] [--markdown PATH]

Two sets of shapes live here, and the split is the point of the file:

- ``TUNING``: the shapes reported slow against PyTorch, and every shape a selection rule has been
  fitted to or checked against (the first held-out set became tuning data once rules were revised
  after measuring it). Rules (csrc/selection/) may be tuned on these.
- ``HELDOUT``: 44 other ViT / CLIP / DINOv2 / video / 3-D / audio stems and heads, patch merging
  inside networks, grouped linears from 16 x 8 x 128 to 8192 x 8 x 8 and 1024 x 4 x 2048; bf16,
  fp16 and fp32 with PyTorch's default flags. Written once and never tuned on: they measure whether
  the rules generalize. Do not edit them to make a number look better; add a new shape to TUNING
  instead, and once a rule is fitted to a held-out result, move that shape to TUNING.

For each shape and pass (forward; forward + backward with the gradients the layer needs), the GPU
time (the sum of the kernel times the profiler records: the host's time does not count) of
patchgemm's default choice is compared with every PyTorch path in the same run (the convolution
as ``nn.Conv*d`` calls it, the reshape + ``nn.Linear`` rewrite with the conv's output memory format,
as a drop-in must return it, ``bmm`` / ``baddbmm``): ratio = best
PyTorch time / ours, so above 1 is faster. ``--candidates`` also times every candidate
of every op the pass runs, forced one at a time (what the rules are fitted from).
"""

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import patchgemm
from patchgemm import functional as pg
from patchgemm.bench import (_CONV, _CONV_T, environment, input_sets, kernel_ms, linear_patch_embed,
                             linear_patch_unembed, randn)

ROUNDS, REPS = 3, 10  # see measure()
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    id: str
    op: str  # "patch_embed", "patch_unembed" or "grouped_linear"
    x: Tuple[int, ...]  # embed: [B, C, *S]; unembed: [B, C_in, *grid] or tokens [B, N, C_in]; grouped: [B, G, D]
    width: int  # embed: E; unembed: C_out; grouped: the output features per group
    kernel: Tuple[int, ...] = ()
    dtype: str = "bf16"
    tokens: bool = False  # embed: tokens out; unembed: tokens in (then `grid` is needed)
    grid: Tuple[int, ...] = ()
    channels_last: bool = False  # x and the weight in channels_last(_3d), as after model.to(memory_format=...)
    dx: bool = True  # the backward also computes x's gradient (a layer inside a network)
    bias: bool = True


def _embed(*args, **kw):
    return Shape(args[0], "patch_embed", *args[1:], **kw)


def _unembed(*args, **kw):
    return Shape(args[0], "patch_unembed", *args[1:], **kw)


def _grouped(*args, **kw):
    return Shape(args[0], "grouped_linear", *args[1:], **kw)


TUNING = [
    _embed("convnext-ds-384-cl", (64, 384, 14, 14), 768, (2, 2), channels_last=True),
    _embed("audio-conv1d-80", (32, 80, 3000), 512, (4,), dx=False),
    _embed("conv2d-64-fp32", (32, 64, 64, 64), 128, (2, 2), "fp32"),
    _embed("p5-fp32", (8, 192, 32, 32, 32), 768, (4, 4, 4), "fp32"),
    _grouped("grouped-1000x3x333", (1000, 3, 333), 77),
    # The first held-out set, which rules were then revised against.
    # Image and video patch stems: the input needs no gradient.
    _embed("vit-b16", (256, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("vit-l14", (64, 3, 224, 224), 1024, (14, 14), tokens=True, dx=False),
    _embed("vit-h14-fp16", (32, 3, 224, 224), 1280, (14, 14), "fp16", tokens=True, dx=False),
    _embed("clip-b32-fp16", (512, 3, 224, 224), 768, (32, 32), "fp16", tokens=True, dx=False),
    _embed("siglip-so400m-378", (16, 3, 378, 378), 1152, (14, 14), tokens=True, dx=False),
    _embed("siglip-b16-256", (128, 3, 256, 256), 768, (16, 16), tokens=True, dx=False),
    _embed("deit-tiny-fp32", (128, 3, 224, 224), 192, (16, 16), "fp32", dx=False),
    _embed("vit-s8", (64, 3, 224, 224), 384, (8, 8), tokens=True, dx=False),
    _embed("vit-b16-batch1", (1, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("vit-b16-fp32", (32, 3, 224, 224), 768, (16, 16), "fp32", tokens=True, dx=False),
    _embed("vivit-tubelet", (8, 3, 16, 224, 224), 768, (2, 16, 16), tokens=True, dx=False),
    _embed("videomae-l-fp16", (4, 3, 16, 224, 224), 1024, (2, 16, 16), "fp16", tokens=True, dx=False),
    _embed("qwen-vl-patches", (1024, 3, 2, 14, 14), 1152, (2, 14, 14), tokens=True, dx=False),
    _embed("3d-stem-k4", (2, 4, 64, 64, 64), 96, (4, 4, 4), dx=False),
    _embed("3d-odd-c-fp32", (4, 5, 64, 64, 64), 128, (2, 2, 2), "fp32", dx=False),
    _embed("3d-k8-tokens", (1, 3, 96, 96, 96), 384, (8, 8, 8), tokens=True, dx=False),
    _embed("3d-wide-e2048", (2, 16, 32, 32, 32), 2048, (4, 4, 4), dx=False),
    _embed("swin-stem", (64, 3, 224, 224), 96, (4, 4), dx=False),
    _embed("convnext-stem-fp32", (64, 3, 224, 224), 96, (4, 4), "fp32", dx=False),
    _embed("conv1d-raw-audio-fp32", (8, 1, 16384), 512, (16,), "fp32", dx=False),
    _embed("odd-c-fp16", (32, 7, 128, 128), 64, (8, 8), "fp16", dx=False),
    _embed("small-e32", (128, 3, 64, 64), 32, (4, 4), dx=False),
    _embed("kw7-tokens", (32, 3, 224, 224), 256, (7, 7), tokens=True, dx=False),
    _embed("cifar-vit-b512", (512, 3, 32, 32), 192, (4, 4), tokens=True, dx=False),
    _embed("sentinel-13-band", (16, 13, 256, 256), 768, (16, 16), tokens=True, dx=False),
    _embed("vit-l16-384-fp16", (64, 3, 384, 384), 1024, (16, 16), "fp16", dx=False),
    # Patch merging / downsampling inside a network: the input needs its gradient too.
    _embed("convnext-ds-192-cl", (32, 192, 28, 28), 384, (2, 2), channels_last=True),
    _embed("convnext-ds-96-fp32", (32, 96, 56, 56), 192, (2, 2), "fp32"),
    _embed("conv1d-k2", (64, 64, 4096), 256, (2,)),
    _embed("merge-k2-512", (16, 256, 32, 32), 512, (2, 2)),
    _embed("3d-merge-k2", (2, 96, 32, 32, 32), 192, (2, 2, 2)),
    _embed("3d-merge-k2-cl", (2, 64, 32, 32, 32), 128, (2, 2, 2), channels_last=True),
    # Patch heads (ConvTranspose, kernel == stride).
    _unembed("mae-pixel-head", (64, 768, 14, 14), 3, (16, 16)),
    _unembed("3d-head-k8", (2, 768, 8, 8, 8), 4, (8, 8, 8)),
    _unembed("3d-up2", (4, 384, 16, 16, 16), 96, (2, 2, 2)),
    _unembed("up2-fp32", (8, 256, 32, 32), 128, (2, 2), "fp32"),
    _unembed("up2-fp16", (16, 512, 16, 16), 256, (2, 2), "fp16"),
    _unembed("head-k32", (32, 1024, 7, 7), 3, (32, 32)),
    _unembed("conv1d-transpose-k4", (16, 512, 256), 80, (4,)),
    _unembed("head-k14-batch1", (1, 1152, 27, 27), 3, (14, 14)),
    _unembed("3d-head-fp32", (2, 192, 16, 16, 16), 4, (4, 4, 4), "fp32"),
    _unembed("swin-head-k4", (32, 96, 56, 56), 3, (4, 4)),
    _unembed("tokens-head-k16", (32, 196, 768), 3, (16, 16), tokens=True, grid=(14, 14)),
    _unembed("tokens-3d-head-fp16", (2, 512, 384), 4, (4, 4, 4), "fp16", tokens=True, grid=(8, 8, 8)),
    # Grouped linear, [B, G, D] -> [B, G, width].
    _grouped("grouped-8x4x32", (8, 4, 32), 32),
    _grouped("grouped-8192x64x64", (8192, 64, 64), 64),
    _grouped("grouped-512x16x256-fp32", (512, 16, 256), 256, dtype="fp32"),
    _grouped("grouped-2048x8x1024-fp16", (2048, 8, 1024), 1024, dtype="fp16"),
    _grouped("grouped-8192x64x4096", (8192, 64, 4096), 64),
    _grouped("grouped-4096x12x768-nobias", (4096, 12, 768), 768, bias=False),
    _grouped("grouped-256x32x128-fp32", (256, 32, 128), 512, dtype="fp32"),
    _grouped("grouped-64x256x64", (64, 256, 64), 16),
    # The second held-out set's shapes that rules were then revised against (under-filled grids, kw = 14
    # into thin GEMMs).
    _embed("vit-b16-batch4", (4, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("3d-ct-k16", (2, 1, 128, 128, 128), 768, (16, 16, 16), tokens=True, dx=False),
    _embed("k14-e64-tokens", (32, 3, 224, 224), 64, (14, 14), tokens=True, dx=False),
    _unembed("mae-head-k16-batch8", (8, 768, 14, 14), 3, (16, 16)),
    _unembed("tokens-3d-head-k8", (4, 216, 768), 4, (8, 8, 8), tokens=True, grid=(6, 6, 6)),
]

HELDOUT = [
    # Image and video patch stems: the input needs no gradient.
    _embed("deit-s16-fp16", (96, 3, 224, 224), 384, (16, 16), "fp16", tokens=True, dx=False),
    _embed("vit-b32-384", (32, 3, 384, 384), 768, (32, 32), tokens=True, dx=False),
    _embed("eva-g14", (8, 3, 224, 224), 1408, (14, 14), tokens=True, dx=False),
    _embed("beit-b16-channels-first", (64, 3, 224, 224), 768, (16, 16), dx=False),
    _embed("pixtral-k16", (2, 3, 1024, 1024), 1024, (16, 16), tokens=True, dx=False),
    _embed("dinov2-s14-518", (16, 3, 518, 518), 384, (14, 14), tokens=True, dx=False),
    _embed("timesformer-fp16", (4, 3, 8, 224, 224), 768, (1, 16, 16), "fp16", tokens=True, dx=False),
    _embed("videomae-b-batch2", (2, 3, 16, 224, 224), 768, (2, 16, 16), tokens=True, dx=False),
    _embed("3d-stem-k2-c4-fp16", (4, 4, 64, 64, 64), 64, (2, 2, 2), "fp16", dx=False),
    _embed("3d-stem-k4-fp32-tokens", (2, 4, 64, 64, 64), 192, (4, 4, 4), "fp32", tokens=True, dx=False),
    _embed("mixer-k32-fp32", (64, 3, 224, 224), 512, (32, 32), "fp32", tokens=True, dx=False),
    _embed("k7-channels-first", (16, 3, 224, 224), 128, (7, 7), dx=False),
    _embed("odd-c11-tokens", (16, 11, 120, 120), 256, (8, 8), tokens=True, dx=False),
    _embed("conv1d-k8-speech", (16, 1, 32000), 256, (8,), dx=False),
    _embed("e2048-k2", (8, 64, 64, 64), 2048, (2, 2), dx=False),
    _embed("batch512-k4-e96", (512, 3, 32, 32), 96, (4, 4), dx=False),
    _embed("levit-k16-fp32", (16, 3, 224, 224), 256, (16, 16), "fp32", dx=False),
    _embed("vit-b16-batch16", (16, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("3d-k8-e768-fp16", (2, 2, 64, 64, 64), 768, (8, 8, 8), "fp16", tokens=True, dx=False),
    _embed("k14-e128-fp16", (16, 3, 224, 224), 128, (14, 14), "fp16", tokens=True, dx=False),
    # Patch merging / downsampling inside a network: the input needs its gradient too.
    _embed("conv1d-k4-fp16", (32, 128, 2048), 256, (4,), "fp16"),
    _embed("convnext-ds-96-cl", (64, 96, 56, 56), 192, (2, 2), channels_last=True),
    _embed("merge-k2-fp16", (32, 128, 64, 64), 256, (2, 2), "fp16"),
    _embed("3d-merge-k2-fp32", (2, 48, 32, 32, 32), 96, (2, 2, 2), "fp32"),
    _embed("merge-k4-cl", (16, 64, 64, 64), 256, (4, 4), channels_last=True),
    _embed("3d-merge-k2-tokens", (2, 96, 16, 16, 16), 192, (2, 2, 2), tokens=True),
    # Patch heads (ConvTranspose, kernel == stride).
    _unembed("3d-head-k4", (2, 384, 16, 16, 16), 4, (4, 4, 4)),
    _unembed("3d-head-k16", (1, 768, 8, 8, 8), 1, (16, 16, 16)),
    _unembed("up4-fp16", (8, 256, 32, 32), 64, (4, 4), "fp16"),
    _unembed("conv1d-transpose-k2-fp32", (16, 256, 1024), 128, (2,), "fp32"),
    _unembed("tokens-head-k14", (16, 256, 1024), 3, (14, 14), tokens=True, grid=(16, 16)),
    _unembed("head-k16-e1024-fp16", (16, 1024, 16, 16), 3, (16, 16), "fp16"),
    _unembed("mae-head-k16-batch32", (32, 768, 14, 14), 3, (16, 16)),
    _unembed("tokens-head-k16-fp16", (8, 256, 512), 3, (16, 16), "fp16", tokens=True, grid=(16, 16)),
    _unembed("up2-odd-c", (8, 250, 32, 32), 125, (2, 2)),
    _unembed("up2-wide", (4, 1024, 64, 64), 512, (2, 2)),
    # Grouped linear, [B, G, D] -> [B, G, width].
    _grouped("grouped-16x8x128", (16, 8, 128), 128),
    _grouped("grouped-4096x32x96-fp16", (4096, 32, 96), 96, dtype="fp16"),
    _grouped("grouped-1024x4x2048", (1024, 4, 2048), 2048),
    _grouped("grouped-128x64x32-fp32", (128, 64, 32), 32, dtype="fp32"),
    _grouped("grouped-2048x16x512-nobias", (2048, 16, 512), 256, bias=False),
    _grouped("grouped-32x128x256", (32, 128, 256), 256),
    _grouped("grouped-8192x8x8", (8192, 8, 8), 8),
    _grouped("grouped-512x4x4096-fp16", (512, 4, 4096), 1024, dtype="fp16"),
]


# ---- each shape's inputs and implementations -----------------------------------------------------


@dataclass
class Problem:
    make_inputs: Callable[[], Dict[str, torch.Tensor]]
    ours: Callable[..., torch.Tensor]
    torch_paths: Dict[str, Callable[..., torch.Tensor]]
    grad_inputs: List[str]
    backward_ops: List[str]  # the ops the backward calls, whose candidates --candidates forces


def _memory_format(rank: int) -> torch.memory_format:
    return torch.channels_last if rank == 2 else torch.channels_last_3d


def problem(s: Shape, device: torch.device) -> Problem:
    dtype = DTYPES[s.dtype]
    rank = len(s.kernel)
    fmt = (lambda t: t.contiguous(memory_format=_memory_format(rank))) if s.channels_last else (lambda t: t)
    if s.op == "patch_embed":
        channels, k = s.x[1], s.kernel
        fan_in = channels * math.prod(k)

        def make_inputs():
            w = randn(s.width, channels, *k, dtype=dtype, device=device) / math.sqrt(fan_in)
            return {"x": fmt(randn(*s.x, dtype=dtype, device=device)).requires_grad_(s.dx),
                    "w": fmt(w).requires_grad_(),
                    "b": randn(s.width, dtype=dtype, device=device, requires_grad=True) if s.bias else None}

        out = "tokens" if s.tokens else "channels_first"
        conv = _CONV[rank]
        paths = {"conv": lambda x, w, b: (lambda y: y.flatten(2).transpose(1, 2) if s.tokens else y)(
                     conv(x, w, b, stride=k)),
                 # A drop-in returns the conv's memory format (linear_patch_embed: a permuted view).
                 "linear": lambda x, w, b: linear_patch_embed(x, w, b, s.tokens).contiguous(
                     memory_format=_memory_format(rank) if s.channels_last and not s.tokens else torch.contiguous_format)}
        return Problem(make_inputs, lambda x, w, b: pg.patch_embed(x, w, b, out_format=out), paths,
                       (["x"] if s.dx else []) + ["w"] + (["b"] if s.bias else []),
                       ["patch_weight_grad"] + (["patch_unembed"] if s.dx else []))
    if s.op == "patch_unembed":
        c_in, k = s.x[-1] if s.tokens else s.x[1], s.kernel
        grid = s.grid if s.tokens else s.x[2:]

        def make_inputs():
            w = randn(c_in, s.width, *k, dtype=dtype, device=device) / math.sqrt(c_in)
            return {"x": randn(*s.x, dtype=dtype, device=device, requires_grad=True),
                    "w": w.requires_grad_(),
                    "b": randn(s.width, dtype=dtype, device=device, requires_grad=True) if s.bias else None}

        def channels_first(x):
            return x.transpose(1, 2).reshape(x.shape[0], c_in, *grid) if s.tokens else x

        conv_t = _CONV_T[rank]
        paths = {"conv_transpose": lambda x, w, b: conv_t(channels_first(x), w, b, stride=k),
                 "linear": lambda x, w, b: linear_patch_unembed(channels_first(x), w, b)}
        ours = (lambda x, w, b: pg.patch_unembed(x, w, b, in_format="tokens", grid=grid)) if s.tokens else \
            (lambda x, w, b: pg.patch_unembed(x, w, b))
        return Problem(make_inputs, ours, paths, ["x", "w"] + (["b"] if s.bias else []),
                       ["patch_embed", "patch_weight_grad"])
    batch, groups, din = s.x

    def make_inputs():
        w = randn(groups, s.width, din, dtype=dtype, device=device) / math.sqrt(din)
        return {"x": randn(batch, groups, din, dtype=dtype, device=device, requires_grad=True),
                "w": w.requires_grad_(),
                "b": randn(groups, s.width, dtype=dtype, device=device, requires_grad=True) if s.bias else None}

    def bmm(x, w, b):
        xg, wt = x.transpose(0, 1), w.transpose(1, 2)
        return (torch.baddbmm(b.unsqueeze(1), xg, wt) if b is not None else torch.bmm(xg, wt)).transpose(0, 1)

    return Problem(make_inputs, lambda x, w, b: pg.grouped_linear(x, w, b), {"bmm": bmm}, ["x", "w"] + (["b"] if s.bias else []),
                   ["grouped_linear_grad_input", "grouped_linear_grad_weight"])


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

    @property
    def best_torch(self) -> Tuple[str, float]:
        return min(((n, t) for n, t in self.torch_ms.items() if t is not None), key=lambda p: p[1])

    @property
    def ratio(self) -> float:
        return self.best_torch[1] / self.ours_ms


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


def measure(s: Shape, set_name: str, device: torch.device, candidates: bool) -> List[Result]:
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
        for _ in range(ROUNDS):
            for name, fn in runs.items():
                try:
                    best[name] = min(kernel_ms(fn, device, reps=REPS), best.get(name) or math.inf)
                except RuntimeError:  # a PyTorch path this torch / GPU lacks
                    best[name] = None
        ours = best.pop("ours")
        torch_ms = best
        r = Result(s.id, set_name, s.op, pass_, s.dtype, ours, torch_ms,
                   {c.op: c.chosen for c in chosen})
        if candidates:
            for op in [s.op] if pass_ == "fwd" else prob.backward_ops:
                r.candidates_ms[op] = {}
                for c in patchgemm.kernels(op):
                    try:
                        with patchgemm.force(**{op: c.name}):
                            r.candidates_ms[op][c.name] = kernel_ms(run, device, reps=REPS)
                    except RuntimeError:  # the forced candidate does not apply
                        r.candidates_ms[op][c.name] = None
        results.append(r)
    return results


# ---- reporting -----------------------------------------------------------------------------------


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
                     "geomean": math.exp(statistics.fmean(math.log(x) for x in ratios)),
                     "below_0.97": [r.id for r in rs if r.ratio < 0.97]})
    return rows


def format_results(results: List[Result]) -> str:
    head = f"{'set':<8} {'shape':<26} {'pass':<8} {'ours ms':>9} {'best PyTorch':>22} {'ratio':>6}  chosen"
    lines = [head, "-" * len(head)]
    for r in results:
        name, t = r.best_torch
        chosen = ", ".join(f"{op}={c}" for op, c in r.chosen.items())
        lines.append(f"{r.set:<8} {r.id:<26} {r.pass_:<8} {r.ours_ms:>9.4f} {f'{t:.4f} ({name})':>22} "
                     f"{r.ratio:>5.2f}x  {chosen}")
        for op, times in r.candidates_ms.items():
            shown = ", ".join(f"{n} {t:.4f}" for n, t in times.items() if t is not None)
            lines.append(f"{'':<45}{op}: {shown}")
    return "\n".join(lines)


def format_summary(rows: List[dict]) -> str:
    lines = ["| set | op | pass | shapes | min | median | geomean | below 0.97x |", "|---|---|---|---|---|---|---|---|"]
    for s in rows:
        below = ", ".join(s["below_0.97"]) or "none"
        lines.append(f"| {s['set']} | {s['op']} | {s['pass']} | {s['n']} | {s['min']:.2f}x | {s['median']:.2f}x | "
                     f"{s['geomean']:.2f}x | {below} |")
    return "\n".join(lines)


def format_markdown(results: List[Result], env: dict) -> str:
    lines = [f"{env.get('date', '')}, {env.get('gpu', env.get('device'))}, torch {env.get('torch')}, "
             f"CUDA {env.get('cuda')}; `python bench/heldout.py --set all`. Ratio = the best PyTorch path's GPU "
             "time / patchgemm's default choice (above 1: faster).", "", format_summary(summary(results)), "",
             "| set | shape | pass | patchgemm ms | best PyTorch ms | ratio | chosen |", "|---|---|---|---|---|---|---|"]
    for r in results:
        name, t = r.best_torch
        chosen = ", ".join(f"{op}={c}" for op, c in r.chosen.items())
        lines.append(f"| {r.set} | {r.id} | {r.pass_} | {r.ours_ms:.4f} | {t:.4f} ({name}) | {r.ratio:.2f}x | "
                     f"{chosen} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", choices=["heldout", "tuning", "all"], default="all")
    parser.add_argument("--filter", help="only shapes whose id contains this text (comma-separated: any of them)")
    parser.add_argument("--candidates", action="store_true", help="also time every candidate, forced")
    parser.add_argument("--device", help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--markdown", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sets = {"tuning": TUNING, "heldout": HELDOUT}
    wanted = [f.strip() for f in (args.filter or "").split(",") if f.strip()]
    chosen = [(name, s) for name, shapes in sets.items() if args.set in (name, "all") for s in shapes
              if not wanted or any(f in s.id for f in wanted)]
    if not chosen:
        print(f"heldout: no shape matches --filter {args.filter!r}")
        return 2
    torch.manual_seed(0)
    results = []
    for set_name, s in chosen:
        results += measure(s, set_name, device, args.candidates)
        print(format_results(results[-2:]).split("\n", 2)[2], flush=True)
    print(format_results(results))
    print(format_summary(summary(results)))
    env = environment(device)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": [dict(asdict(r), ratio=r.ratio) for r in results]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(results, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
