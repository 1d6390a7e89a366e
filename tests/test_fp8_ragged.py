"""FP8 ragged groups (mixture-of-experts layers): scaled_ragged_mm against float64 of the
dequantized operands, its candidates, grouped_linear with group sizes and moe_experts in FP8."""

import pytest
import torch

import patchgemm
from patchgemm import fp8_autocast
from conftest import DEVICES, assert_close_to_ref, needs_gpu, randn, rel_error, syncs_forbidden
from fp8_cases import E4M3, E5M2, HAS_FP8_GPU, dequantized, needs_fp8_gpu, quantize, quantized, ops


# ---- ragged groups in FP8: scaled_ragged_mm, grouped_linear with group sizes, moe_experts ---------

def ragged_ref(a8, sa, b8, sb, bias, sizes):
    a, b = dequantized(a8, sa), dequantized(b8, sb)
    rows = torch.split(a, list(sizes))
    y = torch.cat([r @ b[g].T + (bias[g].double() if bias is not None else 0) for g, r in enumerate(rows)])
    return y


# (sizes, K, N): empty groups, sizes no multiple of 16, and odd K / N that no FP8 GEMM takes.
RAGGED_CASES = [([5, 0, 40, 19], 64, 48), ([0, 0, 33], 32, 16), ([7, 3], 20, 9)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", RAGGED_CASES, ids=lambda c: f"{len(c[0])}groups-k{c[1]}")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("offsets_on", ["cpu", "device"])
def test_scaled_ragged_mm_matches_float64(device, case, out_dtype, with_bias, offsets_on):
    sizes, K, N = case
    a8, sa = quantized((sum(sizes), K), device)
    b8, sb = quantized((len(sizes), N, K), device, scale=0.1)
    bias = randn(len(sizes), N, dtype=out_dtype, device=device) if with_bias else None
    offsets = torch.tensor(sizes).cumsum(0).to(device=device if offsets_on == "device" else "cpu", dtype=torch.int32)
    y = ops.scaled_ragged_mm(a8, b8, sa, sb, bias, offsets, out_dtype)
    assert y.dtype == out_dtype and y.shape == (sum(sizes), N) and y.is_contiguous()
    tol = {torch.bfloat16: 1e-2, torch.float32: 2e-4}[out_dtype]
    assert_close_to_ref(y, ragged_ref(a8, sa, b8, sb, bias, sizes), out_dtype, tol=tol)


@needs_gpu
@pytest.mark.parametrize("case", RAGGED_CASES, ids=lambda c: f"{len(c[0])}groups-k{c[1]}")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_upcast_candidate_matches_float64_without_a_host_sync(case, out_dtype, fmt):
    """Where a sync is forbidden and the sizes are on the GPU, every format and output dtype runs
    upcast_on_gpu (torch._scaled_grouped_mm takes e4m3 to bfloat16 only), sync-free and exact
    to the output dtype's rounding of the upcast a."""
    sizes, K, N = case
    a8, sa = quantized((sum(sizes), K), "cuda", fmt=fmt)
    b8, sb = quantized((len(sizes), N, K), "cuda", scale=0.1)
    bias = randn(len(sizes), N, dtype=out_dtype, device="cuda")
    offsets = torch.tensor(sizes, device="cuda").cumsum(0)
    with syncs_forbidden(), patchgemm.explain() as report:
        y = ops.scaled_ragged_mm(a8, b8, sa, sb, bias, offsets, out_dtype)
    chosen = next(c.chosen for c in report if c.op == "scaled_ragged_mm")
    takes_torch = fmt == E4M3 and out_dtype == torch.bfloat16 and K % 16 == 0 and N % 16 == 0 and \
        torch.cuda.get_device_capability() >= (9, 0)
    assert chosen == ("aten_scaled_grouped_mm" if takes_torch else "upcast_on_gpu"), str(report)
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-6}
    assert_close_to_ref(y, ragged_ref(a8, sa, b8, sb, bias, sizes), out_dtype, tol=tol[out_dtype])


@needs_fp8_gpu
@pytest.mark.parametrize("candidate", ["aten_scaled_grouped_mm", "cublaslt_fp8_loop", "upcast_on_gpu",
                                       "dequantized_loop"])
def test_scaled_ragged_mm_candidates_agree_and_repeat_bitwise_at_scale(candidate):
    """A mixture of experts' layer at training size: 8 experts over 16k rows, sizes no multiple of 16."""
    if candidate == "aten_scaled_grouped_mm" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._scaled_grouped_mm needs sm_90")
    sizes = [3000, 0, 2500, 1999, 2001, 4100, 1184, 1600]
    a8, sa = quantized((sum(sizes), 1024), "cuda")
    b8, sb = quantized((8, 2048, 1024), "cuda", scale=0.03)
    bias = randn(8, 2048, dtype=torch.bfloat16, device="cuda")
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    with patchgemm.force(scaled_ragged_mm=candidate):
        y = ops.scaled_ragged_mm(a8, b8, sa, sb, bias, offsets, torch.bfloat16, True)
        again = ops.scaled_ragged_mm(a8, b8, sa, sb, bias, offsets, torch.bfloat16, True)
    assert torch.equal(y, again)
    assert rel_error(y, ragged_ref(a8, sa, b8, sb, bias, sizes)) < 6e-3  # bf16 rounding, fast accumulation


def test_scaled_ragged_mm_takes_e5m2_where_torch_does_not():
    """An e5m2 gradient: torch._scaled_grouped_mm declines (e4m3 only), another candidate runs."""
    a8, sa = quantized((40, 32), "cuda" if HAS_FP8_GPU else "cpu", fmt=E5M2)
    b8, sb = quantized((2, 16, 32), a8.device)
    offsets = torch.tensor([10, 40], dtype=torch.int32)
    with patchgemm.explain() as report:
        y = ops.scaled_ragged_mm(a8, b8, sa, sb, None, offsets, torch.bfloat16)
    assert_close_to_ref(y, ragged_ref(a8, sa, b8, sb, None, [10, 30]), torch.bfloat16)
    if HAS_FP8_GPU and torch.cuda.get_device_capability() >= (9, 0):
        assert "e4m3 operands only" in str(report)


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_ragged_mm_bad_input(device):
    a8, sa = quantized((12, 32), device)
    b8, sb = quantized((2, 16, 32), device)
    ends = torch.tensor([4, 12])
    with pytest.raises(RuntimeError, match="a must be float8"):
        ops.scaled_ragged_mm(a8.float(), b8, sa, sb, None, ends, torch.bfloat16)
    with pytest.raises(RuntimeError, match="must agree in K"):
        ops.scaled_ragged_mm(a8, b8[:, :, :16], sa, sb, None, ends, torch.bfloat16)
    with pytest.raises(RuntimeError, match="offsets has 3 entries but b has 2 groups"):
        ops.scaled_ragged_mm(a8, b8, sa, sb, None, torch.tensor([4, 8, 12]), torch.bfloat16)
    with pytest.raises(RuntimeError, match="add up to 11 but x has 12 rows"):
        ops.scaled_ragged_mm(a8, b8, sa, sb, None, torch.tensor([4, 11]), torch.bfloat16)
    with pytest.raises(RuntimeError, match="offsets must be int32 or int64"):
        ops.scaled_ragged_mm(a8, b8, sa, sb, None, ends.float(), torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"bias must be \[G, Nc\]"):
        ops.scaled_ragged_mm(a8, b8, sa, sb, torch.zeros(2, 15, dtype=torch.bfloat16, device=device), ends,
                             torch.bfloat16)


def test_scaled_ragged_mm_opcheck():
    a8, sa = quantized((12, 32), "cpu")
    b8, sb = quantized((2, 16, 32), "cpu")
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.scaled_ragged_mm, (a8, b8, sa, sb, torch.ones(2, 16), torch.tensor([4, 12]),
                                                 torch.float32, False), test_utils=utils)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("sizes_as", ["list", "tensor"])
def test_ragged_grouped_linear_fp8_forward_and_backward(device, dtype, sizes_as):
    """Forward and input gradient against float64 of the quantized operands; the weight gradient
    against float64 of the unquantized ones (it runs in the compute dtype)."""
    sizes, D, O = [9, 0, 33, 22], 64, 48
    x = randn(sum(sizes), D, dtype=dtype, device=device, requires_grad=True)
    w = randn(len(sizes), O, D, dtype=dtype, device=device, requires_grad=True)
    b = randn(len(sizes), O, dtype=dtype, device=device, requires_grad=True)
    group_sizes = sizes if sizes_as == "list" else torch.tensor(sizes, device=device)
    y = patchgemm.grouped_linear(x, w, b, group_sizes=group_sizes, fp8=True)
    assert y.dtype == dtype and y.shape == (sum(sizes), O)
    grad_y = randn(*y.shape, dtype=dtype, device=device)
    y.backward(grad_y)
    x8, sx = quantize(x.detach(), E4M3)
    w8, sw = quantize(w.detach(), E4M3)
    g8, sg = quantize(grad_y, E5M2)
    assert_close_to_ref(y, ragged_ref(x8, sx, w8, sw, b.detach(), sizes), torch.bfloat16, "y")
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-4
    ref_gx = ragged_ref(g8, sg, w8.transpose(1, 2).contiguous(), sw, None, sizes)
    assert_close_to_ref(x.grad, ref_gx, dtype, "grad_x", tol=tol)
    rows, grads = torch.split(x.detach().double(), sizes), torch.split(grad_y.double(), sizes)
    assert_close_to_ref(w.grad, torch.stack([gy.T @ r for gy, r in zip(grads, rows)]), dtype, "grad_weight")
    assert_close_to_ref(b.grad, torch.stack([gy.sum(0) for gy in grads]), dtype, "grad_bias")


@pytest.mark.parametrize("device", DEVICES)
def test_moe_experts_in_fp8(device):
    E, D, H, T, k = 4, 64, 32, 40, 2
    experts = patchgemm.MoEExperts(E, D, H, device=device)
    experts8 = patchgemm.MoEExperts(E, D, H, device=device, fp8=True)
    experts8.load_state_dict(experts.state_dict())
    x = randn(T, D, device=device, requires_grad=True)
    index = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(0)).to(device)
    weight = torch.rand(T, k, device=device)
    exact = experts(x, index, weight)
    with fp8_autocast(everywhere=True):
        in_region = experts(x, index, weight)
    assert torch.equal(experts8(x, index, weight), in_region)
    assert 0 < rel_error(in_region, exact) < 0.1
    in_region.square().sum().backward()
    assert torch.isfinite(x.grad).all() and torch.isfinite(experts.gate_up_proj.grad).all()
    assert "fp8=True" in repr(experts8)
    with patchgemm.explain() as report:
        patchgemm.moe_experts(x.detach(), index, weight, experts.gate_up_proj.detach(), experts.down_proj.detach(),
                              fp8=True)
    assert "scaled_ragged_mm" in str(report)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_autocast_leaves_ragged_groups_in_the_compute_dtype(device):
    """Ragged groups measure slower in FP8 than in bf16 (bench data in the note explain shows): a
    region leaves them alone unless everywhere=True; fp8=True still runs them in FP8."""
    E, D, H, T, k = 4, 64, 32, 40, 2
    experts = patchgemm.MoEExperts(E, D, H, device=device)
    x = randn(T, D, device=device)
    index = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(0)).to(device)
    weight = torch.rand(T, k, device=device)
    exact = experts(x, index, weight)
    with fp8_autocast(), patchgemm.explain() as seen:
        assert torch.equal(experts(x, index, weight), exact)
        w, b = randn(3, 16, 64, device=device), randn(3, 16, device=device)
        y = patchgemm.grouped_linear(x, w, b, group_sizes=[10, 20, 10])
    assert torch.equal(y, patchgemm.grouped_linear(x, w, b, group_sizes=[10, 20, 10]))
    notes = [c for c in seen if c.op == "fp8_autocast"]
    assert [c.signature.split(":")[0] for c in notes] == ["(moe_experts", "(grouped_linear"]
    assert all("ragged groups train slower in FP8" in c.how and c.chosen == "the compute dtype" for c in notes)
    assert "M 20 rows a group on average, G 4, K 64 -> N 64" in notes[0].signature
    assert not any(c.op == "scaled_ragged_mm" for c in seen)
    with fp8_autocast(everywhere=True), patchgemm.explain() as seen:
        experts(x, index, weight)
    assert any(c.op == "scaled_ragged_mm" for c in seen)


# ---- delayed scaling: ragged groups and moe_experts keep amax histories as dense groups do --------

DELAYED = patchgemm.Float8Recipe(scaling="delayed")


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_ragged_grouped_linear_starts_as_current_scaling_and_keeps_its_history(device):
    """The first call scales x, the weight and grad_y by their own amaxes (current scaling's values
    and gradients exactly) and records them; an x grown 8x then saturates until its amax is recorded."""
    torch.manual_seed(0)
    sizes = [9, 0, 33, 22]
    x = randn(sum(sizes), 64, device=device, requires_grad=True)
    w = randn(len(sizes), 48, 64, device=device, requires_grad=True)
    grad_y = randn(sum(sizes), 48, device=device)
    history = patchgemm.Float8History()
    results = []
    for fp8, kept in ((DELAYED, history), (True, None)):
        y = patchgemm.grouped_linear(x, w, group_sizes=sizes, fp8=fp8, fp8_history=kept)
        results.append((y, *torch.autograd.grad(y, [x, w], grad_y)))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    for which, t in (("x", x), ("weight", w), ("grad", grad_y)):
        assert torch.equal(history.amax(which)[:2], torch.stack([t.detach().abs().max(), torch.zeros((), device=device)]))
    big = x.detach() * 8
    current = patchgemm.grouped_linear(big, w.detach(), group_sizes=sizes, fp8=True)
    assert not torch.equal(patchgemm.grouped_linear(big, w.detach(), group_sizes=sizes, fp8=DELAYED,
                                                    fp8_history=history), current)
    assert torch.equal(patchgemm.grouped_linear(big, w.detach(), group_sizes=sizes, fp8=DELAYED, fp8_history=history),
                       current)


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_moe_experts_keep_one_history_per_gemm(device):
    """MoEExperts under a delayed recipe: its first call is current scaling's exactly, then its two
    histories (gate-up, down) hold each GEMM's x, weight and gradient amaxes."""
    E, D, H, T, k = 4, 64, 32, 40, 2
    delayed = patchgemm.MoEExperts(E, D, H, device=device, fp8=DELAYED)
    current = patchgemm.MoEExperts(E, D, H, device=device, fp8=True)
    current.load_state_dict(delayed.state_dict())
    x = randn(T, D, device=device, requires_grad=True)
    index = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(0)).to(device)
    weight = torch.rand(T, k, device=device)
    results = []
    for experts in (delayed, current):
        y = experts(x, index, weight)
        results.append((y, *torch.autograd.grad(y.square().sum(), [x, experts.gate_up_proj, experts.down_proj])))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    gate_up, down = delayed.fp8_histories
    assert gate_up.amax("weight")[0] == delayed.gate_up_proj.detach().abs().max()
    assert down.amax("weight")[0] == delayed.down_proj.detach().abs().max()
    assert gate_up.amax("x")[0] == x.detach().abs().max()
    assert all(h.amax("grad")[0] > 0 for h in (gate_up, down))
    with fp8_autocast(recipe=DELAYED, everywhere=True):  # a region's delayed recipe: the module's own histories
        assert torch.isfinite(patchgemm.MoEExperts(E, D, H, device=device)(x, index, weight)).all()
    for bad in (patchgemm.Float8History(), [1, 2], (patchgemm.Float8History(), None)):
        with pytest.raises(TypeError, match="moe_experts: fp8_histories must be two patchgemm.Float8History"):
            patchgemm.moe_experts(x, index, weight, delayed.gate_up_proj, delayed.down_proj, fp8=DELAYED,
                                  fp8_histories=bad)


def test_delayed_moe_experts_compile_and_keep_their_histories():
    """Compiled (fullgraph), MoEExperts under a delayed recipe update both GEMMs' histories as eager
    does, grad_y's from the second call on (as the dense layer's: test_fp8.py): against an eager twin
    whose gradient histories are cleared after its first call, equal at every step."""
    torch.manual_seed(0)
    E, D, H, T, k = 4, 32, 16, 24, 2
    layer = patchgemm.MoEExperts(E, D, H, fp8=DELAYED)
    eager = patchgemm.MoEExperts(E, D, H, fp8=DELAYED)
    eager.load_state_dict(layer.state_dict())
    index = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(0))
    weight = torch.rand(T, k)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for step, scale in enumerate((1, 4, 0.5, 2)):
        x = randn(T, D) * scale
        x_eager = x.clone().requires_grad_()
        y = compiled(x.requires_grad_(), index, weight)
        grad_y = randn(T, D) * (step + 1)
        y.backward(grad_y)
        y_eager = eager(x_eager, index, weight)
        y_eager.backward(grad_y)
        assert torch.equal(y, y_eager) and torch.equal(x.grad, x_eager.grad), step
        if step == 0:
            for history in eager.fp8_histories:
                history._states["grad"].zero_()  # (a history all zeros: as made)
        for ours, theirs in zip(layer.fp8_histories, eager.fp8_histories):
            for which in ("x", "weight", "grad"):
                assert torch.equal(ours.amax(which), theirs.amax(which)), (step, which)
    assert all(h.amax("grad")[0] > 0 for h in layer.fp8_histories)
