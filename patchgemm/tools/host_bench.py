"""`python -m patchgemm bench --host`: the host time of one call of each op against the PyTorch op
it replaces (conv, conv_transpose, bmm, ...), forward and forward + backward.

Host time is what the calling thread spends issuing the call: Python, dispatch, checks, selection,
allocation, launches (and, for forward + backward, the autograd engine). On CUDA the GPU is kept
busy by a sleep kernel queued before every timed call, so no call waits for the GPU and the launch
queue stays short. Machines lent by the hour drift by tens of per cent within a minute, so the two
sides are timed alternately, call by call, and the medians of many such pairs are compared. The
shapes are small (a ViT-S/16 stem, small groups): where host time matters.
"""

import functools
import statistics
import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

from .. import functional as pg
from .bench import sleep_ms, environment, randn
from ..nn import PatchEmbed


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
    make: Callable[[Callable, bool], dict]  # (randn on the device and dtype, tiny) -> {pass: (ours, theirs)}


def _pair(ours, theirs, inputs, grad_shape, r, memory_format=torch.contiguous_format):
    """(fwd, fwd+bwd) callables for both sides: forward under no_grad, or forward + backward of a
    fixed output gradient (in `memory_format`, as the output's)."""
    grad = r(*grad_shape).contiguous(memory_format=memory_format)

    def forward(fn):
        def run():
            with torch.no_grad():
                fn(*inputs)
        return run

    def training(fn):
        return lambda: fn(*inputs).backward(grad)

    return {"fwd": (forward(ours), forward(theirs)), "fwd+bwd": (training(ours), training(theirs))}


def cases() -> List[HostCase]:
    def patch_embed(r, tiny):  # ViT-S/16, batch 64: the images need no gradient
        n = 2 if tiny else 64
        x = r(n, 3, 224, 224)
        w, b = r(384, 3, 16, 16, requires_grad=True), r(384, requires_grad=True)
        return _pair(lambda x, w, b: pg.patch_embed(x, w, b), lambda x, w, b: F.conv2d(x, w, b, stride=16),
                     (x, w, b), (n, 384, 14, 14), r)

    def patch_embed_module(r, tiny):
        n = 2 if tiny else 64
        x = r(n, 3, 224, 224)
        conv = torch.nn.Conv2d(3, 384, 16, stride=16, device=x.device, dtype=x.dtype)
        ours = PatchEmbed.from_conv(conv)
        return _pair(lambda x: ours(x), lambda x: conv(x), (x,), (n, 384, 14, 14), r)

    def patch_embed_3d(r, tiny):  # VideoMAE-S tubelets, batch 8
        n, frames, side = (1, 2, 32) if tiny else (8, 16, 224)
        x = r(n, 3, frames, side, side)
        w, b = r(384, 3, 2, 16, 16, requires_grad=True), r(384, requires_grad=True)
        return _pair(lambda x, w, b: pg.patch_embed(x, w, b), lambda x, w, b: F.conv3d(x, w, b, stride=(2, 16, 16)),
                     (x, w, b), (n, 384, frames // 2, side // 16, side // 16), r)

    def patch_embed_channels_last(r, tiny):  # ConvNeXt-T's first downsample: channels-last x, cuDNN's path
        n, side = (2, 16) if tiny else (64, 56)
        x = r(n, side, side, 96).permute(0, 3, 1, 2).requires_grad_()
        w, b = r(192, 96, 2, 2, requires_grad=True), r(192, requires_grad=True)
        return _pair(lambda x, w, b: pg.patch_embed(x, w, b), lambda x, w, b: F.conv2d(x, w, b, stride=2),
                     (x, w, b), (n, 192, side // 2, side // 2), r, torch.channels_last)

    def patch_unembed(r, tiny):  # a decoder's last layer: tokens of a 14 x 14 grid back to 4-channel 56 x 56
        n = 2 if tiny else 64
        x = r(n, 384, 14, 14, requires_grad=True)
        w, b = r(384, 4, 4, 4, requires_grad=True), r(4, requires_grad=True)
        return _pair(lambda x, w, b: pg.patch_unembed(x, w, b), lambda x, w, b: F.conv_transpose2d(x, w, b, stride=4),
                     (x, w, b), (n, 4, 56, 56), r)

    def patch_unembed_channels_last(r, tiny):  # the mirror of ConvNeXt's downsample: a k = 2 upsampling decoder
        n, side = (2, 8) if tiny else (64, 28)
        x = r(n, side, side, 192).permute(0, 3, 1, 2).requires_grad_()
        w, b = r(192, 96, 2, 2, requires_grad=True), r(96, requires_grad=True)
        return _pair(lambda x, w, b: pg.patch_unembed(x, w, b), lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2),
                     (x, w, b), (n, 96, 2 * side, 2 * side), r, torch.channels_last)

    def patch_unembed_3d(r, tiny):  # the suite's U1: ConvTranspose3d(768, 192, 4) on [8, 768, 8^3]
        n, side = (1, 2) if tiny else (8, 8)
        x = r(n, 768, side, side, side, requires_grad=True)
        w, b = r(768, 192, 4, 4, 4, requires_grad=True), r(192, requires_grad=True)
        return _pair(lambda x, w, b: pg.patch_unembed(x, w, b), lambda x, w, b: F.conv_transpose3d(x, w, b, stride=4),
                     (x, w, b), (n, 192, 4 * side, 4 * side, 4 * side), r)

    def grouped_linear(r, tiny):  # 16 groups of 64 -> 64, batch 8
        x = r(8, 16, 64, requires_grad=True)
        w, b = r(16, 64, 64, requires_grad=True), r(16, 64, requires_grad=True)
        return _pair(lambda x, w, b: pg.grouped_linear(x, w, b),
                     lambda x, w, b: torch.baddbmm(b.unsqueeze(1), x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1),
                     (x, w, b), (8, 16, 64), r)

    def ragged(r, tiny):  # 8 experts, 4096 routed rows, 256 -> 256
        x = r(4096, 256, requires_grad=True)
        w = r(8, 256, 256, requires_grad=True)
        offsets = torch.arange(1, 9, device=x.device, dtype=torch.int32) * 512
        return _pair(lambda x, w: pg.grouped_linear(x, w, offsets=offsets),
                     lambda x, w: torch._grouped_mm(x, w.transpose(1, 2), offs=offsets),
                     (x, w), (4096, 256), r)

    def pointwise(r, tiny):  # 8 groups of 64 channels, batch 8, length 256
        n, length = (2, 32) if tiny else (8, 256)
        x = r(n, 512, length, requires_grad=True)
        w, b = r(512, 64, 1, requires_grad=True), r(512, requires_grad=True)
        return _pair(lambda x, w, b: pg.grouped_pointwise_conv(x, w, b, 8), lambda x, w, b: F.conv1d(x, w, b, groups=8),
                     (x, w, b), (n, 512, length), r)

    def norm(r, tiny):  # an hMLP stem's norm: [8, 64, 32^3]
        x = r(1, 64, 8, 8, 8, requires_grad=True) if tiny else r(8, 64, 32, 32, 32, requires_grad=True)
        w, b = r(64, requires_grad=True), r(64, requires_grad=True)
        return _pair(lambda x, w, b: pg.instance_norm_act(x, w, b),
                     lambda x, w, b: F.gelu(F.instance_norm(x, weight=w, bias=b)), (x, w, b), x.shape, r)

    def swiglu(r, tiny):
        rows = 64 if tiny else 4096
        h = r(rows, 2048, requires_grad=True)
        return _pair(pg.swiglu, lambda h: F.silu(h[:, :1024]) * h[:, 1024:], (h,), (rows, 1024), r)

    return [HostCase("patch_embed", "conv2d", patch_embed), HostCase("PatchEmbed module", "nn.Conv2d", patch_embed_module),
            HostCase("patch_embed 3-D", "conv3d", patch_embed_3d),
            HostCase("patch_embed channels-last", "conv2d", patch_embed_channels_last),
            HostCase("patch_unembed 2-D", "conv_transpose2d", patch_unembed),
            HostCase("patch_unembed channels-last", "conv_transpose2d", patch_unembed_channels_last),
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
                sleep_ms(lead_ms, device)
            t0 = time.perf_counter()
            fn()
            times[fn].append((time.perf_counter() - t0) * 1e6)
        if cuda and i % 4 == 3:
            torch.cuda.synchronize(device)
    if cuda:
        torch.cuda.synchronize(device)
    return statistics.median(times[ours]), statistics.median(times[theirs])


def run(device: Optional[str] = None, dtype: torch.dtype = torch.bfloat16, pairs: int = 100,
        tiny: Optional[bool] = None, progress=print) -> List[HostRow]:
    """Every case's rows; ``tiny`` shrinks the problems to CPU sizes (the default on the CPU, where the
    GPU's sizes take minutes and measure the arithmetic, not the host)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = dev.type == "cpu" if tiny is None else tiny
    rows = []
    for case in cases():
        if case.baseline == "_grouped_mm" and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9):
            progress(f"skipped {case.op}: torch._grouped_mm runs on sm_90+ GPUs only")
            continue
        for pass_, (ours, theirs) in case.make(functools.partial(randn, device=dev, dtype=dtype), tiny).items():
            o, t = host_us(ours, theirs, dev, pairs)
            rows.append(HostRow(case.op, pass_, case.baseline, o, t, t / o))
            progress(format_rows(rows[-1:], header=False))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_rows(rows: List[HostRow], header: bool = True) -> str:
    lines = [f"{'op':<28} {'pass':<8} {'PyTorch op':<20} {'ours us':>8} {'torch us':>9} {'torch/ours':>10}"] if header else []
    lines += [f"{r.op:<28} {r.pass_:<8} {r.baseline:<20} {r.ours_us:>8.1f} {r.baseline_us:>9.1f} {r.ratio:>10.2f}"
              for r in rows]
    return "\n".join(lines)


def main(device: Optional[str] = None, json_path: Optional[str] = None, pairs: int = 100,
         tiny: Optional[bool] = None) -> int:
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
