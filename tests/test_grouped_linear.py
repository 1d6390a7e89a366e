import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import patchgemm
from conftest import DEVICES, DTYPES, assert_close_to_ref, capture_cuda_graph, needs_gpu, poison_allocator, randn

ops = torch.ops.patchgemm


def reference(x, weight, bias, layout):
    """A float64 loop of F.linear over the groups, in x's layout (differentiable)."""
    x, weight = x.double().cpu(), weight.double().cpu()
    bias = None if bias is None else bias.double().cpu()
    groups = weight.shape[0]
    b = lambda g: None if bias is None else bias[g]  # noqa: E731
    if layout == "gbd":
        return torch.stack([F.linear(x[g], weight[g], b(g)) for g in range(groups)], 0)
    xv = x.view(-1, groups, x.shape[-1]) if x.dim() == 2 else x
    out = torch.stack([F.linear(xv[..., g, :], weight[g], b(g)) for g in range(groups)], dim=-2)
    return out.reshape(*x.shape[:-1], weight.shape[1])


def x_shape(kind, layout, batch, groups, din):
    if kind == "flat":
        return (batch * groups, din) if layout == "bgd" else (groups, din)
    if kind == "3d":
        return (batch, groups, din) if layout == "bgd" else (groups, batch, din)
    return (2, batch, groups, din) if layout == "bgd" else (groups, 2, batch, din)


def make_x(shape, strides, dtype, device):
    """x of `shape` laid out in memory as `strides` says."""
    if strides == "contiguous":
        return randn(*shape, dtype=dtype, device=device)
    if strides == "padded":  # rows longer than Din: expressible through ld, no copy
        return randn(*shape[:-1], shape[-1] + 3, dtype=dtype, device=device)[..., : shape[-1]]
    if strides == "every_other":  # features 2 apart: no BLAS layout, one copy
        return randn(*shape[:-1], 2 * shape[-1], dtype=dtype, device=device)[..., ::2]
    if strides == "features_outer":  # Din outermost in memory: transposed operand
        return randn(shape[-1], *shape[:-1], dtype=dtype, device=device).movedim(0, -1)
    raise AssertionError(strides)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("kind", ["flat", "3d", "4d"])
@pytest.mark.parametrize("strides", ["contiguous", "padded", "every_other", "features_outer"])
def test_forward_matches_float64_loop(device, dtype, layout, has_bias, kind, strides):
    groups, batch, din, dout = 3, 5, 12, 7
    x = make_x(x_shape(kind, layout, batch, groups, din), strides, dtype, device)
    weight = randn(groups, dout, din, dtype=dtype, device=device)
    bias = randn(groups, dout, dtype=dtype, device=device) if has_bias else None
    poison_allocator(x.numel() // din * dout * x.element_size(), device)
    y = patchgemm.grouped_linear(x, weight, bias, layout)
    assert y.dtype == dtype and y.device == x.device
    assert_close_to_ref(y, reference(x, weight, bias, layout), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("kind", ["flat", "4d"])
def test_gradients_match_float64_loop(device, dtype, layout, has_bias, kind):
    groups, batch, din, dout = 4, 6, 10, 9
    x = randn(*x_shape(kind, layout, batch, groups, din), dtype=dtype, device=device, requires_grad=True)
    weight = randn(groups, dout, din, dtype=dtype, device=device, requires_grad=True)
    bias = randn(groups, dout, dtype=dtype, device=device, requires_grad=True) if has_bias else None
    inputs = [x, weight] + ([bias] if has_bias else [])
    y = patchgemm.grouped_linear(x, weight, bias, layout)
    grad_y = randn(*y.shape, dtype=dtype, device=device)
    grads = torch.autograd.grad(y, inputs, grad_y)

    ref_inputs = [t.detach().double().cpu().requires_grad_() for t in inputs]
    ref_y = reference(ref_inputs[0], ref_inputs[1], ref_inputs[2] if has_bias else None, layout)
    ref_grads = torch.autograd.grad(ref_y, ref_inputs, grad_y.double().cpu())
    for name, g, rg in zip(["dx", "dweight", "dbias"], grads, ref_grads):
        assert_close_to_ref(g, rg, dtype, name)


def test_backward_skips_unneeded_gradients():
    x = randn(5, 3, 4, dtype=torch.float64)  # no grad: the first layer of a network
    weight = randn(3, 2, 4, dtype=torch.float64, requires_grad=True)
    y = patchgemm.grouped_linear(x, weight)
    (gw,) = torch.autograd.grad(y, [weight], torch.ones_like(y))
    assert_close_to_ref(gw, torch.einsum("bgo,bgi->goi", torch.ones(5, 3, 2, dtype=torch.float64), x),
                        torch.float64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
def test_bias_gradient_of_a_batch_of_one_is_grad_y(device, dtype, layout):
    """A batch of one sums nothing: the bias gradient is grad_y's values (as ATen's sum_to returns
    them for bmm + bias), exactly, through the op's autograd and through functorch's."""
    x = randn(*((1, 3, 4) if layout == "bgd" else (3, 1, 4)), dtype=dtype, device=device)
    weight = randn(3, 5, 4, dtype=dtype, device=device, requires_grad=True)
    bias = randn(3, 5, dtype=dtype, device=device, requires_grad=True)
    gy = randn(*((1, 3, 5) if layout == "bgd" else (3, 1, 5)), dtype=dtype, device=device)
    expected = gy.squeeze(0 if layout == "bgd" else 1)
    (gb,) = torch.autograd.grad(patchgemm.grouped_linear(x, weight, bias, layout=layout), [bias], gy)
    assert gb.shape == bias.shape and gb.is_contiguous() and torch.equal(gb, expected)
    vjp = torch.func.vjp(lambda b: patchgemm.grouped_linear(x, weight, b, layout=layout), bias)[1]
    assert torch.equal(vjp(gy)[0], expected)


@pytest.mark.parametrize("layout", ["bgd", "gbd"])
@pytest.mark.parametrize("has_bias", [True, False])
def test_gradcheck_float64(layout, has_bias):
    x = randn(4, 3, 5, dtype=torch.float64, requires_grad=True)
    weight = randn(3 if layout == "bgd" else 4, 2, 5, dtype=torch.float64, requires_grad=True)
    bias = randn(weight.shape[0], 2, dtype=torch.float64, requires_grad=True) if has_bias else None
    inputs = (x, weight, bias) if has_bias else (x, weight)
    assert torch.autograd.gradcheck(
        lambda *t: patchgemm.grouped_linear(t[0], t[1], t[2] if has_bias else None, layout), inputs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_major", [False, True])
def test_opcheck(device, group_major):
    x = randn(6, 3, 5, device=device, requires_grad=True)
    if group_major:
        x = randn(3, 6, 5, device=device, requires_grad=True)
    weight = randn(3, 4, 5, device=device, requires_grad=True)
    bias = randn(3, 4, device=device, requires_grad=True)
    grad_y = randn(*x.shape[:2], 4, device=device)
    torch.library.opcheck(ops.grouped_linear.default, (x, weight, bias, group_major))
    torch.library.opcheck(ops.grouped_linear.default, (x, weight, None, group_major))
    torch.library.opcheck(ops.grouped_linear_grad_input.default, (grad_y, weight.detach(), group_major))
    torch.library.opcheck(ops.grouped_linear_grad_weight.default, (grad_y, x.detach(), group_major))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_no_graph_break(device):
    torch.manual_seed(0)
    model = nn.Sequential(
        patchgemm.GroupedLinear(4, 8, 16), nn.GELU(), patchgemm.GroupedLinear(4, 16, 8, layout="bgd")
    ).to(device)
    compiled = torch.compile(model, fullgraph=True)
    x = randn(2, 5, 4, 8, device=device, requires_grad=True)
    out_eager = model(x)
    (gx_eager,) = torch.autograd.grad(out_eager.sum(), [x])
    out = compiled(x)
    (gx,) = torch.autograd.grad(out.sum(), [x])
    torch.testing.assert_close(out, out_eager)
    torch.testing.assert_close(gx, gx_eager)


@settings(max_examples=60, deadline=None)
@given(
    groups=st.integers(1, 5), batch=st.integers(0, 7), din=st.integers(0, 9), dout=st.integers(1, 9),
    layout=st.sampled_from(["bgd", "gbd"]), has_bias=st.booleans(), seed=st.integers(0, 2**31 - 1),
)
def test_random_shapes(groups, batch, din, dout, layout, has_bias, seed):
    torch.manual_seed(seed)
    for device in DEVICES:
        dtype = torch.float64
        shape = (batch, groups, din) if layout == "bgd" else (groups, batch, din)
        x = randn(*shape, dtype=dtype, device=device, requires_grad=True)
        weight = randn(groups, dout, din, dtype=dtype, device=device, requires_grad=True)
        bias = randn(groups, dout, dtype=dtype, device=device, requires_grad=True) if has_bias else None
        y = patchgemm.grouped_linear(x, weight, bias, layout)
        assert_close_to_ref(y, reference(x, weight, bias, layout), dtype)
        inputs = [x, weight] + ([bias] if has_bias else [])
        grads = torch.autograd.grad(y, inputs, torch.randn_like(y))
        for t, g in zip(inputs, grads):
            assert g.shape == t.shape and torch.isfinite(g).all()


# ---- edge sizes ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch(device):
    x = randn(0, 3, 4, device=device, requires_grad=True)
    weight = randn(3, 5, 4, device=device, requires_grad=True)
    y = patchgemm.grouped_linear(x, weight, randn(3, 5, device=device))
    assert y.shape == (0, 3, 5)
    gx, gw = torch.autograd.grad(y, [x, weight], torch.ones_like(y))
    assert gx.shape == x.shape and gw.shape == weight.shape and (gw == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("has_bias", [True, False])
def test_zero_input_features_gives_bias(device, has_bias):
    x = randn(4, 3, 0, device=device, requires_grad=True)
    weight = randn(3, 5, 0, device=device, requires_grad=True)
    bias = randn(3, 5, device=device) if has_bias else None
    poison_allocator(4 * 3 * 5 * 4, device)
    y = patchgemm.grouped_linear(x, weight, bias)
    expected = bias.expand(4, 3, 5) if has_bias else torch.zeros(4, 3, 5, device=device)
    torch.testing.assert_close(y, expected)
    gx, gw = torch.autograd.grad(y, [x, weight], torch.ones_like(y))
    assert gx.shape == (4, 3, 0) and gw.shape == (3, 5, 0)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_groups(device):
    y = patchgemm.grouped_linear(randn(4, 0, 3, device=device), randn(0, 5, 3, device=device))
    assert y.shape == (4, 0, 5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group_major", [False, True])
def test_planner_splits_at_blas_int_limit(device, group_major):
    """Sizes past the BLAS integer limit are split into several calls (limit lowered for the test)."""
    groups, batch, din, dout = (8, 5, 4, 3) if group_major else (2, 9, 3, 3)
    layout = "gbd" if group_major else "bgd"
    shape = (groups, batch, din) if group_major else (batch, groups, din)
    x = randn(*shape, dtype=torch.float64, device=device, requires_grad=True)
    weight = randn(groups, dout, din, dtype=torch.float64, device=device, requires_grad=True)
    bias = randn(groups, dout, dtype=torch.float64, device=device, requires_grad=True)
    old = ops._set_blas_int_limit(5 if group_major else 6)
    try:
        y = patchgemm.grouped_linear(x, weight, bias, layout)
        grads = torch.autograd.grad(y, [x, weight, bias], torch.ones_like(y))
    finally:
        ops._set_blas_int_limit(old)
    assert_close_to_ref(y, reference(x, weight, bias, layout), torch.float64)
    ref_inputs = [t.detach().cpu().requires_grad_() for t in (x, weight, bias)]
    ref_y = reference(*ref_inputs, layout)
    ref_grads = torch.autograd.grad(ref_y, ref_inputs, torch.ones_like(ref_y))
    for name, g, rg in zip(["dx", "dweight", "dbias"], grads, ref_grads):
        assert_close_to_ref(g, rg, torch.float64, name)


def applicable(op, device):
    return [c.name for c in patchgemm.kernels(op) if device in c.backends]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
@pytest.mark.parametrize("batch, din, dout", [(1, 64, 48), (5, 1, 48), (5, 64, 1), (1, 1, 1)])
def test_vector_sized_gemms_match_float64_with_every_candidate(device, dtype, layout, batch, din, dout):
    """A GEMM dimension of 1 (batch one: K = 1 in the weight gradient; Din or Dout of 1) gives each
    operand a column or row form; every candidate of the three passes agrees with float64."""
    groups = 3
    x = randn(*x_shape("3d", layout, batch, groups, din), dtype=dtype, device=device, requires_grad=True)
    weight = randn(groups, dout, din, dtype=dtype, device=device, requires_grad=True)
    bias = randn(groups, dout, dtype=dtype, device=device, requires_grad=True)
    ref_inputs = [t.detach().double().cpu().requires_grad_() for t in (x, weight, bias)]
    ref_y = reference(*ref_inputs, layout)
    grad_y = randn(*ref_y.shape, dtype=dtype, device=device)
    ref_grads = torch.autograd.grad(ref_y, ref_inputs, grad_y.double().cpu())
    passes = ["grouped_linear", "grouped_linear_grad_input", "grouped_linear_grad_weight"]
    ran = []
    for name in applicable("grouped_linear", device):
        try:
            with patchgemm.force(**{op: name for op in passes}):
                y = patchgemm.grouped_linear(x, weight, bias, layout)
                grads = torch.autograd.grad(y, [x, weight, bias], grad_y)
        except RuntimeError as e:  # cuBLASLt may propose fewer algorithms than the k-th
            assert name.startswith("cublaslt_algo") and "does not apply" in str(e), f"{name}: {e}"
            continue
        ran.append(name)
        assert_close_to_ref(y, ref_y, dtype, f"{name} y")
        for what, g, rg in zip(["dx", "dweight", "dbias"], grads, ref_grads):
            assert_close_to_ref(g, rg, dtype, f"{name} {what}")
    assert {"strided_batched", "aten_bmm"} <= set(ran)


@pytest.mark.parametrize("device", DEVICES)
def test_column_past_the_blas_int_limit_is_split(device):
    """A K = 1 column longer than the BLAS integer limit keeps the row form, split along its length."""
    grad_y, x = randn(1, 2, 5, dtype=torch.float64, device=device), randn(1, 2, 2, dtype=torch.float64, device=device)
    old = ops._set_blas_int_limit(3)
    try:
        grad_w = ops.grouped_linear_grad_weight(grad_y, x, False)
    finally:
        ops._set_blas_int_limit(old)
    torch.testing.assert_close(grad_w, torch.einsum("bgo,bgi->goi", grad_y, x))


def test_leading_dimension_past_limit_is_a_clear_error():
    old = ops._set_blas_int_limit(4)
    try:
        with pytest.raises(RuntimeError, match="leading dimension"):
            patchgemm.grouped_linear(randn(3, 2, 5), randn(2, 3, 5))
    finally:
        ops._set_blas_int_limit(old)


# ---- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: (randn(4, 3, 5), randn(3, 2, 5), None, "bdg"), ValueError, "layout must be one of"),
        (lambda: (randn(4, 3, 5), randn(2, 5), None, "bgd"), RuntimeError, r"weight must be \[G, Dout, Din\]"),
        (lambda: (randn(4, 3, 5), randn(2, 2, 5), None, "bgd"), RuntimeError, r"x has 3 groups .* weight has 2"),
        (lambda: (randn(4, 3, 5), randn(3, 2, 6), None, "bgd"), RuntimeError, r"5 features per group .* expects 6"),
        (lambda: (randn(4, 3, 5), randn(3, 2, 5), randn(3, 4), "bgd"), RuntimeError, r"bias must be \[G, Dout\] = \[3, 2\]"),
        (lambda: (randn(4, 3, 5), randn(3, 2, 5), randn(6), "bgd"), RuntimeError, r"bias must be 2-D"),
        (lambda: (randn(4, 3, 5), randn(3, 2, 5, dtype=torch.float64), None, "bgd"), RuntimeError, "dtype"),
        (lambda: (randn(4, 3, 5), randn(3, 2, 5), randn(3, 2, dtype=torch.float16), "bgd"), RuntimeError, "dtype"),
        (lambda: (torch.ones(4, 3, 5, dtype=torch.int64), torch.ones(3, 2, 5, dtype=torch.int64), None, "bgd"),
         RuntimeError, "must be float32, float16, bfloat16 or float64"),
        (lambda: (randn(7, 5), randn(3, 2, 5), None, "bgd"), RuntimeError, "multiple of G=3"),
        (lambda: (randn(5), randn(3, 2, 5), None, "bgd"), RuntimeError, r"x must be \[\.\.\., G, Din\]"),
        (lambda: (randn(5), randn(3, 2, 5), None, "gbd"), RuntimeError, r"x must be \[G, \.\.\., Din\]"),
    ],
)
def test_bad_input_is_a_clear_error(make, error, match):
    x, weight, bias, layout = make()
    with pytest.raises(error, match=match):
        patchgemm.grouped_linear(x, weight, bias, layout)


@needs_gpu
def test_device_mismatch_is_a_clear_error():
    with pytest.raises(RuntimeError, match="is on"):
        patchgemm.grouped_linear(randn(4, 3, 5, device="cuda"), randn(3, 2, 5))


# ---- module --------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bgd", "gbd"])
def test_module_matches_modulelist_of_linears(layout):
    torch.manual_seed(0)
    linears = nn.ModuleList(nn.Linear(6, 4, dtype=torch.float64) for _ in range(3))
    grouped = patchgemm.GroupedLinear.from_linears(linears, layout=layout)
    x = randn(5, 3, 6, dtype=torch.float64, requires_grad=True)
    xl = x if layout == "bgd" else x.transpose(0, 1)
    y = grouped(xl)
    y = y if layout == "bgd" else y.transpose(0, 1)
    y_ref = torch.stack([linears[g](x[:, g]) for g in range(3)], dim=1)
    torch.testing.assert_close(y, y_ref)
    dy = torch.randn_like(y)
    g = torch.autograd.grad(y, [x, grouped.weight, grouped.bias], dy)
    g_ref = torch.autograd.grad(y_ref, [x] + [l.weight for l in linears] + [l.bias for l in linears], dy)
    torch.testing.assert_close(g[0], g_ref[0])
    torch.testing.assert_close(g[1], torch.stack(g_ref[1:4]))
    torch.testing.assert_close(g[2], torch.stack(g_ref[4:7]))
    back = grouped.to_linears()
    for l, b in zip(linears, back):
        torch.testing.assert_close(l.weight, b.weight)
        torch.testing.assert_close(l.bias, b.bias)


def test_module_init_and_repr():
    m = patchgemm.GroupedLinear(8, 64, 32)
    bound = 1 / math.sqrt(64)
    assert m.weight.shape == (8, 32, 64) and m.bias.shape == (8, 32)
    assert m.weight.abs().max() <= bound and m.bias.abs().max() <= bound
    assert m.weight.std() > bound / 3  # uniform(-b, b) has std b/sqrt(3)
    assert set(m.state_dict()) == {"weight", "bias"}
    assert repr(m) == "GroupedLinear(num_groups=8, in_features=64, out_features=32, bias=True, layout='bgd')"
    assert patchgemm.GroupedLinear(2, 3, 4, bias=False).bias is None


def test_from_linears_rejects_mismatched_linears():
    with pytest.raises(ValueError, match="linears\\[1\\] is 4->3"):
        patchgemm.GroupedLinear.from_linears([nn.Linear(4, 2), nn.Linear(4, 3)])
    with pytest.raises(ValueError, match="all linears have a bias or none"):
        patchgemm.GroupedLinear.from_linears([nn.Linear(4, 2), nn.Linear(4, 2, bias=False)])
    with pytest.raises(ValueError, match="layout"):
        patchgemm.GroupedLinear(2, 3, 4, layout="xyz")


# ---- autocast ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_behaves_like_linear(device, dtype):
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("CPU autocast is bfloat16")
    m = patchgemm.GroupedLinear(3, 8, 4).to(device)
    x = randn(5, 3, 8, device=device)
    with torch.autocast(device, dtype=dtype):
        y = m(x)
        y_ref = F.linear(x[:, 0], m.weight[0], m.bias[0])
    assert y.dtype == y_ref.dtype == dtype
    assert_close_to_ref(y, reference(x, m.weight, m.bias, "bgd"), dtype)


# ---- CUDA-only properties ------------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
@pytest.mark.parametrize("kind", ["flat", "3d"])
def test_cuda_forward_allocates_only_the_output(layout, kind):
    groups, batch, din, dout = 4, 256, 128, 64  # sizes that are whole allocator blocks
    x = randn(*x_shape(kind, layout, batch, groups, din), dtype=torch.bfloat16, device="cuda")
    weight = randn(groups, dout, din, dtype=torch.bfloat16, device="cuda")
    patchgemm.grouped_linear(x, weight, None, layout)  # warm up handles and workspaces
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = patchgemm.grouped_linear(x, weight, None, layout)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before == y.numel() * y.element_size()


@needs_gpu
@pytest.mark.parametrize("has_bias", [True, False])
def test_cuda_graph_capture_and_replay(has_bias):
    groups, batch, din, dout = 3, 64, 32, 48
    x = randn(batch, groups, din, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    weight = randn(groups, dout, din, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    bias = randn(groups, dout, dtype=torch.bfloat16, device="cuda", requires_grad=True) if has_bias else None
    grad_y = randn(batch, groups, dout, dtype=torch.bfloat16, device="cuda")
    inputs = [x, weight] + ([bias] if has_bias else [])

    def step():
        y = patchgemm.grouped_linear(x, weight, bias)
        return (y, *torch.autograd.grad(y, inputs, grad_y))

    graph, outs = capture_cuda_graph(step)
    with torch.no_grad():
        for t in inputs:
            t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_to_ref(outs[0], reference(x, weight, bias, "bgd"), torch.bfloat16)


@needs_gpu
def test_cuda_fp32_respects_allow_tf32():
    x = randn(512, 4, 1024, device="cuda")
    weight = randn(4, 256, 1024, device="cuda")
    ref = reference(x, weight, None, "bgd")
    torch.backends.cuda.matmul.allow_tf32 = False
    assert_close_to_ref(patchgemm.grouped_linear(x, weight), ref, torch.float32)  # 2e-6: not TF32
    torch.backends.cuda.matmul.allow_tf32 = True
    y = patchgemm.grouped_linear(x, weight)
    err = ((y.double().cpu() - ref).norm() / ref.norm()).item()
    assert err < 5e-3


@needs_gpu
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_cuda_bias_epilogue_with_misaligned_pointers(offset):
    groups, batch, din, dout = 3, 40, 24, 16
    storage = randn(groups * dout + offset, dtype=torch.bfloat16, device="cuda")
    bias = storage[offset:].view(groups, dout)
    xs = randn(batch * groups * din + offset, dtype=torch.bfloat16, device="cuda")
    x = xs[offset:].view(batch, groups, din)
    weight = randn(groups, dout, din, dtype=torch.bfloat16, device="cuda")
    y = patchgemm.grouped_linear(x, weight, bias)
    assert_close_to_ref(y, reference(x, weight, bias, "bgd"), torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_g1_like_shape(dtype):
    """A scaled-down BENCHMARKS G1 (x[B, 12, 1024] -> 3072), forward and gradients."""
    x = randn(256, 12, 1024, dtype=dtype, device="cuda", requires_grad=True)
    weight = (randn(12, 3072, 1024, device="cuda") / 32).to(dtype).requires_grad_()
    bias = randn(12, 3072, dtype=dtype, device="cuda", requires_grad=True)
    y = patchgemm.grouped_linear(x, weight, bias)
    assert_close_to_ref(y, reference(x, weight, bias, "bgd"), dtype)
    dy = randn(*y.shape, dtype=dtype, device="cuda")
    gx, gw, gb = torch.autograd.grad(y, [x, weight, bias], dy)
    x64, w64, dy64 = x.detach().double(), weight.detach().double(), dy.double()
    assert_close_to_ref(gx, torch.einsum("bgo,goi->bgi", dy64, w64), dtype, "dx")
    assert_close_to_ref(gw, torch.einsum("bgo,bgi->goi", dy64, x64), dtype, "dweight")
    assert_close_to_ref(gb, dy64.sum(0), dtype, "dbias")


# Long reductions whose length is not a whole number of cuBLAS K tiles (64 16-bit values): cuBLAS's
# split-K kernels may sum only the whole tiles (kernels/gemm/strided_gemm.h, SplitKGuard). The weight
# gradient reduces over the batch; the forward over Din.
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("batch, din, dout", [(7106, 64, 64), (21512, 8, 24), (38408, 24, 8), (38416, 8, 8),
                                              (3, 21512, 8), (24, 38408, 64)])
def test_long_reductions_keep_their_tail(dtype, batch, din, dout):
    x = randn(batch, 1, din, dtype=dtype, device="cuda", requires_grad=True)
    w = randn(1, dout, din, dtype=dtype, device="cuda", requires_grad=True)
    b = randn(1, dout, dtype=dtype, device="cuda", requires_grad=True)
    y = patchgemm.grouped_linear(x, w, b)
    gy = randn(*y.shape, dtype=dtype, device="cuda")
    gx, gw, gb = torch.autograd.grad(y, [x, w, b], gy)
    x64, w64, b64 = (t.detach().double().cpu().requires_grad_() for t in (x, w, b))
    ref = reference(x64, w64, b64, "bgd")
    rx, rw, rb = torch.autograd.grad(ref, [x64, w64, b64], gy.double().cpu())
    for name, out, expected in [("y", y, ref), ("grad_x", gx, rx), ("grad_weight", gw, rw), ("grad_bias", gb, rb)]:
        assert_close_to_ref(out, expected, dtype, name)
