"""The benchmark suite behind `python -m patchgemm bench` (method: ../shared/BENCHMARKS.md).

Every figure is a CUDA-event median after warm-up on fresh random inputs, rotated when they would
fit in L2; a claim is a ratio measured in the same run: ours vs each PyTorch baseline, and ours vs
the floor = max(FLOPs / measured GEMM peak, bytes / measured copy bandwidth).
"""

import json
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

from . import functional as pg

# ---- timing --------------------------------------------------------------------------------------


def time_ms(fn: Callable[[int], object], device: torch.device, warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of fn(i) over `reps` runs (i selects a rotated input set)."""
    for i in range(warmup):
        fn(i)
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for i in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(i)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def randn(*shape, dtype, device, requires_grad=False):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(requires_grad)


@dataclass
class Ceilings:
    matmul_tflops: Dict[str, float]  # per dtype name, at the current TF32 setting
    copy_tbs: float  # TB/s counting bytes read + written


def measure_ceilings(device: torch.device, dtypes: List[torch.dtype]) -> Ceilings:
    big = device.type == "cuda"
    n = 8192 if big else 1024
    peaks = {}
    for dtype in dtypes:
        a, b = randn(n, n, dtype=dtype, device=device), randn(n, n, dtype=dtype, device=device)
        ms = time_ms(lambda i: a @ b, device, warmup=3, reps=10 if big else 3)
        peaks[str(dtype).replace("torch.", "")] = 2 * n**3 / ms / 1e9
        del a, b
    nbytes = 2**30 if big else 2**26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda i: dst.copy_(src), device, warmup=3, reps=10)
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


def suite(device: torch.device) -> List[Case]:
    """The public cases of BENCHMARKS.md, full size on a GPU and scaled down on the CPU."""
    if device.type == "cuda":
        g1 = dict(batch=2560, groups=12, din=1024, dout=3072)
    else:
        g1 = dict(batch=64, groups=12, din=256, dout=384)
    return [
        grouped_linear_case("G1 bf16", dtype=torch.bfloat16, device=device, **g1),
        grouped_linear_case("G1 bf16 no-bias", dtype=torch.bfloat16, device=device, bias=False, **g1),
        grouped_linear_case("G1 fp32", dtype=torch.float32, device=device, **g1),
    ]


# ---- running -------------------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    pass_: str
    impl: str
    ms: Optional[float]
    tflops: Optional[float]
    floor_ms: float
    error: str = ""


def _input_sets(case: Case, device: torch.device) -> List[Dict[str, torch.Tensor]]:
    """Enough fresh input sets that rotating through them defeats the L2 cache."""
    first = case.make_inputs()
    if device.type != "cuda":
        return [first]
    nbytes = sum(t.numel() * t.element_size() for t in first.values() if t is not None)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    count = min(8, max(1, math.ceil(3 * l2 / max(nbytes, 1))))
    return [first] + [case.make_inputs() for _ in range(count - 1)]


def run_case(case: Case, device: torch.device, ceilings: Ceilings, progress=None) -> List[Row]:
    sets = _input_sets(case, device)
    peak = ceilings.matmul_tflops[str(case.dtype).replace("torch.", "")]
    bw = ceilings.copy_tbs
    flops_fb = case.flops_fwd * (3 if case.needs_dx else 2)
    floors = {
        "fwd": max(case.flops_fwd / peak / 1e9, case.bytes_fwd / bw / 1e9),
        "fwd+bwd": max(flops_fb / peak / 1e9, case.bytes_fwd_bwd / bw / 1e9),
    }
    flops = {"fwd": case.flops_fwd, "fwd+bwd": flops_fb}
    with torch.no_grad():  # the fixed random upstream gradient
        dy = torch.randn(case.impls[case.ours](**sets[0]).shape, dtype=case.dtype, device=device)
    rows = []
    for pass_ in ("fwd", "fwd+bwd"):
        for name, impl in case.impls.items():
            def fwd(i, impl=impl):
                with torch.no_grad():
                    return impl(**sets[i % len(sets)])

            def fwd_bwd(i, impl=impl):
                s = sets[i % len(sets)]
                out = impl(**s)
                return torch.autograd.grad(out, [s[k] for k in case.grad_inputs], dy)

            try:
                ms = time_ms(fwd if pass_ == "fwd" else fwd_bwd, device)
                rows.append(Row(case.id, pass_, name, ms, flops[pass_] / ms / 1e9, floors[pass_]))
            except Exception as e:  # a baseline this torch/GPU lacks: report it, keep going
                rows.append(Row(case.id, pass_, name, None, None, floors[pass_], error=str(e).split("\n")[0][:80]))
            if progress is not None:
                progress.update(1)
    return rows


def format_table(rows: List[Row]) -> str:
    ours = {(r.case, r.pass_): r.ms for r in rows if r.impl == "patchgemm" and r.ms}
    head = f"{'case':<18} {'pass':<8} {'impl':<22} {'ms':>9} {'TFLOP/s':>8} {'floor ms':>9} {'x floor':>8} {'ours faster by':>14}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.ms is None:
            lines.append(f"{r.case:<18} {r.pass_:<8} {r.impl:<22} {'n/a':>9}   ({r.error})")
            continue
        o = ours.get((r.case, r.pass_))
        speed = f"{r.ms / o:.2f}x" if o and r.impl != "patchgemm" else ""
        lines.append(f"{r.case:<18} {r.pass_:<8} {r.impl:<22} {r.ms:>9.4f} {r.tflops:>8.1f} "
                     f"{r.floor_ms:>9.4f} {r.ms / r.floor_ms:>8.2f} {speed:>14}")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    env = {"torch": torch.__version__, "device": str(device), "date": time.strftime("%Y-%m-%d")}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda or torch.version.hip
        env["tf32"] = torch.backends.cuda.matmul.allow_tf32
    return env


def main(device: Optional[str] = None, json_path: Optional[str] = None, filter: Optional[str] = None) -> int:
    from tqdm import tqdm

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cases = [c for c in suite(dev) if not filter or filter.lower() in c.id.lower()]
    if not cases:
        print(f"patchgemm bench: no case matches --filter {filter!r}; cases: {[c.id for c in suite(dev)]}")
        return 2
    torch.manual_seed(0)
    ceilings = measure_ceilings(dev, sorted({c.dtype for c in cases}, key=str))
    print(f"ceilings: matmul TFLOP/s {ceilings.matmul_tflops}, copy {ceilings.copy_tbs:.2f} TB/s")
    rows = []
    with tqdm(total=sum(2 * len(c.impls) for c in cases), desc="bench", unit="run") as progress:
        for case in cases:
            rows += run_case(case, dev, ceilings, progress)
    print(format_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"environment": environment(dev), "ceilings": ceilings.__dict__,
                       "rows": [r.__dict__ for r in rows]}, f, indent=1)
    return 0
