"""Grouped linear on several GPUs: group parallelism against data parallelism (DDP), step time and
memory per GPU.

    torchrun --nproc-per-node 2 bench/distributed.py [--layers G1,G64] [--json PATH] [--smoke]

One training step of one GroupedLinear layer (forward + backward of y.sum(), the global batch
fixed), in these forms:

- ``1 GPU``: the whole layer and batch on rank 0 alone (the other ranks wait);
- ``DDP``: the layer replicated, each rank its share of the batch, gradients all-reduced;
- ``groups, batch-sharded in``: ``patchgemm.distributed.shard_groups`` with each rank's share of the
  batch coming in and going out (an all-to-all each way, forward and backward);
- ``groups, replicated in``: every rank holds the whole batch (as after a replicated layer), computes
  its groups and all-gathers the output;
- ``groups, groups-sharded in``: the input already split by groups (a run of group-parallel layers):
  no communication, the compute-only bound.

Step time, the slowest rank's, median of rounds of back-to-back steps: ``ms/step`` is the wall time
(CUDA events; the larger of GPU and host time per step), ``GPU ms`` the GPU's own (the GPU kept busy
while the host queues the round) and ``host ms`` the time the host takes to issue a step. ``speedup``
= the 1-GPU form's time / the form's, on the same global batch (throughput), wall and GPU time.
Memory: the peak a step allocates on a GPU above what was allocated before it, the largest over the
ranks. Without GPUs (``--smoke``: gloo, tiny shapes) it checks that every form runs.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, init_device_mesh
from torch.nn.parallel import DistributedDataParallel as DDP

import patchgemm
from patchgemm.tools.bench import sleep_ms, environment
from patchgemm.distributed import shard_groups

LAYERS = {  # name: (global batch, groups, in, out)
    "G1": (2560, 12, 1024, 3072),  # BENCHMARKS.md G1
    "G64": (2048, 64, 1024, 1024),
}
SMOKE = {"G1": (8, 4, 16, 24), "G64": (8, 8, 16, 16)}
ROUNDS, STEPS = 7, 10


def _max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_steps(step, device, active=True) -> dict:
    """The slowest rank's medians over rounds of STEPS steps: ``ms``, wall time per step (steps
    back to back, as training runs them: the larger of GPU and host time); ``gpu_ms``, GPU time
    per step (the GPU kept busy while the host queues the round, so host gaps do not count);
    ``host_ms``, host time to issue a step; ``peak_mb``, what a step allocates above the start."""
    cuda = device.type == "cuda"
    if active:
        step()
        step()  # warm-up: cuBLAS handles, DTensor's plans
    wall, gpu, host = [], [], []
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(ROUNDS):
        for busy in (False, True) if cuda else (False,):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize(device)
                if busy:  # twice the host time of a round, so the host has queued it all
                    sleep_ms(2 * STEPS * max(host, default=1.0) + 0.5, device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            if active:
                for _ in range(STEPS):
                    step()
            issued_ms = (time.perf_counter() - t0) * 1e3 / STEPS
            ms = issued_ms
            if cuda:
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end) / STEPS
            (gpu if busy else wall).append(_max_over_ranks(ms if active else 0.0, device))
            if busy or not cuda:
                host.append(_max_over_ranks(issued_ms if active else 0.0, device))
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if cuda and active else 0.0
    median = statistics.median
    return {"ms": median(wall), "gpu_ms": median(gpu) if gpu else None, "host_ms": median(host),
            "peak_mb": _max_over_ranks(peak, device)}


def _forms(dims, device, dtype, mesh, rank, world):
    batch, groups, din, dout = dims
    torch.manual_seed(0)
    layer = patchgemm.GroupedLinear(groups, din, dout, device=device, dtype=dtype)
    x = torch.randn(batch, groups, din, device=device, dtype=dtype)
    mine = x.chunk(world, 0)[rank].contiguous()

    def step_of(module, inputs):
        grad = torch.ones_like(module(inputs).detach())  # d loss / d y of loss = y.sum()

        def step():
            module(inputs).backward(grad)
        return step

    ddp = DDP(patchgemm.GroupedLinear(groups, din, dout, device=device, dtype=dtype),
              device_ids=[device.index] if device.type == "cuda" else None)
    yield "1 GPU", step_of(layer, x), rank == 0
    yield "DDP", step_of(ddp, mine), True
    for label, placement, inputs in (("groups, batch-sharded in", Shard(0), mine),
                                     ("groups, replicated in", Replicate(), x),
                                     ("groups, groups-sharded in", Shard(1), x.chunk(world, 1)[rank].contiguous())):
        module = shard_groups(patchgemm.GroupedLinear(groups, din, dout, device=device, dtype=dtype), mesh,
                              input_layout=placement)
        yield label, step_of(module, inputs), True


def format_rows(rows) -> str:
    """The step-time table (also bench/results.py's section for a saved run)."""
    lines = [f"{'layer':6} {'form':28} {'GPUs':>4} {'ms/step':>9} {'speedup':>8} {'GPU ms':>8} {'GPU speedup':>12} "
             f"{'host ms':>8} {'peak MB/GPU':>12}"]
    for r in rows:
        gpu = (f"{r['gpu_ms']:8.3f} {r['gpu_speedup']:11.2f}x" if r.get("gpu_ms") is not None
               else f"{'-':>8} {'-':>12}")
        host = f"{r['host_ms']:8.3f}" if r.get("host_ms") is not None else f"{'-':>8}"
        lines.append(f"{r['layer']:6} {r['form']:28} {r['gpus']:>4} {r['ms']:9.3f} {r['speedup']:7.2f}x {gpu} "
                     f"{host} {r['peak_mb']:12.0f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--json")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (a check that every form runs)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    mesh = init_device_mesh(device.type, (world,))
    rows = []
    for name in args.layers.split(","):
        dims = (SMOKE if args.smoke else LAYERS)[name]
        single = None
        for label, step, active in _forms(dims, device, dtype, mesh, rank, world):
            row = _time_steps(step, device, active)
            single = row if label == "1 GPU" else single
            row.update(layer=name, dims=dims, form=label, gpus=1 if label == "1 GPU" else world,
                       speedup=single["ms"] / row["ms"],
                       gpu_speedup=single["gpu_ms"] / row["gpu_ms"] if row["gpu_ms"] else None)
            rows.append(row)
    if rank == 0:
        print(format_rows(rows))
        if args.json:
            env = environment(device)
            env.update(world=world, backend=dist.get_backend(), dtype=str(dtype).replace("torch.", ""))
            with open(args.json, "w") as f:
                json.dump({"kind": "distributed", "environment": env, "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
