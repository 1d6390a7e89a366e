"""Drop-in conventions: where a patchgemm op or module stands in for a PyTorch one, it behaves as that
one does — autocast, torch.func transforms, meta tensors, the attributes code reads, error types,
convert on shared modules, and the precision of 16-bit gradients."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import grad, jacrev, vjp, vmap

import patchgemm
from conftest import DEVICES, randn

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented")

F64 = torch.float64


def _cases(device):
    """(name, ours, reference, inputs) per differentiable op, in float64."""
    r = lambda *s: randn(*s, dtype=F64, device=device)  # noqa: E731
    sizes = [2, 0, 5]
    rows = torch.repeat_interleave(torch.arange(3, device=device), torch.tensor(sizes, device=device))
    return [
        ("patch_embed", lambda x, w, b: patchgemm.patch_embed(x, w, b),
         lambda x, w, b: F.conv2d(x, w, b, stride=2), (r(2, 3, 4, 6), r(5, 3, 2, 2), r(5))),
        ("patch_embed tokens", lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format="tokens"),
         lambda x, w, b: F.conv3d(x, w, b, stride=2).flatten(2).transpose(1, 2),
         (r(2, 3, 4, 2, 4), r(5, 3, 2, 2, 2), r(5))),
        ("patch_unembed", lambda x, w, b: patchgemm.patch_unembed(x, w, b),
         lambda x, w, b: F.conv_transpose1d(x, w, b, stride=3), (r(2, 5, 4), r(5, 3, 3), r(3))),
        ("grouped_linear", lambda x, w, b: patchgemm.grouped_linear(x, w, b),
         lambda x, w, b: torch.einsum("bgi,goi->bgo", x, w) + b, (r(3, 4, 6), r(4, 5, 6), r(4, 5))),
        ("ragged", lambda x, w, b: patchgemm.grouped_linear(x, w, b, group_sizes=sizes),
         lambda x, w, b: torch.einsum("ni,noi->no", x, w[rows]) + b[rows], (r(7, 6), r(3, 4, 6), r(3, 4))),
        ("grouped_pointwise_conv", lambda x, w, b: patchgemm.grouped_pointwise_conv(x, w, b, 2),
         lambda x, w, b: F.conv1d(x, w, b, groups=2), (r(2, 6, 5), r(4, 3, 1), r(4))),
        ("swiglu", patchgemm.swiglu, lambda g: F.silu(g[:, :4]) * g[:, 4:], (r(3, 8),)),
        ("instance_norm_act", lambda x, w, b: patchgemm.instance_norm_act(x, w, b),
         lambda x, w, b: F.gelu(F.instance_norm(x, weight=w, bias=b)), (r(2, 3, 8), r(3), r(3))),
    ]


def _close(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_transforms_give_the_reference_gradients(device):
    for name, ours, ref, inputs in _cases(device):
        argnums = tuple(range(len(inputs)))
        loss = lambda f: lambda *a: f(*a).square().sum()  # noqa: E731
        _close(grad(loss(ours), argnums=argnums)(*inputs), grad(loss(ref), argnums=argnums)(*inputs))
        _close(jacrev(ours, argnums=argnums)(*inputs), jacrev(ref, argnums=argnums)(*inputs))
        y, pull = vjp(ours, *inputs)
        y_ref, pull_ref = vjp(ref, *inputs)
        dy = randn(*y.shape, dtype=F64, device=device)
        _close([y], [y_ref])
        _close(pull(dy), pull_ref(dy))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_func_input_gradient_with_weights_that_require_grad(device):
    """torch.func.grad of x alone while the weights are ordinary tensors that require grad (a
    module's parameters), and the input gradient's own gradient: as the reference's."""
    for name, ours, ref, inputs in _cases(device):
        x, *weights = inputs
        weights = [w.requires_grad_() for w in weights]
        loss = lambda f: lambda x: f(x, *weights).pow(3).sum()  # noqa: E731
        _close(grad(loss(ours))(x), grad(loss(ref))(x))
        twice = lambda f: lambda x: grad(loss(f))(x).square().sum()  # noqa: E731
        _close(grad(twice(ours))(x), grad(twice(ref))(x))


@pytest.mark.parametrize("device", DEVICES)
def test_create_graph_gradients_are_right_or_refused(device):
    """A second derivative through the ops' C++ autograd (create_graph=True): the norm and SwiGLU
    give the reference's; the GEMM ops, whose weight gradients are not twice differentiable,
    refuse with an error rather than return a wrong one; the patch ops' x gradient alone is
    differentiable again."""
    for name, ours, ref, inputs in _cases(device):
        def second(f):
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            first = torch.autograd.grad(f(*leaves).pow(3).sum(), leaves, create_graph=True)
            return torch.autograd.grad(sum(g.square().sum() for g in first), leaves)
        if name in ("swiglu", "instance_norm_act"):
            _close(second(ours), second(ref))
            continue
        with pytest.raises(RuntimeError, match="not differentiable again, so backward with create_graph=True"):
            second(ours)
        if name.startswith("patch"):  # x's gradient alone (a gradient penalty): differentiable again
            x, *weights = inputs
            def penalty(f):
                leaf = x.detach().clone().requires_grad_()
                ws = [w.detach().clone().requires_grad_() for w in weights]
                (gx,) = torch.autograd.grad(f(leaf, *ws).pow(3).sum(), leaf, create_graph=True)
                return torch.autograd.grad(gx.square().sum(), [leaf, *ws])
            _close(penalty(ours), penalty(ref))


@pytest.mark.parametrize("device", DEVICES)
def test_vmap_and_grad_of_the_input_gradient(device):
    x, w, b = (randn(*s, dtype=F64, device=device) for s in [(4, 2, 3, 4, 4), (5, 3, 2, 2), (5,)])
    _close([vmap(lambda x: patchgemm.patch_embed(x, w, b))(x)],
           [torch.stack([F.conv2d(xi, w, b, stride=2) for xi in x])])
    x = x[0]
    ours = grad(lambda x: grad(lambda x: patchgemm.patch_embed(x, w, b).pow(3).sum())(x).sum())(x)
    ref = grad(lambda x: grad(lambda x: F.conv2d(x, w, b, stride=2).pow(3).sum())(x).sum())(x)
    _close([ours], [ref])


def test_autocast_leaves_float64_alone():
    x, w, b = randn(2, 3, 4, 4, dtype=F64), randn(4, 3, 2, 2, dtype=F64), randn(4, dtype=F64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.conv2d(x, w, b, stride=2).dtype == F64
        assert patchgemm.patch_embed(x, w, b).dtype == F64
        assert patchgemm.grouped_linear(randn(2, 3, 4, dtype=F64), randn(3, 5, 4, dtype=F64)).dtype == F64
        assert patchgemm.grouped_pointwise_conv(randn(2, 4, 3, dtype=F64), randn(4, 2, 1, dtype=F64),
                                                groups=2).dtype == F64
        # float32 is still cast down, as for the conv
        assert patchgemm.patch_embed(x.float(), w.float(), b.float()).dtype == torch.bfloat16


def test_modules_run_on_meta_tensors_like_the_convs():
    meta = torch.device("meta")
    pairs = [
        (patchgemm.PatchEmbed(3, 8, (2, 4), device=meta), nn.Conv2d(3, 8, (2, 4), (2, 4), device=meta), (2, 3, 8, 8)),
        (patchgemm.PatchUnembed(8, 3, 2, dims=3, device=meta), nn.ConvTranspose3d(8, 3, 2, 2, device=meta),
         (2, 8, 2, 3, 4)),
        (patchgemm.GroupedPointwiseConv(8, 4, 2, device=meta), nn.Conv1d(8, 4, 1, groups=2, device=meta), (2, 8, 5)),
    ]
    for ours, conv, shape in pairs:
        x = torch.empty(shape, device=meta)
        y = ours(x)
        assert y.device == meta and y.shape == conv(x).shape
        y.sum().backward()  # autograd on meta, as for the conv
        assert ours.weight.grad.shape == ours.weight.shape
    g = patchgemm.GroupedLinear(3, 4, 5, device=meta)
    assert g(torch.empty(7, 3, 4, device=meta)).shape == (7, 3, 5)
    h = patchgemm.HierarchicalPatchEmbed(2, 16, stages=(2, 2), dims=2, device=meta)
    assert h(torch.empty(1, 2, 8, 8, device=meta)).shape == (1, 16, 2, 2)
    # ragged groups: sizes given on the host (their offsets a CPU tensor) with meta data
    y = patchgemm.grouped_linear(torch.empty(6, 4, device=meta), torch.empty(3, 5, 4, device=meta),
                                 group_sizes=[2, 1, 3])
    assert y.device == meta and y.shape == (6, 5)
    experts = patchgemm.MoEExperts(4, 8, 6, device=meta)
    y = experts(torch.empty(5, 8, device=meta), torch.zeros(5, 2, dtype=torch.long, device=meta),
                torch.empty(5, 2, device=meta))
    assert y.device == meta and y.shape == (5, 8)


def test_hierarchical_stems_compile_fullgraph():
    torch._dynamo.reset()
    embed = patchgemm.HierarchicalPatchEmbed(2, 16, stages=(2, 2), dims=2)
    unembed = patchgemm.HierarchicalPatchUnembed(16, 2, stages=(2, 2), dims=2)
    x = randn(2, 2, 8, 8)
    for module, inp in ((embed, x), (unembed, embed(x).detach())):
        compiled = torch.compile(module, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(inp), module(inp))


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_patch_modules_have_the_conv_attributes(rank):
    k = (2, 3, 4)[:rank]
    pairs = [(patchgemm.PatchEmbed(3, 8, k), (nn.Conv1d, nn.Conv2d, nn.Conv3d)[rank - 1](3, 8, k, k)),
             (patchgemm.PatchUnembed(8, 3, k), (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[rank - 1](
                 8, 3, k, k)),
             (patchgemm.GroupedPointwiseConv(8, 4, 2, dims=rank),
              (nn.Conv1d, nn.Conv2d, nn.Conv3d)[rank - 1](8, 4, 1, groups=2))]
    for ours, conv in pairs:
        for attr in ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
                     "output_padding", "padding_mode", "transposed"):
            assert getattr(ours, attr) == getattr(conv, attr), (type(ours).__name__, attr)


def test_convert_swaps_a_shared_conv_once_and_reports_every_name():
    model = nn.Module()
    model.a = nn.Conv2d(3, 4, 2, 2)
    model.b = model.a
    model.inner = nn.Sequential(model.a)
    report = patchgemm.convert(model)
    assert model.a is model.b is model.inner[0]
    assert isinstance(model.a, patchgemm.PatchEmbed)
    names = [name for name, _ in report.swapped]
    assert sorted(names) == ["a", "b", "inner.0"] and not report.skipped
    assert "the same module as a" in str(report)


def test_bad_grids_and_patch_ranks_are_clear_errors():
    pu = patchgemm.PatchUnembed(4, 3, 2, in_format="tokens")
    x = randn(1, 4, 4)
    for bad in [(2.9, 2.2), "22"]:
        with pytest.raises(TypeError, match="grid must be a sequence of ints"):
            pu(x, grid=bad)
        with pytest.raises(TypeError, match="grid must be a sequence of ints"):
            patchgemm.PatchUnembed(4, 3, 2, in_format="tokens", grid=bad)
    assert pu(x, grid=(torch.tensor(2).item(), 2)).shape == (1, 3, 4, 4)
    for module in (patchgemm.PatchEmbed, patchgemm.PatchUnembed):
        with pytest.raises(ValueError, match="1, 2 or 3 dims"):
            module(3, 4, (2, 2, 2, 2))
    with pytest.raises(ValueError, match="dims must be 1, 2 or 3"):
        patchgemm.HierarchicalPatchEmbed(3, 8, stages=(2, 2), dims=4)


def test_shape_errors_are_runtime_errors_on_both_sides():
    """torch's ops raise RuntimeError for tensors that do not fit; so do ours, whether Python or C++
    finds the mistake (ValueError stays for bad option values, TypeError for wrong types)."""
    with pytest.raises(RuntimeError, match="Din"):
        patchgemm.grouped_linear(randn(4), randn(2, 3, 4))  # found in Python
    with pytest.raises(RuntimeError, match="features per group"):
        patchgemm.grouped_linear(randn(2, 2, 5), randn(2, 3, 4))  # found in C++
    with pytest.raises(RuntimeError, match="spatial dims"):
        patchgemm.patch_embed(randn(1, 3, 4, 4, 4), randn(4, 3, 2, 2))
    with pytest.raises(RuntimeError, match="channels"):
        patchgemm.patch_embed(randn(1, 2, 4, 4), randn(4, 3, 2, 2))
    with pytest.raises(RuntimeError, match="2 spatial dims"):
        patchgemm.HierarchicalPatchEmbed(2, 16, stages=(2, 2), dims=2)(randn(1, 2, 6, 8, 8))
    with pytest.raises(ValueError, match="layout"):
        patchgemm.grouped_linear(randn(2, 3, 4), randn(3, 5, 4), layout="xyz")


def test_flattened_grouped_linear_with_zero_groups():
    w = randn(0, 3, 4)
    assert patchgemm.grouped_linear(randn(0, 4), w).shape == (0, 3)
    assert patchgemm.grouped_linear(randn(2, 0, 4), w).shape == (2, 0, 3)
    with pytest.raises(RuntimeError, match="multiple of G=0"):
        patchgemm.grouped_linear(randn(2, 4), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch, size", [(2, 16), (16, 16), (2, 64)])
def test_bf16_weight_gradients_with_channels_first_output_round_once(device, batch, size):
    """Channels-first grad_y with a small batch sums per sample (one GEMM batched over the samples,
    or on a GPU one GEMM per sample for long reductions, size 64); the 16-bit sums stay fp32 until
    the end, so the error is the conv's, not one rounding per sample."""
    torch.manual_seed(batch)
    x = randn(batch, 4, size, size, size, dtype=torch.bfloat16, device=device)
    w = randn(8, 4, 2, 2, 2, dtype=torch.bfloat16, device=device, requires_grad=True)
    b = randn(8, dtype=torch.bfloat16, device=device, requires_grad=True)
    dy = randn(batch, 8, size // 2, size // 2, size // 2, dtype=torch.bfloat16, device=device)
    w64, b64 = w.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    F.conv3d(x.double(), w64, b64, stride=2).backward(dy.double())
    errors = {}
    for name, fn in (("ours", patchgemm.patch_embed), ("torch", lambda x, w, b: F.conv3d(x, w, b, stride=2))):
        w.grad = b.grad = None
        with patchgemm.force(patch_weight_grad="gather_gemm"):
            fn(x, w, b).backward(dy)
        errors[name] = [((g.double() - r.grad).norm() / r.grad.norm()).item() for g, r in ((w.grad, w64), (b.grad, b64))]
    for ours, theirs in zip(errors["ours"], errors["torch"]):
        assert ours <= 1.25 * theirs + 1e-4, errors
