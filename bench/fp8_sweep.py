"""Where FP8 pays: GroupedLinear(fp8=True) (current scaling, the recipe fp8_autocast defaults to)
against GroupedLinear in bfloat16, over a seeded sample of grouped-linear shapes.

    python bench/fp8_sweep.py [--json out.json] [--shapes 90] [--ragged]

Shapes: G in {1, 4, 12, 32} groups of M in {256 ... 16384} rows, K and N in {256 ... 4096} (K in,
N out per group), at most 2^28 elements in x, y or the weight. Forward and forward+backward GPU
time (bench's time_ms, three input sets rotated), bias on. Each row gets h = 1 / (1/M + 1/K + 1/N):
FP8 halves the GEMMs' time, which grows as M K N, and adds passes over x, the weight and the output
gradient, which grow as M K + K N + M N, so their ratio decides (docs/design.md, "FP8").
--ragged: mixture-of-experts shapes instead (E in {8, 64} experts of about M in {256, 1024, 4096}
rows, sizes within a quarter of M, offsets on the GPU as moe_experts has them; (K, N) in (1024,
2048), (2048, 1024), (4096, 4096), (4096, 14336)), ragged grouped_linear. Needs an sm_89+ GPU.
"""

import argparse
import itertools
import json
import random
import sys

import torch

import patchgemm
from patchgemm.fp8 import harmonic_size, shape_pays
from patchgemm.tools.bench import environment, time_ms


def ragged_shapes():
    """(E experts, M rows each on average, K, N): mixture-of-experts layers."""
    grid = itertools.product([8, 64], [256, 1024, 4096], [(1024, 2048), (2048, 1024), (4096, 4096), (4096, 14336)])
    return [(e, m, k, n) for e, m, (k, n) in grid if e * m * max(k, n) <= 2**28 and e * k * n <= 2**30]


def shapes(count: int):
    grid = list(itertools.product([1, 4, 12, 32], [256, 1024, 4096, 16384], [256, 512, 1024, 2048, 4096],
                                  [256, 512, 1024, 2048, 4096]))
    random.Random(1).shuffle(grid)
    fits = [s for s in grid if s[0] * s[1] * max(s[2], s[3]) <= 2**28 and s[0] * s[2] * s[3] <= 2**28]
    return fits[:count]


def measure(groups, rows, k, n, device):
    xs = [torch.randn(rows, groups, k, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    grads = [torch.randn(rows, groups, n, device=device, dtype=torch.bfloat16) for _ in range(3)]
    bf16 = patchgemm.GroupedLinear(groups, k, n, device=device, dtype=torch.bfloat16)
    fp8 = patchgemm.GroupedLinear(groups, k, n, device=device, dtype=torch.bfloat16, fp8=True)
    fp8.load_state_dict(bf16.state_dict())
    row = {"G": groups, "M": rows, "K": k, "N": n}
    for name, layer in (("bf16", bf16), ("fp8", fp8)):
        def forward(i, layer=layer):
            with torch.no_grad():
                layer(xs[i % 3])

        def forward_backward(i, layer=layer):
            layer(xs[i % 3]).backward(grads[i % 3])

        row[f"{name}_fwd"] = time_ms(forward, device, reps=15).ms
        row[f"{name}_fwd_bwd"] = time_ms(forward_backward, device, reps=10).ms
    return row


def measure_ragged(experts, rows, k, n, device):
    """grouped_linear over ragged groups (sizes within a quarter of `rows`, offsets on the GPU)."""
    sizes = torch.full((experts,), rows) + torch.randint(-rows // 4, rows // 4 + 1, (experts,),
                                                         generator=torch.Generator().manual_seed(0))
    sizes[-1] = experts * rows - sizes[:-1].sum()
    offsets = torch.cumsum(sizes, 0).to(torch.int32).to(device)
    xs = [torch.randn(experts * rows, k, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2)]
    grads = [torch.randn(experts * rows, n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    weight = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(experts, n, device=device, dtype=torch.bfloat16, requires_grad=True)
    row = {"E": experts, "M": rows, "K": k, "N": n}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        def forward(i, fp8=fp8):
            with torch.no_grad():
                patchgemm.grouped_linear(xs[i % 2], weight, bias, offsets=offsets, fp8=fp8)

        def forward_backward(i, fp8=fp8):
            patchgemm.grouped_linear(xs[i % 2], weight, bias, offsets=offsets, fp8=fp8).backward(grads[i % 2])

        row[f"{name}_fwd"] = time_ms(forward, device, reps=10).ms
        row[f"{name}_fwd_bwd"] = time_ms(forward_backward, device, reps=6).ms
    return row


def format_rows(rows) -> str:
    """Dense rows (G groups) with the rule's verdict; ragged rows (E experts), which regions leave in bf16."""
    groups = "E" if rows and "E" in rows[0] else "G"
    lines = [f"{groups:>3} {'M':>6} {'K':>5} {'N':>5} {'h':>6} {'GFLOP':>7} {'bf16 ms':>8} {'fwd':>6} {'fwd+bwd':>8}  rule"]
    for r in sorted(rows, key=lambda r: harmonic_size(r["M"], r["K"], r["N"])):
        h, flops = harmonic_size(r["M"], r["K"], r["N"]), 2.0 * r[groups] * r["M"] * r["K"] * r["N"]
        rule = "fp8" if groups == "G" and shape_pays(r["M"], r["K"], r["N"], r["G"]) else "bf16"
        lines.append(f"{r[groups]:>3} {r['M']:>6} {r['K']:>5} {r['N']:>5} {h:>6.0f} {flops / 1e9:>7.1f} "
                     f"{r['bf16_fwd_bwd']:>8.3f} {r['bf16_fwd'] / r['fp8_fwd']:>5.2f}x "
                     f"{r['bf16_fwd_bwd'] / r['fp8_fwd_bwd']:>7.2f}x  {rule}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows and the environment here")
    parser.add_argument("--shapes", type=int, default=90, help="how many shapes of the seeded sample")
    parser.add_argument("--ragged", action="store_true", help="mixture-of-experts shapes (ragged groups) instead")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for shape in ragged_shapes() if args.ragged else shapes(args.shapes):
        rows.append((measure_ragged if args.ragged else measure)(*shape, device))
        torch.cuda.empty_cache()
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "fp8-sweep", "ragged": args.ragged, "environment": environment(device), "rows": rows},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
