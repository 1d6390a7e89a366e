"""Shared by the patch ops' tests: the convolutions they are checked against, inputs in a given
memory layout, and their makers."""

import math

import torch
import torch.nn.functional as F

from conftest import randn

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}

# (x shape, kernel): 1-D/2-D/3-D, k = 1, k = the whole input, non-cubic patches, odd sizes.
SHAPES = [
    ((2, 3, 12), (4,)),
    ((2, 3, 15), (5,)),
    ((2, 3, 8, 12), (2, 4)),
    ((3, 5, 7, 9), (7, 3)),
    ((2, 3, 32, 48), (16, 16)),
    ((2, 4, 4, 6, 8), (2, 3, 2)),
    ((3, 3, 2, 28, 14), (2, 14, 14)),
    ((2, 3, 2, 14, 14), (2, 14, 14)),  # one patch per sample (Qwen2-VL style: no gather)
    ((2, 6, 3, 5, 7), (1, 1, 1)),
    ((1, 4, 8, 8, 8), (2, 2, 2)),
]


def layout(x, kind):
    """x with the given memory layout (same values)."""
    if kind == "contiguous":
        return x
    if kind == "channels_last":
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
        return x.to(memory_format=fmt) if fmt else x.transpose(1, 2).contiguous().transpose(1, 2)
    if kind == "every_other":  # no unit stride anywhere: copied once
        big = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        big[..., ::2] = x
        return big[..., ::2]
    raise AssertionError(kind)


def conv_tokens(y):
    return y.flatten(2).transpose(1, 2)


def make(shape, kernel, dtype, device, embed=5, bias=True):
    x = randn(*shape, dtype=dtype, device=device)
    w = randn(embed, shape[1], *kernel, dtype=dtype, device=device) / math.sqrt(shape[1] * math.prod(kernel))
    b = randn(embed, dtype=dtype, device=device) if bias else None
    return x, w, b


def grads(out, inputs, grad_out):
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return torch.autograd.grad(out, wanted, grad_out)


def cuda_kernels_run(fn):
    """Names of the CUDA kernels fn launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(e.name for e in prof.events())


def cropped(x):
    """x as a view into a larger tensor (w still contiguous, other strides and offset aligned)."""
    big = torch.zeros(x.shape[0], x.shape[1] + 1, *x.shape[2:-1], x.shape[-1], dtype=x.dtype, device=x.device)
    big[:, 1:] = x
    return big[:, 1:]
