"""Random problems for every op and direction against float64 references on the CPU.

Each problem draws its own shapes, dtype, memory layout, output format and (on CUDA) kernel mode
from a generator seeded with (PATCHGEMM_FUZZ_SEED, op, index), so a failure names the seed and
index that replay it alone. A problem checks the forward and every gradient (x, weight, bias) by
||out - ref|| / ||ref||. The shapes lean towards what single shapes in the other tests miss: batch
one, odd channel and embedding counts, patches whose K = C * prod(k) runs into the tens of
thousands, reductions (token counts) of every remainder, non-contiguous inputs.

On a GPU each op runs PATCHGEMM_FUZZ_PROBLEMS problems (default 800: 2,400 in all) within
PATCHGEMM_FUZZ_SECONDS per op (default 45); on the CPU a smaller count (PATCHGEMM_FUZZ_CPU_PROBLEMS,
default 150). A run that the time budget cuts short must still reach a quarter of its count.
"""

import math
import os
import random
import time

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from conftest import HAS_GPU, conv_ref, conv_transpose_ref, fused_mode, rel_error

ops = torch.ops.patchgemm

SEED = int(os.environ.get("PATCHGEMM_FUZZ_SEED", "20261124"))
GPU_PROBLEMS = int(os.environ.get("PATCHGEMM_FUZZ_PROBLEMS", "800"))
CPU_PROBLEMS = int(os.environ.get("PATCHGEMM_FUZZ_CPU_PROBLEMS", "150"))
SECONDS = float(os.environ.get("PATCHGEMM_FUZZ_SECONDS", "45"))

# Relative error allowed against float64, per dtype. 16-bit: an output rounding (~2e-3 bf16, ~3e-4
# fp16) and fp32 accumulation; fp32 (IEEE, TF32 off by the conftest fixture): sums of up to 10^6
# terms. A dropped sixteenth-thousandth of a reduction (a lost K tile of 8 in 21,512) is ~2e-2.
TOL = {torch.float64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 1.2e-2, torch.float16: 2.5e-3}

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def test_references_are_the_convs():
    torch.manual_seed(0)
    for shape, kernel in [((2, 3, 12), (4,)), ((2, 3, 6, 10), (3, 5)), ((1, 2, 4, 6, 8), (2, 3, 4))]:
        x = torch.randn(shape, dtype=torch.float64)
        w = torch.randn(5, shape[1], *kernel, dtype=torch.float64)
        b = torch.randn(5, dtype=torch.float64)
        y = CONV[len(kernel)](x, w, b, stride=kernel)
        torch.testing.assert_close(conv_ref(x, w, b, kernel), y)
        wt = torch.randn(5, shape[1], *kernel, dtype=torch.float64)
        bt = torch.randn(shape[1], dtype=torch.float64)
        torch.testing.assert_close(conv_transpose_ref(y, wt, bt, kernel), CONV_T[len(kernel)](y, wt, bt, stride=kernel))
FUSED_MODES = ("auto", "never", "always")


def randn64(rng, device, dtype, *shape):
    """Random values representable in `dtype`, as float64 on the CPU: the reference sees exactly the
    op's inputs (else a sum that cancels, e.g. a bias gradient over two tokens, differs by the inputs'
    rounding). Drawn on `device` (the CPU's generator would take most of a GPU run's time)."""
    g = torch.Generator(device=device).manual_seed(rng.getrandbits(63))
    return torch.randn(*shape, device=device, generator=g).to(dtype).double().cpu()


def dtypes_for(device):
    return [torch.bfloat16, torch.float16, torch.float32] if device == "cuda" else [
        torch.float32, torch.bfloat16, torch.float64]


def with_layout(x, kind):
    """x (on its device) with the given strides, same values."""
    if kind == "channels_last" and x.dim() in (4, 5):
        return x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    if kind == "strided":  # every other element of the last dim: no unit stride there
        big = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        big[..., ::2] = x
        return big[..., ::2]
    return x


def check(failures, what, dtype, pairs):
    for name, out, ref in pairs:
        err = rel_error(out, ref)
        if not err <= TOL[dtype]:
            failures.append(f"{what}: {name} relative error {err:.3g} > {TOL[dtype]:g}")
            return


# ---- problem generators: a dict of shapes and choices ----------------------------------------------

def patch_problem(rng, device, transposed):
    rank = rng.choice([1, 2, 2, 3])
    large_k = rng.random() < 0.15
    if large_k:  # long patches, few of them: K in the tens of thousands
        channels = rng.choice([96, 192, 193, 384])
        kernel = [rng.choice([4, 7, 8, 14, 16, 32]) for _ in range(rank)]
        while math.prod(kernel) * channels > 400_000:
            kernel[rng.randrange(rank)] //= 2
        kernel = [max(k, 1) for k in kernel]
        grid = [rng.randint(1, 4) for _ in range(rank)]
        embed = rng.choice([8, 33, 256, 512])
        batch = rng.choice([1, 1, 2])
    else:
        channels = rng.choice([1, 2, 3, 4, 5, 7, 16, 24, 64, 96])
        kernel = [rng.choice([1, 2, 3, 4, 5, 7, 8, 14, 16]) for _ in range(rank)]
        grid = [rng.randint(1, 12 if rank < 3 else 5) for _ in range(rank)]
        if rank == 1:
            grid[0] = rng.randint(1, 300)
        embed = rng.choice([1, 3, 5, 8, 16, 32, 64, 77, 96, 192, 257, 768])
        batch = rng.choice([1, 1, 2, 3, 5, 17])
    # The float64 reference runs on the CPU: keep its multiply-adds (B * N * E * K) and the volume
    # (B * C * prod(grid * k)) in budget.
    flops, volume = (6e8, 4e6) if device == "cuda" else (1e8, 1e6)
    while (batch * math.prod(grid) * embed * channels * math.prod(kernel) > flops or
           batch * channels * math.prod(grid) * math.prod(kernel) > volume):
        if embed > 8 and batch * math.prod(grid) * embed * channels * math.prod(kernel) > flops:
            embed //= 2
        elif math.prod(grid) > 1:
            grid = [max(1, g // 2) for g in grid]
        elif batch > 1:
            batch //= 2
        else:
            kernel = [max(1, k // 2) for k in kernel]
    dtype = rng.choice(dtypes_for(device))
    tokens = rng.random() < 0.4
    layout = rng.choice(["contiguous", "contiguous", "channels_last", "strided"])
    if transposed and layout == "channels_last" and tokens:
        layout = "contiguous"
    return dict(rank=rank, channels=channels, kernel=kernel, grid=grid, embed=embed, batch=batch,
                dtype=dtype, tokens=tokens, layout=layout, bias=rng.random() < 0.8,
                fused=rng.choice(FUSED_MODES) if device == "cuda" else "auto")


def run_patch_embed(rng, device, p, failures, what):
    dtype, kernel = p["dtype"], p["kernel"]
    spatial = [g * k for g, k in zip(p["grid"], kernel)]
    x64 = randn64(rng, device, dtype, p["batch"], p["channels"], *spatial)
    w64 = (randn64(rng, device, dtype, p["embed"], p["channels"], *kernel) / math.sqrt(p["channels"] * math.prod(kernel))).to(dtype).double()
    b64 = randn64(rng, device, dtype, p["embed"]) if p["bias"] else None
    leaves = [t.requires_grad_() for t in (x64, w64, b64) if t is not None]
    ref = conv_ref(x64, w64, b64, kernel)
    gy64 = randn64(rng, device, dtype, *ref.shape)
    ref_grads = torch.autograd.grad(ref, leaves, gy64)

    x = with_layout(x64.detach().to(device, dtype), p["layout"]).requires_grad_()
    w = w64.detach().to(device, dtype).requires_grad_()
    b = b64.detach().to(device, dtype).requires_grad_() if b64 is not None else None
    fmt = "tokens" if p["tokens"] else "channels_first"
    y = patchgemm.patch_embed(x, w, b, out_format=fmt)
    gy = gy64.to(device, dtype)
    if p["tokens"]:
        ref, gy = ref.flatten(2).transpose(1, 2), gy.flatten(2).transpose(1, 2)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], gy)
    names = ["y", "grad_x", "grad_weight", "grad_bias"]
    check(failures, what, dtype, zip(names, (y, *grads), (ref, *ref_grads)))


def run_patch_unembed(rng, device, p, failures, what):
    dtype, kernel = p["dtype"], p["kernel"]
    c_in, c_out = p["embed"], p["channels"]
    x64 = randn64(rng, device, dtype, p["batch"], c_in, *p["grid"])
    w64 = (randn64(rng, device, dtype, c_in, c_out, *kernel) / math.sqrt(c_in)).to(dtype).double()
    b64 = randn64(rng, device, dtype, c_out) if p["bias"] else None
    leaves = [t.requires_grad_() for t in (x64, w64, b64) if t is not None]
    ref = conv_transpose_ref(x64, w64, b64, kernel)
    gy64 = randn64(rng, device, dtype, *ref.shape)
    ref_grads = list(torch.autograd.grad(ref, leaves, gy64))

    x_cf = x64.detach().to(device, dtype)
    if p["tokens"]:
        x = with_layout(x_cf.flatten(2).transpose(1, 2).contiguous(), p["layout"]).requires_grad_()
        ref_grads[0] = ref_grads[0].flatten(2).transpose(1, 2)
    else:
        x = with_layout(x_cf, p["layout"]).requires_grad_()
    w = w64.detach().to(device, dtype).requires_grad_()
    b = b64.detach().to(device, dtype).requires_grad_() if b64 is not None else None
    fmt = "tokens" if p["tokens"] else "channels_first"
    y = patchgemm.patch_unembed(x, w, b, in_format=fmt, grid=p["grid"] if p["tokens"] else None)
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], gy64.to(device, dtype))
    names = ["y", "grad_x", "grad_weight", "grad_bias"]
    check(failures, what, dtype, zip(names, (y, *grads), (ref, *ref_grads)))


def grouped_problem(rng, device):
    features = [1, 3, 8, 17, 32, 64, 77, 100, 128, 333, 512]
    if rng.random() < 0.15:  # long reductions for the weight gradient: B of every remainder
        batch = rng.randint(2_000, 40_000)
        groups, d_in, d_out = rng.choice([1, 2, 3]), rng.choice([8, 24, 64]), rng.choice([8, 24, 64])
    else:
        batch = rng.choice([1, 2, 5, 8, 37, 128, 1000, rng.randint(1, 3000)])
        groups, d_in, d_out = rng.choice([1, 2, 3, 4, 12, 64]), rng.choice(features), rng.choice(features)
    while batch * groups * max(d_in, d_out) > (4_000_000 if device == "cuda" else 500_000):
        batch = max(1, batch // 2)
    return dict(batch=batch, groups=groups, d_in=d_in, d_out=d_out, dtype=rng.choice(dtypes_for(device)),
                layout=rng.choice(["bgd", "gbd"]), strided=rng.random() < 0.2, bias=rng.random() < 0.7)


def run_grouped_linear(rng, device, p, failures, what):
    dtype, B, G = p["dtype"], p["batch"], p["groups"]
    x64 = randn64(rng, device, dtype, B, G, p["d_in"])
    w64 = (randn64(rng, device, dtype, G, p["d_out"], p["d_in"]) / math.sqrt(max(p["d_in"], 1))).to(dtype).double()
    b64 = randn64(rng, device, dtype, G, p["d_out"]) if p["bias"] else None
    leaves = [t.requires_grad_() for t in (x64, w64, b64) if t is not None]
    ref = torch.einsum("bgi,goi->bgo", x64, w64) + (b64 if b64 is not None else 0)
    gy64 = randn64(rng, device, dtype, *ref.shape)
    ref_grads = list(torch.autograd.grad(ref, leaves, gy64))

    x_bgd = x64.detach().to(device, dtype)
    gy = gy64.to(device, dtype)
    if p["layout"] == "gbd":
        x_bgd, gy = x_bgd.transpose(0, 1).contiguous(), gy.transpose(0, 1).contiguous()
        ref, ref_grads[0] = ref.transpose(0, 1), ref_grads[0].transpose(0, 1)
    x = (with_layout(x_bgd, "strided") if p["strided"] else x_bgd).requires_grad_()
    w = w64.detach().to(device, dtype).requires_grad_()
    b = b64.detach().to(device, dtype).requires_grad_() if b64 is not None else None
    y = patchgemm.grouped_linear(x, w, b, p["layout"])
    grads = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], gy)
    names = ["y", "grad_x", "grad_weight", "grad_bias"]
    check(failures, what, dtype, zip(names, (y, *grads), (ref, *ref_grads)))


OPS = {
    "patch_embed": (lambda rng, dev: patch_problem(rng, dev, False), run_patch_embed),
    "patch_unembed": (lambda rng, dev: patch_problem(rng, dev, True), run_patch_unembed),
    "grouped_linear": (grouped_problem, run_grouped_linear),
}


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if HAS_GPU else []))
@pytest.mark.parametrize("op", list(OPS))
def test_fuzz(op, device):
    make, run = OPS[op]
    count = GPU_PROBLEMS if device == "cuda" else CPU_PROBLEMS
    failures, done, start = [], 0, time.monotonic()
    for i in range(count):
        if time.monotonic() - start > SECONDS:
            break
        rng = random.Random(f"{SEED}/{op}/{i}")
        problem = make(rng, device)
        mode = problem.pop("fused", "auto")
        what = f"{op} #{i} (PATCHGEMM_FUZZ_SEED={SEED}, fused kernels {mode!r}) {problem}"
        try:
            with fused_mode(mode):
                run(rng, device, problem, failures, what)
        except Exception as e:  # an error on a valid problem is a failure too
            failures.append(f"{what}: raised {type(e).__name__}: {e}")
        done += 1
    print(f"{op} on {device}: {done} problems in {time.monotonic() - start:.1f} s, {len(failures)} failed")
    assert not failures, f"{len(failures)} of {done} problems failed:\n" + "\n".join(failures[:20])
    assert done >= max(1, count // 4), f"only {done} of {count} problems ran within {SECONDS} s"
