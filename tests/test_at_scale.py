"""The ops at the sizes users run, on a GPU: many waves of output tiles over every SM.

- Repeats are bitwise equal: every candidate that runs this library's code, forced in turn on each
  case of scale_cases.py it takes, gives the same bits five times over, forward and backward. Our
  kernels are documented as deterministic, and a race shows here long before it shows against a
  tolerance.
- The patch stems of real models (timm, transformers; built from their configs) at training batch
  sizes, every applicable candidate of the forward, the weight gradient and the input gradient
  forced in turn, against float64.
- A seeded, time-boxed fuzz of large patch problems (batches up to 512, up to ~100k token rows, the
  embedding widths of real models, odd grids, all three output formats) against float64:
  PATCHGEMM_SCALE_SECONDS (default 40) and PATCHGEMM_FUZZ_SEED.
"""

import math
import os
import random
import time

import pytest
import torch
from torch import nn

import patchgemm
from conftest import REL_TOL, conv_ref, fused_mode, needs_gpu, rel_error
from scale_cases import CASES, FAMILY_OPS, chose, does_not_apply, forcing, our_candidates

REPEATS = 5
SEED = int(os.environ.get("PATCHGEMM_FUZZ_SEED", "20261124"))
SECONDS = float(os.environ.get("PATCHGEMM_SCALE_SECONDS", "40"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def poison_like(outputs):
    """NaN blocks the sizes of `outputs`, filled then freed together, so the next run's outputs
    land on NaNs wherever a kernel leaves part of them unwritten."""
    blocks = [torch.full((t.numel() * t.element_size() // 4 + 1,), float("nan"), device=t.device) for t in outputs]
    del blocks


@needs_gpu
@pytest.mark.parametrize("family", list(CASES))
def test_repeats_are_bitwise_equal(family):
    cases = CASES[family]
    inputs = {case.name: case.make("cuda") for case in cases}
    failures, ran = [], {}
    for op in FAMILY_OPS[family]:
        for name in our_candidates(op):
            ran[(op, name)] = []
            for case in cases:
                try:
                    with patchgemm.force(**forcing(op, name)):
                        with patchgemm.explain() as explained:
                            first = case.run(inputs[case.name])
                        if not chose(explained, op, name):
                            continue
                        for t in first:
                            if not torch.isfinite(t).all():
                                failures.append(f"{op}={name} on {case}: non-finite values (unwritten output?)")
                                break
                        for repeat in range(1, REPEATS):
                            poison_like(first)
                            again = case.run(inputs[case.name])
                            differ = [i for i, (a, b) in enumerate(zip(first, again)) if not same_bits(a, b)]
                            if differ:
                                failures.append(f"{op}={name} on {case}: repeat {repeat} differs from the first "
                                                f"in outputs {differ}")
                                break
                except RuntimeError as e:
                    if does_not_apply(e):
                        continue
                    raise
                ran[(op, name)].append(case.name)
    # Every candidate of ours ran somewhere: a case list that misses one tests nothing of it.
    untested = [f"{op}={name}" for (op, name), where in ran.items() if not where]
    assert not untested, f"no case of {family} takes {untested}: add one to scale_cases.py"
    assert not failures, "\n".join(failures)


# ---- the patch stems of real models at training batch sizes ---------------------------------------

# timm model -> its training batch per GPU (the usual recipes' 1024-4096 over 8-32 GPUs)
TIMM_STEMS = {"vit_small_patch16_224": 256, "vit_base_patch32_224": 256, "deit3_small_patch16_224": 256,
              "beit_base_patch16_224": 128, "vit_small_patch14_dinov2": 32, "flexivit_small": 128,
              "convnext_tiny": 128, "swin_tiny_patch4_window7_224": 128, "mixer_s16_224": 256,
              "cait_xxs24_224": 256, "twins_svt_small": 128, "focalnet_tiny_srf": 128}
# transformers model and config classes -> (the input of one sample, batch)
TRANSFORMERS_STEMS = {("VideoMAEModel", "VideoMAEConfig"): ((16, 3, 224, 224), 8),
                      ("SiglipVisionModel", "SiglipVisionConfig"): ((3, 224, 224), 128),
                      ("VivitModel", "VivitConfig"): ((32, 3, 224, 224), 4)}
STEM_MODELS = list(TIMM_STEMS) + [f"transformers.{m}" for m, _ in TRANSFORMERS_STEMS]


def is_patch_conv(m: nn.Module) -> bool:
    """A conv patch_embed replaces: kernel == stride (not 1), no padding, dilation or groups."""
    if not isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return False
    unpadded = m.padding == "valid" or (not isinstance(m.padding, str) and not any(m.padding))
    return (tuple(m.kernel_size) == tuple(m.stride) and math.prod(m.kernel_size) > 1 and unpadded
            and m.groups == 1 and all(d == 1 for d in m.dilation))


def model_stems(name: str):
    """(conv, its input's shape without the batch, the training batch) of every kernel == stride
    conv that a forward of the model (built from its config, random weights) runs."""
    if name.startswith("transformers."):
        transformers = pytest.importorskip("transformers")
        (model_class, config_class), (sample, batch) = next(
            (k, v) for k, v in TRANSFORMERS_STEMS.items() if k[0] == name.split(".", 1)[1])
        model = getattr(transformers, model_class)(getattr(transformers, config_class)())
    else:
        timm = pytest.importorskip("timm")
        model = timm.create_model(name, pretrained=False)
        sample, batch = model.pretrained_cfg.get("input_size", (3, 224, 224)), TIMM_STEMS[name]
    found = {}

    def record(module, args):  # returns None: the call's arguments stay as they are
        found.setdefault(id(module), (module, tuple(args[0].shape[1:])))

    hooks = [m.register_forward_pre_hook(record) for m in model.modules() if is_patch_conv(m)]
    model = model.to("cuda").eval()
    with torch.no_grad():
        model(torch.randn(1, *sample, device="cuda"))
    for h in hooks:
        h.remove()
    return [(m, shape, batch) for m, shape in found.values()]


def stem_reference(x, w, b, gy, kernel):
    """The conv's output and its gradients (x, weight, bias) in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = conv_ref(*leaves, kernel)
    return [y.detach(), *torch.autograd.grad(y, leaves, gy.double())]


@needs_gpu
@pytest.mark.parametrize("model", STEM_MODELS)
def test_real_stems_at_training_batches_match_float64(model):
    stems = model_stems(model)
    assert stems, f"{model}: no kernel == stride conv found"
    dtype, tol = torch.bfloat16, REL_TOL[torch.bfloat16]
    failures = []
    for conv, shape, batch in stems:
        kernel = tuple(conv.kernel_size)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(batch, *shape, device="cuda", generator=g).to(dtype)
        w = (torch.randn(conv.weight.shape, device="cuda", generator=g) / math.sqrt(conv.weight[0].numel())).to(dtype)
        b = torch.randn(conv.out_channels, device="cuda", generator=g).to(dtype)
        y_shape = (batch, conv.out_channels, *[s // k for s, k in zip(shape[1:], kernel)])
        gy = torch.randn(y_shape, device="cuda", generator=g).to(dtype)
        ref = stem_reference(x, w, b, gy, kernel)
        what = f"{model}: {type(conv).__name__}({conv.in_channels}, {conv.out_channels}, k={kernel}) x [{batch}, {shape}]"

        def run(out_format):
            xs, ws, bs = (t.detach().requires_grad_() for t in (x, w, b))
            y = patchgemm.patch_embed(xs, ws, bs, out_format=out_format)
            g_out = gy.flatten(2).transpose(1, 2) if out_format == "tokens" else gy
            ys = y.transpose(1, 2).reshape(y_shape) if out_format == "tokens" else y
            return [ys, *torch.autograd.grad(y, [xs, ws, bs], g_out)]

        choices = [("default", {})] + [(f"{op}={c.name}", forcing(op, c.name)) for op in
                                       ("patch_embed", "patch_weight_grad", "patch_unembed")
                                       for c in patchgemm.kernels(op) if "cuda" in c.backends.split()]
        for out_format in ("tokens", "channels_first"):
            for label, forced in choices:
                try:
                    with patchgemm.force(**forced):
                        got = run(out_format)
                        if label == "default" and not all(same_bits(a, c) for a, c in zip(got, run(out_format))):
                            failures.append(f"{what}, {out_format}, default: two calls differ")
                except RuntimeError as e:
                    if does_not_apply(e):
                        continue
                    raise
                for part, out, want in zip(("y", "grad_x", "grad_weight", "grad_bias"), got, ref):
                    err = rel_error(out, want)
                    if not err <= tol:
                        failures.append(f"{what}, {out_format}, {label}: {part} relative error {err:.3g} > {tol:g}")
    assert not failures, "\n".join(failures)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,embed", [
    ((32, 3, 224, 224), (16, 16), 384), ((64, 3, 224, 224), (16, 16), 384), ((128, 3, 224, 224), (16, 16), 384),
    ((192, 3, 224, 224), (16, 16), 384), ((256, 3, 224, 224), (16, 16), 384), ((96, 3, 224, 224), (16, 16), 64),
    ((96, 3, 128, 128), (8, 8), 64), ((300, 3, 224, 224), (16, 16), 192), ((64, 3, 224, 224), (16, 16), 320)])
def test_vit_stems_write_every_token_at_training_batches(dtype, shape, kernel, embed):
    """ViT stems writing tokens at ordinary training batches, the default choice (on Hopper, the
    TMA-rows kernel, whose embedding tiles past E once let a stage be rewritten under a store in
    flight), against float64, repeated calls bitwise equal."""
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(shape, device="cuda", generator=g).to(dtype)
    w = (torch.randn(embed, shape[1], *kernel, device="cuda", generator=g) / math.sqrt(shape[1] * math.prod(kernel))).to(dtype)
    ref = conv_ref(x.double(), w.double(), None, kernel).flatten(2).transpose(1, 2)
    first = patchgemm.patch_embed(x, w, None, out_format="tokens")
    err = rel_error(first, ref)
    assert err <= REL_TOL[dtype], f"relative error {err:.3g}"
    for _ in range(REPEATS - 1):
        poison_like([first])
        assert same_bits(patchgemm.patch_embed(x, w, None, out_format="tokens"), first)


# ---- a time-boxed fuzz of large patch problems ---------------------------------------------------

FUZZ_TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2.5e-3, torch.float32: 2e-5}
EMBEDS = (64, 96, 128, 192, 384, 640, 704, 768, 1024, 1152, 1280, 1536)


def large_patch_problem(rng: random.Random):
    """A problem of the sizes real models run: (x shape, kernel, E, dtype, out_format, bias, mode)."""
    rank = rng.choices([1, 2, 3], weights=[1, 4, 1])[0]
    if rank == 1:
        kernel = [rng.choice([4, 8, 16, 32])]
        channels = rng.choice([1, 3, 7, 21, 80, 128])
    elif rank == 2:
        k = rng.choice([2, 4, 8, 14, 16, 32])
        kernel = [k, k] if rng.random() < 0.85 else [k, rng.choice([2, 4, 8, 16])]
        channels = rng.choice([3, 3, 3, 4, 8, 13, 16, 64, 96]) if k <= 4 else rng.choice([1, 3, 3, 4, 6, 12])
    else:
        kernel = rng.choice([[2, 16, 16], [2, 2, 2], [4, 4, 4], [1, 16, 16], [2, 8, 8]])
        channels = rng.choice([1, 3, 4, 8, 16, 32])
    embed = rng.choice(EMBEDS)
    # Grids: odd and even, square and not; rows (B * N) up to ~100k, the batch up to 512.
    if rank == 1:
        grid = [rng.randint(8, 700)]
    elif rank == 2:
        grid = [rng.randint(4, 64), rng.randint(4, 64)]
    else:
        grid = [rng.randint(2, 16), rng.randint(2, 32), rng.randint(2, 32)]
    rows = rng.randint(8_000, 100_000)
    batch = max(1, min(512, rows // math.prod(grid)))
    # The float64 reference's memory and multiply-adds: x and the patch matrix, B * N * E * K
    patch = channels * math.prod(kernel)
    while batch > 1 and (batch * math.prod(grid) * patch > 1.5e8 or batch * math.prod(grid) * patch * embed > 2e11):
        batch //= 2
    dtype = rng.choices([torch.bfloat16, torch.float16, torch.float32], weights=[5, 3, 1])[0]
    out_format = rng.choice(["tokens", "channels_first", "channels_last"])
    mode = rng.choice(["auto", "auto", "always", "never"])
    return dict(shape=(batch, channels, *[g * k for g, k in zip(grid, kernel)]), kernel=kernel, embed=embed,
                dtype=dtype, out_format=out_format, bias=rng.random() < 0.7, mode=mode)


def run_large_patch_problem(p, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dtype, kernel = p["dtype"], p["kernel"]
    x = torch.randn(p["shape"], device="cuda", generator=g).to(dtype)
    w = (torch.randn(p["embed"], p["shape"][1], *kernel, device="cuda", generator=g)
         / math.sqrt(p["shape"][1] * math.prod(kernel))).to(dtype)
    b = torch.randn(p["embed"], device="cuda", generator=g).to(dtype) if p["bias"] else None
    grid = [s // k for s, k in zip(p["shape"][2:], kernel)]
    y_shape = (p["shape"][0], p["embed"], *grid)
    gy = torch.randn(y_shape, device="cuda", generator=g).to(dtype)
    leaves = [t.double().requires_grad_() for t in (x, w, b) if t is not None]
    ref_y = conv_ref(*leaves[:2], leaves[2] if b is not None else None, kernel)
    refs = [ref_y.detach(), *torch.autograd.grad(ref_y, leaves, gy.double())]
    del leaves, ref_y

    def run():
        ins = [t.detach().requires_grad_() for t in (x, w, b) if t is not None]
        y = patchgemm.patch_embed(ins[0], ins[1], ins[2] if b is not None else None, out_format=p["out_format"])
        if p["out_format"] == "tokens":
            grads = torch.autograd.grad(y, ins, gy.flatten(2).transpose(1, 2))
            y = y.transpose(1, 2).reshape(y_shape)
        else:  # channels_last: the conv's shape over the tokens' memory
            grads = torch.autograd.grad(y, ins, gy)
        return [y, *grads]

    with fused_mode(p["mode"]):
        first, second = run(), run()
    errors = {name: rel_error(out, ref) for name, out, ref in zip(("y", "grad_x", "grad_weight", "grad_bias"), first, refs)}
    return errors, all(same_bits(a, c) for a, c in zip(first, second))


@needs_gpu
def test_large_patch_problems_match_float64():
    failures, done, start = [], 0, time.monotonic()
    while time.monotonic() - start < SECONDS:
        rng = random.Random(f"{SEED}/large/{done}")
        p = large_patch_problem(rng)
        what = f"#{done} (PATCHGEMM_FUZZ_SEED={SEED}) {p}"
        errors, repeatable = run_large_patch_problem(p, rng.getrandbits(62))
        bad = {k: f"{v:.3g}" for k, v in errors.items() if not v <= FUZZ_TOL[p["dtype"]]}
        if bad:
            failures.append(f"{what}: relative errors {bad}")
        if not repeatable:
            failures.append(f"{what}: two calls differ")
        done += 1
        torch.cuda.empty_cache()
    print(f"large patch problems: {done} in {time.monotonic() - start:.1f} s, {len(failures)} failed")
    assert not failures, f"{len(failures)} of {done} failed:\n" + "\n".join(failures[:20])
    assert done >= 10, f"only {done} problems ran within {SECONDS} s"
