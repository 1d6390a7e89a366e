"""Modules: drop-in replacements built on the functional ops."""

import copy
import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import functional as F
from .ops import ops

__all__ = ["GroupedLinear", "GroupedMLP", "GroupedPointwiseConv", "PatchEmbed", "PatchUnembed", "HierarchicalPatchEmbed",
           "HierarchicalPatchUnembed", "convert", "ConvertReport"]


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


# ---- kernel == stride convolutions ----------------------------------------------------------------

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONV_TRANSPOSES = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


class GroupedMLP(nn.Module):
    """``num_groups`` independent gated MLPs, ``dim -> hidden -> out_dim`` (default ``dim``), over the
    groups of ``x``: ``down(silu(gate(x)) * up(x))`` per group (SwiGLU), through grouped_mlp.

    Parameters: ``w_gate_up[G, 2*hidden, dim]`` (gate rows first, then up) and
    ``w_down[G, out_dim, hidden]``, plus ``bias_gate_up[G, 2*hidden]`` / ``bias_down[G, out_dim]``
    when ``bias``; each projection initialised like ``nn.Linear``.
    """

    def __init__(self, num_groups: int, dim: int, hidden: int, activation: str = "swiglu", *,
                 out_dim: Optional[int] = None, bias: bool = False, layout: str = "bgd", device=None, dtype=None):
        super().__init__()
        out_dim = dim if out_dim is None else out_dim
        if activation not in F.ACTIVATIONS:
            raise ValueError(f"GroupedMLP: activation must be one of {F.ACTIVATIONS}, got {activation!r}")
        if layout not in F.LAYOUTS:
            raise ValueError(f"GroupedMLP: layout must be one of {F.LAYOUTS}, got {layout!r}")
        if min(num_groups, dim, hidden, out_dim) < 0:
            raise ValueError(f"GroupedMLP: sizes must be >= 0, got num_groups={num_groups}, dim={dim}, "
                             f"hidden={hidden}, out_dim={out_dim}")
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
                             bias_down=self.bias_down, activation=self.activation)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, dim={self.dim}, hidden={self.hidden}, out_dim={self.out_dim}, "
                f"activation={self.activation!r}, bias={self.bias_down is not None}, layout={self.layout!r}")


def _as_tuple(value, rank: int, name: str) -> Tuple[int, ...]:
    t = tuple(value) if isinstance(value, (tuple, list)) else (value,) * rank
    if len(t) != rank or not all(isinstance(v, int) and v >= 1 for v in t):
        raise ValueError(f"{name} must be a positive int or {rank} positive ints, got {value!r}")
    return t


def _ineligible(module: nn.Module) -> Optional[str]:
    """Why a conv / conv-transpose module is not a kernel == stride patch (un)embedding, or None."""
    if type(module) not in _CONVS + _CONV_TRANSPOSES:
        return f"{type(module).__name__} is not exactly one of the nn.Conv/ConvTranspose classes (custom forward?)"
    reasons = []
    if tuple(module.kernel_size) != tuple(module.stride):
        reasons.append(f"kernel_size {tuple(module.kernel_size)} != stride {tuple(module.stride)}")
    if isinstance(module.padding, str) and module.padding != "valid" or (
            not isinstance(module.padding, str) and any(module.padding)):
        reasons.append(f"padding={module.padding}")
    if any(d != 1 for d in module.dilation):
        reasons.append(f"dilation={tuple(module.dilation)}")
    if module.groups != 1:
        reasons.append(f"groups={module.groups}")
    if module.padding_mode != "zeros":
        reasons.append(f"padding_mode={module.padding_mode!r}")
    if type(module) in _CONV_TRANSPOSES and any(module.output_padding):
        reasons.append(f"output_padding={tuple(module.output_padding)}")
    return ", ".join(reasons) or None


def _pointwise_ineligible(module: nn.Module) -> Optional[str]:
    """Why a conv module is not a grouped pointwise conv (kernel 1, groups > 1), or None."""
    if type(module) not in _CONVS:
        return f"{type(module).__name__} is not exactly nn.Conv1d/2d/3d"
    reasons = []
    if any(k != 1 for k in module.kernel_size) or any(s != 1 for s in module.stride):
        reasons.append(f"kernel_size {tuple(module.kernel_size)} / stride {tuple(module.stride)} are not all 1")
    if isinstance(module.padding, str) and module.padding not in ("valid", "same") or (
            not isinstance(module.padding, str) and any(module.padding)):
        reasons.append(f"padding={module.padding}")
    if any(d != 1 for d in module.dilation):
        reasons.append(f"dilation={tuple(module.dilation)}")
    if module.groups == 1:
        reasons.append("groups=1")
    return ", ".join(reasons) or None


def _init_like_conv(weight: Tensor, bias: Optional[Tensor], fan_in: int) -> None:
    # nn.Conv*'s init: kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)); so is the bias.
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    nn.init.uniform_(weight, -bound, bound)
    if bias is not None:
        nn.init.uniform_(bias, -bound, bound)


class PatchEmbed(nn.Module):
    """Drop-in ``nn.Conv{1,2,3}d(in_channels, embed_dim, patch_size, stride=patch_size)``.

    Parameters ``weight[E, C, *k]`` and ``bias[E]`` have the conv's names and shapes, so a conv's
    ``state_dict`` loads unchanged. ``out_format="tokens"`` returns ``[B, N, E]`` directly (what
    ``conv(x).flatten(2).transpose(1, 2)`` gives); ``pad="dynamic"`` zero-pads non-divisible inputs.
    """

    def __init__(self, in_channels: int, embed_dim: int, patch_size, bias: bool = True, *,
                 dims: Optional[int] = None, out_format: str = "channels_first",
                 pad: Optional[str] = None, device=None, dtype=None):
        super().__init__()
        rank = dims or (len(patch_size) if isinstance(patch_size, (tuple, list)) else 2)
        F._check_format("PatchEmbed: out_format", out_format)
        self.kernel_size = _as_tuple(patch_size, rank, "PatchEmbed: patch_size")
        self.in_channels, self.embed_dim = in_channels, embed_dim
        self.out_format, self.pad = out_format, pad
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(embed_dim, in_channels, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(embed_dim, **factory)) if bias else None
        _init_like_conv(self.weight, self.bias, in_channels * math.prod(self.kernel_size))

    @property
    def stride(self) -> Tuple[int, ...]:
        return self.kernel_size

    def forward(self, x: Tensor) -> Tensor:
        return F.patch_embed(x, self.weight, self.bias, out_format=self.out_format, pad=self.pad)

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


class GroupedPointwiseConv(nn.Module):
    """Drop-in ``nn.Conv{1,2,3}d(in_channels, out_channels, 1, groups=groups)``: G independent
    small linears over the channel groups of every position, through grouped_pointwise_conv.

    Parameters ``weight[C_out, C_in / G, 1, ...]`` and ``bias[C_out]`` as in the conv.
    """

    def __init__(self, in_channels: int, out_channels: int, groups: int, bias: bool = True, *, dims: int = 1,
                 device=None, dtype=None):
        super().__init__()
        if groups < 1 or in_channels % groups or out_channels % groups:
            raise ValueError(f"GroupedPointwiseConv: groups={groups} must divide in_channels={in_channels} and "
                             f"out_channels={out_channels}")
        if dims not in (1, 2, 3):
            raise ValueError(f"GroupedPointwiseConv: dims must be 1, 2 or 3, got {dims}")
        factory = {"device": device, "dtype": dtype}
        self.in_channels, self.out_channels, self.groups, self.dims = in_channels, out_channels, groups, dims
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


class PatchUnembed(nn.Module):
    """Drop-in ``nn.ConvTranspose{1,2,3}d(in_channels, out_channels, patch_size, stride=patch_size)``.

    Parameters ``weight[C_in, C_out, *k]`` and ``bias[C_out]`` as in the ConvTranspose.
    ``in_format="tokens"`` takes ``[B, N, C_in]``; pass ``grid`` to the constructor or to forward.
    """

    def __init__(self, in_channels: int, out_channels: int, patch_size, bias: bool = True, *,
                 dims: Optional[int] = None, in_format: str = "channels_first",
                 grid: Optional[Sequence[int]] = None, device=None, dtype=None):
        super().__init__()
        rank = dims or (len(patch_size) if isinstance(patch_size, (tuple, list)) else 2)
        F._check_format("PatchUnembed: in_format", in_format)
        self.kernel_size = _as_tuple(patch_size, rank, "PatchUnembed: patch_size")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.in_format, self.grid = in_format, None if grid is None else tuple(grid)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(in_channels, out_channels, *self.kernel_size, **factory))
        self.bias = nn.Parameter(torch.empty(out_channels, **factory)) if bias else None
        # ConvTranspose's fan_in, as torch computes it from the weight: dim 1 times the kernel.
        _init_like_conv(self.weight, self.bias, out_channels * math.prod(self.kernel_size))

    @property
    def stride(self) -> Tuple[int, ...]:
        return self.kernel_size

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
    (name, reason) per convolution found; ``model`` is the converted model."""
    model: nn.Module
    swapped: List[Tuple[str, str]] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"patchgemm.convert: swapped {len(self.swapped)}, left {len(self.skipped)}"]
        lines += [f"  swapped {name or '<root>'}: {what}" for name, what in self.swapped]
        lines += [f"  left    {name or '<root>'}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def convert(model: nn.Module, *, inplace: bool = True) -> ConvertReport:
    """Swap every eligible ``nn.Conv{1,2,3}d`` / ``nn.ConvTranspose{1,2,3}d`` (kernel == stride,
    padding 0, dilation 1, groups 1, zeros padding, output_padding 0) for PatchEmbed / PatchUnembed,
    and every grouped pointwise ``nn.Conv{1,2,3}d`` (kernel 1, stride 1, groups > 1) for
    GroupedPointwiseConv, sharing its parameters. Returns a :class:`ConvertReport` (``report.model`` is the model; with
    ``inplace=False`` a converted deep copy, the original untouched)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected an nn.Module, got {type(model).__name__}")
    if not inplace:
        model = copy.deepcopy(model)
    report = ConvertReport(model)

    def replacement(name: str, module: nn.Module) -> Optional[nn.Module]:
        if not isinstance(module, _CONVS + _CONV_TRANSPOSES):
            return None
        reason = _ineligible(module)
        if reason and type(module) in _CONVS and not _pointwise_ineligible(module):
            new = GroupedPointwiseConv.from_conv(module)
        elif reason:
            report.skipped.append((name, reason))
            return None
        else:
            new = (PatchEmbed.from_conv(module) if type(module) in _CONVS
                   else PatchUnembed.from_conv_transpose(module))
        report.swapped.append((name, f"{type(module).__name__} -> {type(new).__name__}"))
        return new

    root = replacement("", model)
    if root is not None:
        report.model = root
        return report
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            new = replacement(f"{parent_name}.{child_name}" if parent_name else child_name, child)
            if new is not None:
                setattr(parent, child_name, new)
    return report


# ---- hierarchical (hMLP) stems --------------------------------------------------------------------

_ACTS = {"gelu": nn.functional.gelu, "relu": nn.functional.relu, "silu": nn.functional.silu, None: None}


def _norm_act_tokens(y: Tensor, norm: Optional[nn.Module], act: Optional[str]) -> Tensor:
    """InstanceNorm over tokens [B, N, C] (per sample and channel, over the N tokens), then the
    activation: one fused op for GELU or none, else the fused norm and then the activation."""
    if norm is None:
        return y if act is None else _ACTS[act](y)
    if act in ("gelu", None):
        return F.instance_norm_act(y, norm.weight, norm.bias, eps=norm.eps, act=act, layout="tokens")
    return _ACTS[act](F.instance_norm_act(y, norm.weight, norm.bias, eps=norm.eps, act=None, layout="tokens"))


def _make_norm(kind: Optional[str], channels: int, rank: int, factory) -> Optional[nn.Module]:
    if kind is None:
        return None
    if kind != "instance":
        raise ValueError(f"norm must be 'instance' or None, got {kind!r}")
    return (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[rank - 1](channels, affine=True, **factory)


def _norms_between(norms: Optional[Sequence[Optional[nn.Module]]], channels: Sequence[int],
                   where: str) -> nn.ModuleList:
    """The norms between consecutive stages (``channels[i]`` features after stage i), checked;
    None (or a None entry) means no norm there."""
    norms = list(norms) if norms is not None else [None] * len(channels)
    if len(norms) != len(channels):
        raise ValueError(f"{where}: need one norm (or None) between each pair of convs")
    for norm, c in zip(norms, channels):
        if norm is None:
            continue
        if not isinstance(norm, (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)) or norm.track_running_stats:
            raise ValueError(f"{where}: norms must be nn.InstanceNorm*d without running stats, got {norm}")
        if norm.affine and norm.num_features != c:
            raise ValueError(f"{where}: norm {norm} does not match {c} channels")
    return nn.ModuleList(n if n is not None else nn.Identity() for n in norms)


def _tokens_weight(weight: Tensor, transposed: bool) -> Tensor:
    """A later stage's weight as a matrix over token rows whose features are (in-patch offset,
    channel), the order the earlier stage's rows arrive in: conv [E, C, *k] -> [E, k.. * C];
    conv-transpose [C_in, C_out, *k] -> [C_in, k.. * C_out]."""
    out, inner = weight.shape[:2]
    return weight.reshape(out, inner, -1).transpose(1, 2).reshape(out, -1)


class HierarchicalPatchEmbed(nn.Module):
    """A stack of kernel == stride convs (an hMLP stem): ``Conv(k1) -> norm -> act -> Conv(k2) ->
    ... -> Conv(kL)``, returning the conv stack's result.

    The input is gathered once, with tokens ordered patch-major for the later stages (every group
    of stage-s patches forming a stage-(s+1) patch is a run of contiguous rows), so stages 2..L are
    plain GEMMs on *views* of the previous stage's output, with no gather at all.
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
        F._check_format("HierarchicalPatchEmbed: out_format", out_format)
        factory = {"device": device, "dtype": dtype}
        hidden = hidden_dim or max(1, embed_dim // 4)
        kernels = [_as_tuple(k, dims, "HierarchicalPatchEmbed: stages[i]") for k in stages]
        widths = [in_chans] + [hidden] * (len(kernels) - 1) + [embed_dim]
        self.stages = nn.ModuleList(
            PatchEmbed(widths[i], widths[i + 1], kernels[i], bias, dims=dims, **factory)
            for i in range(len(kernels)))
        self.norms = nn.ModuleList(_make_norm(norm, w, dims, factory) or nn.Identity() for w in widths[1:-1])
        self.act, self.out_format, self.dims = act, out_format, dims

    @classmethod
    def from_convs(cls, convs: Sequence[nn.Module], norms: Optional[Sequence[nn.Module]] = None,
                   act: Optional[str] = "gelu", out_format: str = "channels_first") -> "HierarchicalPatchEmbed":
        """The stem computing ``convs[0] -> norms[0] -> act -> convs[1] -> ...``, sharing their
        parameters (``norms``: InstanceNorm modules, or None for no norm)."""
        convs = list(convs)
        if not convs:
            raise ValueError("HierarchicalPatchEmbed.from_convs: convs must not be empty")
        stages = [PatchEmbed.from_conv(c) for c in convs]
        for i in range(1, len(stages)):
            if stages[i].in_channels != stages[i - 1].embed_dim or len(stages[i].kernel_size) != len(stages[0].kernel_size):
                raise ValueError(f"HierarchicalPatchEmbed.from_convs: convs[{i}] {convs[i]} does not follow {convs[i - 1]}")
        norms = _norms_between(norms, [s.embed_dim for s in stages[:-1]], "HierarchicalPatchEmbed.from_convs")
        module = cls(stages[0].in_channels, stages[-1].embed_dim, [s.kernel_size for s in stages],
                     norm=None, act=act, dims=len(stages[0].kernel_size), out_format=out_format, device="meta")
        module.stages = nn.ModuleList(stages)
        module.norms = norms
        return module

    def forward(self, x: Tensor) -> Tensor:
        first = self.stages[0]
        kernels = [s.kernel_size for s in self.stages]
        total = [math.prod(k[d] for k in kernels) for d in range(self.dims)]
        if x.dim() != self.dims + 2 or any(s % t for s, t in zip(x.shape[2:], total)):
            raise ValueError(
                f"HierarchicalPatchEmbed: x must be [B, {first.in_channels}, *S] with S divisible by the "
                f"total patch {tuple(total)}, got shape {tuple(x.shape)}")
        grid = [s // t for s, t in zip(x.shape[2:], total)]
        # Stage-1 tokens ordered (final grid, k_L, ..., k_2): coarse first.
        levels = grid + [v for k in reversed(kernels[1:]) for v in k]
        x, w, b = F._autocast(x, first.weight, first.bias)
        y = ops.patch_embed(x, w, b, True, levels)  # [B, N1, C1]
        for stage, norm in zip(self.stages[1:], self.norms):
            y = _norm_act_tokens(y, None if isinstance(norm, nn.Identity) else norm, self.act)
            patch = math.prod(stage.kernel_size)
            rows = y.reshape(y.shape[0], y.shape[1] // patch, patch * y.shape[2])  # a view
            y = nn.functional.linear(rows, _tokens_weight(stage.weight, False).to(rows.dtype),
                                     None if stage.bias is None else stage.bias.to(rows.dtype))
        if self.out_format == "tokens":
            return y
        return y.transpose(1, 2).reshape(y.shape[0], y.shape[2], *grid)


class HierarchicalPatchUnembed(nn.Module):
    """The inverse stack: ``ConvTranspose(kL) -> norm -> act -> ... -> ConvTranspose(k1)`` (``stages``
    listed finest first, as for :class:`HierarchicalPatchEmbed`). Stages L..2 are GEMMs producing
    rows in patch-major order; the last is one GEMM + one scatter."""

    def __init__(self, embed_dim: int, out_chans: int, stages: Sequence = (4, 2, 2), *,
                 hidden_dim: Optional[int] = None, norm: Optional[str] = "instance",
                 act: Optional[str] = "gelu", bias: bool = True, dims: int = 3,
                 in_format: str = "channels_first", device=None, dtype=None):
        super().__init__()
        if not stages:
            raise ValueError("HierarchicalPatchUnembed: stages must not be empty")
        if act not in _ACTS:
            raise ValueError(f"HierarchicalPatchUnembed: act must be one of {list(_ACTS)}, got {act!r}")
        F._check_format("HierarchicalPatchUnembed: in_format", in_format)
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
        self.act, self.in_format, self.dims = act, in_format, dims

    @classmethod
    def from_convs(cls, convs: Sequence[nn.Module], norms: Optional[Sequence[nn.Module]] = None,
                   act: Optional[str] = "gelu", in_format: str = "channels_first") -> "HierarchicalPatchUnembed":
        """The stack computing ``convs[0] -> norms[0] -> act -> convs[1] -> ...`` (ConvTranspose
        modules in application order, coarse first), sharing their parameters."""
        convs = list(convs)
        if not convs:
            raise ValueError("HierarchicalPatchUnembed.from_convs: convs must not be empty")
        stages = [PatchUnembed.from_conv_transpose(c) for c in convs]
        for i in range(1, len(stages)):
            if stages[i].in_channels != stages[i - 1].out_channels:
                raise ValueError(f"HierarchicalPatchUnembed.from_convs: convs[{i}] {convs[i]} does not follow {convs[i - 1]}")
        norms = _norms_between(norms, [s.out_channels for s in stages[:-1]], "HierarchicalPatchUnembed.from_convs")
        module = cls(stages[0].in_channels, stages[-1].out_channels, [s.kernel_size for s in reversed(stages)],
                     norm=None, act=act, dims=len(stages[0].kernel_size), in_format=in_format, device="meta")
        module.stages = nn.ModuleList(stages)
        module.norms = norms
        return module

    def forward(self, x: Tensor, grid: Optional[Sequence[int]] = None) -> Tensor:
        first = self.stages[0]
        if self.in_format == "channels_first":
            if x.dim() != self.dims + 2 or x.shape[1] != first.in_channels:
                raise ValueError(f"HierarchicalPatchUnembed: x must be [B, {first.in_channels}, *grid], got {tuple(x.shape)}")
            grid = list(x.shape[2:])
            y = x.flatten(2).transpose(1, 2)
        else:
            if grid is None or len(grid) != self.dims:
                raise ValueError(f"HierarchicalPatchUnembed: tokens input needs grid with {self.dims} sizes")
            grid = [int(g) for g in grid]
            if x.dim() != 3 or x.shape[1] != math.prod(grid) or x.shape[2] != first.in_channels:
                raise ValueError(
                    f"HierarchicalPatchUnembed: x must be [B, {math.prod(grid)}, {first.in_channels}] for grid "
                    f"{tuple(grid)}, got {tuple(x.shape)}")
            y = x
        y, = F._autocast(y)
        for stage, norm in zip(self.stages[:-1], self.norms):
            patch = math.prod(stage.kernel_size)
            bias = None if stage.bias is None else stage.bias.repeat(patch).to(y.dtype)
            y = nn.functional.linear(y, _tokens_weight(stage.weight, True).t().to(y.dtype), bias)
            y = y.reshape(y.shape[0], y.shape[1] * patch, stage.out_channels)  # a view
            y = _norm_act_tokens(y, None if isinstance(norm, nn.Identity) else norm, self.act)
        last = self.stages[-1]
        # Scatter with the token order the stages produced: (grid, k_L, ..., k_2).
        levels = grid + [v for s in self.stages[:-1] for v in s.kernel_size]
        _, w, b = F._autocast(y, last.weight, last.bias)
        return ops.patch_unembed(y, w, b, True, levels)
