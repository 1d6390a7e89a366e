"""Modules: drop-in replacements built on the functional ops."""

import copy
import math
import sys
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from . import functional as F
from ._args import EMBED_FORMATS, as_grid, as_int, autocast, check_format, check_pad, unsafe_view
from ._functorch import call as _call
from .conv_rules import left_to_pytorch, patch_problem, pointwise_problem
from .fp8 import Float8Recipe
from .fp8 import resolve as resolve_fp8

__all__ = ["GroupedLinear", "GroupedMLP", "GroupedPointwiseConv", "PatchEmbed", "PatchUnembed", "HierarchicalPatchEmbed",
           "HierarchicalPatchUnembed", "convert", "ConvertReport"]


def _sizes(where: str, minimum: int, **sizes) -> Tuple[int, ...]:
    """The given sizes as ints, in order: non-integers are a TypeError (as torch's modules raise), sizes
    below `minimum` a ValueError, each naming the argument."""
    values = tuple(as_int(v, f"{where}: {k}") for k, v in sizes.items())
    if any(v < minimum for v in values):
        given = ", ".join(f"{k}={v}" for k, v in zip(sizes, values))
        raise ValueError(f"{where}: sizes must be >= {minimum}, got {given}")
    return values


class GroupedLinear(nn.Module):
    """``num_groups`` independent ``nn.Linear(in_features, out_features)`` over the groups of ``x``.

    ``x`` is ``[..., G, in_features]`` (``layout="bgd"``) or ``[G, ..., in_features]`` (``"gbd"``);
    parameters are ``weight[G, out_features, in_features]`` and ``bias[G, out_features]``, each group
    initialised like ``nn.Linear``. ``fp8``: run in FP8 (``True``, a ``Float8Recipe``), never
    (``False``), or as the enclosing ``fp8_autocast`` says (None).
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 layout: str = "bgd", device=None, dtype=None, *, fp8: Union[None, bool, Float8Recipe] = None):
        super().__init__()
        if layout not in F.LAYOUTS:
            raise ValueError(f"GroupedLinear: layout must be one of {F.LAYOUTS}, got {layout!r}")
        resolve_fp8("GroupedLinear", fp8)  # checks its type
        self.fp8 = fp8
        num_groups, in_features, out_features = _sizes("GroupedLinear", 0, num_groups=num_groups,
                                                       in_features=in_features, out_features=out_features)
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
        return F.grouped_linear(x, self.weight, self.bias, self.layout, fp8=self.fp8)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, layout={self.layout!r}"
                + (f", fp8={self.fp8!r}" if self.fp8 is not None else ""))

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


# ---- kernel == stride convolutions ----------------------------------------------------------------

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class GroupedMLP(nn.Module):
    """``num_groups`` independent gated MLPs, ``dim -> hidden -> out_dim`` (default ``dim``), over the
    groups of ``x``: ``down(silu(gate(x)) * up(x))`` per group (SwiGLU), through grouped_mlp.

    Parameters: ``w_gate_up[G, 2*hidden, dim]`` (gate rows first, then up) and
    ``w_down[G, out_dim, hidden]``, plus ``bias_gate_up[G, 2*hidden]`` / ``bias_down[G, out_dim]``
    when ``bias``; each projection initialised like ``nn.Linear``. ``fp8``: both GEMMs in FP8, as
    GroupedLinear's.
    """

    def __init__(self, num_groups: int, dim: int, hidden: int, activation: str = "swiglu", *,
                 out_dim: Optional[int] = None, bias: bool = False, layout: str = "bgd", device=None, dtype=None,
                 fp8: Union[None, bool, Float8Recipe] = None):
        super().__init__()
        resolve_fp8("GroupedMLP", fp8)  # checks its type
        self.fp8 = fp8
        out_dim = dim if out_dim is None else out_dim
        if activation not in F.ACTIVATIONS:
            raise ValueError(f"GroupedMLP: activation must be one of {F.ACTIVATIONS}, got {activation!r}")
        if layout not in F.LAYOUTS:
            raise ValueError(f"GroupedMLP: layout must be one of {F.LAYOUTS}, got {layout!r}")
        num_groups, dim, hidden, out_dim = _sizes("GroupedMLP", 0, num_groups=num_groups, dim=dim, hidden=hidden,
                                                  out_dim=out_dim)
        factory = {"device": device, "dtype": dtype}
        self.num_groups, self.dim, self.hidden, self.out_dim = num_groups, dim, hidden, out_dim
        self.activation, self.layout = activation, layout
        self.w_gate_up = nn.Parameter(torch.empty(num_groups, 2 * hidden, dim, **factory))
        self.w_down = nn.Parameter(torch.empty(num_groups, out_dim, hidden, **factory))
        self.bias_gate_up = nn.Parameter(torch.empty(num_groups, 2 * hidden, **factory)) if bias else None
        self.bias_down = nn.Parameter(torch.empty(num_groups, out_dim, **factory)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight, bias, fan_in in ((self.w_gate_up, self.bias_gate_up, self.dim),
                                     (self.w_down, self.bias_down, self.hidden)):
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(weight, -bound, bound)
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def forward(self, x: Tensor) -> Tensor:
        return F.grouped_mlp(x, self.w_gate_up, self.w_down, self.layout, bias_gate_up=self.bias_gate_up,
                             bias_down=self.bias_down, activation=self.activation, fp8=self.fp8)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, dim={self.dim}, hidden={self.hidden}, out_dim={self.out_dim}, "
                f"activation={self.activation!r}, bias={self.bias_down is not None}, layout={self.layout!r}"
                + (f", fp8={self.fp8!r}" if self.fp8 is not None else ""))


class MoEExperts(nn.Module):
    """The routed experts of a mixture of experts, ``num_experts`` SwiGLU MLPs ``dim -> hidden ->
    dim``, through moe_experts: ``forward(x [T, dim], expert_index [T, k], expert_weight [T, k])``.

    Parameters as transformers' experts modules name and lay them out, so their ``state_dict`` keys
    load: ``gate_up_proj[E, 2*hidden, dim]`` (gate rows first, then up) and
    ``down_proj[E, dim, hidden]``. ``convert`` swaps transformers' SwiGLU experts (Mixtral, Qwen-MoE,
    OLMoE, DeepSeek and the others of that layout) for one sharing their parameters.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int, *, device=None, dtype=None):
        super().__init__()
        num_experts, dim, hidden = _sizes("MoEExperts", 1, num_experts=num_experts, dim=dim, hidden=hidden)
        factory = {"device": device, "dtype": dtype}
        # (transformers' attribute names, which code around the experts may read)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, dim, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight, fan_in in ((self.gate_up_proj, self.hidden_dim), (self.down_proj, self.intermediate_dim)):
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)

    @classmethod
    def from_experts(cls, module: nn.Module) -> "MoEExperts":
        """One sharing the parameters of a transformers experts module (``gate_up_proj``,
        ``down_proj``); ValueError saying why where that module computes something else."""
        why = _moe_experts_ineligible(module)
        if why:
            raise ValueError(f"MoEExperts.from_experts: {why}")
        experts, two_hidden, dim = module.gate_up_proj.shape
        new = cls(experts, dim, two_hidden // 2, device="meta")
        new.gate_up_proj, new.down_proj = module.gate_up_proj, module.down_proj
        return new

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return F.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, dim={self.hidden_dim}, hidden={self.intermediate_dim}"


def _acts_as_silu(act) -> bool:
    """Whether ``act`` computes SiLU (transformers' ACT2FN["silu"], nn.SiLU, F.silu, ...): probed."""
    if not callable(act):
        return False
    probe = torch.linspace(-6, 6, 25, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = act(probe)
    except Exception:  # an activation that cannot run on a float64 CPU tensor is not one we know
        return False
    return isinstance(out, Tensor) and out.shape == probe.shape and torch.allclose(out, nn.functional.silu(probe))


def _moe_experts_ineligible(module: nn.Module) -> Optional[str]:
    """Why a module is not a transformers experts module that MoEExperts computes, or None. Its
    layout must be the default of transformers' ``use_experts_implementation``: gate and up
    concatenated in ``gate_up_proj[E, 2H, D]``, ``down_proj[E, D, H]``, no biases, SiLU, the default
    gate, no norm after the experts, and no other parameters or submodules."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or not type(module).__module__.startswith("transformers."):
        return "not a transformers module"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "no gate_up_proj / down_proj parameters"
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False}
    odd = [f"{k}={getattr(module, k)}" for k, v in layout.items() if getattr(module, k, v) != v]
    if odd:
        return f"its layout ({', '.join(odd)}) is not the SwiGLU experts layout"
    if getattr(type(module), "_apply_gate", None) is not getattr(moe, "_default_apply_gate", ()):
        return "its own gate function"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 or tuple(down.shape) != (
            gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2H, D] and [E, D, H]"
    others = [n for n, _ in module.named_parameters() if n not in ("gate_up_proj", "down_proj")]
    others += [n for n, m in module.named_children() if n != "act_fn"]
    if others:
        return f"other parameters or submodules ({', '.join(others)})"
    if not _acts_as_silu(getattr(module, "act_fn", None)):
        return "its activation is not SiLU"
    return None


def _as_tuple(value, rank: int, name: str) -> Tuple[int, ...]:
    t = tuple(value) if isinstance(value, (tuple, list)) else (value,) * rank
    if len(t) != rank or not all(isinstance(v, int) and v >= 1 for v in t):
        raise ValueError(f"{name} must be a positive int or {rank} positive ints, got {value!r}")
    return t


def _patch_size(patch_size, dims: Optional[int], name: str) -> Tuple[int, ...]:
    """The patch size as a tuple of 1 to 3 sizes (``dims`` of them where given)."""
    rank = dims or (len(patch_size) if isinstance(patch_size, (tuple, list)) else 2)
    if rank not in (1, 2, 3):
        raise ValueError(f"{name}: patches have 1, 2 or 3 dims, got patch_size={patch_size!r}, dims={dims!r}")
    return _as_tuple(patch_size, rank, f"{name}: patch_size")


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


def _ineligible(module: nn.Module) -> Optional[str]:
    """Why a conv / conv-transpose module is not a kernel == stride patch (un)embedding, or None."""
    if type(module) not in _CONVS + _CONV_TRANSPOSES:
        return f"{type(module).__name__} is not exactly one of the nn.Conv/ConvTranspose classes (custom forward?)"
    return patch_problem(module)


def _pointwise_ineligible(module: nn.Module) -> Optional[str]:
    """Why a conv module is not a grouped pointwise conv (kernel 1, groups > 1), or None."""
    if type(module) not in _CONVS:
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
    zero-pads them to a whole patch instead).
    """

    def __init__(self, in_channels: int, embed_dim: int, patch_size, bias: bool = True, *,
                 dims: Optional[int] = None, out_format: str = "channels_first",
                 pad: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        self.kernel_size = _patch_size(patch_size, dims, "PatchEmbed")
        in_channels, embed_dim = _sizes("PatchEmbed", 0, in_channels=in_channels, embed_dim=embed_dim)
        self.in_channels, self.embed_dim = in_channels, embed_dim
        self.out_format, self.pad = out_format, pad
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(embed_dim, in_channels, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(embed_dim, **factory)) if bias else None
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
        return F.patch_embed_unchecked(x, self.weight, self.bias, self._out_format, self._pad)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.embed_dim}, patch_size={self.kernel_size}, "
                f"bias={self.bias is not None}, out_format={self.out_format!r}")

    @classmethod
    def from_conv(cls, conv: nn.Module, out_format: str = "channels_first") -> "PatchEmbed":
        """A PatchEmbed computing ``conv`` and sharing its parameters (optimizer state stays valid)."""
        if type(conv) not in _CONVS:
            raise ValueError(f"PatchEmbed.from_conv: expected nn.Conv1d/2d/3d, got {type(conv).__name__}")
        reason = _ineligible(conv)
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
        in_channels, out_channels = _sizes("GroupedPointwiseConv", 0, in_channels=in_channels, out_channels=out_channels)
        (groups,) = _sizes("GroupedPointwiseConv", 1, groups=groups)
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"GroupedPointwiseConv: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        if dims not in (1, 2, 3):
            raise ValueError(f"GroupedPointwiseConv: dims must be 1, 2 or 3, got {dims}")
        factory = {"device": device, "dtype": dtype}
        self.in_channels, self.out_channels, self.groups, self.dims = in_channels, out_channels, groups, dims
        self.kernel_size = (1,) * dims
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups, *(1,) * dims, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        _init_like_conv(self.weight, self.bias, in_channels // groups)

    def forward(self, x: Tensor) -> Tensor:
        return F.grouped_pointwise_conv(x, self.weight, self.bias, self.groups)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, groups={self.groups}, dims={self.dims}, "
                f"bias={self.bias is not None}")

    @classmethod
    def from_conv(cls, conv: nn.Module) -> "GroupedPointwiseConv":
        """A GroupedPointwiseConv computing ``conv`` and sharing its parameters."""
        reason = _pointwise_ineligible(conv)
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
    """

    def __init__(self, in_channels: int, out_channels: int, patch_size, bias: bool = True, *,
                 dims: Optional[int] = None, in_format: str = "channels_first",
                 grid: Optional[Sequence[int]] = None, device=None, dtype=None):
        super().__init__()
        check_format("PatchUnembed: in_format", in_format)
        self.kernel_size = _patch_size(patch_size, dims, "PatchUnembed")
        in_channels, out_channels = _sizes("PatchUnembed", 0, in_channels=in_channels, out_channels=out_channels)
        self.in_channels, self.out_channels = in_channels, out_channels
        self.in_format, self.grid = in_format, None if grid is None else tuple(as_grid(grid, "PatchUnembed"))
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        # ConvTranspose's fan_in, as torch computes it from the weight: dim 1 times the kernel.
        _init_like_conv(self.weight, self.bias, out_channels * math.prod(self.kernel_size))

    transposed = True

    def forward(self, x: Tensor, grid: Optional[Sequence[int]] = None) -> Tensor:
        return F.patch_unembed(x, self.weight, self.bias, in_format=self.in_format,
                               grid=grid if grid is not None else self.grid)

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, patch_size={self.kernel_size}, "
                f"bias={self.bias is not None}, in_format={self.in_format!r}")

    @classmethod
    def from_conv_transpose(cls, conv: nn.Module, in_format: str = "channels_first",
                            grid: Optional[Sequence[int]] = None) -> "PatchUnembed":
        """A PatchUnembed computing ``conv`` and sharing its parameters."""
        if type(conv) not in _CONV_TRANSPOSES:
            raise ValueError(
                f"PatchUnembed.from_conv_transpose: expected nn.ConvTranspose1d/2d/3d, got {type(conv).__name__}")
        reason = _ineligible(conv)
        if reason:
            raise ValueError(f"PatchUnembed.from_conv_transpose: {conv} is not a kernel == stride unpatchify: {reason}")
        module = cls(conv.in_channels, conv.out_channels, tuple(conv.kernel_size), conv.bias is not None,
                     in_format=in_format, grid=grid, device="meta")
        module.weight, module.bias = conv.weight, conv.bias
        return module


@dataclass
class ConvertReport:
    """What :func:`convert` did: ``swapped`` (name, "Conv2d -> PatchEmbed") and ``skipped``
    (name, reason) per convolution or experts module found; ``model`` is the converted model."""
    model: nn.Module
    swapped: List[Tuple[str, str]] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)

    def __repr__(self) -> str:  # not the dataclass's: that prints the whole model
        return (f"ConvertReport(model={type(self.model).__name__}, swapped={len(self.swapped)}, "
                f"skipped={len(self.skipped)})")

    def __str__(self) -> str:
        lines = [f"patchgemm.convert: swapped {len(self.swapped)}, left {len(self.skipped)}"]
        lines += [f"  swapped {name or '<root>'}: {what}" for name, what in self.swapped]
        lines += [f"  left    {name or '<root>'}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def _patch_convs(seq: nn.Module) -> int:
    """How many of ``seq``'s children are kernel == stride convs (or conv-transposes) wider than 1."""
    return sum(type(m) in _CONVS + _CONV_TRANSPOSES and not _ineligible(m) and not left_to_pytorch(m)
               for m in seq.children())


# Patch-embedding modules of timm and transformers whose kernel == stride conv feeds only a
# flatten-to-tokens (``proj(x).flatten(2).transpose(1, 2)``, a permute to channels-last order, or a
# ``.view`` of a one-patch grid): (module, class) -> the conv's attribute. Matched by name, so
# neither library is imported; subclasses are not matched (they may change forward). convert()
# gives them a PatchEmbed with out_format="channels_last": the GEMM writes the tokens and the
# flatten/transpose that follows is a free view. The module itself (its options, checks, norm and
# state_dict keys) stays.
_TOKEN_PATCH_EMBEDS = {
    ("timm.layers.patch_embed", "PatchEmbed"): "proj",
    ("timm.layers.patch_embed", "PatchEmbedWithSize"): "proj",
    ("transformers.models.vit.modeling_vit", "ViTPatchEmbeddings"): "projection",
    ("transformers.models.deit.modeling_deit", "DeiTPatchEmbeddings"): "projection",
    ("transformers.models.vit_mae.modeling_vit_mae", "ViTMAEPatchEmbeddings"): "projection",
    ("transformers.models.dinov2.modeling_dinov2", "Dinov2PatchEmbeddings"): "projection",
    ("transformers.models.videomae.modeling_videomae", "VideoMAEPatchEmbeddings"): "projection",
    ("transformers.models.clip.modeling_clip", "CLIPVisionEmbeddings"): "patch_embedding",
    ("transformers.models.siglip.modeling_siglip", "SiglipVisionEmbeddings"): "patch_embedding",
    ("transformers.models.qwen2_vl.modeling_qwen2_vl", "PatchEmbed"): "proj",
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionPatchEmbed"): "proj",
}


def _token_patch_embed(module: nn.Module) -> Optional[str]:
    """The attribute holding the conv of a known flatten-to-tokens patch embedding, or None."""
    attr = _TOKEN_PATCH_EMBEDS.get((type(module).__module__, type(module).__qualname__))
    if attr is None or type(getattr(module, attr, None)) not in _CONVS:
        return None
    # timm's PatchEmbed can also return the conv's own NCHW map (flatten=False, output_fmt NCHW):
    # that output keeps the conv's memory format.
    if not getattr(module, "flatten", True) and getattr(module, "output_fmt", "NCHW") == "NCHW":
        return None
    return attr


def convert(model: nn.Module, *, inplace: bool = True) -> ConvertReport:
    """Swap, sharing parameters:

    - every ``nn.Sequential`` stem — two kernel == stride convs or more, each followed by an optional
      norm and an optional activation (hMLP stems) — for HierarchicalPatchEmbed /
      HierarchicalPatchUnembed, keeping its parameter names (a subclass too, unless it defines its
      own ``forward``: then its convs are swapped one by one, and the report says why);
    - the conv of every known patch embedding that flattens to tokens (timm's ``PatchEmbed``;
      transformers' ViT, DeiT, ViT-MAE, DINOv2, VideoMAE, CLIP, SigLIP and Qwen2-VL patch
      embeddings) for a PatchEmbed that writes the tokens directly, the module itself kept;
    - every other eligible ``nn.Conv{1,2,3}d`` / ``nn.ConvTranspose{1,2,3}d`` (kernel == stride,
      a kernel wider than 1, padding 0, dilation 1, groups 1, zeros padding, output_padding 0) for
      PatchEmbed / PatchUnembed (1 x 1 convs stay: cuDNN's GEMM, nothing to gather);
    - every grouped pointwise ``nn.Conv{1,2,3}d`` (kernel 1, stride 1, groups > 1, more than one
      input channel per group) for GroupedPointwiseConv. (Depthwise 1 x 1 convs, a per-channel
      scale, stay: on an H100 timm models with them swapped (GhostNetV3, LCNetV2, MobileOne) took
      7 to 11% more GPU time per training step.)
    - every transformers experts module of the SwiGLU layout (``gate_up_proj[E, 2H, D]``,
      ``down_proj[E, D, H]``: Mixtral, Qwen-MoE, OLMoE, DeepSeek, ...) for MoEExperts.

    Returns a :class:`ConvertReport` (``report.model`` is the model; with ``inplace=False`` a
    converted deep copy, the original untouched)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(inplace, bool):
        raise TypeError(f"convert: inplace must be True or False, got {type(inplace).__name__} {inplace!r}")
    if not inplace:
        model = copy.deepcopy(model)
    report = ConvertReport(model)

    def replacement(name: str, module: nn.Module) -> Optional[nn.Module]:
        attr = _token_patch_embed(module)
        conv = getattr(module, attr) if attr is not None else None
        if conv is not None and not _ineligible(conv):
            setattr(module, attr, PatchEmbed.from_conv(conv, out_format="channels_last"))
            report.swapped.append((f"{name}.{attr}" if name else attr,
                                   f"{type(conv).__name__} -> PatchEmbed writing tokens "
                                   f"(in {type(module).__module__.split('.')[0]} {type(module).__name__})"))
            return module  # its other children stay as they are
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3:
            why = _moe_experts_ineligible(module)  # (a transformers experts module, or one like it)
            if why:
                report.skipped.append((name, f"experts: {why}"))
                return None
            report.swapped.append((name, f"{type(module).__name__} -> MoEExperts"))
            return MoEExperts.from_experts(module)
        if isinstance(module, nn.Sequential) and _patch_convs(module) >= 2:
            # A subclass is a stem too when it computes as a Sequential does (its forward is
            # Sequential's); one with a forward of its own may compute anything, so its convs are
            # swapped one by one, and the report says so.
            if type(module).forward is not nn.Sequential.forward:
                report.skipped.append((name, f"not a whole stem: {type(module).__name__} defines its own "
                                             "forward (its convs are swapped one by one)"))
                return None
            first = next(iter(module.children()))
            stem = HierarchicalPatchEmbed if type(first) in _CONVS else HierarchicalPatchUnembed
            try:
                new = stem.from_sequential(module)
            except _StemNormError as e:  # laid out as a stem: say why its convs are swapped one by one
                report.skipped.append((name, f"not a whole stem: {e}"))
                return None
            except ValueError:  # not laid out as a stem
                return None
            report.swapped.append((name, f"{type(module).__name__} of {len(new._plan.stages)} convs -> {stem.__name__}"))
            return new
        if not isinstance(module, _CONVS + _CONV_TRANSPOSES):
            return None
        reason = _ineligible(module)
        grouped_pointwise = bool(reason) and type(module) in _CONVS and not _pointwise_ineligible(module)
        if grouped_pointwise or not reason:
            reason = left_to_pytorch(module)
        if reason:
            report.skipped.append((name, reason))
            return None
        if grouped_pointwise:
            new = GroupedPointwiseConv.from_conv(module)
        else:
            new = (PatchEmbed.from_conv(module) if type(module) in _CONVS
                   else PatchUnembed.from_conv_transpose(module))
        report.swapped.append((name, f"{type(module).__name__} -> {type(new).__name__}"))
        return new

    root = replacement("", model)
    if root is not None:
        report.model = root
        return report
    # Top-down, so a replaced module's children are not visited. A module held under several names
    # (or by several parents) is converted once, and every holder gets the same replacement, as the
    # model shared it.
    done = {}  # id(original) -> (its first name, replacement or None)

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent._modules.items()):  # (named_children skips repeats)
            if child is None:
                continue
            name = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in done:
                first, new = done[id(child)]
                if new is not None:
                    setattr(parent, child_name, new)
                    report.swapped.append((name, f"the same module as {first}"))
                continue
            new = replacement(name, child)
            done[id(child)] = (name, new)
            if new is not None:
                setattr(parent, child_name, new)
            else:
                visit(child, name)

    visit(model, "")
    return report


# ---- hierarchical (hMLP) stems --------------------------------------------------------------------

_ACTS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu, "silu": nn.functional.silu, None: None}
# Activation modules that act on each element alone: on tokens they give what they give on a
# channels-first map.
_ACT_MODULES = (nn.GELU, nn.ReLU, nn.ReLU6, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
                nn.Hardswish, nn.Identity)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)


def _instance_like(norm: nn.Module) -> bool:
    """Whether ``norm`` normalizes each sample and channel over all positions, with per-channel
    affine parameters: what instance_norm_act computes. InstanceNorm*d without running statistics,
    and GroupNorm with one group per channel."""
    if type(norm) in _INSTANCE_NORMS:
        return not norm.track_running_stats
    return type(norm) is nn.GroupNorm and norm.num_groups == norm.num_channels


def _norm_problem(norm: nn.Module, channels: int, rank: int) -> Optional[str]:
    """Why ``norm`` cannot normalize a stem's tokens of ``channels`` channels, or None.

    Inside a stem the positions arrive patch-major, not in spatial order. The instance norms do not
    mind. Any other norm module runs on a channels-first view of the tokens, so it must not depend on
    where positions are: a copy of it runs once on random input, with and without the positions
    shuffled. Per-position norms and per-channel statistics over positions (RMS instance norms,
    BatchNorm) pass; a norm that mixes neighbours fails."""
    if _instance_like(norm):
        features = norm.num_channels if type(norm) is nn.GroupNorm else norm.num_features
        if (norm.weight is not None or type(norm) is nn.GroupNorm) and features != channels:
            return f"{norm} does not match {channels} channels"
        return None
    probe = copy.deepcopy(norm)
    state = next(iter([*probe.parameters(), *probe.buffers()]), None)
    device = state.device if state is not None else torch.device("cpu")
    dtype = state.dtype if state is not None and state.is_floating_point() else torch.float32
    if device.type == "meta":
        return f"{type(norm).__name__} is on the meta device: cannot check it"
    shape = (2, channels, *((12,), (4, 3), (3, 2, 2))[rank - 1])
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=generator).to(device, dtype)
    order = torch.randperm(12, generator=generator).to(device)

    def shuffle(t):
        return t.flatten(2)[:, :, order].reshape(t.shape)

    try:
        with torch.no_grad():
            shuffled_after, shuffled_before = shuffle(probe(x)), probe(shuffle(x))
    except Exception as e:  # noqa: BLE001 (any failure means: not this norm)
        return f"{type(norm).__name__} failed on a [B, {channels}, *S] input: {type(e).__name__}: {e}"
    tol = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    if shuffled_after.shape != x.shape or not torch.allclose(shuffled_after.float(), shuffled_before.float(),
                                                             rtol=tol, atol=tol):
        return f"{type(norm).__name__} depends on the order of positions (it mixes neighbours?)"
    return None


def _act(y: Tensor, act) -> Tensor:
    """``act``: an _ACTS key, an activation module, or None."""
    if act is None:
        return y
    return _ACTS[act](y) if isinstance(act, str) else act(y)


def _norm_act(y: Tensor, norm: Optional[nn.Module], act, grid: Optional[Sequence[int]]) -> Tensor:
    """``act(norm(y))`` for tokens ``y [B, N, C]`` whose N positions cover ``grid`` in some order, or,
    with ``grid=None``, for a channels-first map ``y [B, C, *S]``. The instance norms run as
    instance_norm_act (one fused pass with an exact GELU after them); any other norm is the module
    itself, on a channels-first view of the tokens."""
    tokens = grid is not None
    if norm is None:
        return _act(y, act)
    if _instance_like(norm):
        fused = act == "gelu" or (type(act) is nn.GELU and act.approximate == "none")
        y = F.instance_norm_act(y, norm.weight, norm.bias, eps=norm.eps, act="gelu" if fused else None,
                                layout="tokens" if tokens else "channels_first")
        return y if fused else _act(y, act)
    if tokens:
        return _act(norm(y.transpose(1, 2).unflatten(2, list(grid))).flatten(2).transpose(1, 2), act)
    return _act(norm(y), act)


def _make_norm(kind: Optional[str], channels: int, rank: int, factory) -> Optional[nn.Module]:
    if kind is None:
        return None
    if kind != "instance":
        raise ValueError(f"norm must be 'instance' or None, got {kind!r}")
    return _INSTANCE_NORMS[rank - 1](channels, affine=True, **factory)


def _tokens_weight(weight: Tensor, transposed: bool) -> Tensor:
    """A later stage's weight as a matrix over token rows whose features are (in-patch offset,
    channel), the order the earlier stage's rows arrive in: conv [E, C, *k] -> [E, k.. * C];
    conv-transpose [C_in, C_out, *k] -> [C_in, k.. * C_out]."""
    out, inner = weight.shape[:2]
    return weight.reshape(out, inner, -1).transpose(1, 2).reshape(out, -1)


@dataclass(frozen=True)
class _StemPlan:
    """Where a stem's pieces live, as submodule names, so that a stem made from an ``nn.Sequential``
    keeps the Sequential's parameter names: the stages in the order they apply, and after each
    stage its norm (a name or None) and its activation (("fn", an _ACTS key), ("module", a name) or
    None). The entries after the last stage are the stem's trailing norm and activation."""
    stages: Tuple[str, ...]
    norms: Tuple[Optional[str], ...]
    acts: Tuple[Optional[Tuple[str, str]], ...]

    @staticmethod
    def native(layers: int, has_norm: bool, act: Optional[str]) -> "_StemPlan":
        """The plan of the constructors: ``stages.i``, ``norms.i`` between stages, one act."""
        between = layers - 1
        return _StemPlan(tuple(f"stages.{i}" for i in range(layers)),
                         tuple(f"norms.{i}" if has_norm else None for i in range(between)) + (None,),
                         tuple(("fn", act) if act else None for i in range(between)) + (None,))

    def resolve(self, module: nn.Module):
        """(stages, norms, acts) as modules and _ACTS keys."""
        get = module.get_submodule
        return ([get(n) for n in self.stages], [None if n is None else get(n) for n in self.norms],
                [None if a is None else (a[1] if a[0] == "fn" else get(a[1])) for a in self.acts])


class _StemNormError(ValueError):
    """A Sequential laid out as a stem whose norm cannot run on tokens (convert reports it)."""


def _stem_from_sequential(cls, seq: nn.Module, conv_types, swap, **attributes):
    """A ``cls`` (a hierarchical stem) computing ``seq`` = conv (norm)? (act)? conv (norm)? (act)? ...
    with two convs or more, holding ``seq``'s own modules under their own names (the convs swapped by
    ``swap``, sharing their parameters). ValueError naming the layer that does not fit."""
    where = f"{cls.__name__}.from_sequential"
    if not isinstance(seq, nn.Sequential):
        raise ValueError(f"{where}: expected an nn.Sequential, got {type(seq).__name__}")
    layers = list(seq._modules.items())
    stages, norms, acts, i = [], [], [], 0
    while i < len(layers):
        name, conv = layers[i]
        if type(conv) not in conv_types:
            raise ValueError(f"{where}: layer {name} is {type(conv).__name__}, where a "
                             f"{'/'.join(t.__name__ for t in conv_types)} should come")
        reason = _ineligible(conv)
        if reason:
            raise ValueError(f"{where}: layer {name} is not kernel == stride: {reason}")
        stages.append(name)
        i += 1
        norm = act = None
        if i < len(layers) and type(layers[i][1]) not in conv_types + _ACT_MODULES:
            norm, i = layers[i][0], i + 1
        if i < len(layers) and type(layers[i][1]) in _ACT_MODULES:
            act, i = ("module", layers[i][0]), i + 1
        norms.append(norm)
        acts.append(act)
    if len(stages) < 2:
        raise ValueError(f"{where}: a stem needs two convs or more, {seq} has {len(stages)}")
    modules = dict(layers)
    convs = [modules[n] for n in stages]
    for i in range(1, len(convs)):
        if convs[i].in_channels != convs[i - 1].out_channels or len(convs[i].kernel_size) != len(convs[0].kernel_size):
            raise ValueError(f"{where}: layer {stages[i]} {convs[i]} does not follow layer {stages[i - 1]} {convs[i - 1]}")
    rank = len(convs[0].kernel_size)
    for conv, norm in zip(convs, norms):
        problem = None if norm is None else _norm_problem(modules[norm], conv.out_channels, rank)
        if problem:
            raise _StemNormError(f"{where}: layer {norm}: {problem}")
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for name, layer in layers:
        module.add_module(name, swap(layer) if name in stages else layer)
    module._plan = _StemPlan(tuple(stages), tuple(norms), tuple(acts))
    module.dims = rank
    for key, value in attributes.items():
        setattr(module, key, value)
    return module


def _stem_from_convs(cls, convs, norms, act, final_norm, swap, **kwargs):
    """A ``cls`` over ``convs`` with ``norms`` between them (InstanceNorm or any norm that
    _norm_problem accepts; None for none) and ``final_norm`` after the last."""
    where = f"{cls.__name__}.from_convs"
    convs = list(convs)
    if not convs:
        raise ValueError(f"{where}: convs must not be empty")
    stages = [swap(c) for c in convs]
    for i in range(1, len(stages)):
        if stages[i].in_channels != stages[i - 1].out_channels or len(stages[i].kernel_size) != len(stages[0].kernel_size):
            raise ValueError(f"{where}: convs[{i}] {convs[i]} does not follow {convs[i - 1]}")
    norms = list(norms) if norms is not None else [None] * (len(stages) - 1)
    if len(norms) != len(stages) - 1:
        raise ValueError(f"{where}: need one norm (or None) between each pair of convs")
    rank = len(stages[0].kernel_size)
    for norm, stage in zip(norms + [final_norm], stages):
        problem = None if norm is None else _norm_problem(norm, stage.out_channels, rank)
        if problem:
            raise ValueError(f"{where}: {problem}")
    kernels = [s.kernel_size for s in stages]
    if issubclass(cls, HierarchicalPatchUnembed):  # whose constructor lists the stages finest first
        kernels.reverse()
    module = cls(stages[0].in_channels, stages[-1].out_channels, kernels, norm=None, act=act, dims=rank,
                 device="meta", **kwargs)
    module.stages = nn.ModuleList(stages)
    module.norms = nn.ModuleList(n if n is not None else nn.Identity() for n in norms)
    if final_norm is not None:
        module.final_norm = final_norm
    module._plan = _StemPlan(module._plan.stages,
                             tuple(None if n is None else f"norms.{i}" for i, n in enumerate(norms))
                             + (None if final_norm is None else "final_norm",),
                             module._plan.acts)
    return module


class HierarchicalPatchEmbed(nn.Module):
    """A stack of kernel == stride convs (an hMLP stem): ``Conv(k1) -> norm -> act -> Conv(k2) ->
    ... -> Conv(kL)`` (and optionally a norm and an activation after the last), returning the conv
    stack's result.

    The input is gathered once, with tokens ordered patch-major for the later stages (every group
    of stage-s patches forming a stage-(s+1) patch is a run of contiguous rows), so stages 2..L are
    plain GEMMs on *views* of the previous stage's output, with no gather at all. The channels-first
    result shares those tokens' memory (strided like channels_last), so ``flatten(2).transpose(1, 2)``
    after it is free.
    """

    def __init__(self, in_chans: int, embed_dim: int, stages: Sequence = (4, 2, 2), *,
                 hidden_dim: Optional[int] = None, norm: Optional[str] = "instance",
                 act: Optional[str] = "gelu", bias: bool = True, dims: int = 3,
                 out_format: str = "channels_first", device=None, dtype=None):
        super().__init__()
        if not stages:
            raise ValueError("HierarchicalPatchEmbed: stages must not be empty")
        if act not in _ACTS:
            raise ValueError(f"HierarchicalPatchEmbed: act must be one of {list(_ACTS)}, got {act!r}")
        if dims not in (1, 2, 3):
            raise ValueError(f"HierarchicalPatchEmbed: dims must be 1, 2 or 3, got {dims!r}")
        check_format("HierarchicalPatchEmbed: out_format", out_format)
        factory = {"device": device, "dtype": dtype}
        hidden = hidden_dim or max(1, embed_dim // 4)
        kernels = [_as_tuple(k, dims, "HierarchicalPatchEmbed: stages[i]") for k in stages]
        widths = [in_chans] + [hidden] * (len(kernels) - 1) + [embed_dim]
        self.stages = nn.ModuleList(
            PatchEmbed(widths[i], widths[i + 1], kernels[i], bias, dims=dims, **factory)
            for i in range(len(kernels)))
        self.norms = nn.ModuleList(_make_norm(norm, w, dims, factory) or nn.Identity() for w in widths[1:-1])
        self.out_format, self.dims = out_format, dims
        self._plan = _StemPlan.native(len(kernels), norm is not None, act)

    @classmethod
    def from_convs(cls, convs: Sequence[nn.Module], norms: Optional[Sequence[Optional[nn.Module]]] = None,
                   act: Optional[str] = "gelu", out_format: str = "channels_first",
                   final_norm: Optional[nn.Module] = None) -> "HierarchicalPatchEmbed":
        """The stem computing ``convs[0] -> norms[0] -> act -> convs[1] -> ... -> convs[-1] ->
        final_norm``, sharing their parameters. A norm is an InstanceNorm (or GroupNorm with a group
        per channel), fused with the activation, or any other norm module that does not depend on
        the order of positions (a custom RMS instance norm, say), run as it is; None for none."""
        return _stem_from_convs(cls, convs, norms, act, final_norm, PatchEmbed.from_conv, out_format=out_format)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, out_format: str = "channels_first") -> "HierarchicalPatchEmbed":
        """The stem computing ``seq``, an ``nn.Sequential`` of kernel == stride convs, each followed
        by an optional norm and an optional activation (as MATEY's or Multiple Physics
        Pretraining's ``hMLP_stem``), two convs or more. It holds ``seq``'s own modules under their
        names, so ``seq``'s ``state_dict`` loads into it unchanged. ValueError where ``seq`` is not
        such a stem."""
        check_format("HierarchicalPatchEmbed: out_format", out_format)
        return _stem_from_sequential(cls, seq, _CONVS, PatchEmbed.from_conv, out_format=out_format)

    def forward(self, x: Tensor) -> Tensor:
        stages, norms, acts = self._plan.resolve(self)
        first = stages[0]
        kernels = [s.kernel_size for s in stages]
        total = [math.prod([k[d] for k in kernels]) for d in range(self.dims)]
        if x.dim() != self.dims + 2:
            raise RuntimeError(f"HierarchicalPatchEmbed: x must be [B, {first.in_channels}, *S] with {self.dims} "
                               f"spatial dims, got shape {tuple(x.shape)}")
        # Stage by stage where each conv leaves out what fills no patch, and on the CPU, where every
        # path is ATen's: there the token-ordered gather and the norms over tokens cost more than the
        # channels-first GEMMs and ATen's own norms one stage after the other (bench H1).
        if x.device.type == "cpu" or any(s % t for s, t in zip(x.shape[2:], total)):
            return self._stage_by_stage(x, stages, norms, acts)
        grid = [s // t for s, t in zip(x.shape[2:], total)]
        # Stage-1 tokens ordered (final grid, k_L, ..., k_2): coarse first.
        levels = grid + [v for k in reversed(kernels[1:]) for v in k]
        x, w, b = autocast(x, first.weight, first.bias)
        y = _call("patch_embed", x, w, b, True, levels)  # [B, N1, C1]
        for i, stage in enumerate(stages):
            if i > 0:
                patch = math.prod(stage.kernel_size)
                rows = y.reshape(y.shape[0], y.shape[1] // patch, patch * y.shape[2])  # a view
                y = nn.functional.linear(rows, _tokens_weight(stage.weight, False).to(rows.dtype),
                                         None if stage.bias is None else stage.bias.to(rows.dtype))
            if norms[i] is not None or acts[i] is not None:
                # stage i's tokens cover the final grid times the later stages' kernels
                stage_grid = [g * math.prod([k[d] for k in kernels[i + 1:]]) for d, g in enumerate(grid)]
                y = _norm_act(y, norms[i], acts[i], stage_grid)
        if self.out_format == "tokens":
            return y
        # (an _unsafe_view: the same strides as the view, but not a view for FSDP2 to warn about)
        return unsafe_view(y.transpose(1, 2), (y.shape[0], y.shape[2], *grid))

    def _stage_by_stage(self, x: Tensor, stages, norms, acts) -> Tensor:
        """The stem as its convs compute it, one after the other: for sizes that the total patch does
        not divide, where a stage's grid is not the next stage's patches exactly, and on the CPU."""
        for stage, norm, act in zip(stages, norms, acts):
            x = _norm_act(F.patch_embed_unchecked(x, stage.weight, stage.bias, "channels_first", None), norm, act, None)
        return x.flatten(2).transpose(1, 2) if self.out_format == "tokens" else x


class HierarchicalPatchUnembed(nn.Module):
    """The inverse stack: ``ConvTranspose(kL) -> norm -> act -> ... -> ConvTranspose(k1)`` (``stages``
    listed finest first, as for :class:`HierarchicalPatchEmbed`), optionally with a norm and an
    activation after the last. Stages L..2 are GEMMs producing rows in patch-major order; the last
    is one GEMM + one scatter."""

    def __init__(self, embed_dim: int, out_chans: int, stages: Sequence = (4, 2, 2), *,
                 hidden_dim: Optional[int] = None, norm: Optional[str] = "instance",
                 act: Optional[str] = "gelu", bias: bool = True, dims: int = 3,
                 in_format: str = "channels_first", device=None, dtype=None):
        super().__init__()
        if not stages:
            raise ValueError("HierarchicalPatchUnembed: stages must not be empty")
        if act not in _ACTS:
            raise ValueError(f"HierarchicalPatchUnembed: act must be one of {list(_ACTS)}, got {act!r}")
        if dims not in (1, 2, 3):
            raise ValueError(f"HierarchicalPatchUnembed: dims must be 1, 2 or 3, got {dims!r}")
        check_format("HierarchicalPatchUnembed: in_format", in_format)
        factory = {"device": device, "dtype": dtype}
        hidden = hidden_dim or max(1, embed_dim // 4)
        kernels = [_as_tuple(k, dims, "HierarchicalPatchUnembed: stages[i]") for k in stages]
        # Applied coarse to fine: stages[-1] first.
        widths = [embed_dim] + [hidden] * (len(kernels) - 1) + [out_chans]
        order = list(reversed(kernels))
        self.stages = nn.ModuleList(
            PatchUnembed(widths[i], widths[i + 1], order[i], bias, dims=dims, **factory)
            for i in range(len(order)))
        self.norms = nn.ModuleList(_make_norm(norm, w, dims, factory) or nn.Identity() for w in widths[1:-1])
        self.in_format, self.dims = in_format, dims
        self._plan = _StemPlan.native(len(kernels), norm is not None, act)

    @classmethod
    def from_convs(cls, convs: Sequence[nn.Module], norms: Optional[Sequence[Optional[nn.Module]]] = None,
                   act: Optional[str] = "gelu", in_format: str = "channels_first",
                   final_norm: Optional[nn.Module] = None) -> "HierarchicalPatchUnembed":
        """The stack computing ``convs[0] -> norms[0] -> act -> convs[1] -> ... -> final_norm``
        (ConvTranspose modules in application order, coarse first), sharing their parameters; norms
        as for :meth:`HierarchicalPatchEmbed.from_convs`."""
        return _stem_from_convs(cls, convs, norms, act, final_norm, PatchUnembed.from_conv_transpose,
                                in_format=in_format)

    @classmethod
    def from_sequential(cls, seq: nn.Sequential, in_format: str = "channels_first") -> "HierarchicalPatchUnembed":
        """The stack computing ``seq``, an ``nn.Sequential`` of kernel == stride ConvTranspose
        modules, each followed by an optional norm and an optional activation (as the
        ``hMLP_output`` of MATEY or Multiple Physics Pretraining), keeping ``seq``'s parameter names;
        as :meth:`HierarchicalPatchEmbed.from_sequential`."""
        check_format("HierarchicalPatchUnembed: in_format", in_format)
        return _stem_from_sequential(cls, seq, _CONV_TRANSPOSES, PatchUnembed.from_conv_transpose,
                                     in_format=in_format)

    def forward(self, x: Tensor, grid: Optional[Sequence[int]] = None) -> Tensor:
        stages, norms, acts = self._plan.resolve(self)
        first = stages[0]
        if self.in_format == "channels_first":
            if x.dim() != self.dims + 2 or x.shape[1] != first.in_channels:
                raise RuntimeError(f"HierarchicalPatchUnembed: x must be [B, {first.in_channels}, *grid], got {tuple(x.shape)}")
            grid = list(x.shape[2:])
            y = x.flatten(2).transpose(1, 2)
        else:
            if grid is None or len(grid) != self.dims:
                raise ValueError(f"HierarchicalPatchUnembed: tokens input needs grid with {self.dims} sizes")
            grid = as_grid(grid, "HierarchicalPatchUnembed")
            if x.dim() != 3 or x.shape[1] != math.prod(grid) or x.shape[2] != first.in_channels:
                raise RuntimeError(
                    f"HierarchicalPatchUnembed: x must be [B, {math.prod(grid)}, {first.in_channels}] for grid "
                    f"{tuple(grid)}, got {tuple(x.shape)}")
            y = x
        y, = autocast(y)
        for i, stage in enumerate(stages[:-1]):
            patch = math.prod(stage.kernel_size)
            bias = None if stage.bias is None else stage.bias.repeat(patch).to(y.dtype)
            y = nn.functional.linear(y, _tokens_weight(stage.weight, True).t().to(y.dtype), bias)
            y = y.reshape(y.shape[0], y.shape[1] * patch, stage.out_channels)  # a view
            if norms[i] is not None or acts[i] is not None:
                stage_grid = [g * math.prod([s.kernel_size[d] for s in stages[:i + 1]]) for d, g in enumerate(grid)]
                y = _norm_act(y, norms[i], acts[i], stage_grid)
        last = stages[-1]
        # Scatter with the token order the stages produced: (grid, k_L, ..., k_2).
        levels = grid + [v for s in stages[:-1] for v in s.kernel_size]
        _, w, b = autocast(y, last.weight, last.bias)
        out = _call("patch_unembed", y, w, b, True, levels)
        return _norm_act(out, norms[-1], acts[-1], None)
