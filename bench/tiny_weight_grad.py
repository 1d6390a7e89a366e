"""The fused weight gradient for tiny patches (csrc/kernels/patch/sm80/tiny_patch_weight_grad.cu) against gather +
cuBLAS, same process and inputs: patch_weight_grad with the fused kernels on ("auto") and off
("never"), GPU time, and the bandwidth the fused kernel reaches ((grad_y + x bytes) / time).

    python bench/tiny_weight_grad.py          (CUDA, bf16)
"""

import torch

import patchgemm  # noqa: F401  (registers the ops)
from patchgemm.bench import time_ms

# (name, x shape, E): kernel 2 along every dim. The first is P3's weight gradient and U2's (the
# transpose's, with x and grad_y swapped).
CASES = [("P3/U2 dW", (8, 4, 128, 128, 128), 192), ("E96", (8, 4, 128, 128, 128), 96),
         ("K64 E256", (4, 8, 128, 128, 128), 256), ("2-D K12", (64, 3, 224, 224), 192)]


def median_ms(fn):
    return time_ms(lambda i: fn(), torch.device("cuda"), warmup=3, reps=20).ms


def main():
    ops = torch.ops.patchgemm
    print(f"{'case':9} {'grad_y':15} {'bias':5} {'fused ms':>9} {'GB/s':>6} {'gather+GEMM ms':>14} {'ratio':>6}")
    for name, shape, embed in CASES:
        kernel = [2] * (len(shape) - 2)
        x = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(embed, shape[1], *kernel, dtype=torch.bfloat16, device="cuda")
        for fmt in ("channels_first", "tokens"):
            dy = torch.randn_like(patchgemm.patch_embed(x, w, out_format=fmt))
            for bias in (True, False):
                def run():
                    return ops.patch_weight_grad(dy, x, kernel, fmt == "tokens", [], bias)
                fused = median_ms(run)
                with patchgemm.force(patch_weight_grad="gather_gemm"):
                    gathered = median_ms(run)
                gbytes = (dy.numel() + x.numel()) * dy.element_size() / 1e9
                print(f"{name:9} {fmt:15} {bias!s:5} {fused:9.4f} {gbytes / fused * 1e3:6.0f} {gathered:14.4f} "
                      f"{gathered / fused:6.2f}", flush=True)


if __name__ == "__main__":
    main()
