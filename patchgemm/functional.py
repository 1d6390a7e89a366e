"""The functional API: layout handling and autocast, then one registered op."""

import math
from typing import Optional

import torch
from torch import Tensor

from .ops import ops

LAYOUTS = ("bgd", "gbd")


def _autocast(*tensors):
    """Cast floating tensors to the autocast dtype, as torch.autocast does for nn.Linear."""
    ref = tensors[0]
    if not torch.is_autocast_enabled(ref.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(ref.device.type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() else t for t in tensors)


def grouped_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, layout: str = "bgd") -> Tensor:
    """G independent linears over the groups of ``x``, as one strided-batched GEMM.

    Args:
        x: ``layout="bgd"``: ``[..., G, Din]`` (groups second-to-last), or flattened ``[B*G, Din]``
            (rows ordered batch-major, group-minor; G is taken from ``weight``).
            ``layout="gbd"``: ``[G, ..., Din]`` (group-major).
        weight: ``[G, Dout, Din]``, the nn.Linear convention: ``torch.stack([l.weight for l in linears])``.
        bias: ``[G, Dout]`` or None.
        layout: ``"bgd"`` or ``"gbd"``.

    Returns:
        ``y`` in the layout of ``x`` with Din replaced by Dout:
        ``y[..., g, :] = x[..., g, :] @ weight[g].T + bias[g]``.

    The GEMM reads ``x`` through its strides and writes ``y`` in its final layout: no permute and no
    copy for contiguous inputs in either layout. Inputs whose strides no BLAS call can describe (e.g.
    a view with a non-unit stride in both inner dims) are copied once.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"grouped_linear: layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        raise TypeError("grouped_linear: x and weight must be tensors")
    if weight.dim() != 3:
        raise ValueError(f"grouped_linear: weight must be [G, Dout, Din], got shape {tuple(weight.shape)}")
    if bias is not None and not isinstance(bias, Tensor):
        raise TypeError("grouped_linear: bias must be a tensor or None")
    groups, out_features, _ = weight.shape
    x, weight, bias = _autocast(x, weight, bias)

    if layout == "bgd":
        if x.dim() == 2:  # [B*G, Din]
            if groups == 0 or x.shape[0] % groups != 0:
                raise ValueError(
                    f"grouped_linear: flattened x {tuple(x.shape)} must have a multiple of G={groups} "
                    f"rows (weight {tuple(weight.shape)})")
            x3 = x.reshape(x.shape[0] // groups, groups, x.shape[1])
        elif x.dim() >= 3:
            x3 = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
        else:
            raise ValueError(
                f"grouped_linear: x must be [..., G, Din] or [B*G, Din] for layout 'bgd', got shape {tuple(x.shape)}")
    else:
        if x.dim() < 2:
            raise ValueError(
                f"grouped_linear: x must be [G, ..., Din] for layout 'gbd', got shape {tuple(x.shape)}")
        x3 = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])

    y = ops.grouped_linear(x3, weight, bias, layout == "gbd")
    return y.view(*x.shape[:-1], out_features)
