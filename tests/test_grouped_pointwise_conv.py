"""grouped_pointwise_conv (F.conv*d with kernel 1 and groups > 1): values and gradients of every
implementation against float64, memory formats, convert(), gradcheck, opcheck, compile, bad input."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchgemm
from conftest import DEVICES, DTYPES, assert_close_to_ref, needs_gpu, poison_allocator, randn

ops = torch.ops.patchgemm
CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
OPS = ("grouped_pointwise_conv", "grouped_pointwise_conv_grad_input", "grouped_pointwise_conv_grad_weight")
# A forced candidate per op (grad_weight has its own second candidate).
FORCES = {
    "strided_batched": dict.fromkeys(OPS, "strided_batched"),
    "aten_matmul": {OPS[0]: "aten_matmul", OPS[1]: "aten_matmul", OPS[2]: "aten_einsum"},
    "aten_conv": {OPS[0]: "aten_conv", OPS[1]: "aten_conv", OPS[2]: "aten_einsum"},
}


def make_x(batch, channels, spatial, dtype, device, channels_last):
    x = randn(batch, channels, *spatial, dtype=dtype, device=device)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last if len(spatial) == 2 else torch.channels_last_3d)
    return x.requires_grad_()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", list(FORCES))
@pytest.mark.parametrize("spatial, channels_last", [((9,), False), ((4, 5), False), ((4, 5), True), ((2, 3, 4), True)])
@pytest.mark.parametrize("bias", [True, False])
def test_every_impl_matches_float64_conv(device, dtype, impl, spatial, channels_last, bias):
    groups, c_in, c_out, batch = 4, 12, 8, 3
    x = make_x(batch, c_in, spatial, dtype, device, channels_last)
    weight = randn(c_out, c_in // groups, *(1,) * len(spatial), dtype=dtype, device=device, requires_grad=True)
    b = randn(c_out, dtype=dtype, device=device, requires_grad=True) if bias else None
    inputs = [x, weight] + ([b] if bias else [])
    poison_allocator(x.numel() * x.element_size(), device)
    with patchgemm.force(**FORCES[impl]):
        y = patchgemm.grouped_pointwise_conv(x, weight, b, groups)
        grad_y = randn(*y.shape, dtype=dtype, device=device)
        grads = torch.autograd.grad(y, inputs, grad_y)
    refs = [t.detach().double().cpu().requires_grad_(True) for t in inputs]
    ref = CONV[len(spatial)](refs[0], refs[1], refs[2] if bias else None, groups=groups)
    ref_grads = torch.autograd.grad(ref, refs, grad_y.double().cpu())
    # The conv's memory format: channels_last in, channels_last out (and for dx).
    fmt = (torch.channels_last if len(spatial) == 2 else torch.channels_last_3d) if channels_last else torch.contiguous_format
    assert y.is_contiguous(memory_format=fmt) and grads[0].is_contiguous(memory_format=fmt)
    assert y.dtype == dtype
    assert_close_to_ref(y, ref, dtype, "y")
    for name, g, r in zip(["x", "weight", "bias"], grads, ref_grads):
        assert_close_to_ref(g, r, dtype, f"grad {name}")


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_unbatched_input(device):
    weight = randn(6, 2, 1, device=device)
    x = randn(2, 10, 7, device=device)[:, 2:8]  # a channel slice: copied once
    assert_close_to_ref(patchgemm.grouped_pointwise_conv(x, weight, groups=3), F.conv1d(x, weight, groups=3),
                        torch.float32)
    x = randn(6, 7, device=device)
    assert_close_to_ref(patchgemm.grouped_pointwise_conv(x, weight, groups=3), F.conv1d(x, weight, groups=3),
                        torch.float32)


# The small-group kernels (csrc/kernels/gemm/sm80/small_group_gemm.cu, CUDA, 16-bit, channels-first
# x): (batch, groups, c_in, c_out, spatial) covering 1 to 8 k-steps, both warp layouts (at most 16
# rows: 4 x 2 warps of 32 rows; more: 8 x 2 of 16) with dead warps and rows (c_out 17, 33, 40, 100),
# ragged position tiles (L % 128 != 0), tiles whose block meets a second group, several position
# ranges per group in the weight gradient, and a single range (few positions).
SMALL_GROUP_CASES = [
    (3, 5, 16, 16, (136,)),
    (2, 64, 100, 100, (1024,)),
    (1, 3, 128, 128, (8, 40)),
    (4, 7, 3, 33, (1000,)),
    (2, 9, 72, 8, (24,)),
    (8, 2, 40, 120, (16, 16, 16)),
    (1, 1, 128, 64, (8,)),
    (5, 3, 24, 40, (6, 128)),  # 6 position tiles: members of a pair take every other one
    (2, 4, 24, 17, (200,)),  # one row past the first row of warps
]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SMALL_GROUP_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_small_group_kernels_match_float64(dtype, case, bias):
    batch, groups, c_in, c_out, spatial = case
    x = make_x(batch, groups * c_in, spatial, dtype, "cuda", False)
    weight = randn(groups * c_out, c_in, *(1,) * len(spatial), dtype=dtype, device="cuda", requires_grad=True)
    b = randn(groups * c_out, dtype=dtype, device="cuda", requires_grad=True) if bias else None
    inputs = [x, weight] + ([b] if bias else [])
    poison_allocator(x.numel() // c_in * c_out * x.element_size(), "cuda")
    with patchgemm.force(**dict.fromkeys(OPS, "small_groups")), patchgemm.explain() as e:
        y = patchgemm.grouped_pointwise_conv(x, weight, b, groups)
        grad_y = randn(*y.shape, dtype=dtype, device="cuda")
        grads = torch.autograd.grad(y, inputs, grad_y)
    assert {c.chosen for c in e} == {"small_groups"} and len(e) == 3, [str(c) for c in e]
    refs = [t.detach().double().cpu().requires_grad_(True) for t in inputs]
    ref = CONV[len(spatial)](refs[0], refs[1], refs[2] if bias else None, groups=groups)
    ref_grads = torch.autograd.grad(ref, refs, grad_y.double().cpu())
    assert y.is_contiguous() and grads[0].is_contiguous()
    assert_close_to_ref(y, ref, dtype, "y")
    for name, g, r in zip(["x", "weight", "bias"], grads, ref_grads):
        assert_close_to_ref(g, r, dtype, f"grad {name}")


@needs_gpu
@pytest.mark.parametrize("bias", [True, False])
def test_small_group_weight_grad_is_deterministic(bias):
    """Several blocks per group sum their ranges in one fixed order: two runs agree bit for bit."""
    x = randn(4, 3 * 100, 4096, dtype=torch.bfloat16, device="cuda")
    grad_y = randn(4, 3 * 72, 4096, dtype=torch.bfloat16, device="cuda")
    with patchgemm.force(grouped_pointwise_conv_grad_weight="small_groups"):
        first, second = (torch.ops.patchgemm.grouped_pointwise_conv_grad_weight(grad_y, x, 3, bias) for _ in range(2))
    ref_w = torch.einsum("bgml,bgkl->gmk", grad_y.double().view(4, 3, 72, -1), x.double().view(4, 3, 100, -1))
    assert_close_to_ref(first[0].view(3, 72, 100), ref_w, torch.bfloat16, "grad weight")
    if bias:
        assert_close_to_ref(first[1], grad_y.double().sum((0, 2)), torch.bfloat16, "grad bias")
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@needs_gpu
@pytest.mark.parametrize("case", SMALL_GROUP_CASES)
def test_small_group_fp32_runs_in_tf32_where_the_conv_would(case):
    """fp32 forward and input gradient on the small-group kernel in TF32, under
    torch.backends.cudnn.allow_tf32 as F.conv*d; the weight gradient stays on cuBLAS."""
    batch, groups, c_in, c_out, spatial = case
    x = make_x(batch, groups * c_in, spatial, torch.float32, "cuda", False)
    weight = randn(groups * c_out, c_in, *(1,) * len(spatial), device="cuda", requires_grad=True)
    b = randn(groups * c_out, device="cuda", requires_grad=True)
    with patchgemm.force(grouped_pointwise_conv="small_groups"):  # TF32 off (conftest): a clear refusal
        with pytest.raises(RuntimeError, match="cudnn.allow_tf32 is off"):
            patchgemm.grouped_pointwise_conv(x, weight, b, groups)
    torch.backends.cudnn.allow_tf32 = True
    poison_allocator(x.numel() // c_in * c_out * 4, "cuda")
    with patchgemm.explain() as e:
        y = patchgemm.grouped_pointwise_conv(x, weight, b, groups)
        grad_y = randn(*y.shape, device="cuda")
        grads = torch.autograd.grad(y, [x, weight, b], grad_y)
    assert [c.chosen for c in e][:2] == ["small_groups"] * 2, [str(c) for c in e]
    refs = [t.detach().double().cpu().requires_grad_(True) for t in (x, weight, b)]
    ref = CONV[len(spatial)](*refs, groups=groups)
    ref_grads = torch.autograd.grad(ref, refs, grad_y.double().cpu())
    assert_close_to_ref(y, ref, torch.float32, "y", tol=2e-3)  # TF32: 10-bit mantissas, rounded
    assert_close_to_ref(grads[0], ref_grads[0], torch.float32, "grad x", tol=2e-3)


@needs_gpu
def test_small_group_kernels_are_the_default_and_decline_clearly():
    x = randn(2, 256, 64, dtype=torch.bfloat16, device="cuda")
    weight = randn(256, 32, 1, dtype=torch.bfloat16, device="cuda")
    (choice,) = patchgemm.explain(patchgemm.grouped_pointwise_conv, x, weight, None, 8)
    assert choice.chosen == "small_groups", str(choice)
    # Positions per sample not a multiple of 8: another candidate runs; forcing it names the reason.
    x = randn(2, 256, 60, dtype=torch.bfloat16, device="cuda")
    (choice,) = patchgemm.explain(patchgemm.grouped_pointwise_conv, x, weight, None, 8)
    assert choice.chosen != "small_groups", str(choice)
    with patchgemm.force(grouped_pointwise_conv="small_groups"):
        with pytest.raises(RuntimeError, match="does not apply.*multiple of 8"):
            patchgemm.grouped_pointwise_conv(x, weight, None, 8)
    # Groups wider than 128 channels, fp32 without TF32 (conftest), channels_last: not this kernel's.
    for x, w in [(randn(2, 512, 64, dtype=torch.bfloat16, device="cuda"), randn(512, 256, 1, dtype=torch.bfloat16, device="cuda")),
                 (randn(2, 256, 64, device="cuda"), randn(256, 128, 1, device="cuda")),
                 (randn(2, 256, 8, 8, dtype=torch.bfloat16, device="cuda").contiguous(memory_format=torch.channels_last),
                  randn(256, 128, 1, 1, dtype=torch.bfloat16, device="cuda"))]:
        (choice,) = patchgemm.explain(patchgemm.grouped_pointwise_conv, x, w, None, 2)
        assert choice.chosen != "small_groups", str(choice)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_channels_first_rule_follows_the_bf16_gemm(dtype):
    """On the CPU, channels-first x takes torch.matmul's one batched GEMM, except bfloat16 where
    ATen's own bf16 loop runs the GEMMs (no oneDNN: below AVX-512), which per-sample GEMMs lay out
    for (kernels/gemm/gemm_cpu.cpp)."""
    x = randn(2, 32, 16, dtype=dtype)
    w = randn(32, 8, 1, dtype=dtype)
    with patchgemm.explain() as e:
        patchgemm.grouped_pointwise_conv(x, w, None, 4)
    (call,) = [c for c in e if c.op == "grouped_pointwise_conv"]
    onednn = torch.backends.cpu.get_cpu_capability() == "AVX512"
    per_sample = dtype == torch.bfloat16 and not onednn
    assert call.chosen == ("strided_batched" if per_sample else "aten_matmul"), str(e)


def test_gradcheck_opcheck_and_compile():
    x = randn(2, 6, 5, dtype=torch.float64, requires_grad=True)
    weight = randn(4, 3, 1, dtype=torch.float64, requires_grad=True)
    bias = randn(4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: patchgemm.grouped_pointwise_conv(*a, groups=2), (x, weight, bias))
    torch.library.opcheck(ops.grouped_pointwise_conv.default, (x, weight, bias, 2))
    x4 = randn(2, 6, 3, 4, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    torch.library.opcheck(ops.grouped_pointwise_conv.default, (x4, weight.detach().view(4, 3, 1, 1), None, 2))
    torch.library.opcheck(ops.grouped_pointwise_conv_grad_input.default, (randn(2, 4, 5, dtype=torch.float64), weight.detach(), 2))
    for with_bias in (False, True):
        torch.library.opcheck(ops.grouped_pointwise_conv_grad_weight.default,
                              (randn(2, 4, 5, dtype=torch.float64), x.detach(), 2, with_bias))
    model = patchgemm.GroupedPointwiseConv(6, 4, 2, dtype=torch.float64)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    assert_close_to_ref(out, F.conv1d(x, model.weight, model.bias, groups=2), torch.float64)
    assert model.weight.grad is not None


def test_convert_swaps_grouped_pointwise_convs():
    """Grouped 1 x 1 convs become GroupedPointwiseConv; depthwise ones (a per-channel scale) and
    ungrouped ones stay convs, with a reason."""
    model = nn.Sequential(nn.Conv2d(8, 8, 1, groups=4), nn.Conv2d(8, 8, 3, padding=1, groups=4), nn.Conv1d(8, 8, 1),
                          nn.Conv2d(8, 16, 1, groups=2, bias=False), nn.Conv2d(16, 16, 1, groups=16))
    report = patchgemm.convert(model, inplace=False)
    converted = report.model
    assert isinstance(converted[0], patchgemm.GroupedPointwiseConv)
    assert isinstance(converted[3], patchgemm.GroupedPointwiseConv) and converted[3].bias is None
    skipped = dict(report.skipped)
    assert isinstance(converted[1], nn.Conv2d) and "1" in skipped
    assert isinstance(converted[4], nn.Conv2d) and "per-channel scale" in skipped["4"]
    assert converted[0].weight is not model[0].weight  # a copy: inplace=False
    assert set(converted.state_dict()) == set(model.state_dict())  # checkpoints still load
    x = randn(2, 8, 5, 6)
    assert_close_to_ref(converted[3](converted[0](x)), model[3](model[0](x)), torch.float32)


@pytest.mark.parametrize("make, error, match", [
    (lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 6, 5), torch.randn(4, 3, 3), groups=2), RuntimeError,
     "kernel must be 1"),
    (lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 6, 5), torch.randn(4, 2, 1), groups=2), RuntimeError,
     "expects 4"),
    (lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 6, 5), torch.randn(5, 3, 1), groups=2), RuntimeError,
     "multiple of groups"),
    (lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 6, 5), torch.randn(4, 3, 1), torch.randn(3), groups=2),
     RuntimeError, r"bias must be \[C_out\]"),
    (lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 6, 5), torch.randn(4, 3, 1), groups=0), RuntimeError,
     "groups must be >= 1"),
    (lambda: patchgemm.GroupedPointwiseConv(6, 4, 4), ValueError, "must divide"),
])
def test_bad_input_is_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_16bit_weight_grad_sums_in_fp32_like_the_conv(dtype):
    """The weight gradient of 2 groups of 16 x 16 over 8192 positions: a long reduction into one tile
    per group, where cuBLAS splits K. torch's matmul flag (on by default) lets einsum round the partial
    sums to 16 bits; the conv's cuDNN sums in fp32. Every candidate that runs must be as accurate."""
    flags = torch.backends.cuda.matmul
    old = flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction
    flags.allow_bf16_reduced_precision_reduction = flags.allow_fp16_reduced_precision_reduction = True
    try:
        x, w, dy = randn(1, 32, 8192), randn(32, 16, 1) / 4, randn(1, 32, 8192)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        (ref,) = torch.autograd.grad(F.conv1d(xr, wr, groups=2), wr, dy)
        args = [t.to("cuda", dtype).requires_grad_() for t in (x, w)]
        (conv,) = torch.autograd.grad(F.conv1d(*args, groups=2), args[1], dy.to("cuda", dtype))
        conv_err = ((conv.double().cpu() - ref).norm() / ref.norm()).item()
        ran = []
        for name in {c.name for c in patchgemm.kernels(OPS[2])}:
            try:
                with patchgemm.force(**{OPS[2]: name}):
                    (g,) = torch.autograd.grad(patchgemm.grouped_pointwise_conv(*args, groups=2), args[1],
                                               dy.to("cuda", dtype))
            except RuntimeError as err:
                assert "does not apply" in str(err), err
                continue
            err = ((g.double().cpu() - ref).norm() / ref.norm()).item()
            assert err <= 2 * conv_err, f"{name}: relative error {err:.3g}, the conv's {conv_err:.3g}"
            ran.append(name)
        assert "strided_batched" in ran, ran
    finally:
        flags.allow_bf16_reduced_precision_reduction, flags.allow_fp16_reduced_precision_reduction = old
