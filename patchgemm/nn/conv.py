"""Drop-in convolution modules: PatchEmbed (kernel == stride Conv*d), PatchUnembed (its
ConvTranspose*d) and GroupedPointwiseConv (grouped 1 x 1 Conv*d)."""

import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import functional as F
from .._args import EMBED_FORMATS, as_bool, as_grid, check_format, check_pad, check_sizes
from ..conv_rules import patch_problem, pointwise_problem
from ..fp8 import Float8Recipe
from ..fp8 import resolve as resolve_fp8

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def as_sizes(value, rank: int, name: str) -> Tuple[int, ...]:
    t = tuple(value) if isinstance(value, (tuple, list)) else (value,) * rank
    if len(t) != rank or not all(isinstance(v, int) and v >= 1 for v in t):
        raise ValueError(f"{name} must be a positive int or {rank} positive ints, got {value!r}")
    return t


def _patch_size(patch_size, dims: Optional[int], name: str) -> Tuple[int, ...]:
    """The patch size as a tuple of 1 to 3 sizes (``dims`` of them where given)."""
    rank = dims if dims is not None else (len(patch_size) if isinstance(patch_size, (tuple, list)) else 2)
    if isinstance(rank, bool) or rank not in (1, 2, 3):
        raise ValueError(f"{name}: patches have 1, 2 or 3 dims, got patch_size={patch_size!r}, dims={dims!r}")
    return as_sizes(patch_size, rank, f"{name}: patch_size")


class _ConvAttributes:
    """The attributes code reads off an ``nn.Conv*d`` / ``nn.ConvTranspose*d`` (``in_channels``,
    ``out_channels`` and ``kernel_size`` are set by the module): the stride is the kernel, no
    padding, dilation 1, one group (GroupedPointwiseConv sets its own ``groups``)."""
    transposed = False
    padding_mode = "zeros"
    groups = 1

    @property
    def stride(self) -> Tuple[int, ...]:
        return tuple(self.kernel_size)

    @property
    def padding(self) -> Tuple[int, ...]:
        return (0,) * len(self.kernel_size)

    @property
    def output_padding(self) -> Tuple[int, ...]:
        return (0,) * len(self.kernel_size)

    @property
    def dilation(self) -> Tuple[int, ...]:
        return (1,) * len(self.kernel_size)


def patch_conv_problem(module: nn.Module) -> Optional[str]:
    """Why a conv / conv-transpose module is not a kernel == stride patch (un)embedding, or None."""
    if type(module) not in CONVS + CONV_TRANSPOSES:
        return f"{type(module).__name__} is not exactly one of the nn.Conv/ConvTranspose classes (custom forward?)"
    return patch_problem(module)


def pointwise_conv_problem(module: nn.Module) -> Optional[str]:
    """Why a conv module is not a grouped pointwise conv (kernel 1, groups > 1), or None."""
    if type(module) not in CONVS:
        return f"{type(module).__name__} is not exactly nn.Conv1d/2d/3d"
    return pointwise_problem(module)


def _init_like_conv(weight: Tensor, bias: Optional[Tensor], fan_in: int) -> None:
    # nn.Conv*'s init: kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)); so is the bias.
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


class PatchEmbed(_ConvAttributes, nn.Module):
    """Drop-in ``nn.Conv{1,2,3}d(in_channels, embed_dim, patch_size, stride=patch_size)``.

    Parameters ``weight[E, C, *k]`` and ``bias[E]`` have the conv's names and shapes, so a conv's
    ``state_dict`` loads unchanged. ``out_format="tokens"`` returns ``[B, N, E]`` directly (what
    ``conv(x).flatten(2).transpose(1, 2)`` gives), ``"channels_last"`` the conv's shape over
    those tokens' memory (see :func:`patchgemm.functional.patch_embed`); the last positions of a
    spatial size the patch does not divide are left out, as the conv leaves them (``pad="dynamic"``
    zero-pads them to a whole patch instead). ``fp8``: the GEMM in FP8 (``True``, a
    ``Float8Recipe``) or not (``False``); only when asked: an ``fp8_autocast`` region does not
    reach patch embeddings (see :mod:`patchgemm.fp8`).
    """

    def __init__(self, in_channels: int, embed_dim: int, patch_size, bias: bool = True, *,
                 dims: Optional[int] = None, out_format: str = "channels_first",
                 pad: Optional[str] = None, device=None, dtype=None, fp8: Union[bool, Float8Recipe] = False):
        super().__init__()
        resolve_fp8("PatchEmbed", fp8)  # checks its type
        self.fp8 = fp8
        self.kernel_size = _patch_size(patch_size, dims, "PatchEmbed")
        in_channels, embed_dim = check_sizes("PatchEmbed", 0, in_channels=in_channels, embed_dim=embed_dim)
        self.in_channels, self.embed_dim = in_channels, embed_dim
        self.out_format, self.pad = out_format, pad
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(embed_dim, in_channels, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(embed_dim, **factory)) if as_bool(bias, "PatchEmbed: bias") else None
        _init_like_conv(self.weight, self.bias, in_channels * math.prod(self.kernel_size))

    @property
    def out_channels(self) -> int:
        return self.embed_dim

    # The options are checked when set, so forward calls the op without checking them again.
    @property
    def out_format(self) -> str:
        return self._out_format

    @out_format.setter
    def out_format(self, value: str) -> None:
        check_format("PatchEmbed: out_format", value, EMBED_FORMATS)
        self._out_format = value

    @property
    def pad(self) -> Optional[str]:
        return self._pad

    @pad.setter
    def pad(self, value: Optional[str]) -> None:
        check_pad("PatchEmbed", value)
        self._pad = value

    def forward(self, x: Tensor) -> Tensor:
        return F.patch_embed_unchecked(x, self.weight, self.bias, self._out_format, self._pad,
                                       resolve_fp8("PatchEmbed", self.fp8, region=False))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.embed_dim}, patch_size={self.kernel_size}, "
                f"bias={self.bias is not None}, out_format={self.out_format!r}"
                + (f", fp8={self.fp8!r}" if self.fp8 else ""))

    @classmethod
    def from_conv(cls, conv: nn.Module, out_format: str = "channels_first") -> "PatchEmbed":
        """A PatchEmbed computing ``conv`` and sharing its parameters (optimizer state stays valid)."""
        if type(conv) not in CONVS:
            raise ValueError(f"PatchEmbed.from_conv: expected nn.Conv1d/2d/3d, got {type(conv).__name__}")
        reason = patch_conv_problem(conv)
        if reason:
            raise ValueError(f"PatchEmbed.from_conv: {conv} is not a kernel == stride patch embedding: {reason}")
        module = cls(conv.in_channels, conv.out_channels, tuple(conv.kernel_size), conv.bias is not None,
                     out_format=out_format, device="meta")
        module.weight, module.bias = conv.weight, conv.bias
        return module


class GroupedPointwiseConv(_ConvAttributes, nn.Module):
    """Drop-in ``nn.Conv{1,2,3}d(in_channels, out_channels, 1, groups=groups)``: G independent
    small linears over the channel groups of every position, through grouped_pointwise_conv.

    Parameters ``weight[C_out, C_in / G, 1, ...]`` and ``bias[C_out]`` as in the conv.
    """

    def __init__(self, in_channels: int, out_channels: int, groups: int, bias: bool = True, *, dims: int = 1,
                 device=None, dtype=None):
        super().__init__()
        in_channels, out_channels = check_sizes("GroupedPointwiseConv", 0, in_channels=in_channels, out_channels=out_channels)
        (groups,) = check_sizes("GroupedPointwiseConv", 1, groups=groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"GroupedPointwiseConv: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        if isinstance(dims, bool) or dims not in (1, 2, 3):
            raise ValueError(f"GroupedPointwiseConv: dims must be 1, 2 or 3, got {dims!r}")
        factory = {"device": device, "dtype": dtype}
        self.in_channels, self.out_channels, self.groups, self.dims = in_channels, out_channels, groups, dims
        self.kernel_size = (1,) * dims
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *(1,) * dims, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if as_bool(bias, "GroupedPointwiseConv: bias") else None
        _init_like_conv(self.weight, self.bias, in_channels // groups)

    def forward(self, x: Tensor) -> Tensor:
        return F.grouped_pointwise_conv(x, self.weight, self.bias, self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, groups={self.groups}, dims={self.dims}, "
                f"bias={self.bias is not None}")

    @classmethod
    def from_conv(cls, conv: nn.Module) -> "GroupedPointwiseConv":
        """A GroupedPointwiseConv computing ``conv`` and sharing its parameters."""
        reason = pointwise_conv_problem(conv)
        if reason:
            raise ValueError(f"GroupedPointwiseConv.from_conv: {conv} is not a grouped pointwise conv: {reason}")
        module = cls(conv.in_channels, conv.out_channels, conv.groups, conv.bias is not None,
                     dims=len(conv.kernel_size), device="meta")
        module.weight, module.bias = conv.weight, conv.bias
        return module


class PatchUnembed(_ConvAttributes, nn.Module):
    """Drop-in ``nn.ConvTranspose{1,2,3}d(in_channels, out_channels, patch_size, stride=patch_size)``.

    Parameters ``weight[C_in, C_out, *k]`` and ``bias[C_out]`` as in the ConvTranspose.
    ``in_format="tokens"`` takes ``[B, N, C_in]``; pass ``grid`` to the constructor or to forward.
    ``fp8`` as for :class:`PatchEmbed`.
    """

    def __init__(self, in_channels: int, out_channels: int, patch_size, bias: bool = True, *,
                 dims: Optional[int] = None, in_format: str = "channels_first",
                 grid: Optional[Sequence[int]] = None, device=None, dtype=None,
                 fp8: Union[bool, Float8Recipe] = False):
        super().__init__()
        resolve_fp8("PatchUnembed", fp8)  # checks its type
        self.fp8 = fp8
        check_format("PatchUnembed: in_format", in_format)
        self.kernel_size = _patch_size(patch_size, dims, "PatchUnembed")
        in_channels, out_channels = check_sizes("PatchUnembed", 0, in_channels=in_channels, out_channels=out_channels)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.in_format, self.grid = in_format, None if grid is None else tuple(as_grid(grid, "PatchUnembed"))
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if as_bool(bias, "PatchUnembed: bias") else None
        # ConvTranspose's fan_in, as torch computes it from the weight: dim 1 times the kernel.
        _init_like_conv(self.weight, self.bias, out_channels * math.prod(self.kernel_size))

    transposed = True

    def forward(self, x: Tensor, grid: Optional[Sequence[int]] = None) -> Tensor:
        return F.patch_unembed(x, self.weight, self.bias, in_format=self.in_format,
                               grid=grid if grid is not None else self.grid, fp8=self.fp8)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, patch_size={self.kernel_size}, "
                f"bias={self.bias is not None}, in_format={self.in_format!r}"
                + (f", fp8={self.fp8!r}" if self.fp8 else ""))

    @classmethod
    def from_conv_transpose(cls, conv: nn.Module, in_format: str = "channels_first",
                            grid: Optional[Sequence[int]] = None) -> "PatchUnembed":
        """A PatchUnembed computing ``conv`` and sharing its parameters."""
        if type(conv) not in CONV_TRANSPOSES:
            raise ValueError(
                f"PatchUnembed.from_conv_transpose: expected nn.ConvTranspose1d/2d/3d, got {type(conv).__name__}")
        reason = patch_conv_problem(conv)
        if reason:
            raise ValueError(f"PatchUnembed.from_conv_transpose: {conv} is not a kernel == stride unpatchify: {reason}")
        module = cls(conv.in_channels, conv.out_channels, tuple(conv.kernel_size), conv.bias is not None,
                     in_format=in_format, grid=grid, device="meta")
        module.weight, module.bias = conv.weight, conv.bias
        return module
