"""Problems at the sizes users run: many waves of output tiles over every SM of the GPU.

A fault that needs a block to take a second tile, a store still in flight when the next one
starts, or a token range that meets another cannot show on the few-tile problems most tests use.
Each case here makes several waves on a 132-SM GPU and runs one op family forward and backward, so
forcing one candidate of any op of the family runs that candidate at scale. Used by
test_at_scale.py (repeats bitwise equal) and sanitize_smoke.py --scale (compute-sanitizer).
"""

import math
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

import patchgemm


def tensors(name: str, device, dtype, *shapes, fan_in: Dict[int, int] = None):
    """Random tensors of the given shapes from a generator on `device` seeded by `name` (the same
    values in every process); the one at index i divided by sqrt(fan_in[i]) (weights)."""
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    out = []
    for i, shape in enumerate(shapes):
        t = torch.randn(*shape, device=device, generator=g)
        out.append((t / math.sqrt((fan_in or {}).get(i, 1))).to(dtype))
    return out


@dataclass
class Case:
    """One problem of an op family: `make(device)` builds its inputs, `run(inputs)` computes every
    output and gradient of one forward + backward."""

    family: str
    name: str
    make: Callable
    run: Callable

    def __str__(self):
        return f"{self.family}:{self.name}"


def _x_w_b_run(op: Callable) -> Callable:
    """run(inputs) of a family whose inputs are x, w, b and gy: y = op(x, w, b) and its gradients."""
    def run(t):
        x, w, b = (t[k].detach().requires_grad_() for k in ("x", "w", "b"))
        y = op(x, w, b)
        return [y, *torch.autograd.grad(y, [x, w, b], t["gy"])]

    return run


# ---- patch embedding and unembedding: patch_embed, patch_unembed, patch_weight_grad -------------

def _patch_case(name, shape, kernel, embed, out_format, dtype=torch.bfloat16):
    grid = [s // k for s, k in zip(shape[2:], kernel)]
    channels, patch = shape[1], math.prod(kernel)
    tokens = math.prod(grid)
    y_shape = (shape[0], tokens, embed) if out_format != "channels_first" else (shape[0], embed, *grid)
    in_format = "channels_first" if out_format == "channels_first" else "tokens"

    def make(device):
        x, w, b, gy, u_in, bu, gu = tensors(
            name, device, dtype, shape, (embed, channels, *kernel), (embed,), y_shape, y_shape, (channels,),
            (shape[0], channels, *[g * k for g, k in zip(grid, kernel)]), fan_in={1: channels * patch})
        return dict(x=x, w=w, b=b, gy=gy, u_in=u_in, bu=bu, gu=gu)

    def run(t):
        x, w, b = (t[k].detach().requires_grad_() for k in ("x", "w", "b"))
        y = patchgemm.patch_embed(x, w, b, out_format=out_format)
        gy = t["gy"]
        if out_format == "channels_last":  # y [B, E, *grid] strided as tokens
            gy = gy.transpose(1, 2).unflatten(2, grid)
        grads = torch.autograd.grad(y, [x, w, b], gy)
        u_in, w2, bu = (t[k].detach().requires_grad_() for k in ("u_in", "w", "bu"))
        u = patchgemm.patch_unembed(u_in, w2, bu, in_format=in_format, grid=grid if in_format == "tokens" else None)
        u_grads = torch.autograd.grad(u, [u_in, w2, bu], t["gu"])
        return [y, *grads, u, *u_grads]

    return Case("patch", name, make, run)


PATCH = [
    # ViT-S/16 at a training batch: 2 embedding tiles of 256 (the second half empty), 200+ tiles
    _patch_case("vit_s16_b128_tokens", (128, 3, 224, 224), (16, 16), 384, "tokens"),
    _patch_case("vit_s16_b128_cf", (128, 3, 224, 224), (16, 16), 384, "channels_first"),
    _patch_case("vit_s16_b96_tokens_fp16", (96, 3, 224, 224), (16, 16), 384, "tokens", torch.float16),
    # kw = 8, E = 64 (one block of a 256-wide tile), 128-px images
    _patch_case("k8_e64_b96_tokens", (96, 3, 128, 128), (8, 8), 64, "tokens"),
    # 19-patch grid rows (odd), E = 704: its last embedding tile three 64-wide blocks
    _patch_case("k16_e704_odd_grid_channels_last", (32, 3, 208, 304), (16, 16), 704, "channels_last"),
    # a DiT-XL/2 latent: k = 2 on 4 channels, E = 1152
    _patch_case("dit_latent_k2_e1152_tokens", (64, 4, 32, 32), (2, 2), 1152, "tokens"),
    # a 3-D hMLP stage (P4-like): kw = 2 pairs, channels-first
    _patch_case("hmlp_k2_c32_e192_cf", (8, 32, 16, 64, 64), (2, 2, 2), 192, "channels_first"),
    # tiny patches (K = 64): the tiny kernels, channels-first
    _patch_case("tiny_k2_c8_e96_cf", (8, 8, 32, 64, 64), (2, 2, 2), 96, "channels_first"),
    # video tubelets (2 x 16 x 16), E = 768
    _patch_case("tubelet_b4_e768_tokens", (4, 3, 16, 224, 224), (2, 16, 16), 768, "tokens"),
    # one patch per sample: the patch matrix is a view of x
    _patch_case("one_patch_b4096_tokens", (4096, 3, 16, 16), (16, 16), 384, "tokens"),
    # k = 3 on RGB (K = 27): the gather's ones column fits its padding, so the weight gradient
    # multiplies the forward's patch matrix (saved_patches)
    _patch_case("k3_e256_b64_tokens", (64, 3, 96, 96), (3, 3), 256, "tokens"),
    # time-series patching: Conv1d(7, 128, 16)
    _patch_case("series_1d_k16_e128_tokens", (512, 7, 512), (16,), 128, "tokens"),
    # a head into 4 channels (the narrow kernel): 7 x 7 patches of 256 channels, channels split
    _patch_case("head_k7_c256_e4_tokens", (4, 256, 112, 112), (7, 7), 4, "tokens"),
]


# ---- grouped linear: grouped_linear, grouped_linear_grad_input, grouped_linear_grad_weight -------

def _grouped_case(name, batch, groups, d_in, d_out, layout, dtype):
    x_shape = (batch, groups, d_in) if layout == "bgd" else (groups, batch, d_in)
    y_shape = x_shape[:2] + (d_out,)

    def make(device):
        x, w, b, gy = tensors(name, device, dtype, x_shape, (groups, d_out, d_in), (groups, d_out), y_shape,
                              fan_in={1: d_in})
        return dict(x=x, w=w, b=b, gy=gy)

    run = _x_w_b_run(lambda x, w, b: patchgemm.grouped_linear(x, w, b, layout))
    return Case("grouped_linear", name, make, run)


GROUPED = [_grouped_case("b8192_g12_512_768_bf16", 8192, 12, 512, 768, "bgd", torch.bfloat16),
           _grouped_case("g16_b4096_384_384_fp32", 4096, 16, 384, 384, "gbd", torch.float32)]


# ---- grouped pointwise convs: grouped_pointwise_conv and its two gradients ------------------------

def _pointwise_case(name, batch, groups, c_in, c_out, spatial, channels_last, dtype):
    x_shape = (batch, groups * c_in, *spatial)

    def make(device):
        x, w, b, gy = tensors(name, device, dtype, x_shape, (groups * c_out, c_in, *[1] * len(spatial)),
                              (groups * c_out,), (batch, groups * c_out, *spatial), fan_in={1: c_in})
        if channels_last:
            x, gy = (v.contiguous(memory_format=torch.channels_last) for v in (x, gy))
        return dict(x=x, w=w, b=b, gy=gy)

    run = _x_w_b_run(lambda x, w, b: patchgemm.grouped_pointwise_conv(x, w, b, groups=groups))
    return Case("pointwise", name, make, run)


POINTWISE = [_pointwise_case("g64_100_L1024_bf16", 16, 64, 100, 100, (1024,), False, torch.bfloat16),
             _pointwise_case("g16_64_56x56_channels_last_bf16", 16, 16, 64, 64, (56, 56), True, torch.bfloat16)]


# ---- ragged groups: ragged_grouped_linear and its two gradients -----------------------------------

def _ragged_case(name, sizes, d_in, d_out, dtype):
    rows = sum(sizes)

    def make(device):
        x, w, b, gy = tensors(name, device, dtype, (rows, d_in), (len(sizes), d_out, d_in), (len(sizes), d_out),
                              (rows, d_out), fan_in={1: d_in})
        return dict(x=x, w=w, b=b, gy=gy)

    run = _x_w_b_run(lambda x, w, b: patchgemm.grouped_linear(x, w, b, group_sizes=sizes))
    return Case("ragged", name, make, run)


RAGGED = [_ragged_case("8_experts_bf16", [5000, 0, 3100, 7777, 1, 4096, 2500, 9000], 1024, 1536, torch.bfloat16),
          _ragged_case("6_experts_fp32", [3000, 1200, 0, 5001, 2222, 64], 512, 768, torch.float32),
          # groups padded to 256 rows into wide outputs: the weight gradient's K needs no split
          _ragged_case("6_padded_experts_bf16", [2048, 0, 1024, 4096, 512, 3072], 2048, 4096, torch.bfloat16)]


# ---- SwiGLU: swiglu and swiglu_backward ------------------------------------------------------------

def _swiglu_case(name, rows, hidden, dtype):
    def make(device):
        gate_up, gh = tensors(name, device, dtype, (rows, 2 * hidden), (rows, hidden))
        return dict(gate_up=gate_up, gh=gh)

    def run(t):
        gate_up = t["gate_up"].detach().requires_grad_()
        h = patchgemm.swiglu(gate_up)
        return [h, *torch.autograd.grad(h, [gate_up], t["gh"])]

    return Case("swiglu", name, make, run)


SWIGLU = [_swiglu_case("65536x2048_bf16", 65536, 2048, torch.bfloat16),
          _swiglu_case("10007x1000_fp32", 10007, 1000, torch.float32)]


# ---- fused instance norm + GELU: instance_norm_act and its backward -------------------------------

def _norm_case(name, shape, layout, dtype):
    channels = shape[1] if layout == "channels_first" else shape[2]

    def make(device):
        x, w, b, gy = tensors(name, device, dtype, shape, (channels,), (channels,), shape)
        return dict(x=x, w=w, b=b, gy=gy)

    run = _x_w_b_run(lambda x, w, b: patchgemm.instance_norm_act(x, w, b, layout=layout))
    return Case("instance_norm", name, make, run)


NORM = [_norm_case("8x192x32x64x64_bf16", (8, 192, 32, 64, 64), "channels_first", torch.bfloat16),
        _norm_case("tokens_16x4096x384_fp32", (16, 4096, 384), "tokens", torch.float32)]


CASES: Dict[str, List[Case]] = {"patch": PATCH, "grouped_linear": GROUPED, "pointwise": POINTWISE,
                                "ragged": RAGGED, "swiglu": SWIGLU, "instance_norm": NORM}

# The ops each family's forward + backward calls (each can be forced alone).
FAMILY_OPS = {
    "patch": ("patch_embed", "patch_unembed", "patch_weight_grad"),
    "grouped_linear": ("grouped_linear", "grouped_linear_grad_input", "grouped_linear_grad_weight"),
    "pointwise": ("grouped_pointwise_conv", "grouped_pointwise_conv_grad_input", "grouped_pointwise_conv_grad_weight"),
    "ragged": ("ragged_grouped_linear", "ragged_grouped_linear_grad_input", "ragged_grouped_linear_grad_weight"),
    "swiglu": ("swiglu", "swiglu_backward"),
    "instance_norm": ("instance_norm_act", "instance_norm_act_backward"),
}


def our_candidates(op: str, device_kind: str = "cuda") -> List[str]:
    """The candidates of `op` that run this library's code on `device_kind` (not PyTorch's own ops)."""
    return [c.name for c in patchgemm.kernels(op)
            if not c.name.startswith("aten_") and device_kind in c.backends.split()]


# A candidate that reuses earlier work of the call (saved_patches multiplies the patch matrix a
# gathering embedding left: patch_embed's forward, or patch_unembed's dx) is not forced itself: it
# runs wherever that work exists, and forcing it would decline the call's other uses of its op
# (where no embedding gathered). Forcing what makes the work runs it; `chose` tells whether it did.
_REUSES = {("patch_weight_grad", "saved_patches"): {"patch_embed": "gather_gemm"}}


def forcing(op: str, name: str) -> Dict[str, str]:
    """What running candidate `name` of `op` takes: forcing it, or (a reuse) what makes its work."""
    return _REUSES.get((op, name)) or {op: name}


def chose(explained, op: str, name: str) -> bool:
    """Whether a call recorded by patchgemm.explain() ran candidate `name` of `op`."""
    return any(c.op == op and c.chosen == name for c in explained)


def does_not_apply(error: Exception) -> bool:
    """Whether `error` is a forced candidate declining the call (as opposed to a real failure)."""
    return isinstance(error, RuntimeError) and "does not apply to this call" in str(error)
