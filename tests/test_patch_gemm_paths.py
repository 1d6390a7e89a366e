"""The gather / scatter + GEMM paths of the patch ops: the GPU's tilings, copies and tiles, and the
CPU's copies of contiguous runs."""

import math

import pytest
import torch

import patchgemm
from conftest import (DEVICES, assert_close_to_ref, fused_mode, needs_gpu,
                      poison_allocator, randn)
from patch_cases import CONV, CONV_T, conv_tokens, cropped, cuda_kernels_run, layout, make

ops = torch.ops.patchgemm


# ---- CPU: the gather and scatter as copies of runs ----------------------------------------------

def _patch_matrix(x, kernel):
    """x's patch matrix [B, N, K] in the weight's column order (c, k...), by ATen's reshape."""
    rank, (batch, channels) = len(kernel), x.shape[:2]
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    x = x[(slice(None), slice(None)) + tuple(slice(0, g * k) for g, k in zip(grid, kernel))]
    split = [batch, channels] + [v for g, k in zip(grid, kernel) for v in (g, k)]
    order = [0] + [2 + 2 * i for i in range(rank)] + [1] + [3 + 2 * i for i in range(rank)]
    return x.reshape(split).permute(order).reshape(batch, math.prod(grid), -1)


def _one_hot_weight(rows, cols, dtype):
    """[rows, cols] with one 1 per row at a random column: a GEMM against it moves values exactly."""
    w = torch.zeros(rows, cols, dtype=dtype)
    w[torch.arange(rows), torch.randperm(cols)[:rows] if rows <= cols else torch.randint(cols, (rows,))] = 1
    return w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape,kernel", [((2, 192, 16, 16, 16), (2, 2, 2)),  # many rows: every thread's share
                                          ((3, 5, 7, 9), (7, 3)),             # odd runs
                                          ((2, 3, 11), (1,)),                 # runs of one value
                                          ((1, 4, 2, 14, 28), (2, 7, 14))])
@pytest.mark.parametrize("memory", ["contiguous", "channels_last", "cropped", "every_other"])
def test_cpu_gather_and_scatter_move_values_exactly(dtype, shape, kernel, memory):
    """The CPU's gather (csrc/kernels/patch/patchify_cpu.cpp) copies every patch value to its place:
    against a one-hot weight the GEMM paths return x's patch matrix bitwise, in both output formats,
    and the unembedding's scatter puts each token's values back where ATen's permute does, bias
    added once. Views with runs (cropped, channels-last) and without (every other value) alike."""
    x = layout(randn(*shape, dtype=dtype), memory) if memory != "cropped" else cropped(randn(*shape, dtype=dtype))
    K = shape[1] * math.prod(kernel)
    pick = _one_hot_weight(K, K, dtype)  # row e picks column pick[e].argmax() of the patch matrix
    ref = _patch_matrix(x, kernel) @ pick.double().t().to(dtype) if dtype == torch.float64 else \
        (_patch_matrix(x, kernel).double() @ pick.double().t()).to(dtype)
    w = pick.view(K, shape[1], *kernel)
    with patchgemm.force(patch_embed="gather_gemm"):
        tokens = patchgemm.patch_embed(x, w, None, out_format="tokens")
        first = patchgemm.patch_embed(x, w, None)
    assert torch.equal(tokens, ref)
    assert torch.equal(first.flatten(2).transpose(1, 2), ref)
    # The scatter: tokens [B, N, C_in] through a one-hot [C_in, C_out * k...] back to a volume.
    grid = [s // k for s, k in zip(shape[2:], kernel)]
    c_out, c_in = shape[1], 6
    t = randn(shape[0], math.prod(grid), c_in, dtype=dtype)
    w_t = _one_hot_weight(c_out * math.prod(kernel), c_in, dtype).t().contiguous().view(c_in, c_out, *kernel)
    bias = randn(c_out, dtype=dtype)
    q = (t.double() @ w_t.double().view(c_in, -1)).to(dtype).view(shape[0], *grid, c_out, *kernel)
    rank = len(kernel)
    order = [0, 1 + rank] + [v for i in range(rank) for v in (1 + i, 2 + rank + i)]
    expect = q.permute(order).reshape(shape[0], c_out, *[g * k for g, k in zip(grid, kernel)])
    expect = expect + bias.view(1, -1, *[1] * rank)
    with patchgemm.force(patch_unembed="gemm_scatter"):
        out = patchgemm.patch_unembed(t, w_t, bias, in_format="tokens", grid=grid)
    assert torch.equal(out, expect)


# ---- GPU specifics -------------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,kernel", [((2, 300, 4, 6, 70), (2, 2, 2)),   # several channel tiles
                                          ((2, 7, 3, 9, 27), (3, 3, 3)),     # odd kernel: 2-byte units
                                          ((3, 64, 2, 40, 200), (1, 4, 4)),  # partial w tiles
                                          ((2, 2, 224, 224), (16, 16))])
@pytest.mark.parametrize("memory", ["contiguous", "channels_last"])
def test_gpu_gather_scatter_tilings(dtype, shape, kernel, memory):
    x, w, b = make(shape, kernel, dtype, "cuda", embed=24)
    xs = layout(x, memory)
    ref = CONV[len(kernel)](x.double(), w.double(), b.double(), stride=kernel)
    for out_format in ("channels_first", "tokens"):
        y = patchgemm.patch_embed(xs, w, b, out_format=out_format)
        assert_close_to_ref(y, conv_tokens(ref) if out_format == "tokens" else ref, dtype)
    w_t = randn(24, shape[1], *kernel, dtype=dtype, device="cuda") / math.sqrt(24)
    b_t = randn(shape[1], dtype=dtype, device="cuda")
    z = randn(*ref.shape, dtype=dtype, device="cuda")
    for in_format in ("channels_first", "tokens"):
        u = patchgemm.patch_unembed(conv_tokens(z) if in_format == "tokens" else z, w_t, b_t,
                                    in_format=in_format, grid=ref.shape[2:])
        assert_close_to_ref(u, CONV_T[len(kernel)](z.double(), w_t.double(), b_t.double(), stride=kernel), dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape,kernel,offset", [((2, 3, 14, 29), (7, 7), 1),      # kw = 7, rows start mid-vector
                                                 ((3, 5, 9, 33), (3, 5), 3),       # runs of several tokens
                                                 ((2, 2, 4, 6, 23), (2, 3, 3), 2),  # 3-D
                                                 ((2, 40, 8, 9), (2, 2), 1),       # kw even, odd starts
                                                 ((8, 64, 98, 50), (7, 7), 1)])    # channel ranges: whole vectors
def test_gpu_gather_reads_rows_that_start_anywhere(dtype, shape, kernel, offset):
    """Rows of x that are not whole aligned 16-byte vectors gather through the aligned vectors that
    cover them (csrc/kernels/patch/patchify_kernels.cu, volume_to_tile_any_alignment): the forward
    and the weight gradient through gather + GEMM, on a view whose rows start mid-vector."""
    base, w, b = make(shape, kernel, dtype, "cuda", embed=24)
    x = base[..., offset:]
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    ref = CONV[len(kernel)](x.double(), w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    ref_w, ref_b = torch.autograd.grad(ref, [w64, b64], dy.double())
    w.requires_grad_(), b.requires_grad_()
    poison_allocator(2 * max(ref.numel(), w.numel()) * x.element_size(), "cuda")
    with patchgemm.force(patch_embed="gather_gemm", patch_weight_grad="gather_gemm"), patchgemm.explain() as e:
        y = patchgemm.patch_embed(x, w, b)
        grad_w, grad_b = torch.autograd.grad(y, [w, b], dy)
    assert {c.chosen for c in e} == {"gather_gemm"} and len(e) == 2, str(e)
    assert_close_to_ref(y, ref, dtype)
    assert_close_to_ref(grad_w, ref_w, dtype, "weight gradient")
    assert_close_to_ref(grad_b, ref_b, dtype, "bias gradient")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,kernel", [((2, 4, 16, 32, 32), (8, 16, 16)),  # K = 8192 > 4 x 16 tokens: summed apart
                                          ((2, 4, 16, 32, 30), (8, 16, 15))])  # K = 7680, rows of 15: likewise
@pytest.mark.parametrize("weight_grad", ["saved_patches", "gather_gemm"])
def test_gpu_channels_first_bias_of_a_weight_larger_than_y(dtype, shape, kernel, weight_grad):
    """A channels-first embedding whose weight is many times its output adds the bias after the
    GEMM and sums its gradient from grad_y (kernels/patch/patch_gemm.cpp, bias_as_ones_column)
    rather than folding it into a copy of the weight: forward and every gradient against float64."""
    x, w, b = make(shape, kernel, dtype, "cuda", embed=40)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    ref = CONV[len(kernel)](x64, w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    refs = torch.autograd.grad(ref, [x64, w64, b64], dy.double())
    for t in (x, w, b):
        t.requires_grad_()
    poison_allocator(2 * w.numel() * x.element_size(), "cuda")
    with patchgemm.force(patch_embed="gather_gemm", patch_weight_grad=weight_grad), patchgemm.explain() as e:
        y = patchgemm.patch_embed(x, w, b)
        grads = torch.autograd.grad(y, [x, w, b], dy)
        again = patchgemm.patch_embed(x, w, b)
    assert {c.op: c.chosen for c in e}["patch_embed"] == "gather_gemm", str(e)
    assert torch.equal(y, again), "two calls differ"
    assert_close_to_ref(y, ref, dtype)
    for got, want, name in zip(grads, refs, ["x gradient", "weight gradient", "bias gradient"]):
        assert_close_to_ref(got, want, dtype, name)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kernel,embed", [((8, 64, 98, 49), (7, 7), 256),  # K = 3136 into 784 tokens
                                                ((1, 128, 64, 64), (8, 8), 64),   # K = 8192 into 64 tokens
                                                ((4, 32, 64, 64), (8, 8), 512),   # K = 2048 into 256 x 512
                                                ((1, 256, 64, 64), (8, 8), 32)])  # K = 16384: the scratch
def test_gpu_16_bit_gemm_sums_stay_fp32_where_they_cancel(dtype, shape, kernel, embed):
    """A 16-bit embedding whose long reduction goes to few output tiles keeps its sums in fp32
    (csrc/kernels/gemm/gemm.cpp: cuBLASLt's fp32 split-K, or an fp32 scratch for the longest K),
    as the convolution it replaces does. Each output sums K products of about +-1 whose total is
    near 0: partial sums rounded to 16 bits would err by their own rounding (a few units at
    partial sums of thousands), far beyond the output's."""
    K = shape[1] * math.prod(kernel)
    x = (1 + 0.1 * torch.randn(shape, device="cuda")).to(dtype)
    signs = torch.ones(embed, K, device="cuda")
    signs[:, K // 2:] = -1
    w = (signs * (1 + 0.1 * torch.randn(embed, K, device="cuda"))).reshape(embed, shape[1], *kernel).to(dtype)
    b = torch.randn(embed, device="cuda").to(dtype)
    ref = CONV[len(kernel)](x.double(), w.double(), b.double(), stride=kernel)
    poison_allocator(2 * ref.numel() * x.element_size(), "cuda")
    with patchgemm.force(patch_embed="gather_gemm"):
        y = patchgemm.patch_embed(x, w, b)
        again = patchgemm.patch_embed(x, w, b)
    assert torch.equal(y, again), "two calls differ"
    # The output's own rounding (2^-8 of its size for bfloat16) plus fp32 sums' error.
    err = (y.double() - ref).abs().max().item()
    assert err <= 2 ** -7 * ref.abs().max().item() + 1e-3 * math.sqrt(K), (err, ref.abs().max().item())


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,kernel,embed", [((3, 512, 8, 12), (4, 4), 64),    # K = 8192, 6 tokens per sample
                                                ((1, 128, 24, 40), (8, 8), 64),   # one sample of 15 (unaligned) tokens
                                                ((2, 32, 4, 16, 16), (4, 8, 8), 64),  # 3-D, K = 8192, 2 tokens
                                                ((4, 8, 32, 32), (32, 32), 64),   # one patch per sample
                                                ((24, 64, 28, 28), (4, 4), 64),   # K = 1024 into 7 x 7 rows
                                                ((2, 64, 30, 30), (2, 2), 64),    # K = 256 into 225 (odd) tokens
                                                ((3, 16, 40, 40), (4, 4), 64),    # 100 tokens: pairs, not 16 bytes
                                                ((4, 24, 28, 28), (4, 4), 30),    # 49 tokens, E = 30: pairs
                                                ((4, 375, 28, 28), (4, 4), 750)])  # a head's grad_y: K = 6000
@pytest.mark.parametrize("has_bias", [True, False])
def test_gpu_gather_gemm_through_tokens(dtype, shape, kernel, embed, has_bias):
    """Channels-first output of long patches on few tokens, or into rows less aligned than E: one
    GEMM over every token, then the tiled transpose into y (csrc/kernels/patch/patch_gemm.cpp,
    embed_gemm_through_tokens; patchify_kernels.cu, transposing_copy)."""
    x, w, b = make(shape, kernel, dtype, "cuda", embed=embed, bias=has_bias)
    ref = CONV[len(kernel)](x.double(), w.double(), b.double() if has_bias else None, stride=kernel)
    poison_allocator(2 * ref.numel() * x.element_size(), "cuda")
    with patchgemm.force(patch_embed="gather_gemm"), patchgemm.explain() as e:
        y = patchgemm.patch_embed(x, w, b)
    assert [c.chosen for c in e] == ["gather_gemm"]
    assert y.is_contiguous() and y.shape == ref.shape
    assert_close_to_ref(y, ref, dtype)


# (x shape, x's channel offset into a larger tensor, weight shape) of channels-first unembeddings
# whose GEMM copies x into tokens order: the transpose's loads as 16 bytes, pairs or single
# elements, its stores the same, and views that start mid-vector.
UNEMBED_COPIES = [((2, 64, 8, 16), 0, (64, 8, 4, 4)),     # 128 tokens of 64 channels: 16-byte both sides
                  ((3, 40, 7, 9), 0, (40, 5, 4, 4)),      # 63 tokens: single-element loads
                  ((2, 48, 14, 14), 1, (48, 2, 8, 8)),    # starts 392 bytes in: pairs
                  ((2, 37, 10, 10), 0, (37, 2, 8, 8)),    # 37 channels: single-element stores
                  ((1, 24, 70, 70), 0, (24, 5, 4, 4))]    # 4900 tokens (unaligned), several tiles


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,offset,wshape", UNEMBED_COPIES)
def test_gpu_unembed_copies_x_by_transpose(dtype, shape, offset, wshape):
    """gemm_scatter's copy of channels-first x into tokens order (patch_gemm.cpp,
    unembed_gemm_copies_x) through the tiled transpose."""
    b, c, h, w_ = shape
    base = randn(b, c + offset, h, w_, dtype=dtype, device="cuda")
    x = base[:, offset:]
    w = randn(*wshape, dtype=dtype, device="cuda") / math.sqrt(c)
    kernel = wshape[2:]
    ref = CONV_T[2](x.double(), w.double(), stride=kernel)
    poison_allocator(2 * ref.numel() * x.element_size(), "cuda")
    with patchgemm.force(patch_unembed="gemm_scatter"), patchgemm.explain() as e:
        y = patchgemm.patch_unembed(x, w)
    assert [c.chosen for c in e] == ["gemm_scatter"]
    assert_close_to_ref(y, ref, dtype)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,kernel,embed", [((2, 3, 64, 64), 16, 24),    # 16 tokens: 16-byte loads
                                                ((3, 3, 48, 80), 16, 20),    # 15 tokens: single-element loads
                                                ((2, 3, 96, 160), 16, 70),   # 60 tokens, E = 70: pairs (16-bit)
                                                # 2 x 5,329 tokens into 192 x 2,156: a GEMM batched over
                                                # the samples would run unsplit on few tiles
                                                ((2, 11, 1022, 1022), 14, 192)])
def test_gpu_weight_grad_copies_grad_y_by_transpose(dtype, shape, kernel, embed):
    """The weight gradient's copy of channels-first grad_y into tokens order (weight_grad_by_gemm:
    long patches on few tokens, or long reductions on few tiles) through the tiled transpose."""
    x, w, b = make(shape, (kernel, kernel), dtype, "cuda", embed=embed)
    w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
    ref = CONV[2](x.double(), w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    ref_w, ref_b = torch.autograd.grad(ref, [w64, b64], dy.double())
    w.requires_grad_(), b.requires_grad_()
    with patchgemm.force(patch_weight_grad="gather_gemm"):
        grad_w, grad_b = torch.autograd.grad(patchgemm.patch_embed(x, w, b), [w, b], dy)
    assert_close_to_ref(grad_w, ref_w, dtype, "weight gradient")
    assert_close_to_ref(grad_b, ref_b, dtype, "bias gradient")


# Tiles resized to the GPU (patchify_kernels.cu, plan_tiles): small problems split into patch rows
# and then channel ranges; long thin (1-D) ones grown along w. x's shape, the ConvTranspose weight's.
RESIZED_TILES = [((4, 64, 7, 14), (64, 3, 7, 7)),     # 7 x 7 rows of 3 channels: rows split
                 ((1, 32, 7, 7), (32, 256, 7, 7)),    # 256 channels of 7 x 7: channel ranges split
                 ((2, 16, 4, 5), (16, 40, 2, 3)),     # odd kw, 40 channels
                 ((40, 64, 256), (64, 1, 16)),        # 1-D, one channel: runs grown along w
                 ((140, 32, 100), (32, 3, 4))]        # 1-D, grown runs that end mid-grid


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("xshape,wshape", RESIZED_TILES)
def test_gpu_resized_tiles(dtype, xshape, wshape):
    """The tiled scatter (gemm_scatter, with its bias) and the tiled gather (gather_gemm's embedding
    and weight gradient, the ConvTranspose weight read as a Conv weight of the output's channels)
    on tiles split or grown for the GPU's SMs."""
    rank = len(wshape) - 2
    kernel = wshape[2:]
    x = randn(*xshape, dtype=dtype, device="cuda")
    w = randn(*wshape, dtype=dtype, device="cuda") / math.sqrt(xshape[1])
    b = randn(wshape[1], dtype=dtype, device="cuda")
    ref = CONV_T[rank](x.double(), w.double(), b.double(), stride=kernel)
    poison_allocator(2 * ref.numel() * x.element_size(), "cuda")
    with patchgemm.force(patch_unembed="gemm_scatter"), patchgemm.explain() as e:
        y = patchgemm.patch_unembed(x, w, b)
    assert [c.chosen for c in e] == ["gemm_scatter"]
    assert_close_to_ref(y, ref, dtype)
    # The embedding of the unembedding's output back into x's channels: the gather of its patches.
    v = randn(*ref.shape, dtype=dtype, device="cuda")
    w64, b64 = w.double().requires_grad_(), randn(xshape[1], dtype=torch.float64, device="cuda").requires_grad_()
    ref_e = CONV[rank](v.double(), w64, b64, stride=kernel)
    dy = randn(*ref_e.shape, dtype=dtype, device="cuda")
    ref_w, ref_b = torch.autograd.grad(ref_e, [w64, b64], dy.double())
    we, be = w.clone().requires_grad_(), b64.to(dtype).detach().requires_grad_()
    with patchgemm.force(patch_embed="gather_gemm", patch_weight_grad="gather_gemm"):
        out = patchgemm.patch_embed(v, we, be)
        grad_w, grad_b = torch.autograd.grad(out, [we, be], dy)
    assert_close_to_ref(out, ref_e, dtype)
    assert_close_to_ref(grad_w, ref_w, dtype, "weight gradient")
    assert_close_to_ref(grad_b, ref_b, dtype, "bias gradient")


@needs_gpu
@pytest.mark.parametrize("dtype,shape,kernel", [(torch.bfloat16, (3, 3, 64, 96), (16, 16)),   # ViT-like, K = 768
                                                (torch.float16, (2, 5, 4, 8, 24), (2, 2, 8)),  # 3-D, 16-byte rows
                                                (torch.float32, (2, 3, 8, 24), (2, 8)),        # 32-byte rows
                                                (torch.float64, (2, 3, 6, 10), (3, 2))])       # K = 18: padded rows
@pytest.mark.parametrize("memory", ["contiguous", "cropped"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_gpu_gather_wide_rows(dtype, shape, kernel, memory, has_bias):
    """Patch rows of whole 16-byte vectors gather without a tile (csrc/kernels/patch/patchify_kernels.cu,
    gather_wide_rows), the ones column for the bias gradient included."""
    x, w, b = make(shape, kernel, dtype, "cuda", embed=24, bias=has_bias)
    xs = (cropped(x) if memory == "cropped" else x.clone()).requires_grad_()
    w.requires_grad_()
    params = [xs, w] + ([b.requires_grad_()] if has_bias else [])
    x64, w64 = x.double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_() if has_bias else None
    ref = CONV[len(kernel)](x64, w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device="cuda")
    want = torch.autograd.grad(ref, [x64, w64] + ([b64] if has_bias else []), dy.double())
    with fused_mode("never"):
        out = {}

        def step():
            out["y"] = patchgemm.patch_embed(xs, w, b)
            out["g"] = torch.autograd.grad(out["y"], params, dy)

        assert "gather_wide_rows" in cuda_kernels_run(step)
    assert_close_to_ref(out["y"], ref, dtype)
    for g, r, name in zip(out["g"], want, ["grad_x", "grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name)


# ---- The forward's patch matrix, reused by the weight gradient -----------------------------------

SAVED_PATCHES = [  # (x shape, kernel, out_format, x's memory, the forward forced)
    ((2, 3, 16, 16), (4, 4), "tokens", "contiguous", "gather_gemm"),
    ((2, 3, 16, 16), (4, 4), "channels_first", "contiguous", "gather_gemm"),
    ((2, 4, 8, 8, 8), (2, 2, 2), "channels_first", "channels_last", "gather_gemm"),
    ((3, 5, 12, 20), (4, 4), "tokens", "channels_last", "aten_linear"),
    ((4, 1, 512), (16,), "tokens", "contiguous", "aten_linear"),
    ((3, 2, 8, 8), (8, 8), "tokens", "contiguous", "view_gemm"),  # one patch per sample: x itself
    ((2, 3, 12, 12), (3, 3), "tokens", "contiguous", "gather_gemm"),  # K = 27: a ones column in the padding
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("shape,kernel,fmt,memory,forward", SAVED_PATCHES)
def test_weight_grad_reuses_the_forwards_patch_matrix(device, dtype, has_bias, shape, kernel, fmt, memory, forward):
    """Where the forward gathered (or copied) the patch matrix, the weight gradient's GEMM reads it
    (saved_patches) instead of gathering x again, the bias gradient from its ones column or summed
    from tokens grad_y: every gradient as the float64 convolution's, and dW as the gather's."""
    if forward == "aten_linear" and device == "cuda" and dtype == torch.float32:
        forward = "gather_gemm"  # (linear's TF32 flag is not the conv's: not offered)
    x, w, b = make(shape, kernel, dtype, device, embed=24, bias=has_bias)
    x = layout(x, memory).requires_grad_()
    params = [x, w.requires_grad_()] + ([b.requires_grad_()] if has_bias else [])
    with patchgemm.force(patch_embed=forward), patchgemm.explain() as e:
        y = patchgemm.patch_embed(x, w, b, out_format=fmt)
        dy = randn(*y.shape, dtype=dtype, device=device)
        got = torch.autograd.grad(y, params, dy)
    (weight_grad,) = [c for c in e if c.op == "patch_weight_grad"]
    if dtype != torch.float32 and has_bias and fmt == "channels_first":
        # channels-first grad_y: the matrix where it has a ones column for the bias (the GPU's gather),
        # else its rule leaves the 16-bit bias sum to the fused kernels' pass (where the forward wrote
        # channels-first memory, it keeps no matrix for it)
        reason = {v.name: v.reason for v in weight_grad.candidates}["saved_patches"]
        assert weight_grad.chosen == "saved_patches" or reason == "no patch matrix kept from the forward" or \
            reason.startswith("rule: a 16-bit bias gradient summed apart from channels-first"), str(e)
    else:
        assert weight_grad.chosen == "saved_patches", str(e)
    params64 = [t.detach().double().requires_grad_() for t in params]
    y64 = CONV[len(kernel)](params64[0], params64[1], params64[2] if has_bias else None, stride=kernel)
    y64 = conv_tokens(y64) if fmt == "tokens" else y64
    ref = torch.autograd.grad(y64, params64, dy.double())
    bias_terms = dy.double().abs().sum([d for d in range(dy.dim()) if d != 1])  # (db's sum's)
    for name, g, r in zip(("dx", "dW", "db"), got, ref):
        assert_close_to_ref(g, r, dtype, what=name, magnitude=bias_terms if name == "db" else None)
    with patchgemm.force(patch_embed=forward, patch_weight_grad="gather_gemm"):
        y = patchgemm.patch_embed(x, w, b, out_format=fmt)
        gathered = torch.autograd.grad(y, params[1:], dy)
    for g, r in zip(got[1:], gathered):
        assert g.stride() == r.stride()  # the weight's memory format, as the gather's (channels-last x)
        torch.testing.assert_close(g, r, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)


UNEMBED_SHARED_PATCHES = [  # (grad_y's shape: the unembedding's output, kernel, in_format, memory, dx's embedding)
    ((2, 3, 16, 16), (4, 4), "tokens", "contiguous", "gather_gemm"),
    ((2, 5, 16, 16), (4, 4), "channels_first", "contiguous", "gather_gemm"),
    ((2, 4, 8, 8, 8), (2, 2, 2), "channels_first", "channels_last", "gather_gemm"),
    ((3, 5, 12, 20), (4, 4), "tokens", "channels_last", "aten_linear"),
    ((4, 1, 512), (16,), "tokens", "contiguous", "aten_linear"),
    ((2, 3, 12, 12), (3, 3), "channels_first", "contiguous", "gather_gemm"),  # K = 27: padded rows
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("shape,kernel,in_format,memory,dx_embed", UNEMBED_SHARED_PATCHES)
def test_unembed_weight_grad_reuses_dx_patch_matrix(device, dtype, has_bias, shape, kernel, in_format, memory,
                                                    dx_embed):
    """patch_unembed's backward gathers grad_y's patches once, as the linear rewrite's does: dx is
    the embedding of grad_y, and where that embedding gathered the patch matrix the weight gradient
    multiplies it (saved_patches). Every gradient as the float64 transposed convolution's, dW and db
    as a weight gradient that gathers grad_y itself; without dx, nothing is reused."""
    if dx_embed == "aten_linear" and device == "cuda" and dtype == torch.float32:
        dx_embed = "gather_gemm"  # (linear's TF32 flag is not the conv's: not offered)
    grid = [s // k for s, k in zip(shape[2:], kernel)]
    c_out, c_in = shape[1], 24
    x = randn(shape[0], c_in, *grid, dtype=dtype, device=device)
    x = layout(x, memory)
    x_in = x.flatten(2).transpose(1, 2).contiguous() if in_format == "tokens" else x
    w = randn(c_in, c_out, *kernel, dtype=dtype, device=device) / math.sqrt(c_in)
    b = randn(c_out, dtype=dtype, device=device) if has_bias else None
    params = [x_in.requires_grad_(), w.requires_grad_()] + ([b.requires_grad_()] if has_bias else [])
    unembed = lambda: patchgemm.patch_unembed(x_in, w, b, in_format=in_format,  # noqa: E731
                                              grid=grid if in_format == "tokens" else None)
    with patchgemm.force(patch_embed=dx_embed), patchgemm.explain() as e:
        y = unembed()
        dy = layout(randn(*y.shape, dtype=dtype, device=device), memory)
        got = torch.autograd.grad(y, params, dy)
    assert [c.op for c in e] == ["patch_unembed", "patch_embed", "patch_weight_grad"], str(e)
    assert e[1].chosen == dx_embed and e[2].chosen == "saved_patches", str(e)

    params64 = [t.detach().double().requires_grad_() for t in params]
    x64 = params64[0].transpose(1, 2).reshape(shape[0], c_in, *grid) if in_format == "tokens" else params64[0]
    y64 = CONV_T[len(kernel)](x64, params64[1], params64[2] if has_bias else None, stride=kernel)
    ref = torch.autograd.grad(y64, params64, dy.double())
    bias_terms = dy.double().abs().sum([d for d in range(dy.dim()) if d != 1])  # (db's sum's)
    for name, g, r in zip(("dx", "dW", "db"), got, ref):
        assert_close_to_ref(g, r, dtype, what=name, magnitude=bias_terms if name == "db" else None)
    with patchgemm.force(patch_embed=dx_embed, patch_weight_grad="gather_gemm"):
        gathered = torch.autograd.grad(unembed(), params, dy)
    for g, r in zip(got, gathered):
        assert g.stride() == r.stride()  # the weight's memory format, as the gather's (channels-last grad_y)
        torch.testing.assert_close(g, r, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)

    with patchgemm.force(patch_embed=dx_embed), patchgemm.explain() as e:  # the weight's gradient alone
        torch.autograd.grad(unembed(), params[1:], dy)
    assert [c.op for c in e] == ["patch_unembed", "patch_weight_grad"] and e[1].chosen != "saved_patches", str(e)


@pytest.mark.parametrize("device", DEVICES)
def test_saved_patches_rule_leaves_wide_16_bit_bias_sums_to_one_pass(device):
    """A 16-bit bias gradient that the forward's matrix has no ones column for is summed from grad_y
    apart: over a grad_y of 4 MB or more, more than twice as wide as the patch (DiT's latents), the
    rule passes the saved matrix over, and the forward keeps none; forced, it runs."""
    x, w, b = make((8, 4, 32, 32), (2, 2), torch.bfloat16, device, embed=1024)  # grad_y: 2048 x 1024
    w.requires_grad_(), b.requires_grad_()
    dy = randn(8, 256, 1024, dtype=torch.bfloat16, device=device)
    forward = "aten_linear" if device == "cuda" else "gather_gemm"
    grads = {}
    for forced in ({}, {"patch_weight_grad": "saved_patches"}):
        with patchgemm.force(patch_embed=forward, **forced), patchgemm.explain() as e:
            y = patchgemm.patch_embed(x, w, b, out_format="tokens")
            grads[bool(forced)] = torch.autograd.grad(y, [w, b], dy)
        (weight_grad,) = [c for c in e if c.op == "patch_weight_grad"]
        if forced:
            assert weight_grad.chosen == "saved_patches", str(e)
        else:  # (no matrix kept: the verdict says so)
            verdict = {v.name: v for v in weight_grad.candidates}["saved_patches"]
            assert weight_grad.chosen != "saved_patches" and verdict.reason == "no patch matrix kept from the forward", \
                str(e)
    for g, r in zip(grads[True], grads[False]):
        torch.testing.assert_close(g, r, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_saved_patches_with_a_16_bit_bias_and_channels_first_grad_y(device):
    """Channels-first grad_y, a 16-bit bias the matrix has no ones column for: on the GPU the rule
    leaves the bias sum to the fused kernels, which read grad_y as it lies; the CPU has none, sums
    such a grad_y quickly, and takes the matrix rather than gathering x again. (49 tokens per
    sample: the GPU's forward runs through tokens, whose matrix has no ones column.)"""
    x, w, b = make((2, 8, 56, 56), (8, 8), torch.bfloat16, device, embed=32)
    w.requires_grad_(), b.requires_grad_()
    dy = randn(2, 32, 7, 7, dtype=torch.bfloat16, device=device)
    with patchgemm.force(patch_embed="gather_gemm"), patchgemm.explain() as e:
        got = torch.autograd.grad(patchgemm.patch_embed(x, w, b), [w, b], dy)
    (weight_grad,) = [c for c in e if c.op == "patch_weight_grad"]
    verdict = {v.name: v for v in weight_grad.candidates}["saved_patches"]
    if device == "cpu":
        assert weight_grad.chosen == "saved_patches", str(e)
    else:  # (no matrix kept: the verdict says so)
        assert weight_grad.chosen != "saved_patches" and verdict.reason == "no patch matrix kept from the forward", \
            str(e)
    with patchgemm.force(patch_embed="gather_gemm", patch_weight_grad="gather_gemm"):
        gathered = torch.autograd.grad(patchgemm.patch_embed(x, w, b), [w, b], dy)
    for g, r in zip(got, gathered):
        torch.testing.assert_close(g, r, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_saved_patches_only_where_a_forward_made_them_and_a_weight_needs_them(device):
    """No patch matrix is kept where the forward read x in place (the convolution), nor where the
    weight needs no gradient (dx alone, from the weight); the op patch_weight_grad, which has no
    forward, cannot be forced onto one."""
    x, w, b = make((2, 3, 16, 16), (4, 4), torch.float32, device, embed=24)
    w.requires_grad_()
    with patchgemm.force(patch_embed="aten_conv"), patchgemm.explain() as e:
        patchgemm.patch_embed(x, w, b, out_format="tokens").sum().backward()
    weight_grad = [c for c in e if c.op == "patch_weight_grad"]
    assert len(weight_grad) == 1 and weight_grad[0].chosen != "saved_patches", str(e)
    reasons = {v.name: v.reason for v in weight_grad[0].candidates}
    assert reasons["saved_patches"] == "no patch matrix kept from the forward", str(e)

    x.requires_grad_()
    w.requires_grad_(False)
    with patchgemm.force(patch_embed="gather_gemm"), patchgemm.explain() as e:
        patchgemm.patch_embed(x, w, b).sum().backward()
    assert [c.op for c in e] == ["patch_embed", "patch_unembed"], str(e)

    dy = randn(2, 16, 24, device=device)
    with patchgemm.force(patch_weight_grad="saved_patches"), \
            pytest.raises(RuntimeError, match="no patch matrix kept from the forward"):
        ops.patch_weight_grad(dy, x.detach(), [4, 4], True, [], True)


@pytest.mark.parametrize("mode", ["autotune", "learned"])
def test_saved_patches_in_every_mode(mode, tmp_path):
    """Autotune and the learned selector take the saved patch matrix too: there is nothing to time
    (nothing is remembered for it), and a forced weight gradient still recomputes it from x."""
    x, w, b = make((4, 3, 32, 32), (8, 8), torch.float32, "cpu", embed=32)
    w.requires_grad_()
    previous = patchgemm.set_selection(mode, cache_dir=str(tmp_path)) if mode == "autotune" else \
        patchgemm.set_selection(mode)
    try:
        with patchgemm.force(patch_embed="gather_gemm"), patchgemm.explain() as e:
            y = patchgemm.patch_embed(x, w, b, out_format="tokens")
            (dw,) = torch.autograd.grad(y, [w], y.detach())
    finally:
        patchgemm.set_selection(previous)
    chosen = [c for c in e if c.op == "patch_weight_grad"]
    assert len(chosen) == 1 and chosen[0].chosen == "saved_patches" and chosen[0].how.startswith("reused"), str(e)
    w64 = w.detach().double().requires_grad_()
    y64 = conv_tokens(CONV[2](x.double(), w64, b.double(), stride=8))
    assert_close_to_ref(dw, torch.autograd.grad(y64, [w64], y.detach().double())[0], torch.float32, what="dW")
