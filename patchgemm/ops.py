"""Loads the compiled library and registers what the dispatcher needs from Python: a fake (meta)
kernel for every op (so torch.compile / torch.export trace them) and autograd, whose backward
calls other registered ops (so compiled backward traces too)."""

import torch

try:
    from . import _C  # noqa: F401  (loading it runs the C++ TORCH_LIBRARY registrations)
except ImportError as e:
    raise ImportError(
        "patchgemm: the compiled library patchgemm._C is missing. Build it with "
        "`pip install --no-build-isolation .` (or `-e .` for development); if it is installed, you "
        "are importing the source tree instead: run from another directory."
    ) from e

ops = torch.ops.patchgemm


def _layout_dims(group_major: bool):
    """(group dim, batch dim) of a 3-D activation in the given layout."""
    return (0, 1) if group_major else (1, 0)


# ---- fake kernels: exact output shapes (outputs are contiguous) ----------------------------------

@torch.library.register_fake("patchgemm::grouped_linear")
def _(x, weight, bias, group_major):
    torch._check(x.dim() == 3 and weight.dim() == 3, lambda: "grouped_linear: x and weight must be 3-D")
    g, _ = _layout_dims(group_major)
    torch._check(x.shape[g] == weight.shape[0], lambda: "grouped_linear: group count mismatch")
    torch._check(x.shape[2] == weight.shape[2], lambda: "grouped_linear: Din mismatch")
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[1]))


@torch.library.register_fake("patchgemm::grouped_linear_grad_input")
def _(grad_y, weight, group_major):
    torch._check(grad_y.shape[2] == weight.shape[1], lambda: "grouped_linear_grad_input: Dout mismatch")
    return grad_y.new_empty((grad_y.shape[0], grad_y.shape[1], weight.shape[2]))


@torch.library.register_fake("patchgemm::grouped_linear_grad_weight")
def _(grad_y, x, group_major):
    g, _ = _layout_dims(group_major)
    return x.new_empty((x.shape[g], grad_y.shape[2], x.shape[2]))


# ---- autograd -------------------------------------------------------------------------------------

def _grouped_linear_setup_context(ctx, inputs, output):
    x, weight, bias, group_major = inputs
    # Keep only what backward will read: x for dW, weight for dx (no copies: these are the inputs).
    ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                          weight if ctx.needs_input_grad[0] else None)
    ctx.group_major = group_major


def _grouped_linear_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = ops.grouped_linear_grad_input(grad_y, weight, ctx.group_major)
    if ctx.needs_input_grad[1]:
        grad_w = ops.grouped_linear_grad_weight(grad_y, x, ctx.group_major)
    if ctx.needs_input_grad[2]:
        grad_b = grad_y.sum(dim=_layout_dims(ctx.group_major)[1])
    return grad_x, grad_w, grad_b, None


torch.library.register_autograd(
    "patchgemm::grouped_linear", _grouped_linear_backward, setup_context=_grouped_linear_setup_context
)

