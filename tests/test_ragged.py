"""Ragged grouped linear (groups of different row counts): values and gradients of every
implementation against a float64 loop, empty groups, sizes vs offsets on the CPU and the GPU,
gradcheck, opcheck, torch.compile, bad input."""

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from conftest import DEVICES, DTYPES, HAS_GPU, assert_close_to_ref, needs_gpu, poison_allocator, randn, syncs_forbidden

ops = torch.ops.patchgemm
IMPLS = ["aten_grouped_mm", "loop"] + (["cublas_grouped", "ragged_mma", "ragged_tiles"] if HAS_GPU else [])
OPS = ("ragged_grouped_linear", "ragged_grouped_linear_grad_input", "ragged_grouped_linear_grad_weight")


def reference(x, weight, bias, sizes):
    """A float64 loop of F.linear over the row groups (differentiable)."""
    x, weight = x.double().cpu(), weight.double().cpu()
    bias = None if bias is None else bias.double().cpu()
    outs, start = [], 0
    for g, n in enumerate(sizes):
        outs.append(F.linear(x[start:start + n], weight[g], None if bias is None else bias[g]))
        start += n
    return torch.cat(outs, 0)


def applies(impl, dtype, device, din=16, dout=24):
    if impl == "ragged_tiles":
        return device == "cuda"
    if impl == "ragged_mma":
        return device == "cuda" and dtype in (torch.float16, torch.bfloat16) and torch.cuda.get_device_capability()[0] >= 8
    if impl == "cublas_grouped":
        return device == "cuda" and dtype != torch.float64
    if impl == "aten_grouped_mm":
        if device == "cuda":
            return dtype == torch.bfloat16 and torch.cuda.get_device_capability()[0] >= 9
        return dtype != torch.float64 and all(d * torch.finfo(dtype).bits // 8 % 16 == 0 for d in (din, dout))
    return True


def run(x, weight, bias, sizes, impl, **kwargs):
    with patchgemm.force(**{op: impl for op in OPS}):
        return patchgemm.grouped_linear(x, weight, bias, group_sizes=sizes, **kwargs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("sizes", [[5, 0, 11, 1], [0, 0, 9], [3], [0, 0]])
def test_every_impl_matches_float64_loop(device, dtype, impl, bias, sizes):
    if not applies(impl, dtype, device):
        pytest.skip(f"{impl} does not run {dtype} on {device}")
    groups, din, dout = len(sizes), 16, 24
    x = randn(sum(sizes), din, dtype=dtype, device=device, requires_grad=True)
    weight = randn(groups, dout, din, dtype=dtype, device=device, requires_grad=True)
    b = randn(groups, dout, dtype=dtype, device=device, requires_grad=True) if bias else None
    inputs = [x, weight] + ([b] if bias else [])
    poison_allocator(groups * dout * din * x.element_size(), device)
    y = run(x, weight, b, sizes, impl)
    grad_y = randn(*y.shape, dtype=dtype, device=device)
    with patchgemm.force(**{op: impl for op in OPS}):
        grads = torch.autograd.grad(y, inputs, grad_y)
    refs_in = [t.detach().double().cpu().requires_grad_(True) for t in inputs]
    ref = reference(*refs_in[:2], refs_in[2] if bias else None, sizes)
    ref_grads = torch.autograd.grad(ref, refs_in, grad_y.double().cpu())
    assert y.dtype == dtype and y.shape == (sum(sizes), dout)
    assert_close_to_ref(y, ref, dtype, "y")
    for name, g, r in zip(["x", "weight", "bias"], grads, ref_grads):
        assert_close_to_ref(g, r, dtype, f"grad {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["list", "cpu_sizes", "device_sizes", "offsets", "device_offsets"])
def test_sizes_and_offsets_in_every_form(device, form):
    sizes = [4, 0, 7, 2]
    x, weight = randn(13, 8, device=device), randn(4, 6, 8, device=device)
    ends = torch.tensor(sizes).cumsum(0)
    kwargs = {"list": {"group_sizes": sizes}, "cpu_sizes": {"group_sizes": torch.tensor(sizes)},
              "device_sizes": {"group_sizes": torch.tensor(sizes, device=device)}, "offsets": {"offsets": ends},
              "device_offsets": {"offsets": ends.to(device=device, dtype=torch.int32)}}[form]
    y = patchgemm.grouped_linear(x, weight, **kwargs)
    assert_close_to_ref(y, reference(x, weight, None, sizes), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_skewed_sizes(dtype):
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        groups = int(torch.randint(1, 9, (1,), generator=gen))
        weights = 1.0 / torch.arange(1, groups + 1, dtype=torch.float64)  # Zipf-like
        sizes = torch.multinomial(weights, 60, replacement=True, generator=gen).bincount(minlength=groups).tolist()
        x, weight = randn(60, 16, dtype=dtype), randn(groups, 32, 16, dtype=dtype)
        bias = randn(groups, 32, dtype=dtype)
        assert_close_to_ref(patchgemm.grouped_linear(x, weight, bias, group_sizes=sizes),
                            reference(x, weight, bias, sizes), dtype)


def test_gradcheck_opcheck_and_compile():
    sizes = [2, 0, 3]
    x = randn(5, 4, dtype=torch.float64, requires_grad=True)
    weight = randn(3, 6, 4, dtype=torch.float64, requires_grad=True)
    bias = randn(3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: patchgemm.grouped_linear(*a, group_sizes=sizes), (x, weight, bias))
    offsets = torch.tensor([2, 2, 5])
    torch.library.opcheck(ops.ragged_grouped_linear.default, (x, weight, bias, offsets))
    torch.library.opcheck(ops.ragged_grouped_linear_grad_input.default, (randn(5, 6, dtype=torch.float64), weight.detach(), offsets))
    torch.library.opcheck(ops.ragged_grouped_linear_grad_weight.default, (randn(5, 6, dtype=torch.float64), x.detach(), offsets))

    def step(x, weight, offsets):
        return patchgemm.grouped_linear(x, weight, offsets=offsets).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(x, weight, offsets)
    loss.backward()
    ref = reference(x.detach(), weight.detach(), None, sizes).square().sum()
    assert abs(loss.item() - ref.item()) <= 1e-9 * abs(ref.item())
    assert x.grad is not None and weight.grad is not None


@pytest.mark.parametrize("make, error, match", [
    (lambda: patchgemm.grouped_linear(torch.randn(5, 4), torch.randn(2, 3, 4), group_sizes=[2, 2]), RuntimeError,
     "add up to 4 but x has 5 rows"),
    (lambda: patchgemm.grouped_linear(torch.randn(5, 4), torch.randn(2, 3, 4), group_sizes=[6, -1]), RuntimeError,
     ">= 0"),
    (lambda: patchgemm.grouped_linear(torch.randn(5, 4), torch.randn(2, 3, 4), offsets=torch.tensor([4, 3])),
     RuntimeError, "non-decreasing"),
    (lambda: patchgemm.grouped_linear(torch.randn(5, 4), torch.randn(2, 3, 4), group_sizes=[5]), RuntimeError,
     "1 entries but weight"),
    (lambda: patchgemm.grouped_linear(torch.randn(5, 4), torch.randn(2, 3, 4), group_sizes=[1, 4], offsets=[1, 5]),
     ValueError, "not both"),
    (lambda: patchgemm.grouped_linear(torch.randn(1, 5, 4), torch.randn(2, 3, 4), group_sizes=[1, 4]), RuntimeError,
     r"\[N, Din\]"),
    (lambda: patchgemm.grouped_linear(torch.randn(5, 3), torch.randn(2, 3, 4), group_sizes=[1, 4]), RuntimeError,
     "expects 4"),
    (lambda: patchgemm.grouped_linear(torch.randn(5, 4), torch.randn(2, 3, 4), group_sizes=torch.tensor([1.0, 4.0])),
     RuntimeError, "int32/int64"),
])
def test_bad_input_is_a_clear_error(make, error, match):
    with pytest.raises(error, match=match):
        make()


@needs_gpu
def test_cuda_device_sizes_need_no_sync_where_grouped_mm_runs():
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm's CUDA path needs sm_90")
    sizes = torch.tensor([64, 0, 128, 64], device="cuda")
    x = randn(256, 64, dtype=torch.bfloat16, device="cuda")
    weight = randn(4, 32, 64, dtype=torch.bfloat16, device="cuda")
    patchgemm.grouped_linear(x, weight, group_sizes=sizes)  # warm up
    with syncs_forbidden():
        y = patchgemm.grouped_linear(x, weight, group_sizes=sizes)
    assert_close_to_ref(y, reference(x, weight, None, sizes.tolist()), torch.bfloat16)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_long_ragged_reductions_keep_their_tail(dtype):
    """The weight gradient reduces over a group's rows: long, odd group sizes (cuBLAS's split-K
    tail loss, kernels/gemm/strided_gemm.h) must sum every row."""
    sizes = [38_008, 7_106, 1]
    x = torch.zeros(sum(sizes), 64, dtype=dtype, device="cuda")
    grad_y = torch.zeros(sum(sizes), 64, dtype=dtype, device="cuda")
    ends = torch.tensor(sizes).cumsum(0).tolist()
    for end in ends:  # only each group's last row is non-zero: a lost tail gives zeros
        x[end - 1] = 1
        grad_y[end - 1] = 1
    offsets = torch.tensor(ends)
    grad_w = ops.ragged_grouped_linear_grad_weight(grad_y, x, offsets)  # the default choice
    assert (grad_w.float() == 1).all()
    ran = 0
    for impl in IMPLS:
        if not applies(impl, dtype, "cuda", 64, 64):
            continue
        try:
            with patchgemm.force(ragged_grouped_linear_grad_weight=impl):
                grad_w = ops.ragged_grouped_linear_grad_weight(grad_y, x, offsets)
        except RuntimeError as e:  # cuBLAS's grouped GEMM declines reductions the guard would split
            assert impl == "cublas_grouped" and "more than one BLAS call" in str(e), e
            continue
        ran += 1
        assert (grad_w.float() == 1).all(), impl
    assert ran >= 1


@needs_gpu
@pytest.mark.parametrize("din, dout", [(96, 80), (45, 37)])
@pytest.mark.parametrize("impl", ["ragged_tiles", "ragged_mma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_device_kernels_many_groups_sized_on_the_gpu(dtype, impl, din, dout):
    """Our device-side kernels at scale: 300 groups (two chunks of the block-wide scan), a third of
    them empty, sizes on the GPU; values and gradients against float64, and a repeat bitwise equal
    (no atomics: each output element is one thread's sum, in one order). Sizes that are multiples
    of 8 load in 16-byte pieces, the others element by element."""
    if not applies(impl, dtype, "cuda"):
        pytest.skip(f"{impl} does not run {dtype}")
    gen = torch.Generator().manual_seed(7)
    sizes = torch.randint(0, 300, (300,), generator=gen)
    sizes[torch.randperm(300, generator=gen)[:100]] = 0
    sizes = sizes.tolist()
    x = randn(sum(sizes), din, dtype=dtype, device="cuda", requires_grad=True)
    weight = randn(300, dout, din, dtype=dtype, device="cuda", requires_grad=True)
    bias = randn(300, dout, dtype=dtype, device="cuda", requires_grad=True)
    group_sizes = torch.tensor(sizes, device="cuda")
    grad_y = randn(sum(sizes), dout, dtype=dtype, device="cuda")

    def step():
        y = run(x, weight, bias, group_sizes, impl)
        with patchgemm.force(**{op: impl for op in OPS}):
            return (y, *torch.autograd.grad(y, [x, weight, bias], grad_y))

    poison_allocator(300 * dout * din * x.element_size(), "cuda")
    first, second = step(), step()
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    refs_in = [t.detach().double().cpu().requires_grad_(True) for t in (x, weight, bias)]
    ref = reference(*refs_in, sizes)
    ref_grads = torch.autograd.grad(ref, refs_in, grad_y.double().cpu())
    for name, got, want in zip(["y", "grad x", "grad weight", "grad bias"], first, (ref, *ref_grads)):
        assert_close_to_ref(got, want, dtype, name)


@needs_gpu
@pytest.mark.parametrize("impl", ["ragged_tiles", "ragged_mma"])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_device_kernels_read_int32_and_int64_offsets(impl, index_dtype):
    """The offsets reach our kernels in their own index type (no conversion): both widths, forward
    and both gradients."""
    sizes = [40, 0, 25, 63]
    x = randn(sum(sizes), 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    weight = randn(4, 48, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(index_dtype)
    grad_y = randn(sum(sizes), 48, dtype=torch.bfloat16, device="cuda")
    with patchgemm.force(**{op: impl for op in OPS}), patchgemm.explain() as report:
        y = patchgemm.grouped_linear(x, weight, offsets=offsets)
        grads = torch.autograd.grad(y, [x, weight], grad_y)
    assert [c.chosen for c in report if c.op.startswith("ragged")] == [impl] * 3, str(report)
    refs_in = [t.detach().double().cpu().requires_grad_(True) for t in (x, weight)]
    ref = reference(*refs_in, None, sizes)
    ref_grads = torch.autograd.grad(ref, refs_in, grad_y.double().cpu())
    for name, got, want in zip(["y", "grad x", "grad weight"], (y, *grads), (ref, *ref_grads)):
        assert_close_to_ref(got, want, torch.bfloat16, name)


@needs_gpu
def test_device_kernels_run_without_a_host_sync():
    """Sizes on the GPU in float16 / float32: with syncs forbidden (sync debug mode "error") the
    paths that read the sizes on the host decline and ours run, forward and backward."""
    sizes = torch.tensor([40, 0, 25, 63], device="cuda")
    for dtype, impl in ((torch.float16, "ragged_mma"), (torch.float32, "ragged_tiles")):
        x = randn(128, 64, dtype=dtype, device="cuda", requires_grad=True)
        weight = randn(4, 48, 64, dtype=dtype, device="cuda", requires_grad=True)
        with syncs_forbidden(), patchgemm.explain() as report:
            y = patchgemm.grouped_linear(x, weight, group_sizes=sizes)
            grads = torch.autograd.grad(y, [x, weight], torch.ones_like(y))
        ragged = [c for c in report if c.op.startswith("ragged")]
        assert len(ragged) == 3 and all(c.chosen == impl for c in ragged), str(report)
        ref = reference(x.detach(), weight.detach(), None, sizes.tolist())
        assert_close_to_ref(y, ref, dtype, "y")
        assert all(torch.isfinite(g).all() for g in grads)


@needs_gpu
@pytest.mark.parametrize("impl", ["ragged_tiles", "ragged_mma"])
def test_device_kernels_fail_a_device_assert_on_malformed_gpu_offsets(impl):
    """GPU offsets are checked where they live: a decreasing offset is a device-side assert (the
    CUDA context is lost, so in a child process), never a wrong answer."""
    import subprocess
    import sys
    code = (
        "import torch, patchgemm\n"
        "x = torch.randn(10, 8, device='cuda').half(); w = torch.randn(2, 4, 8, device='cuda').half()\n"
        "off = torch.tensor([7, 3], device='cuda')\n"
        f"with patchgemm.force(ragged_grouped_linear='{impl}'):\n"
        "    y = torch.ops.patchgemm.ragged_grouped_linear(x, w, None, off)\n"
        "torch.cuda.synchronize()\n"
        "print('computed', y.sum().item())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "computed" not in result.stdout, result.stdout
    assert "device-side assert" in result.stderr, result.stderr[-2000:]
