"""swiglu and grouped_mlp: values and gradients against float64 references, every implementation
of the swiglu tables, gradcheck, opcheck, torch.compile, modules, memory, bad input."""

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from conftest import DEVICES, DTYPES, assert_close_to_ref, needs_gpu, poison_allocator, randn

ops = torch.ops.patchgemm
SWIGLU_IMPLS = ["fused", "aten_composite"]


def swiglu_reference(gate_up):
    gate, up = gate_up.double().cpu().chunk(2, -1)
    return F.silu(gate) * up


def mlp_reference(x, w_gate_up, w_down, b_gate_up, b_down, layout):
    """A float64 loop over the groups of Linear -> SiLU * up -> Linear (differentiable)."""
    x, w_gate_up, w_down = (t.double().cpu() for t in (x, w_gate_up, w_down))
    b_gate_up, b_down = (None if t is None else t.double().cpu() for t in (b_gate_up, b_down))
    groups, hidden = w_gate_up.shape[0], w_down.shape[2]
    outs = []
    for g in range(groups):
        xg = x[g] if layout == "gbd" else x[..., g, :]
        bg = lambda b, rows: None if b is None else b[g, rows]  # noqa: E731
        gate = F.linear(xg, w_gate_up[g, :hidden], bg(b_gate_up, slice(0, hidden)))
        up = F.linear(xg, w_gate_up[g, hidden:], bg(b_gate_up, slice(hidden, None)))
        outs.append(F.linear(F.silu(gate) * up, w_down[g], None if b_down is None else b_down[g]))
    return torch.stack(outs, 0 if layout == "gbd" else -2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", SWIGLU_IMPLS)
@pytest.mark.parametrize("shape", [(5, 3, 16), (7, 10), (1, 2), (4, 0, 6), (3, 34)])
def test_swiglu_every_impl_matches_float64(device, dtype, impl, shape):
    gate_up = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    grad_h = randn(*shape[:-1], shape[-1] // 2, dtype=dtype, device=device)
    poison_allocator(gate_up.numel() * gate_up.element_size(), device)
    with patchgemm.force(swiglu=impl, swiglu_backward=impl):
        h = patchgemm.swiglu(gate_up)
        (grad,) = torch.autograd.grad(h, gate_up, grad_h)
    ref_in = gate_up.detach().double().cpu().requires_grad_(True)
    ref = swiglu_reference(ref_in)
    (ref_grad,) = torch.autograd.grad(ref, ref_in, grad_h.double().cpu())
    assert h.dtype == dtype and h.is_contiguous()
    assert_close_to_ref(h, ref, dtype, "h")
    assert_close_to_ref(grad, ref_grad, dtype, "grad_gate_up")


def magnitudes(rows, hidden, dtype, seed):
    """gate_up [rows, 2 * hidden] with random signs and log-uniform magnitudes from 1e-4 to 120: the
    exp's range reduction, its underflow (gate < -88: e^-gate is inf) and the plain middle."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.empty(rows, 2 * hidden, dtype=torch.float64).uniform_(-9.2, 4.8, generator=g))
    sign = torch.randint(0, 2, (rows, 2 * hidden), generator=g) * 2 - 1
    return (mag * sign).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_cpu_fused_is_right_elementwise_at_every_magnitude(dtype):
    """The CPU fused loops (an exp of their own, vectorized) against float64 value by value: rows of
    1027 (not a multiple of the block or of a vector), enough rows for several threads; NaN and the
    infinities give what ATen's silu gives; repeated calls are bitwise equal."""
    rows, hidden = 67, 1027
    gate_up = magnitudes(rows, hidden, dtype, seed=1)
    gate_up[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0], dtype=dtype)
    grad_h = magnitudes(rows, hidden, dtype, seed=2)[:, :hidden].clamp(-4, 4)
    rtol = {torch.float32: 3e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    # A denormal's rounding; and below gate = -88.7, where e^-gate overflows float, h is -0 as ATen's
    # silu gives (exactly, below 1e-36 * up).
    atol = max(torch.finfo(dtype).tiny * torch.finfo(dtype).eps, 1e-30)
    with patchgemm.force(swiglu="fused", swiglu_backward="fused"):
        h = ops.swiglu(gate_up)
        grad = ops.swiglu_backward(grad_h, gate_up)
        for again, first in ((ops.swiglu(gate_up), h), (ops.swiglu_backward(grad_h, gate_up), grad)):
            torch.testing.assert_close(again, first, rtol=0, atol=0, equal_nan=True)
    ref_h = swiglu_reference(gate_up).to(dtype)
    torch.testing.assert_close(h, ref_h, rtol=rtol, atol=atol, equal_nan=True)
    finite = gate_up.isfinite().all(-1)  # (the first row holds the specials)
    ref_in = gate_up[finite].double().requires_grad_()
    dh = grad_h[finite].double()
    (ref_grad,) = torch.autograd.grad(swiglu_reference(ref_in), ref_in, dh)
    # d_gate = dh * up * s * (1 + gate * (1 - s)) cancels near gate = -1.28: the bound scales with the
    # terms, not with their sum.
    gate, up = ref_in.detach().chunk(2, -1)
    terms = torch.cat([dh.abs() * up.abs() * (1 + gate.abs()), dh.abs() * gate.abs()], -1)
    err = (grad[finite].double() - ref_grad).abs()
    assert (err <= rtol * (ref_grad.abs() + terms) + atol).all(), f"{(err / (ref_grad.abs() + terms)).max():.3g}"


def test_swiglu_cpu_default_is_the_fused_loop_where_it_is_vectorized():
    """fp32 and 16-bit on a CPU with AVX2 (or not x86) run the fused loops; float64 and CPUs without
    AVX2 run ATen's ops, which are vectorized there and ours are not."""
    vectorized = torch.backends.cpu.get_cpu_capability() != "DEFAULT"
    for dtype, fused in ((torch.float32, vectorized), (torch.bfloat16, vectorized), (torch.float64, False)):
        gate_up = randn(8, 64, dtype=dtype, requires_grad=True)
        with patchgemm.explain() as e:
            torch.autograd.grad(patchgemm.swiglu(gate_up), gate_up, randn(8, 32, dtype=dtype))
        chosen = {c.op: c.chosen for c in e}
        expected = "fused" if fused else "aten_composite"
        assert chosen == {"swiglu": expected, "swiglu_backward": expected}, str(e)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_reads_strided_input(device):
    base = randn(6, 20, device=device)
    gate_up = base[:, 2:18]  # rows 20 apart: made contiguous once
    assert_close_to_ref(patchgemm.swiglu(gate_up), swiglu_reference(gate_up), torch.float32)
    assert_close_to_ref(patchgemm.swiglu(base.t()), swiglu_reference(base.t()), torch.float32)


def test_swiglu_gradcheck_and_opcheck():
    gate_up = randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(patchgemm.swiglu, (gate_up,))
    torch.library.opcheck(ops.swiglu.default, (gate_up,))
    torch.library.opcheck(ops.swiglu_backward.default, (randn(3, 4, 3, dtype=torch.float64), gate_up.detach()))


@pytest.mark.parametrize("make, match", [
    (lambda: ops.swiglu(torch.randn(3, 5)), "must be even"),
    (lambda: ops.swiglu(torch.tensor(1.0)), "0-D"),
    (lambda: ops.swiglu(torch.ones(4, 2, dtype=torch.int32)), "float32, float16"),
    (lambda: ops.swiglu_backward(torch.randn(3, 3), torch.randn(3, 4)), r"grad_h must be \[3, 2\]"),
    (lambda: ops.swiglu_backward(torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 4)), "dtype"),
])
def test_swiglu_bad_input_is_a_clear_error(make, match):
    with pytest.raises(RuntimeError, match=match):
        make()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mlp_values_and_gradients(device, dtype, layout, bias):
    groups, batch, dim, hidden, out_dim = 3, 5, 12, 10, 7
    shape = (batch, groups, dim) if layout == "bgd" else (groups, batch, dim)
    x = randn(*shape, dtype=dtype, device=device, requires_grad=True)
    w_gate_up = randn(groups, 2 * hidden, dim, dtype=dtype, device=device, requires_grad=True)
    w_down = randn(groups, out_dim, hidden, dtype=dtype, device=device, requires_grad=True)
    b_gate_up = randn(groups, 2 * hidden, dtype=dtype, device=device, requires_grad=True) if bias else None
    b_down = randn(groups, out_dim, dtype=dtype, device=device, requires_grad=True) if bias else None
    inputs = [t for t in (x, w_gate_up, w_down, b_gate_up, b_down) if t is not None]
    y = patchgemm.grouped_mlp(x, w_gate_up, w_down, layout, bias_gate_up=b_gate_up, bias_down=b_down)
    grad_y = randn(*y.shape, dtype=dtype, device=device)
    grads = torch.autograd.grad(y, inputs, grad_y)
    refs_in = [t.detach().double().cpu().requires_grad_(True) for t in inputs]
    it = iter(refs_in)
    rx, rgu, rd = next(it), next(it), next(it)
    rbgu, rbd = (next(it), next(it)) if bias else (None, None)
    ref = mlp_reference(rx, rgu, rd, rbgu, rbd, layout)
    ref_grads = torch.autograd.grad(ref, refs_in, grad_y.double().cpu())
    # Three GEMMs in a row: 16-bit rounding of the two intermediates adds up.
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3}.get(dtype)
    assert_close_to_ref(y, ref, dtype, "y", tol)
    for name, g, r in zip(["x", "w_gate_up", "w_down", "b_gate_up", "b_down"], grads, ref_grads):
        assert_close_to_ref(g, r, dtype, f"grad {name}", tol)


def test_grouped_mlp_gradcheck_and_compile():
    x = randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    w_gate_up = randn(2, 6, 5, dtype=torch.float64, requires_grad=True)
    w_down = randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: patchgemm.grouped_mlp(*a), (x, w_gate_up, w_down))
    model = patchgemm.GroupedMLP(2, 5, 3, dtype=torch.float64)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    out = compiled(x)
    out.sum().backward()
    ref = mlp_reference(x.detach(), model.w_gate_up.detach(), model.w_down.detach(), None, None, "bgd")
    assert_close_to_ref(out, ref, torch.float64)
    assert model.w_gate_up.grad is not None and x.grad is not None


def test_module_matches_loop_of_linears():
    torch.manual_seed(0)
    model = patchgemm.GroupedMLP(3, 8, 6, out_dim=5, bias=True)
    assert model.w_gate_up.shape == (3, 12, 8) and model.w_down.shape == (3, 5, 6)
    assert model.bias_gate_up.shape == (3, 12) and model.bias_down.shape == (3, 5)
    assert model.w_gate_up.abs().max() <= 1 / 8 ** 0.5 and model.w_down.abs().max() <= 1 / 6 ** 0.5
    x = randn(4, 3, 8)
    ref = mlp_reference(x, model.w_gate_up, model.w_down, model.bias_gate_up, model.bias_down, "bgd")
    assert_close_to_ref(model(x), ref, torch.float32)
    assert "hidden=6" in repr(model) and "swiglu" in repr(model)


@pytest.mark.parametrize("make, error, match", [
    (lambda: patchgemm.GroupedMLP(2, 4, 4, activation="gelu"), ValueError, "activation"),
    (lambda: patchgemm.grouped_mlp(torch.randn(3, 2, 4), torch.randn(2, 7, 4), torch.randn(2, 4, 3)), RuntimeError,
     r"\[G, 2H, D\]"),
    (lambda: patchgemm.grouped_mlp(torch.randn(3, 2, 4), torch.randn(2, 8, 4), torch.randn(3, 4, 4)), RuntimeError,
     "same G and H"),
    (lambda: patchgemm.grouped_mlp(torch.randn(3, 2, 5), torch.randn(2, 8, 4), torch.randn(2, 4, 4)), RuntimeError,
     r"x must be \[B, 2, 4\] \(layout 'bgd'\) .* got shape \(3, 2, 5\)"),
    (lambda: patchgemm.grouped_mlp(torch.randn(3, 2, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 4), "gbd"),
     RuntimeError, r"x must be \[2, B, 4\] \(layout 'gbd'\)"),
])
def test_grouped_mlp_bad_input_is_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


@needs_gpu
def test_cuda_grouped_mlp_saves_less_than_the_bmm_form():
    """Peak memory of forward + backward: no higher than the same GEMMs through bmm + eager SiLU * up."""
    groups, batch, dim, hidden = 4, 512, 256, 512
    x = randn(groups, batch, dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w_gate_up = randn(groups, 2 * hidden, dim, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w_down = randn(groups, dim, hidden, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def bmm_form():
        gate_up = torch.bmm(x, w_gate_up.transpose(1, 2))
        gate, up = gate_up.chunk(2, -1)
        return torch.bmm(F.silu(gate) * up, w_down.transpose(1, 2))

    def ours():
        return patchgemm.grouped_mlp(x, w_gate_up, w_down, "gbd")

    peaks = []
    for fn in (bmm_form, ours):
        for _ in range(2):
            x.grad = w_gate_up.grad = w_down.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn().float().sum().backward()
            torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] <= peaks[0], f"peak memory {peaks[1]} > bmm form's {peaks[0]}"
