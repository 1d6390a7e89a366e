"""instance_norm_act: InstanceNorm (+ affine) + GELU fused, both layouts, against PyTorch in float64."""

import math

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from conftest import DEVICES, DTYPES, assert_close_to_ref, poison_allocator, randn

ops = torch.ops.patchgemm

# (x shape as channels-first [B, C, *spatial]): 1-D/2-D/3-D; odd spatial sizes and channel counts
# (the kernels' one-element path); one spatial element; a channel longer than one chunk of the
# CUDA reduction (16384 elements); more channels than one block of the tokens reduction covers.
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 1e-2}
SHAPES = [(2, 8, 16), (3, 5, 7, 9), (2, 16, 4, 4, 4), (2, 24, 1), (1, 8, 160, 130), (2, 3, 5), (1, 2064, 3)]


def reference(x_cf, weight, bias, eps, act):
    """The definition in float64 on channels-first x (F.instance_norm refuses one spatial element;
    test_matches_torch_instance_norm checks the two agree)."""
    x = x_cf.double()
    dims = list(range(2, x.dim()))
    var, mean = torch.var_mean(x, dim=dims, keepdim=True, correction=0)
    y = (x - mean) * torch.rsqrt(var + eps)
    shape = (1, -1) + (1,) * len(dims)
    if weight is not None:
        y = y * weight.double().view(shape)
    if bias is not None:
        y = y + bias.double().view(shape)
    return F.gelu(y) if act == "gelu" else y


def test_matches_torch_instance_norm():
    x, w, b = inputs((2, 8, 5, 6), torch.float64, "cpu")
    ref = F.gelu(F.instance_norm(x, weight=w, bias=b, eps=1e-3))
    assert_close_to_ref(patchgemm.instance_norm_act(x, w, b, eps=1e-3), ref, torch.float64)
    assert_close_to_ref(reference(x, w, b, 1e-3, "gelu"), ref, torch.float64)


def to_layout(x_cf, layout):
    return x_cf.flatten(2).transpose(1, 2).contiguous() if layout == "tokens" else x_cf


def from_layout(t, x_cf, layout):
    return t.transpose(1, 2).reshape(x_cf.shape) if layout == "tokens" else t


def inputs(shape, dtype, device, affine=True, offset=0.0):
    x = (randn(*shape, dtype=torch.float64) * 2 + offset).to(device=device, dtype=dtype)
    if not affine:
        return x, None, None
    return x, randn(shape[1], dtype=dtype, device=device), randn(shape[1], dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", ["channels_first", "tokens"])
def test_forward_backward_match_pytorch(device, dtype, shape, layout):
    x_cf, w, b = inputs(shape, dtype, device)
    x = to_layout(x_cf, layout).requires_grad_()
    w.requires_grad_()
    b.requires_grad_()
    poison_allocator(x.numel() * x.element_size(), device)
    y = patchgemm.instance_norm_act(x, w, b, layout=layout)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()

    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x_cf, w, b))
    ref = reference(x64, w64, b64, 1e-5, "gelu")
    assert_close_to_ref(from_layout(y, x_cf, layout), ref, dtype)

    dy_cf = randn(*shape, dtype=torch.float64, device=device)
    got = torch.autograd.grad(y, [x, w, b], to_layout(dy_cf, layout).to(dtype))
    want = torch.autograd.grad(ref, [x64, w64, b64], dy_cf)
    # The gradients also carry dy's rounding to `dtype` and sums over whole channels.
    tol = GRAD_TOL[dtype]
    if math.prod(shape[2:]) == 1:
        # One element per channel: grad_x is exactly 0, as the difference of two equal terms of
        # size |dy| * weight / sqrt(eps) that the kernels may round one ulp apart.
        scale = dy_cf.abs().max().item() * w.abs().max().item() / math.sqrt(1e-5)
        assert got[0].abs().max().item() <= 1e-5 * scale, "grad_x of one-element channels"
    else:
        # A channel of a few values (shape (1, 2064, 3)) may be nearly constant, which scales up the
        # error of any implementation: the bound is then twice PyTorch's own on the same inputs.
        x_t, w_t, b_t = (t.detach().clone().requires_grad_() for t in (x_cf, w, b))
        torch_dx = torch.autograd.grad(F.gelu(F.instance_norm(x_t, weight=w_t, bias=b_t, eps=1e-5)), x_t,
                                       dy_cf.to(dtype))[0]
        torch_err = ((torch_dx.double() - want[0]).norm() / want[0].norm()).item()
        assert_close_to_ref(from_layout(got[0], x_cf, layout), want[0], dtype, "grad_x", max(tol, 2 * torch_err))
    assert_close_to_ref(got[1], want[1], dtype, "grad_weight", tol)
    assert_close_to_ref(got[2], want[2], dtype, "grad_bias", tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("act", ["gelu", None])
def test_no_affine_no_act(device, affine, act):
    x, w, b = inputs((2, 16, 6, 10), torch.float32, device, affine=affine)
    for layout in ("channels_first", "tokens"):
        xl = to_layout(x, layout).requires_grad_()
        y = patchgemm.instance_norm_act(xl, w, b, act=act, layout=layout)
        ref_x = x.double().requires_grad_()
        ref = reference(ref_x, w, b, 1e-5, act)
        assert_close_to_ref(from_layout(y, x, layout), ref, torch.float32)
        dy = randn(*x.shape, dtype=torch.float64, device=device)
        (g,) = torch.autograd.grad(y, [xl], to_layout(dy, layout).float())
        (r,) = torch.autograd.grad(ref, [ref_x], dy)
        assert_close_to_ref(from_layout(g, x, layout), r, torch.float32, "grad_x")


@pytest.mark.parametrize("device", DEVICES)
def test_large_mean_keeps_variance(device):
    """Channels far from zero: float32 statistics must not cancel (the kernels shift by a sample)."""
    x, w, b = inputs((2, 8, 64, 64), torch.float32, device, offset=1000.0)
    for layout in ("channels_first", "tokens"):
        y = patchgemm.instance_norm_act(to_layout(x, layout), w, b, act=None, layout=layout)
        assert_close_to_ref(from_layout(y, x, layout), reference(x, w, b, 1e-5, None), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck(device):
    x, w, b = inputs((2, 3, 4, 5), torch.float64, device)
    for layout in ("channels_first", "tokens"):
        args = tuple(t.clone().requires_grad_() for t in (to_layout(x, layout), w, b))
        assert torch.autograd.gradcheck(lambda x, w, b: patchgemm.instance_norm_act(x, w, b, layout=layout), args)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, w, b = inputs((2, 8, 4, 6), torch.float32, device)
    for tokens in (False, True):
        xl = to_layout(x, "tokens" if tokens else "channels_first").requires_grad_()
        torch.library.opcheck(ops.instance_norm_act, (xl, w.requires_grad_(), b, 1e-5, True, tokens))
        torch.library.opcheck(ops.instance_norm_act, (xl, None, None, 1e-3, False, tokens))
        y, mean, rstd = ops.instance_norm_act(xl.detach(), w.detach(), b, 1e-5, True, tokens)
        torch.library.opcheck(ops.instance_norm_act_backward, (torch.randn_like(y), xl.detach(), w.detach(), b, mean, rstd, True, tokens))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()
    x, w, b = inputs((2, 8, 4, 6), torch.float32, device)
    w.requires_grad_()

    def f(x):
        return patchgemm.instance_norm_act(x, w, b).square().sum()

    xr = x.clone().requires_grad_()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(xr)
    torch.testing.assert_close(out, f(x))
    g = torch.autograd.grad(out, [xr, w])
    g_ref = torch.autograd.grad(f(x.clone().requires_grad_()), [w])
    torch.testing.assert_close(g[1], g_ref[0])


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device):
    x = torch.empty(0, 4, 3, 3, device=device)
    assert patchgemm.instance_norm_act(x).shape == x.shape
    y = patchgemm.instance_norm_act(torch.empty(2, 0, 8, device=device, requires_grad=True))
    y.sum().backward()


def test_bad_input():
    x = torch.randn(2, 4, 8)
    with pytest.raises(RuntimeError, match=r"weight must be \[4\].*got shape \[3\]"):
        patchgemm.instance_norm_act(x, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"bias has dtype.*x has dtype"):
        ops.instance_norm_act(x, None, torch.ones(4, dtype=torch.float64), 1e-5, True, False)
    with pytest.raises(RuntimeError, match=r"at least one spatial dim.*\[2, 4\]"):
        patchgemm.instance_norm_act(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"tokens \[B, N, C\].*\[2, 4, 8, 8\]"):
        patchgemm.instance_norm_act(torch.randn(2, 4, 8, 8), layout="tokens")
    with pytest.raises(RuntimeError, match="eps must be finite"):
        patchgemm.instance_norm_act(x, eps=-1.0)
    with pytest.raises(RuntimeError, match="must be float32"):
        patchgemm.instance_norm_act(torch.ones(2, 4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="act must be"):
        patchgemm.instance_norm_act(x, act="relu")
    with pytest.raises(ValueError, match="layout must be"):
        patchgemm.instance_norm_act(x, layout="nchw")


def test_cpu_runs_atens_batch_norm_except_on_few_positions():
    """The CPU's path is ATen's own batch norm (as F.instance_norm runs), forward and backward; a
    channel of under 16 positions goes to the float64 composite (batch norm's folded affine loses
    digits on near-constant channels)."""
    for spatial, chosen in ((64, "aten_batch_norm"), (3, "aten_composite")):
        x = randn(2, 8, spatial, requires_grad=True)
        w, b = randn(8, requires_grad=True), randn(8, requires_grad=True)
        with patchgemm.explain() as report:
            y = patchgemm.instance_norm_act(x, w, b)
            y.backward(torch.ones_like(y))
        lines = [line for line in str(report).splitlines() if line.startswith("instance_norm_act")]
        assert len(lines) == 2 and all(line.split(" -> ")[1].startswith(chosen) for line in lines), lines
