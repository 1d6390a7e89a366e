"""Shape sets for choosing implementations, and each shape's inputs and PyTorch paths.

The split between the sets is the point of this file:

- ``TUNING``: the shapes reported slow against PyTorch, and every shape a selection rule has been
  fitted to or checked against (the first held-out set became tuning data once rules were revised
  after measuring it). Rules (csrc/selection/) and the learned selector may be tuned on these.
- ``HELDOUT``: 44 other ViT / CLIP / DINOv2 / video / 3-D / audio stems and heads, patch merging
  inside networks, grouped linears from 16 x 8 x 128 to 8192 x 8 x 8 and 1024 x 4 x 2048; bf16,
  fp16 and fp32 with PyTorch's default flags. Written once and never tuned or trained on: they
  measure whether the rules and the learned selector generalize. Do not edit them to make a number
  look better; add a new shape to TUNING instead, and once a rule is fitted to a held-out result,
  move that shape to TUNING.
- ``random_shapes(n, seed)``: shapes drawn at random over the same families, more training data
  for the learned selector (``python -m patchgemm tune``).
- ``model_shapes(n, seed)``: shapes drawn at random from the layer kinds of real models (image,
  video and 3-D stems at common resolutions, hierarchical downsampling with C -> 2C, decoder heads
  and upsampling, channel counts that are not multiples of 8), where ``random_shapes``' uniform
  grid is thin. Training data too; the held-out set stays out of both.
- ``channels_last_shapes(n, seed)``: the channels-last 16-bit embeddings of those two, each with its
  mirror transpose, for measuring the channels-last paths alone.
- ``FAMILIES``: the layers of model families, each a whole family (the catalog the default choice is
  judged on by leaving one family out at a time: diffusion-transformer and video-DiT latents,
  segmentation and detection at batch 1-4, weather and climate grids, medical volumes, time series
  and audio, remote sensing, batch-one inference, MoE experts at a fixed capacity, recommender
  towers). Every shape of every set has a family (``family_of``); the random sequences are the
  families ``random`` and ``model-like``, never held out (no model is made of them).

``bench/heldout.py`` measures the default choice against PyTorch on these sets.
"""

import math
import random
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .. import functional as pg
from .bench import CONVS, CONV_TRANSPOSES, linear_patch_embed, linear_patch_unembed, randn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shape:
    id: str
    op: str  # "patch_embed", "patch_unembed" or "grouped_linear"
    x: Tuple[int, ...]  # embed: [B, C, *S]; unembed: [B, C_in, *grid] or tokens [B, N, C_in]; grouped: [B, G, D]
    width: int  # embed: E; unembed: C_out; grouped: the output features per group
    kernel: Tuple[int, ...] = ()
    dtype: str = "bf16"
    tokens: bool = False  # embed: tokens out; unembed: tokens in (then `grid` is needed)
    grid: Tuple[int, ...] = ()
    channels_last: bool = False  # x and the weight in channels_last(_3d), as after model.to(memory_format=...)
    dx: bool = True  # the backward also computes x's gradient (a layer inside a network)
    bias: bool = True


def _embed(*args, **kw):
    return Shape(args[0], "patch_embed", *args[1:], **kw)


def _unembed(*args, **kw):
    return Shape(args[0], "patch_unembed", *args[1:], **kw)


def _grouped(*args, **kw):
    return Shape(args[0], "grouped_linear", *args[1:], **kw)


TUNING = [
    _embed("convnext-ds-384-cl", (64, 384, 14, 14), 768, (2, 2), channels_last=True),
    _embed("audio-conv1d-80", (32, 80, 3000), 512, (4,), dx=False),
    _embed("conv2d-64-fp32", (32, 64, 64, 64), 128, (2, 2), "fp32"),
    _embed("p5-fp32", (8, 192, 32, 32, 32), 768, (4, 4, 4), "fp32"),
    _grouped("grouped-1000x3x333", (1000, 3, 333), 77),
    # The first held-out set, which rules were then revised against.
    # Image and video patch stems: the input needs no gradient.
    _embed("vit-b16", (256, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("vit-l14", (64, 3, 224, 224), 1024, (14, 14), tokens=True, dx=False),
    _embed("vit-h14-fp16", (32, 3, 224, 224), 1280, (14, 14), "fp16", tokens=True, dx=False),
    _embed("clip-b32-fp16", (512, 3, 224, 224), 768, (32, 32), "fp16", tokens=True, dx=False),
    _embed("siglip-so400m-378", (16, 3, 378, 378), 1152, (14, 14), tokens=True, dx=False),
    _embed("siglip-b16-256", (128, 3, 256, 256), 768, (16, 16), tokens=True, dx=False),
    _embed("deit-tiny-fp32", (128, 3, 224, 224), 192, (16, 16), "fp32", dx=False),
    _embed("vit-s8", (64, 3, 224, 224), 384, (8, 8), tokens=True, dx=False),
    _embed("vit-b16-batch1", (1, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("vit-b16-fp32", (32, 3, 224, 224), 768, (16, 16), "fp32", tokens=True, dx=False),
    _embed("vivit-tubelet", (8, 3, 16, 224, 224), 768, (2, 16, 16), tokens=True, dx=False),
    _embed("videomae-l-fp16", (4, 3, 16, 224, 224), 1024, (2, 16, 16), "fp16", tokens=True, dx=False),
    _embed("qwen-vl-patches", (1024, 3, 2, 14, 14), 1152, (2, 14, 14), tokens=True, dx=False),
    _embed("3d-stem-k4", (2, 4, 64, 64, 64), 96, (4, 4, 4), dx=False),
    _embed("3d-odd-c-fp32", (4, 5, 64, 64, 64), 128, (2, 2, 2), "fp32", dx=False),
    _embed("3d-k8-tokens", (1, 3, 96, 96, 96), 384, (8, 8, 8), tokens=True, dx=False),
    _embed("3d-wide-e2048", (2, 16, 32, 32, 32), 2048, (4, 4, 4), dx=False),
    _embed("swin-stem", (64, 3, 224, 224), 96, (4, 4), dx=False),
    _embed("convnext-stem-fp32", (64, 3, 224, 224), 96, (4, 4), "fp32", dx=False),
    _embed("conv1d-raw-audio-fp32", (8, 1, 16384), 512, (16,), "fp32", dx=False),
    _embed("odd-c-fp16", (32, 7, 128, 128), 64, (8, 8), "fp16", dx=False),
    _embed("small-e32", (128, 3, 64, 64), 32, (4, 4), dx=False),
    _embed("kw7-tokens", (32, 3, 224, 224), 256, (7, 7), tokens=True, dx=False),
    _embed("cifar-vit-b512", (512, 3, 32, 32), 192, (4, 4), tokens=True, dx=False),
    _embed("sentinel-13-band", (16, 13, 256, 256), 768, (16, 16), tokens=True, dx=False),
    _embed("vit-l16-384-fp16", (64, 3, 384, 384), 1024, (16, 16), "fp16", dx=False),
    # Patch merging / downsampling inside a network: the input needs its gradient too.
    _embed("convnext-ds-192-cl", (32, 192, 28, 28), 384, (2, 2), channels_last=True),
    _embed("convnext-ds-96-fp32", (32, 96, 56, 56), 192, (2, 2), "fp32"),
    _embed("conv1d-k2", (64, 64, 4096), 256, (2,)),
    _embed("merge-k2-512", (16, 256, 32, 32), 512, (2, 2)),
    _embed("3d-merge-k2", (2, 96, 32, 32, 32), 192, (2, 2, 2)),
    _embed("3d-merge-k2-cl", (2, 64, 32, 32, 32), 128, (2, 2, 2), channels_last=True),
    # Patch heads (ConvTranspose, kernel == stride).
    _unembed("mae-pixel-head", (64, 768, 14, 14), 3, (16, 16)),
    _unembed("3d-head-k8", (2, 768, 8, 8, 8), 4, (8, 8, 8)),
    _unembed("3d-up2", (4, 384, 16, 16, 16), 96, (2, 2, 2)),
    _unembed("up2-fp32", (8, 256, 32, 32), 128, (2, 2), "fp32"),
    _unembed("up2-fp16", (16, 512, 16, 16), 256, (2, 2), "fp16"),
    _unembed("head-k32", (32, 1024, 7, 7), 3, (32, 32)),
    _unembed("conv1d-transpose-k4", (16, 512, 256), 80, (4,)),
    _unembed("head-k14-batch1", (1, 1152, 27, 27), 3, (14, 14)),
    _unembed("3d-head-fp32", (2, 192, 16, 16, 16), 4, (4, 4, 4), "fp32"),
    _unembed("swin-head-k4", (32, 96, 56, 56), 3, (4, 4)),
    _unembed("tokens-head-k16", (32, 196, 768), 3, (16, 16), tokens=True, grid=(14, 14)),
    _unembed("tokens-3d-head-fp16", (2, 512, 384), 4, (4, 4, 4), "fp16", tokens=True, grid=(8, 8, 8)),
    # Grouped linear, [B, G, D] -> [B, G, width].
    _grouped("grouped-8x4x32", (8, 4, 32), 32),
    _grouped("grouped-8192x64x64", (8192, 64, 64), 64),
    _grouped("grouped-512x16x256-fp32", (512, 16, 256), 256, dtype="fp32"),
    _grouped("grouped-2048x8x1024-fp16", (2048, 8, 1024), 1024, dtype="fp16"),
    _grouped("grouped-8192x64x4096", (8192, 64, 4096), 64),
    _grouped("grouped-4096x12x768-nobias", (4096, 12, 768), 768, bias=False),
    _grouped("grouped-256x32x128-fp32", (256, 32, 128), 512, dtype="fp32"),
    _grouped("grouped-64x256x64", (64, 256, 64), 16),
    # The second held-out set's shapes that rules were then revised against (under-filled grids, kw = 14
    # into thin GEMMs).
    _embed("vit-b16-batch4", (4, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("3d-ct-k16", (2, 1, 128, 128, 128), 768, (16, 16, 16), tokens=True, dx=False),
    _embed("k14-e64-tokens", (32, 3, 224, 224), 64, (14, 14), tokens=True, dx=False),
    _unembed("mae-head-k16-batch8", (8, 768, 14, 14), 3, (16, 16)),
    _unembed("tokens-3d-head-k8", (4, 216, 768), 4, (8, 8, 8), tokens=True, grid=(6, 6, 6)),
    # Small patches from over 256 channels, which the tiny unembedding's rule was fitted to.
    _unembed("decoder-384-k4", (64, 384, 14, 14), 4, (4, 4)),
    _unembed("decoder-512-k2", (32, 512, 28, 28), 16, (2, 2)),
    # The benchmark suite's cases (patchgemm.tools.bench, docs/benchmarks.md): the default choice
    # must be right where the README's numbers come from.
    _embed("vit-b16-suite-p1", (128, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("qwen-vl-suite-p2", (4096, 3, 2, 14, 14), 1280, (2, 14, 14), tokens=True, dx=False),
    _embed("3d-suite-p3", (8, 4, 128, 128, 128), 192, (2, 2, 2), dx=False),
    _embed("3d-suite-p3-fp32", (8, 4, 128, 128, 128), 192, (2, 2, 2), "fp32", dx=False),
    _embed("3d-suite-p4", (8, 192, 64, 64, 64), 192, (2, 2, 2)),
    _embed("3d-suite-p5", (8, 192, 32, 32, 32), 768, (4, 4, 4)),
    _unembed("3d-suite-u1", (8, 768, 8, 8, 8), 192, (4, 4, 4)),
    _unembed("3d-suite-u2", (8, 192, 64, 64, 64), 4, (2, 2, 2)),
    _grouped("grouped-suite-g1", (2560, 12, 1024), 3072),
    _grouped("grouped-suite-g1-nobias", (2560, 12, 1024), 3072, bias=False),
    _grouped("grouped-suite-g1-fp32", (2560, 12, 1024), 3072, dtype="fp32"),
    _grouped("grouped-suite-g2-tokens", (8192, 64, 100), 100),
]

HELDOUT = [
    # Image and video patch stems: the input needs no gradient.
    _embed("deit-s16-fp16", (96, 3, 224, 224), 384, (16, 16), "fp16", tokens=True, dx=False),
    _embed("vit-b32-384", (32, 3, 384, 384), 768, (32, 32), tokens=True, dx=False),
    _embed("eva-g14", (8, 3, 224, 224), 1408, (14, 14), tokens=True, dx=False),
    _embed("beit-b16-channels-first", (64, 3, 224, 224), 768, (16, 16), dx=False),
    _embed("pixtral-k16", (2, 3, 1024, 1024), 1024, (16, 16), tokens=True, dx=False),
    _embed("dinov2-s14-518", (16, 3, 518, 518), 384, (14, 14), tokens=True, dx=False),
    _embed("timesformer-fp16", (4, 3, 8, 224, 224), 768, (1, 16, 16), "fp16", tokens=True, dx=False),
    _embed("videomae-b-batch2", (2, 3, 16, 224, 224), 768, (2, 16, 16), tokens=True, dx=False),
    _embed("3d-stem-k2-c4-fp16", (4, 4, 64, 64, 64), 64, (2, 2, 2), "fp16", dx=False),
    _embed("3d-stem-k4-fp32-tokens", (2, 4, 64, 64, 64), 192, (4, 4, 4), "fp32", tokens=True, dx=False),
    _embed("mixer-k32-fp32", (64, 3, 224, 224), 512, (32, 32), "fp32", tokens=True, dx=False),
    _embed("k7-channels-first", (16, 3, 224, 224), 128, (7, 7), dx=False),
    _embed("odd-c11-tokens", (16, 11, 120, 120), 256, (8, 8), tokens=True, dx=False),
    _embed("conv1d-k8-speech", (16, 1, 32000), 256, (8,), dx=False),
    _embed("e2048-k2", (8, 64, 64, 64), 2048, (2, 2), dx=False),
    _embed("batch512-k4-e96", (512, 3, 32, 32), 96, (4, 4), dx=False),
    _embed("levit-k16-fp32", (16, 3, 224, 224), 256, (16, 16), "fp32", dx=False),
    _embed("vit-b16-batch16", (16, 3, 224, 224), 768, (16, 16), tokens=True, dx=False),
    _embed("3d-k8-e768-fp16", (2, 2, 64, 64, 64), 768, (8, 8, 8), "fp16", tokens=True, dx=False),
    _embed("k14-e128-fp16", (16, 3, 224, 224), 128, (14, 14), "fp16", tokens=True, dx=False),
    # Patch merging / downsampling inside a network: the input needs its gradient too.
    _embed("conv1d-k4-fp16", (32, 128, 2048), 256, (4,), "fp16"),
    _embed("convnext-ds-96-cl", (64, 96, 56, 56), 192, (2, 2), channels_last=True),
    _embed("merge-k2-fp16", (32, 128, 64, 64), 256, (2, 2), "fp16"),
    _embed("3d-merge-k2-fp32", (2, 48, 32, 32, 32), 96, (2, 2, 2), "fp32"),
    _embed("merge-k4-cl", (16, 64, 64, 64), 256, (4, 4), channels_last=True),
    _embed("3d-merge-k2-tokens", (2, 96, 16, 16, 16), 192, (2, 2, 2), tokens=True),
    # Patch heads (ConvTranspose, kernel == stride).
    _unembed("3d-head-k4", (2, 384, 16, 16, 16), 4, (4, 4, 4)),
    _unembed("3d-head-k16", (1, 768, 8, 8, 8), 1, (16, 16, 16)),
    _unembed("up4-fp16", (8, 256, 32, 32), 64, (4, 4), "fp16"),
    _unembed("conv1d-transpose-k2-fp32", (16, 256, 1024), 128, (2,), "fp32"),
    _unembed("tokens-head-k14", (16, 256, 1024), 3, (14, 14), tokens=True, grid=(16, 16)),
    _unembed("head-k16-e1024-fp16", (16, 1024, 16, 16), 3, (16, 16), "fp16"),
    _unembed("mae-head-k16-batch32", (32, 768, 14, 14), 3, (16, 16)),
    _unembed("tokens-head-k16-fp16", (8, 256, 512), 3, (16, 16), "fp16", tokens=True, grid=(16, 16)),
    _unembed("up2-odd-c", (8, 250, 32, 32), 125, (2, 2)),
    _unembed("up2-wide", (4, 1024, 64, 64), 512, (2, 2)),
    # Grouped linear, [B, G, D] -> [B, G, width].
    _grouped("grouped-16x8x128", (16, 8, 128), 128),
    _grouped("grouped-4096x32x96-fp16", (4096, 32, 96), 96, dtype="fp16"),
    _grouped("grouped-1024x4x2048", (1024, 4, 2048), 2048),
    _grouped("grouped-128x64x32-fp32", (128, 64, 32), 32, dtype="fp32"),
    _grouped("grouped-2048x16x512-nobias", (2048, 16, 512), 256, bias=False),
    _grouped("grouped-32x128x256", (32, 128, 256), 256),
    _grouped("grouped-8192x8x8", (8192, 8, 8), 8),
    _grouped("grouped-512x4x4096-fp16", (512, 4, 4096), 1024, dtype="fp16"),
]


def _family(name: str, *shapes: Shape) -> Tuple[str, List[Shape]]:
    return name, [replace(s, id=f"{name}/{s.id}") for s in shapes]


# Real models' layers, by family (configs of the models named; batch sizes as trained or served).
# Diffusion transformers patchify VAE latents (k = 2 on 4-16 channels) and unpatchify their final
# layer's tokens; the input needs no gradient.
FAMILIES: Dict[str, List[Shape]] = dict([
    _family("dit",
            _embed("sd3-1024", (4, 16, 128, 128), 1536, (2, 2), tokens=True, dx=False),
            _embed("sd35-large", (2, 16, 128, 128), 2432, (2, 2), tokens=True, dx=False),
            _embed("pixart-512-fp16", (16, 4, 64, 64), 1152, (2, 2), "fp16", tokens=True, dx=False),
            _embed("dit-xl2-256", (256, 4, 32, 32), 1152, (2, 2), tokens=True, dx=False),
            _embed("dit-b4-256", (128, 4, 32, 32), 768, (4, 4), tokens=True, dx=False),
            _embed("flux-1024", (1, 16, 128, 128), 3072, (2, 2), tokens=True, dx=False),
            _embed("hunyuan-dit-1024", (2, 4, 128, 128), 1408, (2, 2), tokens=True, dx=False),
            _embed("uvit-fp16", (64, 4, 32, 32), 512, (2, 2), "fp16", tokens=True, dx=False),
            _unembed("dit-xl2-final", (256, 256, 1152), 8, (2, 2), tokens=True, grid=(16, 16)),
            _unembed("sd3-final", (4, 4096, 1536), 16, (2, 2), tokens=True, grid=(64, 64)),
            _unembed("pixart-final-fp16", (16, 1024, 1152), 8, (2, 2), "fp16", tokens=True, grid=(32, 32))),
    _family("video-dit",
            _embed("cogvideox-frames", (13, 16, 60, 90), 1920, (2, 2), tokens=True, dx=False),
            _embed("cogvideox15-t2", (1, 16, 22, 96, 170), 3072, (2, 2, 2), tokens=True, dx=False),
            _embed("opensora-122", (2, 4, 16, 64, 64), 1152, (1, 2, 2), tokens=True, dx=False),
            _embed("latte-frames-fp16", (32, 4, 32, 32), 1152, (2, 2), "fp16", tokens=True, dx=False),
            _embed("hunyuanvideo", (1, 16, 33, 68, 120), 3072, (1, 2, 2), tokens=True, dx=False),
            _embed("mochi", (1, 12, 28, 60, 106), 3072, (1, 2, 2), tokens=True, dx=False),
            _embed("wan-1.3b", (1, 16, 21, 60, 104), 1536, (1, 2, 2), tokens=True, dx=False),
            _unembed("wan-final", (1, 32760, 1536), 16, (1, 2, 2), tokens=True, grid=(21, 30, 52)),
            _unembed("opensora-final", (2, 16384, 1152), 8, (1, 2, 2), tokens=True, grid=(16, 32, 32))),
    # Segmentation and detection backbones at batch 1-4 (SAM writes its patches channels-last:
    # tokens), and the transposed convs of their decoders and feature pyramids.
    _family("segmentation",
            _embed("sam-h-b1", (1, 3, 1024, 1024), 1280, (16, 16), dx=False),
            _embed("sam-b-b4", (4, 3, 1024, 1024), 768, (16, 16), tokens=True, dx=False),
            _embed("sam-l-b2-fp16", (2, 3, 1024, 1024), 1024, (16, 16), "fp16", tokens=True, dx=False),
            _embed("vitdet-b-b2", (2, 3, 1024, 1024), 768, (16, 16), tokens=True, dx=False),
            _embed("mask2former-swin-b", (2, 3, 1024, 1024), 128, (4, 4), dx=False),
            _embed("depth-anything-l-b1", (1, 3, 518, 518), 1024, (14, 14), tokens=True, dx=False),
            _unembed("sam-upscale-1", (1, 256, 64, 64), 64, (2, 2)),
            _unembed("sam-upscale-2", (1, 64, 128, 128), 32, (2, 2)),
            _unembed("vitdet-pyramid-up", (2, 768, 64, 64), 384, (2, 2)),
            _unembed("vitdet-pyramid-up2-fp16", (2, 384, 128, 128), 192, (2, 2), "fp16")),
    # Weather and climate: many variables over large grids, batch 1-2; per-variable tokenizers.
    _family("weather",
            _embed("fourcastnet-afno", (1, 20, 720, 1440), 768, (8, 8), tokens=True, dx=False),
            _embed("fourcastnet-fp32", (1, 20, 720, 1440), 768, (8, 8), "fp32", tokens=True, dx=False),
            _embed("climax-per-variable", (768, 1, 32, 64), 1024, (2, 2), tokens=True, dx=False),
            _embed("pangu-surface", (1, 7, 720, 1440), 192, (4, 4), dx=False),
            _embed("pangu-upper-air", (1, 5, 14, 720, 1440), 192, (2, 4, 4), dx=False),
            _embed("aurora-k4", (1, 69, 360, 720), 512, (4, 4), tokens=True, dx=False),
            _unembed("fourcastnet-head", (1, 16200, 768), 20, (8, 8), tokens=True, grid=(90, 180)),
            _unembed("pangu-recover", (1, 192, 180, 360), 4, (4, 4))),
    # Medical volumes: one to four modalities, 96^3-160^3 crops, batch 1-4; their decoders.
    _family("medical-3d",
            _embed("unetr-ct", (2, 1, 96, 96, 96), 768, (16, 16, 16), tokens=True, dx=False),
            _embed("unetr-brats", (1, 4, 128, 128, 128), 768, (16, 16, 16), tokens=True, dx=False),
            _embed("swinunetr-stem", (2, 1, 96, 96, 96), 48, (2, 2, 2), dx=False),
            _embed("swinunetr-brats-fp16", (1, 4, 128, 128, 128), 48, (2, 2, 2), "fp16", dx=False),
            _embed("nnformer-stem", (2, 1, 64, 128, 128), 96, (4, 4, 4), dx=False),
            _embed("ct-mae-160", (4, 1, 160, 160, 160), 768, (16, 16, 16), tokens=True, dx=False),
            _embed("swinunetr-merge", (2, 96, 24, 24, 24), 192, (2, 2, 2)),
            _unembed("unetr-decoder", (2, 768, 6, 6, 6), 384, (2, 2, 2)),
            _unembed("swinunetr-up", (2, 96, 48, 48, 48), 48, (2, 2, 2)),
            _unembed("swinunetr-up-fp16", (1, 192, 32, 32, 32), 96, (2, 2, 2), "fp16")),
    # Time series (channel-independent patching: the channels folded into the batch) and audio
    # spectrogram patches.
    _family("time-series-audio",
            _embed("patchtst-fp32", (256, 1, 512), 128, (16,), "fp32", dx=False),
            _embed("patchtst-etth-fp32", (1792, 1, 336), 128, (16,), "fp32", dx=False),
            _embed("timesfm", (64, 1, 512), 1280, (32,), dx=False),
            _embed("moirai-p64", (128, 1, 2048), 384, (64,), dx=False),
            _embed("chronos-bolt", (256, 1, 2048), 512, (16,), dx=False),
            _embed("ast-spectrogram", (32, 1, 128, 1024), 768, (16, 16), tokens=True, dx=False),
            _embed("audiomae-fp16", (64, 1, 1024, 128), 768, (16, 16), "fp16", tokens=True, dx=False),
            _embed("multivariate-k8", (64, 21, 4096), 256, (8,)),
            _unembed("patchtst-head-fp32", (256, 128, 32), 1, (16,), "fp32")),
    # Remote sensing: multispectral bands, time steps as tubelets of 1.
    _family("remote-sensing",
            _embed("prithvi-100m", (2, 6, 3, 224, 224), 768, (1, 16, 16), tokens=True, dx=False),
            _embed("prithvi-eo2-600m", (4, 6, 4, 224, 224), 1280, (1, 14, 14), tokens=True, dx=False),
            _embed("satmae-groups", (96, 3, 96, 96), 1024, (8, 8), tokens=True, dx=False),
            _embed("ssl4eo-s16-fp32", (64, 13, 224, 224), 384, (16, 16), "fp32", tokens=True, dx=False),
            _embed("clay-k8", (16, 10, 256, 256), 1024, (8, 8), tokens=True, dx=False),
            _embed("sar-2-band", (32, 2, 256, 256), 768, (16, 16), dx=False),
            _unembed("prithvi-decoder", (2, 588, 512), 18, (1, 16, 16), tokens=True, grid=(3, 14, 14))),
    # Batch-one inference across families.
    _family("batch-one",
            _embed("clip-l14-336-fp16", (1, 3, 336, 336), 1024, (14, 14), "fp16", tokens=True, dx=False),
            _embed("siglip-so400m-384", (1, 3, 384, 384), 1152, (14, 14), tokens=True, dx=False),
            _embed("dinov2-g14", (1, 3, 224, 224), 1536, (14, 14), tokens=True, dx=False),
            _embed("vit-b16-fp32", (1, 3, 224, 224), 768, (16, 16), "fp32", dx=False),
            _embed("convnext-t-stem", (1, 3, 224, 224), 96, (4, 4), dx=False),
            _embed("convnext-t-ds-cl-fp16", (1, 96, 56, 56), 192, (2, 2), "fp16", channels_last=True, dx=False),
            _embed("dit-xl2-latent", (1, 4, 32, 32), 1152, (2, 2), tokens=True, dx=False),
            _embed("qwen2-vl-image", (256, 3, 2, 14, 14), 1280, (2, 14, 14), tokens=True, dx=False),
            _unembed("mae-head", (1, 768, 14, 14), 3, (16, 16)),
            _grouped("grouped-64x4096", (1, 64, 4096), 4096),
            _grouped("grouped-8x1024-fp16", (1, 8, 1024), 1024, dtype="fp16")),
    # MoE expert layers with a fixed capacity per expert ([capacity, experts, D]; gate and up fused).
    _family("moe",
            _grouped("mixtral-up", (256, 8, 4096), 14336),
            _grouped("mixtral-down", (256, 8, 14336), 4096),
            _grouped("olmoe-gate-up", (64, 64, 2048), 2048),
            _grouped("olmoe-down", (64, 64, 1024), 2048),
            _grouped("qwen2-moe-gate-up", (128, 60, 2048), 2816),
            _grouped("deepseek-v2-lite-down-fp16", (32, 64, 1408), 2048, dtype="fp16"),
            _grouped("switch-base", (64, 128, 768), 3072)),
    # Recommender towers: multi-task heads and per-feature MLPs, training and serving batches.
    _family("recommender",
            _grouped("multitask-towers", (4096, 8, 512), 256),
            _grouped("multitask-towers-fp32", (65536, 8, 256), 128, dtype="fp32"),
            _grouped("dlrm-per-feature", (16384, 26, 128), 64),
            _grouped("dcn-towers-fp16", (2048, 16, 1024), 512, dtype="fp16"),
            _grouped("mmoe-experts", (8192, 4, 512), 256),
            _grouped("serving-b16", (16, 32, 256), 256),
            _grouped("serving-b1-nobias", (1, 8, 512), 512, bias=False)),
])

def family_shapes() -> List[Shape]:
    """Every FAMILIES shape, family after family."""
    return [s for shapes in FAMILIES.values() for s in shapes]


# The families of the TUNING and HELDOUT shapes, by id (first match).
_SET_FAMILIES = [
    ("video", ("vivit", "videomae", "timesformer", "qwen-vl")),
    ("volumes", ("3d-", "p5-")),
    ("audio-1d", ("audio", "conv1d")),
    ("hierarchical", ("convnext-ds", "merge", "conv2d-64", "swin-stem", "convnext-stem", "e2048")),
    ("decoders", ("mae-", "head-", "up2", "up4", "swin-head", "tokens-head", "decoder-")),
    ("grouped", ("grouped",)),
]


def family_of(shape_id: str) -> str:
    """The model family of the shape of this id: a FAMILIES shape's (its id is ``family/name``),
    ``random`` / ``model-like`` for the random sequences, and for TUNING and HELDOUT the family their
    id names (``image`` for other image stems)."""
    if "/" in shape_id:
        return shape_id.split("/", 1)[0]
    if shape_id.startswith("random-"):
        return "random"
    if shape_id.startswith(("model-", "cl-")):
        return "model-like"
    return next((name for name, prefixes in _SET_FAMILIES if shape_id.startswith(prefixes)), "image")


# ---- each shape's inputs and implementations -----------------------------------------------------


@dataclass
class Problem:
    make_inputs: Callable[[], Dict[str, torch.Tensor]]
    ours: Callable[..., torch.Tensor]
    torch_paths: Dict[str, Callable[..., torch.Tensor]]
    grad_inputs: List[str]
    backward_ops: List[str]  # the ops the backward calls, whose candidates --candidates forces


def _memory_format(rank: int) -> torch.memory_format:
    return torch.channels_last if rank == 2 else torch.channels_last_3d


def problem(s: Shape, device: torch.device) -> Problem:
    dtype = DTYPES[s.dtype]
    rank = len(s.kernel)
    fmt = (lambda t: t.contiguous(memory_format=_memory_format(rank))) if s.channels_last else (lambda t: t)
    if s.op == "patch_embed":
        channels, k = s.x[1], s.kernel
        fan_in = channels * math.prod(k)

        def make_inputs():
            w = randn(s.width, channels, *k, dtype=dtype, device=device) / math.sqrt(fan_in)
            return {"x": fmt(randn(*s.x, dtype=dtype, device=device)).requires_grad_(s.dx),
                    "w": fmt(w).requires_grad_(),
                    "b": randn(s.width, dtype=dtype, device=device, requires_grad=True) if s.bias else None}

        out = "tokens" if s.tokens else "channels_first"
        conv = CONVS[rank]
        paths = {"conv": lambda x, w, b: (lambda y: y.flatten(2).transpose(1, 2) if s.tokens else y)(
                     conv(x, w, b, stride=k)),
                 # A drop-in returns the conv's memory format (linear_patch_embed: a permuted view).
                 "linear": lambda x, w, b: linear_patch_embed(x, w, b, s.tokens).contiguous(
                     memory_format=_memory_format(rank) if s.channels_last and not s.tokens else torch.contiguous_format)}
        return Problem(make_inputs, lambda x, w, b: pg.patch_embed(x, w, b, out_format=out), paths,
                       (["x"] if s.dx else []) + ["w"] + (["b"] if s.bias else []),
                       ["patch_weight_grad"] + (["patch_unembed"] if s.dx else []))
    if s.op == "patch_unembed":
        c_in, k = s.x[-1] if s.tokens else s.x[1], s.kernel
        grid = s.grid if s.tokens else s.x[2:]

        fmt_x = fmt if not s.tokens else (lambda t: t)

        def make_inputs():
            w = randn(c_in, s.width, *k, dtype=dtype, device=device) / math.sqrt(c_in)
            return {"x": fmt_x(randn(*s.x, dtype=dtype, device=device)).requires_grad_(),
                    "w": fmt_x(w).requires_grad_(),
                    "b": randn(s.width, dtype=dtype, device=device, requires_grad=True) if s.bias else None}

        def channels_first(x):
            return x.transpose(1, 2).reshape(x.shape[0], c_in, *grid) if s.tokens else x

        conv_t = CONV_TRANSPOSES[rank]
        out_fmt = _memory_format(rank) if s.channels_last and not s.tokens else torch.contiguous_format
        paths = {"conv_transpose": lambda x, w, b: conv_t(channels_first(x), w, b, stride=k),
                 "linear": lambda x, w, b: linear_patch_unembed(channels_first(x), w, b).contiguous(memory_format=out_fmt)}
        ours = (lambda x, w, b: pg.patch_unembed(x, w, b, in_format="tokens", grid=grid)) if s.tokens else \
            (lambda x, w, b: pg.patch_unembed(x, w, b))
        return Problem(make_inputs, ours, paths, ["x", "w"] + (["b"] if s.bias else []),
                       ["patch_embed", "patch_weight_grad"])
    batch, groups, din = s.x

    def make_inputs():
        w = randn(groups, s.width, din, dtype=dtype, device=device) / math.sqrt(din)
        return {"x": randn(batch, groups, din, dtype=dtype, device=device, requires_grad=True),
                "w": w.requires_grad_(),
                "b": randn(groups, s.width, dtype=dtype, device=device, requires_grad=True) if s.bias else None}

    def bmm(x, w, b):
        xg, wt = x.transpose(0, 1), w.transpose(1, 2)
        return (torch.baddbmm(b.unsqueeze(1), xg, wt) if b is not None else torch.bmm(xg, wt)).transpose(0, 1)

    return Problem(make_inputs, lambda x, w, b: pg.grouped_linear(x, w, b), {"bmm": bmm}, ["x", "w"] + (["b"] if s.bias else []),
                   ["grouped_linear_grad_input", "grouped_linear_grad_weight"])




# ---- random shapes -------------------------------------------------------------------------------

_MAX_ELEMENTS = 1 << 25  # per input or output tensor: keeps a sweep's memory and time small


def _pick(rng: random.Random, values):
    return values[rng.randrange(len(values))]


def _random_patch(rng: random.Random, i: int, dtype: str) -> Shape:
    rank = _pick(rng, (1, 2, 2, 2, 3, 3))
    k = {1: _pick(rng, (2, 4, 8, 16)), 2: _pick(rng, (2, 2, 4, 7, 8, 14, 16, 32)), 3: _pick(rng, (2, 2, 4, 8, 16))}[rank]
    kernel = (k,) * rank if rank != 3 or rng.random() < 0.8 else (_pick(rng, (1, 2)), k, k)
    grid = tuple(_pick(rng, {1: (64, 256, 1024), 2: (4, 7, 14, 16, 28, 32, 56), 3: (4, 8, 16)}[rank]) for _ in range(rank))
    size = tuple(g * kk for g, kk in zip(grid, kernel))
    embed = rng.random() < 0.7
    channels = _pick(rng, (1, 3, 3, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024))
    width = _pick(rng, (3, 4, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048))
    if not embed:  # heads: many channels in, few out, or upsampling inside a network
        channels, width = max(channels, 32), width if rng.random() < 0.5 else _pick(rng, (1, 3, 4))
    tokens_grid = math.prod(grid)
    per_sample = max(channels * math.prod(size), width * tokens_grid) if embed else max(
        channels * tokens_grid, width * math.prod(size))
    batch = max(1, min(_pick(rng, (1, 2, 4, 8, 16, 32, 64, 128, 256)), _MAX_ELEMENTS // per_sample))
    if per_sample > _MAX_ELEMENTS:
        return _random_patch(rng, i, dtype)
    channels_last = rank > 1 and rng.random() < 0.2
    if embed:
        tokens = not channels_last and rng.random() < 0.5
        return _embed(f"random-embed-{i}", (batch, channels) + size, width, kernel, dtype, tokens=tokens,
                      channels_last=channels_last, dx=rng.random() < 0.4, bias=rng.random() < 0.8)
    tokens = rng.random() < 0.3
    x = (batch, tokens_grid, channels) if tokens else (batch, channels) + grid
    return _unembed(f"random-unembed-{i}", x, width, kernel, dtype, tokens=tokens, grid=grid if tokens else (),
                    bias=rng.random() < 0.8)


def random_shapes(n: int, seed: int = 0) -> List[Shape]:
    """``n`` shapes over the patch and grouped-linear families (sizes, dtypes, layouts at random)."""
    rng = random.Random(seed)
    shapes = []
    for i in range(n):
        dtype = _pick(rng, ("bf16", "bf16", "fp16", "fp32"))
        if rng.random() < 0.75:
            shapes.append(_random_patch(rng, i, dtype))
            continue
        groups = _pick(rng, (2, 3, 4, 8, 12, 16, 32, 64, 128, 256))
        din, dout = (_pick(rng, (8, 16, 32, 64, 96, 128, 256, 333, 512, 768, 1024, 2048)) for _ in range(2))
        batch = _pick(rng, (1, 8, 64, 256, 1024, 4096, 8192))
        while batch > 1 and batch * groups * max(din, dout) > _MAX_ELEMENTS:
            batch //= 2
        shapes.append(_grouped(f"random-grouped-{i}", (batch, groups, din), dout, dtype=dtype, bias=rng.random() < 0.7))
    return shapes


# Common values of real models' layers (timm / transformers configs, U-Nets, physics stems).
_IMAGE_SIZES = (96, 128, 160, 192, 224, 240, 256, 288, 320, 336, 384, 448, 480, 512, 518, 560, 640, 768, 1024)
_STEM_WIDTHS = (64, 96, 128, 192, 256, 384, 512, 640, 768, 1024, 1152, 1280, 1408, 1536)
_STAGE_CHANNELS = (32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768)
_ODD_CHANNELS = (5, 6, 7, 11, 13, 20, 30, 50, 60, 90, 100, 120, 125, 150, 180, 250, 300, 360, 500, 750)


def _fits(batch: int, per_sample: int) -> int:
    """The largest batch up to `batch` whose tensors stay within _MAX_ELEMENTS (0: none fits)."""
    return min(batch, _MAX_ELEMENTS // per_sample)


def _model_stem(rng: random.Random, i: int, dtype: str) -> Optional[Shape]:
    if rng.random() < 0.7:  # images: [B, C, H, W], often not square
        k = _pick(rng, (4, 7, 8, 14, 14, 16, 16, 16, 32))
        square = rng.random() < 0.75
        size = (max(_pick(rng, _IMAGE_SIZES) // k, 1) * k,) * 2 if square else \
            tuple(max(_pick(rng, _IMAGE_SIZES) // k, 1) * k for _ in range(2))
        kernel = (k, k)
    elif rng.random() < 0.5:  # video: tubelets over frames
        t, k = _pick(rng, (1, 2, 2, 4)), _pick(rng, (14, 16, 16))
        frames = _pick(rng, (4, 8, 16, 32))
        side = _pick(rng, (160, 224, 224, 256, 288))
        size, kernel = (max(frames // t, 1) * t, side // k * k, side // k * k), (t, k, k)
    else:  # 3-D fields: cubes
        k = _pick(rng, (2, 4, 4, 8, 8, 16))
        size, kernel = (_pick(rng, (32, 64, 64, 96, 128)),) * 3, (k, k, k)
    channels = _pick(rng, (3, 3, 3, 1, 4, 2) + _ODD_CHANNELS[:4] if len(size) == 2 else (1, 2, 3, 4, 5, 7, 11))
    width = _pick(rng, _STEM_WIDTHS)
    grid = [s // k for s, k in zip(size, kernel)]
    batch = _fits(_pick(rng, (1, 2, 4, 8, 16, 32, 64, 128, 256)), max(channels * math.prod(size), width * math.prod(grid)))
    if batch == 0:
        return None
    layout = rng.random()
    return _embed(f"model-stem-{i}", (batch, channels) + size, width, kernel, dtype, tokens=layout < 0.6,
                  channels_last=layout > 0.9, dx=rng.random() < 0.1, bias=rng.random() < 0.9)


def _model_downsample(rng: random.Random, i: int, dtype: str) -> Optional[Shape]:
    rank = _pick(rng, (2, 2, 2, 2, 3, 1))
    channels = _pick(rng, _ODD_CHANNELS[4:] if rng.random() < 0.15 else _STAGE_CHANNELS)
    width = channels * 2 if rng.random() < 0.7 else _pick(rng, (channels, channels * 4, _pick(rng, _STAGE_CHANNELS)))
    k = 2 if rng.random() < 0.8 else 4
    grid = {1: (128, 256, 512, 1024, 2048), 2: (7, 8, 12, 14, 16, 24, 28, 32, 48, 56, 64), 3: (4, 8, 12, 16, 24, 32)}[rank]
    square = rng.random() < 0.8
    size = (_pick(rng, grid) * k,) * rank if square else tuple(_pick(rng, grid) * k for _ in range(rank))
    batch = _fits(_pick(rng, (1, 2, 4, 8, 16, 32, 64, 128, 256)), channels * math.prod(size))
    if batch == 0:
        return None
    channels_last = rank > 1 and rng.random() < 0.6
    return _embed(f"model-down-{i}", (batch, channels) + size, width, (k,) * rank, dtype,
                  tokens=not channels_last and rng.random() < 0.3, channels_last=channels_last,
                  dx=rng.random() < 0.9, bias=rng.random() < 0.6)


def _model_head(rng: random.Random, i: int, dtype: str) -> Optional[Shape]:
    rank = _pick(rng, (2, 2, 2, 3, 1))
    if rng.random() < 0.5:  # a decoder head: tokens or a feature map back to pixels
        k = {1: _pick(rng, (2, 4, 8)), 2: _pick(rng, (4, 8, 14, 16, 16)), 3: _pick(rng, (2, 4, 8, 16))}[rank]
        c_in, width = _pick(rng, (128, 192, 256, 384, 512, 768, 1024)), _pick(rng, (1, 2, 3, 3, 4, 5, 11))
        grid = {1: (256, 1024, 4096), 2: (7, 8, 14, 16, 24, 32, 37), 3: (4, 8, 16)}[rank]
    else:  # upsampling inside a decoder (U-Net, feature pyramid): C -> C / 2 or C
        k = 2 if rng.random() < 0.8 else 4
        c_in = _pick(rng, _ODD_CHANNELS[8:] if rng.random() < 0.2 else _STAGE_CHANNELS + (1024,))
        width = c_in // 2 if rng.random() < 0.6 else c_in
        grid = {1: (128, 512, 2048), 2: (7, 8, 14, 16, 28, 32, 56, 64), 3: (4, 8, 16, 32)}[rank]
    grid = (_pick(rng, grid),) * rank
    batch = _fits(_pick(rng, (1, 2, 4, 8, 16, 32, 64)), max(c_in * math.prod(grid), width * math.prod(grid) * k ** rank))
    if batch == 0:
        return None
    tokens = rng.random() < 0.35
    x = (batch, math.prod(grid), c_in) if tokens else (batch, c_in) + grid
    return _unembed(f"model-head-{i}", x, width, (k,) * rank, dtype, tokens=tokens, grid=grid if tokens else (),
                    bias=rng.random() < 0.8)


def channels_last_shapes(n: int, seed: int = 0) -> List[Shape]:
    """``n`` channels-last 16-bit embeddings of ``random_shapes`` and ``model_shapes`` (seed ``seed``),
    each followed by its mirror: the transpose from the embedding's output back to x's shape, with x
    and the weight channels-last too."""
    pool = [s for s in random_shapes(20 * n, seed) + model_shapes(20 * n, seed)
            if s.op == "patch_embed" and s.channels_last and s.dtype != "fp32"]
    random.Random(seed + 1).shuffle(pool)
    shapes = []
    for s in pool[:n]:
        grid = tuple(size // k for size, k in zip(s.x[2:], s.kernel))
        shapes += [replace(s, id=f"cl-{s.id}"),
                   _unembed(f"cl-{s.id}-transpose", (s.x[0], s.width) + grid, s.x[1], s.kernel, s.dtype,
                            channels_last=True, bias=s.bias)]
    return shapes


def model_shapes(n: int, seed: int = 0) -> List[Shape]:
    """``n`` shapes drawn from real models' layer kinds: stems, downsampling and heads (see the top)."""
    rng = random.Random(seed)
    shapes: List[Shape] = []
    while len(shapes) < n:
        i = len(shapes)
        dtype = _pick(rng, ("bf16", "bf16", "fp16", "fp32"))
        family = rng.random()
        s = (_model_stem if family < 0.4 else _model_downsample if family < 0.7 else _model_head)(rng, i, dtype)
        if s is not None:
            shapes.append(s)
    return shapes
