"""Loads the compiled library and registers what the dispatcher needs from Python: a fake (meta)
kernel for every op (so torch.compile / torch.export trace them) and autograd, whose backward
calls other registered ops (so compiled backward traces too)."""

import math

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



# ---- patch embedding: fake kernels ----------------------------------------------------------------

def _level_grid(levels, rank):
    """The grid that flattened `levels` (groups of `rank` sizes) multiply to, per dim."""
    grid = [1] * rank
    for i, size in enumerate(levels):
        grid[i % rank] *= size
    return grid


@torch.library.register_fake("patchgemm::patch_embed")
def _(x, weight, bias, tokens, levels):
    kernel = weight.shape[2:]
    torch._check(x.dim() == weight.dim(), lambda: "patch_embed: x and weight ranks differ")
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    if tokens:
        return x.new_empty((x.shape[0], math.prod(grid), weight.shape[0]))
    return x.new_empty((x.shape[0], weight.shape[0], *grid))


@torch.library.register_fake("patchgemm::patch_unembed")
def _(x, weight, bias, tokens, levels):
    kernel = weight.shape[2:]
    grid = _level_grid(levels, len(kernel)) if tokens else x.shape[2:]
    return x.new_empty((x.shape[0], weight.shape[1], *[g * k for g, k in zip(grid, kernel)]))


@torch.library.register_fake("patchgemm::patch_weight_grad")
def _(grad_y, x, kernel_size, tokens, levels, with_bias):
    embed = grad_y.shape[-1] if tokens else grad_y.shape[1]
    return (x.new_empty((embed, x.shape[1], *kernel_size)),
            x.new_empty((embed,) if with_bias else (0,)))


# ---- patch embedding: autograd --------------------------------------------------------------------
# The adjoint of patch_embed is patch_unembed with the same weight, and vice versa; both weight
# gradients are patch_weight_grad, which recomputes the patch matrix from the saved input (an input
# of the op, so saving it costs no memory) instead of keeping it alive.

def _patch_setup_context(ctx, inputs, output):
    x, weight, bias, tokens, levels = inputs
    needs_x, needs_w, needs_b = ctx.needs_input_grad[:3]
    ctx.save_for_backward(x if needs_w or needs_b else None, weight if needs_x else None)
    ctx.tokens, ctx.levels, ctx.has_bias = tokens, list(levels), bias is not None
    ctx.kernel = list(weight.shape[2:])


def _patch_embed_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        levels = ctx.levels
        if ctx.tokens and not levels:  # row-major tokens: one level, the grid
            levels = [s // k for s, k in zip(ctx.x_spatial, ctx.kernel)]
        grad_x = ops.patch_unembed(grad_y, weight, None, ctx.tokens, levels)
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        grad_w, grad_b = ops.patch_weight_grad(grad_y, x, ctx.kernel, ctx.tokens, ctx.levels,
                                               ctx.needs_input_grad[2])
    return grad_x, grad_w, grad_b if ctx.needs_input_grad[2] else None, None, None


def _patch_embed_setup_context(ctx, inputs, output):
    _patch_setup_context(ctx, inputs, output)
    ctx.x_spatial = list(inputs[0].shape[2:])


def _patch_unembed_backward(ctx, grad_y):
    x, weight = ctx.saved_tensors
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_x = ops.patch_embed(grad_y, weight, None, ctx.tokens, ctx.levels)
    if ctx.needs_input_grad[1]:
        grad_w, _ = ops.patch_weight_grad(x, grad_y, ctx.kernel, ctx.tokens, ctx.levels, False)
    if ctx.needs_input_grad[2]:
        grad_b = grad_y.sum(dim=[d for d in range(grad_y.dim()) if d != 1])
    return grad_x, grad_w, grad_b, None, None


torch.library.register_autograd(
    "patchgemm::patch_embed", _patch_embed_backward, setup_context=_patch_embed_setup_context)
torch.library.register_autograd(
    "patchgemm::patch_unembed", _patch_unembed_backward, setup_context=_patch_setup_context)
