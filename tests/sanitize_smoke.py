"""Run every CUDA code path once on small shapes, for compute-sanitizer:
    compute-sanitizer --tool memcheck python tests/sanitize_smoke.py
or, with --scale, every candidate of ours forced in turn on the multi-wave problems of
scale_cases.py (a block's second tile, stores in flight across tiles):
    compute-sanitizer --tool racecheck python tests/sanitize_smoke.py --scale [--once] [family[:op] ...]
(not a pytest module: it asserts only that results are finite; the tests check values)."""

import sys

import torch

import patchgemm
from conftest import WGMMA, selection  # (tests/, the script's folder, is on sys.path)
from scale_cases import CASES, FAMILY_OPS, chose, does_not_apply, forcing, our_candidates

ops = torch.ops.patchgemm


def main():
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for layout in ("bgd", "gbd"):
            for bias in (True, False):
                shape = (37, 3, 29) if layout == "bgd" else (3, 37, 29)
                x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
                w = torch.randn(3, 19, 29, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(3, 19, dtype=dtype, device="cuda", requires_grad=True) if bias else None
                y = patchgemm.grouped_linear(x, w, b, layout)
                grads = torch.autograd.grad(y, [x, w], torch.randn_like(y))
                assert all(torch.isfinite(t).all() for t in (y, *grads))
    # FP8: the fused quantization (scalar tails, and a grid-stride run over more packs than threads)
    # and the FP8 grouped linear, forward and backward
    if torch.cuda.get_device_capability() >= (8, 9):
        for n in (1, 13, 3 * 2**20 + 7):
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(n, dtype=dtype, device="cuda")
                data, _, scale, _ = ops.quantize_fp8(x, torch.float8_e5m2)
                assert torch.isfinite(scale) and torch.isfinite(data.float()).all()
                data, data_t, scale, _ = ops.quantize_fp8(x.view(1, -1, 1 if n % 7 else 7), torch.float8_e4m3fn, True, True)
                assert torch.isfinite(data_t.float()).all()
        # the transposing cast at 8, 4 and 1 values per thread, over several waves of tiles, summing columns
        for shape in ((4, 2048, 2056), (2, 2048, 2052), (2, 1000, 1027)):
            data, data_t, scale, sums = ops.quantize_fp8(torch.randn(shape, device="cuda", dtype=torch.bfloat16),
                                                      torch.float8_e4m3fn, True, True, True)
            assert torch.isfinite(data.float()).all() and torch.isfinite(data_t.float()).all()
            assert torch.isfinite(sums).all()
        # delayed scaling: both casts observing the amax, the record kernel at its longest history,
        # and a history holding nothing yet (the amax kernel measures first) then one that does
        for n, shape, length in ((3 * 2**20 + 7, None, 1024), (None, (4, 2048, 2056), 16), (None, (2, 1000, 1027), 1)):
            state = torch.zeros(length + 2, device="cuda")
            for _ in range(2):
                x = torch.randn(n if shape is None else shape, device="cuda", dtype=torch.bfloat16)
                data, data_t, scale, _ = ops.quantize_fp8(x, torch.float8_e4m3fn, True, shape is not None, False, state)
                assert torch.isfinite(scale) and torch.isfinite(data.float()).all() and state[1].item() == 0
        x = torch.randn(64, 3, 32, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        layer = patchgemm.GroupedLinear(3, 32, 48, device="cuda", dtype=torch.bfloat16, fp8=True)
        y = layer(x)
        grads = torch.autograd.grad(y, [x, layer.weight, layer.bias], torch.randn_like(y))
        assert all(torch.isfinite(t).all() for t in (y, *grads))
        # ragged groups and a patch embedding in FP8
        x = torch.randn(100, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        w = torch.randn(3, 32, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        sizes = torch.tensor([40, 0, 60], device="cuda")
        for recipe in (patchgemm.Float8Recipe(), patchgemm.Float8Recipe(backward_format=torch.float8_e4m3fn)):
            y = patchgemm.grouped_linear(x, w, group_sizes=sizes, fp8=recipe)
            grads = torch.autograd.grad(y, [x, w], torch.randn_like(y))
            assert all(torch.isfinite(t).all() for t in (y, *grads))
        x = torch.randn(2, 3, 32, 32, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        w = torch.randn(64, 3, 8, 8, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        y = patchgemm.patch_embed(x, w, out_format="tokens", fp8=True)
        grads = torch.autograd.grad(y, [x, w], torch.randn_like(y))
        assert all(torch.isfinite(t).all() for t in (y, *grads))
    # splitting at a lowered BLAS integer limit
    old = ops._set_blas_int_limit(6)
    x = torch.randn(9, 2, 3, device="cuda", requires_grad=True)
    w = torch.randn(2, 3, 3, device="cuda", requires_grad=True)
    y = patchgemm.grouped_linear(x, w, torch.randn(2, 3, device="cuda"))
    torch.autograd.grad(y, [x, w], torch.ones_like(y))
    ops._set_blas_int_limit(old)
    # patch (un)embedding: every gather/scatter kernel, unit size and tiling edge
    shapes = [((2, 5, 4, 6, 14), (2, 3, 2)), ((2, 3, 9, 21), (3, 7)), ((2, 70, 2, 4, 10), (2, 2, 2)),
              ((3, 2, 2, 14, 14), (2, 14, 14)), ((2, 3, 28, 224), (14, 14)), ((1, 3, 7, 280), (7, 7))]
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for shape, kernel in shapes:
            for memory in ("contiguous", "channels_last"):
                x = torch.randn(shape, dtype=dtype, device="cuda")
                if memory == "channels_last":
                    x = x.movedim(1, -1).contiguous().movedim(-1, 1)
                x.requires_grad_()
                w = torch.randn(6, shape[1], *kernel, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(6, dtype=dtype, device="cuda", requires_grad=True)
                for out_format in ("channels_first", "tokens"):
                    y = patchgemm.patch_embed(x, w, b, out_format=out_format)
                    grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
                    assert all(torch.isfinite(t).all() for t in (y, *grads))
                    grid = [s // k for s, k in zip(shape[2:], kernel)]
                    bias_out = torch.randn(shape[1], dtype=dtype, device="cuda")
                    u = patchgemm.patch_unembed(y.detach(), w.detach(), bias_out, in_format=out_format, grid=grid)
                    assert torch.isfinite(u).all()
    # the gather's rows that are not whole aligned vectors (odd kw, views starting mid-vector),
    # forward and weight gradient through gather + GEMM
    with patchgemm.force(patch_embed="gather_gemm", patch_weight_grad="gather_gemm"):
        for dtype in (torch.bfloat16, torch.float32, torch.float64):
            for shape, kernel in [((2, 3, 14, 29), (7, 7)), ((3, 5, 9, 33), (3, 5)), ((2, 2, 4, 6, 23), (2, 3, 3))]:
                x = torch.randn(shape, dtype=dtype, device="cuda")[..., 1:]
                w = torch.randn(6, shape[1], *kernel, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(6, dtype=dtype, device="cuda", requires_grad=True)
                y = patchgemm.patch_embed(x, w, b)
                grads = torch.autograd.grad(y, [w, b], torch.randn_like(y))
                assert all(torch.isfinite(t).all() for t in (y, *grads))
    # the tiled transpose between tokens and channels-first (16 bytes, pairs or single elements a
    # side): the embedding through tokens, gemm_scatter's copy of x, the weight gradient's of grad_y
    for dtype in (torch.bfloat16, torch.float32):
        with patchgemm.force(patch_embed="gather_gemm"):
            for shape, k, e in [((2, 64, 30, 30), 2, 64), ((3, 16, 40, 40), 4, 24), ((2, 3, 64, 70), 2, 40)]:
                x = torch.randn(shape, dtype=dtype, device="cuda")
                assert torch.isfinite(patchgemm.patch_embed(x, torch.randn(e, shape[1], k, k, dtype=dtype, device="cuda"))).all()
        with patchgemm.force(patch_unembed="gemm_scatter"):
            for shape, offset, wshape in [((2, 64, 8, 16), 0, (64, 8, 4, 4)), ((3, 40, 7, 9), 0, (40, 5, 4, 4)),
                                          ((2, 48, 14, 14), 1, (48, 2, 8, 8)), ((2, 37, 10, 10), 0, (37, 2, 8, 8))]:
                x = torch.randn(shape[0], shape[1] + offset, *shape[2:], dtype=dtype, device="cuda")[:, offset:]
                assert torch.isfinite(patchgemm.patch_unembed(x, torch.randn(wshape, dtype=dtype, device="cuda"))).all()
        with patchgemm.force(patch_weight_grad="gather_gemm"):
            for shape, e in [((2, 3, 64, 64), 24), ((3, 3, 48, 80), 20), ((2, 3, 96, 160), 70)]:
                w = torch.randn(e, 3, 16, 16, dtype=dtype, device="cuda", requires_grad=True)
                y = patchgemm.patch_embed(torch.randn(shape, dtype=dtype, device="cuda"), w)
                assert torch.isfinite(torch.autograd.grad(y, [w], torch.randn_like(y))[0]).all()
    # the tiled gather and scatter on tiles resized to the GPU: rows and channel ranges split, 1-D
    # runs grown along w (the last ending mid-grid)
    for dtype in (torch.bfloat16, torch.float32):
        with patchgemm.force(patch_unembed="gemm_scatter", patch_embed="gather_gemm", patch_weight_grad="gather_gemm"):
            for xshape, wshape in [((4, 64, 7, 14), (64, 3, 7, 7)), ((1, 32, 7, 7), (32, 256, 7, 7)),
                                   ((40, 64, 256), (64, 1, 16)), ((140, 32, 100), (32, 3, 4))]:
                w = torch.randn(wshape, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(wshape[1], dtype=dtype, device="cuda")
                y = patchgemm.patch_unembed(torch.randn(xshape, dtype=dtype, device="cuda"), w, b)
                e = patchgemm.patch_embed(y, w)
                assert all(torch.isfinite(t).all() for t in (y, e, torch.autograd.grad(e, [w], torch.randn_like(e))[0]))
    # the fused tiny-patch kernels (K <= 64; 16-bit and fp32): full and partial token tiles, any strides;
    # the 16-bit weight gradient (kw = 2) of the embedding and of the unembedding (with its bias
    # gradient), and the unembedding
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for shape, kernel, embed in [((2, 4, 16, 16, 16), (2, 2, 2), 32), ((3, 1, 6, 10, 16), (2, 2, 2), 48),
                                     ((2, 2, 512), (8,), 16)]:
            for memory in ("contiguous", "channels_last"):
                x = torch.randn(shape, dtype=dtype, device="cuda")
                if memory == "channels_last":
                    x = x.movedim(1, -1).contiguous().movedim(-1, 1)
                x.requires_grad_()
                w = torch.randn(embed, shape[1], *kernel, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(embed, dtype=dtype, device="cuda", requires_grad=True)
                y = patchgemm.patch_embed(x, w, b)
                grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
                bias_out = torch.randn(shape[1], dtype=dtype, device="cuda", requires_grad=True)
                u = patchgemm.patch_unembed(y.detach().requires_grad_(), w, bias_out)
                grads_u = torch.autograd.grad(u, [w, bias_out], torch.randn_like(u))
                assert all(torch.isfinite(t).all() for t in (y, *grads, u, *grads_u))
                if dtype != torch.float32:  # the fused weight gradient and unembedding with tokens
                    y = patchgemm.patch_embed(x, w, b, out_format="tokens")
                    grads = torch.autograd.grad(y, [w, b], torch.randn_like(y))
                    grid = [s // k for s, k in zip(shape[2:], kernel)]
                    u = patchgemm.patch_unembed(y.detach(), w, bias_out, in_format="tokens", grid=grid)
                    assert all(torch.isfinite(t).all() for t in (*grads, u))
    # the tiny unembedding from 384 and 512 input channels (one block per SM), channels-first rows in
    # 8-byte pieces (N = 196, 36: a partial last slice)
    for c_in, grid, kernel, c_out in [(384, (14, 14), (4, 4), 4), (512, (2, 18), (2, 2), 16)]:
        x = torch.randn(3, c_in, *grid, dtype=torch.bfloat16, device="cuda")
        w = torch.randn(c_in, c_out, *kernel, dtype=torch.bfloat16, device="cuda")
        u = patchgemm.patch_unembed(x, w, torch.randn(c_out, dtype=torch.bfloat16, device="cuda"))
        assert torch.isfinite(u).all()
    # the implicit-GEMM embedding (16-bit, kw even; its wgmma and mma.sync kernels on a 9.0 GPU): runs
    # of 2, 4 and 8, partial tiles, padded K; its weight gradient (kw = 2 on mma.sync; on wgmma kw = 2
    # pairs and kw % 4 = 0 runs of 8 or 4, with the bias gradient: grad_y in pieces of 8 or 4 tokens (N =
    # 12), over many token ranges (3 x 8 x 40^3), or as one range writing dW itself (K = 3072)); and with
    # kw = 2 (kw = 4 on wgmma) the unembedding (its
    # input gradient; with a bias below), over more tiles than SMs (its wgmma kernel is persistent);
    # tokens out with patch rows of 16-128 bytes by TMA (ViT-B/16-like over more tiles than SMs), and
    # their weight gradients with the patches by TMA (kw = 16, 32, 64; several token ranges, and two unequal
    # ones for 72 tiles on 132 SMs; 3 and 4 slots);
    # kw = 2 channels-first out with a slice's patches by one TMA box (32-, 16- and 8-patch grid rows),
    # and the kw = 2 unembedding storing pair boxes by TMA (K = 192)
    for dtype, wgmma in [(torch.bfloat16, True), (torch.float16, True), (torch.bfloat16, False)]:
        with selection(rules=False, exclude=() if wgmma else WGMMA):
            for shape, kernel, embed in [((2, 32, 4, 8, 8), (2, 2, 2), 192), ((2, 5, 6, 12, 18), (1, 3, 2), 37),
                                         ((3, 3, 48, 80), (16, 16), 96), ((2, 24, 8, 8, 8), (4, 4, 4), 200),
                                         ((3, 16, 2, 6, 8), (2, 2, 2), 64), ((3, 9, 6, 10, 20), (2, 2, 2), 64),
                                         ((3, 8, 20, 40, 40), (2, 2, 2), 64), ((3, 3, 48, 64), (16, 16), 96),
                                         ((3, 8, 40, 40, 40), (4, 4, 4), 64), ((2, 48, 16, 16, 16), (4, 4, 4), 384),
                                         ((2, 16, 8, 32, 64), (2, 8, 8), 192), ((4, 32, 32, 32, 32), (2, 2, 2), 200),
                                         ((40, 3, 224, 224), (16, 16), 768), ((2, 5, 64, 96), (4, 32), 320),
                                         ((2, 3, 4, 256), (2, 64), 64), ((6, 16, 8, 64, 64), (2, 2, 2), 192),
                                         ((2, 32, 32, 16), (2, 2), 64), ((2, 24, 8, 64, 64), (2, 2, 2), 64),
                                         ((5, 6, 224, 400), (16, 16), 1408)]:
                x = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
                w = torch.randn(embed, shape[1], *kernel, dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(embed, dtype=dtype, device="cuda", requires_grad=True)
                for out_format in ("channels_first", "tokens"):
                    y = patchgemm.patch_embed(x, w, b, out_format=out_format)
                    grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
                    grid = [s // k for s, k in zip(shape[2:], kernel)]
                    u = patchgemm.patch_unembed(y.detach(), w.detach(), torch.randn(shape[1], dtype=dtype, device="cuda"),
                                                in_format=out_format, grid=grid)
                    assert all(torch.isfinite(t).all() for t in (y, *grads, u))
            x = torch.randn(2, 32, 4, 8, 8, dtype=dtype, device="cuda")  # a weight gradient without bias
            w = torch.randn(192, 32, 2, 2, 2, dtype=dtype, device="cuda", requires_grad=True)
            y = patchgemm.patch_embed(x, w)
            assert torch.isfinite(torch.autograd.grad(y, [w], torch.randn_like(y))[0]).all()
    # batch one with long patches: a thin, long channels-first GEMM that cuBLAS runs split-K, its K
    # not a whole number of K tiles (the split-K guard's second call); a long weight-gradient reduction
    for dtype in (torch.bfloat16, torch.float16):
        for shape, kernel, embed, memory in [((1, 192, 96, 28), (16, 7), 8, "contiguous"),
                                             ((1, 192, 14, 56), (7, 14), 256, "channels_last")]:
            x = torch.randn(shape, dtype=dtype, device="cuda")
            if memory == "channels_last":
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            w = torch.randn(embed, shape[1], *kernel, dtype=dtype, device="cuda", requires_grad=True)
            b = torch.randn(embed, dtype=dtype, device="cuda", requires_grad=True)
            y = patchgemm.patch_embed(x, w, b)
            grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
            assert all(torch.isfinite(t).all() for t in (y, *grads))
        x = torch.randn(21512, 1, 8, dtype=dtype, device="cuda", requires_grad=True)
        w = torch.randn(1, 24, 8, dtype=dtype, device="cuda", requires_grad=True)
        y = patchgemm.grouped_linear(x, w)
        assert torch.isfinite(torch.autograd.grad(y, [w], torch.randn_like(y))[0]).all()
    # fused instance norm + GELU: both layouts, vector and one-element paths, several chunks
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for shape in [(2, 16, 8, 8, 8), (2, 5, 7, 9), (1, 8, 20000)]:
            for layout in ("channels_first", "tokens"):
                x = torch.randn(shape, dtype=dtype, device="cuda")
                if layout == "tokens":
                    x = x.flatten(2).transpose(1, 2).contiguous()
                x.requires_grad_()
                w = torch.randn(shape[1], dtype=dtype, device="cuda", requires_grad=True)
                b = torch.randn(shape[1], dtype=dtype, device="cuda", requires_grad=True)
                y = patchgemm.instance_norm_act(x, w, b, layout=layout)
                grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
                assert all(torch.isfinite(t).all() for t in (y, *grads))
    stem = patchgemm.HierarchicalPatchEmbed(3, 16, [2, 2], device="cuda")
    head = patchgemm.HierarchicalPatchUnembed(16, 3, [2, 2], device="cuda")
    z = head(stem(torch.randn(2, 3, 8, 8, 8, device="cuda")))
    torch.autograd.grad(z.sum(), list(stem.parameters()) + list(head.parameters()))
    # swiglu (vector and scalar paths) and ragged grouped linear (every candidate, empty groups)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        for shape in ((5, 3, 64), (7, 10)):
            gate_up = torch.randn(shape, dtype=dtype, device="cuda", requires_grad=True)
            h = patchgemm.swiglu(gate_up)
            (grad,) = torch.autograd.grad(h, gate_up, torch.randn_like(h))
            assert torch.isfinite(h).all() and torch.isfinite(grad).all()
    ragged = ("ragged_grouped_linear", "ragged_grouped_linear_grad_input", "ragged_grouped_linear_grad_weight")
    for dtype, impls in ((torch.bfloat16, ("aten_grouped_mm", "cublas_grouped", "ragged_mma", "ragged_tiles", "loop")),
                         (torch.float32, ("cublas_grouped", "ragged_tiles", "loop")),
                         (torch.float64, ("ragged_tiles",))):
        for impl in impls:
            x = torch.randn(40, 32, dtype=dtype, device="cuda", requires_grad=True)
            w = torch.randn(4, 48, 32, dtype=dtype, device="cuda", requires_grad=True)
            b = torch.randn(4, 48, dtype=dtype, device="cuda", requires_grad=True)
            with patchgemm.force(**{op: impl for op in ragged}):
                y = patchgemm.grouped_linear(x, w, b, group_sizes=[17, 0, 22, 1])
                grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
            assert all(torch.isfinite(t).all() for t in (y, *grads))
    # the device kernels' block-wide scan over two chunks of 256 groups, sizes on the GPU, a third empty
    sizes = torch.randint(0, 40, (300,), generator=torch.Generator().manual_seed(0))
    sizes[::3] = 0
    for impl in ("ragged_tiles", "ragged_mma"):
        x = torch.randn(int(sizes.sum()), 24, device="cuda", dtype=torch.float16, requires_grad=True)
        w = torch.randn(300, 20, 24, device="cuda", dtype=torch.float16, requires_grad=True)
        with patchgemm.force(**{op: impl for op in ragged}):
            y = patchgemm.grouped_linear(x, w, group_sizes=sizes.cuda())
            grads = torch.autograd.grad(y, [x, w], torch.randn_like(y))
        assert all(torch.isfinite(t).all() for t in (y, *grads))
    # grouped pointwise conv: channels-first (per-sample GEMMs, fp32 weight-gradient sums) and tokens
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((3, 12, 37), (2, 12, 5, 7)):
            x = torch.randn(shape, dtype=dtype, device="cuda")
            if len(shape) == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            x.requires_grad_()
            w = torch.randn(8, 3, *(1,) * (len(shape) - 2), dtype=dtype, device="cuda", requires_grad=True)
            b = torch.randn(8, dtype=dtype, device="cuda", requires_grad=True)
            y = patchgemm.grouped_pointwise_conv(x, w, b, groups=4)
            grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
            assert all(torch.isfinite(t).all() for t in (y, *grads))
    # the small-group kernels: ragged position tiles, dead warps, a block meeting a second group
    pointwise_ops = ("grouped_pointwise_conv", "grouped_pointwise_conv_grad_input", "grouped_pointwise_conv_grad_weight")
    with patchgemm.force(**dict.fromkeys(pointwise_ops, "small_groups")):
        for batch, groups, c_in, c_out, length in ((2, 5, 100, 100, 136), (3, 3, 128, 33, 1000), (1, 2, 3, 128, 8), (2, 3, 64, 48, 384)):
            x = torch.randn(batch, groups * c_in, length, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            w = torch.randn(groups * c_out, c_in, 1, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            b = torch.randn(groups * c_out, dtype=torch.bfloat16, device="cuda", requires_grad=True)
            y = patchgemm.grouped_pointwise_conv(x, w, b, groups=groups)
            grads = torch.autograd.grad(y, [x, w, b], torch.randn_like(y))
            assert all(torch.isfinite(t).all() for t in (y, *grads))
    # ... and its fp32 (TF32) apply, forward and input gradient
    torch.backends.cudnn.allow_tf32 = True
    with patchgemm.force(**dict.fromkeys(pointwise_ops[:2], "small_groups")):
        for batch, groups, c_in, c_out, length in ((2, 5, 100, 100, 136), (1, 2, 3, 128, 8), (2, 3, 64, 48, 384)):
            x = torch.randn(batch, groups * c_in, length, device="cuda", requires_grad=True)
            w = torch.randn(groups * c_out, c_in, 1, device="cuda")
            y = patchgemm.grouped_pointwise_conv(x, w, torch.randn(groups * c_out, device="cuda"), groups=groups)
            (grad_x,) = torch.autograd.grad(y, [x], torch.randn_like(y))
            assert all(torch.isfinite(t).all() for t in (y, grad_x))
    torch.cuda.synchronize()
    print("sanitize_smoke: ok")


def run_forced(case, inputs, op, name) -> bool:
    """case's forward + backward with candidate `name` forced for `op`; False where it declines."""
    try:
        with patchgemm.force(**forcing(op, name)), patchgemm.explain() as explained:
            outputs = case.run(inputs)
    except RuntimeError as e:
        if does_not_apply(e):
            return False
        raise
    if not chose(explained, op, name):
        return False
    assert all(torch.isfinite(t).all() for t in outputs), f"{op}={name} on {case}"
    print(f"  {op}={name} on {case}", flush=True)  # progress, should a run be cut short
    return True


def main_at_scale(families, once=False):
    """families: names of CASES, each alone (every op of the family) or as family:op (one op).
    once: each candidate on one case only, the family's smallest it applies to (every case is
    multi-wave; racecheck, the slowest tool, finishes so)."""
    runs = 0
    for item in families:
        family, _, only = item.partition(":")
        ops = [only] if only else FAMILY_OPS[family]
        if once:
            inputs = [case.make("cuda") for case in CASES[family]]
            sizes = [sum(t.numel() for t in made.values()) for made in inputs]
            order = sorted(range(len(inputs)), key=sizes.__getitem__)
            for op in ops:
                for name in our_candidates(op):
                    ran = any(run_forced(CASES[family][i], inputs[i], op, name) for i in order)
                    runs += ran
                    if not ran:
                        print(f"  {op}={name}: applies to no {family} case", flush=True)
        else:
            for case in CASES[family]:
                inputs = case.make("cuda")
                for op in ops:
                    runs += sum(run_forced(case, inputs, op, name) for name in our_candidates(op))
        del inputs
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    print(f"sanitize_smoke --scale: ok ({runs} runs)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--scale" in args:
        families = [a for a in args if a not in ("--scale", "--once")] or list(CASES)
        known = list(CASES) + [f"{family}:{op}" for family in CASES for op in FAMILY_OPS[family]]
        unknown = set(families) - set(known)
        if unknown:
            sys.exit(f"sanitize_smoke: unknown families {sorted(unknown)}; known: {known}")
        main_at_scale(families, once="--once" in args)
    else:
        main()
