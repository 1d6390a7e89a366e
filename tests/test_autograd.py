"""The C++ autograd (csrc/ops/autograd.cpp): every combination of inputs that need a gradient, with and
without a bias, against PyTorch's own autograd in float64; dynamic-shape compile through backward."""

import contextlib
import itertools

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch

import patchgemm
from conftest import DEVICES, assert_close_to_ref, randn

# (which of x, weight, bias require grad), bias present or not
NEEDS = [n for n in itertools.product([False, True], repeat=3) if any(n)]


def _leaves(tensors, needs, has_bias):
    out = []
    for t, n in zip(tensors, needs):
        out.append(None if t is None else t.detach().requires_grad_(n))
    if not has_bias:
        out[2] = None
    return out


def _check(ours, ref, inputs, needs, has_bias):
    mine = _leaves(inputs, needs, has_bias)
    theirs = _leaves(inputs, needs, has_bias)
    y, y_ref = ours(*mine), ref(*theirs)
    assert_close_to_ref(y, y_ref, torch.float64)
    dy = randn(*y.shape, dtype=torch.float64, device=y.device)
    wanted = [i for i, t in enumerate(mine) if t is not None and t.requires_grad]
    if not wanted:  # only an absent bias "needs" a gradient: no graph at all
        assert y.grad_fn is None
        return
    got = torch.autograd.grad(y, [mine[i] for i in wanted], dy)
    want = torch.autograd.grad(y_ref, [theirs[i] for i in wanted], dy)
    for i, g, r in zip(wanted, got, want):
        assert_close_to_ref(g, r, torch.float64, ["grad_x", "grad_weight", "grad_bias"][i])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", NEEDS)
@pytest.mark.parametrize("has_bias", [True, False])
def test_grad_subsets_patch_embed(device, needs, has_bias):
    x = randn(2, 3, 4, 6, 4, dtype=torch.float64, device=device)
    w = randn(5, 3, 2, 3, 2, dtype=torch.float64, device=device)
    b = randn(5, dtype=torch.float64, device=device)
    for fmt in ("channels_first", "tokens"):
        def ref(x, w, b):
            y = F.conv3d(x, w, b, stride=(2, 3, 2))
            return y.flatten(2).transpose(1, 2) if fmt == "tokens" else y
        _check(lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format=fmt), ref, (x, w, b), needs, has_bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", NEEDS)
@pytest.mark.parametrize("has_bias", [True, False])
def test_grad_subsets_patch_unembed(device, needs, has_bias):
    x = randn(2, 5, 3, 2, dtype=torch.float64, device=device)
    w = randn(5, 3, 2, 4, dtype=torch.float64, device=device)
    b = randn(3, dtype=torch.float64, device=device)
    _check(lambda x, w, b: patchgemm.patch_unembed(x, w, b),
           lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 4)), (x, w, b), needs, has_bias)
    _check(lambda x, w, b: patchgemm.patch_unembed(x.flatten(2).transpose(1, 2), w, b, in_format="tokens", grid=(3, 2)),
           lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(2, 4)), (x, w, b), needs, has_bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("needs", NEEDS)
@pytest.mark.parametrize("has_bias", [True, False])
def test_grad_subsets_grouped_linear(device, needs, has_bias):
    x = randn(6, 3, 4, dtype=torch.float64, device=device)
    w = randn(3, 5, 4, dtype=torch.float64, device=device)
    b = randn(3, 5, dtype=torch.float64, device=device)

    def ref(x, w, b):
        y = torch.einsum("bgi,goi->bgo", x, w)
        return y if b is None else y + b

    _check(patchgemm.grouped_linear, ref, (x, w, b), needs, has_bias)


def test_autograd_runs_in_cpp():
    """The backward node is the C++ function: no Python autograd.Function (host time per layer)."""
    x = randn(2, 3, 8, 8)
    w = randn(4, 3, 4, 4, requires_grad=True)
    y = patchgemm.patch_embed(x, w)
    assert "PatchEmbed" in y.grad_fn.name(), y.grad_fn.name()
    assert not isinstance(y.grad_fn, torch.autograd.function.BackwardCFunction)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_dynamic_backward(device):
    """Dynamic shapes through the C++ backward: sizes it needs as integers are specialized, not lost."""
    torch._dynamo.reset()
    w = randn(6, 3, 2, 2, device=device, requires_grad=True)
    u = randn(6, 3, 2, 2, device=device, requires_grad=True)

    def model(x):
        return patchgemm.patch_unembed(patchgemm.patch_embed(x, w, out_format="tokens").relu(), u,
                                       in_format="tokens", grid=(x.shape[2] // 2, x.shape[3] // 2))

    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for batch, h in [(2, 8), (3, 12)]:
        x = randn(batch, 3, h, 8, device=device, requires_grad=True)
        y, y_ref = compiled(x), model(x)
        torch.testing.assert_close(y, y_ref)
        got = torch.autograd.grad(y.square().sum(), [x, w, u])
        want = torch.autograd.grad(y_ref.square().sum(), [x, w, u])
        for a, r in zip(got, want):
            torch.testing.assert_close(a, r)


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    """A mode that only records the ops it sees; while it is active no call is plain."""

    def __init__(self):
        super().__init__()
        self.ops = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _plain_cases(device, dtype):
    cl = torch.channels_last
    x = randn(2, 4, 8, 12, dtype=dtype, device=device)
    w, b = randn(6, 4, 2, 4, dtype=dtype, device=device), randn(6, dtype=dtype, device=device)
    xu = randn(2, 6, 4, 3, dtype=dtype, device=device)
    xr, wr = randn(10, 4, dtype=dtype, device=device), randn(3, 5, 4, dtype=dtype, device=device)
    offsets = torch.tensor([3, 3, 10], device=device)
    return {
        "patch_embed": (lambda x, w, b: patchgemm.patch_embed(x, w, b), (x, w, b)),
        "patch_embed channels-last": (lambda x, w, b: patchgemm.patch_embed(x, w, b), (x.contiguous(memory_format=cl), w, b)),
        "patch_embed tokens": (lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format="tokens"), (x, w, b)),
        "patch_unembed": (lambda x, w, b: patchgemm.patch_unembed(x, w, b[:4]), (xu, w, b)),
        "patch_unembed channels-last": (lambda x, w, b: patchgemm.patch_unembed(x, w, b[:4]),
                                        (xu.contiguous(memory_format=cl), w, b)),
        "ragged grouped_linear": (lambda x, w, b: patchgemm.grouped_linear(x, w, b, offsets=offsets),
                                  (xr, wr, randn(3, 5, dtype=dtype, device=device))),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(_plain_cases("cpu", torch.float64)))
def test_plain_calls_match_the_dispatcher(device, case):
    """Plain calls of the patch and ragged ops run their C++ from the autograd kernel (checked once,
    no second pass through the dispatcher); under a TorchDispatchMode no call is plain, and they go
    through the dispatcher, where the mode sees them. Both give the same values and gradients."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float64
    fn, inputs = _plain_cases(device, dtype)[case]
    results = []
    for mode in (None, _Seen()):
        leaves = [t.detach().requires_grad_() for t in inputs]
        with mode or contextlib.nullcontext():
            y = fn(*leaves)
            grads = torch.autograd.grad(y, leaves, torch.ones_like(y))
        if mode is not None:
            assert any(op.startswith("patchgemm.") for op in mode.ops), mode.ops
        results.append((y, *grads))
    for got, want in zip(*results):
        if device == "cpu":
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:  # (where the plain call settles on cuDNN, the mode's runs patchgemm's kernels)
            assert_close_to_ref(got, want, dtype)
