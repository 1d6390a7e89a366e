"""The multi-process half of test_distributed.py: ``python distributed_worker.py WORLD BACKEND OUT``
starts WORLD processes (gloo on the CPU, or NCCL with one GPU each), runs every scenario below in
each and writes ``OUT/rank<r>.json``: per scenario "ok" or the failure's traceback.

Every scenario compares a distributed run with the same computation in one process, made in the
same rank from the same seeds: float64 on the CPU (tight tolerances), float32 on GPUs.
"""

import copy
import datetime
import json
import os
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import patchgemm as pg
from patchgemm.distributed import shard_groups
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS = 3
LR = 0.1


class Ctx:
    def __init__(self, rank, world, device):
        self.rank, self.world, self.device = rank, world, device
        self.dtype = torch.float64 if device.type == "cpu" else torch.float32
        self.tol = 1e-10 if self.dtype == torch.float64 else 1e-4
        self.mesh = init_device_mesh(device.type, (world,))

    def randn(self, *shape, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(self.device, self.dtype)

    def mine(self, t, dim=0):
        """This rank's part of t along dim: DTensor's split (torch.chunk's, empty past its chunks)."""
        parts = t.chunk(self.world, dim)
        return parts[self.rank] if self.rank < len(parts) else t.narrow(dim, t.shape[dim], 0)

    def close(self, what, got, want):
        got = got.full_tensor() if isinstance(got, DTensor) else got
        err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        scale = max(want.double().abs().max().item() if want.numel() else 0.0, 1.0)
        assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert err <= self.tol * scale, f"{what}: max error {err:.3g} (scale {scale:.3g}) on rank {self.rank}"


class Collectives(TorchDispatchMode):
    """The collectives run inside it, by name (c10d's ops, as shard_groups calls them, and
    DTensor's)."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional", "_dtensor") and "wait" not in func.__name__ \
                and "wrap" not in func.__name__:
            self.ran.append(func.__name__)
        return func(*args, **(kwargs or {}))


# ---- models -------------------------------------------------------------------------------------

class ConvModel(nn.Module):
    """A ViT-like stem (kernel == stride conv), a head, and a transposed conv back: what convert()
    turns into PatchEmbed / PatchUnembed."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 4, stride=4)
        self.mix = nn.Linear(16, 16)
        self.out = nn.ConvTranspose2d(16, 3, 4, stride=4)

    def forward(self, x):
        y = self.stem(x)
        y = self.mix(y.flatten(2).transpose(1, 2)).transpose(1, 2).reshape(y.shape)
        return self.out(torch.nn.functional.gelu(y))


class PatchModel(nn.Module):
    """Every module of the package that holds parameters of a patch or grouped GEMM."""

    def __init__(self):
        super().__init__()
        self.hier = pg.HierarchicalPatchEmbed(2, 12, stages=(2, 2), hidden_dim=6, dims=2)
        self.embed = pg.PatchEmbed(12, 8, 2, out_format="tokens")
        self.grouped = pg.GroupedLinear(4, 2, 3)
        self.mlp = pg.GroupedMLP(4, 3, 5, bias=True)
        self.unembed = pg.PatchUnembed(12, 2, 4, in_format="tokens")

    def forward(self, x):  # x [B, 2, 16, 16]
        t = self.embed(self.hier(x))  # [B, 4, 8]
        t = self.mlp(self.grouped(t.unflatten(2, (4, 2)))).flatten(2)  # [B, 4, 12]
        return self.unembed(t, grid=(2, 2))  # [B, 2, 8, 8]


def _models(ctx):
    torch.manual_seed(0)
    report = pg.convert(ConvModel().to(ctx.device, ctx.dtype))
    assert len(report.swapped) == 2, str(report)
    return {"patch_model": (PatchModel().to(ctx.device, ctx.dtype), (2, 16, 16)),
            "converted": (report.model, (3, 16, 16))}


def _train(model, x, steps=STEPS):
    """SGD steps on mean((model(x) - 0.5)^2) (each rank's mean: DDP and FSDP2 average them)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - 0.5) ** 2).mean().backward()
        opt.step()


def _data_parallel(ctx, wrap, compile_model):
    for name, (model, sample) in _models(ctx).items():
        x = ctx.randn(2 * ctx.world, *sample, seed=1)
        reference = copy.deepcopy(model)
        _train(reference, x)
        wrapped = wrap(copy.deepcopy(model))
        if compile_model:
            wrapped = torch.compile(wrapped, backend="aot_eager" if ctx.device.type == "cpu" else "inductor")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(wrapped, ctx.mine(x))
        # No module returns a view (HierarchicalPatchEmbed's channels-first map shares its tokens'
        # memory through an _unsafe_view).
        views = [str(w.message) for w in caught if "view" in str(w.message)]
        assert not views, f"{name}: {views[0]}"
        want = dict(reference.named_parameters())
        for pname, p in (wrapped.module if isinstance(wrapped, DDP) else wrapped).named_parameters():
            ctx.close(f"{name}.{pname.replace('_orig_mod.', '').replace('module.', '')}", p,
                      want[pname.replace("_orig_mod.", "").replace("module.", "")])


def _fsdp2(ctx, model):
    """Each child of the model its own FSDP2 unit, as one wraps blocks (a HierarchicalPatchEmbed
    reads its stages' parameters itself: it is one unit, not one per stage), then the root. (The
    mesh is explicit: FSDP2's default is on the GPU wherever there is one.)"""
    for m in model.children():
        if any(p.requires_grad for p in m.parameters()):
            fully_shard(m, mesh=ctx.mesh)
    fully_shard(model, mesh=ctx.mesh)
    return model


def _ddp(ctx, model):
    return DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)


def ddp(ctx):
    _data_parallel(ctx, lambda m: _ddp(ctx, m), False)


def ddp_compiled(ctx):
    _data_parallel(ctx, lambda m: _ddp(ctx, m), True)


def fsdp2(ctx):
    _data_parallel(ctx, lambda m: _fsdp2(ctx, m), False)


def fsdp2_compiled(ctx):
    _data_parallel(ctx, lambda m: _fsdp2(ctx, m), True)


# ---- group parallelism --------------------------------------------------------------------------

def _group_parallel(ctx, layout, input_layout, groups=5, x_shape=(2, 3), mlp=False):
    """One GroupedLinear (or GroupedMLP), group-parallel, against the same module in one process:
    output, input gradient and parameter gradients; returns the collectives forward and backward
    ran."""
    torch.manual_seed(0)
    if mlp:
        ref = pg.GroupedMLP(groups, 8, 4, out_dim=6, bias=True, layout=layout).to(ctx.device, ctx.dtype)
    else:
        ref = pg.GroupedLinear(groups, 8, 6, layout=layout).to(ctx.device, ctx.dtype)
    batch = (2 * ctx.world,) + x_shape[1:]
    shape = (groups, *batch, 8) if layout == "gbd" else (*batch, groups, 8)
    x = ctx.randn(*shape, seed=2).requires_grad_()
    y = ref(x)
    dy = ctx.randn(*y.shape, seed=3)
    y.backward(dy)
    module = shard_groups(copy.deepcopy(ref), ctx.mesh, input_layout=input_layout)
    assert all(isinstance(p, DTensor) and p.placements == (Shard(0),) for p in module.parameters())

    def part(t):
        return ctx.mine(t, input_layout.dim) if isinstance(input_layout, Shard) else t

    x_mine = part(x.detach()).clone().requires_grad_()
    with Collectives() as forward:
        y_mine = module(x_mine)
    ctx.close("y", y_mine, part(y.detach()))
    with Collectives() as backward:
        y_mine.backward(part(dy))
    want = dict(ref.named_parameters())
    for name, p in module.named_parameters():
        ctx.close(f"{name}.grad", p.grad, want[name].grad)
    grad_x = x_mine.grad
    if isinstance(input_layout, Replicate):
        ctx.close("x.grad", grad_x, x.grad)
    else:
        ctx.close("x.grad", grad_x, part(x.grad))
    return forward.ran, backward.ran


def group_parallel_groups_in(ctx):
    """Input already sharded on its groups: no collective at all, forward or backward (N-D x, and
    3-D x, a GroupedLinear's one-node path)."""
    for x_shape in ((2, 3), (2,)):
        for layout, dim in (("bgd", len(x_shape)), ("gbd", 0)):
            forward, backward = _group_parallel(ctx, layout, Shard(dim), x_shape=x_shape)
            assert not forward and not backward, f"{layout}: collectives {forward} / {backward}"


def group_parallel_autocast(ctx):
    """Under autocast a group-parallel layer casts as the single-process one does (float32
    parameters, bf16 GEMMs): the same outputs and gradients, in the same dtypes."""
    torch.manual_seed(0)
    ref = pg.GroupedLinear(2 * ctx.world, 8, 6).to(ctx.device, torch.float32)
    module = shard_groups(copy.deepcopy(ref), ctx.mesh, input_layout=Shard(1))
    x = ctx.randn(3, 2 * ctx.world, 8, seed=11).float().requires_grad_()
    x_mine = ctx.mine(x.detach(), 1).clone().requires_grad_()
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16):
        y, y_mine = ref(x), module(x_mine)
    assert y_mine.dtype == y.dtype == torch.bfloat16, (y.dtype, y_mine.dtype)
    dy = ctx.randn(*y.shape, seed=12).to(torch.bfloat16)
    y.backward(dy)
    y_mine.backward(ctx.mine(dy, 1))
    want = dict(ref.named_parameters())
    pairs = [("y", y_mine, ctx.mine(y.detach(), 1)), ("x.grad", x_mine.grad, ctx.mine(x.grad, 1))]
    pairs += [(f"{name}.grad", p.grad.to_local(), ctx.mine(want[name].grad)) for name, p in module.named_parameters()]
    for what, got, expected in pairs:
        assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
        torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2, msg=lambda m: f"{what}: {m}")


def group_parallel_replicated_in(ctx):
    for layout, groups in (("bgd", 5), ("gbd", 5), ("bgd", 2 * ctx.world)):  # uneven and even splits
        forward, backward = _group_parallel(ctx, layout, Replicate(), groups=groups)
        for ran in (forward, backward):  # the output gathered; in backward, x's gradient
            assert (len(ran) == 1 and "allgather" in ran[0]) or (ctx.world == 1 and not ran), \
                f"{layout}: ran {forward} / {backward}"


def group_parallel_batch_in(ctx):
    """Each rank its own samples: one all-to-all onto the groups and one back, forward and
    backward."""
    for layout, dim in (("bgd", 0), ("gbd", 1)):
        for groups in (2 * ctx.world, 2 * ctx.world + 1):
            forward, backward = _group_parallel(ctx, layout, Shard(dim), groups=groups)
            for ran in (forward, backward):  # (a world of one moves nothing)
                assert (len(ran) == 2 and all("alltoall" in op for op in ran)) or (ctx.world == 1 and not ran), \
                    f"{layout}: ran {forward} / {backward}"


def group_parallel_few_groups(ctx):
    """Fewer groups than ranks: some ranks hold none."""
    _group_parallel(ctx, "bgd", Shard(0), groups=ctx.world - 1 if ctx.world > 2 else 1)


def group_parallel_mlp(ctx):
    """A GroupedMLP (three GEMMs and SwiGLU per group), each input layout."""
    for layout, (batch, group) in (("bgd", (0, 2)), ("gbd", (1, 0))):
        for placement in (Shard(group), Replicate(), Shard(batch)):
            forward, backward = _group_parallel(ctx, layout, placement, mlp=True)
            if placement == Shard(group):
                assert not forward and not backward, f"{layout}: collectives {forward} / {backward}"


def group_parallel_training(ctx):
    """Two group-parallel layers trained for some steps, batch-sharded input: the parameters match
    the single-process run's."""
    torch.manual_seed(0)
    model = nn.Sequential(pg.GroupedLinear(6, 8, 16), nn.GELU(), pg.GroupedLinear(6, 16, 8)).to(ctx.device, ctx.dtype)
    x = ctx.randn(2 * ctx.world, 6, 8, seed=4)
    reference = copy.deepcopy(model)
    _train(reference, x)
    sharded = shard_groups(copy.deepcopy(model), ctx.mesh, input_layout=Shard(0))
    # Each rank's loss is the mean over its samples: average the gradients as DDP would.
    opt = torch.optim.SGD(sharded.parameters(), lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        (((sharded(ctx.mine(x)) - 0.5) ** 2).mean() / ctx.world).backward()
        opt.step()
    want = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        ctx.close(name, p, want[name])


def dtensor_rules(ctx):
    """The ops on DTensors in every sharding their rules name, forward and both gradients."""
    ops = torch.ops.patchgemm
    for group_major in (False, True):
        g, b = (0, 1) if group_major else (1, 0)
        x = ctx.randn(*((5, 4 * ctx.world, 8) if group_major else (4 * ctx.world, 5, 8)), seed=5)
        w, bias = ctx.randn(5, 6, 8, seed=6), ctx.randn(5, 6, seed=7)
        dy = ctx.randn(*x.shape[:2], 6, seed=8)
        y = ops.grouped_linear(x, w, bias, group_major)
        gx, gw = ops.grouped_linear_grad_input(dy, w, group_major), ops.grouped_linear_grad_weight(dy, x, group_major)
        cases = [("replicated", Replicate(), Replicate(), Replicate(), Replicate()),
                 ("groups", Shard(g), Shard(0), Shard(0), Shard(g)),
                 ("batch", Shard(b), Replicate(), Replicate(), Shard(b)),
                 ("out features", Replicate(), Shard(1), Shard(1), Shard(2))]
        for name, px, pw, pb, pdy in cases:
            xd, wd, bd, dyd = (distribute_tensor(t, ctx.mesh, [p]) for t, p in ((x, px), (w, pw), (bias, pb), (dy, pdy)))
            with Collectives() as comm:
                y_d = ops.grouped_linear(xd, wd, bd, group_major)
                gx_d = ops.grouped_linear_grad_input(dyd, wd, group_major)
                gw_d = ops.grouped_linear_grad_weight(dyd, xd, group_major)
            assert not comm.ran, f"{name}: the ops communicated: {comm.ran}"
            ctx.close(f"{name} y", y_d, y)
            ctx.close(f"{name} grad_x", gx_d, gx)
            ctx.close(f"{name} grad_w", gw_d, gw)
        # input features (no bias): the output is a partial sum
        y0 = ops.grouped_linear(x, w, None, group_major)
        y_d = ops.grouped_linear(distribute_tensor(x, ctx.mesh, [Shard(2)]), distribute_tensor(w, ctx.mesh, [Shard(2)]),
                                 None, group_major)
        assert y_d.placements == (Partial(),), y_d.placements
        ctx.close("input features y", y_d, y0)
    _ragged_rules(ctx)


def _ragged_rules(ctx):
    """Ragged groups on DTensors: replicated, output features and input features."""
    ops = torch.ops.patchgemm
    x, w, bias = ctx.randn(7, 8, seed=10), ctx.randn(3, 4 * ctx.world, 8, seed=11), ctx.randn(3, 4 * ctx.world, seed=12)
    offsets = torch.tensor([2, 2, 7], dtype=torch.int32 if ctx.device.type == "cuda" else torch.int64, device=ctx.device)
    dy = ctx.randn(7, 4 * ctx.world, seed=13)
    want = (ops.ragged_grouped_linear(x, w, bias, offsets), ops.ragged_grouped_linear_grad_input(dy, w, offsets),
            ops.ragged_grouped_linear_grad_weight(dy, x, offsets))
    cases = [("replicated", Replicate(), Replicate(), Replicate(), Replicate()),
             ("out features", Replicate(), Shard(1), Shard(1), Shard(1))]
    for name, px, pw, pb, pdy in cases:
        xd, wd, bd, dyd = (distribute_tensor(t, ctx.mesh, [p]) for t, p in ((x, px), (w, pw), (bias, pb), (dy, pdy)))
        od = distribute_tensor(offsets, ctx.mesh, [Replicate()])
        with Collectives() as comm:
            got = (ops.ragged_grouped_linear(xd, wd, bd, od), ops.ragged_grouped_linear_grad_input(dyd, wd, od),
                   ops.ragged_grouped_linear_grad_weight(dyd, xd, od))
        # (grad_input over sharded output features comes out Partial: reducing it is the caller's)
        assert not comm.ran, f"ragged {name}: the ops communicated: {comm.ran}"
        assert name == "replicated" or (got[0].placements, got[1].placements, got[2].placements) == \
            ((Shard(1),), (Partial(),), (Shard(1),)), [t.placements for t in got]
        for what, g, ref in zip(("y", "grad_x", "grad_w"), got, want):
            ctx.close(f"ragged {name} {what}", g, ref)
    y0 = ops.ragged_grouped_linear(x, w, None, offsets)
    y_d = ops.ragged_grouped_linear(distribute_tensor(x, ctx.mesh, [Shard(1)]), distribute_tensor(w, ctx.mesh, [Shard(2)]),
                                    None, distribute_tensor(offsets, ctx.mesh, [Replicate()]))
    assert y_d.placements == (Partial(),), y_d.placements
    ctx.close("ragged input features y", y_d, y0)
    gw_d = ops.ragged_grouped_linear_grad_weight(distribute_tensor(dy, ctx.mesh, [Replicate()]),
                                                 distribute_tensor(x, ctx.mesh, [Shard(1)]),
                                                 distribute_tensor(offsets, ctx.mesh, [Replicate()]))
    assert gw_d.placements == (Shard(2),), gw_d.placements
    ctx.close("ragged input features grad_w", gw_d, want[2])
    # through grouped_linear(group_sizes=...) and autograd, the weight's output features sharded
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    sizes = torch.tensor([2, 0, 5], device=ctx.device)
    pg.grouped_linear(xr, wr, group_sizes=sizes).backward(dy)
    xd = distribute_tensor(x, ctx.mesh, [Replicate()]).requires_grad_()
    wd = distribute_tensor(w, ctx.mesh, [Shard(1)]).requires_grad_()
    y_d = pg.grouped_linear(xd, wd, group_sizes=distribute_tensor(sizes, ctx.mesh, [Replicate()]))
    assert y_d.placements == (Shard(1),), y_d.placements
    y_d.backward(distribute_tensor(dy, ctx.mesh, [Shard(1)]))
    ctx.close("ragged module y", y_d, pg.grouped_linear(x, w, group_sizes=sizes))
    ctx.close("ragged module grad_x", xd.grad, xr.grad)
    ctx.close("ragged module grad_w", wd.grad, wr.grad)


def bad_input(ctx):
    import pytest

    with pytest.raises(ValueError, match="holds no GroupedLinear"):
        shard_groups(nn.Linear(2, 2), ctx.mesh)
    with pytest.raises(ValueError, match="input_layout must be Replicate"):
        shard_groups(pg.GroupedLinear(2, 2, 2), ctx.mesh, input_layout=Partial())
    with pytest.raises(ValueError, match="1-D DeviceMesh"):
        shard_groups(pg.GroupedLinear(2, 2, 2), "cpu")
    module = shard_groups(pg.GroupedLinear(2, 2, 2).to(ctx.device, ctx.dtype), ctx.mesh, input_layout=Shard(3))
    with pytest.raises(ValueError, match="names a dim of a 3-D tensor"):
        module(ctx.randn(2, 2, 2, seed=9))
    with pytest.raises(ValueError, match="group-parallel already"):
        shard_groups(module, ctx.mesh)
    # Unequal batch shards: a clear error under TORCH_DISTRIBUTED_DEBUG=DETAIL (on every rank),
    # where the all-to-all's sizes would disagree; a DTensor input may be uneven.
    module = shard_groups(pg.GroupedLinear(4, 2, 3).to(ctx.device, ctx.dtype), ctx.mesh, input_layout=Shard(0))
    x_local = ctx.randn(2 + ctx.rank, 4, 2, seed=11)
    if ctx.world > 1:
        level = dist.get_debug_level()
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        try:
            with pytest.raises(ValueError, match=r"needs the same size of dim 0 on every rank, got \[2, 3"):
                module(x_local)
        finally:
            dist.set_debug_level(level)
    rows = [2 + r for r in range(ctx.world)]
    x_d = DTensor.from_local(x_local, ctx.mesh, [Shard(0)], run_check=False, shape=(sum(rows), 4, 2),
                             stride=(8, 2, 1))
    y_d = module(x_d)  # this rank's part of DTensor's even split of the samples
    assert y_d.shape == (ctx.mine(torch.empty(sum(rows))).shape[0], 4, 3), (y_d.shape, rows)
    # A DTensor comes back where asked, in the asked placement.
    module = shard_groups(pg.GroupedLinear(4, 2, 3).to(ctx.device, ctx.dtype), ctx.mesh, use_local_output=False)
    y = module(ctx.randn(2, 4, 2, seed=10))
    assert isinstance(y, DTensor) and y.placements == (Replicate(),) and y.shape == (2, 4, 3), y


SCENARIOS = {f.__name__: f for f in (ddp, ddp_compiled, fsdp2, fsdp2_compiled, group_parallel_groups_in,
                                     group_parallel_autocast, group_parallel_replicated_in, group_parallel_batch_in,
                                     group_parallel_few_groups, group_parallel_mlp, group_parallel_training,
                                     dtensor_rules, bad_input)}


def _rank_main(rank, world, backend, out, init_file):
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A scenario failing on one rank makes the others' collectives time out, not hang.
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    ctx = Ctx(rank, world, device)
    results = {}
    only = os.environ.get("PATCHGEMM_DIST_ONLY", "")
    for name, scenario in SCENARIOS.items():
        if only and name not in only.split(","):
            continue
        print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
        try:
            scenario(ctx)
            results[name] = "ok"
        except Exception:  # reported per scenario; the others still run
            results[name] = traceback.format_exc()
        torch._dynamo.reset()
        dist.barrier()
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:  # so far: a world cut short keeps these
            json.dump(results, f)
    dist.destroy_process_group()


def main(argv):
    world, backend, out = int(argv[0]), argv[1], argv[2]
    mp.spawn(_rank_main, args=(world, backend, out, os.path.join(out, "init")), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1:])
