"""Loads the compiled library and registers the one thing the dispatcher needs from Python: a fake
(meta) kernel for every op, so torch.compile / torch.export trace them. Autograd is registered in
C++ (csrc/ops/autograd.cpp), and its backward calls registered ops, so a compiled backward traces too."""

import glob
import math
import os

import torch
from torch._prims_common import suggest_memory_format


def _why_the_library_did_not_load(error: ImportError) -> str:
    """What to do about a failed import of patchgemm._C: not built, built against another torch, or
    the loader's own error."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from ._built_with import TORCH as built_with
    except ImportError:
        built_with = None
    rebuild = ("rebuild it: `pip install --no-build-isolation -e .` in the checkout (or reinstall the package "
               "with `--no-build-isolation --force-reinstall --no-deps`)")
    if built_with is not None and built_with != torch.__version__:
        return (f"patchgemm: the compiled library patchgemm._C was built against torch {built_with}, but torch "
                f"{torch.__version__} is installed; {rebuild}")
    if not glob.glob(os.path.join(here, "_C.*")):
        return (f"patchgemm: the compiled library patchgemm._C is not built in {here}. Install with "
                f"`pip install --no-build-isolation -e .` (editable: this source tree then finds it), or, after a "
                f"plain `pip install .`, run from outside the source tree")
    if "undefined symbol" in str(error):
        return f"patchgemm: patchgemm._C does not match torch {torch.__version__} ({error}); {rebuild}"
    return f"patchgemm: patchgemm._C failed to load: {error}"


try:
    from . import _C  # noqa: F401  (loading it runs the C++ TORCH_LIBRARY registrations)
except ImportError as e:
    raise ImportError(_why_the_library_did_not_load(e)) from e

ops = torch.ops.patchgemm


def group_dim(group_major: bool) -> int:
    """The group dim of a 3-D activation in the given layout."""
    return 0 if group_major else 1


# ---- fake kernels: exact output shapes and strides -----------------------------------------------

def _fake(name: str):
    """Registers the function as patchgemm::<name>'s fake (meta) kernel, behind one check: no meta
    tensor among real floating-point ones. The dispatcher runs the fake kernel for any call with a
    meta tensor in it, and for a real x its output would be uninitialized memory on x's device; the
    real kernels refuse mixed devices themselves (csrc/ops/checks.h). Integer tensors may stay real
    under meta data: ragged groups' offsets live on the host."""
    def register(fn):
        arguments = [a.name for a in getattr(ops, name).default._schema.arguments]

        def checked(*args, **kwargs):
            named = {**dict(zip(arguments, args)), **kwargs}
            tensors = {k: v for k, v in named.items() if isinstance(v, torch.Tensor)}
            meta = [k for k, v in tensors.items() if v.device.type == "meta"]
            real = [k for k, v in tensors.items() if v.device.type != "meta" and v.is_floating_point()]
            if meta and real:
                raise RuntimeError(f"{name}: {meta[0]} is on meta but {real[0]} is on {tensors[real[0]].device}: "
                                   "move every tensor to one device")
            return fn(*args, **kwargs)

        torch.library.register_fake(f"patchgemm::{name}")(checked)
        return fn
    return register


@_fake("grouped_linear")
def _(x, weight, bias, group_major):
    torch._check(x.dim() == 3 and weight.dim() == 3, lambda: "grouped_linear: x and weight must be 3-D")
    g = group_dim(group_major)
    torch._check(x.shape[g] == weight.shape[0], lambda: "grouped_linear: group count mismatch")
    torch._check(x.shape[2] == weight.shape[2], lambda: "grouped_linear: Din mismatch")
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[1]))


@_fake("grouped_linear_grad_input")
def _(grad_y, weight, group_major):
    torch._check(grad_y.shape[2] == weight.shape[1], lambda: "grouped_linear_grad_input: Dout mismatch")
    return grad_y.new_empty((grad_y.shape[0], grad_y.shape[1], weight.shape[2]))


@_fake("grouped_linear_grad_weight")
def _(grad_y, x, group_major):
    g = group_dim(group_major)
    return x.new_empty((x.shape[g], grad_y.shape[2], x.shape[2]))


@_fake("ragged_grouped_linear")
def _(x, weight, bias, offsets):
    torch._check(x.dim() == 2 and weight.dim() == 3, lambda: "ragged_grouped_linear: x must be 2-D, weight 3-D")
    torch._check(x.shape[1] == weight.shape[2], lambda: "ragged_grouped_linear: Din mismatch")
    return x.new_empty((x.shape[0], weight.shape[1]))


@_fake("ragged_grouped_linear_grad_input")
def _(grad_y, weight, offsets):
    return grad_y.new_empty((grad_y.shape[0], weight.shape[2]))


@_fake("ragged_grouped_linear_grad_weight")
def _(grad_y, x, offsets):
    return x.new_empty((offsets.shape[0], grad_y.shape[1], x.shape[1]))


@_fake("grouped_pointwise_conv")
def _(x, weight, bias, groups):
    torch._check(x.dim() == weight.dim() and x.shape[1] == groups * weight.shape[1],
                 lambda: "grouped_pointwise_conv: x and weight do not match")
    return _channels_first_output(x, (x.shape[0], weight.shape[0], *x.shape[2:]))


@_fake("grouped_pointwise_conv_grad_input")
def _(grad_y, weight, groups):
    return _channels_first_output(grad_y, (grad_y.shape[0], groups * weight.shape[1], *grad_y.shape[2:]))


@_fake("grouped_pointwise_conv_grad_weight")
def _(grad_y, x, groups, with_bias=False):
    return (x.new_empty((grad_y.shape[1], x.shape[1] // groups, *(1,) * (x.dim() - 2))),
            x.new_empty((grad_y.shape[1],) if with_bias else (0,)))


@_fake("swiglu")
def _(gate_up):
    torch._check(gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0, lambda: "swiglu: gate_up must be [..., 2H]")
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@_fake("swiglu_backward")
def _(grad_h, gate_up):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


# ---- patch embedding: fake kernels ----------------------------------------------------------------

@_fake("patch_matrix")
def _(x, kernel_size):
    rank = len(kernel_size)
    torch._check(x.dim() == rank + 2, lambda: f"patch_matrix: x must have {rank} spatial dims, got {tuple(x.shape)}")
    tokens = math.prod(s // k for s, k in zip(x.shape[2:], kernel_size))
    return x.new_empty((x.shape[0] * tokens, x.shape[1] * math.prod(kernel_size)))


@_fake("patch_matrix_backward")
def _(grad, x_shape, kernel_size):
    return grad.new_empty(tuple(x_shape))


def _level_grid(levels, rank):
    """The grid that flattened `levels` (groups of `rank` sizes; None: none) multiply to, per dim."""
    grid = [1] * rank
    for i, size in enumerate(levels or []):
        grid[i % rank] *= size
    return grid


def _channels_first_output(x, shape):
    """A channels-first output or weight gradient takes the memory format a non-empty x suggests
    (channels_last(_3d) or contiguous), as PyTorch's convolutions do (csrc/ops/checks.h:
    lies_channels_last)."""
    fmt = suggest_memory_format(x) if x.numel() > 0 else torch.contiguous_format
    return torch.empty(shape, dtype=x.dtype, device=x.device, memory_format=fmt)


@_fake("patch_embed")
def _(x, weight, bias, tokens, levels):
    kernel = weight.shape[2:]
    torch._check(x.dim() == weight.dim(), lambda: "patch_embed: x and weight ranks differ")
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    if tokens:
        return x.new_empty((x.shape[0], math.prod(grid), weight.shape[0]))
    return _channels_first_output(x, (x.shape[0], weight.shape[0], *grid))


@_fake("patch_unembed")
def _(x, weight, bias, tokens, levels):
    kernel = weight.shape[2:]
    grid = _level_grid(levels, len(kernel)) if tokens else x.shape[2:]
    shape = (x.shape[0], weight.shape[1], *[g * k for g, k in zip(grid, kernel)])
    return x.new_empty(shape) if tokens else _channels_first_output(x, shape)


@_fake("patch_weight_grad")
def _(grad_y, x, kernel_size, tokens, levels, with_bias, transposed=False):
    embed = grad_y.shape[-1] if tokens else grad_y.shape[1]
    return (_channels_first_output(x, (embed, x.shape[1], *kernel_size)),
            x.new_empty(((x.shape[1] if transposed else embed),) if with_bias else (0,)))


# ---- instance norm + activation: fake kernels -----------------------------------------------------

def _norm_stats_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@_fake("instance_norm_act")
def _(x, weight, bias, eps, gelu, tokens):
    channels = x.shape[2] if tokens else x.shape[1]
    stats = x.new_empty((x.shape[0], channels), dtype=_norm_stats_dtype(x))
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@_fake("instance_norm_act_backward")
def _(grad_y, x, weight, bias, mean, rstd, gelu, tokens):
    channels = x.shape[2] if tokens else x.shape[1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((channels,) if weight is not None else (0,)),
            x.new_empty((channels,) if bias is not None else (0,)))


# ---- FP8: fake kernels -----------------------------------------------------------------------------

@_fake("quantize_fp8")
def _(x, format, rowwise=True, transposed=False, column_sums=False, amax_state=None):
    swapped = (*x.shape[:-2], x.shape[-1], x.shape[-2]) if transposed else (0,)
    return (x.new_empty(x.shape if rowwise else (0,), dtype=format), x.new_empty(swapped, dtype=format),
            x.new_empty((), dtype=torch.float32), x.new_empty((*x.shape[:-2], x.shape[-1]) if column_sums else (0,)))


@_fake("scaled_grouped_mm")
def _(a, b, scale_a, scale_b, bias, group_major, out_dtype, fast_accum=False):
    torch._check(a.dim() == 3 and b.dim() == 3, lambda: "scaled_grouped_mm: a and b must be 3-D")
    torch._check(a.shape[group_dim(group_major)] == b.shape[0] and a.shape[2] == b.shape[2],
                 lambda: "scaled_grouped_mm: a and b must agree in G and K")
    return a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=out_dtype)


@_fake("scaled_ragged_mm")
def _(a, b, scale_a, scale_b, bias, offsets, out_dtype, fast_accum=False):
    torch._check(a.dim() == 2 and b.dim() == 3, lambda: "scaled_ragged_mm: a must be 2-D, b 3-D")
    torch._check(a.shape[1] == b.shape[2], lambda: "scaled_ragged_mm: a and b must agree in K")
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)
