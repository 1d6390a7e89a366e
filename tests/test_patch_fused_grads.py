"""The GPU's fused patch kernels of the backward passes and the unembedding (tiny, implicit on
mma.sync and wgmma; weight gradients, transposed convolutions): values against float64."""

import math

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from conftest import assert_close_to_ref, needs_gpu, poison_allocator, randn, wgmma_built
from patch_cases import CONV, CONV_T, conv_tokens, cropped, cuda_kernels_run, make

ops = torch.ops.patchgemm



# Tokens weight gradients with patch rows of 32-128 bytes read the patches by TMA on a 9.0 GPU
# (implicit_patch_weight_grad_rows_sm90.cu), the bias gradient included: (x shape, kernel, E) with
# 14-, 5-, 6-, 4-, 24-, 12- and 25-patch grid rows (6, 14, 12, 17, 4, 7 and 4 boxes a slice; 3 and 4
# slots), several token ranges ending in a partial slice, embedding tiles with boxes past E, 1 to 6
# column tiles.
IMPLICIT_ROWS_DW = [((16, 3, 224, 224), (16, 16), 200),   # ViT-like: 3136 tokens in 6 ranges
                    ((3, 3, 48, 80), (16, 16), 96),        # 5-patch rows, 45 tokens
                    ((2, 5, 64, 192), (4, 32), 320),       # kw = 32, K = 640: two embedding tiles
                    ((2, 3, 4, 256), (2, 64), 64),         # kw = 64, 4-patch rows
                    ((2, 3, 4, 32, 96), (2, 16, 16), 136),  # 3-D video patches, K = 1536
                    ((2, 3, 32, 384), (16, 16), 256),      # 24-patch rows
                    ((1, 3, 16, 224), (16, 16), 64),       # 14 tokens
                    ((40, 3, 224, 224), (16, 16), 768),    # P1-like: 18 tiles, 7 ranges
                    # 72 tiles: on 108-143 SMs (H100, H200) two unequal ranges, the second a third
                    ((12, 3, 384, 384), (32, 32), 768),    # ViT-B/32
                    ((5, 6, 224, 400), (16, 16), 1408)]    # the ranges meet mid grid row


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,embed", IMPLICIT_ROWS_DW)
@pytest.mark.parametrize("has_bias", [True, False])
def test_gpu_implicit_rows_weight_grad_kernel(fused_always, dtype, shape, kernel, embed, has_bias):
    x, w, b = make(shape, kernel, dtype, "cuda", embed=embed, bias=has_bias)
    params = [w.requires_grad_()] + ([b.requires_grad_()] if has_bias else [])
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if has_bias else None
    ref = CONV[len(kernel)](x.double(), w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    want = torch.autograd.grad(ref, [w64] + ([b64] if has_bias else []), dy.double())
    y = patchgemm.patch_embed(x, w, b, out_format="tokens")
    poison_allocator(4 * w.numel() * 64, "cuda")
    out = {}
    ran = cuda_kernels_run(lambda: out.update(g=torch.autograd.grad(y, params, conv_tokens(dy))))
    assert ("implicit_weight_grad_kernel_sm90_rows" in ran) == wgmma_built(), ran
    for g, r, name in zip(out["g"], want, ["grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name)


@needs_gpu
def test_gpu_implicit_rows_weight_grad_of_unembed(fused_always):
    """The transpose's weight gradient with tokens x is the same kernel, x and grad_y swapped."""
    z = randn(6, 4 * 14, 96, dtype=torch.bfloat16, device="cuda")  # tokens of a 4 x 14 grid
    w = (randn(96, 3, 16, 16, dtype=torch.bfloat16, device="cuda") / 40).requires_grad_()
    u = patchgemm.patch_unembed(z, w, in_format="tokens", grid=(4, 14))
    du = randn(*u.shape, dtype=torch.bfloat16, device="cuda")
    out = {}
    ran = cuda_kernels_run(lambda: out.update(dw=torch.autograd.grad(u, [w], du)[0]))
    assert ("implicit_weight_grad_kernel_sm90_rows" in ran) == wgmma_built(), ran
    w64 = w.detach().double().requires_grad_()
    ref = F.conv_transpose2d(z.double().transpose(1, 2).reshape(6, 96, 4, 14), w64, stride=16)
    (want,) = torch.autograd.grad(ref, [w64], du.double())
    assert_close_to_ref(out["dw"], want, torch.bfloat16, "grad_weight")


# 16-bit weight gradients run an implicit GEMM: on a 9.0 GPU the wgmma one of
# implicit_patch_weight_grad_sm90.cu (kw % 4 == 0, and kw = 2 in pairs), else for kw = 2 the mma.sync
# one of csrc/kernels/patch/sm80/implicit_patch_weight_grad.cu (the tests run with wgmma on and off). (x shape, kernel, E) covering
# one and two 128-column tiles (partial ones: K = 192, 432), 128- and 192-wide embedding tiles
# (partial: E = 200), E not a multiple of 8 (channels-first grad_y only), N not a multiple of 8 (tokens
# grad_y only, but for wgmma's 4-token pieces where N % 4 == 0), 1-D/2-D/3-D, many token ranges (a
# block per SM) that end inside samples, and one range (wgmma: dW written by the kernel).
IMPLICIT_DW = [((2, 192, 8, 16, 16), (2, 2, 2), 192),  # P4-like: K = 1536, 192-wide tiles
               ((2, 24, 4, 8, 8), (2, 2, 2), 200),     # K = 192, E = 200: partial tiles both ways
               ((2, 8, 4, 8, 16), (2, 2, 2), 36),      # E = 36: channels-first grad_y only
               ((3, 16, 2, 6, 8), (2, 2, 2), 64),      # N = 12: tokens grad_y only
               ((3, 40, 16, 32), (2, 2), 48),          # 2-D
               ((2, 64, 512), (2,), 32),               # 1-D
               ((3, 8, 20, 40, 40), (2, 2, 2), 64),    # 12000 tokens: ~47 ranges of 256
               ((2, 24, 8, 8, 8), (4, 4, 4), 200),     # P5-like: K = 1536, E = 200
               ((2, 8, 8, 8, 16), (4, 4, 4), 36),      # E = 36: channels-first grad_y only
               ((3, 3, 48, 64), (16, 16), 96),         # P1-like 2-D: N = 12, pieces of 4 tokens
               ((3, 3, 48, 80), (16, 16), 96),         # N = 15: tokens grad_y only
               ((1, 3, 24, 48), (12, 12), 64),         # kw = 12, K = 432: a partial column tile
               ((2, 16, 8, 32, 64), (2, 8, 8), 192),   # kw = 8: runs of 8 (16-byte copies)
               ((8, 3, 64, 224), (16, 16), 128),       # P1-like, 448 tokens: two ranges, runs of 8
               ((2, 32, 512), (4,), 32),               # 1-D
               ((3, 8, 40, 40, 40), (4, 4, 4), 64),    # 3000 tokens: 11 ranges
               ((2, 48, 16, 16, 16), (4, 4, 4), 384),  # K = 3072: one range, two 192-wide tiles
               ((5, 8, 8, 32, 32), (4, 4, 4), 64)]     # N = 128 (TMA grad_y), a range from mid-sample


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,embed", IMPLICIT_DW)
@pytest.mark.parametrize("memory", ["contiguous", "cropped"])
@pytest.mark.parametrize("out_format", ["channels_first", "tokens"])
def test_gpu_implicit_weight_grad_kernel(fused_always, implicit_wgmma, dtype, shape, kernel, embed, memory,
                                         out_format):
    x, w, b = make(shape, kernel, dtype, "cuda", embed=embed)
    xs = cropped(x) if memory == "cropped" else x.clone()
    w.requires_grad_(), b.requires_grad_()
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = CONV[len(kernel)](x.double(), w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    want = torch.autograd.grad(ref, [w64, b64], dy.double())
    tokens = out_format == "tokens"
    # A forward that reads x in place (cuDNN's): a gathering one would leave the weight gradient its
    # patch matrix (saved_patches)
    with patchgemm.force(patch_embed="aten_conv"):
        y = patchgemm.patch_embed(xs, w, b, out_format=out_format)
    poison_allocator(4 * w.numel() * 64, "cuda")
    out = {}
    ran = cuda_kernels_run(lambda: out.update(g=torch.autograd.grad(y, [w, b], conv_tokens(dy) if tokens else dy)))
    n = math.prod(ref.shape[2:])
    # (every kw = 2 shape here has K % 4 == 0 and grid rows of 4k patches: the pairs' conditions)
    if kernel[-1] % 4 == 0:
        applies = implicit_wgmma and (embed % 8 == 0 if tokens else n % 4 == 0)
    else:
        applies = kernel[-1] == 2 and (embed % 8 == 0 if tokens else n % (4 if implicit_wgmma else 8) == 0)
        applies = applies and not tiny_weight_grad_applies(xs, kernel, embed, tokens)
        assert ("tiny_weight_grad_kernel" in ran) == tiny_weight_grad_applies(xs, kernel, embed, tokens), ran
    assert ("implicit_weight_grad_kernel" in ran) == applies, ran
    assert ("implicit_weight_grad_kernel_sm90" in ran) == (applies and implicit_wgmma), ran
    for g, r, name in zip(out["g"], want, ["grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name)


@needs_gpu
@pytest.mark.parametrize("shape,kernel,embed,out_format", [
    ((2, 192, 8, 16, 16), (2, 2, 2), 192, "channels_first"),  # pairs, 12 column tiles
    ((2, 192, 8, 16, 16), (2, 2, 2), 192, "tokens"),
    ((3, 16, 20, 40, 40), (2, 2, 2), 64, "channels_first"),   # pairs, many ranges
    ((3, 16, 20, 40, 40), (2, 2, 2), 64, "tokens"),
    ((2, 24, 8, 8, 8), (4, 4, 4), 200, "channels_first"),     # runs of 4, E past the tile
    ((2, 24, 8, 8, 8), (4, 4, 4), 200, "tokens"),
    ((2, 16, 8, 32, 64), (2, 8, 8), 36, "channels_first")])   # runs of 8, E % 8 != 0 (channels-first only)
@pytest.mark.parametrize("has_bias", [True, False])
def test_gpu_wgmma_weight_grad_bias(fused_always, shape, kernel, embed, out_format, has_bias):
    """The wgmma weight gradient sums the bias gradient from its grad_y tiles (E % 4 == 0), each slice
    by one column tile's block, and sum_token_ranges adds the blocks' sums: values against float64."""
    tokens = out_format == "tokens"
    if not wgmma_built():
        pytest.skip("needs the sm_90a build on a 9.0 GPU")
    x, w, b = make(shape, kernel, torch.bfloat16, "cuda", embed=embed, bias=has_bias)
    params = [w.requires_grad_()] + ([b.requires_grad_()] if has_bias else [])
    params64 = [t.detach().double().requires_grad_() for t in params]
    ref = CONV[len(kernel)](x.double(), params64[0], params64[1] if has_bias else None, stride=kernel)
    dy = randn(*ref.shape, dtype=torch.bfloat16, device="cuda")
    want = torch.autograd.grad(ref, params64, dy.double())
    y = patchgemm.patch_embed(x, w, b, out_format=out_format)
    out = {}
    ran = cuda_kernels_run(lambda: out.update(g=torch.autograd.grad(y, params, conv_tokens(dy) if tokens else dy)))
    assert "implicit_weight_grad_kernel_sm90" in ran, ran
    # the bias gradient from the kernel's tiles: no reduction of grad_y after it
    assert not (has_bias and "reduce_kernel" in ran), ran
    for g, r, name in zip(out["g"], want, ["grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, torch.bfloat16, name)


def tiny_weight_grad_applies(x, kernel, embed, tokens):
    """Whether the weight gradient of patch_embed(x) takes csrc/kernels/patch/sm80/tiny_patch_weight_grad.cu: 16-bit,
    kw = 2, K <= 64, E <= 256 and even, 16-byte pieces of grad_y (tokens: E % 8 == 0; channels-first
    N % 8 == 0), grid rows of 4k tokens, 16-byte aligned runs of x."""
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    aligned = x.stride(-1) == 1 and x.data_ptr() % 16 == 0 and all(
        st % 8 == 0 for st, sz in zip(x.stride()[:-1], x.shape[:-1]) if sz > 1)
    return (x.dtype in (torch.bfloat16, torch.float16) and kernel[-1] == 2 and x.shape[1] * math.prod(kernel) <= 64
            and embed <= 256 and embed % 2 == 0 and (embed % 8 == 0 if tokens else math.prod(grid) % 8 == 0)
            and grid[-1] % 4 == 0 and aligned)


# 16-bit patches of at most 64 elements with kw = 2 take the fused weight gradient of
# csrc/kernels/patch/sm80/tiny_patch_weight_grad.cu (with the bias gradient as one more tile): (x shape, kernel, E)
# covering K = 32 and 64 (one and four 16-row tiles), K = 12 (a partial tile), E = 256 (four 8-wide
# tiles per warp), E = 200, 36 and 6 (n-tiles past E; 36, 6: channels-first only), N = 120 (a partial
# last slice per sample), N = 24 (less than one slice), 1-D/2-D/3-D, and one that does not apply
# (kw = 4: gather + GEMM).
TINY_DW = [((2, 4, 16, 16, 16), (2, 2, 2), 192),  # P3-like: K = 32
           ((3, 1, 6, 10, 16), (2, 2, 2), 48),    # K = 8, N = 120
           ((2, 8, 8, 8, 16), (2, 2, 2), 200),    # K = 64, E = 200
           ((2, 4, 4, 6, 8), (2, 2, 2), 36),      # N = 24, E = 36
           ((2, 2, 4, 8, 8), (2, 2, 2), 6),       # E = 6: a padded row of bias partial sums
           ((2, 3, 32, 64), (2, 2), 64),          # 2-D, K = 12
           ((2, 16, 1024), (2,), 256),            # 1-D, K = 32, E = 256
           ((2, 4, 8, 16), (4, 4), 64)]           # kw = 4: not this kernel


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,embed", TINY_DW)
@pytest.mark.parametrize("memory", ["contiguous", "cropped"])
@pytest.mark.parametrize("out_format", ["channels_first", "tokens"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_gpu_tiny_weight_grad_kernel(dtype, shape, kernel, embed, memory, out_format, has_bias):
    x, w, b = make(shape, kernel, dtype, "cuda", embed=embed, bias=has_bias)
    xs = cropped(x) if memory == "cropped" else x.clone()
    params = [w.requires_grad_()] + ([b.requires_grad_()] if has_bias else [])
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if has_bias else None
    ref = CONV[len(kernel)](x.double(), w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    want = torch.autograd.grad(ref, [w64] + ([b64] if has_bias else []), dy.double())
    tokens = out_format == "tokens"
    # A forward that reads x in place (cuDNN's): a gathering one would leave the weight gradient its
    # patch matrix (saved_patches)
    with patchgemm.force(patch_embed="aten_conv"):
        y = patchgemm.patch_embed(xs, w, b, out_format=out_format)
    poison_allocator(4 * w.numel() * 64, "cuda")
    out = {}
    ran = cuda_kernels_run(lambda: out.update(g=torch.autograd.grad(y, params, conv_tokens(dy) if tokens else dy)))
    assert ("tiny_weight_grad_kernel" in ran) == tiny_weight_grad_applies(xs, kernel, embed, tokens), ran
    if kernel == (2, 2, 2) and embed in (192, 48):
        assert "tiny_weight_grad_kernel" in ran  # the cases the rule is for must not silently fall back
    for g, r, name in zip(out["g"], want, ["grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name)


# ConvTranspose's weight gradient is the tiny kernel's with x and grad_y swapped, its bias gradient
# (grad_y summed per channel) an n-tile of ones in the same pass: (x shape [B, C_in, *grid], kernel,
# C_out) covering K = 32 (U2-like) and 64 (four m-tiles of sums), C_out = 3 (a padded row of bias
# partial sums), N = 120, 2-D and 1-D.
TINY_DW_UNEMBED = [((2, 96, 4, 8, 16), (2, 2, 2), 4),  # U2-like: K = 32
                   ((2, 64, 2, 4, 8), (2, 2, 2), 8),   # K = 64
                   ((2, 40, 3, 5, 8), (2, 2, 2), 3),   # K = 24, N = 120
                   ((2, 32, 8, 16), (2, 2), 5),        # 2-D, K = 20
                   ((2, 48, 64), (2,), 16)]            # 1-D, K = 32


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,out_channels", TINY_DW_UNEMBED)
@pytest.mark.parametrize("in_format", ["channels_first", "tokens"])
@pytest.mark.parametrize("grads", ["weight_bias", "weight", "bias"])
def test_gpu_tiny_weight_grad_of_unembed(dtype, shape, kernel, out_channels, in_format, grads):
    c_in, grid = shape[1], list(shape[2:])
    x = randn(*shape, dtype=dtype, device="cuda")
    w = randn(c_in, out_channels, *kernel, dtype=dtype, device="cuda") / math.sqrt(c_in)
    b = randn(out_channels, dtype=dtype, device="cuda")
    tokens = in_format == "tokens"
    xs = conv_tokens(x).contiguous() if tokens else x
    params = ([w.requires_grad_()] if "weight" in grads else []) + ([b.requires_grad_()] if "bias" in grads else [])
    y = patchgemm.patch_unembed(xs, w, b, in_format=in_format, grid=grid if tokens else None)
    dy = randn(*y.shape, dtype=dtype, device="cuda")
    poison_allocator(4 * w.numel() * 64, "cuda")
    out = {}
    ran = cuda_kernels_run(lambda: out.update(g=torch.autograd.grad(y, params, dy)))
    fused = "weight" in grads and tiny_weight_grad_applies(dy, kernel, c_in, tokens)
    assert ("tiny_weight_grad_kernel" in ran) == fused, ran
    if shape[2:] == (4, 8, 16) and "weight" in grads:
        assert fused  # the U2-like case must not silently fall back
    if fused and "bias" in grads:
        assert "reduce_kernel" not in ran, ran  # the bias gradient came out of the same pass
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = CONV_T[len(kernel)](x.double(), w64, b64, stride=kernel)
    want = torch.autograd.grad(ref, ([w64] if "weight" in grads else []) + ([b64] if "bias" in grads else []),
                               dy.double())
    for g, r in zip(out["g"], want):
        assert_close_to_ref(g, r, dtype, f"grad of {list(r.shape)}")


def tiny_unembed_fits(dtype, c_in, grid, kernel, out_channels, tokens):
    """Whether csrc/kernels/patch/sm80/tiny_patch_unembed.cu runs the problem: 16-bit, kw even, K <= 64,
    C_in <= 512, aligned pieces of x (tokens: C_in % 8 == 0; channels-first: N % 4 == 0)."""
    return (dtype in (torch.bfloat16, torch.float16) and kernel[-1] % 2 == 0
            and out_channels * math.prod(kernel) <= 64 and c_in <= 512
            and (c_in % 8 == 0 if tokens else math.prod(grid) % 4 == 0))


def tiny_unembed_applies(dtype, c_in, grid, kernel, out_channels, tokens, batch):
    """Whether patch_unembed's rules take the tiny kernel where it fits: not at 8192 multiply-adds per
    token (K x C_in) or more over 128-token tiles for under 3/4 of the SMs, and over 256 input
    channels only where GEMM -> scatter would copy x first (channels-first: B > 1 and N < 256, or
    N % 8 != 0)."""
    n = math.prod(grid)
    copies_x = not tokens and ((batch > 1 and n < 256) or n % 8 != 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gemm_work = out_channels * math.prod(kernel) * c_in >= 8192 and 4 * -(-batch * n // 128) < 3 * sms
    return (tiny_unembed_fits(dtype, c_in, grid, kernel, out_channels, tokens)
            and not gemm_work and (c_in <= 256 or copies_x))


# 16-bit unembeddings of patches of at most 64 elements with kw even take the fused kernel of
# csrc/kernels/patch/sm80/tiny_patch_unembed.cu: (x shape [B, C_in, *grid], kernel, C_out) covering K = 32 and 64
# (two and four n-tiles per warp), C_in = 256, 384, 512 (one block per SM; 8192 multiply-adds per
# token or more over a few tiles, which the rules give a GEMM path: forced there) and 40 (a padded
# reduction), N = 120 and 200 (partial last slices), N = 196 and 36 (channels-first rows copied in
# 8-byte pieces), C_in = 5 (channels-first only), kw = 4, 1-D/2-D/3-D, and ones that do not apply
# (K = 72: GEMM -> scatter or the implicit GEMM; N = 18 channels-first).
TINY_UNEMBED = [((2, 96, 4, 8, 16), (2, 2, 2), 4),   # U2-like: K = 32
                ((2, 256, 2, 4, 8), (2, 2, 2), 8),   # K = 64, C_in = 256
                ((3, 40, 3, 5, 8), (2, 2, 2), 6),    # C_in = 40, N = 120, K = 48
                ((2, 24, 8, 16), (2, 4), 3),         # 2-D, kw = 4, K = 24
                ((2, 16, 200), (2,), 20),            # 1-D, N = 200, K = 40
                ((2, 5, 2, 2, 4), (2, 3, 2), 4),     # C_in = 5: channels-first only, K = 48
                ((3, 384, 14, 14), (4, 4), 4),       # a decoder's last layer: C_in = 384, N = 196
                ((2, 512, 2, 18), (2, 2), 16),       # C_in = 512, N = 36, K = 64
                ((2, 64, 18), (2,), 8),              # N = 18: tokens x only
                ((2, 32, 4, 4, 8), (2, 2, 2), 9)]    # K = 72: not this kernel


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,out_channels", TINY_UNEMBED)
@pytest.mark.parametrize("in_format", ["channels_first", "tokens"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_gpu_tiny_unembed_kernel(dtype, shape, kernel, out_channels, in_format, has_bias):
    c_in, grid = shape[1], list(shape[2:])
    x = randn(*shape, dtype=dtype, device="cuda")
    w = randn(c_in, out_channels, *kernel, dtype=dtype, device="cuda") / math.sqrt(c_in)
    b = randn(out_channels, dtype=dtype, device="cuda") if has_bias else None
    tokens = in_format == "tokens"
    xs = conv_tokens(x).contiguous() if tokens else x
    ref = CONV_T[len(kernel)](x.double(), w.double(), b.double() if has_bias else None, stride=kernel)
    poison_allocator(2 * math.prod(ref.shape), "cuda")
    out = {}
    ran = cuda_kernels_run(lambda: out.update(
        y=patchgemm.patch_unembed(xs, w, b, in_format=in_format, grid=grid if tokens else None)))
    applies = tiny_unembed_applies(dtype, c_in, grid, kernel, out_channels, tokens, shape[0])
    assert ("tiny_unembed_kernel" in ran) == applies, ran
    if shape == (2, 96, 4, 8, 16):
        assert applies  # the U2-like case the kernel is for must not silently fall back
    assert_close_to_ref(out["y"], ref, dtype)
    if applies or not tiny_unembed_fits(dtype, c_in, grid, kernel, out_channels, tokens):
        return
    # Where the rules pass over the kernel, it still runs the problem when forced (or autotuned).
    poison_allocator(2 * math.prod(ref.shape), "cuda")
    with patchgemm.force(patch_unembed="tiny"):
        ran = cuda_kernels_run(lambda: out.update(
            y=patchgemm.patch_unembed(xs, w, b, in_format=in_format, grid=grid if tokens else None)))
    assert "tiny_unembed_kernel" in ran, ran
    assert_close_to_ref(out["y"], ref, dtype)


# 16-bit unembeddings with kw = 2 (and so patch_embed's input gradients) run the implicit GEMM of
# csrc/kernels/patch/sm80/implicit_patch_unembed.cu (on a 9.0 GPU, its wgmma version, which takes kw = 4 too and
# reads by TMA: channels-first x with N % 64 == 0, K % 8 == 0; the tests run both): (x shape
# [B, C_in, *grid], kernel, C_out) covering one and several column tiles (128 wide on mma.sync,
# 192 on wgmma; partial ones: K = 160, 192 and 128, 160, 256, 512, 640), C_in not a multiple of 8
# (channels-first x only) or of 64, N not a multiple of 8 (tokens x only) or of 64 (no TMA), K not a
# multiple of 8 (no TMA), 1-D/2-D/3-D, token tiles that straddle samples, a last tile half past the
# end, kw = 4 (a grid row of odd width: neither kernel), and more tiles than SMs (the wgmma kernel is
# persistent).
IMPLICIT_UNEMBED = [((2, 192, 4, 8, 8), (2, 2, 2), 192),  # P4's input gradient: K = 1536
                    ((2, 64, 4, 4, 8), (2, 2, 2), 24),    # K = 192: a partial column tile on mma.sync
                    ((2, 36, 2, 4, 8), (2, 2, 2), 16),    # C_in = 36: channels-first x only
                    ((3, 64, 1, 3, 4), (2, 2, 2), 16),    # N = 12: tokens x only
                    ((3, 48, 8, 16), (2, 2), 40),         # 2-D
                    ((2, 32, 256), (2,), 64),             # 1-D
                    ((3, 64, 5, 6, 8), (2, 2, 2), 16),    # N = 240: tiles straddle samples
                    ((2, 64, 2, 4, 8), (4, 4, 4), 24),    # kw = 4 (P5's input gradient, U1): K = 1536
                    ((3, 64, 1, 3, 6), (4, 4, 4), 4),     # kw = 4, N = 18: tokens x only; K = 256
                    ((3, 48, 8, 16), (4, 4), 40),         # kw = 4, 2-D: K = 640, a partial tile
                    ((2, 32, 256), (4,), 48),             # kw = 4, 1-D
                    ((2, 64, 2, 4, 5), (4, 4, 4), 8),     # kw = 4, grid rows of 5 tokens
                    ((3, 64, 2, 4, 8), (4, 4, 4), 24),    # kw = 4, N = 64, 192 tokens: half a last tile
                    ((2, 32, 8, 16), (2, 2), 17),         # K = 68: no TMA (rows of 136 bytes)
                    ((2, 200, 16, 16, 16), (2, 2, 2), 96),  # 256 tiles: several per SM; C_in = 200
                    # y's tiles as pair boxes by TMA (kw = 2; 8-, 16-, 32-patch grid rows; 192 columns)
                    ((4, 64, 8, 32, 32), (2, 2, 2), 24),   # 32-patch rows, 256 tiles
                    ((2, 64, 2, 16, 16), (2, 2, 2), 48),   # 16-patch rows, two column tiles
                    ((3, 96, 16, 8), (2, 2), 48),          # 2-D, 8-patch rows
                    ((2, 64, 4, 32, 32), (1, 2, 2), 48)]   # kd = 1


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,out_channels", IMPLICIT_UNEMBED)
@pytest.mark.parametrize("in_format", ["channels_first", "tokens"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_gpu_implicit_unembed_kernel(fused_always, implicit_wgmma, dtype, shape, kernel, out_channels, in_format,
                                     has_bias):
    c_in, grid = shape[1], list(shape[2:])
    x = randn(*shape, dtype=dtype, device="cuda")
    w = randn(c_in, out_channels, *kernel, dtype=dtype, device="cuda") / math.sqrt(c_in)
    b = randn(out_channels, dtype=dtype, device="cuda") if has_bias else None
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if has_bias else None
    ref = CONV_T[len(kernel)](x64, w64, b64, stride=kernel)
    tokens = in_format == "tokens"
    xs = (conv_tokens(x).contiguous() if tokens else x).requires_grad_()
    params = [w.requires_grad_()] + ([b.requires_grad_()] if has_bias else [])
    poison_allocator(2 * math.prod(ref.shape), "cuda")
    out = {}
    ran = cuda_kernels_run(lambda: out.update(
        y=patchgemm.patch_unembed(xs, w, b, in_format=in_format, grid=grid if tokens else None)))
    applies = c_in % 8 == 0 if tokens else math.prod(grid) % 8 == 0
    if kernel[-1] == 4:  # 16-byte stores of 2 tokens' runs: grid rows of even width
        applies = applies and grid[-1] % 2 == 0
    tma = out_channels * math.prod(kernel) % 8 == 0 and (tokens or math.prod(grid) % 64 == 0)
    wgmma = applies and implicit_wgmma and tma
    assert not tiny_unembed_applies(dtype, c_in, grid, kernel, out_channels, tokens, shape[0])  # (the fused kernel's cases)
    assert ("implicit_unembed_kernel" in ran) == (wgmma or (applies and kernel[-1] == 2)), ran
    assert ("implicit_unembed_kernel_sm90" in ran) == wgmma, ran
    gh, gw = ([1] + grid)[-2:]
    kd_kh = math.prod(kernel[:-1])
    pair_boxes = (kernel[-1] == 2 and gw in (8, 16, 32) and gh % (128 // gw) == 0 and
                  out_channels * math.prod(kernel) % 192 == 0 and 192 % (2 * kd_kh) == 0)
    assert ("2, true>" in ran) == (wgmma and pair_boxes), ran
    assert_close_to_ref(out["y"], ref, dtype)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    want = torch.autograd.grad(ref, [x64, w64] + ([b64] if has_bias else []), dy.double())
    got = torch.autograd.grad(out["y"], [xs] + params, dy)
    want = [conv_tokens(want[0]) if tokens else want[0], *want[1:]]
    for g, r, name in zip(got, want, ["grad_x", "grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name)


# The bias gradient summed apart (column_sums.cu) where the weight gradient multiplies the forward's
# patch matrix without a ones column: (x shape, kernel, E): one range of rows and a partial
# 256-column block, many ranges (sum_token_ranges adds them), E = 8, E not a multiple of 8 (ATen's
# reduction instead), and a grad_y strided between rows.
COLUMN_SUMS = [((1, 3, 224, 224), (16, 16), 768),     # ViT-B/16 at batch one: 196 rows, one range
               ((1, 4, 32, 32), (2, 2), 1152),        # DiT-XL/2 at batch one: 4.5 column blocks
               ((1, 4, 34, 32), (2, 2), 64),          # 272 rows: two ranges
               ((24, 4, 64, 64), (2, 2), 1280),       # 24576 rows: many ranges
               ((3, 6, 40, 40), (4, 4), 8),
               ((16, 4, 8, 8), (8, 8), 256),          # one patch per sample: B rows merge
               ((2, 3, 32, 32), (8, 8), 100)]         # E % 8: not the kernel


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,embed", COLUMN_SUMS)
@pytest.mark.parametrize("strided", [False, True])
def test_gpu_bias_grad_by_column_sums(dtype, shape, kernel, embed, strided):
    x, w, b = make(shape, kernel, dtype, "cuda", embed=embed)
    w.requires_grad_(), b.requires_grad_()
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    ref = conv_tokens(CONV[len(kernel)](x.double(), w64, b64, stride=kernel))
    dy = randn(*ref.shape[:-1], embed + 8 * strided, dtype=dtype, device="cuda")[..., :embed]
    want = torch.autograd.grad(ref, [w64, b64], dy.double())
    with patchgemm.force(patch_embed="aten_linear", patch_weight_grad="saved_patches"):
        y = patchgemm.patch_embed(x, w, b, out_format="tokens")
        poison_allocator(4 * w.numel() * 64, "cuda")
        out = {}
        ran = cuda_kernels_run(lambda: out.update(g=torch.autograd.grad(y, [w, b], dy, retain_graph=True)))
        again = torch.autograd.grad(y, [w, b], dy)
    assert ("column_sums_kernel" in ran) == (embed % 8 == 0), ran
    rows = shape[0] * math.prod(s // k for s, k in zip(shape[2:], kernel))
    assert ("sum_token_ranges_kernel" in ran) == (embed % 8 == 0 and rows > 256), ran  # more than one range
    for g, r, name in zip(out["g"], want, ["grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name)
    assert torch.equal(out["g"][1], again[1])  # a fixed order of sums: repeats are bitwise equal
