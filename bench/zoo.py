"""convert() across timm's and transformers' model zoos: what it swaps, whether values and gradients
match, and the GPU time of a training step against the original.

    python bench/zoo.py [--json PATH] [--device DEV] [--batch N] [MODEL,MODEL,...]
    python bench/zoo.py --compile [--lock PATH] [--json PATH] [--batch N] [MODEL,MODEL,...]

MODEL is a timm model name, or ``transformers.<Class>`` for one of TRANSFORMERS_ZOO (built from its
library's default config). The default list is TIMM_ZOO then TRANSFORMERS_ZOO; a model whose library
is missing is reported as an error row and skipped.

Per model (random weights, batch 8 at the model's input size; videos and the Qwen2.5-VL tower 2):
the modules swapped; the converted model's fp32 (TF32 off) errors against the original run in
float64: of the output, of x's gradient, and the largest parameter-gradient error relative to the
largest parameter gradient's norm (a gradient that is zero in exact arithmetic, as a key
projection's bias under softmax, is all rounding and meaningless on its own); `/ orig`, the largest
of those three over the original fp32 model's own error, errors under ROUNDING counted as ROUNDING
(about 1 or below: as exact as the original; some models' gradients are mostly rounding, for both);
and, on a GPU, `GPU x`: the original's GPU time per bf16-autocast training step over the converted
model's (the profiler's kernel sum, as `bench --models`). Where `GPU x` < 1 convert has made the
model slower. On the CPU (``--device cpu``) the timing is left out: a check of values only.

``--compile`` judges patchgemm's compiler integration instead: per model, ``convert`` + ``torch.compile``
against ``patchgemm.compile`` on the unchanged model (Inductor's default mode, a bf16-autocast
training step as `bench --models --compile` runs it): the modules convert swaps and the calls the
compiler rewrites, each form's output against the eager original, and `GPU x`, the convert form's
GPU time per step over the integration's (1 where the two give the same speed). With ``--lock PATH``
the timings are taken holding an exclusive lock on PATH, so that processes sharing a GPU compile side
by side and time one at a time.
"""

import argparse
import contextlib
import copy
import fcntl
import json
import sys
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

import patchgemm
from patchgemm.tools import model_bench
from patchgemm.tools.bench import environment, kernel_ms

TIMM_ZOO = ("vit_small_patch16_224,vit_base_patch32_224,deit3_small_patch16_224,beit_base_patch16_224,"
            "vit_small_patch14_dinov2,flexivit_small,convnext_tiny,convnextv2_atto,swin_tiny_patch4_window7_224,"
            "swinv2_cr_tiny_224,mixer_s16_224,resmlp_12_224,cait_xxs24_224,crossvit_tiny_240,twins_svt_small,"
            "twins_pcpvt_small,focalnet_tiny_srf,davit_tiny,nest_tiny,visformer_tiny,edgenext_xx_small,"
            "inception_next_tiny,coat_lite_tiny,efficientformerv2_s0,pvt_v2_b0,rdnet_tiny,nextvit_small,starnet_s1,"
            "efficientvit_b0,ghostnetv3_100,lcnetv2_small,mobileone_s0")


class _VisionTower(nn.Module):
    """A Qwen2-VL style vision tower as a function of its flattened patches alone: every sample one
    image of a fixed patch grid (grid_thw), as its language model's processor feeds it."""

    def __init__(self, tower: nn.Module, grid_thw: Tuple[int, int, int]):
        super().__init__()
        self.tower, self.grid_thw = tower, grid_thw

    def forward(self, patches):
        per_image = self.grid_thw[0] * self.grid_thw[1] * self.grid_thw[2]
        grid = torch.tensor([self.grid_thw] * (patches.shape[0] // per_image), device=patches.device)
        return self.tower(patches, grid_thw=grid)


def _image(config) -> Tuple[int, ...]:
    size = config.image_size
    h, w = (size, size) if isinstance(size, int) else size
    return (config.num_channels, h, w)


def _video(config) -> Tuple[int, ...]:
    return (config.num_frames, *_image(config))


def _qwen_vl(version: str) -> Callable[[], nn.Module]:
    def build():
        if version == "2":
            from transformers.models.qwen2_vl import modeling_qwen2_vl as m
            config, tower = m.Qwen2VLVisionConfig(), m.Qwen2VisionTransformerPretrainedModel
        else:
            from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as m
            # (the config's default width is its language model's, 3584: the 7B model's tower is 1280 wide)
            config = m.Qwen2_5_VLVisionConfig(hidden_size=1280, num_heads=16)
            tower = m.Qwen2_5_VisionTransformerPretrainedModel
        return _VisionTower(tower._from_config(config), (1, 16, 16))
    return build


def _qwen_vl_input(model: nn.Module) -> Tuple[int, ...]:
    config = model.tower.config
    return (16 * 16, config.in_channels * config.temporal_patch_size * config.patch_size ** 2)


def _transformers(model_class: str, config_class: str, **config) -> Callable[[], nn.Module]:
    def build():
        import transformers
        return getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    return build


# name -> (build, the input of one sample given the model, batch)
TRANSFORMERS_ZOO: Dict[str, Tuple[Callable[[], nn.Module], Callable[[nn.Module], Tuple[int, ...]], int]] = {
    "transformers.ViTModel": (_transformers("ViTModel", "ViTConfig"), lambda m: _image(m.config), 8),
    "transformers.DeiTModel": (_transformers("DeiTModel", "DeiTConfig"), lambda m: _image(m.config), 8),
    "transformers.BeitModel": (_transformers("BeitModel", "BeitConfig"), lambda m: _image(m.config), 8),
    "transformers.Dinov2Model": (_transformers("Dinov2Model", "Dinov2Config"), lambda m: _image(m.config), 8),
    "transformers.CLIPVisionModel": (_transformers("CLIPVisionModel", "CLIPVisionConfig"),
                                     lambda m: _image(m.config), 8),
    "transformers.SiglipVisionModel": (_transformers("SiglipVisionModel", "SiglipVisionConfig"),
                                       lambda m: _image(m.config), 8),
    "transformers.YolosModel": (_transformers("YolosModel", "YolosConfig"), lambda m: _image(m.config), 2),
    "transformers.VitDetModel": (_transformers("VitDetModel", "VitDetConfig"), lambda m: _image(m.config), 8),
    "transformers.VideoMAEModel": (_transformers("VideoMAEModel", "VideoMAEConfig"), lambda m: _video(m.config), 2),
    "transformers.TimesformerModel": (_transformers("TimesformerModel", "TimesformerConfig"),
                                      lambda m: _video(m.config), 2),
    "transformers.VivitModel": (_transformers("VivitModel", "VivitConfig"), lambda m: _video(m.config), 2),
    "transformers.SwinModel": (_transformers("SwinModel", "SwinConfig"), lambda m: _image(m.config), 8),
    "transformers.Swinv2Model": (_transformers("Swinv2Model", "Swinv2Config"), lambda m: _image(m.config), 8),
    "transformers.ConvNextModel": (_transformers("ConvNextModel", "ConvNextConfig"), lambda m: (3, 224, 224), 8),
    "transformers.ConvNextV2Model": (_transformers("ConvNextV2Model", "ConvNextV2Config"),
                                     lambda m: (3, 224, 224), 8),
    "transformers.FocalNetModel": (_transformers("FocalNetModel", "FocalNetConfig"), lambda m: _image(m.config), 8),
    "transformers.PvtModel": (_transformers("PvtModel", "PvtConfig"), lambda m: _image(m.config), 8),
    "transformers.SegformerModel": (_transformers("SegformerModel", "SegformerConfig"), lambda m: (3, 512, 512), 8),
    "transformers.DPTForDepthEstimation": (_transformers("DPTForDepthEstimation", "DPTConfig"),
                                           lambda m: _image(m.config), 8),
    "transformers.Wav2Vec2Model": (_transformers("Wav2Vec2Model", "Wav2Vec2Config"), lambda m: (16000,), 8),
    "transformers.Qwen2VLVision": (_qwen_vl("2"), _qwen_vl_input, 8),
    "transformers.Qwen2_5_VLVision": (_qwen_vl("2.5"), _qwen_vl_input, 2),
}
ZOO = TIMM_ZOO + "," + ",".join(TRANSFORMERS_ZOO)


def build(name: str, device: torch.device, batch: int) -> Tuple[nn.Module, torch.Tensor]:
    """The model (random weights) and a random input batch."""
    torch.manual_seed(0)
    if name in TRANSFORMERS_ZOO:
        make, sample, default_batch = TRANSFORMERS_ZOO[name]
        model = make().to(device)
        shape = sample(model)
        if isinstance(model, _VisionTower):  # the batch's images' patches are rows of one tensor
            return model, torch.randn(shape[0] * (batch or default_batch), *shape[1:], device=device)
        return model, torch.randn(batch or default_batch, *shape, device=device)
    import timm
    model = timm.create_model(name, pretrained=False).to(device)
    return model, torch.randn(batch or 8, *model.pretrained_cfg.get("input_size", (3, 224, 224)), device=device)


# Errors below this (a few float32 ulps) are rounding however they compare: `/ orig` counts them as it.
ROUNDING = 1e-6


def _grads_and_output(model: nn.Module, x: torch.Tensor, g: Optional[torch.Tensor]):
    """(output, x's gradient, {name: parameter gradient}) of model(x) against g (random if None)."""
    x = x.clone().requires_grad_()
    y = model_bench._output(model(x))
    if g is None:
        g = torch.randn_like(y)
    y.backward(g.to(y.dtype))
    return y.detach(), x.grad, {k: p.grad for k, p in model.named_parameters() if p.grad is not None}, g


def _errors(got, ref) -> Tuple[float, float, float]:
    """Relative errors of the output and x's gradient, and the largest parameter-gradient error over
    the largest parameter gradient's norm."""
    rel = [((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item() for a, b in zip(got[:2], ref[:2])]
    scale = max(p.norm().item() for p in ref[2].values())
    return (*rel, max((((got[2][k].double() - p).norm().item() / scale) for k, p in ref[2].items()), default=0.0))


def check(name: str, device: torch.device, batch: int = 0) -> dict:
    model, x = build(name, device, batch)
    exact = copy.deepcopy(model).double()
    report = patchgemm.convert(model, inplace=False)
    conv = report.model
    for m in (model, conv, exact):
        m.eval()  # no dropout or drop path: the same function thrice
    ref = _grads_and_output(exact, x.double(), None)
    original, converted = (_errors(_grads_and_output(m, x, ref[3]), ref) for m in (model, conv))
    ratio = None
    if device.type == "cuda":
        ratio = (kernel_ms(model_bench._training_step(model, x, device), device, warmup=2, reps=3)
                 / kernel_ms(model_bench._training_step(conv, x, device), device, warmup=2, reps=3))
    return {"model": name, "swapped": len(report.swapped), "err_out": converted[0], "err_dx": converted[1],
            "err_dw": converted[2], "original_errors": original,
            "vs_original": max(c / max(o, ROUNDING) for c, o in zip(converted, original)), "gpu_x": ratio}


@contextlib.contextmanager
def _exclusive(path: Optional[str]):
    """Holds an exclusive lock on `path` (nothing without one)."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def check_compiled(name: str, device: torch.device, batch: int = 0, lock: Optional[str] = None) -> dict:
    """convert + torch.compile against patchgemm.compile on one model (the module docstring's --compile)."""
    model, x = build(name, device, batch)
    forms = {form: model_bench._compiled(form, model)[0] for form in ("convert+compile", "patchgemm.compile")}
    row = {"model": name, "swapped": len(patchgemm.convert(model, inplace=False).swapped)}
    model.eval()  # the outputs in eval mode: no dropout or drop path, norms on their running stats
    for form, m in forms.items():
        m.eval()  # (each form holds a copy of the model: its own mode)
        with _naming(form), torch.no_grad():
            row[f"diff {form}"] = model_bench._relative_diff(m, model, x)
    steps = {form: model_bench._training_step(m, x, device) for form, m in forms.items()}  # (train mode)
    for form, step in steps.items():
        with _naming(form):
            step(0)  # compiles the training graph
    row["rewritten"] = len(forms["patchgemm.compile"].patchgemm_report.rewritten)
    if device.type == "cuda":
        with _exclusive(lock):
            ms = {form: kernel_ms(step, device, warmup=2, reps=5) for form, step in steps.items()}
        row.update({f"ms {form}": t for form, t in ms.items()})
        row["gpu_x"] = ms["convert+compile"] / ms["patchgemm.compile"]
    return row


@contextlib.contextmanager
def _naming(form: str):
    """Names the form that failed in the error."""
    try:
        yield
    except Exception as e:
        raise RuntimeError(f"{form}: {type(e).__name__}: {e}") from e


def format_compiled_rows(rows, header: bool = True) -> str:
    lines = [f"{'model':<36} {'swap':>4} {'rewr':>4} {'diff conv':>9} {'diff pg':>9} {'conv ms':>8} {'pg ms':>8} "
             f"{'GPU x':>6}"] if header else []
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<36} error: {r['error']}")
            continue
        ms = [r.get(f"ms {f}") for f in ("convert+compile", "patchgemm.compile")]
        lines.append(f"{r['model']:<36} {r['swapped']:>4} {r['rewritten']:>4} {r['diff convert+compile']:>9.1e} "
                     f"{r['diff patchgemm.compile']:>9.1e} "
                     + " ".join("       -" if t is None else f"{t:>8.3f}" for t in ms)
                     + ("      -" if r.get("gpu_x") is None else f" {r['gpu_x']:>6.3f}"))
    return "\n".join(lines)


def format_rows(rows, header: bool = True, errors: bool = True) -> str:
    """check()'s rows as a table (`errors=False`: without the three errors `/ orig` sums up)."""
    lines = [f"{'model':<36} {'swap':>4}" + (f" {'err out':>9} {'err dx':>9} {'err dW':>9}" if errors else "")
             + f" {'/ orig':>7} {'GPU x':>7}"] if header else []
    for r in rows:
        if "error" in r:
            lines.append(f"{r['model']:<36} error: {r['error']}")
        else:
            gpu_x = "-" if r.get("gpu_x") is None else f"{r['gpu_x']:.3f}"
            errs = f" {r['err_out']:>9.1e} {r['err_dx']:>9.1e} {r['err_dw']:>9.1e}" if errors else ""
            lines.append(f"{r['model']:<36} {r['swapped']:>4}{errs} {r['vs_original']:>7.2f} {gpu_x:>7}")
    return "\n".join(lines)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="?", default=ZOO)
    parser.add_argument("--json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=0,
                        help="samples per batch (default: 8; videos and the Qwen2.5-VL tower 2)")
    parser.add_argument("--compile", action="store_true",
                        help="convert + torch.compile against patchgemm.compile (the docstring says how)")
    parser.add_argument("--lock", help="with --compile: time while holding an exclusive lock on this file")
    args = parser.parse_args(argv[1:])
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)
    fmt = format_compiled_rows if args.compile else format_rows
    print(fmt([]), flush=True)
    rows = []
    for name in args.models.split(","):
        try:
            rows.append(check_compiled(name, device, args.batch, args.lock) if args.compile
                        else check(name, device, args.batch))
        except Exception as e:  # a model this library lacks, or one that fails: say so, go on
            rows.append({"model": name, "error": f"{type(e).__name__}: {str(e)[:160]}"})
        print(fmt(rows[-1:], header=False), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.json:  # after every model: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                kind = "zoo-compile" if args.compile else "zoo"
                json.dump({"kind": kind, "environment": environment(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv)
