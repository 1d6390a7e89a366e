"""PatchEmbed / PatchUnembed modules, convert() and the hierarchical stems."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchgemm
from conftest import (DEVICES, assert_close_to_ref, randn)
from patch_cases import conv_tokens

ops = torch.ops.patchgemm


# ---- modules -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_modules_load_conv_state_dicts_and_match(device):
    conv = nn.Conv3d(4, 8, (2, 3, 2), stride=(2, 3, 2), device=device)
    pe = patchgemm.PatchEmbed(4, 8, (2, 3, 2), device=device)
    pe.load_state_dict(conv.state_dict())
    x = randn(2, 4, 4, 6, 4, device=device)
    torch.testing.assert_close(pe(x), conv(x), atol=1e-5, rtol=1e-5)
    ct = nn.ConvTranspose2d(8, 3, 4, stride=4, device=device)
    pu = patchgemm.PatchUnembed.from_conv_transpose(ct)
    assert pu.weight is ct.weight and pu.bias is ct.bias  # shared: optimizer state stays valid
    z = randn(2, 8, 3, 5, device=device)
    torch.testing.assert_close(pu(z), ct(z), atol=1e-5, rtol=1e-5)
    assert patchgemm.PatchUnembed(8, 3, 4).state_dict().keys() == ct.state_dict().keys()
    assert "patch_size=(4, 4)" in repr(pu)


def test_module_init_matches_conv_bounds():
    torch.manual_seed(0)
    pe = patchgemm.PatchEmbed(3, 64, 16)
    bound = 1 / math.sqrt(3 * 16 * 16)
    assert pe.weight.abs().max() <= bound and pe.weight.abs().max() > 0.9 * bound
    pu = patchgemm.PatchUnembed(64, 3, 4)
    assert pu.weight.abs().max() <= 1 / math.sqrt(3 * 16)


def test_convert_mixed_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 4, stride=4),                      # eligible
        nn.Conv2d(16, 16, 3, padding=1),                    # not a patch embedding
        nn.Sequential(nn.Conv2d(16, 16, 2, stride=2, groups=2),    # groups
                      nn.ConvTranspose2d(16, 16, 2, stride=2),      # eligible
                      nn.Conv2d(16, 16, 2, stride=2, padding_mode="circular"),
                      nn.ConvTranspose2d(16, 3, 4, stride=4, output_padding=0)),  # eligible
    )
    x = randn(2, 3, 32, 32)
    ref = model(x)
    report = patchgemm.convert(model, inplace=False)
    assert isinstance(model[0], nn.Conv2d)  # the original is untouched
    swapped = dict(report.swapped)
    skipped = dict(report.skipped)
    assert swapped == {"0": "Conv2d -> PatchEmbed", "2.1": "ConvTranspose2d -> PatchUnembed",
                       "2.3": "ConvTranspose2d -> PatchUnembed"}
    assert set(skipped) == {"1", "2.0", "2.2"}
    assert "groups=2" in skipped["2.0"] and "padding_mode='circular'" in skipped["2.2"]
    assert "kernel_size (3, 3) != stride (1, 1)" in skipped["1"]
    torch.testing.assert_close(report.model(x), ref, atol=1e-5, rtol=1e-5)
    assert "swapped 3" in str(report)
    report = patchgemm.convert(model)  # in place
    assert isinstance(model[0], patchgemm.PatchEmbed) and report.model is model
    root = patchgemm.convert(nn.Conv1d(2, 4, 3, stride=3))
    assert isinstance(root.model, patchgemm.PatchEmbed)


def test_convert_leaves_pointwise_convs():
    """1 x 1 convs (a GEMM cuDNN runs as well, nothing to gather) stay nn.Conv, with a reason, also two
    of them in an nn.Sequential (not an hMLP stem); grouped ones become GroupedPointwiseConv."""
    model = nn.Sequential(nn.Conv2d(8, 16, 1), nn.GELU(), nn.Conv2d(16, 8, 1),
                          nn.Sequential(nn.ConvTranspose2d(8, 8, 1), nn.Conv1d(8, 8, (1,))),
                          nn.Conv2d(8, 8, 1, groups=2))
    report = patchgemm.convert(model, inplace=False)
    skipped = dict(report.skipped)
    assert set(skipped) == {"0", "2", "3.0", "3.1"}, str(report)
    assert all("pointwise" in why for why in skipped.values())
    assert dict(report.swapped) == {"4": "Conv2d -> GroupedPointwiseConv"}


def _conv_stack(kinds, widths, kernels, rank, device):
    conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[rank] if kinds == "conv" else \
        {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}[rank]
    norm = {1: nn.InstanceNorm1d, 2: nn.InstanceNorm2d, 3: nn.InstanceNorm3d}[rank]
    convs = [conv(widths[i], widths[i + 1], kernels[i], stride=kernels[i], device=device, dtype=torch.float64)
             for i in range(len(kernels))]
    norms = [norm(w, affine=True, device=device, dtype=torch.float64) for w in widths[1:-1]]
    for n in norms:
        nn.init.normal_(n.weight)
        nn.init.normal_(n.bias)

    def run(x):
        for i, c in enumerate(convs):
            x = c(x)
            if i < len(norms):
                x = F.gelu(norms[i](x))
        return x
    return convs, norms, run


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank,stages,size", [(3, [2, 2, 4], (16, 16, 32)), (2, [4, 2, 2], (32, 48)),
                                              (3, [(1, 2, 2), 2], (4, 8, 8)), (1, [3], (12,))])
def test_hierarchical_stems_match_conv_stacks(device, rank, stages, size):
    kernels = [k if isinstance(k, tuple) else (k,) * rank for k in stages]
    widths = [4] + [6] * (len(kernels) - 1) + [10]
    convs, norms, run = _conv_stack("conv", widths, kernels, rank, device)
    stem = patchgemm.HierarchicalPatchEmbed.from_convs(convs, norms)
    x = randn(2, 4, *size, dtype=torch.float64, device=device, requires_grad=True)
    y, ref = stem(x), run(x)
    assert_close_to_ref(y, ref, torch.float64)
    params = [x] + [p for m in convs + norms for p in m.parameters()]
    g = randn(*ref.shape, dtype=torch.float64, device=device)
    for a, r in zip(torch.autograd.grad(y, params, g), torch.autograd.grad(ref, params, g)):
        # (a bias right before an InstanceNorm has a zero gradient: compare absolutely)
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-9)
    tokens = patchgemm.HierarchicalPatchEmbed.from_convs(convs, norms, out_format="tokens")(x)
    assert_close_to_ref(tokens, conv_tokens(ref), torch.float64)

    # The inverse stack, applied coarse to fine.
    convs_t, norms_t, run_t = _conv_stack("transpose", widths[::-1], kernels[::-1], rank, device)
    head = patchgemm.HierarchicalPatchUnembed.from_convs(convs_t, norms_t)
    z = ref.detach().requires_grad_()
    u, u_ref = head(z), run_t(z)
    assert_close_to_ref(u, u_ref, torch.float64)
    params = [z] + [p for m in convs_t + norms_t for p in m.parameters()]
    g = randn(*u_ref.shape, dtype=torch.float64, device=device)
    for a, r in zip(torch.autograd.grad(u, params, g), torch.autograd.grad(u_ref, params, g)):
        torch.testing.assert_close(a, r, atol=1e-10, rtol=1e-9)
    head_tokens = patchgemm.HierarchicalPatchUnembed.from_convs(convs_t, norms_t, in_format="tokens")
    assert_close_to_ref(head_tokens(conv_tokens(z), grid=z.shape[2:]), u_ref, torch.float64)


def test_hierarchical_defaults():
    stem = patchgemm.HierarchicalPatchEmbed(4, 64, stages=[2, 2, 4])
    assert [s.kernel_size for s in stem.stages] == [(2, 2, 2), (2, 2, 2), (4, 4, 4)]
    assert [s.embed_dim for s in stem.stages] == [16, 16, 64]
    y = stem(randn(1, 4, 16, 16, 16))
    assert y.shape == (1, 64, 1, 1, 1)
    head = patchgemm.HierarchicalPatchUnembed(64, 4, stages=[2, 2, 4])
    assert head(y).shape == (1, 4, 16, 16, 16)
    # A size the total patch does not divide: each conv leaves out what fills no patch of its own.
    x = randn(1, 4, 17, 16, 18)
    ref = x
    for i, stage in enumerate(stem.stages):
        ref = F.conv3d(ref, stage.weight, stage.bias, stride=stage.kernel_size)
        ref = F.gelu(stem.norms[i](ref)) if i < len(stem.norms) else ref
    torch.testing.assert_close(stem(x), ref)
    with pytest.raises(RuntimeError, match="3 spatial dims"):
        stem(randn(1, 4, 16, 16))
