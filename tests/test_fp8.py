"""FP8 grouped linears (patchgemm.fp8): quantization, the FP8 grouped GEMM against float64 of the
dequantized operands, the autograd recipe, the switches, compile, and a toy training run against
bf16. On the CPU the GEMM is emulated exactly (dequantized_bmm); on sm_89+ GPUs cuBLASLt's FP8 runs."""

import pytest
import torch

import patchgemm
from patchgemm import Float8Recipe, fp8_autocast
from conftest import DEVICES, HAS_GPU, assert_close_to_ref, poison_allocator, randn, rel_error

ops = torch.ops.patchgemm
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Relative spacing of each format's values (3 and 2 mantissa bits): rounding to nearest errs by at
# most half of it per element.
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HAS_FP8_GPU = HAS_GPU and torch.version.cuda is not None and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(not HAS_FP8_GPU, reason="needs an sm_89+ NVIDIA GPU")


def dequantized(data, scale):
    return data.double() * scale.double()


def quantize(x, fmt):
    """(data, scale) of quantize_fp8 without the transposed copy."""
    data, _, scale = ops.quantize_fp8(x, fmt)
    return data, scale


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
    data, data_t, scale = ops.quantize_fp8(x, E5M2, True, True)
    assert data_t.shape == (*shape[:-2], shape[-1], shape[-2]) and data_t.is_contiguous()
    assert torch.equal(data_t.view(torch.uint8), data.transpose(-2, -1).contiguous().view(torch.uint8))
    none, only_t, again = ops.quantize_fp8(x, E5M2, False, True)
    assert none.numel() == 0 and torch.equal(again, scale)
    assert torch.equal(only_t.view(torch.uint8), data_t.view(torch.uint8))


@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 1000, 1024 + 3), (3, 1000, 1024 + 4), (2, 1000, 1024 + 8)],
                         ids=["by1", "by4", "by8"])  # the transposing kernel's widths, edges in rows and columns
def test_fused_quantize_is_bitwise_aten(dtype, fmt, transposed, shape):
    """At scale (a grid-stride loop over more tiles than the grid has blocks) and with ragged edges."""
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


# ---- scaled_grouped_mm: the FP8 grouped GEMM ------------------------------------------------------

def quantized(shape, device, fmt=E4M3, scale=1.0):
    return quantize(randn(*shape, device=device) * scale, fmt)


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
    with fp8_autocast():
        quantized_y = plain(x)
        assert torch.equal(never(x), exact)  # a module's own choice wins
        with fp8_autocast(enabled=False):
            assert torch.equal(plain(x), exact)
    assert torch.equal(plain(x), exact)  # the region is over
    assert not torch.equal(quantized_y, exact) and rel_error(quantized_y, exact) < 0.06


@pytest.mark.parametrize("device", DEVICES)
def test_grouped_mlp_fp8_matches_its_region(device):
    x = randn(16, 2, 32, device=device)
    mlp = patchgemm.GroupedMLP(2, 32, 64, device=device)
    mlp8 = patchgemm.GroupedMLP(2, 32, 64, device=device, fp8=True)
    mlp8.load_state_dict(mlp.state_dict())
    with fp8_autocast():
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


@needs_fp8_gpu
@pytest.mark.parametrize("candidate", ["aten_scaled_grouped_mm", "cublaslt_fp8_loop", "dequantized_loop"])
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
    with fp8_autocast():
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


# ---- kernel == stride convolutions in FP8 ---------------------------------------------------------

def deq(t, fmt):
    """t quantized to fmt and back, in float64: the exact operand an FP8 GEMM multiplies."""
    data, scale = quantize(t.detach().contiguous(), fmt)
    return dequantized(data, scale)


# (x shape, weight shape): 1-, 2- and 3-D, sizes the patch divides and sizes it does not (the conv
# leaves the last positions out), K and E multiples of 16 (cuBLASLt's FP8) and not.
EMBED_CASES = [((2, 3, 32, 32), (16, 3, 8, 8)), ((2, 4, 17, 35), (32, 4, 4, 4)), ((3, 1, 64), (16, 1, 16)),
               ((1, 2, 8, 8, 8), (16, 2, 2, 2, 2)), ((2, 3, 10, 10), (5, 3, 3, 3))]
CONVS = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}
CONV_TS = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
           3: torch.nn.functional.conv_transpose3d}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", EMBED_CASES, ids=lambda c: "x".join(map(str, c[0])))
@pytest.mark.parametrize("out_format", ["channels_first", "tokens"])
def test_patch_embed_fp8_matches_float64_of_its_quantized_operands(device, dtype, case, out_format):
    """Forward and all three gradients against the conv in float64 of the values the recipe
    quantizes: the patches (x's values), the weight and the output gradient."""
    (x_shape, w_shape), rank = case, len(case[1]) - 2
    x = randn(*x_shape, dtype=dtype, device=device, requires_grad=True)
    w = randn(*w_shape, dtype=dtype, device=device, requires_grad=True)
    b = randn(w_shape[0], dtype=dtype, device=device, requires_grad=True)
    y = patchgemm.patch_embed(x, w, b, out_format=out_format, fp8=True)
    assert y.dtype == dtype
    grad_y = randn(*y.shape, dtype=dtype, device=device)
    y.backward(grad_y)
    recipe = Float8Recipe()
    whole = x[(slice(None), slice(None), *(slice(0, s - s % k) for s, k in zip(x_shape[2:], w_shape[2:])))]
    x64 = deq(whole, recipe.forward_format).requires_grad_()
    w64 = deq(w, recipe.forward_format).requires_grad_()
    b64 = b.detach().double().requires_grad_()
    ref = CONVS[rank](x64, w64, b64, stride=w_shape[2:])
    grad64 = deq(grad_y, recipe.backward_format)
    if out_format == "tokens":
        ref = ref.flatten(2).transpose(1, 2)
    else:
        assert y.is_contiguous()  # as the conv returns it for contiguous x
    ref.backward(grad64)
    ref_gx = torch.zeros(x_shape, dtype=torch.float64, device=device)
    ref_gx[(slice(None), slice(None), *(slice(0, n) for n in x64.shape[2:]))] = x64.grad
    assert_close_to_ref(y, ref, torch.bfloat16, "y")
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-4
    assert_close_to_ref(x.grad, ref_gx, dtype, "grad_x", tol=tol)
    assert_close_to_ref(w.grad, w64.grad, dtype, "grad_weight", tol=tol)
    assert_close_to_ref(b.grad, grad_y.double().sum(tuple(range(grad_y.dim() - 1)) if out_format == "tokens"
                                                    else (0, *range(2, grad_y.dim()))), dtype, "grad_bias", tol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [((2, 16, 4, 4), (16, 3, 8, 8)), ((2, 32, 5, 3), (32, 4, 2, 2)),
                                  ((2, 16, 4), (16, 1, 16)), ((1, 16, 2, 3, 2), (16, 2, 2, 2, 2))],
                         ids=lambda c: "x".join(map(str, c[0])))
@pytest.mark.parametrize("in_format", ["channels_first", "tokens"])
def test_patch_unembed_fp8_matches_float64_of_its_quantized_operands(device, case, in_format):
    (x_shape, w_shape), rank = case, len(case[1]) - 2
    x = randn(*x_shape, device=device, requires_grad=True)
    w = randn(*w_shape, device=device, requires_grad=True)
    b = randn(w_shape[1], device=device, requires_grad=True)
    tokens = in_format == "tokens"
    given = x.flatten(2).transpose(1, 2) if tokens else x
    y = patchgemm.patch_unembed(given, w, b, in_format=in_format, grid=x_shape[2:] if tokens else None, fp8=True)
    assert y.is_contiguous() and y.dtype == torch.float32
    grad_y = randn(*y.shape, device=device)
    y.backward(grad_y)
    x64 = deq(x, E4M3).requires_grad_()
    w64 = deq(w, E4M3).requires_grad_()
    b64 = b.detach().double().requires_grad_()
    ref = CONV_TS[rank](x64, w64, b64, stride=w_shape[2:])
    ref.backward(deq(grad_y, E5M2))
    assert_close_to_ref(y, ref, torch.bfloat16, "y")
    assert_close_to_ref(x.grad, x64.grad, torch.float32, "grad_x", tol=2e-4)
    assert_close_to_ref(w.grad, w64.grad, torch.float32, "grad_weight", tol=2e-4)
    # The bias gradient sums the output gradient itself, not its FP8 copy, in fp32: within fp32's
    # rounding of each channel's sum, bounded by the sum of the magnitudes it adds (a sum that
    # cancels to a small value keeps the absolute error of its terms: against the value itself a
    # relative bound fails on some random draws).
    dims = (0, *range(2, grad_y.dim()))
    bias_err = (b.grad.double() - grad_y.double().sum(dims)).abs()
    assert (bias_err <= 1e-6 * grad_y.double().abs().sum(dims)).all(), bias_err


@pytest.mark.parametrize("device", DEVICES)
def test_patch_modules_run_fp8_when_asked_and_regions_leave_them(device):
    """fp8=True (or a recipe) on the module or the call; an fp8_autocast region does not reach
    patch embeddings (FP8 is slower than bf16 there, bench/fp8.py)."""
    embed = patchgemm.PatchEmbed(3, 32, 8, device=device)
    unembed = patchgemm.PatchUnembed(32, 3, 8, device=device)
    embed8 = patchgemm.PatchEmbed(3, 32, 8, device=device, fp8=True)
    unembed8 = patchgemm.PatchUnembed(32, 3, 8, device=device, fp8=Float8Recipe(fast_accumulation=False))
    embed8.load_state_dict(embed.state_dict())
    unembed8.load_state_dict(unembed.state_dict())
    x = randn(2, 3, 32, 32, device=device)
    exact_tokens, exact_image = embed(x), unembed(embed(x))
    with fp8_autocast():
        assert torch.equal(embed(x), exact_tokens) and torch.equal(unembed(embed(x)), exact_image)
    tokens = embed8(x)
    assert torch.equal(tokens, patchgemm.patch_embed(x, embed.weight, embed.bias, fp8=True))
    image = unembed8(exact_tokens)
    assert 0 < rel_error(tokens, exact_tokens) < 0.06 and 0 < rel_error(image, exact_image) < 0.06
    assert "fp8=True" in repr(embed8) and "fp8" not in repr(embed)
    with pytest.raises(TypeError, match="fp8 must be None, a bool or a patchgemm.Float8Recipe"):
        patchgemm.PatchUnembed(32, 3, 8, fp8="yes")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("in_format", ["channels_first", "tokens"])
def test_hierarchical_stems_in_fp8(device, in_format):
    """A MATEY-style 3-D stem and its inverse: FP8 stage by stage when asked, close to full
    precision; a region leaves them as they are."""
    embed = patchgemm.HierarchicalPatchEmbed(4, 64, (4, 2, 2), hidden_dim=32, device=device)
    unembed = patchgemm.HierarchicalPatchUnembed(64, 4, (4, 2, 2), hidden_dim=32, in_format=in_format,
                                                 device=device)
    x = randn(2, 4, 32, 16, 16, device=device, requires_grad=True)
    grid = (2, 1, 1)

    def run():
        z = embed(x)
        return unembed(z.flatten(2).transpose(1, 2), grid) if in_format == "tokens" else unembed(z)
    exact = run()
    with fp8_autocast():
        assert torch.equal(run(), exact)
    embed.fp8 = unembed.fp8 = True
    y = run()
    y.square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and torch.isfinite(embed.stages[0].weight.grad).all()
    assert 0 < rel_error(y, exact) < 0.2  # six FP8 GEMMs in a row, ~3.5% each, and the norms between


def test_patch_fp8_bad_input_is_a_clear_error():
    w = randn(16, 3, 4, 4)
    with pytest.raises(RuntimeError, match="x has 2 channels"):
        patchgemm.patch_embed(randn(1, 2, 8, 8), w, fp8=True)
    with pytest.raises(RuntimeError, match="smaller than one patch"):
        patchgemm.patch_embed(randn(1, 3, 2, 8), w, fp8=True)
    with pytest.raises(TypeError, match="FP8 needs float32, float16 or bfloat16 x"):
        patchgemm.patch_embed(randn(1, 3, 8, 8, dtype=torch.float64), w, fp8=True)
    with pytest.raises(RuntimeError, match=r"bias must be \[16\]"):
        patchgemm.patch_embed(randn(1, 3, 8, 8), w, randn(3), fp8=True)
    with pytest.raises(RuntimeError, match="must be tokens"):
        patchgemm.patch_unembed(randn(1, 5, 16), w, in_format="tokens", grid=(2, 2), fp8=True)
    with pytest.raises(RuntimeError, match=r"must be \[B, 16, \*grid\]"):
        patchgemm.patch_unembed(randn(1, 8, 2, 2), w, fp8=True)


def test_patch_embed_fp8_compiles_without_graph_breaks():
    layer = patchgemm.PatchEmbed(3, 32, 8, out_format="tokens", fp8=True)
    x = randn(2, 3, 32, 32, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    y.sum().backward()
    grad, x.grad = x.grad.clone(), None
    eager = layer(x)
    eager.sum().backward()
    assert torch.equal(y, eager) and torch.equal(grad, x.grad)


def test_explain_shows_the_patch_fp8_choices():
    with patchgemm.explain() as report:
        patchgemm.patch_embed(randn(1, 3, 16, 16), randn(16, 3, 8, 8), fp8=True)
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
def test_toy_training_fp8_loss_within_2_percent_of_bf16(device):
    bf16, fp8 = train(False, device), train(True, device)
    first = train(True, device, steps=0)
    assert fp8 < 0.5 * first  # it learned
    assert abs(fp8 - bf16) <= 0.02 * bf16, f"FP8 loss {fp8:.5g} vs bf16 {bf16:.5g}"
