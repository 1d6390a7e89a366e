"""instance_norm_act against F.gelu(F.instance_norm(...)) on H1's stem activations (bf16, CUDA):
CUDA-event medians of fwd and fwd+bwd, and the peak memory one fwd+bwd allocates.

    python bench/instance_norm_act.py
"""

import torch
import torch.nn.functional as F

import patchgemm
from patchgemm.bench import time_ms


def main():
    dev = torch.device("cuda")
    for shape in [(8, 192, 64, 64, 64), (8, 192, 32, 32, 32)]:
        x = torch.randn(shape, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(shape[1], device=dev, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(shape[1], device=dev, dtype=torch.bfloat16, requires_grad=True)
        tokens = x.detach().flatten(2).transpose(1, 2).contiguous().requires_grad_()
        dy = torch.randn_like(x)
        impls = {
            "F.gelu(F.instance_norm)": (lambda: F.gelu(F.instance_norm(x, weight=w, bias=b)), x, dy),
            "instance_norm_act": (lambda: patchgemm.instance_norm_act(x, w, b), x, dy),
            "instance_norm_act tokens": (lambda: patchgemm.instance_norm_act(tokens, w, b, layout="tokens"),
                                         tokens, dy.flatten(2).transpose(1, 2).contiguous()),
        }
        for name, (f, inp, grad) in impls.items():
            with torch.no_grad():
                fwd = time_ms(lambda i: f(), dev).ms
            fwd_bwd = time_ms(lambda i: torch.autograd.grad(f(), [inp, w, b], grad), dev).ms
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            torch.autograd.grad(f(), [inp, w, b], grad)
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            print(f"{str(list(shape)):22s} {name:26s} fwd {fwd:7.3f} ms  fwd+bwd {fwd_bwd:7.3f} ms  peak {peak:6.0f} MB")


if __name__ == "__main__":
    main()
