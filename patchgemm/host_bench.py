"""`python -m patchgemm bench --host`: the host time of one call of each op against the PyTorch op
it replaces (conv, conv_transpose, bmm, ...), forward and forward + backward.

Host time is what the calling thread spends issuing the call: Python, dispatch, checks, selection,
allocation, launches (and, for forward + backward, the autograd engine). On CUDA the GPU is kept
busy by a sleep kernel queued before every timed call, so no call waits for the GPU and the launch
queue stays short. Machines lent by the hour drift by tens of per cent within a minute, so the two
sides are timed alternately, call by call, and the medians of many such pairs are compared. The
shapes are small (a ViT-S/16 stem, small groups): where host time matters.
"""

import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from . import functional as pg
from .bench import _sleep_ms, environment
from .nn import PatchEmbed


@dataclass
class HostRow:
    op: str
    pass_: str            # "fwd" or "fwd+bwd"
    baseline: str         # the PyTorch op it replaces
    ours_us: float        # median host time per call
    baseline_us: float
    ratio: float          # baseline / ours (>= 1: ours costs the host no more)


@dataclass
class HostCase:
    op: str
    baseline: str
    make: Callable[[torch.device, torch.dtype, bool], dict]  # (device, dtype, tiny) -> {pass: (ours, theirs)}


def _r(*shape, device, dtype, grad=False):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


def _pair(ours, theirs, inputs, grad_shape, device, dtype):
    """(fwd, fwd+bwd) callables for both sides: forward under no_grad, or forward + backward of a
    fixed output gradient."""
    grad = torch.randn(*grad_shape, device=device, dtype=dtype)

    def forward(fn):
        def run():
            with torch.no_grad():
                fn(*inputs)
        return run

    def training(fn):
        return lambda: fn(*inputs).backward(grad)

    return {"fwd": (forward(ours), forward(theirs)), "fwd+bwd": (training(ours), training(theirs))}


def cases() -> List[HostCase]:
    def patch_embed(device, dtype, tiny):  # ViT-S/16, batch 64: the images need no gradient
        n = 2 if tiny else 64
        x = _r(n, 3, 224, 224, device=device, dtype=dtype)
        w, b = _r(384, 3, 16, 16, device=device, dtype=dtype, grad=True), _r(384, device=device, dtype=dtype, grad=True)
        return _pair(lambda x, w, b: pg.patch_embed(x, w, b), lambda x, w, b: F.conv2d(x, w, b, stride=16),
                     (x, w, b), (n, 384, 14, 14), device, dtype)

    def patch_embed_module(device, dtype, tiny):
        conv = torch.nn.Conv2d(3, 384, 16, stride=16, device=device, dtype=dtype)
        ours = PatchEmbed.from_conv(conv)
        n = 2 if tiny else 64
        x = _r(n, 3, 224, 224, device=device, dtype=dtype)
        return _pair(lambda x: ours(x), lambda x: conv(x), (x,), (n, 384, 14, 14), device, dtype)

    def patch_embed_3d(device, dtype, tiny):  # VideoMAE-S tubelets, batch 8
        n = 1 if tiny else 8
        x = _r(n, 3, 16, 224, 224, device=device, dtype=dtype)
        w, b = _r(384, 3, 2, 16, 16, device=device, dtype=dtype, grad=True), _r(384, device=device, dtype=dtype, grad=True)
        return _pair(lambda x, w, b: pg.patch_embed(x, w, b), lambda x, w, b: F.conv3d(x, w, b, stride=(2, 16, 16)),
                     (x, w, b), (n, 384, 8, 14, 14), device, dtype)

    def patch_unembed(device, dtype, tiny):  # a decoder's last layer: tokens of a 14 x 14 grid back to 4-channel 56 x 56
        n = 2 if tiny else 64
        x = _r(n, 384, 14, 14, device=device, dtype=dtype, grad=True)
        w, b = _r(384, 4, 4, 4, device=device, dtype=dtype, grad=True), _r(4, device=device, dtype=dtype, grad=True)
        return _pair(lambda x, w, b: pg.patch_unembed(x, w, b), lambda x, w, b: F.conv_transpose2d(x, w, b, stride=4),
                     (x, w, b), (n, 4, 56, 56), device, dtype)

    def patch_unembed_3d(device, dtype, tiny):  # the suite's U1: ConvTranspose3d(768, 192, 4) on [8, 768, 8^3]
        n = 1 if tiny else 8
        x = _r(n, 768, 8, 8, 8, device=device, dtype=dtype, grad=True)
        w, b = _r(768, 192, 4, 4, 4, device=device, dtype=dtype, grad=True), _r(192, device=device, dtype=dtype, grad=True)
        return _pair(lambda x, w, b: pg.patch_unembed(x, w, b), lambda x, w, b: F.conv_transpose3d(x, w, b, stride=4),
                     (x, w, b), (n, 192, 32, 32, 32), device, dtype)

    def grouped_linear(device, dtype, tiny):  # 16 groups of 64 -> 64, batch 8
        x = _r(8, 16, 64, device=device, dtype=dtype, grad=True)
        w, b = _r(16, 64, 64, device=device, dtype=dtype, grad=True), _r(16, 64, device=device, dtype=dtype, grad=True)
        return _pair(lambda x, w, b: pg.grouped_linear(x, w, b),
                     lambda x, w, b: torch.baddbmm(b.unsqueeze(1), x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1),
                     (x, w, b), (8, 16, 64), device, dtype)

    def ragged(device, dtype, tiny):  # 8 experts, 4096 routed rows, 256 -> 256
        x = _r(4096, 256, device=device, dtype=dtype, grad=True)
        w = _r(8, 256, 256, device=device, dtype=dtype, grad=True)
        offsets = torch.arange(1, 9, device=device, dtype=torch.int32) * 512
        return _pair(lambda x, w: pg.grouped_linear(x, w, offsets=offsets),
                     lambda x, w: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets),
                     (x, w), (4096, 256), device, dtype)

    def pointwise(device, dtype, tiny):  # 8 groups of 64 channels, length 256
        x = _r(8, 512, 256, device=device, dtype=dtype, grad=True)
        w, b = _r(512, 64, 1, device=device, dtype=dtype, grad=True), _r(512, device=device, dtype=dtype, grad=True)
        return _pair(lambda x, w, b: pg.grouped_pointwise_conv(x, w, b, 8), lambda x, w, b: F.conv1d(x, w, b, groups=8),
                     (x, w, b), (8, 512, 256), device, dtype)

    def norm(device, dtype, tiny):  # an hMLP stem's norm: [8, 64, 32^3]
        x = _r(1 if tiny else 8, 64, 32, 32, 32, device=device, dtype=dtype, grad=True)
        w, b = _r(64, device=device, dtype=dtype, grad=True), _r(64, device=device, dtype=dtype, grad=True)
        return _pair(lambda x, w, b: pg.instance_norm_act(x, w, b),
                     lambda x, w, b: F.gelu(F.instance_norm(x, weight=w, bias=b)), (x, w, b), x.shape, device, dtype)

    def swiglu(device, dtype, tiny):
        h = _r(4096, 2048, device=device, dtype=dtype, grad=True)
        return _pair(pg.swiglu, lambda h: F.silu(h[:, :1024]) * h[:, 1024:], (h,), (4096, 1024), device, dtype)

    return [HostCase("patch_embed", "conv2d", patch_embed), HostCase("PatchEmbed module", "nn.Conv2d", patch_embed_module),
            HostCase("patch_embed 3-D", "conv3d", patch_embed_3d),
            HostCase("patch_unembed 2-D", "conv_transpose2d", patch_unembed),
            HostCase("patch_unembed U1", "conv_transpose3d", patch_unembed_3d),
            HostCase("grouped_linear", "baddbmm", grouped_linear), HostCase("ragged grouped_linear", "_grouped_mm", ragged),
            HostCase("grouped_pointwise_conv", "conv1d groups", pointwise),
            HostCase("instance_norm_act", "instance_norm+gelu", norm), HostCase("swiglu", "silu*mul", swiglu)]


def host_us(ours: Callable[[], object], theirs: Callable[[], object], device: torch.device, pairs: int = 100):
    """Median host times (us) of one call of each, timed alternately (which goes first alternates
    too); on CUDA each call is queued behind a sleep longer than the host takes for it."""
    cuda = device.type == "cuda"
    for _ in range(3):
        ours(), theirs()
    times = {ours: [], theirs: []}
    lead_ms = 1.0
    if cuda:
        torch.cuda.synchronize(device)
        for fn in (ours, theirs):  # a first estimate of the host time, for the sleep's length
            t0 = time.perf_counter()
            fn()
            lead_ms = max(lead_ms, 3e3 * (time.perf_counter() - t0))
            torch.cuda.synchronize(device)
    for i in range(pairs):
        for fn in ((ours, theirs) if i % 2 == 0 else (theirs, ours)):
            if cuda:
                _sleep_ms(lead_ms, device)
            t0 = time.perf_counter()
            fn()
            times[fn].append((time.perf_counter() - t0) * 1e6)
        if cuda and i % 4 == 3:
            torch.cuda.synchronize(device)
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(times[ours]), statistics.median(times[theirs])


def run(device: Optional[str] = None, dtype: torch.dtype = torch.bfloat16, pairs: int = 100, tiny: bool = False,
        progress=print) -> List[HostRow]:
    """Every case's rows; ``tiny`` shrinks the batches (a smoke run on the CPU)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rows = []
    for case in cases():
        if case.baseline == "_grouped_mm" and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9):
            progress(f"skipped {case.op}: torch._grouped_mm runs on sm_90+ GPUs only")
            continue
        for pass_, (ours, theirs) in case.make(dev, dtype, tiny).items():
            o, t = host_us(ours, theirs, dev, pairs)
            rows.append(HostRow(case.op, pass_, case.baseline, o, t, t / o))
            progress(format_rows(rows[-1:], header=False))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_rows(rows: List[HostRow], header: bool = True) -> str:
    lines = [f"{'op':<24} {'pass':<8} {'PyTorch op':<20} {'ours us':>8} {'torch us':>9} {'torch/ours':>10}"] if header else []
    lines += [f"{r.op:<24} {r.pass_:<8} {r.baseline:<20} {r.ours_us:>8.1f} {r.baseline_us:>9.1f} {r.ratio:>10.2f}"
              for r in rows]
    return "\n".join(lines)


def main(device: Optional[str] = None, json_path: Optional[str] = None, pairs: int = 100, tiny: bool = False) -> int:
    import json
    from dataclasses import asdict

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(format_rows([]))
    rows = run(str(dev), pairs=pairs, tiny=tiny)
    print("\n" + format_rows(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": environment(dev), "host": [asdict(r) for r in rows]}, f, indent=1)
    return 0
