"""The implicit-GEMM kernels vs gather/scatter + cuBLAS, same process and inputs: patch_embed's
forward (csrc/kernels/patch/sm80/implicit_patch_gemm.cu), its weight gradient (implicit_patch_weight_grad.cu,
kw = 2; implicit_patch_weight_grad_sm90.cu, kw % 4 == 0 on a 9.0 GPU) and patch_unembed, which is
also its input gradient (implicit_patch_unembed.cu, kw = 2). The tables behind their selection rule (csrc/kernels/primitives/implicit_patch.cuh). The forward and the
unembedding also time their mma.sync kernels where the wgmma ones (*_sm90.cu) run.

    python bench/implicit_vs_gather.py          (CUDA, bf16, with bias)
"""

import math

import torch

import patchgemm
from patchgemm.bench import time_ms

CASES = [("P1", (128, 3, 224, 224), (16, 16), 768), ("P4", (8, 192, 64, 64, 64), (2, 2, 2), 192),
         ("P5", (8, 192, 32, 32, 32), (4, 4, 4), 768), ("P4 E384", (4, 192, 64, 64, 64), (2, 2, 2), 384),
         ("P4 E96", (4, 192, 64, 64, 64), (2, 2, 2), 96), ("P5 E192", (8, 192, 32, 32, 32), (4, 4, 4), 192),
         ("C96 E384", (8, 96, 64, 64, 64), (2, 2, 2), 384), ("2D k2", (64, 64, 112, 112), (2, 2), 128),
         ("ViT-L/14", (64, 3, 224, 224), (14, 14), 1024), ("P5 E1536", (8, 192, 32, 32, 32), (4, 4, 4), 1536)]
# The weight gradient's cases (kw = 2 on mma.sync, kw % 4 == 0 on wgmma); "U2 dW" is U2's (the
# unembed's weight gradient: x is its output gradient [8, 4, 128^3], grad_y its input [8, 192, 64^3]);
# U1's is P5's.
WEIGHT_GRAD_CASES = [c for c in CASES if c[2][-1] == 2 or c[2][-1] % 4 == 0] + [
    ("U2 dW", (8, 4, 128, 128, 128), (2, 2, 2), 192)]
# patch_unembed: the input gradients of the kw = 2 and 4 cases (x = grad_y [B, E, *grid], C_out = C;
# P5's is U1), and U2.
UNEMBED_CASES = [(f"{name} dx", (shape[0], embed, *[s // k for s, k in zip(shape[2:], kernel)]), kernel, shape[1])
                 for name, shape, kernel, embed in CASES if kernel[-1] in (2, 4)] + [
                     ("U2", (8, 192, 64, 64, 64), (2, 2, 2), 4)]


def median_ms(fn, runs=20):
    return time_ms(lambda i: fn(), torch.device("cuda"), warmup=3, reps=runs).ms


def compare(label, run, flops, mma_sync_column=False):
    """Prints the implicit kernel's time, gather/scatter + cuBLAS's, their ratio and the implicit
    TFLOP/s; with mma_sync_column, also the time of the mma.sync kernel (the wgmma one off)."""
    testing = torch.ops.patchgemm._set_selection_testing  # (rules on or off, candidates left out)
    wgmma = ["implicit_rows_sm90", "implicit_pairs_sm90", "implicit_sm90"]
    fused = ["tiny", "implicit_mma"] + wgmma
    try:
        testing(False, [])
        implicit = median_ms(run)
        if mma_sync_column:
            testing(False, wgmma)
            mma_sync = median_ms(run)
        testing(True, fused)
        gathered = median_ms(run)
    finally:
        testing(True, [])
    extra = f" {mma_sync:11.4f}" if mma_sync_column else ""
    print(f"{label} {implicit:11.4f}{extra} {gathered:14.4f} {gathered / implicit:6.2f} "
          f"{flops / implicit / 1e9:13.1f}", flush=True)


def make(shape, kernel, embed):
    x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(embed, shape[1], *kernel, dtype=torch.bfloat16, device="cuda") / math.sqrt(
        shape[1] * math.prod(kernel))
    return x, w, torch.randn(embed, dtype=torch.bfloat16, device="cuda")


def main():
    header = f"{'format':15} {'implicit ms':>11} {'gather+GEMM ms':>14} {'ratio':>6} {'implicit TF/s':>13}"
    wgmma_header = header.replace("implicit ms", "implicit ms mma.sync ms")
    print(f"forward (patch_embed; implicit: the wgmma kernel on a 9.0 GPU)\n{'case':10} {wgmma_header}")
    for name, shape, kernel, embed in CASES:
        x, w, b = make(shape, kernel, embed)
        for fmt in ("channels_first", "tokens"):
            compare(f"{name:10} {fmt:15}", lambda: patchgemm.patch_embed(x, w, b, out_format=fmt),
                    2 * x.numel() * embed, mma_sync_column=True)
    print(f"\nweight gradient (patch_weight_grad, with the bias gradient)\n{'case':10} {header}")
    for name, shape, kernel, embed in WEIGHT_GRAD_CASES:
        x, w, b = make(shape, kernel, embed)
        for fmt in ("channels_first", "tokens"):
            y = patchgemm.patch_embed(x, w, b, out_format=fmt)
            dy = torch.randn_like(y)
            compare(f"{name:10} {fmt:15}",
                    lambda: torch.ops.patchgemm.patch_weight_grad(dy, x, kernel, fmt == "tokens", [], True),
                    2 * x.numel() * embed)
    print(f"\nunembedding (patch_unembed, with bias; implicit: the wgmma kernel on a 9.0 GPU)\n{'case':10} {wgmma_header}")
    for name, shape, kernel, out_channels in UNEMBED_CASES:
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(shape[1], out_channels, *kernel, dtype=torch.bfloat16, device="cuda") / math.sqrt(shape[1])
        b = torch.randn(out_channels, dtype=torch.bfloat16, device="cuda")
        x_tokens = x.flatten(2).transpose(1, 2).contiguous()
        for fmt, inp in (("channels_first", x), ("tokens", x_tokens)):
            compare(f"{name:10} {fmt:15}",
                    lambda: patchgemm.patch_unembed(inp, w, b, in_format=fmt, grid=shape[2:] if fmt == "tokens" else None),
                    2 * x.numel() * out_channels * math.prod(kernel), mma_sync_column=True)


if __name__ == "__main__":
    main()
