"""patch_embed / patch_unembed against float64 convolutions: values, gradients, formats,
strides, sizes, bad input, compile; long patches."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchgemm
from conftest import (DEVICES, DTYPES, assert_close_to_ref, fused_mode, needs_gpu,
                      poison_allocator, randn)
from patch_cases import CONV, CONV_T, SHAPES, conv_tokens, grads, layout, make

ops = torch.ops.patchgemm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,kernel", SHAPES)
@pytest.mark.parametrize("out_format", ["channels_first", "tokens", "channels_last"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_patch_embed_matches_float64_conv(device, dtype, shape, kernel, out_format, has_bias):
    x, w, b = make(shape, kernel, dtype, device, bias=has_bias)
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_()
    poison_allocator(x.numel() * 8, device)
    y = patchgemm.patch_embed(x, w, b, out_format=out_format)
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    b64 = None if b is None else b.detach().double().cpu().requires_grad_()
    ref = CONV[len(kernel)](x64, w64, b64, stride=kernel)
    ref = conv_tokens(ref) if out_format == "tokens" else ref
    assert y.dtype == dtype
    # channels_last: the conv's shape over the token matrix, so flattening to tokens is free
    assert (y.flatten(2).transpose(1, 2) if out_format == "channels_last" else y).is_contiguous()
    assert_close_to_ref(y, ref, dtype)
    grad_y = randn(*ref.shape, dtype=dtype).double()  # the values the op sees, exactly
    got = grads(y, [x, w, b], grad_y.to(device, dtype))
    want = grads(ref, [x64, w64, b64], grad_y)
    bias_terms = grad_y.abs().sum([d for d in range(grad_y.dim()) if d != 1])  # (the bias gradient's sum's)
    for g, r, name in zip(got, want, ["grad_x", "grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name, magnitude=bias_terms if name == "grad_bias" else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape,kernel", [s for s in SHAPES if len(s[1]) > 1])
@pytest.mark.parametrize("memory", ["channels_last", "every_other"])
def test_patch_embed_any_input_strides(device, dtype, shape, kernel, memory):
    x, w, b = make(shape, kernel, dtype, device)
    xs = layout(x, memory).requires_grad_()
    for out_format in ("channels_first", "tokens"):
        y = patchgemm.patch_embed(xs, w, b, out_format=out_format)
        ref = CONV[len(kernel)](x.double().cpu(), w.double().cpu(), b.double().cpu(), stride=kernel)
        assert_close_to_ref(y, conv_tokens(ref) if out_format == "tokens" else ref, dtype)
        (gx,) = torch.autograd.grad(y, [xs], torch.ones_like(y))
        x64 = x.detach().double().cpu().requires_grad_()
        r = CONV[len(kernel)](x64, w.double().cpu(), b.double().cpu(), stride=kernel)
        assert_close_to_ref(gx, torch.autograd.grad(r, [x64], torch.ones_like(r))[0], dtype, "grad_x")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,kernel", SHAPES)
@pytest.mark.parametrize("in_format", ["channels_first", "tokens"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_patch_unembed_matches_float64_conv_transpose(device, dtype, shape, kernel, in_format, has_bias):
    grid = [s // k for s, k in zip(shape[2:], kernel)]
    c_in, c_out = 6, shape[1]
    x = randn(shape[0], c_in, *grid, dtype=dtype, device=device, requires_grad=True)
    w = (randn(c_in, c_out, *kernel, dtype=dtype, device=device) / math.sqrt(c_in)).requires_grad_()
    b = randn(c_out, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    inp = conv_tokens(x) if in_format == "tokens" else x
    poison_allocator(math.prod(shape) * 8, device)
    y = patchgemm.patch_unembed(inp, w, b, in_format=in_format, grid=grid)
    x64, w64 = x.detach().double().cpu().requires_grad_(), w.detach().double().cpu().requires_grad_()
    b64 = None if b is None else b.detach().double().cpu().requires_grad_()
    ref = CONV_T[len(kernel)](x64, w64, b64, stride=kernel)
    assert y.is_contiguous()
    assert_close_to_ref(y, ref, dtype)
    grad_y = randn(*ref.shape, dtype=dtype).double()  # the values the op sees, exactly
    got = grads(y, [x, w, b], grad_y.to(device, dtype))
    want = grads(ref, [x64, w64, b64], grad_y)
    bias_terms = grad_y.abs().sum([d for d in range(grad_y.dim()) if d != 1])  # (the bias gradient's sum's)
    for g, r, name in zip(got, want, ["grad_x", "grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, name, magnitude=bias_terms if name == "grad_bias" else None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, c_out, grid, kernel", [
    (1, 3, (14, 14), (4, 4)),    # a batch of one: one sum of the rows
    (1, 2, (64, 64), (4, 4)),    # a batch of one, few long rows: cut into pieces first
    (3, 3, (14, 14), (4, 4)),    # rows summed, then the batch
    (1, 1, (8,), (2,)),
])
def test_patch_unembed_bias_gradient(device, dtype, batch, c_out, grid, kernel):
    """The bias gradient of an unembedding is grad_y summed over all but its channels, accumulated in
    fp32 and rounded once, whichever way the sum is cut; repeated calls give the same bits."""
    c_in = 8
    x = randn(batch, c_in, *grid, dtype=dtype, device=device)
    w = randn(c_in, c_out, *kernel, dtype=dtype, device=device) / math.sqrt(c_in)
    b = randn(c_out, dtype=dtype, device=device, requires_grad=True)
    grad_y = randn(batch, c_out, *[g * k for g, k in zip(grid, kernel)], dtype=dtype, device=device)
    got = [torch.autograd.grad(patchgemm.patch_unembed(x, w, b), [b], grad_y)[0] for _ in range(2)]
    assert got[0].dtype == dtype and got[0].shape == (c_out,)
    assert torch.equal(got[0], got[1])
    dims = [d for d in range(grad_y.dim()) if d != 1]
    want = grad_y.double().sum(dims)
    assert_close_to_ref(got[0], want, dtype, "grad_bias", magnitude=grad_y.double().abs().sum(dims))


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    x, w, b = make((2, 3, 4, 6), (2, 3), torch.float64, device, embed=4)
    for t in (x, w, b):
        t.requires_grad_()
    for out_format in ("channels_first", "tokens"):
        assert torch.autograd.gradcheck(lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format=out_format), (x, w, b))
    xt = randn(2, 4, 2, 2, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: patchgemm.patch_unembed(x, w, b[:3]), (xt, w, b))
    assert torch.autograd.gradcheck(
        lambda x, w, b: patchgemm.patch_unembed(conv_tokens(x), w, b[:3], in_format="tokens", grid=(2, 2)), (xt, w, b))
    # A hierarchical token order (levels): grid 2x2 of 2x2 groups.
    xl = randn(2, 3, 8, 12, dtype=torch.float64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: ops.patch_embed(x, w, b, True, [2, 2, 2, 2]), (xl, w, b))


def test_backward_skips_grad_input_when_not_needed():
    """The first layer of a network: x needs no gradient, so patch_unembed (dx) must not run."""
    x, w, b = make((2, 3, 8, 8), (4, 4), torch.float32, "cpu")
    w.requires_grad_()
    b.requires_grad_()
    with patchgemm.explain() as e:
        patchgemm.patch_embed(x, w, b).sum().backward()
    ops_run = [c.op for c in e]
    assert ops_run == ["patch_embed", "patch_weight_grad"], str(e)
    assert w.grad is not None and b.grad is not None


@pytest.mark.parametrize("device", DEVICES)
def test_levels_order_tokens_patch_major(device):
    """levels=[grid..., k2...] lists tokens so every k2 x k2 group of patches is contiguous rows."""
    x, w, b = make((2, 3, 8, 12), (2, 2), torch.float64, device)
    y = ops.patch_embed(x, w, b, True, [2, 3, 2, 2])
    ref = CONV[2](x, w, b, stride=2)  # [2, 5, 4, 6] -> rows (gh, gw, ih, iw), nh = gh*2 + ih
    ref = ref.view(2, 5, 2, 2, 3, 2).permute(0, 2, 4, 3, 5, 1).reshape(2, 24, 5)
    assert_close_to_ref(y, ref, torch.float64)
    back = ops.patch_unembed(y, w, None, True, [2, 3, 2, 2])
    assert_close_to_ref(back, CONV_T[2](CONV[2](x, w, b, stride=2), w, None, stride=2), torch.float64)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, w, b = make((2, 3, 4, 6), (2, 3), torch.float32, device, embed=4)
    w.requires_grad_()
    b.requires_grad_()
    xr = x.clone().requires_grad_()
    for tokens in (False, True):
        torch.library.opcheck(ops.patch_embed, (xr, w, b, tokens, []))
        y = ops.patch_embed(x, w, b, tokens, []).detach()  # a grad_y: not differentiable itself
        torch.library.opcheck(ops.patch_weight_grad, (y, x, [2, 3], tokens, [], True))
    xt = randn(2, 4, 2, 2, device=device, requires_grad=True)
    torch.library.opcheck(ops.patch_unembed, (xt, w, b[:3], False, []))
    # patch_unembed's weight and bias gradients (transposed: the roles of x and grad_y swapped).
    dy = randn(2, 3, 4, 6, device=device)
    torch.library.opcheck(ops.patch_weight_grad, (xt.detach(), dy, [2, 3], False, [], True, True))
    torch.library.opcheck(ops.patch_unembed, (conv_tokens(xt).detach().requires_grad_(), w, b[:3], True, [2, 2]))
    torch.library.opcheck(ops.patch_embed, (randn(2, 3, 8, 12, device=device), w, b, True, [2, 2, 2, 2]))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    torch._dynamo.reset()
    embed = patchgemm.PatchEmbed(3, 8, (2, 4), out_format="tokens", device=device)
    unembed = patchgemm.PatchUnembed(8, 3, (2, 4), in_format="tokens", grid=(4, 3), device=device)

    def model(x):
        return unembed(embed(x).relu())

    x = randn(2, 3, 8, 12, device=device, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    y, y_ref = compiled(x), model(x)
    torch.testing.assert_close(y, y_ref)
    g = torch.autograd.grad(y.square().sum(), [x, embed.weight])
    g_ref = torch.autograd.grad(y_ref.square().sum(), [x, embed.weight])
    for a, r in zip(g, g_ref):
        torch.testing.assert_close(a, r)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [0, 1])
def test_degenerate_sizes(device, batch):
    x, w, b = make((batch, 3, 8, 8), (4, 4), torch.float32, device)
    y = patchgemm.patch_embed(x, w, b)
    ref = CONV[2](x.double(), w.double(), b.double(), stride=4)
    assert y.shape == ref.shape
    if batch:
        assert_close_to_ref(y, ref, torch.float32)
    w.requires_grad_()
    y = patchgemm.patch_embed(x, w, b, out_format="tokens")
    (gw,) = torch.autograd.grad(y.sum(), [w])
    assert gw.shape == w.shape and (batch or gw.abs().sum() == 0)
    u = patchgemm.patch_unembed(ref.float(), w.detach(), None)
    assert u.shape == (batch, 3, 8, 8)
    # No input channels: conv sums nothing, y is the bias.
    y0 = patchgemm.patch_embed(randn(2, 0, 4, 4, device=device), randn(5, 0, 2, 2, device=device), b)
    torch.testing.assert_close(y0, b.view(1, 5, 1, 1).expand(2, 5, 2, 2))


@pytest.mark.parametrize("device", DEVICES)
def test_dynamic_pad(device):
    x, w, b = make((2, 3, 10, 13), (4, 4), torch.float64, device)
    y = patchgemm.patch_embed(x, w, b, pad="dynamic")
    ref = CONV[2](F.pad(x, (0, 3, 0, 2)), w, b, stride=4)
    assert_close_to_ref(y, ref, torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape,kernel", [((2, 512, 199), (2,)), ((2, 3, 10, 13), (4, 4)), ((1, 4, 9, 8, 11), (2, 2, 4))])
@pytest.mark.parametrize("kind", ["contiguous", "channels_last"])
@pytest.mark.parametrize("out_format", ["channels_first", "tokens"])
def test_sizes_the_patch_does_not_divide_are_cropped_as_the_conv_does(device, shape, kernel, kind, out_format):
    """A kernel == stride conv leaves out the last positions that fill no whole patch (wav2vec 2.0's
    k = 2 convs over odd lengths): so do patch_embed and PatchEmbed, values and gradients."""
    x, w, b = make(shape, kernel, torch.float64, device)
    x = layout(x, kind).requires_grad_()
    w.requires_grad_(), b.requires_grad_()
    g = randn(*conv_tokens(CONV[len(kernel)](x.detach(), w.detach(), stride=kernel)).shape, dtype=torch.float64,
              device=device)
    y = patchgemm.patch_embed(x, w, b, out_format=out_format)
    ref = conv_tokens(CONV[len(kernel)](x, w, b, stride=kernel))
    grad_y = g if out_format == "tokens" else g.transpose(1, 2).reshape(y.shape)
    ref_grads = grads(ref, (x, w, b), g)
    assert_close_to_ref(y if out_format == "tokens" else conv_tokens(y), ref, torch.float64)
    for got, want in zip(grads(y, (x, w, b), grad_y), ref_grads):
        assert_close_to_ref(got, want, torch.float64)
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[len(kernel)](shape[1], 5, kernel, kernel, device=device,
                                                                    dtype=torch.float64)
    torch.testing.assert_close(patchgemm.PatchEmbed.from_conv(conv)(x), conv(x))
    with torch.inference_mode():  # the op itself, below autograd
        torch.testing.assert_close(patchgemm.PatchEmbed.from_conv(conv)(x), conv(x))
    # under torch.func: the Python autograd path
    _, vjp = torch.func.vjp(lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format=out_format), x, w, b)
    for got, want in zip(vjp(grad_y), ref_grads):
        assert_close_to_ref(got, want, torch.float64)
    with pytest.raises(RuntimeError, match=r"smaller than one patch"):  # as the conv, which raises too
        patchgemm.patch_embed(x.narrow(2, 0, kernel[0] - 1), w, b)


def test_unbatched_input():
    x, w, b = make((1, 3, 8, 8), (4, 4), torch.float64, "cpu")
    y = patchgemm.patch_embed(x[0], w, b)
    assert_close_to_ref(y, CONV[2](x[0], w, b, stride=4), torch.float64)
    u = patchgemm.patch_unembed(y, w, b[:3])
    assert_close_to_ref(u, CONV_T[2](y, w, b[:3], stride=4), torch.float64)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda x, w, b: patchgemm.patch_embed(x[0, 0], w, b), r"x must be \[B, C, \*S\]"),
        (lambda x, w, b: patchgemm.patch_embed(x, w[0, 0], b), r"weight must be \[E, C, \*kernel\]"),
        (lambda x, w, b: patchgemm.patch_embed(x[:, :2], w, b), r"x has 2 channels .* expects 3"),
        (lambda x, w, b: patchgemm.patch_embed(x, w, b[:4]), r"bias must be \[5\]"),
        (lambda x, w, b: patchgemm.patch_embed(x.double(), w, b), r"x has dtype Double but weight has dtype Float"),
        (lambda x, w, b: patchgemm.patch_embed(x.int(), w, b), r"x must be float32"),
        (lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format="nhwc"), r"out_format must be one of"),
        (lambda x, w, b: patchgemm.patch_unembed(x, w, None, in_format="tokens"), r"needs grid"),
        (lambda x, w, b: patchgemm.patch_unembed(torch.zeros(2, 5, 5), w, None, in_format="tokens", grid=(2, 2)),
         r"x has 5 tokens .* grid \[2, 2\] has 4"),
        (lambda x, w, b: patchgemm.patch_unembed(torch.zeros(2, 4, 2, 2), w, None), r"x must be \[B, 5, \*grid\]"),
        (lambda x, w, b: ops.patch_embed(x, w, b, True, [2, 2, 2]), r"levels must hold 1 to 4 groups of 2"),
        (lambda x, w, b: ops.patch_embed(x, w, b, True, [2, 1, 2, 1]), r"multiply to grid \[4, 1\] .* grid is \[4, 4\]"),
        (lambda x, w, b: ops.patch_embed(x, w, b, False, [4, 4]), r"levels .* need tokens output"),
    ],
)
def test_bad_input_errors(call, message):
    x, w, b = make((2, 3, 8, 8), (2, 2), torch.float32, "cpu")
    with pytest.raises((RuntimeError, ValueError), match=message):
        call(x, w, b)


@needs_gpu
def test_device_mismatch_error():
    x, w, b = make((2, 3, 8, 8), (2, 2), torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"x is on cpu but weight is on cuda"):
        patchgemm.patch_embed(x, w.cuda(), b.cuda())



# ---- memory format: channels-last in, channels-last out (as PyTorch's convolutions) -----------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,kernel", [((2, 6, 8, 12), (2, 4)), ((2, 5, 4, 6, 8), (2, 3, 2)),
                                          ((3, 4, 6, 6), (6, 6)), ((2, 8, 16, 16), (2, 2))])
@pytest.mark.parametrize("force", [None, "aten"])
def test_channels_last_in_channels_last_out(device, dtype, shape, kernel, force):
    """A channels-last x gives a channels-last output (the GEMM's tokens-major output itself) and
    channels-last gradients from channels-last upstream gradients, on every path."""
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x, w, b = make(shape, kernel, dtype, device, embed=16)
    xs = x.contiguous(memory_format=fmt).requires_grad_()
    ws, bs = w.clone().requires_grad_(), b.clone().requires_grad_()
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    chosen = {"patch_embed": "aten_conv", "patch_unembed": "aten_conv_transpose",
              "patch_weight_grad": "aten_conv_backward"} if force else {}
    if force and device == "cpu" and dtype in (torch.float16, torch.bfloat16):
        del chosen["patch_embed"]  # never offered there (torch's 16-bit CPU convolution is wrong for some x)
    with patchgemm.force(**chosen), patchgemm.explain() as e:
        y = patchgemm.patch_embed(xs, ws, bs)
        ref = CONV[len(kernel)](x64, w64, b64, stride=kernel)
        assert y.is_contiguous(memory_format=fmt)
        assert_close_to_ref(y, ref, dtype)
        dy = randn(*y.shape, dtype=dtype, device=device).contiguous(memory_format=fmt)
        got = torch.autograd.grad(y, [xs, ws, bs], dy)
        want = torch.autograd.grad(ref, [x64, w64, b64], dy.double())
        if math.prod(y.shape[2:]) > 1:  # a grid of one patch: dy's format is ambiguous
            assert got[0].is_contiguous(memory_format=fmt)
        for g, r in zip(got, want):
            assert_close_to_ref(g, r, dtype)
        # The raw weight gradient is channels-last, as aten.convolution_backward's: a channels-last
        # weight takes it without a copy.
        grad_w, _ = torch.ops.patchgemm.patch_weight_grad(dy, xs.detach(), list(kernel), False, [], False, False)
        assert grad_w.is_contiguous(memory_format=fmt)
        assert_close_to_ref(grad_w, want[1], dtype)
        # The transpose: channels-last input, channels-last output.
        wt = randn(shape[1], 3, *kernel, dtype=dtype, device=device).requires_grad_()
        u = patchgemm.patch_unembed(xs, wt, bs[:3])
        wt64 = wt.detach().double().requires_grad_()
        u_ref = CONV_T[len(kernel)](x64, wt64, b64[:3], stride=kernel)
        assert u.is_contiguous(memory_format=fmt)
        assert_close_to_ref(u, u_ref, dtype)
        du = randn(*u.shape, dtype=dtype, device=device).contiguous(memory_format=fmt)
        got = torch.autograd.grad(u, [xs, wt], du)
        want = torch.autograd.grad(u_ref, [x64, wt64], du.double())
        for g, r in zip(got, want):
            assert_close_to_ref(g, r, dtype)
    if force:
        assert {c.chosen for c in e if c.op in chosen} <= set(chosen.values())
    for op, args in [("patch_embed", (xs.detach(), w, b, False, [])), ("patch_unembed", (xs.detach(), wt.detach(), None, False, [])),
                     ("patch_weight_grad", (dy, xs.detach(), list(kernel), False, [], True, False))]:
        torch.library.opcheck(getattr(torch.ops.patchgemm, op).default, args)



# Batch one with long patches (K = C * prod(k) in the tens of thousands): the channels-first GEMM is
# thin and long, which cuBLAS runs split-K, and a K that is not a whole number of its K tiles must
# keep its tail (the bias rides in the patch matrix's last columns). The fp16 row reduces 7,106
# tokens for the weight gradient.
@needs_gpu
@pytest.mark.parametrize("mode", ["auto", "never"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape, kernel, embed, memory", [
    ((1, 192, 96, 28), (16, 7), 8, "contiguous"),
    ((1, 192, 14, 56), (7, 14), 256, "channels_last"),
    ((1, 96, 96, 28), (16, 7), 8, "contiguous"),
    ((1, 384, 16, 16, 48), (8, 8, 8), 512, "contiguous"),
    ((17, 4, 304, 352), (16, 16), 64, "contiguous"),
])
def test_long_patches_match_float64(mode, dtype, shape, kernel, embed, memory):
    x, w, b = (t.double().requires_grad_() for t in make(shape, kernel, dtype, "cpu", embed=embed))
    ref = CONV[len(kernel)](x, w, b, stride=kernel)
    gy = randn(*ref.shape, dtype=dtype).double()
    ref_grads = torch.autograd.grad(ref, [x, w, b], gy)
    xd = layout(x.detach().to("cuda", dtype), memory).requires_grad_()
    wd, bd = (t.detach().to("cuda", dtype).requires_grad_() for t in (w, b))
    with fused_mode(mode):
        y = patchgemm.patch_embed(xd, wd, bd)
        grads = torch.autograd.grad(y, [xd, wd, bd], gy.to("cuda", dtype))
    for name, out, expected in zip(["y", "grad_x", "grad_weight", "grad_bias"], (y, *grads), (ref, *ref_grads)):
        assert_close_to_ref(out, expected, dtype, name, tol=1e-5 if dtype == torch.float32 else None)


def _rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["patch_embed", "patch_embed_wide", "patch_unembed"])
def test_long_16bit_reductions_sum_in_fp32_like_the_conv(case, dtype):
    """A long reduction into few output tiles, where cuBLAS splits K: torch's matmul flag (on by
    default) lets a matmul round the partial sums to 16 bits, 4-5x the error; the conv's cuDNN sums in
    fp32. Every candidate standing in for the conv that runs must be as accurate (within 2x). The
    wide case fills a wave of small tiles, which cuBLASLt writes directly (kernels/gemm/gemm.cpp)."""
    flags = torch.backends.cuda.matmul
    old = flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = flags.allow_fp16_reduced_precision_reduction = True
    op = "patch_unembed" if case == "patch_unembed" else "patch_embed"
    try:
        if case == "patch_embed":  # 6144 values per patch into 8 tokens x 33 features
            x, w, b, k = randn(1, 96, 64, 8), randn(33, 96, 16, 4) / 80, randn(33), (16, 4)
            conv = lambda x, w, b: F.conv2d(x, w, b, stride=k)  # noqa: E731
            ours = lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format="tokens")  # noqa: E731
            to_ours = lambda y: y.flatten(2).transpose(1, 2)  # noqa: E731
        elif case == "patch_embed_wide":  # a UNETR stem: 4096 values per patch into 432 tokens x 768
            x, w, b, k = randn(2, 1, 96, 96, 96), randn(768, 1, 16, 16, 16) / 64, randn(768), (16, 16, 16)
            conv = lambda x, w, b: F.conv3d(x, w, b, stride=k)  # noqa: E731
            ours = lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format="tokens")  # noqa: E731
            to_ours = lambda y: y.flatten(2).transpose(1, 2)  # noqa: E731
        else:  # 4096 channels into 8 tokens x 3 * 4 * 4 values
            x, w, b, k = randn(1, 4096, 2, 4), randn(4096, 3, 4, 4) / 64, randn(3), (4, 4)
            conv = lambda x, w, b: F.conv_transpose2d(x, w, b, stride=k)  # noqa: E731
            ours = lambda x, w, b: patchgemm.patch_unembed(x, w, b)  # noqa: E731
            to_ours = lambda y: y  # noqa: E731
        ref = to_ours(conv(x, w, b))
        args = [t.to("cuda", dtype) for t in (x, w, b)]
        conv_err = _rel_err(to_ours(conv(*args)).cpu(), ref)
        ran = []
        for name in {c.name for c in patchgemm.kernels(op)}:
            try:
                with patchgemm.force(**{op: name}):
                    y = ours(*args)
            except RuntimeError as err:
                assert "does not apply" in str(err), err
                continue
            err = _rel_err(y.cpu(), ref)
            assert err <= 2 * conv_err, f"{name}: relative error {err:.3g}, the conv's {conv_err:.3g}"
            ran.append(name)
        assert "gather_gemm" in ran or "gemm_scatter" in ran, ran
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = old


@needs_gpu
def test_small_long_16bit_token_embeds_stay_on_a_gemm_where_linear_steps_aside():
    """A small 16-bit embedding writing tokens runs as ATen's copy + linear, except where linear may
    round split-K sums to 16 bits (a long reduction into few tiles): the gather + GEMM then, whose
    sums stay in fp32, not cuDNN's conv, up to 30x slower there (a ViT-style stem at batch 2)."""
    flags = torch.backends.cuda.matmul
    old = flags.allow_bf16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = True
    try:
        x, w, b = (t.to("cuda", torch.bfloat16) for t in (randn(2, 3, 96, 96), randn(768, 3, 32, 32), randn(768)))
        with patchgemm.explain() as e:
            patchgemm.patch_embed(x, w, b, out_format="tokens")
        (c,) = [c for c in e if c.op == "patch_embed"]
        assert c.chosen == "gather_gemm", str(e)
    finally:
        flags.allow_bf16_reduced_precision_reduction = old
