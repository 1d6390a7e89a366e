"""Whole hMLP stems: convert() recognizes an nn.Sequential of kernel == stride convs with norms and
activations between them (as MATEY's and Multiple Physics Pretraining's hMLP_stem / hMLP_output) and
swaps it for one HierarchicalPatchEmbed / HierarchicalPatchUnembed with the same parameter names,
outputs and gradients."""

import copy
import gc

import pytest
import torch
from torch import nn

import patchgemm
from conftest import DEVICES, assert_close_to_ref, randn


class RMSInstanceNorm(nn.Module):
    """A custom norm as physics models write it: per sample and channel, x / (std over positions +
    eps), then a per-channel scale and shift."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x):
        spatial = tuple(range(2, x.dim()))
        std = x.std(dim=spatial, keepdim=True)
        shape = (1, -1) + (1,) * len(spatial)
        return x / (std + self.eps) * self.weight.view(shape) + self.bias.view(shape)


class NeighbourNorm(nn.Module):
    """A 'norm' that mixes neighbouring positions: the stem must not be fused around it."""

    def __init__(self, channels):
        super().__init__()
        self.smooth = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)

    def forward(self, x):
        return self.smooth(x)


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module


def stem_3d(norm, trailing=True, bias=False, dtype=torch.float64):
    """MATEY's hMLP_stem shape: Conv3d k4 -> norm -> GELU -> Conv3d k2 -> norm -> GELU -> Conv3d k2 (-> norm)."""
    layers = [nn.Conv3d(4, 8, 4, 4, bias=bias), norm(8), nn.GELU(),
              nn.Conv3d(8, 8, 2, 2, bias=bias), norm(8), nn.GELU(),
              nn.Conv3d(8, 16, 2, 2, bias=bias)]
    if trailing:
        layers.append(norm(16))
    return _randomize(nn.Sequential(*layers).to(dtype))


def output_3d(norm, dtype=torch.float64):
    """MPP's hMLP_output out_proj shape: ConvT k2 -> norm -> GELU -> ConvT k2 -> norm -> GELU."""
    return _randomize(nn.Sequential(nn.ConvTranspose3d(16, 8, 2, 2), norm(8), nn.GELU(),
                                    nn.ConvTranspose3d(8, 8, 2, 2), norm(8), nn.GELU()).to(dtype))


NORMS = {
    "instance": lambda c: nn.InstanceNorm3d(c, affine=True),
    "instance_plain": lambda c: nn.InstanceNorm3d(c),
    "groupnorm": lambda c: nn.GroupNorm(c, c),
    "rms_custom": RMSInstanceNorm,
}


class Holder(nn.Module):
    def __init__(self, proj):
        super().__init__()
        self.proj = proj

    def forward(self, x):
        return self.proj(x)


def _compare(original, converted, x, params=True):
    """Same outputs and same gradients (input and every parameter) in float64 (to 1e-10: three
    stages and two norms deep, the summation orders differ)."""
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = original(x1), converted(x2)
    assert_close_to_ref(y2, y1, torch.float64, tol=1e-10)
    dy = randn(*y1.shape, dtype=y1.dtype, device=y1.device)
    y1.backward(dy)
    y2.backward(dy)
    assert_close_to_ref(x2.grad, x1.grad, torch.float64, "grad_x", tol=1e-10)
    if not params:
        return
    params = dict(original.named_parameters())
    for name, p in converted.named_parameters():
        ref = params[name].grad
        if ref.norm() < 1e-9:  # a conv bias right before an instance norm: its gradient is 0
            assert p.grad.norm() < 1e-9, name
        else:
            assert_close_to_ref(p.grad, ref, torch.float64, f"grad of {name}", tol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("trailing", [True, False])
def test_convert_swaps_a_whole_stem(device, norm, trailing):
    torch.manual_seed(0)
    model = Holder(stem_3d(NORMS[norm], trailing, bias=norm == "instance").to(device))
    original = Holder(stem_3d(NORMS[norm], trailing, bias=norm == "instance").to(device))
    original.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    report = patchgemm.convert(model)
    assert isinstance(model.proj, patchgemm.HierarchicalPatchEmbed)
    assert report.swapped == [("proj", "Sequential of 3 convs -> HierarchicalPatchEmbed")] and not report.skipped
    assert list(model.state_dict()) == keys  # checkpoints load unchanged
    model.load_state_dict(original.state_dict())
    _compare(original, model, randn(2, 4, 16, 16, 32, dtype=torch.float64, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", ["instance", "rms_custom"])
def test_convert_swaps_a_whole_output_stack(device, norm):
    torch.manual_seed(1)
    model = Holder(output_3d(NORMS[norm]).to(device))
    original = Holder(output_3d(NORMS[norm]).to(device))
    original.load_state_dict(model.state_dict())
    report = patchgemm.convert(model)
    assert isinstance(model.proj, patchgemm.HierarchicalPatchUnembed), report
    assert list(model.state_dict()) == list(original.state_dict())
    _compare(original, model, randn(2, 16, 2, 3, 2, dtype=torch.float64, device=device))


def test_a_norm_that_mixes_positions_keeps_the_convs_apart():
    torch.manual_seed(2)
    seq = _randomize(nn.Sequential(nn.Conv2d(3, 8, 2, 2), NeighbourNorm(8), nn.ReLU(), nn.Conv2d(8, 8, 2, 2)).double())
    original = Holder(seq)
    model = Holder(_randomize(nn.Sequential(nn.Conv2d(3, 8, 2, 2), NeighbourNorm(8), nn.ReLU(),
                                            nn.Conv2d(8, 8, 2, 2)).double()))
    model.load_state_dict(original.state_dict())
    report = patchgemm.convert(model)
    assert type(model.proj) is nn.Sequential
    assert [n for n, _ in report.swapped] == ["proj.0", "proj.3"]
    assert "NeighbourNorm depends on the order of positions" in dict(report.skipped)["proj"]
    _compare(original, model, randn(2, 3, 8, 12, dtype=torch.float64))


class SequentialStem(nn.Sequential):
    """A stem written as a Sequential subclass (MATEY's style), computing as a Sequential does."""


class StemWithItsOwnForward(nn.Sequential):
    def forward(self, x):
        return super().forward(x) * 2.0


def test_a_sequential_subclass_is_a_whole_stem_unless_it_has_its_own_forward():
    def pair(cls):  # the model to convert, and a copy of it to compare with
        torch.manual_seed(3)
        model = Holder(cls(*stem_3d(NORMS["instance"], bias=True).children()))
        return model, copy.deepcopy(model)

    model, original = pair(SequentialStem)
    report = patchgemm.convert(model)
    assert report.swapped == [("proj", "SequentialStem of 3 convs -> HierarchicalPatchEmbed")] and not report.skipped
    assert list(model.state_dict()) == list(original.state_dict())
    _compare(original, model, randn(2, 4, 16, 16, 32, dtype=torch.float64))

    model, original = pair(StemWithItsOwnForward)
    report = patchgemm.convert(model)
    assert type(model.proj) is StemWithItsOwnForward
    assert [n for n, _ in report.swapped] == ["proj.0", "proj.3", "proj.6"]
    assert "StemWithItsOwnForward defines its own forward" in dict(report.skipped)["proj"]
    _compare(original, model, randn(2, 4, 16, 16, 32, dtype=torch.float64))


def test_from_sequential_and_from_convs_name_what_does_not_fit():
    with pytest.raises(ValueError, match="layer 2 is Linear"):
        patchgemm.HierarchicalPatchEmbed.from_sequential(nn.Sequential(nn.Conv2d(3, 4, 2, 2), nn.GELU(), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="layer 2 is not kernel == stride"):
        patchgemm.HierarchicalPatchEmbed.from_sequential(
            nn.Sequential(nn.Conv2d(3, 4, 2, 2), nn.GELU(), nn.Conv2d(4, 4, 3, 2)))
    with pytest.raises(ValueError, match="two convs or more"):
        patchgemm.HierarchicalPatchEmbed.from_sequential(nn.Sequential(nn.Conv2d(3, 4, 2, 2), nn.GELU()))
    with pytest.raises(ValueError, match="does not follow"):
        patchgemm.HierarchicalPatchEmbed.from_sequential(nn.Sequential(nn.Conv2d(3, 4, 2, 2), nn.Conv2d(5, 4, 2, 2)))
    with pytest.raises(ValueError, match="does not match 4 channels"):
        patchgemm.HierarchicalPatchEmbed.from_convs([nn.Conv2d(3, 4, 2, 2), nn.Conv2d(4, 4, 2, 2)],
                                                    norms=[nn.InstanceNorm2d(6, affine=True)])


@pytest.mark.parametrize("device", DEVICES)
def test_from_convs_takes_a_trailing_norm(device):
    torch.manual_seed(3)
    convs = [nn.Conv2d(3, 8, 4, 4), nn.Conv2d(8, 16, 2, 2)]
    norms = [RMSInstanceNorm(8)]
    final = nn.InstanceNorm2d(16, affine=True)
    seq = _randomize(nn.Sequential(convs[0], norms[0], nn.GELU(), convs[1], final).double().to(device))
    reference = copy.deepcopy(seq)  # (the stem shares the convs' and norms' parameters)
    stem = patchgemm.HierarchicalPatchEmbed.from_convs(convs, norms=norms, act="gelu", final_norm=final)
    _compare(reference, stem, randn(2, 3, 16, 24, dtype=torch.float64, device=device), params=False)
    unembed_convs = [nn.ConvTranspose2d(16, 8, 2, 2).double().to(device), nn.ConvTranspose2d(8, 3, 4, 4).double().to(device)]
    final = nn.GroupNorm(3, 3).double().to(device)
    stack = patchgemm.HierarchicalPatchUnembed.from_convs(unembed_convs, norms=[None], act="relu", final_norm=final)
    reference = copy.deepcopy(nn.Sequential(unembed_convs[0], nn.ReLU(), unembed_convs[1], final))
    _compare(reference, stack, randn(2, 16, 2, 3, dtype=torch.float64, device=device), params=False)


def test_a_converted_stem_under_bf16_autocast():
    torch.manual_seed(4)
    original = stem_3d(RMSInstanceNorm, dtype=torch.float32)
    model = Holder(stem_3d(RMSInstanceNorm, dtype=torch.float32))
    model.proj.load_state_dict(original.state_dict())
    patchgemm.convert(model)
    x = randn(2, 4, 32, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, ref = model(x), original(x)
    assert y.dtype == ref.dtype  # (float32: the norm's float32 scale promotes, in both)
    assert_close_to_ref(y, original(x), torch.bfloat16, tol=3e-2)


def test_model_bench_runs_every_form_on_the_cpu(capsys):
    """`python -m patchgemm bench --models` on tiny sizes: the MATEY-style model in its three forms,
    the converted form swapping the stem and the output whole and computing the same function."""
    from patchgemm.tools import model_bench

    rows = model_bench.run(["MATEY-3D"], device="cpu", tiny=True, progress=lambda line: None)
    assert [r.form for r in rows] == ["conv", "use_linear", "converted"]
    assert all(r.gpu_ms > 0 and r.wall_ms > 0 for r in rows)
    assert "; 2 swapped;" in rows[2].note and rows[1].vs_original_gpu > 0
    assert rows[2].note.startswith("vs use_linear: CPU ")  # the rewrite it must also beat (CPU time here)
    assert all(len(r.wall_rounds) == 31 and r.wall_ms == min(r.wall_rounds) for r in rows)
    assert rows[1].vs_original_wall == rows[0].wall_ms / rows[1].wall_ms  # the fastest rounds'
    assert gc.isenabled()  # the rounds ran without the collector, which is back on
    diff = float(rows[2].note.split("diff ")[1])
    assert diff < 3e-2
    model = model_bench.MateyStyle3d(2, 64, 16, 1, 4)
    report = patchgemm.convert(model)
    assert [type(m).__name__ for m in (model.embed, model.debed)] == ["HierarchicalPatchEmbed",
                                                                        "HierarchicalPatchUnembed"]
    assert model_bench.main(["nope"], device="cpu", tiny=True) == 2
    assert "unknown model" in capsys.readouterr().out
    assert "swapped 2" in str(report)


def test_model_bench_compiles_every_form_on_the_cpu():
    """`bench --models --compile` on tiny sizes: the compiled original, convert() then compile,
    and patchgemm.compile (no CUDA graphs on the CPU), each computing the model's function."""
    from patchgemm.tools import model_bench

    torch._dynamo.reset()
    rows = model_bench.run(["MATEY-3D"], device="cpu", tiny=True, progress=lambda line: None, compiled=True)
    assert [r.form for r in rows] == ["compile", "convert+compile", "patchgemm.compile"]
    assert all(r.gpu_ms > 0 and r.wall_ms > 0 for r in rows) and rows[2].vs_original_gpu > 0
    assert "2 swapped" in rows[1].note and rows[2].note.startswith("6 rewritten; ")
    assert all(float(r.note.split("diff ")[1]) < 3e-2 for r in rows)


def test_host_bench_times_every_op_against_its_pytorch_op(tmp_path):
    """`python -m patchgemm bench --host` on tiny sizes: a row per op and pass, and the JSON renders
    as a section of RESULTS.md."""
    import json
    import sys
    from pathlib import Path

    from patchgemm.tools import host_bench

    out = tmp_path / "cpu-host.json"
    assert host_bench.main(device="cpu", json_path=str(out), pairs=1, tiny=True) == 0
    saved = json.loads(out.read_text())
    ops = {(r["op"], r["pass_"]) for r in saved["host"]}
    assert {case.op for case in host_bench.cases()} - {"ragged grouped_linear"} == {op for op, _ in ops}
    assert all(r["ours_us"] > 0 and r["baseline_us"] > 0 and r["ratio"] > 0 for r in saved["host"])
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import results

    assert results.main([str(out), "--out", str(tmp_path / "RESULTS.md")]) == 0
    assert "## Host time per call" in (tmp_path / "RESULTS.md").read_text()
