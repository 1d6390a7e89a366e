"""convert() across timm's model zoo: what it swaps, whether values and gradients match, and the
GPU time of a training step against the original.

    python bench/timm_zoo.py [--json PATH] [MODEL,MODEL,...]     (default: ZOO; needs timm and a GPU)

Per model (random weights, batch 8 at the model's input size): the modules swapped; fp32 (TF32 off)
relative differences of the output and of x's gradient, and the largest parameter-gradient
difference relative to the largest parameter gradient's norm (a gradient that is zero in exact
arithmetic, as a key projection's bias under softmax, is all rounding and meaningless on its own);
and `GPU x`: the original's GPU time per bf16-autocast training step over the converted model's
(the profiler's kernel sum, as `bench --models`). Where `GPU x` < 1 convert has made the model slower.
"""

import argparse
import json
import sys

import torch

import patchgemm
from patchgemm import model_bench
from patchgemm.bench import environment, kernel_ms

ZOO = ("vit_small_patch16_224,vit_base_patch32_224,deit3_small_patch16_224,beit_base_patch16_224,"
       "vit_small_patch14_dinov2,flexivit_small,convnext_tiny,convnextv2_atto,swin_tiny_patch4_window7_224,"
       "swinv2_cr_tiny_224,mixer_s16_224,resmlp_12_224,cait_xxs24_224,crossvit_tiny_240,twins_svt_small,"
       "twins_pcpvt_small,focalnet_tiny_srf,davit_tiny,nest_tiny,visformer_tiny,edgenext_xx_small,"
       "inception_next_tiny,coat_lite_tiny,efficientformerv2_s0,pvt_v2_b0,rdnet_tiny,nextvit_small,starnet_s1,"
       "efficientvit_b0,ghostnetv3_100,lcnetv2_small,mobileone_s0")


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(name: str, device: torch.device, batch: int = 8) -> dict:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False).to(device)
    x = torch.randn(batch, *model.pretrained_cfg.get("input_size", (3, 224, 224)), device=device)
    report = patchgemm.convert(model, inplace=False)
    conv = report.model
    model.eval(), conv.eval()  # no dropout or drop path: the same function twice
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = model_bench._output(model(xa)), model_bench._output(conv(xb))
    g = torch.randn_like(ya)
    ya.backward(g), yb.backward(g)
    grads = dict(model.named_parameters())
    scale = max(p.grad.norm().item() for p in grads.values() if p.grad is not None)
    dw = max(((p.grad - grads[k].grad).norm().item() / scale for k, p in conv.named_parameters()
              if p.grad is not None), default=0.0)
    ratio = (kernel_ms(model_bench._training_step(model, x, device), device, warmup=2, reps=3)
             / kernel_ms(model_bench._training_step(conv, x, device), device, warmup=2, reps=3))
    return {"model": name, "swapped": len(report.swapped), "d_out": _rel(yb, ya), "d_dx": _rel(xb.grad, xa.grad),
            "d_dw": dw, "gpu_x": ratio}


def format_rows(rows, header: bool = True) -> str:
    lines = [f"{'model':<32} {'swap':>4} {'d out':>9} {'d dx':>9} {'d dW':>9} {'GPU x':>7}"] if header else []
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<32} error: {r['error']}")
        else:
            lines.append(f"{r['model']:<32} {r['swapped']:>4} {r['d_out']:>9.1e} {r['d_dx']:>9.1e} {r['d_dw']:>9.1e} "
                         f"{r['gpu_x']:>7.3f}")
    return "\n".join(lines)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="?", default=ZOO)
    parser.add_argument("--json")
    args = parser.parse_args(argv[1:])
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda")
    print(format_rows([]), flush=True)
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(check(name, device))
        except Exception as e:  # a model this timm lacks, or one that fails: say so, go on
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        print(format_rows(rows[-1:], header=False), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kind": "timm_zoo", "environment": environment(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv)
