"""Where FP8 pays: GroupedLinear(fp8=True) (current scaling, the recipe fp8_autocast defaults to)
against GroupedLinear in bfloat16, over a seeded sample of grouped-linear shapes.

    python bench/fp8_sweep.py [--json out.json] [--shapes 90]

Shapes: G in {1, 4, 12, 32} groups of M in {256 ... 16384} rows, K and N in {256 ... 4096} (K in,
N out per group), at most 2^28 elements in x, y or the weight. Forward and forward+backward GPU
time (bench's time_ms, three input sets rotated), bias on. Each row gets h = 1 / (1/M + 1/K + 1/N):
FP8 halves the GEMMs' time, which grows as M K N, and adds passes over x, the weight and the output
gradient, which grow as M K + K N + M N, so their ratio decides (docs/design.md, "FP8"). Needs an
sm_89+ GPU.
"""

import argparse
import itertools
import json
import random
import sys

import torch

import patchgemm
from patchgemm.tools.bench import environment, time_ms

RULE_H, RULE_FLOPS = 500.0, 5e10  # FP8 forward+backward pays above both (docs/design.md)


def shapes(count: int):
    grid = list(itertools.product([1, 4, 12, 32], [256, 1024, 4096, 16384], [256, 512, 1024, 2048, 4096],
                                  [256, 512, 1024, 2048, 4096]))
    random.Random(1).shuffle(grid)
    fits = [s for s in grid if s[0] * s[1] * max(s[2], s[3]) <= 2**28 and s[0] * s[2] * s[3] <= 2**28]
    return fits[:count]


def harmonic(m: int, k: int, n: int) -> float:
    return 1.0 / (1.0 / m + 1.0 / k + 1.0 / n)


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


def format_rows(rows) -> str:
    lines = [f"{'G':>3} {'M':>6} {'K':>5} {'N':>5} {'h':>6} {'GFLOP':>7} {'bf16 ms':>8} {'fwd':>6} {'fwd+bwd':>8}  rule"]
    for r in sorted(rows, key=lambda r: harmonic(r["M"], r["K"], r["N"])):
        h, flops = harmonic(r["M"], r["K"], r["N"]), 2.0 * r["G"] * r["M"] * r["K"] * r["N"]
        rule = "fp8" if h > RULE_H and flops >= RULE_FLOPS else "bf16"
        lines.append(f"{r['G']:>3} {r['M']:>6} {r['K']:>5} {r['N']:>5} {h:>6.0f} {flops / 1e9:>7.1f} "
                     f"{r['bf16_fwd_bwd']:>8.3f} {r['bf16_fwd'] / r['fp8_fwd']:>5.2f}x "
                     f"{r['bf16_fwd_bwd'] / r['fp8_fwd_bwd']:>7.2f}x  {rule}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the rows and the environment here")
    parser.add_argument("--shapes", type=int, default=90, help="how many shapes of the seeded sample")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = []
    for groups, m, k, n in shapes(args.shapes):
        rows.append(measure(groups, m, k, n, device))
        torch.cuda.empty_cache()
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "fp8-sweep", "environment": environment(device), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
