"""Grouped linear over several GPUs: DTensor sharding rules for its ops, and group parallelism.

The groups of a grouped linear are independent, so they can be spread over ranks as expert
parallelism spreads experts: rank r holds groups ``G * r / R .. G * (r + 1) / R`` of the weight
and computes only those, with no communication while the input is sharded the same way.

- Importing this module registers DTensor sharding rules for ``patchgemm::grouped_linear`` and its
  two gradient ops (``import patchgemm`` does it too when ``torch.distributed.tensor`` is already
  loaded). With them, the ops take DTensors: sharded on the groups (weight ``Shard(0)``, the
  activations on their group dim), on the batch (weight replicated; the weight gradient comes out
  ``Partial``), on the output features (weight ``Shard(1)``) or on the input features (no bias;
  the output ``Partial``), or replicated. The rules are those of each local op computing its part.
  The ragged ops (groups of different row counts) have the feature and replicated rules.
- ``shard_groups(module, mesh)`` turns the ``GroupedLinear`` and ``GroupedMLP`` modules of a model
  into group-parallel ones: their parameters become DTensors sharded over the groups of a 1-D device mesh, and their
  forward takes the input as it arrives (replicated, or sharded over a batch dim: every rank its own
  samples), moves it onto the group sharding (a local slice, or one all-to-all), runs the op on
  this rank's groups and gives the output back in the input's placement (an all-gather, or the
  inverse all-to-all), c10d collectives called directly (a DTensor input goes through DTensor's
  redistribution). Backward runs the inverse collectives.
"""

import copy
import math
from typing import List, Optional

import torch
from torch import Tensor, nn
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding

from . import _functorch
from . import functional as _F
from ._args import autocast
from .ops import group_dim, ops

__all__ = ["shard_groups"]


def _dims(group_major: bool):
    """(group dim, batch dim) of a 3-D activation [B, G, D] or, group-major, [G, B, D]."""
    g = group_dim(group_major)
    return g, 1 - g


def _bias(bias, placement: Placement) -> Optional[Placement]:
    """The bias argument's placement in a rule: None where there is no bias."""
    return None if bias is None else placement


@register_sharding(ops.grouped_linear.default)
def _grouped_linear_sharding(x, weight, bias, group_major):
    g, b = _dims(group_major)
    rules = [
        ([Replicate()], [Replicate(), Replicate(), _bias(bias, Replicate()), None]),
        ([Shard(g)], [Shard(g), Shard(0), _bias(bias, Shard(0)), None]),  # groups
        ([Shard(b)], [Shard(b), Replicate(), _bias(bias, Replicate()), None]),  # batch
        ([Shard(2)], [Replicate(), Shard(1), _bias(bias, Shard(1)), None]),  # output features
    ]
    if bias is None:  # input features: each rank's partial sum over its slice of Din
        rules.append(([Partial()], [Shard(2), Shard(2), None, None]))
    return rules


@register_sharding(ops.grouped_linear_grad_input.default)
def _grouped_linear_grad_input_sharding(grad_y, weight, group_major):
    g, b = _dims(group_major)
    return [
        ([Replicate()], [Replicate(), Replicate(), None]),
        ([Shard(g)], [Shard(g), Shard(0), None]),
        ([Shard(b)], [Shard(b), Replicate(), None]),
        ([Partial()], [Shard(2), Shard(1), None]),  # output features: a partial sum over Dout
        ([Shard(2)], [Replicate(), Shard(2), None]),  # input features
    ]


@register_sharding(ops.grouped_linear_grad_weight.default)
def _grouped_linear_grad_weight_sharding(grad_y, x, group_major):
    g, b = _dims(group_major)
    return [
        ([Replicate()], [Replicate(), Replicate(), None]),
        ([Shard(0)], [Shard(g), Shard(g), None]),
        ([Partial()], [Shard(b), Shard(b), None]),  # batch: a partial sum over the samples
        ([Shard(1)], [Shard(2), Replicate(), None]),
        ([Shard(2)], [Replicate(), Shard(2), None]),
    ]


# Ragged groups: x [N, Din] sorted by group, offsets [G] replicated. Rows cannot be split without
# rebasing the offsets, so the rules shard the features only: the output features (weight Shard(1))
# or, without bias, the input features (a partial sum).
@register_sharding(ops.ragged_grouped_linear.default)
def _ragged_grouped_linear_sharding(x, weight, bias, offsets):
    rules = [
        ([Replicate()], [Replicate(), Replicate(), _bias(bias, Replicate()), Replicate()]),
        ([Shard(1)], [Replicate(), Shard(1), _bias(bias, Shard(1)), Replicate()]),  # output features
    ]
    if bias is None:
        rules.append(([Partial()], [Shard(1), Shard(2), None, Replicate()]))  # input features
    return rules


@register_sharding(ops.ragged_grouped_linear_grad_input.default)
def _ragged_grouped_linear_grad_input_sharding(grad_y, weight, offsets):
    return [
        ([Replicate()], [Replicate(), Replicate(), Replicate()]),
        ([Partial()], [Shard(1), Shard(1), Replicate()]),  # output features: a partial sum over Dout
        ([Shard(1)], [Replicate(), Shard(2), Replicate()]),  # input features
    ]


@register_sharding(ops.ragged_grouped_linear_grad_weight.default)
def _ragged_grouped_linear_grad_weight_sharding(grad_y, x, offsets):
    return [
        ([Replicate()], [Replicate(), Replicate(), Replicate()]),
        ([Shard(1)], [Shard(1), Replicate(), Replicate()]),  # output features
        ([Shard(2)], [Replicate(), Shard(1), Replicate()]),  # input features
    ]


def _check_placement(name: str, placement: Placement) -> None:
    if not isinstance(placement, (Replicate, Shard)):
        raise ValueError(f"shard_groups: {name} must be Replicate() or Shard(dim), got {placement!r}")


def _check_shard_dim(name: str, placement: Placement, t: Tensor) -> None:
    if isinstance(placement, Shard) and not -t.dim() <= placement.dim < t.dim():
        raise ValueError(f"shard_groups: {name} {placement} names a dim of a {t.dim()}-D tensor of shape "
                         f"{tuple(t.shape)}")


def _grouped_modules(module: nn.Module) -> List[nn.Module]:
    from .nn import GroupedLinear, GroupedMLP

    return [m for m in module.modules() if isinstance(m, (GroupedLinear, GroupedMLP))]


def _local_result(module, x: Tensor) -> Tensor:
    """The module's computation on this rank's groups of x and of its DTensor parameters."""
    from .nn import GroupedMLP

    if not isinstance(module, GroupedMLP):
        weight, bias = module.weight, module.bias
        if (x.dim() == 3 and isinstance(weight, DTensor) and (bias is None or isinstance(bias, DTensor))
                and not _functorch.active() and not torch.compiler.is_compiling()):
            # the usual case, in one autograd node (functorch transforms and tracing take the other)
            return _ShardedGroupedLinear.apply(*autocast(x, weight, bias), module.layout == "gbd")
    names, params = zip(*module.named_parameters(recurse=False))
    shards = dict(zip(names, _LocalShards.apply(*params)))
    if isinstance(module, GroupedMLP):
        return _F.grouped_mlp(x, shards["w_gate_up"], shards["w_down"], module.layout,
                              bias_gate_up=shards.get("bias_gate_up"), bias_down=shards.get("bias_down"),
                              activation=module.activation)
    return _F.grouped_linear(x, shards["weight"], shards.get("bias"), module.layout)


class _GroupParallel:
    """The forward of a group-parallel GroupedLinear or GroupedMLP (mixed into its class by
    shard_groups): the ops run on this rank's groups as plain tensors (no DTensor dispatch per op,
    whose host time would exceed a GPU's share of the work). A plain-tensor input moves onto the
    groups and the output back by direct collectives (_Regroup, with their inverses in backward);
    a DTensor input, or a DTensor output asked for, goes through DTensor's redistribution."""

    def forward(self, x: Tensor) -> Tensor:
        mesh, input_layout, output_layout, use_local_output = self._group_parallel
        g = 0 if self.layout == "gbd" else x.dim() - 2
        on_groups = Shard(g)
        if isinstance(x, DTensor):
            x_mine = x.redistribute(mesh, [on_groups]).to_local()
        else:
            _check_shard_dim("input_layout", input_layout, x)
            x_mine = x if _same(input_layout, g, x.dim()) else \
                _Regroup.apply(x, input_layout, on_groups, self.num_groups, g, mesh.get_group())
        y_mine = _local_result(self, x_mine)
        _check_shard_dim("output_layout", output_layout, y_mine)
        if use_local_output:
            return y_mine if _same(output_layout, g, y_mine.dim()) else \
                _Regroup.apply(y_mine, on_groups, output_layout, self.num_groups, g, mesh.get_group())
        return _on_groups(y_mine, mesh, g, self.num_groups).redistribute(mesh, [output_layout])


def _same(placement: Placement, group_dim: int, ndim: int) -> bool:
    return isinstance(placement, Shard) and placement.dim % ndim == group_dim


def _chunks(n: int, parts: int) -> List[int]:
    """torch.chunk's split of n over parts, DTensor's Shard: ceil(n / parts) each, the last ones
    smaller or empty."""
    size = -(-n // parts) if parts else 0
    return [max(0, min(size, n - r * size)) for r in range(parts)]


def _all_to_all(t: Tensor, split_dim: int, send: List[int], cat_dim: int, cat: List[int], group) -> Tensor:
    """Rank r gets chunk r of t along split_dim (chunk sizes ``send``, the same on every rank);
    the chunks arriving here are concatenated in rank order along cat_dim, rank r's chunk
    ``cat[r]`` long there. One all_to_all_single over flat buffers, so the sizes may differ."""
    rank = torch.distributed.get_rank(group)
    moved = t.movedim(split_dim, 0).contiguous()  # each chunk one contiguous block
    row = math.prod(moved.shape[1:])
    shapes = []
    for r in range(len(send)):
        shape = list(t.shape)
        shape[split_dim], shape[cat_dim] = send[rank], cat[r]
        shapes.append(shape)
    counts = [math.prod(s) for s in shapes]
    out = moved.new_empty(sum(counts))
    torch.distributed.all_to_all_single(out, moved.view(-1), counts, [n * row for n in send], group=group)
    pieces = []
    for piece, shape in zip(out.split(counts), shapes):
        moved_shape = [shape[split_dim]] + [v for d, v in enumerate(shape) if d != split_dim]
        pieces.append(piece.view(moved_shape).movedim(0, split_dim))
    return torch.cat(pieces, cat_dim)


def _all_gather(t: Tensor, dim: int, sizes: List[int], group) -> Tensor:
    """Every rank's t, concatenated in rank order along dim (rank r's ``sizes[r]`` long there),
    padded to the longest for the collective where the sizes differ."""
    longest = max(sizes)
    if t.shape[dim] == longest:
        padded = t.contiguous()
    else:
        padded = t.new_zeros([longest if d == dim else v for d, v in enumerate(t.shape)])
        padded.narrow(dim, 0, t.shape[dim]).copy_(t)
    gathered = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(gathered, padded, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(gathered, sizes)], dim)


def _regroup(t: Tensor, source: Placement, target: Placement, groups: int, group_dim: int, group) -> Tensor:
    """t, laid out over the ranks as ``source``, laid out as ``target``; one of them is Shard on
    the group dim, the other Replicate or Shard on another dim (equal shards there)."""
    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    if world == 1:  # one rank holds everything in every layout
        return t
    source_dim = source.dim % t.dim() if isinstance(source, Shard) else None
    target_dim = target.dim % t.dim() if isinstance(target, Shard) else None
    group_sizes = _chunks(groups, world)
    if source_dim == group_dim:  # this rank's groups -> everyone's groups
        if target_dim is None:
            return _all_gather(t, group_dim, group_sizes, group)
        return _all_to_all(t, target_dim, _chunks(t.shape[target_dim], world), group_dim, group_sizes, group)
    # everyone's groups -> this rank's groups
    if source_dim is None:
        return t.narrow(group_dim, sum(group_sizes[:rank]), group_sizes[rank])
    if torch.distributed.get_debug_level() == torch.distributed.DebugLevel.DETAIL:
        _check_equal_shards(t, source_dim, world, group)
    return _all_to_all(t, group_dim, group_sizes, source_dim, [t.shape[source_dim]] * world, group)


def _check_equal_shards(t: Tensor, dim: int, world: int, group) -> None:
    """Unequal shards would give the ranks' all-to-alls disagreeing sizes (gloo aborts, NCCL may
    hang): checked by one more collective and a host sync, so only under
    TORCH_DISTRIBUTED_DEBUG=DETAIL, where c10d checks its collectives' shapes too."""
    size = torch.tensor([t.shape[dim]], dtype=torch.int64,
                        device=t.device if torch.distributed.get_backend(group) == "nccl" else "cpu")
    sizes = [torch.empty_like(size) for _ in range(world)]
    torch.distributed.all_gather(sizes, size, group=group)
    sizes = torch.cat(sizes).tolist()  # one host sync
    if len(set(sizes)) > 1:
        raise ValueError(f"shard_groups: input_layout Shard({dim}) needs the same size of dim {dim} on every rank, "
                         f"got {sizes} (x {tuple(t.shape)} here); pass a DTensor for uneven shards")


class _Regroup(torch.autograd.Function):
    """_regroup, and in backward its inverse on the gradient: an all-to-all's is the reverse
    all-to-all; a replicated tensor sliced to this rank's groups gets every rank's gradient
    gathered, and a gathered one its own slice of the gradient (DTensor's rules for Replicate)."""

    @staticmethod
    def forward(ctx, t, source, target, groups, group_dim, group):
        ctx.args = source, target, groups, group_dim, group
        return _regroup(t, source, target, groups, group_dim, group)

    @staticmethod
    def backward(ctx, grad):
        source, target, groups, group_dim, group = ctx.args
        return _regroup(grad, target, source, groups, group_dim, group), None, None, None, None, None


class _LocalShards(torch.autograd.Function):
    """This rank's shards of DTensor parameters as plain tensors, their gradients back as DTensors
    of the parameters' own specs: what ``DTensor.to_local()`` does per parameter, in one autograd
    node and without rebuilding the spec in backward (from_local's checks cost more host time than
    the rest of a layer's step)."""

    @staticmethod
    def forward(ctx, *params):
        ctx.set_materialize_grads(False)
        ctx.specs = [p._spec for p in params]
        # fresh tensor objects: autograd writes its metadata into them, not into the DTensors' own
        return tuple(p._local_tensor.view_as(p._local_tensor) for p in params)

    @staticmethod
    def backward(ctx, *grads):
        # The shards are contiguous (distribute_tensor's), so contiguous gradients match the specs.
        return tuple(None if g is None else DTensor(g.contiguous(), copy.copy(spec), requires_grad=False)
                     for g, spec in zip(grads, ctx.specs))


class _ShardedGroupedLinear(torch.autograd.Function):
    """grouped_linear on this rank's groups: x local, the weight and bias DTensors sharded on the
    groups. The ops and gradients of _LocalShards followed by the op's own autograd, in one node
    whose backward makes the parameter gradients as DTensors of the parameters' specs: with half
    the GEMMs per GPU, host time per step is what limits a group-parallel layer."""

    @staticmethod
    def forward(ctx, x, weight, bias, group_major):
        ctx.set_materialize_grads(False)
        w = weight._local_tensor
        ctx.save_for_backward(x, w)
        ctx.group_major = group_major
        ctx.specs = weight._spec, None if bias is None else bias._spec
        return _functorch.call("grouped_linear", x, w, None if bias is None else bias._local_tensor, group_major)

    @staticmethod
    def backward(ctx, grad_y):
        if grad_y is None:
            return None, None, None, None
        x, w = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grads = _functorch.grouped_linear_grads(grad_y, x, w, ctx.group_major, need_x, need_w,
                                                need_b and ctx.specs[1] is not None)
        # The gradients are contiguous, as the shards are: the specs' strides hold.
        return (grads[0], *(None if g is None else DTensor(g, copy.copy(spec), requires_grad=False)
                            for g, spec in zip(grads[1:], ctx.specs)), None)


def _on_groups(t: Tensor, mesh: DeviceMesh, g: int, groups: int) -> DTensor:
    """This rank's groups of t as a DTensor sharded on dim g (torch.chunk's split of the groups:
    the global shape is passed, as the local shapes may differ)."""
    shape = list(t.shape)
    shape[g] = groups
    return DTensor.from_local(t, mesh, [Shard(g)], run_check=False, shape=torch.Size(shape),
                              stride=make_contiguous_strides_for(shape))


_CLASSES = {}


def _group_parallel_class(cls):
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"GroupParallel{cls.__name__}", (_GroupParallel, cls), {})
    return _CLASSES[cls]


def shard_groups(module: nn.Module, mesh: DeviceMesh, *, input_layout: Placement = Replicate(),
                 output_layout: Optional[Placement] = None, use_local_output: bool = True) -> nn.Module:
    """Makes every ``GroupedLinear`` and ``GroupedMLP`` in ``module`` (itself included)
    group-parallel over ``mesh``: expert parallelism for per-group layers.

    Args:
        module: a ``GroupedLinear`` / ``GroupedMLP``, or a model holding some; changed in place and
            returned.
        mesh: a 1-D ``DeviceMesh``; rank r of it keeps groups ``G * r / R .. G * (r + 1) / R``
            (``torch.chunk``'s split: G need not divide by R).
        input_layout: how a plain-tensor input is laid out over the ranks: ``Replicate()`` (every
            rank holds all of x) or ``Shard(d)``: rank r holds its part of dim d, e.g. of the batch
            dim 0 (each rank its own samples, the same number on every rank, as DistributedSampler
            makes them; checked under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``) or of the group dim (each
            rank its own groups: no communication at all). A DTensor input keeps its own layout,
            uneven shards included (its output takes DTensor's even split).
        output_layout: the output's placement (default: ``input_layout``).
        use_local_output: return this rank's part as a plain tensor rather than a DTensor.

    The parameters become DTensors ``Shard(0)`` over the groups; an optimizer over
    ``module.parameters()`` updates each rank's groups. The results equal the single-GPU module's:
    the collectives only move data.
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"shard_groups: mesh must be a 1-D DeviceMesh, got {mesh!r}")
    _check_placement("input_layout", input_layout)
    output_layout = input_layout if output_layout is None else output_layout
    _check_placement("output_layout", output_layout)
    targets = _grouped_modules(module)
    if not targets:
        raise ValueError(f"shard_groups: {type(module).__name__} holds no GroupedLinear or GroupedMLP")
    for m in targets:
        if isinstance(m, _GroupParallel):
            raise ValueError(f"shard_groups: {type(m).__name__} is group-parallel already")
        for name, p in list(m.named_parameters(recurse=False)):
            m.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]), p.requires_grad))
        m.__class__ = _group_parallel_class(type(m))
        m._group_parallel = (mesh, input_layout, output_layout, use_local_output)
    return module
