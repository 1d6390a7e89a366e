"""Modules: drop-in replacements built on the functional ops."""

import math
from typing import List, Sequence

import torch
from torch import Tensor, nn

from . import functional as F

__all__ = ["GroupedLinear"]


class GroupedLinear(nn.Module):
    """``num_groups`` independent ``nn.Linear(in_features, out_features)`` over the groups of ``x``.

    ``x`` is ``[..., G, in_features]`` (``layout="bgd"``) or ``[G, ..., in_features]`` (``"gbd"``);
    parameters are ``weight[G, out_features, in_features]`` and ``bias[G, out_features]``, each group
    initialised like ``nn.Linear``.
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 layout: str = "bgd", device=None, dtype=None):
        super().__init__()
        if layout not in F.LAYOUTS:
            raise ValueError(f"GroupedLinear: layout must be one of {F.LAYOUTS}, got {layout!r}")
        if min(num_groups, in_features, out_features) < 0:
            raise ValueError(
                f"GroupedLinear: sizes must be >= 0, got num_groups={num_groups}, "
                f"in_features={in_features}, out_features={out_features}")
        factory = {"device": device, "dtype": dtype}
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.layout = layout
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's init per group: kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
        # and so is its bias. (init.kaiming_uniform_ on the 3-D tensor would take the wrong fan_in.)
        bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return F.grouped_linear(x, self.weight, self.bias, self.layout)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, layout={self.layout!r}")

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], layout: str = "bgd") -> "GroupedLinear":
        """One GroupedLinear holding copies of the weights of ``linears`` (group g = ``linears[g]``)."""
        linears = list(linears)
        if not linears or not all(isinstance(l, nn.Linear) for l in linears):
            raise ValueError("GroupedLinear.from_linears: expected a non-empty list of nn.Linear")
        first = linears[0]
        for i, l in enumerate(linears):
            if (l.in_features, l.out_features) != (first.in_features, first.out_features):
                raise ValueError(
                    f"GroupedLinear.from_linears: linears[{i}] is {l.in_features}->{l.out_features} but "
                    f"linears[0] is {first.in_features}->{first.out_features}")
            if (l.bias is None) != (first.bias is None):
                raise ValueError("GroupedLinear.from_linears: either all linears have a bias or none does")
            if (l.weight.dtype, l.weight.device) != (first.weight.dtype, first.weight.device):
                raise ValueError(
                    f"GroupedLinear.from_linears: linears[{i}] is {l.weight.dtype} on {l.weight.device}, "
                    f"linears[0] is {first.weight.dtype} on {first.weight.device}")
        module = cls(len(linears), first.in_features, first.out_features, first.bias is not None,
                     layout, device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            module.weight.copy_(torch.stack([l.weight for l in linears]))
            if module.bias is not None:
                module.bias.copy_(torch.stack([l.bias for l in linears]))
        return module

    def to_linears(self) -> List[nn.Linear]:
        """Independent nn.Linear modules holding copies of each group's weights."""
        linears = []
        for g in range(self.num_groups):
            l = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
            with torch.no_grad():
                l.weight.copy_(self.weight[g])
                if self.bias is not None:
                    l.bias.copy_(self.bias[g])
            linears.append(l)
        return linears
