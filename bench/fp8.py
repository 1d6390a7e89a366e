"""FP8 grouped linear against bf16 and against the FP8 a user can write with PyTorch, same run.

    python bench/fp8.py [--json out.json] [--shapes G1,...,P1,H1,R1]

Per grouped-linear shape ([B, G, Din] -> Dout per group, bias): forward and forward+backward, GPU
time (median of CUDA events, the host's issue time apart) for
  patchgemm bf16              GroupedLinear in bfloat16;
  patchgemm fp8               GroupedLinear(fp8=True) on the same bfloat16 tensors (quantization of x
                              and the weight included in every call, as current scaling does);
  fp8 weight reused           the same with is_first_microbatch=False: the weight's FP8 copy made once
                              (gradient accumulation's microbatches after the first);
  fp8 delayed                 Float8Recipe(scaling="delayed"): each tensor scaled by its amax history,
                              one pass over it (after a first call that seeds the history);
  fp8 delayed, weight reused  both;
  torch._scaled_grouped_mm    x and the weight quantized with torch ops, one batched FP8 GEMM with
                              (broadcast) row-wise scales, then the [G, B, N] -> [B, G, N] copy;
  torch._scaled_mm per group  the same quantization, G FP8 GEMMs, stacked.
PyTorch's FP8 GEMMs have no backward: forward+backward compares with bf16 only.
The layer cases (P1: ViT-B/16's stem at batch 128, tokens out; H1: a MATEY-style 3-D hMLP stem,
x [8, 4, 128^3], kernels 2, 2, 4 to 768; R1: a mixture of experts' layer, 8 experts of 1024 -> 2048
over 16k routed rows, group sizes uneven, e4m3 gradients) compare patchgemm bf16 with patchgemm
fp8 only (no PyTorch FP8 path exists for them); forward+backward computes the weights' gradients
(and the input's for R1).
Needs an sm_89+ GPU.
"""

import argparse
import json
import sys

import torch

import patchgemm
from patchgemm.tools.bench import environment, time_ms

SHAPES = {  # id: (B, G, Din, Dout)
    "G1": (2560, 12, 1024, 3072),
    "G1-down": (2560, 12, 3072, 1024),
    "G4": (8192, 8, 512, 512),
    "G5": (1024, 32, 256, 1024),
}
E4M3 = torch.float8_e4m3fn


def quantize_with_torch(t):
    """Per-tensor current scaling as a user writes it: (data, dequantization scale)."""
    amax = t.abs().amax().float()
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (t.float() / scale).clamp(-448, 448).to(E4M3), scale


def scaled_grouped_mm_forward(x, w, b):
    x8, sx = quantize_with_torch(x)
    w8, sw = quantize_with_torch(w)
    G, B, N = w.shape[0], x.shape[0], w.shape[1]
    y = torch._scaled_grouped_mm(x8.transpose(0, 1).contiguous(), w8.transpose(1, 2), sx.expand(G, B).contiguous(),
                                 sw.expand(G, N).contiguous(), out_dtype=torch.bfloat16)
    return (y + b.unsqueeze(1)).transpose(0, 1).contiguous()


def scaled_mm_loop_forward(x, w, b):
    x8, sx = quantize_with_torch(x)
    w8, sw = quantize_with_torch(w)
    return torch.stack([torch._scaled_mm(x8[:, g].contiguous(), w8[g].t(), sx, sw, bias=b[g],
                                         out_dtype=torch.bfloat16) for g in range(w.shape[0])], dim=1)


def measure(shape_id, device):
    B, G, D, N = SHAPES[shape_id]
    torch.manual_seed(0)
    x = torch.randn(B, G, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(B, G, N, device=device, dtype=torch.bfloat16)
    layer = patchgemm.GroupedLinear(G, D, N, device=device, dtype=torch.bfloat16)
    layer8 = patchgemm.GroupedLinear(G, D, N, device=device, dtype=torch.bfloat16, fp8=True)
    delayed = patchgemm.GroupedLinear(G, D, N, device=device, dtype=torch.bfloat16,
                                      fp8=patchgemm.Float8Recipe(scaling="delayed"))
    for fp8_layer in (layer8, delayed):
        fp8_layer.load_state_dict(layer.state_dict())
        fp8_layer(x, is_first_microbatch=True).backward(grad)  # the weight's copy kept, the histories seeded
    w, b = layer.weight.detach(), layer.bias.detach()
    modules = {  # name: (module, its call's keyword arguments)
        "patchgemm bf16": (layer, {}),
        "patchgemm fp8": (layer8, {}),
        "fp8 weight reused": (layer8, {"is_first_microbatch": False}),
        "fp8 delayed": (delayed, {}),
        "fp8 delayed, weight reused": (delayed, {"is_first_microbatch": False}),
    }
    forward = {
        **{name: (lambda m=m, kw=kw: m(x, **kw)) for name, (m, kw) in modules.items()},
        "torch._scaled_grouped_mm": lambda: scaled_grouped_mm_forward(x.detach(), w, b),
        "torch._scaled_mm per group": lambda: scaled_mm_loop_forward(x.detach(), w, b),
    }
    reference = layer(x).detach().double()
    rows = []
    for name, fn in forward.items():
        try:
            with torch.no_grad():
                error = ((fn().double() - reference).norm() / reference.norm()).item()
                t = time_ms(lambda i: fn(), device)
        except (RuntimeError, NotImplementedError) as e:  # an op this torch or GPU lacks
            rows.append({"shape": shape_id, "pass": "fwd", "impl": name, "error": str(e).splitlines()[0]})
            continue
        rows.append({"shape": shape_id, "pass": "fwd", "impl": name, "gpu_ms": t.ms, "host_ms": t.host_ms,
                     "rel_err_vs_bf16": error})
    for name, (module, kw) in modules.items():
        def step(i, module=module, kw=kw):
            x.grad = None
            module.zero_grad(set_to_none=True)
            module(x, **kw).backward(grad)
        t = time_ms(step, device)
        rows.append({"shape": shape_id, "pass": "fwd+bwd", "impl": name, "gpu_ms": t.ms, "host_ms": t.host_ms})
    flops = 2.0 * B * G * D * N
    for r in rows:
        if "gpu_ms" in r:
            r["tflops"] = flops * (3 if r["pass"] == "fwd+bwd" else 1) / r["gpu_ms"] / 1e9
    return rows


def layer_case(case_id, device):
    """(module in bf16, the same in fp8, x, needs x's gradient, GEMM flops of the forward)."""
    torch.manual_seed(0)
    bf16 = dict(device=device, dtype=torch.bfloat16)
    if case_id == "P1":
        make = lambda fp8: patchgemm.PatchEmbed(3, 768, 16, out_format="tokens", fp8=fp8, **bf16)  # noqa: E731
        x, flops = torch.randn(128, 3, 224, 224, **bf16), 2.0 * 128 * 196 * 768 * 768
        return make(False), make(True), (x,), False, flops
    if case_id == "H1":
        make = lambda fp8: patchgemm.HierarchicalPatchEmbed(  # noqa: E731
            4, 768, (2, 2, 4), hidden_dim=192, fp8=fp8, **bf16)
        x = torch.randn(8, 4, 128, 128, 128, **bf16)
        tokens = 8 * 64**3
        flops = 2.0 * (tokens * 4 * 8 * 192 + tokens / 8 * 192 * 8 * 192 + tokens / 512 * 192 * 64 * 768)
        return make(False), make(True), (x,), False, flops
    if case_id == "R1":
        sizes = torch.tensor([3000, 100, 2500, 1999, 2001, 4100, 1084, 1600], device=device)
        # e4m3 gradients: torch._scaled_grouped_mm's only format, so no pass reads the sizes on the host
        # (a host sync in the timed call would time the GPU's idling too)
        recipe = patchgemm.Float8Recipe(backward_format=torch.float8_e4m3fn)
        make = lambda fp8: _Ragged(8, 1024, 2048, sizes, recipe if fp8 else False, bf16)  # noqa: E731
        x = torch.randn(int(sizes.sum()), 1024, **bf16, requires_grad=True)
        return make(False), make(True), (x,), True, 2.0 * x.shape[0] * 1024 * 2048
    raise ValueError(f"unknown case {case_id}")


class _Ragged(torch.nn.Module):
    def __init__(self, groups, din, dout, sizes, fp8, factory):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(groups, dout, din, **factory) / din**0.5)
        self.sizes, self.fp8 = sizes, fp8

    def forward(self, x):
        return patchgemm.grouped_linear(x, self.weight, group_sizes=self.sizes, fp8=self.fp8)


def measure_layer(case_id, device):
    plain, fp8, inputs, needs_dx, flops = layer_case(case_id, device)
    fp8.load_state_dict(plain.state_dict())
    rows = []
    with torch.no_grad():
        reference = plain(*inputs).double()
    for name, module in (("patchgemm bf16", plain), ("patchgemm fp8", fp8)):
        with torch.no_grad():
            error = ((module(*inputs).double() - reference).norm() / reference.norm()).item()
            t = time_ms(lambda i, module=module: module(*inputs), device)
        rows.append({"shape": case_id, "pass": "fwd", "impl": name, "gpu_ms": t.ms, "host_ms": t.host_ms,
                     "rel_err_vs_bf16": error, "tflops": flops / t.ms / 1e9})
        grad = torch.randn_like(reference, dtype=torch.bfloat16)

        def step(i, module=module, grad=grad):
            for x in inputs:
                x.grad = None
            module.zero_grad(set_to_none=True)
            module(*inputs).backward(grad)
        t = time_ms(step, device)
        rows.append({"shape": case_id, "pass": "fwd+bwd", "impl": name, "gpu_ms": t.ms, "host_ms": t.host_ms,
                     "tflops": flops * (3 if needs_dx else 2) / t.ms / 1e9})
    return rows


LAYERS = ("P1", "H1", "R1")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows and the environment here")
    every = (*SHAPES, *LAYERS)
    parser.add_argument("--shapes", default=",".join(every), help="comma-separated ids of " + ", ".join(every))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        sys.exit("bench/fp8.py: needs an sm_89+ NVIDIA GPU")
    device = torch.device("cuda")
    rows = [r for s in args.shapes.split(",") for r in (measure_layer if s in LAYERS else measure)(s, device)]
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "fp8", "environment": environment(device), "rows": rows}, f, indent=1)


def format_rows(rows) -> str:
    """The table: per shape and pass, each implementation's times and its speed-up over bf16."""
    lines = [f"{'shape':8} {'pass':8} {'implementation':26} {'GPU ms':>7} {'host ms':>7} {'vs bf16':>7} "
             f"{'rel err':>7}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['shape']:8} {r['pass']:8} {r['impl']:26} n/a: {r['error'][:80]}")
            continue
        base = next(q for q in rows if q["shape"] == r["shape"] and q["pass"] == r["pass"]
                    and q["impl"] == "patchgemm bf16")
        err = f"{r['rel_err_vs_bf16']:.4f}" if "rel_err_vs_bf16" in r else ""
        lines.append(f"{r['shape']:8} {r['pass']:8} {r['impl']:26} {r['gpu_ms']:7.3f} {r['host_ms']:7.3f} "
                     f"{base['gpu_ms'] / r['gpu_ms']:6.2f}x {err:>7}".rstrip())
    return "\n".join(lines)


if __name__ == "__main__":
    main()
