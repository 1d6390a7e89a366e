"""patch_embed's forward through the implicit-GEMM kernel vs gather + cuBLAS, same process and inputs
(the table behind the kernel's selection rule; see csrc/cuda/implicit_patch_gemm.cu).

    python bench/implicit_vs_gather.py          (CUDA, bf16, with bias)
"""

import math

import torch

import patchgemm

CASES = [("P1", (128, 3, 224, 224), (16, 16), 768), ("P4", (8, 192, 64, 64, 64), (2, 2, 2), 192),
         ("P5", (8, 192, 32, 32, 32), (4, 4, 4), 768), ("P4 E384", (4, 192, 64, 64, 64), (2, 2, 2), 384),
         ("P4 E96", (4, 192, 64, 64, 64), (2, 2, 2), 96), ("P5 E192", (8, 192, 32, 32, 32), (4, 4, 4), 192),
         ("C96 E384", (8, 96, 64, 64, 64), (2, 2, 2), 384), ("2D k2", (64, 64, 112, 112), (2, 2), 128),
         ("ViT-L/14", (64, 3, 224, 224), (14, 14), 1024), ("P5 E1536", (8, 192, 32, 32, 32), (4, 4, 4), 1536)]


def median_ms(fn, runs=20):
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[runs // 2]


def main():
    mode = torch.ops.patchgemm._set_fused_patch_kernels
    print(f"{'case':10} {'format':15} {'implicit ms':>11} {'gather+GEMM ms':>14} {'ratio':>6} {'implicit TF/s':>13}")
    for name, shape, kernel, embed in CASES:
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(embed, shape[1], *kernel, dtype=torch.bfloat16, device="cuda") / math.sqrt(
            shape[1] * math.prod(kernel))
        b = torch.randn(embed, dtype=torch.bfloat16, device="cuda")
        for fmt in ("channels_first", "tokens"):
            def run():
                return patchgemm.patch_embed(x, w, b, out_format=fmt)

            old = mode("always")
            try:
                implicit = median_ms(run)
                mode("never")
                gathered = median_ms(run)
            finally:
                mode(old)
            tflops = 2 * x.numel() * embed / implicit / 1e9
            print(f"{name:10} {fmt:15} {implicit:11.4f} {gathered:14.4f} {gathered / implicit:6.2f} {tflops:13.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
