"""Run every CUDA code path once on small shapes, for compute-sanitizer:
    compute-sanitizer --tool memcheck python tests/sanitize_smoke.py
(not a pytest module: it asserts only that results are finite; the tests check values)."""

import torch

import patchgemm

ops = torch.ops.patchgemm


def main():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for layout in ("bgd", "gbd"):
            for bias in (True, False):
                shape = (37, 3, 29) if layout == "bgd" else (3, 37, 29)
                x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
                w = torch.randn(3, 19, 29, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(3, 19, dtype=dtype, device="cuda", requires_grad=True) if bias else None
                y = patchgemm.grouped_linear(x, w, b, layout)
                grads = torch.autograd.grad(y, [x, w], torch.randn_like(y))
                assert all(torch.isfinite(t).all() for t in (y, *grads))
    # splitting at a lowered BLAS integer limit
    old = ops._set_blas_int_limit(6)
    x = torch.randn(9, 2, 3, device="cuda", requires_grad=True)
    w = torch.randn(2, 3, 3, device="cuda", requires_grad=True)
    y = patchgemm.grouped_linear(x, w, torch.randn(2, 3, device="cuda"))
    torch.autograd.grad(y, [x, w], torch.ones_like(y))
    ops._set_blas_int_limit(old)
    torch.cuda.synchronize()
    print("sanitize_smoke: ok")


if __name__ == "__main__":
    main()
