"""Hierarchical (hMLP) stems: a stack of kernel == stride convs (or their transposes), each stage
after the first a GEMM on a view of the one before."""

import copy
import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import functional as F
from .._args import as_grid, autocast, check_format, unsafe_view
from .._functorch import call as _call
from ..fp8 import Float8Recipe
from ..fp8 import resolve as resolve_fp8
from .conv import CONV_TRANSPOSES, CONVS, PatchEmbed, PatchUnembed, as_sizes, patch_conv_problem

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
    instance_norm_act (one fused pass with an exact GELU after them), except on the CPU, where that
    op is ATen's batch norm and GELU anyway and its backward, which recomputes the norm's output
    from the saved statistics, runs slower than their autograd (bench H1: 0.85x); any other norm is
    the module itself, on a channels-first view of the tokens."""
    tokens = grid is not None
    if norm is None:
        return _act(y, act)
    if _instance_like(norm) and not y.is_cpu:
        fused = act == "gelu" or (type(act) is nn.GELU and act.approximate == "none")
        y = F.instance_norm_act(y, norm.weight, norm.bias, eps=norm.eps, act="gelu" if fused else None,
                                layout="tokens" if tokens else "channels_first")
        return y if fused else _act(y, act)
    if tokens:  # (the norm's output copied to tokens: the activation and its gradient then share a
        # layout; on a tokens view of channels-first memory, the CPU's GELU backward meets its gradient
        # in the other layout and walks it element by element, 20x slower than the copy)
        return _act(norm(y.transpose(1, 2).unflatten(2, list(grid))).flatten(2).transpose(1, 2).contiguous(), act)
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


class StemNormError(ValueError):
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
        reason = patch_conv_problem(conv)
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
            raise StemNormError(f"{where}: layer {norm}: {problem}")
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
    after it is free. ``fp8`` (``True``, a ``Float8Recipe``): every stage's GEMM in FP8, the stages
    one after the other, the norms in the compute dtype; only when asked, as for PatchEmbed.
    """

    fp8 = False  # (stems built by from_convs / from_sequential: set it to run them in FP8)

    def __init__(self, in_chans: int, embed_dim: int, stages: Sequence = (4, 2, 2), *,
                 hidden_dim: Optional[int] = None, norm: Optional[str] = "instance",
                 act: Optional[str] = "gelu", bias: bool = True, dims: int = 3,
                 out_format: str = "channels_first", device=None, dtype=None,
                 fp8: Union[bool, Float8Recipe] = False):
        super().__init__()
        if not stages:
            raise ValueError("HierarchicalPatchEmbed: stages must not be empty")
        resolve_fp8("HierarchicalPatchEmbed", fp8)  # checks its type
        self.fp8 = fp8
        if act not in _ACTS:
            raise ValueError(f"HierarchicalPatchEmbed: act must be one of {list(_ACTS)}, got {act!r}")
        if dims not in (1, 2, 3):
            raise ValueError(f"HierarchicalPatchEmbed: dims must be 1, 2 or 3, got {dims!r}")
        check_format("HierarchicalPatchEmbed: out_format", out_format)
        factory = {"device": device, "dtype": dtype}
        hidden = hidden_dim if hidden_dim is not None else max(1, embed_dim // 4)
        kernels = [as_sizes(k, dims, "HierarchicalPatchEmbed: stages[i]") for k in stages]
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
        return _stem_from_sequential(cls, seq, CONVS, PatchEmbed.from_conv, out_format=out_format)

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
        recipe = resolve_fp8("HierarchicalPatchEmbed", self.fp8, region=False)
        if recipe is not None or x.device.type == "cpu" or any(s % t for s, t in zip(x.shape[2:], total)):
            return self._stage_by_stage(x, stages, norms, acts, recipe)
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

    def _stage_by_stage(self, x: Tensor, stages, norms, acts, recipe) -> Tensor:
        """The stem as its convs compute it, one after the other: for sizes that the total patch does
        not divide, where a stage's grid is not the next stage's patches exactly, on the CPU, and in
        FP8 (`recipe`)."""
        for stage, norm, act in zip(stages, norms, acts):
            # (no name for the conv's output: it is freed once its norm has read it, so the next
            # stage's allocations can reuse that memory while it is still in cache)
            x = _norm_act(F.patch_embed_unchecked(x, stage.weight, stage.bias, "channels_first", None, recipe),
                          norm, act, None)
        return x.flatten(2).transpose(1, 2) if self.out_format == "tokens" else x


class HierarchicalPatchUnembed(nn.Module):
    """The inverse stack: ``ConvTranspose(kL) -> norm -> act -> ... -> ConvTranspose(k1)`` (``stages``
    listed finest first, as for :class:`HierarchicalPatchEmbed`), optionally with a norm and an
    activation after the last. Stages L..2 are GEMMs producing rows in patch-major order; the last
    is one GEMM + one scatter. ``fp8`` as for :class:`HierarchicalPatchEmbed` (in FP8 each stage
    is one FP8 GEMM + one scatter)."""

    fp8 = False

    def __init__(self, embed_dim: int, out_chans: int, stages: Sequence = (4, 2, 2), *,
                 hidden_dim: Optional[int] = None, norm: Optional[str] = "instance",
                 act: Optional[str] = "gelu", bias: bool = True, dims: int = 3,
                 in_format: str = "channels_first", device=None, dtype=None,
                 fp8: Union[bool, Float8Recipe] = False):
        super().__init__()
        if not stages:
            raise ValueError("HierarchicalPatchUnembed: stages must not be empty")
        resolve_fp8("HierarchicalPatchUnembed", fp8)  # checks its type
        self.fp8 = fp8
        if act not in _ACTS:
            raise ValueError(f"HierarchicalPatchUnembed: act must be one of {list(_ACTS)}, got {act!r}")
        if dims not in (1, 2, 3):
            raise ValueError(f"HierarchicalPatchUnembed: dims must be 1, 2 or 3, got {dims!r}")
        check_format("HierarchicalPatchUnembed: in_format", in_format)
        factory = {"device": device, "dtype": dtype}
        hidden = hidden_dim if hidden_dim is not None else max(1, embed_dim // 4)
        kernels = [as_sizes(k, dims, "HierarchicalPatchUnembed: stages[i]") for k in stages]
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
        return _stem_from_sequential(cls, seq, CONV_TRANSPOSES, PatchUnembed.from_conv_transpose,
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
        recipe = resolve_fp8("HierarchicalPatchUnembed", self.fp8, region=False)
        if recipe is not None:  # stage by stage, each channels-first output the next stage's input
            for i, stage in enumerate(stages):
                tokens = i == 0 and self.in_format == "tokens"
                y = F.patch_unembed(y if i else x, stage.weight, stage.bias, in_format="tokens" if tokens else
                                    "channels_first", grid=grid if tokens else None, fp8=recipe)
                y = _norm_act(y, norms[i], acts[i], None)
            return y
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
