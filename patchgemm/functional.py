"""The functional API: argument handling and autocast, then one registered op."""

import itertools
import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from . import fp8 as _fp8
from ._args import (EMBED_FORMATS, as_grid, as_int, autocast, autocast_dtype, check_format, check_optional_tensor,
                    check_pad, unsafe_view)
from ._functorch import call as _call
from .fp8 import Float8History, Float8Recipe, Float8Weight

LAYOUTS = ("bgd", "gbd")


def grouped_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, layout: str = "bgd", *,
                   group_sizes=None, offsets=None, fp8: Union[None, bool, Float8Recipe] = None,
                   fp8_weight: Optional[Float8Weight] = None, fp8_history: Optional[Float8History] = None) -> Tensor:
    """G independent linears over the groups of ``x``, as one strided-batched GEMM.

    Args:
        x: ``layout="bgd"``: ``[..., G, Din]`` (groups second-to-last), or flattened ``[B*G, Din]``
            (rows ordered batch-major, group-minor; G is taken from ``weight``).
            ``layout="gbd"``: ``[G, ..., Din]`` (group-major).
        weight: ``[G, Dout, Din]``, the nn.Linear convention: ``torch.stack([l.weight for l in linears])``.
        bias: ``[G, Dout]`` or None.
        layout: ``"bgd"`` or ``"gbd"``.
        group_sizes: ragged groups (a mixture of experts' expert layers): ``x`` is ``[N, Din]``
            sorted by group and group g has ``group_sizes[g]`` rows (sizes may be 0, the sum is N);
            a sequence of ints or a 1-D integer tensor on the CPU or on x's device. A GPU tensor
            of sizes costs no host sync where ``torch._grouped_mm`` runs the problem (bfloat16 on
            sm_90+); in other dtypes one by default (cuBLAS reads the sizes on the host), none
            during CUDA-graph capture or under ``torch.cuda.set_sync_debug_mode("error")``, where
            our kernels read them on the GPU.
        offsets: instead of ``group_sizes``, their cumulative sums (``torch._grouped_mm``'s
            ``offs``): group g is rows ``offsets[g-1]:offsets[g]``.
        fp8: run in FP8 (patchgemm.fp8): ``True`` (the default recipe), a ``Float8Recipe``, ``False``
            (never), or None (the enclosing ``fp8_autocast`` region's choice). Ragged groups compute
            their weight gradient in the compute dtype.
        fp8_weight: ``quantize_weight(weight)``, made earlier: the FP8 copy of ``weight`` this call
            uses instead of quantizing it (reused across the microbatches of one optimizer step;
            stale once the weight changes). Needs FP8 on; not with ragged groups.
        fp8_history: this layer's ``Float8History``, which a delayed-scaling recipe needs (made
            once per layer, kept across steps).

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
        raise RuntimeError(f"grouped_linear: weight must be [G, Dout, Din], got shape {tuple(weight.shape)}")
    check_optional_tensor(bias, "grouped_linear: bias")
    recipe = _fp8.resolve("grouped_linear", fp8)
    ragged = group_sizes is not None or offsets is not None
    _fp8.check_history("grouped_linear", recipe, fp8_history)
    if fp8_weight is not None:
        if not isinstance(fp8_weight, Float8Weight):
            raise TypeError(f"grouped_linear: fp8_weight must be a patchgemm.Float8Weight (quantize_weight) or "
                            f"None, got {type(fp8_weight).__name__}")
        if recipe is None:
            raise ValueError("grouped_linear: fp8_weight is given but this call does not run in FP8 (fp8=False, "
                             "or None outside an fp8_autocast region)")
        if ragged:
            raise ValueError("grouped_linear: fp8_weight applies to dense groups; ragged groups quantize their "
                             "weight per call")
    if ragged:
        rows = x.shape[0] // max(weight.shape[0], 1) if x.dim() else 0  # (x's shape is checked below)
        if recipe is not None and _fp8.region_declines("grouped_linear", fp8, rows, weight, x.device, ragged=True):
            recipe = None
        return _ragged_grouped_linear(x, weight, bias, group_sizes, offsets, recipe, fp8_history)
    groups, out_features, in_features = weight.shape
    if x.dim() not in (0, 1, 3) and x.shape[-1] != in_features:  # (the op's check would name the 3-D view)
        raise RuntimeError(f"grouped_linear: x has {x.shape[-1]} features in its last dim (shape {tuple(x.shape)}) "
                           f"but weight [G, Dout, Din] expects {in_features} (shape {tuple(weight.shape)})")
    if x.dim() == 3:  # the op's own form, in either layout
        x3 = x
    elif layout == "bgd":
        if x.dim() == 2:  # [B*G, Din]
            if x.shape[0] % max(groups, 1) != 0 or (groups == 0 and x.shape[0] != 0):
                raise RuntimeError(
                    f"grouped_linear: flattened x {tuple(x.shape)} must have a multiple of G={groups} "
                    f"rows (weight {tuple(weight.shape)})")
            x3 = x.reshape(x.shape[0] // groups if groups else 1, groups, x.shape[1])
        elif x.dim() >= 3:
            x3 = x.reshape(math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])
        else:
            raise RuntimeError(
                f"grouped_linear: x must be [..., G, Din] or [B*G, Din] for layout 'bgd', got shape {tuple(x.shape)}")
    else:
        if x.dim() < 2:
            raise RuntimeError(
                f"grouped_linear: x must be [G, ..., Din] for layout 'gbd', got shape {tuple(x.shape)}")
        x3 = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])

    if recipe is not None and _fp8.region_declines("grouped_linear", fp8, x3.shape[layout == "gbd"], weight,
                                                   x3.device):
        recipe, fp8_weight = None, None  # (a region's call: a weight copy made for it goes unused)
    y = _grouped_linear_3d(x3, weight, bias, layout == "gbd", recipe, fp8_weight, fp8_history)
    if x.dim() == 3:
        return y
    # As nn.Linear on N-D x: the result is y's memory but not a view of it, so a module returning it
    # returns no view (FSDP2 warns about those: an in-place op on one would skip its hooks).
    return unsafe_view(y, (*x.shape[:-1], out_features))


def _grouped_linear_3d(x3, weight, bias, group_major, recipe, fp8_weight=None, fp8_history=None):
    """The op on a 3-D x: in autocast's dtype (its casts), or in FP8 with `recipe`, which quantizes x
    and the weight (unless `fp8_weight` is its copy) from their own dtypes and writes autocast's
    (else x's)."""
    if recipe is not None:
        return _fp8.grouped_linear(x3, weight, bias, group_major, recipe, autocast_dtype(x3) or x3.dtype, fp8_weight,
                                   fp8_history)
    return _call("grouped_linear", *autocast(x3, weight, bias), group_major)


def _ragged_grouped_linear(x, weight, bias, group_sizes, offsets, recipe, fp8_history=None):
    """The ragged op with the group bounds as offsets (a tensor), in autocast's dtype or in FP8."""
    if recipe is not None:
        ends = _ragged_ends(x, weight, group_sizes, offsets)
        return _fp8.ragged_grouped_linear(x, weight, bias, ends, recipe, autocast_dtype(x) or x.dtype, fp8_history)
    x, weight, bias = autocast(x, weight, bias)
    return _call("ragged_grouped_linear", x, weight, bias, _ragged_ends(x, weight, group_sizes, offsets))


def _ragged_ends(x, weight, group_sizes, offsets):
    """group_sizes or offsets as the offsets tensor the ragged ops take (checked here where given as a
    sequence; the ops check a tensor's values)."""
    if group_sizes is None and isinstance(offsets, Tensor):  # the op checks x and them
        return offsets
    if group_sizes is not None and offsets is not None:
        raise ValueError("grouped_linear: give group_sizes or offsets, not both")
    if x.dim() != 2:
        raise RuntimeError(f"grouped_linear: with group sizes, x must be [N, Din] sorted by group, got shape {tuple(x.shape)}")
    given = group_sizes if group_sizes is not None else offsets
    name = "group_sizes" if group_sizes is not None else "offsets"
    if isinstance(given, Tensor):
        if given.dim() != 1 or given.dtype not in (torch.int32, torch.int64):
            raise RuntimeError(f"grouped_linear: {name} must be a 1-D int32/int64 tensor, got {given.dtype} {tuple(given.shape)}")
        if group_sizes is not None:
            ends = torch.cumsum(given, 0, dtype=torch.int32 if given.is_cuda else torch.int64)
        else:
            ends = given
    else:
        if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__"):
            raise TypeError(f"grouped_linear: {name} must be a sequence of ints or a 1-D int32/int64 tensor, "
                            f"got {type(given).__name__} {given!r}")
        values = [as_int(v, f"grouped_linear: each of {name}") for v in given]
        if group_sizes is not None:
            if any(v < 0 for v in values):
                raise RuntimeError(f"grouped_linear: group_sizes must be >= 0, got {values}")
            values = list(itertools.accumulate(values))
        ends = torch.tensor(values, dtype=torch.int64)
    if ends.shape[0] != weight.shape[0]:
        raise RuntimeError(f"grouped_linear: {name} has {ends.shape[0]} entries but weight {tuple(weight.shape)} "
                         f"has {weight.shape[0]} groups")
    return ends


def grouped_pointwise_conv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, groups: int = 1) -> Tensor:
    """``F.conv{1,2,3}d(x, weight, bias, groups=groups)`` for a kernel of size 1: G independent small
    linears over the channel groups of every position.

    Args:
        x: ``[B, C_in, *spatial]`` (1 to 3 spatial dims), or unbatched ``[C_in, *spatial]``.
        weight: ``[C_out, C_in / groups, 1, ...]``, the conv layout.
        bias: ``[C_out]`` or None.

    The output takes the memory format ``x`` suggests, as the conv's does: channels_last(_3d) x is
    one strided-batched GEMM over the groups; other x runs channels-first (one GEMM per sample).
    """
    if not isinstance(x, Tensor) or not isinstance(weight, Tensor):
        raise TypeError("grouped_pointwise_conv: x and weight must be tensors")
    check_optional_tensor(bias, "grouped_pointwise_conv: bias")
    unbatched = x.dim() == weight.dim() - 1
    if unbatched:
        x = x.unsqueeze(0)
    groups = as_int(groups, "grouped_pointwise_conv: groups")
    x, weight, bias = autocast(x, weight, bias)
    y = _call("grouped_pointwise_conv", x, weight, bias, groups)
    return y.squeeze(0) if unbatched else y


def swiglu(gate_up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` where ``gate, up = gate_up.chunk(2, -1)``, in one pass over memory.

    ``gate_up`` is ``[..., 2H]``: a row's gate projection then its up projection, as one GEMM on a
    ``[2H, D]`` weight (``torch.cat([w_gate, w_up])``) makes them. Returns ``[..., H]``. Backward
    reads ``gate_up`` again instead of saving the activation.
    """
    if not isinstance(gate_up, Tensor):
        raise TypeError("swiglu: gate_up must be a tensor")
    return _call("swiglu", gate_up)


ACTIVATIONS = ("swiglu",)


def grouped_mlp(x: Tensor, w_gate_up: Tensor, w_down: Tensor, layout: str = "bgd", *,
                bias_gate_up: Optional[Tensor] = None, bias_down: Optional[Tensor] = None,
                activation: str = "swiglu", fp8: Union[None, bool, Float8Recipe] = None,
                fp8_weights: Optional[Sequence[Float8Weight]] = None,
                fp8_histories: Optional[Sequence[Float8History]] = None) -> Tensor:
    """A gated MLP per group: ``down_g(silu(gate_g(x_g)) * up_g(x_g))`` for the G groups of ``x``.

    Args:
        x: ``[..., G, D]`` (``layout="bgd"``) or ``[G, ..., D]`` (``"gbd"``), as for grouped_linear.
        w_gate_up: ``[G, 2H, D]``: per group the gate weight (rows ``:H``) then the up weight
            (rows ``H:``), each in the nn.Linear convention.
        w_down: ``[G, D_out, H]``.
        bias_gate_up, bias_down: ``[G, 2H]`` and ``[G, D_out]``, or None.
        activation: ``"swiglu"``.
        fp8: both GEMMs in FP8, as grouped_linear's ``fp8`` (the activation in the compute dtype).
        fp8_weights: ``(quantize_weight(w_gate_up), quantize_weight(w_down))``, as grouped_linear's
            ``fp8_weight``.
        fp8_histories: two ``Float8History``, of the gate-up and the down GEMM, as grouped_linear's
            ``fp8_history``.

    Three GEMMs and one fused activation: gate and up are one strided-batched GEMM, the activation
    reads its output in place and writes h, the down GEMM reads h; backward likewise (one fused
    kernel for the activation's gradient). Saved for backward: x, gate_up and h.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"grouped_mlp: activation must be one of {ACTIVATIONS}, got {activation!r}")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(w, Tensor):
            raise TypeError(f"grouped_mlp: {name} must be a tensor, got {type(w).__name__}")
        if w.dim() != 3:
            raise RuntimeError(f"grouped_mlp: {name} must be a 3-D tensor, got shape {tuple(w.shape)}")
    check_optional_tensor(bias_gate_up, "grouped_mlp: bias_gate_up")
    check_optional_tensor(bias_down, "grouped_mlp: bias_down")
    groups, two_hidden, _ = w_gate_up.shape
    if two_hidden % 2 or w_down.shape[0] != groups or w_down.shape[2] * 2 != two_hidden:
        raise RuntimeError(
            f"grouped_mlp: w_gate_up must be [G, 2H, D] and w_down [G, D_out, H] with the same G and H, got "
            f"{tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    if fp8_weights is not None and (isinstance(fp8_weights, Float8Weight) or len(fp8_weights) != 2):
        raise TypeError("grouped_mlp: fp8_weights must be two patchgemm.Float8Weight, of w_gate_up and w_down")
    w8_gate_up, w8_down = (None, None) if fp8_weights is None else fp8_weights
    h_gate_up, h_down = _two_histories("grouped_mlp", _fp8.resolve("grouped_mlp", fp8), fp8_histories)
    # On the CPU the hidden activations of a [B, G, D] x live group-major, [G, B, 2H]: the GEMMs
    # then read and write whole matrices, where ATen's batched GEMMs would first copy batches that
    # interleave in memory (the GPU's strided-batched GEMMs read either layout at the same cost).
    if isinstance(x, Tensor) and x.dim() == 3 and layout in ("bgd", "gbd"):  # (named as given, not as a view)
        g_dim = 1 if layout == "bgd" else 0
        if x.shape[g_dim] != groups or x.shape[2] != w_gate_up.shape[2]:
            want = f"[B, {groups}, {w_gate_up.shape[2]}]" if g_dim else f"[{groups}, B, {w_gate_up.shape[2]}]"
            raise RuntimeError(f"grouped_mlp: x must be {want} (layout {layout!r}) for w_gate_up "
                               f"{tuple(w_gate_up.shape)}, got shape {tuple(x.shape)}")
    hidden_group_major = layout == "bgd" and isinstance(x, Tensor) and x.dim() == 3 and x.device.type == "cpu"
    gate_up = grouped_linear(x.transpose(0, 1) if hidden_group_major else x, w_gate_up, bias_gate_up,
                             "gbd" if hidden_group_major else layout, fp8=fp8, fp8_weight=w8_gate_up,
                             fp8_history=h_gate_up)
    h = swiglu(gate_up)
    return grouped_linear(h.transpose(0, 1) if hidden_group_major else h, w_down, bias_down, layout, fp8=fp8,
                          fp8_weight=w8_down, fp8_history=h_down)


def _two_histories(where: str, recipe: Optional[Float8Recipe], histories) -> Tuple[Optional[Float8History], ...]:
    """The gate-up and the down GEMM's Float8History of a gated MLP (None, None where none are given)."""
    if histories is not None and (not isinstance(histories, (tuple, list)) or len(histories) != 2
                                  or not all(isinstance(h, Float8History) for h in histories)):
        raise TypeError(f"{where}: fp8_histories must be two patchgemm.Float8History, of the gate-up and the down "
                        f"GEMM")
    if histories is None and recipe is not None and recipe.delayed:
        raise ValueError(f"{where}: a delayed-scaling recipe keeps an amax history per GEMM: pass fp8_histories="
                         f"(patchgemm.Float8History(), patchgemm.Float8History()), made once per layer and kept "
                         f"across steps (the modules keep their own)")
    return (None, None) if histories is None else tuple(histories)


def moe_experts(x: Tensor, expert_index: Tensor, expert_weight: Tensor, w_gate_up: Tensor, w_down: Tensor, *,
                fp8: Union[None, bool, Float8Recipe] = None,
                fp8_histories: Optional[Sequence[Float8History]] = None) -> Tensor:
    """The routed experts of a mixture of experts: for each token, the SwiGLU MLPs of the experts
    its router picked, weighted and summed.

    Args:
        x: ``[T, D]``, the tokens.
        expert_index: ``[T, k]`` integers, each token's k experts; the value E (the number of
            experts) marks a slot with no expert (it adds nothing).
        expert_weight: ``[T, k]``, the router's weight of each.
        w_gate_up: ``[E, 2H, D]``, per expert the gate weight (rows ``:H``) then the up weight.
        w_down: ``[E, D, H]``.
        fp8: both ragged GEMMs in FP8, as grouped_linear's ``fp8`` (the SwiGLU in the compute dtype).
        fp8_histories: two ``Float8History``, of the gate-up and the down GEMM, as grouped_mlp's
            (a delayed-scaling recipe needs them; ``MoEExperts`` keeps its own).

    Returns ``[T, D]`` in x's dtype: ``sum_j expert_weight[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``
    with ``e = expert_index[t, j]``, as transformers' Mixtral, Qwen-MoE, OLMoE and DeepSeek experts
    compute it (their ``gate_up_proj`` / ``down_proj`` layout). The T k token-expert pairs are sorted by
    expert and run as two ragged grouped GEMMs with the fused SwiGLU between them; the group
    offsets stay on x's device (host syncs as ``grouped_linear``'s ``group_sizes`` says).
    """
    for name, t in (("x", x), ("expert_index", expert_index), ("expert_weight", expert_weight),
                    ("w_gate_up", w_gate_up), ("w_down", w_down)):
        if not isinstance(t, Tensor):
            raise TypeError(f"moe_experts: {name} must be a tensor, got {type(t).__name__}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3 or w_gate_up.shape[1] % 2 or w_down.shape[0] != w_gate_up.shape[0] \
            or w_down.shape[2] * 2 != w_gate_up.shape[1] or w_down.shape[1] != w_gate_up.shape[2]:
        raise RuntimeError(f"moe_experts: w_gate_up must be [E, 2H, D] and w_down [E, D, H] with the same E, H and D, "
                           f"got {tuple(w_gate_up.shape)} and {tuple(w_down.shape)}")
    experts, _, dim = w_gate_up.shape
    if experts == 0:
        raise RuntimeError(f"moe_experts: w_gate_up {tuple(w_gate_up.shape)} has no experts (E = 0)")
    if x.dim() != 2 or x.shape[1] != dim:
        raise RuntimeError(f"moe_experts: x must be [T, D] with D = {dim} (w_gate_up {tuple(w_gate_up.shape)}), "
                           f"got shape {tuple(x.shape)}")
    if expert_index.dim() != 2 or expert_index.shape[0] != x.shape[0] or expert_index.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"moe_experts: expert_index must be [T, k] int32/int64 with T = {x.shape[0]} (x "
                           f"{tuple(x.shape)}), got {expert_index.dtype} {tuple(expert_index.shape)}")
    if expert_weight.shape != expert_index.shape:
        raise RuntimeError(f"moe_experts: expert_weight must have expert_index's shape {tuple(expert_index.shape)}, "
                           f"got {tuple(expert_weight.shape)}")
    tokens, top_k = expert_index.shape
    index = expert_index.reshape(-1)
    # An index outside [0, E] is an error, as an out-of-range gather is, checked where the index
    # lives without a host sync: on the CPU at once; on a GPU a device-side assert (the next
    # synchronizing call raises, and the CUDA context is lost, as for ATen's index kernels).
    if index.numel() and index.device.type != "meta":
        torch._assert_async(((index >= 0) & (index <= experts)).all(),
                            f"moe_experts: expert_index values must be in [0, E] = [0, {experts}] (E: no expert)")
    weight = expert_weight.reshape(-1)
    # A slot with no expert (index E) runs with the last expert and weight 0: the sizes add up to
    # T k without reading how many such slots there are on the host.
    weight = weight.masked_fill(index >= experts, 0)
    sorted_index, order = torch.sort(index.clamp(max=experts - 1), stable=True)
    bounds = torch.arange(1, experts + 1, device=index.device, dtype=sorted_index.dtype)
    offsets = torch.searchsorted(sorted_index, bounds, out_int32=True)  # pairs of experts <= e
    unsort = torch.empty_like(order)
    unsort[order] = torch.arange(order.shape[0], device=order.device)
    recipe = _fp8.resolve("moe_experts", fp8)
    if recipe is not None and _fp8.region_declines("moe_experts", fp8, index.numel() // experts, w_gate_up,
                                                   x.device, ragged=True):
        recipe = None
    h_gate_up, h_down = _two_histories("moe_experts", recipe, fp8_histories)
    gate_up = grouped_linear(_rows_by_expert(x, order, unsort, top_k), w_gate_up, offsets=offsets, fp8=recipe or False,
                             fp8_history=h_gate_up)
    y = grouped_linear(swiglu(gate_up), w_down, offsets=offsets, fp8=recipe or False,
                       fp8_history=h_down) * weight[order].unsqueeze(-1)
    return _rows_by_slot(y, order, unsort).view(tokens, top_k, dim).sum(1).to(x.dtype)


# The pairs' rows move between (token, slot) order and expert order by gathers both ways: the
# backward of a gather through a permutation is the gather through its inverse, not ATen's
# scatter-add (which sorts its indices), and a token's k pair gradients are summed as the forward
# sums its k outputs.

class _RowsByExpert(torch.autograd.Function):
    """``x[order // k]``: each pair's token row, pairs in expert order; backward: each token's k pair
    gradients, summed."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, order, unsort, top_k):
        return x[order // top_k]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[2])
        ctx.top_k = inputs[3]

    @staticmethod
    def backward(ctx, grad):
        (unsort,) = ctx.saved_tensors
        return grad[unsort].view(-1, ctx.top_k, grad.shape[-1]).sum(1), None, None, None


class _RowsBySlot(torch.autograd.Function):
    """``y[unsort]``: the pairs' rows back in (token, slot) order; backward: ``grad[order]``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(y, order, unsort):
        return y[unsort]

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])

    @staticmethod
    def backward(ctx, grad):
        (order,) = ctx.saved_tensors
        return grad[order], None, None


def _rows_by_expert(x, order, unsort, top_k):
    if torch.is_grad_enabled() and x.requires_grad:
        return _RowsByExpert.apply(x, order, unsort, top_k)
    return x[order // top_k]


def _rows_by_slot(y, order, unsort):
    if torch.is_grad_enabled() and y.requires_grad:
        return _RowsBySlot.apply(y, order, unsort)
    return y[unsort]


# ---- kernel == stride convolutions ----------------------------------------------------------------

def _check_weight(op, weight, bias, layout):
    if not isinstance(weight, Tensor):
        raise TypeError(f"{op}: weight must be a tensor")
    check_optional_tensor(bias, f"{op}: bias")
    if not 3 <= weight.dim() <= 5:
        raise RuntimeError(f"{op}: weight must be {layout} with 1, 2 or 3 kernel dims, got shape {tuple(weight.shape)}")


def patch_embed(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
                out_format: str = "channels_first", pad: Optional[str] = None,
                fp8: Union[bool, Float8Recipe] = False) -> Tensor:
    """``F.conv{1,2,3}d(x, weight, bias, stride=weight.shape[2:])`` as one gather + one GEMM.

    Args:
        x: ``[B, C, *S]`` (or unbatched ``[C, *S]``), any memory format: contiguous,
            ``channels_last`` / ``channels_last_3d`` and other strides (those are copied once).
        weight: ``[E, C, *k]``, the conv layout (conv checkpoints load unchanged).
        bias: ``[E]`` or None.
        out_format: ``"channels_first"`` returns ``[B, E, *grid]`` (what the conv returns, in the
            memory format x suggests, as the conv's); ``"tokens"`` returns ``[B, N, E]`` with N in
            row-major patch-grid order, i.e. ``conv(x).flatten(2).transpose(1, 2)``, written
            directly; ``"channels_last"`` returns ``[B, E, *grid]`` strided like channels_last(_3d)
            whatever x is: those tokens' memory, so ``.flatten(2).transpose(1, 2)`` (or a
            permute to channels-last order) after it costs nothing.
        pad: None: as the conv, the last positions of a spatial dim that fill no whole patch are
            left out (x is read through a view of the rest). ``"dynamic"``: zero-pad at the end of
            each spatial dim up to a multiple instead, like timm's ``dynamic_img_pad`` (one copy of x).
        fp8: ``True`` or a ``Float8Recipe``: the GEMM in FP8 (patchgemm.fp8), the patch matrix and
            the weight quantized to e4m3, the gradient to the recipe's backward format. Only when
            asked: an ``fp8_autocast`` region does not reach patch embeddings.

    Backward computes dW and dbias always and dx only when x requires grad, recomputing the patch
    matrix from x instead of saving it (in FP8 it saves the quantized patch matrix instead).
    """
    check_format("patch_embed: out_format", out_format, EMBED_FORMATS)
    _check_weight("patch_embed", weight, bias, "[E, C, *kernel]")
    check_pad("patch_embed", pad)
    if not isinstance(x, Tensor):
        raise TypeError("patch_embed: x must be a tensor")
    return patch_embed_unchecked(x, weight, bias, out_format, pad, _fp8.resolve("patch_embed", fp8, region=False))


def patch_embed_unchecked(x: Tensor, weight: Tensor, bias: Optional[Tensor], out_format: str, pad: Optional[str],
                          recipe: Optional[Float8Recipe] = None) -> Tensor:
    """patch_embed once its options are checked (PatchEmbed checks them when it is built); `recipe`:
    FP8 (the resolved ``fp8``), else None."""
    rank = weight.dim()
    unbatched = x.dim() == rank - 1
    if unbatched:
        x = x.unsqueeze(0)
    if x.dim() != rank:
        raise RuntimeError(
            f"patch_embed: x must be [B, C, *S] or [C, *S] with {rank - 2} spatial dims to match "
            f"weight {tuple(weight.shape)}, got shape {tuple(x.shape)}")
    if pad is not None:  # "dynamic"
        extra = [(-s) % k for s, k in zip(x.shape[2:], weight.shape[2:])]
        if any(extra):
            x = torch.nn.functional.pad(x, [p for e in reversed(extra) for p in (0, e)])
    if recipe is not None:
        y = _fp8.patch_embed(x, weight, bias, out_format, recipe, autocast_dtype(x) or x.dtype)
        return y.squeeze(0) if unbatched else y
    x, weight, bias = autocast(x, weight, bias)
    y = _call("patch_embed", x, weight, bias, out_format != "channels_first", [])
    if out_format == "channels_last":
        grid = [s // k for s, k in zip(x.shape[2:], weight.shape[2:])]
        y = unsafe_view(y.transpose(1, 2), (y.shape[0], y.shape[2], *grid))  # the tokens' memory, not a view
    return y.squeeze(0) if unbatched else y


def patch_unembed(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, *,
                  in_format: str = "channels_first", grid: Optional[Sequence[int]] = None,
                  fp8: Union[bool, Float8Recipe] = False) -> Tensor:
    """``F.conv_transpose{1,2,3}d(x, weight, bias, stride=weight.shape[2:])`` as one GEMM + one
    scatter (the bias is added by the scatter).

    Args:
        x: ``in_format="channels_first"``: ``[B, C_in, *grid]`` (or unbatched ``[C_in, *grid]``);
            ``"tokens"``: ``[B, N, C_in]`` (or ``[N, C_in]``) with N in row-major grid order.
        weight: ``[C_in, C_out, *k]``, the ConvTranspose layout.
        bias: ``[C_out]`` or None.
        grid: the patch grid ``(n_d, n_h, n_w)`` (one entry per kernel dim); required for tokens.
        fp8: ``True`` or a ``Float8Recipe``: the GEMM in FP8, as patch_embed's ``fp8``.

    Returns ``[B, C_out, *(grid * k)]``, contiguous.
    """
    check_format("patch_unembed: in_format", in_format)
    _check_weight("patch_unembed", weight, bias, "[C_in, C_out, *kernel]")
    if not isinstance(x, Tensor):
        raise TypeError("patch_unembed: x must be a tensor")
    rank = weight.dim() - 2
    tokens = in_format == "tokens"
    unbatched = x.dim() == (2 if tokens else rank + 1)
    if unbatched:
        x = x.unsqueeze(0)
    if tokens:
        if grid is None:
            raise ValueError("patch_unembed: in_format='tokens' needs grid=(n_d, n_h, n_w), one size per kernel dim")
        grid = as_grid(grid, "patch_unembed")
        if len(grid) != rank:
            raise RuntimeError(f"patch_unembed: grid {tuple(grid)} must have {rank} entries for weight {tuple(weight.shape)}")
    elif grid is not None and tuple(as_grid(grid, "patch_unembed")) != tuple(x.shape[2:]):
        raise RuntimeError(f"patch_unembed: grid {tuple(grid)} does not match x {tuple(x.shape)}")
    recipe = _fp8.resolve("patch_unembed", fp8, region=False)
    if recipe is not None:
        y = _fp8.patch_unembed(x, weight, bias, grid if tokens else None, recipe, autocast_dtype(x) or x.dtype)
        return y.squeeze(0) if unbatched else y
    x, weight, bias = autocast(x, weight, bias)
    y = _call("patch_unembed", x, weight, bias, tokens, grid if tokens else [])
    return y.squeeze(0) if unbatched else y


# ---- the glue of hierarchical stems ---------------------------------------------------------------

def instance_norm_act(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
                      eps: float = 1e-5, act: Optional[str] = "gelu", layout: str = "channels_first") -> Tensor:
    """``F.gelu(F.instance_norm(x, weight=weight, bias=bias, eps=eps))`` in two passes over ``x``.

    Args:
        x: ``layout="channels_first"``: ``[B, C, *spatial]`` (a conv's output);
            ``"tokens"``: ``[B, N, C]``, normalized per sample and channel over the N tokens.
        weight, bias: ``[C]`` (InstanceNorm's affine parameters) or None.
        act: ``"gelu"`` (exact, erf) or None (the norm alone).

    The statistics are float32 (float64 for float64 ``x``). Backward saves only ``x`` and the
    per-channel statistics, and recomputes the normalized activation; PyTorch's two ops save two
    copies of the activation and make about three times the passes over it.
    """
    check_format("instance_norm_act: layout", layout)
    if act not in ("gelu", None):
        raise ValueError(f"instance_norm_act: act must be 'gelu' or None, got {act!r}")
    if not isinstance(x, Tensor):
        raise TypeError("instance_norm_act: x must be a tensor")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"instance_norm_act: eps must be a number, got {type(eps).__name__} {eps!r}")
    for name, t in (("weight", weight), ("bias", bias)):
        check_optional_tensor(t, f"instance_norm_act: {name}")
        # As F.instance_norm: parameters in x's dtype, or float32 for 16-bit x (autocast's layout).
        if t is not None and (not isinstance(t, Tensor) or (
                t.dtype != x.dtype and not (t.dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16)))):
            raise RuntimeError(f"instance_norm_act: {name} must be a tensor of x's dtype ({x.dtype}), or float32 for "
                               f"16-bit x, got {t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    weight, bias = (None if t is None else t.to(x.dtype) for t in (weight, bias))
    return _call("instance_norm_act", x, weight, bias, float(eps), act == "gelu", layout == "tokens")[0]
