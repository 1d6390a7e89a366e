"""The benchmark suite behind `python -m patchgemm bench` (method: ../shared/BENCHMARKS.md).

Every figure is a CUDA-event median of the GPU's time after warm-up on fresh random inputs, rotated
when they would fit in L2 (the host's time per call is reported apart: see time_ms); a claim is a
ratio measured in the same run: ours vs each PyTorch baseline, and ours vs the floor =
max(FLOPs / measured GEMM peak, bytes / measured copy bandwidth).
"""

import contextlib
import json
import math
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import functional as pg

# ---- timing --------------------------------------------------------------------------------------


@dataclass
class Timing:
    ms: float                 # median time of one call: GPU time on CUDA (see time_ms), wall time on the CPU
    host_ms: Optional[float]  # median host time to issue one call (Python, dispatch, launches; no
                              # waiting); None on the CPU, where the host does the work (ms)
    samples: Tuple[float, ...] = ()  # on the CPU: each call's time (ms), which run_case pools over turns


def _sleep_rate(device: torch.device) -> float:
    """Clock cycles of torch.cuda._sleep per ms, measured now (the clock moves with load and heat)."""
    cycles = 1_000_000
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


_cycles_per_ms: Dict[int, float] = {}


def sleep_ms(ms: float, device: torch.device, recalibrate: bool = False) -> None:
    """Keeps the GPU busy for about `ms` (torch.cuda._sleep spins for a number of clock cycles);
    `recalibrate` measures the spin rate again first (after a warm-up has raised the clock)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if recalibrate or index not in _cycles_per_ms:
        _cycles_per_ms[index] = _sleep_rate(device)
    torch.cuda._sleep(int(ms * _cycles_per_ms[index]))


ROUNDS = 3  # turns each implementation of a case takes on a GPU (run_case)
CPU_ROUNDS, CPU_TURN_MS = 15, 10.0  # on the CPU: more, shorter turns (run_case)


def time_ms(fn: Callable[[int], object], device: torch.device, warmup: int = 5, reps: int = 30) -> Timing:
    """Median time of fn(i) over `reps` runs (i selects a rotated input set).

    On CUDA the events time the GPU's work: the GPU first spins for a lead longer than the host
    takes to issue the call, so the host has queued the whole call before the start event fires.
    Otherwise a slow host (a launch costs ~20 us on some lent VMs) would be timed instead of the
    GPU. A run whose host time came near its lead is run again with twice the lead. What the host
    spends is reported apart, as host_ms.
    """
    for i in range(warmup):
        fn(i)
    times, host = [], []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for i in range(3):
            t0 = time.perf_counter()
            fn(i)
            host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize(device)
        lead_ms = 3 * max(host) + 0.1
        for i in range(reps):
            while True:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                sleep_ms(lead_ms, device, recalibrate=i == 0)  # at the clock the warm-up left
                start.record()
                t0 = time.perf_counter()
                fn(i)
                spent = (time.perf_counter() - t0) * 1e3
                end.record()
                end.synchronize()
                if spent < 0.7 * lead_ms or lead_ms > 1000:
                    break
                lead_ms *= 2  # the GPU may have idled waiting for the host: run it again
            host.append(spent)
            times.append(start.elapsed_time(end))
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
        return Timing(statistics.median(times), None, tuple(times))
    return Timing(statistics.median(times), statistics.median(host))


def kernel_ms(fn: Callable[[int], object], device: torch.device, warmup: int = 3, reps: int = 10) -> float:
    """GPU time of one call of fn(i) as the sum of the durations of the kernels, copies and memsets it
    runs (the profiler's device events), averaged over `reps` calls: idle gaps, while the host
    issues the work, do not count. On the CPU: the median wall time."""
    if device.type != "cuda":
        return time_ms(fn, device, warmup=warmup, reps=reps).ms
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            fn(i)
        torch.cuda.synchronize(device)
    device_events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not device_events:
        raise RuntimeError("kernel_ms: the profiler recorded no device events")
    return sum(e.time_range.elapsed_us() for e in device_events) / 1e3 / reps


def randn(*shape, dtype, device, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)


@dataclass
class Ceilings:
    matmul_tflops: Dict[str, float]  # per dtype name, at the current TF32 setting; "tf32": fp32 in TF32
    copy_tbs: float  # TB/s counting bytes read + written


def measure_ceilings(device: torch.device, dtypes: List[torch.dtype]) -> Ceilings:
    big = device.type == "cuda"
    n = 8192 if big else 1024

    # A ceiling is the fastest rate the device sustains. A VM's CPU speed drifts by 10-30% within
    # seconds, and one median taken in a slow spell would lower a ceiling and lift every floor
    # above what the cases then measure: on the CPU, the fastest of five medians.
    def fastest_ms(fn, reps: int) -> float:
        return min(time_ms(fn, device, warmup=3, reps=reps).ms for _ in range(1 if big else 5))

    peaks = {}
    for dtype in dtypes:
        operands = [randn(n, n, dtype=dtype, device=device), randn(n, n, dtype=dtype, device=device)]

        def product(i):
            return operands[0] @ operands[1]

        ms = fastest_ms(product, reps=10 if big else 3)
        peaks[str(dtype).replace("torch.", "")] = 2 * n**3 / ms / 1e9
        if dtype == torch.float32 and big:  # the rate of fp32 work that a conv's TF32 flag lets run in TF32
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                peaks["tf32"] = 2 * n**3 / time_ms(product, device, warmup=3, reps=10).ms / 1e9
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
        operands.clear()  # the next dtype's 8192^2 operands do not wait for these to be freed
    nbytes = 2**30 if big else 2**26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = fastest_ms(lambda i: dst.copy_(src), reps=10)
    return Ceilings(peaks, 2 * nbytes / ms / 1e9)


# ---- cases ---------------------------------------------------------------------------------------


@dataclass
class Case:
    """One problem: its input sets, implementations (ours first) and the work that bounds it."""
    id: str
    dtype: torch.dtype
    make_inputs: Callable[[], Dict[str, torch.Tensor]]
    impls: Dict[str, Callable[..., torch.Tensor]]  # name -> fn(**inputs) -> output
    flops_fwd: float
    bytes_fwd: float
    bytes_fwd_bwd: float
    grad_inputs: List[str]  # inputs that get gradients in fwd+bwd
    needs_dx: bool = True
    notes: str = ""
    flops_fwd_bwd: Optional[float] = None  # default: 3x forward with dx, 2x without
    conv: bool = False  # a convolution: fp32 may run in TF32 under torch.backends.cudnn.allow_tf32

    @property
    def ours(self) -> str:
        return next(iter(self.impls))


def _grouped_mm(x, w):  # [B, G, Din] x [G, Dout, Din] -> [B, G, Dout] through torch._grouped_mm
    return torch._grouped_mm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)


def grouped_linear_case(case_id, batch, groups, din, dout, dtype, device, bias=True) -> Case:
    elt = torch.finfo(dtype).bits // 8

    def make_inputs():
        return {
            "x": randn(batch, groups, din, dtype=dtype, device=device, requires_grad=True),
            "w": (randn(groups, dout, din, dtype=dtype, device=device) / math.sqrt(din)).requires_grad_(),
            "b": randn(groups, dout, dtype=dtype, device=device, requires_grad=True) if bias else None,
        }

    def add_bias(y, b):
        return y if b is None else y + b

    impls = {
        "patchgemm": lambda x, w, b: pg.grouped_linear(x, w, b),
        "bmm (permuted views)": lambda x, w, b: (
            torch.baddbmm(b.unsqueeze(1), x.transpose(0, 1), w.transpose(1, 2)) if b is not None
            else torch.bmm(x.transpose(0, 1), w.transpose(1, 2))).transpose(0, 1),
        "einsum": lambda x, w, b: add_bias(torch.einsum("bgi,goi->bgo", x, w), b),
        "loop of nn.Linear": lambda x, w, b: torch.stack(
            [F.linear(x[:, g], w[g], None if b is None else b[g]) for g in range(groups)], dim=1),
    }
    if hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16:
        impls["torch._grouped_mm"] = lambda x, w, b: add_bias(_grouped_mm(x, w), b)
    x_n, w_n, y_n, b_n = batch * groups * din, groups * dout * din, batch * groups * dout, groups * dout * bias
    return Case(
        id=case_id, dtype=dtype, make_inputs=make_inputs, impls=impls,
        flops_fwd=2.0 * batch * groups * din * dout,
        bytes_fwd=elt * (x_n + w_n + b_n + y_n),
        bytes_fwd_bwd=elt * 2 * (x_n + w_n + b_n + y_n),  # x, w, b, dy read; y, dx, dw, db written
        grad_inputs=["x", "w", "b"] if bias else ["x", "w"],
        notes=f"x[{batch}, {groups}, {din}] -> {dout} per group, bias={bias}",
    )


def pointwise_case(case_id, batch, groups, per_group, length, dtype, device) -> Case:
    """Many small parallel linears as a grouped Conv1d with kernel 1 (BENCHMARKS.md G2), NCL input."""
    elt = torch.finfo(dtype).bits // 8
    channels = groups * per_group

    def make_inputs():
        return {
            "x": randn(batch, channels, length, dtype=dtype, device=device, requires_grad=True),
            "w": (randn(channels, per_group, 1, dtype=dtype, device=device) / math.sqrt(per_group)).requires_grad_(),
            "b": randn(channels, dtype=dtype, device=device, requires_grad=True),
        }

    def broadcast_matmul(x, w, b):
        y = torch.matmul(w.view(groups, per_group, per_group), x.view(batch, groups, per_group, length))
        return y.view(batch, channels, length) + b.view(1, -1, 1)

    impls = {
        "patchgemm": lambda x, w, b: pg.grouped_pointwise_conv(x, w, b, groups),
        "torch.matmul (broadcast)": broadcast_matmul,
        "grouped Conv1d": lambda x, w, b: F.conv1d(x, w, b, groups=groups),
    }
    x_n, w_n = batch * channels * length, channels * per_group
    return Case(
        id=case_id, dtype=dtype, make_inputs=make_inputs, impls=impls,
        flops_fwd=2.0 * batch * length * channels * per_group,
        bytes_fwd=elt * (2 * x_n + w_n + channels), bytes_fwd_bwd=elt * (5 * x_n + 2 * w_n),  # fwd: x, y; bwd: dy, x, dx
        grad_inputs=["x", "w", "b"], conv=True,
        notes=f"x[{batch}, {channels}, {length}], {groups} groups of {per_group}, kernel 1")


def grouped_mlp_case(case_id, batch, groups, dim, hidden, dtype, device) -> Case:
    """A SwiGLU MLP per group (BENCHMARKS.md G3): down(silu(gate(x)) * up(x)), gate and up in one weight."""
    elt = torch.finfo(dtype).bits // 8

    def make_inputs():
        return {
            "x": randn(batch, groups, dim, dtype=dtype, device=device, requires_grad=True),
            "wgu": (randn(groups, 2 * hidden, dim, dtype=dtype, device=device) / math.sqrt(dim)).requires_grad_(),
            "wd": (randn(groups, dim, hidden, dtype=dtype, device=device) / math.sqrt(hidden)).requires_grad_(),
        }

    def eager_swiglu(gate_up):
        gate, up = gate_up.chunk(2, -1)
        return F.silu(gate) * up

    def loop(x, wgu, wd):
        outs = []
        for g in range(groups):
            xg = x[:, g]
            h = F.silu(F.linear(xg, wgu[g, :hidden])) * F.linear(xg, wgu[g, hidden:])
            outs.append(F.linear(h, wd[g]))
        return torch.stack(outs, 1)

    impls = {
        "patchgemm": lambda x, wgu, wd: pg.grouped_mlp(x, wgu, wd),
        "bmm + eager SwiGLU": lambda x, wgu, wd: torch.bmm(
            eager_swiglu(torch.bmm(x.transpose(0, 1), wgu.transpose(1, 2))), wd.transpose(1, 2)).transpose(0, 1),
        "grouped_linear + eager": lambda x, wgu, wd: pg.grouped_linear(eager_swiglu(pg.grouped_linear(x, wgu)), wd),
        "loop of nn.Linear": loop,
    }
    rows = batch * groups
    flops = 2.0 * rows * (dim * 2 * hidden + hidden * dim)
    x_n, w_n = rows * dim, groups * 3 * hidden * dim
    return Case(
        id=case_id, dtype=dtype, make_inputs=make_inputs, impls=impls, flops_fwd=flops,
        bytes_fwd=elt * (2 * x_n + w_n), bytes_fwd_bwd=elt * 2 * (2 * x_n + w_n), grad_inputs=["x", "wgu", "wd"],
        notes=f"x[{batch}, {groups}, {dim}] -> {hidden} (SwiGLU) -> {dim} per group")


def zipf_sizes(total: int, groups: int, s: float = 1.0) -> List[int]:
    """`total` rows over `groups` with Zipf(s)-skewed sizes (largest first), summing exactly to total."""
    weights = [1.0 / (g + 1) ** s for g in range(groups)]
    sizes = [int(total * w / sum(weights)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def ragged_case(case_id, tokens, groups, din, dout, dtype, device) -> Case:
    """Mixture-of-experts expert layers (BENCHMARKS.md R1): x sorted by group, Zipf-skewed sizes."""
    elt = torch.finfo(dtype).bits // 8
    sizes = zipf_sizes(tokens, groups)

    def make_inputs():
        return {
            "x": randn(tokens, din, dtype=dtype, device=device, requires_grad=True),
            "w": (randn(groups, dout, din, dtype=dtype, device=device) / math.sqrt(din)).requires_grad_(),
            "sizes": torch.tensor(sizes, dtype=torch.int32, device=device),
        }

    impls = {
        "patchgemm": lambda x, w, sizes: pg.grouped_linear(x, w, group_sizes=sizes),
        "loop of F.linear": lambda x, w, sizes: torch.cat(
            [F.linear(xg, w[g]) for g, xg in enumerate(x.split(_host_sizes))]),
    }
    _host_sizes = sizes
    if hasattr(torch, "_grouped_mm") and device.type == "cuda" and dtype == torch.bfloat16:
        impls["torch._grouped_mm"] = lambda x, w, sizes: torch._grouped_mm(
            x, w.transpose(1, 2), offs=torch.cumsum(sizes, 0, dtype=torch.int32))
    x_n, w_n, y_n = tokens * din, groups * dout * din, tokens * dout
    return Case(
        id=case_id, dtype=dtype, make_inputs=make_inputs, impls=impls, flops_fwd=2.0 * tokens * din * dout,
        bytes_fwd=elt * (x_n + w_n + y_n), bytes_fwd_bwd=elt * 2 * (x_n + w_n + y_n), grad_inputs=["x", "w"],
        notes=f"x[{tokens}, {din}] -> {dout}, {groups} groups, Zipf sizes {sizes[0]}..{sizes[-1]}")


def _patch_grid(x, kernel):
    return [s // k for s, k in zip(x.shape[2:], kernel)]


def linear_patch_embed(x, w, b, tokens):
    """The usual hand rewrite of a kernel == stride conv: view + permute + reshape + nn.Linear (and a
    permuted view back to channels-first)."""
    batch, channels, kernel = x.shape[0], x.shape[1], w.shape[2:]
    grid, rank = _patch_grid(x, kernel), len(kernel)
    x = x[(slice(None), slice(None)) + tuple(slice(0, g * k) for g, k in zip(grid, kernel))]  # as the conv: whole patches
    split = [batch, channels] + [v for g, k in zip(grid, kernel) for v in (g, k)]
    order = [0] + [2 + 2 * i for i in range(rank)] + [1] + [3 + 2 * i for i in range(rank)]
    patches = x.reshape(split).permute(order).reshape(batch * math.prod(grid), -1)
    y = F.linear(patches, w.reshape(w.shape[0], -1), b).view(batch, *grid, w.shape[0])
    return y.flatten(1, rank) if tokens else y.movedim(-1, 1)


def linear_patch_unembed(x, w, b):
    """The hand rewrite of a kernel == stride ConvTranspose: tokens @ W, then permute the patches out."""
    batch, c_in, grid = x.shape[0], x.shape[1], x.shape[2:]
    kernel, rank, c_out = w.shape[2:], len(w.shape[2:]), w.shape[1]
    q = (x.flatten(2).transpose(1, 2) @ w.reshape(c_in, -1)).view(batch, *grid, c_out, *kernel)
    order = [0, 1 + rank] + [v for i in range(rank) for v in (1 + i, 2 + rank + i)]
    y = q.permute(order).reshape(batch, c_out, *[g * k for g, k in zip(grid, kernel)])
    return y if b is None else y + b.view(1, -1, *[1] * rank)


CONVS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_TRANSPOSES = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _conv_name(device) -> str:
    """What runs F.conv*d on this device: cuDNN (MIOpen on ROCm) on a GPU, ATen's own on the CPU."""
    if torch.device(device).type != "cuda":
        return "ATen conv"
    return "MIOpen conv" if torch.version.hip else "cuDNN conv"


def patch_embed_case(case_id, x_shape, embed, kernel, dtype, device, tokens=False, needs_dx=False) -> Case:
    kernel = tuple(kernel)
    elt = torch.finfo(dtype).bits // 8
    channels, rank = x_shape[1], len(kernel)
    fan_in = channels * math.prod(kernel)

    def make_inputs():
        return {
            "x": randn(*x_shape, dtype=dtype, device=device, requires_grad=needs_dx),
            "w": (randn(embed, channels, *kernel, dtype=dtype, device=device) / math.sqrt(fan_in)).requires_grad_(),
            "b": randn(embed, dtype=dtype, device=device, requires_grad=True),
        }

    conv = CONVS[rank]
    fmt = "tokens" if tokens else "channels_first"
    impls = {
        "patchgemm": lambda x, w, b: pg.patch_embed(x, w, b, out_format=fmt),
        _conv_name(device): lambda x, w, b: (lambda y: y.flatten(2).transpose(1, 2) if tokens else y)(
            conv(x, w, b, stride=kernel)),
        # A drop-in returns the conv's layout: channels-first out is made contiguous, as the conv's is.
        "linear": lambda x, w, b: linear_patch_embed(x, w, b, tokens).contiguous(),
    }
    tokens_n = math.prod(x_shape) // fan_in
    x_n, w_n, y_n = math.prod(x_shape), embed * fan_in, tokens_n * embed
    flops = 2.0 * tokens_n * fan_in * embed
    fb_bytes = x_n + 2 * y_n + 2 * (w_n + embed) + (x_n if needs_dx else 0)
    return Case(
        id=case_id, dtype=dtype, make_inputs=make_inputs, impls=impls, flops_fwd=flops,
        bytes_fwd=elt * (x_n + w_n + embed + y_n), bytes_fwd_bwd=elt * fb_bytes,
        grad_inputs=(["x"] if needs_dx else []) + ["w", "b"], needs_dx=needs_dx, conv=True,
        notes=f"x{list(x_shape)} Conv{rank}d({channels}, {embed}, {kernel}) -> {fmt}, dx={needs_dx}")


def patch_unembed_case(case_id, x_shape, out_channels, kernel, dtype, device) -> Case:
    kernel = tuple(kernel)
    elt = torch.finfo(dtype).bits // 8
    c_in, rank = x_shape[1], len(kernel)

    def make_inputs():
        return {
            "x": randn(*x_shape, dtype=dtype, device=device, requires_grad=True),
            "w": (randn(c_in, out_channels, *kernel, dtype=dtype, device=device) / math.sqrt(c_in)).requires_grad_(),
            "b": randn(out_channels, dtype=dtype, device=device, requires_grad=True),
        }

    conv_t = CONV_TRANSPOSES[rank]
    impls = {
        "patchgemm": lambda x, w, b: pg.patch_unembed(x, w, b),
        _conv_name(device): lambda x, w, b: conv_t(x, w, b, stride=kernel),
        "linear": linear_patch_unembed,
    }
    x_n, w_n = math.prod(x_shape), c_in * out_channels * math.prod(kernel)
    y_n = x_n // c_in * out_channels * math.prod(kernel)
    return Case(
        id=case_id, dtype=dtype, make_inputs=make_inputs, impls=impls,
        flops_fwd=2.0 * x_n * out_channels * math.prod(kernel),
        bytes_fwd=elt * (x_n + w_n + out_channels + y_n),
        bytes_fwd_bwd=elt * 2 * (x_n + w_n + out_channels + y_n), grad_inputs=["x", "w", "b"], conv=True,
        notes=f"x{list(x_shape)} ConvTranspose{rank}d({c_in}, {out_channels}, {kernel})")


def hmlp_stem_case(case_id, x_shape, widths, kernels, dtype, device) -> Case:
    """A whole kernel == stride stem: Conv -> InstanceNorm -> GELU -> ... -> Conv (BENCHMARKS.md H1)."""
    from ..nn import HierarchicalPatchEmbed

    rank = len(x_shape) - 2
    elt = torch.finfo(dtype).bits // 8
    stem = HierarchicalPatchEmbed(widths[0], widths[-1], kernels, hidden_dim=widths[1], dims=rank,
                                  device="meta")
    names = [n for n, _ in stem.named_parameters()]
    stages = len(kernels)

    def make_inputs():
        inputs = {"x": randn(*x_shape, dtype=dtype, device=device)}
        for i, k in enumerate(kernels):
            fan_in = widths[i] * k ** rank
            inputs[f"w{i}"] = (randn(widths[i + 1], widths[i], *(k,) * rank, dtype=dtype, device=device)
                               / math.sqrt(fan_in)).requires_grad_()
            inputs[f"b{i}"] = randn(widths[i + 1], dtype=dtype, device=device, requires_grad=True)
        for i in range(stages - 1):
            inputs[f"g{i}"] = (1 + 0.1 * randn(widths[i + 1], dtype=dtype, device=device)).requires_grad_()
            inputs[f"h{i}"] = (0.1 * randn(widths[i + 1], dtype=dtype, device=device)).requires_grad_()
        return inputs

    def stack(stage):
        def run(x, **p):
            for i in range(stages):
                x = stage(x, p[f"w{i}"], p[f"b{i}"])
                if i < stages - 1:
                    x = F.gelu(F.instance_norm(x, weight=p[f"g{i}"], bias=p[f"h{i}"]))
            return x
        return run

    # The stem runs on the case's tensors: each call binds them in place of its own (meta) parameters,
    # as functional_call would, without functional_call's own cost per call (0.2 ms on a CPU).
    slots = {}
    for i in range(stages):
        slots[f"w{i}"], slots[f"b{i}"] = ("stages", i, "weight"), ("stages", i, "bias")
    for i in range(stages - 1):
        slots[f"g{i}"], slots[f"h{i}"] = ("norms", i, "weight"), ("norms", i, "bias")
    assert {f"{group}.{i}.{name}" for group, i, name in slots.values()} == set(names)

    def ours(x, **p):
        for key, (group, i, name) in slots.items():
            getattr(stem, group)[i]._parameters[name] = p[key]
        return stem(x)

    conv = CONVS[rank]
    impls = {
        "patchgemm": ours,
        "patchgemm per stage": stack(lambda x, w, b: pg.patch_embed(x, w, b)),
        _conv_name(device): stack(lambda x, w, b: conv(x, w, b, stride=w.shape[2:])),
        "linear": stack(lambda x, w, b: linear_patch_embed(x, w, b, False).contiguous()),
    }
    flops = flops_fb = bytes_f = bytes_fb = 0.0
    tokens = math.prod(x_shape[2:])
    for i, k in enumerate(kernels):
        x_n = x_shape[0] * widths[i] * tokens
        tokens //= k ** rank
        fan_in = widths[i] * k ** rank
        y_n, w_n = x_shape[0] * tokens * widths[i + 1], widths[i + 1] * fan_in
        f = 2.0 * x_shape[0] * tokens * fan_in * widths[i + 1]
        flops += f
        flops_fb += f * (3 if i else 2)
        bytes_f += elt * (x_n + w_n + y_n)
        bytes_fb += elt * (x_n + 2 * y_n + 2 * w_n + (x_n if i else 0))
    grads = [f"{p}{i}" for i in range(stages) for p in "wb"] + [f"{p}{i}" for i in range(stages - 1) for p in "gh"]
    return Case(id=case_id, dtype=dtype, make_inputs=make_inputs, impls=impls, flops_fwd=flops,
                bytes_fwd=bytes_f, bytes_fwd_bwd=bytes_fb, grad_inputs=grads, needs_dx=False,
                flops_fwd_bwd=flops_fb, conv=True,
                notes=f"x{list(x_shape)} stem {widths} kernels {kernels} (floor: the convs only)")


def suite(device: torch.device) -> List[Case]:
    """The public cases of BENCHMARKS.md, full size on a GPU and scaled down on the CPU."""
    bf16, fp32 = torch.bfloat16, torch.float32
    if device.type == "cuda":
        g1 = dict(batch=2560, groups=12, din=1024, dout=3072)
        b, vol, p1_batch, p2_batch = 8, 128, 128, 4096
        r1, r1_dims = [(8, 16384), (64, 32768), (128, 65536)], (1024, 2048)
        g2 = dict(batch=8, groups=64, per_group=100, length=1024)
    else:  # every case scaled down to calls of 0.3-15 ms on a 2-core CPU
        g1 = dict(batch=64, groups=12, din=256, dout=384)
        b, vol, p1_batch, p2_batch = 1, 32, 4, 64
        r1, r1_dims = [(8, 512)], (128, 256)
        g2 = dict(batch=4, groups=32, per_group=32, length=256)
    cases = [
        grouped_linear_case("G1 bf16", dtype=bf16, device=device, **g1),
        grouped_linear_case("G1 bf16 no-bias", dtype=bf16, device=device, bias=False, **g1),
        grouped_linear_case("G1 fp32", dtype=fp32, device=device, **g1),
        pointwise_case("G2 bf16", dtype=bf16, device=device, **g2),
        pointwise_case("G2 fp32", dtype=fp32, device=device, **g2),
        grouped_linear_case("G2 tokens", g2["batch"] * g2["length"], g2["groups"], g2["per_group"], g2["per_group"],
                            bf16, device),
        grouped_mlp_case("G3", g1["batch"], g1["groups"], g1["din"], g1["din"] * 2, bf16, device),
        *[ragged_case(f"R1 {g} groups", tokens, g, r1_dims[0], r1_dims[1], bf16, device)
          for g, tokens in r1],
        patch_embed_case("P1", (p1_batch, 3, 224, 224), 768, (16, 16), bf16, device, tokens=True),
        patch_embed_case("P2", (p2_batch, 3, 2, 14, 14), 1280, (2, 14, 14), bf16, device, tokens=True),
        patch_embed_case("P3", (b, 4, vol, vol, vol), 192, (2, 2, 2), bf16, device),
        patch_embed_case("P3 fp32", (b, 4, vol, vol, vol), 192, (2, 2, 2), fp32, device),
        patch_embed_case("P4", (b, 192, vol // 2, vol // 2, vol // 2), 192, (2, 2, 2), bf16, device, needs_dx=True),
        patch_embed_case("P5", (b, 192, vol // 4, vol // 4, vol // 4), 768, (4, 4, 4), bf16, device, needs_dx=True),
        patch_embed_case("P5 fp32", (b, 192, vol // 4, vol // 4, vol // 4), 768, (4, 4, 4), fp32, device,
                         needs_dx=True),
        patch_unembed_case("U1", (b, 768, vol // 16, vol // 16, vol // 16), 192, (4, 4, 4), bf16, device),
        patch_unembed_case("U2", (b, 192, vol // 2, vol // 2, vol // 2), 4, (2, 2, 2), bf16, device),
        hmlp_stem_case("H1", (b, 4, vol, vol, vol), [4, 192, 192, 768], [2, 2, 4], bf16, device),
    ]
    return cases


# ---- running -------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    pass_: str
    impl: str
    ms: Optional[float]
    tflops: Optional[float]
    floor_ms: float
    peak_mb: Optional[float] = None  # fwd+bwd: peak memory above the inputs (activations, workspaces)
    error: str = ""
    host_ms: Optional[float] = None  # host time to issue one call (older JSON files lack it)


def input_sets(make_inputs: Callable[[], Dict[str, torch.Tensor]], device: torch.device
               ) -> List[Dict[str, torch.Tensor]]:
    """Enough fresh input sets that rotating through them defeats the L2 cache."""
    first = make_inputs()
    if device.type != "cuda":
        return [first]
    nbytes = sum(t.numel() * t.element_size() for t in first.values() if t is not None)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    count = min(8, max(1, math.ceil(3 * l2 / max(nbytes, 1))))
    return [first] + [make_inputs() for _ in range(count - 1)]


def _peak_mb(run, device: torch.device) -> Optional[float]:
    """Peak memory one run allocates beyond what was allocated before it (MB)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run(0)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _take_turns(runs: Dict[str, Callable[[int], object]],
                device: torch.device) -> Tuple[Dict[str, Timing], Dict[str, str]]:
    """Each implementation's Timing, and where one fails the error's first line instead, the
    implementations taking turns so that a drift of the GPU's clock or of the machine's load cannot
    favour whichever ran first.

    On a GPU: ROUNDS turns of time_ms, each implementation keeping its best median. On the CPU, whose
    speed drifts by 10-30% within seconds on a shared VM: CPU_ROUNDS turns of about CPU_TURN_MS
    each (enough consecutive calls to keep the caches as a loop of them would), and the median of
    every call of every turn. Identical implementations then agree within 2-4% on a 2-core VM,
    where the best of three 30-call medians spread 10-20%."""
    cpu = device.type != "cuda"
    reps = {}
    if cpu:  # calls per turn, from the fastest of three timed calls after a warm-up
        for name, run in runs.items():
            try:
                run(0)
                spent = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    run(0)
                    spent.append((time.perf_counter() - t0) * 1e3)
                reps[name] = max(3, min(30, int(CPU_TURN_MS / max(min(spent), 1e-3))))
            except Exception:  # reported by the first turn
                reps[name] = 1
    best: Dict[str, Timing] = {}
    errors: Dict[str, str] = {}
    pooled: Dict[str, List[float]] = {name: [] for name in runs}
    names = list(runs)
    for turn in range(CPU_ROUNDS if cpu else ROUNDS):
        # Each round starts with the next implementation: none always runs first (after another
        # case's calls) or last.
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            run = runs[name]
            if name in errors:
                continue
            try:
                t = time_ms(run, device, warmup=1, reps=reps[name]) if cpu else time_ms(run, device)
            except Exception as e:  # a baseline this torch/GPU lacks: report it, keep going
                errors[name] = str(e).split("\n")[0][:80]
                continue
            if cpu:
                pooled[name] += t.samples
            elif name in best:
                old = best[name]
                best[name] = Timing(min(t.ms, old.ms), min(t.host_ms, old.host_ms))
            else:
                best[name] = t
    if cpu:
        best = {name: Timing(statistics.median(pooled[name]), None) for name in runs if name not in errors}
    return best, errors


def run_case(case: Case, device: torch.device, ceilings: Ceilings, progress=None) -> List[Row]:
    sets = input_sets(case.make_inputs, device)
    peak = ceilings.matmul_tflops[str(case.dtype).replace("torch.", "")]
    if case.conv and case.dtype == torch.float32 and torch.backends.cudnn.allow_tf32:
        peak = ceilings.matmul_tflops.get("tf32", peak)
    bw = ceilings.copy_tbs
    flops_fb = case.flops_fwd_bwd or case.flops_fwd * (3 if case.needs_dx else 2)
    floors = {
        "fwd": max(case.flops_fwd / peak / 1e9, case.bytes_fwd / bw / 1e9),
        "fwd+bwd": max(flops_fb / peak / 1e9, case.bytes_fwd_bwd / bw / 1e9),
    }
    flops = {"fwd": case.flops_fwd, "fwd+bwd": flops_fb}
    with torch.no_grad():  # the fixed random upstream gradient
        dy = torch.randn(case.impls[case.ours](**sets[0]).shape, dtype=case.dtype, device=device)
    rows = []
    for pass_ in ("fwd", "fwd+bwd"):
        runs = {}
        for name, impl in case.impls.items():
            def fwd(i, impl=impl):
                with torch.no_grad():
                    return impl(**sets[i % len(sets)])

            def fwd_bwd(i, impl=impl):
                s = sets[i % len(sets)]
                out = impl(**s)
                return torch.autograd.grad(out, [s[k] for k in case.grad_inputs], dy)

            runs[name] = fwd if pass_ == "fwd" else fwd_bwd
        best, errors = _take_turns(runs, device)
        for name, run in runs.items():
            if name in errors:
                rows.append(Row(case.id, pass_, name, None, None, floors[pass_], error=errors[name]))
            else:
                t = best[name]
                peak = _peak_mb(run, device) if pass_ == "fwd+bwd" else None
                rows.append(Row(case.id, pass_, name, t.ms, flops[pass_] / t.ms / 1e9, floors[pass_], peak,
                                host_ms=t.host_ms))
            if progress is not None:
                progress.update(1)
    return rows


def format_table(rows: List[Row]) -> str:
    ours = {(r.case, r.pass_): r.ms for r in rows if r.impl == "patchgemm" and r.ms}
    head = (f"{'case':<16} {'pass':<8} {'impl':<20} {'ms':>9} {'TFLOP/s':>8} {'floor ms':>9} {'x floor':>8} "
            f"{'ours faster by':>14} {'peak MB':>8} {'host ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.ms is None:
            lines.append(f"{r.case:<16} {r.pass_:<8} {r.impl:<20} {'n/a':>9}   ({r.error})")
            continue
        o = ours.get((r.case, r.pass_))
        speed = f"{r.ms / o:.2f}x" if o and r.impl != "patchgemm" else ""
        # (peak memory is measured on CUDA only; on the CPU the host time is the time)
        peak = f"{r.peak_mb:>8.0f}" if r.peak_mb is not None else f"{'-':>8}"
        host = f"{r.host_ms:>8.4f}" if r.host_ms is not None else f"{'-':>8}"
        lines.append(f"{r.case:<16} {r.pass_:<8} {r.impl:<20} {r.ms:>9.4f} {r.tflops:>8.3g} "
                     f"{r.floor_ms:>9.4f} {r.ms / r.floor_ms:>8.2f} {speed:>14} {peak:>8} {host}")
    return "\n".join(lines)


def _commit() -> Optional[str]:
    """The patchgemm commit measured: $PATCHGEMM_COMMIT (set where the package is built from a copy of
    the tree without git), else that of the checkout the package is imported from, else None."""
    if os.environ.get("PATCHGEMM_COMMIT"):
        return os.environ["PATCHGEMM_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # patchgemm/tools/..
    if not os.path.exists(os.path.join(root, ".git")):  # installed, not run from the checkout itself
        return None
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def hold_cpu_heap() -> bool:
    """Keeps freed CPU buffers in the process's heap (glibc: no mmap per large buffer, no trimming).

    ATen's CPU tensors come from malloc, and glibc serves large requests by fresh mmaps whose pages
    fault in on first touch, by a threshold that moves with what the process freed before. A call's
    time then depends on the calls that ran before it (2x for the same call, bench's G3 and P5 on a
    2-core VM), not on its own work. Held, every implementation reuses warm pages, as a training
    loop's steady state does. Returns whether it applied (glibc only)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, (1 << 31) - 1))
    except (OSError, AttributeError):  # not glibc
        return False


def environment(device: torch.device) -> dict:
    from .. import __version__

    env = {"torch": torch.__version__, "device": str(device), "date": time.strftime("%Y-%m-%d"),
           "patchgemm": __version__, "commit": _commit()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda or torch.version.hip
        env["tf32"] = torch.backends.cuda.matmul.allow_tf32
    elif device.type == "cpu":  # what a CPU result depends on: the threads ATen runs on
        env["device"] = f"cpu, {torch.get_num_threads()} threads"
    return env


def _plot(rows: List[dict], env: dict, path: str) -> None:
    from .plot import plot

    where = env.get("gpu") or env.get("device", "?")
    plot(rows, path, title=f"python -m patchgemm bench: {where}, torch {env.get('torch', '?')}, {env.get('date', '')}")
    print(f"plot written to {path}")


def _matches(case_id: str, wanted: str) -> bool:
    """A --filter term names a case ("G1 fp32") or a family of cases (its first word: "G1")."""
    case_id = case_id.lower()
    return wanted == case_id or wanted == case_id.split()[0]


def main(device: Optional[str] = None, json_path: Optional[str] = None, filter: Optional[str] = None,
         plot_path: Optional[str] = None) -> int:
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is an extra: patchgemm[bench]
        tqdm = None

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    wanted = [f.strip().lower() for f in (filter or "").split(",") if f.strip()]
    cases = [c for c in suite(dev) if not wanted or any(_matches(c.id, f) for f in wanted)]
    if not cases:
        print(f"patchgemm bench: no case matches --filter {filter!r}; cases: {[c.id for c in suite(dev)]}")
        return 2
    torch.manual_seed(0)
    if dev.type == "cpu" and hold_cpu_heap():
        print("CPU heap held (glibc: no mmap per large buffer, no trimming): see bench.hold_cpu_heap")
    ceilings = measure_ceilings(dev, sorted({c.dtype for c in cases}, key=str))
    print(f"ceilings: matmul TFLOP/s {ceilings.matmul_tflops}, copy {ceilings.copy_tbs:.2f} TB/s")
    rows = []
    runs = sum(2 * len(c.impls) for c in cases)
    with tqdm(total=runs, desc="bench", unit="run") if tqdm else contextlib.nullcontext() as progress:
        for case in cases:
            rows += run_case(case, dev, ceilings, progress)
    print(format_table(rows))
    env = environment(dev)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": env, "ceilings": ceilings.__dict__,
                       "rows": [r.__dict__ for r in rows]}, f, indent=1)
    if plot_path:
        _plot([r.__dict__ for r in rows], env, plot_path)
    return 0


def replay(json_path: str, plot_path: Optional[str] = None) -> int:
    """Prints (and plots) the results a `--json` run saved, without running anything."""
    with open(json_path) as f:
        saved = json.load(f)
    print(format_table([Row(**r) for r in saved["rows"]]))
    if plot_path:
        _plot(saved["rows"], saved.get("environment", {}), plot_path)
    return 0
