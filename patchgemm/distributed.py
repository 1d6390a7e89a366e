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
- ``shard_groups(module, mesh)`` turns the ``GroupedLinear`` modules of a model into group-parallel
  ones: their parameters become DTensors sharded over the groups of a 1-D device mesh, and their
  forward takes the input as it arrives (replicated, or sharded over a batch dim: every rank its own
  samples), moves it onto the group sharding (a local slice, or one all-to-all) and gives the output
  back in the input's placement (an all-gather, or the inverse all-to-all). Backward runs the same
  collectives in reverse through DTensor's autograd.
"""

from typing import List, Optional

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.experimental import register_sharding

from .ops import ops

__all__ = ["shard_groups"]


def _dims(group_major: bool):
    """(group dim, batch dim) of a 3-D activation [B, G, D] or, group-major, [G, B, D]."""
    return (0, 1) if group_major else (1, 0)


@register_sharding(ops.grouped_linear.default)
def _grouped_linear_sharding(x, weight, bias, group_major):
    g, b = _dims(group_major)
    has_bias = bias is not None

    def with_bias(placement):
        return placement if has_bias else None

    rules = [
        ([Replicate()], [Replicate(), Replicate(), with_bias(Replicate()), None]),
        ([Shard(g)], [Shard(g), Shard(0), with_bias(Shard(0)), None]),  # groups
        ([Shard(b)], [Shard(b), Replicate(), with_bias(Replicate()), None]),  # batch
        ([Shard(2)], [Replicate(), Shard(1), with_bias(Shard(1)), None]),  # output features
    ]
    if not has_bias:  # input features: each rank's partial sum over its slice of Din
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


def _check_placement(name: str, placement: Placement) -> None:
    if not isinstance(placement, (Replicate, Shard)):
        raise ValueError(f"shard_groups: {name} must be Replicate() or Shard(dim), got {placement!r}")


def _group_dim(module, x: Tensor) -> int:
    """The group dim of the module's input x ([..., G, Din] or, group-major, [G, ..., Din])."""
    return 0 if module.layout == "gbd" else x.dim() - 2


def _grouped_linears(module: nn.Module) -> List[nn.Module]:
    from .nn import GroupedLinear

    return [m for m in module.modules() if isinstance(m, GroupedLinear)]


def shard_groups(module: nn.Module, mesh: DeviceMesh, *, input_layout: Placement = Replicate(),
                 output_layout: Optional[Placement] = None, use_local_output: bool = True) -> nn.Module:
    """Makes every ``GroupedLinear`` in ``module`` (itself included) group-parallel over ``mesh``.

    Args:
        module: a ``GroupedLinear``, or a model holding some; changed in place and returned.
        mesh: a 1-D ``DeviceMesh``; rank r of it keeps groups ``G * r / R .. G * (r + 1) / R``
            (``torch.chunk``'s split: G need not divide by R).
        input_layout: how a plain-tensor input is laid out over the ranks: ``Replicate()`` (every
            rank holds all of x) or ``Shard(d)`` (rank r holds its part of dim d, e.g. the batch dim
            0: each rank its own samples; or the group dim: each rank its own groups). A DTensor
            input keeps its own placement.
        output_layout: the output's placement (default: ``input_layout``).
        use_local_output: return the local tensor rather than a DTensor.

    The parameters are DTensors ``Shard(0)`` over the groups; an optimizer over
    ``module.parameters()`` updates each rank's groups. The module's result equals the single-GPU
    module's (within the reduction order of the all-gathers, which are exact copies).
    """
    if not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"shard_groups: mesh must be a 1-D DeviceMesh, got {mesh!r}")
    _check_placement("input_layout", input_layout)
    output_layout = input_layout if output_layout is None else output_layout
    _check_placement("output_layout", output_layout)
    targets = _grouped_linears(module)
    if not targets:
        raise ValueError(f"shard_groups: {type(module).__name__} holds no GroupedLinear")

    def partition(name, m, mesh):
        if m in targets:
            for pname, p in list(m.named_parameters(recurse=False)):
                if not isinstance(p, DTensor):
                    m.register_parameter(pname, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)]),
                                                             p.requires_grad))

    def prepare_input(m, inputs, mesh):
        x, *rest = inputs
        if not isinstance(x, DTensor):
            x = _from_local(m, x, mesh, input_layout)
        return (x.redistribute(mesh, [Shard(_group_dim(m, x))]), *rest)

    def prepare_output(m, y, mesh):
        _check_shard_dim("output_layout", output_layout, y)
        y = y.redistribute(mesh, [output_layout])
        return y.to_local() if use_local_output else y

    for m in targets:
        distribute_module(m, mesh, partition, prepare_input, prepare_output)
    return module


def _from_local(module, x: Tensor, mesh: DeviceMesh, placement: Placement) -> DTensor:
    """x, this rank's part of the input, as a DTensor. Sharded on the group dim, the parts follow
    torch.chunk's split of the module's G groups; sharded on another dim, they are equal."""
    _check_shard_dim("input_layout", placement, x)
    if not isinstance(placement, Shard) or placement.dim % x.dim() != _group_dim(module, x):
        return DTensor.from_local(x, mesh, [placement], run_check=False)
    shape = list(x.shape)
    shape[_group_dim(module, x)] = module.num_groups
    stride = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        stride[d] = stride[d + 1] * shape[d + 1]
    return DTensor.from_local(x, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=tuple(stride))


def _check_shard_dim(name: str, placement: Placement, t: Tensor) -> None:
    if isinstance(placement, Shard) and not -t.dim() <= placement.dim < t.dim():
        raise ValueError(f"shard_groups: {name} {placement} names a dim of a {t.dim()}-D tensor of shape "
                         f"{tuple(t.shape)}")

