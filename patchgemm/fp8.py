"""FP8 grouped linears: each GEMM's operands quantized on the fly, one FP8 strided-batched GEMM per pass.

The recipe is the usual "current scaling" one (TransformerEngine's ``Float8CurrentScaling``,
torchao's tensorwise ``Float8LinearConfig``): every call computes one scale per tensor from the
tensor's own amax, so no history is kept and nothing needs calibrating. The forward quantizes ``x``
and the weight to e4m3; the backward quantizes the output gradient to e5m2 (the "hybrid" formats),
reuses the saved FP8 ``x`` and weight, and writes ``grad_x`` and ``grad_weight`` in the inputs' own
dtypes (fp32 master weights get fp32 gradients). The output and the bias stay in the compute dtype.

Turn it on per module (``GroupedLinear(..., fp8=True)``), per call (``grouped_linear(..., fp8=True)``),
or for a region (``with patchgemm.fp8_autocast(): ...``), which reaches every grouped linear and
grouped MLP inside that was not told otherwise. Ragged (mixture-of-experts) groups run in their
usual precision there; asking them for FP8 directly is an error.
"""

import contextlib
import dataclasses
from typing import Optional, Union

import torch

from .ops import ops

__all__ = ["Float8Recipe", "fp8_autocast"]

_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How a grouped linear runs in FP8.

    Attributes:
        forward_format: the format of ``x`` and the weight (``torch.float8_e4m3fn``).
        backward_format: the format of the output's gradient: ``torch.float8_e5m2`` (the hybrid
            recipe: gradients need range more than precision) or ``torch.float8_e4m3fn``.
        fast_accumulation: Hopper's faster FP8 accumulation in the forward GEMM, as torchao and
            TransformerEngine use there; the gradients' GEMMs always accumulate in full fp32.
    """

    forward_format: torch.dtype = torch.float8_e4m3fn
    backward_format: torch.dtype = torch.float8_e5m2
    fast_accumulation: bool = True

    def __post_init__(self):
        if self.forward_format != torch.float8_e4m3fn:
            raise ValueError(f"Float8Recipe: forward_format must be torch.float8_e4m3fn, got {self.forward_format}")
        if self.backward_format not in _FORMATS:
            raise ValueError(f"Float8Recipe: backward_format must be torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {self.backward_format}")
        if not isinstance(self.fast_accumulation, bool):
            raise TypeError(f"Float8Recipe: fast_accumulation must be a bool, got {self.fast_accumulation!r}")


_regions: list = []  # the recipes of the enclosing fp8_autocast regions, innermost last (None: off)


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Optional[Float8Recipe] = None):
    """Run the grouped linears and grouped MLPs inside in FP8 (``enabled``) or not, with ``recipe``
    (default ``Float8Recipe()``), unless a module or call chose for itself. Process-wide, as
    TransformerEngine's: enter it on the thread that runs the model, around the forward; the
    backward uses the recipe each call was made with. A compiled model reads it when traced and
    recompiles when it changes."""
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast: enabled must be a bool, got {enabled!r}")
    if recipe is not None and not isinstance(recipe, Float8Recipe):
        raise TypeError(f"fp8_autocast: recipe must be a patchgemm.Float8Recipe or None, got {type(recipe).__name__}")
    _regions.append((recipe or Float8Recipe()) if enabled else None)
    try:
        yield
    finally:
        _regions.pop()


def resolve(where: str, fp8: Union[None, bool, Float8Recipe]) -> Optional[Float8Recipe]:
    """The recipe a call runs with: its own choice (False: none, True: the default recipe), else the
    innermost fp8_autocast region's, else none."""
    if fp8 is None:
        return _regions[-1] if _regions else None
    if isinstance(fp8, Float8Recipe):
        return fp8
    if isinstance(fp8, bool):
        return Float8Recipe() if fp8 else None
    raise TypeError(f"{where}: fp8 must be None, a bool or a patchgemm.Float8Recipe, got {type(fp8).__name__}")


def _quantize(t: torch.Tensor, fmt: torch.dtype, group_major: bool, rowwise: bool, batch_major: bool):
    """(t in fmt in its layout or None, t's [G, D, B] copy or None, scale) for an activation or
    gradient t [B, G, D] ([G, B, D] when group_major): the copy is what a GEMM summing over B reads."""
    if group_major:
        data, data_t, scale = ops.quantize_fp8(t, fmt, rowwise, batch_major)
        return (data if rowwise else None), (data_t if batch_major else None), scale
    B, G, D = t.shape
    data, data_t, scale = ops.quantize_fp8(t.reshape(B, G * D), fmt, rowwise, batch_major)
    return (data.view(B, G, D) if rowwise else None), (data_t.view(G, D, B) if batch_major else None), scale


class _GroupedLinearFp8(torch.autograd.Function):
    """y = x_g @ weight_g^T + bias_g with x and the weight quantized to e4m3 (one scale each); the
    backward quantizes grad_y and runs both gradients' GEMMs in FP8. Hopper's FP8 GEMMs read both
    operands K-major, so each quantization also writes the transposed copy a gradient's GEMM needs
    (in the same pass): the weight's for grad_x, x's and grad_y's (batch-major) for grad_weight; the
    forward saves those copies, in FP8, and nothing else."""

    @staticmethod
    def forward(ctx, x, weight, bias, group_major: bool, out_dtype: torch.dtype, recipe: Float8Recipe,
                need_grad_x: bool, need_grad_w: bool):
        fmt = recipe.forward_format
        x8, x8_t, x_scale = _quantize(x, fmt, group_major, True, need_grad_w)
        w8, w8_t, w_scale = ops.quantize_fp8(weight, fmt, True, need_grad_x)
        ctx.save_for_backward(x8_t, x_scale, w8_t if need_grad_x else None, w_scale)
        ctx.group_major, ctx.recipe, ctx.x_dtype, ctx.w_dtype = group_major, recipe, x.dtype, weight.dtype
        return ops.scaled_grouped_mm(x8, w8, x_scale, w_scale, bias, group_major, out_dtype,
                                     recipe.fast_accumulation)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x8_t, x_scale, w8_t, w_scale = ctx.saved_tensors
        group_major = ctx.group_major
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x or need_w:
            g8, g8_t, g_scale = _quantize(grad_y, ctx.recipe.backward_format, group_major, need_x, need_w)
        if need_x:  # grad_x_g [B, Din] = grad_y_g [B, Dout] @ weight_g [Dout, Din]
            grad_x = ops.scaled_grouped_mm(g8, w8_t, g_scale, w_scale, None, group_major, ctx.x_dtype, False)
        if need_w:  # grad_w_g [Dout, Din] = grad_y_g^T [Dout, B] @ x_g [B, Din]
            grad_w = ops.scaled_grouped_mm(g8_t, x8_t, g_scale, x_scale, None, True, ctx.w_dtype, False)
        if need_b:
            grad_b = grad_y.sum(1 if group_major else 0, dtype=torch.float32).to(grad_y.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def grouped_linear(x3: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_major: bool,
                   recipe: Float8Recipe, out_dtype: torch.dtype) -> torch.Tensor:
    """The FP8 grouped linear of a 3-D x ([B, G, Din], or [G, B, Din] when group_major); out_dtype is
    the compute dtype (autocast's, else x's), the bias cast to it."""
    for name, t in (("x", x3), ("weight", weight)):
        if t.dtype not in _COMPUTE_DTYPES:
            raise TypeError(f"grouped_linear: FP8 needs float32, float16 or bfloat16 {name}, got {t.dtype} "
                            f"(shape {tuple(t.shape)})")
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    grad = torch.is_grad_enabled()
    return _GroupedLinearFp8.apply(x3, weight, bias, group_major, out_dtype, recipe, grad and x3.requires_grad,
                                   grad and weight.requires_grad)
