"""FP8 kernel == stride convolutions: patch_embed / patch_unembed against float64 of their quantized
operands, the modules and stems, errors, compile, explain."""

import math

import pytest
import torch

import patchgemm
from patchgemm import Float8Recipe, fp8_autocast
from conftest import DEVICES, assert_close_to_ref, randn, rel_error
from fp8_cases import E4M3, E5M2, deq


# ---- kernel == stride convolutions in FP8 ---------------------------------------------------------

# (x shape, weight shape): 1-, 2- and 3-D, sizes the patch divides and sizes it does not (the conv
# leaves the last positions out), K and E multiples of 16 (cuBLASLt's FP8) and not.
EMBED_CASES = [((2, 3, 32, 32), (16, 3, 8, 8)), ((2, 4, 17, 35), (32, 4, 4, 4)), ((3, 1, 64), (16, 1, 16)),
               ((1, 2, 8, 8, 8), (16, 2, 2, 2, 2)), ((2, 3, 10, 10), (5, 3, 3, 3))]
CONVS = {1: torch.nn.functional.conv1d, 2: torch.nn.functional.conv2d, 3: torch.nn.functional.conv3d}
CONV_TS = {1: torch.nn.functional.conv_transpose1d, 2: torch.nn.functional.conv_transpose2d,
           3: torch.nn.functional.conv_transpose3d}


# ---- the patch matrix: the FP8 paths' gather and its adjoint scatter -------------------------------

def patch_matrix_ref(x, kernel):
    """[B * N, C * prod(k)] by a permute copy: rows in row-major grid order, columns (c, k...)."""
    rank, (batch, channels) = len(kernel), x.shape[:2]
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    split = x.reshape(batch, channels, *(n for g, k in zip(grid, kernel) for n in (g, k)))
    order = (0, *range(2, 2 + 2 * rank, 2), 1, *range(3, 3 + 2 * rank, 2))
    return split.permute(order).reshape(-1, channels * math.prod(kernel))


# The last two: rows of runs 6 and 24 KB apart, which the CPU copies in chunks (the last one shorter).
MATRIX_CASES = [((2, 3, 32, 32), (8, 8)), ((3, 1, 64), (16,)), ((1, 2, 8, 8, 8), (2, 2, 2)), ((2, 5, 6, 10), (3, 5)),
                ((4, 192, 16, 16, 16), (2, 2, 2)), ((0, 3, 8, 8), (4, 4)), ((2, 384, 2040), (4,)),
                ((1, 384, 100, 100), (4, 4))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced"])
@pytest.mark.parametrize("case", MATRIX_CASES, ids=lambda c: "x".join(map(str, c[0])))
def test_patch_matrix_is_the_permuted_copy_and_its_backward_the_scatter(device, dtype, layout, case):
    x_shape, kernel = case
    x = randn(*x_shape, dtype=dtype, device=device)
    if layout == "channels_last" and x.dim() in (4, 5):
        x = x.to(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    elif layout == "sliced":  # every other channel of a wider x: no unit-stride channel runs
        x = randn(x_shape[0], 2 * x_shape[1], *x_shape[2:], dtype=dtype, device=device)[:, ::2]
    p = torch.ops.patchgemm.patch_matrix(x, list(kernel))
    ref = patch_matrix_ref(x, kernel)
    assert p.shape == ref.shape and p.is_contiguous() and p.dtype == dtype
    assert torch.equal(p, ref)
    assert torch.equal(torch.ops.patchgemm.patch_matrix(x, list(kernel)), p)  # bitwise on a repeat
    g = randn(*p.shape, dtype=dtype, device=device)
    back = torch.ops.patchgemm.patch_matrix_backward(g, list(x.shape), list(kernel))
    assert back.shape == x.shape and back.is_contiguous()
    xr = x.detach().clone().requires_grad_()
    patch_matrix_ref(xr, kernel).backward(g)
    assert torch.equal(back, xr.grad)


def test_patch_matrix_gradients_and_opcheck():
    x = torch.randn(2, 3, 4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.patchgemm.patch_matrix(t, [2, 3]), (x,))
    assert torch.autograd.gradgradcheck(lambda t: torch.ops.patchgemm.patch_matrix(t, [2, 3]), (x,))
    g = torch.randn(8, 18, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch.ops.patchgemm.patch_matrix_backward(t, [2, 3, 4, 6], [2, 3]), (g,))
    torch.library.opcheck(torch.ops.patchgemm.patch_matrix, (x.detach(), [2, 3]))
    torch.library.opcheck(torch.ops.patchgemm.patch_matrix_backward, (g.detach(), [2, 3, 4, 6], [2, 3]))


def test_patch_matrix_bad_input_is_a_clear_error():
    x = randn(2, 3, 8, 8)
    with pytest.raises(RuntimeError, match=r"patch_matrix: spatial size \[8, 8\] of x .* not divisible"):
        torch.ops.patchgemm.patch_matrix(x, [3, 3])
    with pytest.raises(RuntimeError, match="patch_matrix: x must be \\[B, C, D, H, W\\] for a 3-D kernel"):
        torch.ops.patchgemm.patch_matrix(x, [2, 2, 2])
    with pytest.raises(RuntimeError, match="kernel sizes must be >= 1"):
        torch.ops.patchgemm.patch_matrix(x, [0, 2])
    with pytest.raises(RuntimeError, match=r"patch_matrix_backward: grad must be \[32, 12\]"):
        torch.ops.patchgemm.patch_matrix_backward(randn(32, 13), [2, 3, 8, 8], [2, 2])


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
