"""FP8 grouped linears (patchgemm.fp8): quantization, the FP8 grouped GEMM against float64 of the
dequantized operands, the autograd recipe, the switches, weights reused across microbatches,
compile, and a toy training run against bf16. On the CPU the GEMM is emulated exactly
(dequantized_bmm); on sm_89+ GPUs cuBLASLt's FP8 runs. Ragged groups: test_fp8_ragged.py; patch
embeddings: test_fp8_patch.py."""

import pytest
import torch

import patchgemm
from patchgemm import Float8Recipe, fp8_autocast
from conftest import DEVICES, assert_close_to_ref, poison_allocator, randn, rel_error
from fp8_cases import E4M3, E5M2, FP8_MAX, HALF_ULP, dequantized, needs_fp8_gpu, quantize, quantized, ops


# ---- quantize_fp8 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("numel", [1, 7, 4096 + 5, 3 * 1024 * 1024 + 1])
def test_quantize_scales_by_amax_and_rounds_to_nearest(device, dtype, fmt, numel):
    x = (randn(numel, dtype=torch.float64) * 3).to(device=device, dtype=dtype)
    data, scale = quantize(x, fmt)
    assert data.dtype == fmt and data.shape == x.shape and data.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == () and scale.device == x.device
    amax = x.double().abs().max()
    assert scale.item() == pytest.approx((amax / FP8_MAX[fmt]).item(), rel=1e-6)
    assert data.double().abs().max().item() == FP8_MAX[fmt]  # the largest value lands on the format's max
    # Each element within half a step of the format (relative), or of its smallest subnormal step.
    back, x64 = dequantized(data, scale), x.double()
    tiny = scale.double() * (2.0**-9 if fmt == E4M3 else 2.0**-16)
    assert ((back - x64).abs() <= HALF_ULP[fmt] * x64.abs() + tiny).all()


@pytest.mark.parametrize("device", DEVICES)
def test_quantize_edge_values(device):
    zeros = torch.zeros(33, device=device)
    data, scale = quantize(zeros, E4M3)
    assert scale.item() == 1.0 and (data.float() == 0).all()
    empty_data, empty_scale = quantize(torch.empty(0, 16, device=device), E4M3)
    assert empty_data.shape == (0, 16) and empty_scale.item() == 1.0
    for bad in (float("nan"), float("inf")):
        x = randn(64, device=device)
        x[5] = bad
        data, scale = quantize(x, E4M3)
        # Never a finite result from a non-finite input: the scale (or the data) carries it.
        assert not torch.isfinite(dequantized(data, scale)).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(70, 130), (3, 65, 64), (2, 1, 1), (1, 4096 + 3, 5)])
def test_transposed_copy_is_the_data_transposed(device, shape):
    x = randn(*shape, dtype=torch.bfloat16, device=device)
    data, data_t, scale, _ = ops.quantize_fp8(x, E5M2, True, True)
    assert data_t.shape == (*shape[:-2], shape[-1], shape[-2]) and data_t.is_contiguous()
    assert torch.equal(data_t.view(torch.uint8), data.transpose(-2, -1).contiguous().view(torch.uint8))
    none, only_t, again, _ = ops.quantize_fp8(x, E5M2, False, True)
    assert none.numel() == 0 and torch.equal(again, scale)
    assert torch.equal(only_t.view(torch.uint8), data_t.view(torch.uint8))


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 1000, 1024 + 3), (3, 1000, 1024 + 4), (2, 1000, 1024 + 8),
                                   (65535 + 9, 8, 24), (2560, 12288)],
                         ids=["by1", "by4", "by8", "by8-many-p", "by8-large"])
def test_fused_quantize_is_bitwise_aten(dtype, fmt, transposed, shape):
    """The transposing kernels' widths (16-bit x with R and C multiples of 8 take 8 x 8 blocks), with
    edges in rows and columns, more x[p] than a grid has blocks (a loop), and a grid of many waves."""
    x = randn(*shape, dtype=dtype, device="cuda") * 5
    with patchgemm.force(quantize_fp8="fused"):
        out = ops.quantize_fp8(x, fmt, True, transposed)
        again = ops.quantize_fp8(x, fmt, True, transposed)
    with patchgemm.force(quantize_fp8="aten"):
        ref = ops.quantize_fp8(x, fmt, True, transposed)
    assert torch.equal(out[2], ref[2])
    for got, want, rerun in zip(out[:2], ref[:2], again[:2]):
        differ = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
        assert differ.numel() == 0, (
            f"{len(differ)} values differ, first at {differ[0].tolist()}: {got[tuple(differ[0])].float().item()} vs "
            f"ATen's {want[tuple(differ[0])].float().item()} (x / scale there: "
            f"{(x.float().reshape(got.shape) / ref[2])[tuple(differ[0])].item() if got.shape == x.shape else '?'})")
        assert torch.equal(got.view(torch.uint8), rerun.view(torch.uint8))


def quantizers(device):
    """The quantize_fp8 candidates that run on `device`."""
    return ["fused", "aten"] if device == "cuda" and torch.cuda.get_device_capability() >= (8, 9) else ["aten"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(70, 130), (3, 65, 64), (2, 1000, 1024 + 8), (2, 1000, 1027), (2, 3000, 516),
                                   (4096, 4104), (5, 0, 8), (1, 1, 4), (65535 + 9, 8, 16)])
def test_column_sums_are_the_bias_gradient(device, dtype, transposed, shape):
    """x summed over its second-to-last dim, within one rounding of the float64 sum; the data and the
    scale the same bits as without the sums, and every run the same bits (the transposing kernel's
    widths, edges in rows and columns, no rows; a grid of many waves of blocks)."""
    x = randn(*shape, dtype=dtype, device=device) * 3
    want = x.double().sum(-2)
    bound = (2.0**-8 if dtype == torch.bfloat16 else 2.0**-23) * want.abs() + 1e-5 * x.double().abs().sum(-2) + 1e-30
    for impl in quantizers(device):
        with patchgemm.force(quantize_fp8=impl):
            data, data_t, scale, sums = ops.quantize_fp8(x, E4M3, True, transposed, True)
            again = ops.quantize_fp8(x, E4M3, True, transposed, True)
            plain = ops.quantize_fp8(x, E4M3, True, transposed)
        assert sums.shape == want.shape and sums.dtype == dtype and sums.is_contiguous()
        assert ((sums.double() - want).abs() <= bound).all(), (impl, (sums.double() - want).abs().max().item())
        assert torch.equal(sums, again[3]) and torch.equal(scale, plain[2]) and plain[3].numel() == 0
        for got, ref in ((data, plain[0]), (data_t, plain[1])):
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_column_sums_need_two_dims():
    with pytest.raises(RuntimeError, match="column sums need x of 2 dims"):
        ops.quantize_fp8(randn(8), E4M3, True, False, True)


# ---- delayed scaling: the amax state ---------------------------------------------------------------

def scale_of(amax, fmt):
    """The scale an amax (a float32 scalar) gives: a true division (ATen's by a Python number is a
    multiplication by its reciprocal on CUDA, which may round differently)."""
    return torch.where(amax == 0, torch.ones_like(amax), amax / torch.full_like(amax, FP8_MAX[fmt]))


def scaled_by(x, fmt, amax):
    """x quantized to fmt with the scale an amax (a float32 scalar) gives: (data, scale)."""
    scale = scale_of(amax, fmt)
    return (x.float() * scale.reciprocal()).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt), scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transposed", [False, True])
def test_delayed_scaling_scales_by_the_history_and_records_each_amax(device, transposed):
    """The first call (nothing recorded) scales by x's own amax; each later one by the largest amax of
    the last L calls, saturating what lies beyond; the state keeps them newest first."""
    L = 3
    xs = [randn(3, 70, 130, device=device) * s for s in (1, 4, 2, 0.5, 0.25, 0.125)]
    for impl in quantizers(device):
        state, recorded = torch.zeros(L + 2, device=device), []
        for i, x in enumerate(xs):
            with patchgemm.force(quantize_fp8=impl):
                data, data_t, scale, _ = ops.quantize_fp8(x, E4M3, True, transposed, False, state)
            amax = x.abs().max()
            want, want_scale = scaled_by(x, E4M3, max(recorded[:L]) if recorded else amax)
            assert torch.equal(scale, want_scale), (impl, i)
            assert torch.equal(data.view(torch.uint8), want.view(torch.uint8)), (impl, i)
            if transposed:
                assert torch.equal(data_t.view(torch.uint8), data.transpose(-2, -1).contiguous().view(torch.uint8))
            if i == 1:  # x grew 4x past the one amax recorded: its largest values saturate
                assert (data.float().abs() == FP8_MAX[E4M3]).sum() > 1
            recorded.insert(0, amax)
            kept = torch.stack(recorded[:L] + [torch.zeros_like(amax)] * (L - len(recorded[:L])))
            assert torch.equal(state[2:], kept) and state[1].item() == 0, (impl, i, state)
            assert torch.equal(state[0], kept.max())


@needs_fp8_gpu
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 1000, 1024 + 3), (2, 1000, 1024 + 8), (8, 2048, 2048)])
def test_fused_delayed_quantize_is_bitwise_aten_and_repeats(transposed, shape):
    """Over several waves of blocks: the fused kernels (one pass, observing the amax) give ATen's bits,
    the same every run, and record the same amaxes."""
    xs = [randn(*shape, dtype=torch.bfloat16, device="cuda") * s for s in (1, 3, 0.5)]
    runs = []
    for impl in ("fused", "aten", "fused"):
        state, out = torch.zeros(16 + 2, device="cuda"), []
        with patchgemm.force(quantize_fp8=impl):
            for x in xs:
                data, data_t, scale, _ = ops.quantize_fp8(x, E5M2, True, transposed, False, state)
                out += [data.view(torch.uint8), data_t.view(torch.uint8), scale, state.clone()]
        runs.append(out)
    for got, want, again in zip(*runs):
        assert torch.equal(got, want) and torch.equal(got, again)


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_scaling_carries_a_nan_until_the_history_forgets_it(device):
    state = torch.zeros(1 + 2, device=device)
    bad = randn(64, device=device)
    bad[3] = float("nan")
    _, _, scale, _ = ops.quantize_fp8(bad, E4M3, True, False, False, state)
    assert torch.isnan(state[0]) and not torch.isfinite(scale)  # (this call measured its own amax: NaN)
    clean = randn(64, device=device)
    _, _, scale, _ = ops.quantize_fp8(clean, E4M3, True, False, False, state)
    assert torch.isnan(scale)  # scaled by the NaN recorded: never a finite answer from it
    _, _, scale, _ = ops.quantize_fp8(clean, E4M3, True, False, False, state)
    assert torch.isfinite(scale) and torch.equal(scale, scale_of(clean.abs().max(), E4M3))


@pytest.mark.parametrize("device", DEVICES)
def test_amax_state_bad_input(device):
    x = randn(4, 8, device=device)
    for bad in (torch.zeros(5, dtype=torch.float64, device=device), torch.zeros(2, device=device),
                torch.zeros(1027, device=device), torch.zeros(2, 5, device=device),
                torch.zeros(10, device=device)[::2]):
        with pytest.raises(RuntimeError, match=r"amax_state must be a contiguous float32 tensor \[L \+ 2\]"):
            ops.quantize_fp8(x, E4M3, True, False, False, bad)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="amax_state is on cpu but x is on cuda"):
            ops.quantize_fp8(x, E4M3, True, False, False, torch.zeros(5))


# ---- scaled_grouped_mm: the FP8 grouped GEMM ------------------------------------------------------

def scaled_ref(a8, sa, b8, sb, bias, group_major):
    a = dequantized(a8, sa)
    a = a if group_major else a.transpose(0, 1)
    y = a @ dequantized(b8, sb).transpose(1, 2)  # [G, M, N]
    if bias is not None:
        y = y + bias.double().unsqueeze(1)
    return y if group_major else y.transpose(0, 1)


# (B, G, K, N): cuBLASLt's FP8 shapes (multiples of 16), and odd ones, which no FP8 GEMM takes.
GEMM_SHAPES = [(32, 3, 64, 48), (5, 2, 16, 16), (7, 3, 20, 9)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", GEMM_SHAPES)
@pytest.mark.parametrize("group_major", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_grouped_mm_matches_float64(device, shape, group_major, out_dtype, with_bias):
    B, G, K, N = shape
    a8, sa = quantized((G, B, K) if group_major else (B, G, K), device)
    b8, sb = quantized((G, N, K), device, scale=0.1)
    bias = randn(G, N, dtype=out_dtype, device=device) if with_bias else None
    poison_allocator(B * G * N * 4, device)
    y = ops.scaled_grouped_mm(a8, b8, sa, sb, bias, group_major, out_dtype)
    assert y.dtype == out_dtype and y.is_contiguous() and y.shape == ((G, B, N) if group_major else (B, G, N))
    # One rounding into out_dtype from exact sums on the CPU; on a GPU, FP8 tensor cores' sums (their
    # own fp32-like accumulator between promotions, ~1e-4 relative).
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-4}[out_dtype]
    assert_close_to_ref(y, scaled_ref(a8, sa, b8, sb, bias, group_major), out_dtype, tol=tol)


@needs_fp8_gpu
@pytest.mark.parametrize("fast_accum", [False, True])
def test_scaled_grouped_mm_at_scale_is_bitwise_repeatable(fast_accum):
    """The benchmark's G1 (B 2560, G 12, 1024 -> 3072): hundreds of output tiles per group, many waves."""
    B, G, K, N = 2560, 12, 1024, 3072
    a8, sa = quantized((B, G, K), "cuda")
    b8, sb = quantized((G, N, K), "cuda", scale=0.03)
    with patchgemm.explain() as report:
        y = ops.scaled_grouped_mm(a8, b8, sa, sb, None, False, torch.bfloat16, fast_accum)
    assert "cublaslt_fp8" in str(report)
    for _ in range(3):
        assert torch.equal(y, ops.scaled_grouped_mm(a8, b8, sa, sb, None, False, torch.bfloat16, fast_accum))
    ref = scaled_ref(a8, sa, b8, sb, None, False)
    assert rel_error(y, ref) < (2e-3 if fast_accum else 1e-3) + 4e-3  # bf16 rounding, plus fast accumulation's


@needs_fp8_gpu
@pytest.mark.parametrize("candidate", ["cublaslt_fp8", "aten_scaled_mm", "dequantized_bmm"])
def test_scaled_grouped_mm_candidates_agree(candidate):
    a8, sa = quantized((64, 4, 128), "cuda")
    b8, sb = quantized((4, 96, 128), "cuda", scale=0.1)
    bias = randn(4, 96, dtype=torch.bfloat16, device="cuda")
    with patchgemm.force(scaled_grouped_mm=candidate):
        y = ops.scaled_grouped_mm(a8, b8, sa, sb, bias, False, torch.bfloat16)
    assert_close_to_ref(y, scaled_ref(a8, sa, b8, sb, bias, False), torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
def test_scaled_grouped_mm_bad_input(device):
    a8, sa = quantized((8, 2, 32), device)
    b8, sb = quantized((2, 16, 32), device)
    with pytest.raises(RuntimeError, match="a must be float8"):
        ops.scaled_grouped_mm(a8.float(), b8, sa, sb, None, False, torch.bfloat16)
    with pytest.raises(RuntimeError, match="must agree in G and K"):
        ops.scaled_grouped_mm(a8, b8[:, :, :16], sa, sb, None, False, torch.bfloat16)
    with pytest.raises(RuntimeError, match="scale_b must be one float32 value"):
        ops.scaled_grouped_mm(a8, b8, sa, sb.expand(2), None, False, torch.bfloat16)
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        ops.scaled_grouped_mm(a8, b8, sa, sb, None, False, torch.float64)
    with pytest.raises(RuntimeError, match=r"bias must be \[G, N\]"):
        ops.scaled_grouped_mm(a8, b8, sa, sb, torch.zeros(2, 15, dtype=torch.bfloat16, device=device), False,
                              torch.bfloat16)
    with pytest.raises(RuntimeError, match="format must be"):
        ops.quantize_fp8(randn(4, device=device), torch.bfloat16)


def test_opcheck():
    a8, sa = quantized((16, 2, 32), "cpu")
    b8, sb = quantized((2, 16, 32), "cpu")
    torch.library.opcheck(ops.quantize_fp8, (randn(4, 8), E4M3))
    torch.library.opcheck(ops.quantize_fp8, (randn(2, 4, 8), E5M2, False, True))
    torch.library.opcheck(ops.quantize_fp8, (randn(2, 4, 8), E5M2, False, True, True))
    torch.library.opcheck(ops.quantize_fp8, (randn(2, 4, 8), E4M3, True, True, True, torch.zeros(6)))
    # (Not test_schema for FP8 inputs: its mutation check multiplies them, which ATen cannot in FP8.)
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.scaled_grouped_mm, (a8, b8, sa, sb, None, False, torch.bfloat16, False), test_utils=utils)
    g8, sg = quantized((2, 16, 32), "cpu")
    torch.library.opcheck(ops.scaled_grouped_mm, (g8, b8, sg, sb, torch.ones(2, 16), True, torch.float32, True),
                          test_utils=utils)


# ---- the grouped linear in FP8 --------------------------------------------------------------------

def fp8_reference(x, weight, bias, grad_y, group_major, recipe):
    """Forward and gradients in float64 from the operands the recipe quantizes (their exact values)."""
    x8, sx = quantize(x.detach(), recipe.forward_format)
    w8, sw = quantize(weight.detach(), recipe.forward_format)
    g8, sg = quantize(grad_y, recipe.backward_format)
    by_group = (lambda t: t) if group_major else (lambda t: t.transpose(0, 1))
    xq, wq, gq = by_group(dequantized(x8, sx)), dequantized(w8, sw), by_group(dequantized(g8, sg))
    y = xq @ wq.transpose(1, 2) + (bias.double().unsqueeze(1) if bias is not None else 0)
    return by_group(y), by_group(gq @ wq), gq.transpose(1, 2) @ xq, by_group(grad_y.double()).sum(1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(48, 3, 64, 32), (9, 2, 24, 10)])
def test_grouped_linear_fp8_forward_and_backward(device, layout, dtype, shape):
    B, G, D, O = shape
    group_major = layout == "gbd"
    x = randn(*((G, B, D) if group_major else (B, G, D)), dtype=dtype, device=device, requires_grad=True)
    layer = patchgemm.GroupedLinear(G, D, O, layout=layout, device=device, dtype=dtype, fp8=True)
    y = layer(x)
    assert y.dtype == dtype
    grad_y = randn(*y.shape, dtype=dtype, device=device)
    y.backward(grad_y)
    ref_y, ref_gx, ref_gw, ref_gb = fp8_reference(x, layer.weight, layer.bias, grad_y, group_major, Float8Recipe())
    assert_close_to_ref(y, ref_y, torch.bfloat16, "y")  # fp32 output: fast accumulation's rounding on a GPU
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-4  # (fp32: the FP8 tensor cores' sums)
    assert_close_to_ref(x.grad, ref_gx, dtype, "grad_x", tol=tol)
    assert_close_to_ref(layer.weight.grad, ref_gw, dtype, "grad_weight", tol=tol)
    assert_close_to_ref(layer.bias.grad, ref_gb, dtype, "grad_bias", tol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_error_against_full_precision_is_within_the_recipe_bound(device):
    """The documented bound: e4m3 operands (half-step 2^-4) give ~3% relative error on random data,
    e5m2 gradients ~6%; we assert 6% and 12%."""
    B, G, D, O = 256, 4, 128, 64
    x = randn(B, G, D, device=device, requires_grad=True)
    layer = patchgemm.GroupedLinear(G, D, O, device=device, fp8=True)
    y = layer(x)
    grad_y = randn(*y.shape, device=device)
    y.backward(grad_y)
    x64, w64 = x.detach().double().transpose(0, 1), layer.weight.detach().double()
    g64 = grad_y.double().transpose(0, 1)
    exact_y = (x64 @ w64.transpose(1, 2) + layer.bias.detach().double().unsqueeze(1)).transpose(0, 1)
    assert rel_error(y, exact_y) < 0.06
    assert rel_error(x.grad, (g64 @ w64).transpose(0, 1)) < 0.12
    assert rel_error(layer.weight.grad, g64.transpose(1, 2) @ x64) < 0.12


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_autocast_region_and_overrides(device):
    x = randn(16, 2, 32, device=device)
    plain = patchgemm.GroupedLinear(2, 32, 16, device=device)
    never = patchgemm.GroupedLinear(2, 32, 16, device=device, fp8=False)
    never.load_state_dict(plain.state_dict())
    exact = plain(x)
    with fp8_autocast(everywhere=True):  # (a problem this small: only with everywhere)
        quantized_y = plain(x)
        assert torch.equal(never(x), exact)  # a module's own choice wins
        with fp8_autocast(enabled=False):
            assert torch.equal(plain(x), exact)
    assert torch.equal(plain(x), exact)  # the region is over
    assert not torch.equal(quantized_y, exact) and rel_error(quantized_y, exact) < 0.06


def fp8_ran(choices) -> bool:
    return any(c.op == "quantize_fp8" for c in choices)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_autocast_runs_fp8_where_it_pays(device):
    """A region's dense grouped linear runs in FP8 only where fp8_pays says FP8 trains faster (never
    on the CPU, whose FP8 is an emulation); explain says why where it does not; everywhere=True, a
    module's fp8=True and a weight copy in a region that declines behave as documented."""
    small = patchgemm.GroupedLinear(2, 32, 16, device=device)
    x = randn(16, 2, 32, device=device)
    exact = small(x)
    with fp8_autocast(), patchgemm.explain() as seen:
        y = small(x)
    assert torch.equal(y, exact) and not fp8_ran(seen)
    region = [c for c in seen if c.op == "fp8_autocast"]
    assert len(region) == 1 and region[0].chosen == "the compute dtype" and "everywhere=True" in region[0].how
    assert "grouped_linear: M 16 rows a group, G 2, K 32 -> N 16" in region[0].signature
    with fp8_autocast(everywhere=True), patchgemm.explain() as seen:
        small(x)
    assert fp8_ran(seen)
    with fp8_autocast(), patchgemm.explain() as seen:
        patchgemm.GroupedLinear(2, 32, 16, device=device, fp8=True)(x)
        kept = patchgemm.quantize_weight(small.weight)
        assert torch.equal(patchgemm.grouped_linear(x, small.weight, small.bias, fp8_weight=kept), exact)
    assert fp8_ran(seen)  # the module's own choice
    for bad in ("yes", 1):
        with pytest.raises(TypeError, match="everywhere must be a bool"), fp8_autocast(everywhere=bad):
            pass


@pytest.mark.parametrize("rows, din, dout, groups, pays", [
    (8192, 2048, 2048, 1, True),     # h 910, 69 GFLOP
    (4096, 2048, 1024, 12, True),    # h 585 (the sweep's 1.07x)
    (4096, 512, 4096, 1, False),     # h 410 (the sweep's 0.92x)
    (4096, 2048, 1024, 1, False),    # h 585 but 17 GFLOP (0.91x)
    (0, 2048, 2048, 4, False),
])
def test_fp8_pays_rule(rows, din, dout, groups, pays):
    from patchgemm.fp8 import fp8_pays
    assert not fp8_pays(rows, din, dout, groups, torch.device("cpu"))
    if torch.cuda.is_available():
        sm89 = torch.cuda.get_device_capability() >= (8, 9)
        assert fp8_pays(rows, din, dout, groups, torch.device("cuda")) == (pays and sm89)


@needs_fp8_gpu
def test_fp8_autocast_reaches_a_layer_where_fp8_pays():
    layer = patchgemm.GroupedLinear(1, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = randn(8192, 1, 2048, device="cuda", dtype=torch.bfloat16)
    with fp8_autocast(), patchgemm.explain() as seen:
        y = layer(x)
    assert fp8_ran(seen) and not any(c.op == "fp8_autocast" for c in seen)
    assert 0 < rel_error(y, layer(x)) < 0.06


@needs_fp8_gpu
@pytest.mark.parametrize("rows", [16, 8192])
def test_fp8_autocast_rule_compiles_in_one_graph(rows):
    layer = patchgemm.GroupedLinear(1, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    x = randn(rows, 1, 2048, device="cuda", dtype=torch.bfloat16)
    with fp8_autocast():
        eager = layer(x)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)(x)
    assert torch.equal(compiled, eager) if rows == 16 else rel_error(compiled, eager) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mlp_fp8_matches_its_region(device):
    x = randn(16, 2, 32, device=device)
    mlp = patchgemm.GroupedMLP(2, 32, 64, device=device)
    mlp8 = patchgemm.GroupedMLP(2, 32, 64, device=device, fp8=True)
    mlp8.load_state_dict(mlp.state_dict())
    with fp8_autocast(everywhere=True):
        in_region = mlp(x)
    assert torch.equal(mlp8(x), in_region)
    assert 0 < rel_error(in_region, mlp(x)) < 0.1


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_under_autocast_keeps_fp32_master_weights(device):
    layer = patchgemm.GroupedLinear(3, 32, 16, device=device, fp8=True)
    x = randn(8, 3, 32, device=device, requires_grad=True)
    with torch.autocast(device_type=device, dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert layer.bias.grad.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_takes_every_x_form_grouped_linear_does(device):
    w, b = randn(3, 16, 32, device=device), randn(3, 16, device=device)
    x = randn(4, 5, 3, 32, device=device)
    y = patchgemm.grouped_linear(x, w, b, fp8=True)
    assert y.shape == (4, 5, 3, 16)
    assert torch.equal(y.reshape(20, 3, 16), patchgemm.grouped_linear(x.reshape(20, 3, 32), w, b, fp8=True))
    flat = patchgemm.grouped_linear(x.reshape(60, 32), w, b, fp8=True)
    assert torch.equal(flat, y.reshape(60, 16))
    # Other strides: the same quantized values, a GEMM of other leading dimensions (on a GPU perhaps
    # another algorithm, summing in another order).
    strided = x.reshape(20, 3, 32).transpose(0, 1).contiguous().transpose(0, 1)  # [B, G, D] view of [G, B, D]
    assert rel_error(patchgemm.grouped_linear(strided, w, b, fp8=True), y.reshape(20, 3, 16)) < 1e-3
    gbd = patchgemm.grouped_linear(x.reshape(20, 3, 32).transpose(0, 1), w, b, "gbd", fp8=True)
    assert rel_error(gbd.transpose(0, 1), y.reshape(20, 3, 16)) < 1e-3


@pytest.mark.parametrize("needs", ["x", "weight", "bias", "weight and bias"])
def test_fp8_backward_computes_only_what_is_needed(needs):
    layer = patchgemm.GroupedLinear(2, 32, 16, fp8=True)
    x = randn(8, 2, 32, requires_grad="x" in needs)
    layer.weight.requires_grad_("weight" in needs)
    layer.bias.requires_grad_("bias" in needs)
    layer(x).sum().backward()
    for name, t in (("x", x), ("weight", layer.weight), ("bias", layer.bias)):
        assert (t.grad is not None) == (name in needs.split(" and ")), name


def test_fp8_switch_errors():
    with pytest.raises(TypeError, match="fp8 must be None, a bool or a patchgemm.Float8Recipe"):
        patchgemm.GroupedLinear(2, 16, 16, fp8="e4m3")
    with pytest.raises(ValueError, match="forward_format must be"):
        Float8Recipe(forward_format=torch.float8_e5m2)
    with pytest.raises(TypeError, match="recipe must be"):
        with fp8_autocast(recipe="hybrid"):
            pass
    with pytest.raises(TypeError, match="FP8 needs float32, float16 or bfloat16 x"):
        patchgemm.grouped_linear(randn(4, 2, 16, dtype=torch.float64), randn(2, 8, 16), fp8=True)
    with pytest.raises(RuntimeError, match=r"with ragged groups, x must be \[N, Din\] with Din = 16"):
        patchgemm.grouped_linear(randn(6, 15), randn(2, 8, 16), group_sizes=[2, 4], fp8=True)
    with pytest.raises(RuntimeError, match="group_sizes has 3 entries but weight"):
        patchgemm.grouped_linear(randn(6, 16), randn(2, 8, 16), group_sizes=[2, 2, 2], fp8=True)
    with pytest.raises(RuntimeError, match="add up to 5 but x has 6 rows"):
        patchgemm.grouped_linear(randn(6, 16), randn(2, 8, 16), group_sizes=[2, 3], fp8=True)


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_weight_reused_across_microbatches(device):
    """is_first_microbatch=True keeps the weight's FP8 copy; False reuses it: the same values and
    gradients as quantizing every call while the weight is unchanged, and the old copy (stale, by
    the contract) after the weight changes, until the next True."""
    torch.manual_seed(0)
    layer = patchgemm.GroupedLinear(3, 32, 16, device=device, fp8=True)
    xs = [randn(8, 3, 32, device=device, requires_grad=True) for _ in range(3)]
    per_call = [layer(x) for x in xs]
    grads = [torch.autograd.grad(y.sum(), [x, layer.weight, layer.bias]) for x, y in zip(xs, per_call)]
    for i, x in enumerate(xs):
        y = layer(x, is_first_microbatch=(i == 0))
        assert torch.equal(y, per_call[i])
        for got, expected in zip(torch.autograd.grad(y.sum(), [x, layer.weight, layer.bias]), grads[i]):
            assert torch.equal(got, expected)
    fresh = layer(xs[0]).detach()
    with torch.no_grad():
        layer.weight.mul_(2)
    assert torch.equal(layer(xs[0], is_first_microbatch=False), fresh)  # the copy made before the change
    assert not torch.equal(layer(xs[0], is_first_microbatch=True), fresh)
    assert torch.equal(layer(xs[0], is_first_microbatch=False), layer(xs[0]))
    # The functional form: a copy made once, passed to each call.
    w8 = patchgemm.quantize_weight(layer.weight)
    assert torch.equal(patchgemm.grouped_linear(xs[1], layer.weight, layer.bias, fp8=True, fp8_weight=w8),
                       layer(xs[1]))
    plain = patchgemm.GroupedLinear(3, 32, 16, device=device)  # not in FP8: the argument is ignored
    assert torch.equal(plain(xs[2], is_first_microbatch=True), plain(xs[2]))


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mlp_fp8_weights_reused_across_microbatches(device):
    mlp = patchgemm.GroupedMLP(2, 32, 48, bias=True, device=device, fp8=True)
    xs = [randn(8, 2, 32, device=device) for _ in range(2)]
    per_call = [mlp(x) for x in xs]
    assert [torch.equal(mlp(x, is_first_microbatch=(i == 0)), y) for i, (x, y) in enumerate(zip(xs, per_call))] == \
        [True, True]
    kept = patchgemm.quantize_weight(mlp.w_gate_up), patchgemm.quantize_weight(mlp.w_down)
    y = patchgemm.grouped_mlp(xs[1], mlp.w_gate_up, mlp.w_down, bias_gate_up=mlp.bias_gate_up,
                              bias_down=mlp.bias_down, fp8=True, fp8_weights=kept)
    assert torch.equal(y, per_call[1])


def test_fp8_weight_reuse_errors():
    layer = patchgemm.GroupedLinear(2, 16, 8, fp8=True)
    x = randn(4, 2, 16)
    with pytest.raises(RuntimeError, match="is_first_microbatch=False reuses the FP8 weights .* none were made"):
        layer(x, is_first_microbatch=False)
    with pytest.raises(TypeError, match="fp8_weights must be two patchgemm.Float8Weight"):
        patchgemm.grouped_mlp(x, randn(2, 8, 16), randn(2, 16, 4), fp8=True, fp8_weights=[None])
    with pytest.raises(TypeError, match="is_first_microbatch must be True, False or None, got 1"):
        layer(x, is_first_microbatch=1)
    w8 = patchgemm.quantize_weight(layer.weight)
    with pytest.raises(ValueError, match="does not run in FP8"):
        patchgemm.grouped_linear(x, layer.weight, fp8=False, fp8_weight=w8)
    with pytest.raises(ValueError, match="ragged groups quantize their weight per call"):
        patchgemm.grouped_linear(randn(6, 16), layer.weight, group_sizes=[2, 4], fp8=True, fp8_weight=w8)
    with pytest.raises(ValueError, match=r"fp8_weight was made from a torch.float32 weight \[2, 8, 16\]"):
        patchgemm.grouped_linear(randn(4, 3, 16), randn(3, 8, 16), fp8=True, fp8_weight=w8)
    with pytest.raises(TypeError, match="fp8_weight must be a patchgemm.Float8Weight"):
        patchgemm.grouped_linear(x, layer.weight, fp8=True, fp8_weight=layer.weight)
    with pytest.raises(TypeError, match=r"weight must be a float32, float16 or bfloat16 tensor \[G, Dout, Din\]"):
        patchgemm.quantize_weight(randn(8, 16))


DELAYED = Float8Recipe(scaling="delayed")


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_grouped_linear_starts_as_current_scaling_and_keeps_its_history(device):
    """A layer's first call has nothing recorded: it scales x, the weight and grad_y by their own
    amaxes, the current recipe's values and gradients exactly. After it, each scales by its history:
    an x grown 8x saturates where current scaling follows it."""
    torch.manual_seed(0)
    delayed = patchgemm.GroupedLinear(3, 32, 16, device=device, fp8=DELAYED)
    current = patchgemm.GroupedLinear(3, 32, 16, device=device, fp8=True)
    current.load_state_dict(delayed.state_dict())
    x = randn(24, 3, 32, device=device, requires_grad=True)
    grad_y = randn(24, 3, 16, device=device)
    results = []
    for layer in (delayed, current):
        y = layer(x)
        results.append((y, *torch.autograd.grad(y, [x, layer.weight, layer.bias], grad_y)))
    for got, want in zip(*results):
        assert torch.equal(got, want)
    history = delayed.fp8_history
    for which, t in (("x", x), ("weight", delayed.weight), ("grad", grad_y)):
        assert torch.equal(history.amax(which)[:2], torch.stack([t.detach().abs().max(), torch.zeros((), device=device)]))
    big = x.detach() * 8
    assert not torch.equal(delayed(big), current(big))
    y = delayed(big)  # now the history holds 8x amax: the same scale as current scaling's
    assert torch.equal(y, current(big)) and history.amax("x")[0] == big.abs().max()
    assert "Float8History(x: 16, weight: 16, grad: 16)" == repr(history)
    # The functional form with a history of its own: the same sequence, the same values.
    fresh = patchgemm.Float8History()
    outs = [patchgemm.grouped_linear(t, delayed.weight, delayed.bias, fp8=DELAYED, fp8_history=fresh)
            for t in (x, big, big)]
    delayed.fp8_history.reset()
    assert all(torch.equal(o, delayed(t)) for o, t in zip(outs, (x, big, big)))


@pytest.mark.parametrize("device", DEVICES)
def test_delayed_grouped_mlp_keeps_one_history_per_gemm(device):
    mlp = patchgemm.GroupedMLP(2, 32, 48, bias=True, device=device, fp8=DELAYED)
    x = randn(8, 2, 32, device=device, requires_grad=True)
    mlp(x).sum().backward()
    gate_up, down = mlp.fp8_histories
    assert gate_up.amax("x")[0] == x.detach().abs().max() and down.amax("x")[0] > 0
    assert gate_up.amax("grad")[0] > 0 and down.amax("grad")[0] > 0
    with fp8_autocast(recipe=DELAYED, everywhere=True):  # a region's delayed recipe: the module's own histories
        patchgemm.GroupedMLP(2, 32, 48, device=device)(x)


def test_delayed_scaling_errors():
    with pytest.raises(ValueError, match="scaling must be 'current' or 'delayed', got 'late'"):
        Float8Recipe(scaling="late")
    for bad in (0, 1025, True, 2.0):
        with pytest.raises(ValueError, match="amax_history_len must be an int from 1 to 1024"):
            Float8Recipe(scaling="delayed", amax_history_len=bad)
    x, w = randn(4, 2, 16), randn(2, 8, 16)
    with pytest.raises(ValueError, match="a delayed-scaling recipe keeps an amax history per layer: pass fp8_history"):
        patchgemm.grouped_linear(x, w, fp8=DELAYED)
    with pytest.raises(ValueError, match="pass fp8_history"), fp8_autocast(recipe=DELAYED):
        patchgemm.grouped_linear(x, w)
    with pytest.raises(TypeError, match="fp8_history must be a patchgemm.Float8History or None, got dict"):
        patchgemm.grouped_linear(x, w, fp8=DELAYED, fp8_history={})
    with pytest.raises(TypeError, match="fp8_histories must be two patchgemm.Float8History"):
        patchgemm.grouped_mlp(x, randn(2, 8, 16), randn(2, 16, 4), fp8=DELAYED,
                              fp8_histories=patchgemm.Float8History())
    with pytest.raises(ValueError, match="which must be one of"):
        patchgemm.Float8History().amax("y")
    # Ragged groups and moe_experts keep histories too (tests/test_fp8_ragged.py), and need them.
    rows = randn(6, 16)
    with pytest.raises(ValueError, match="pass fp8_history"):
        patchgemm.grouped_linear(rows, w, group_sizes=[2, 4], fp8=DELAYED)
    with pytest.raises(ValueError, match=r"moe_experts: a delayed-scaling recipe .* pass fp8_histories"):
        patchgemm.moe_experts(rows, torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1), randn(2, 8, 16),
                              randn(2, 16, 4), fp8=DELAYED)


def test_delayed_scaling_compiles_without_graph_breaks():
    """Compiled, a delayed layer's histories update inside the graphs as eager's do: the forward's
    from the first call, grad_y's from the second (the first traced call makes that state, which
    AOTAutograd's backward cannot update; the next call is traced with it made). Against an eager
    twin whose grad_y history is cleared after its first call, values, gradients and histories are
    equal at every step, including steps scaled by the history."""
    torch.manual_seed(0)
    layer = patchgemm.GroupedLinear(2, 32, 16, fp8=DELAYED)
    eager = patchgemm.GroupedLinear(2, 32, 16, fp8=DELAYED)
    eager.load_state_dict(layer.state_dict())
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for step, (scale, grad_scale) in enumerate([(1, 1), (4, 3), (2, 0.5), (1, 2), (0.5, 1)]):
        x, grad_y = randn(16, 2, 32) * scale, randn(16, 2, 16) * grad_scale
        x_eager = x.clone().requires_grad_()
        y = compiled(x.requires_grad_())
        y.backward(grad_y)
        y_eager = eager(x_eager)
        y_eager.backward(grad_y)
        assert torch.equal(y, y_eager) and torch.equal(x.grad, x_eager.grad), step
        assert torch.equal(layer.weight.grad, eager.weight.grad), step
        if step == 0:
            assert (layer.fp8_history.amax("grad") == 0).all()
            eager.fp8_history._states["grad"].zero_()  # (a history all zeros: as made)
        for which in ("x", "weight", "grad"):
            assert torch.equal(layer.fp8_history.amax(which), eager.fp8_history.amax(which)), (step, which)
    assert (layer.fp8_history.amax("grad")[:4] > 0).all()


def test_fp8_compiles_without_graph_breaks():
    layer = patchgemm.GroupedLinear(2, 32, 16, fp8=True)
    x = randn(16, 2, 32, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    y = compiled(x)
    y.sum().backward()
    grad = x.grad.clone()
    x.grad = None
    eager = layer(x)
    eager.sum().backward()
    assert torch.equal(y, eager) and torch.equal(grad, x.grad)


def test_explain_shows_the_fp8_choices():
    with patchgemm.explain() as report:
        patchgemm.grouped_linear(randn(4, 2, 16), randn(2, 16, 16), fp8=True)
    text = str(report)
    assert "quantize_fp8" in text and "scaled_grouped_mm" in text


# ---- a toy training run: FP8 tracks bf16 ----------------------------------------------------------

def train(fp8, device, steps=500):
    torch.manual_seed(0)
    G, D, H = 4, 64, 128
    teacher = [torch.randn(G, H, D, device=device) / D**0.5, torch.randn(G, D, H, device=device) / H**0.5]
    model = torch.nn.Sequential(patchgemm.GroupedLinear(G, D, H, device=device, fp8=fp8), torch.nn.GELU(),
                                patchgemm.GroupedLinear(G, H, D, device=device, fp8=fp8))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    for _ in range(steps):
        x = torch.randn(64, G, D, device=device)
        with torch.no_grad():
            target = patchgemm.grouped_linear(torch.nn.functional.gelu(patchgemm.grouped_linear(x, teacher[0])),
                                              teacher[1])
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = torch.nn.functional.mse_loss(model(x).float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.bfloat16):  # held-out loss
        x = torch.randn(4096, G, D, device=device, generator=torch.Generator(device).manual_seed(1))
        target = patchgemm.grouped_linear(torch.nn.functional.gelu(patchgemm.grouped_linear(x, teacher[0])),
                                          teacher[1])
        return torch.nn.functional.mse_loss(model(x).float(), target.float()).item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", [Float8Recipe(), DELAYED], ids=["current", "delayed"])
def test_toy_training_fp8_loss_within_2_percent_of_bf16(device, recipe):
    bf16, fp8 = train(False, device), train(recipe, device)
    first = train(recipe, device, steps=0)
    assert fp8 < 0.5 * first  # it learned
    assert abs(fp8 - bf16) <= 0.02 * bf16, f"FP8 loss {fp8:.5g} vs bf16 {bf16:.5g}"
