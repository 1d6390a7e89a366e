"""Bad input never computes: each wrong call below raises an error of the type torch's own ops raise
(TypeError for a wrong kind of argument, RuntimeError for tensors that do not fit, ValueError for a
bad option), and its message names the argument."""

import subprocess
import sys

import pytest
import torch

import patchgemm


def moe_args(experts=4, index=((0, 1), (2, 3))):
    dim, hidden = 8, 3
    return (torch.randn(len(index), dim), torch.tensor(index), torch.ones(len(index), len(index[0])),
            torch.randn(experts, 2 * hidden, dim), torch.randn(experts, dim, hidden))


def ragged(group_sizes):
    return patchgemm.grouped_linear(torch.randn(10, 4), torch.randn(3, 5, 4), group_sizes=group_sizes)


BAD_CALLS = {
    # moe_experts: expert indices outside [0, E] (E itself: no expert), no experts at all
    "moe_experts index -1": (lambda: patchgemm.moe_experts(*moe_args(index=((0, -1), (1, 2)))),
                             RuntimeError, "expert_index"),
    "moe_experts index above E": (lambda: patchgemm.moe_experts(*moe_args(index=((0, 9), (1, 2)))),
                                  RuntimeError, "expert_index"),
    "moe_experts E = 0": (lambda: patchgemm.moe_experts(*moe_args(experts=0, index=((0,), (0,)))),
                          RuntimeError, "no experts"),
    # group sizes: not ints (never truncated), not a sequence
    "group_sizes floats": (lambda: ragged([3.5, 3, 4.5]), TypeError, "group_sizes"),
    "group_sizes a string": (lambda: ragged("abc"), TypeError, "group_sizes"),
    "group_sizes an int": (lambda: ragged(5), TypeError, "group_sizes"),
    "group_sizes bools": (lambda: ragged([True, 4, 5]), TypeError, "group_sizes"),
    # grouped_linear: x not 3-D whose features do not match names x's own shape, not the op's view of it
    "grouped_linear flattened x, wrong Din": (
        lambda: patchgemm.grouped_linear(torch.randn(4, 6), torch.randn(2, 5, 3)), RuntimeError, "(4, 6)"),
    "grouped_linear 4-D x, wrong Din": (
        lambda: patchgemm.grouped_linear(torch.randn(2, 3, 2, 4), torch.randn(2, 5, 3)), RuntimeError, "(2, 3, 2, 4)"),
    "grouped_mlp x of the wrong width": (
        lambda: patchgemm.GroupedMLP(2, 4, 8)(torch.randn(3, 2, 5)), RuntimeError, r"got shape \(3, 2, 5\)"),
    "grouped_mlp x of the wrong groups": (
        lambda: patchgemm.GroupedMLP(2, 4, 8)(torch.randn(3, 3, 4)), RuntimeError, r"x must be \[B, 2, 4\]"),
    # a bias (or a norm's parameter) that is not a tensor: a TypeError, as torch's ops raise
    "patch_embed bias a string": (lambda: patchgemm.patch_embed(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 2, 2), "b"),
                                  TypeError, "bias must be a tensor or None"),
    "patch_unembed bias a string": (
        lambda: patchgemm.patch_unembed(torch.randn(2, 4, 3, 3), torch.randn(4, 3, 2, 2), "b"), TypeError, "bias"),
    "grouped_pointwise_conv bias a string": (
        lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 8, 5), torch.randn(8, 4, 1), "b", 2), TypeError, "bias"),
    "instance_norm_act weight a string": (
        lambda: patchgemm.instance_norm_act(torch.randn(2, 3, 4), weight="w"), TypeError, "weight"),
    "grouped_mlp bias_gate_up a string": (
        lambda: patchgemm.grouped_mlp(torch.randn(3, 2, 4), torch.randn(2, 8, 4), torch.randn(2, 4, 4),
                                      bias_gate_up="b"), TypeError, "bias_gate_up"),
    "grouped_mlp w_down a string": (
        lambda: patchgemm.grouped_mlp(torch.randn(3, 2, 4), torch.randn(2, 8, 4), "w"), TypeError, "w_down"),
    # grouped pointwise conv: groups not an int
    "groups a string": (lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 8, 5), torch.randn(8, 4, 1),
                                                                 groups="2"), TypeError, "groups"),
    "groups a float": (lambda: patchgemm.grouped_pointwise_conv(torch.randn(2, 8, 5), torch.randn(8, 4, 1),
                                                                groups=2.0), TypeError, "groups"),
    # convert: inplace not a bool
    "convert inplace='no'": (lambda: patchgemm.convert(torch.nn.Conv2d(3, 4, 2, 2), inplace="no"),
                             TypeError, "inplace"),
    # patch_embed: an unbatched x with the wrong channel count names the channels, as conv2d does
    "patch_embed unbatched x, wrong channels": (
        lambda: patchgemm.patch_embed(torch.randn(2, 3, 224), torch.randn(96, 3, 16, 16)), RuntimeError, "channels"),
    "instance_norm_act eps a string": (lambda: patchgemm.instance_norm_act(torch.randn(2, 3, 4), eps="a"),
                                       TypeError, "eps"),
    # modules: sizes that are not ints
    "GroupedLinear(2.5, 4, 4)": (lambda: patchgemm.GroupedLinear(2.5, 4, 4), TypeError, "num_groups"),
    "GroupedMLP dim a string": (lambda: patchgemm.GroupedMLP(2, "4", 8), TypeError, "dim"),
    "MoEExperts(4.0, 8, 8)": (lambda: patchgemm.MoEExperts(4.0, 8, 8), TypeError, "num_experts"),
    "PatchEmbed(3.0, 8, 4)": (lambda: patchgemm.PatchEmbed(3.0, 8, 4), TypeError, "in_channels"),
    "PatchUnembed(8, None, 4)": (lambda: patchgemm.PatchUnembed(8, None, 4), TypeError, "out_channels"),
    "GroupedPointwiseConv groups 2.0": (lambda: patchgemm.GroupedPointwiseConv(8, 8, 2.0), TypeError, "groups"),
    "explain(42)": (lambda: patchgemm.explain(42), TypeError, "explain"),
    # modules: a bias switch that is not a bool (a string is not read by its truth)
    "GroupedLinear bias='no'": (lambda: patchgemm.GroupedLinear(2, 4, 4, bias="no"), TypeError, "bias must be a bool"),
    "GroupedMLP bias=1": (lambda: patchgemm.GroupedMLP(2, 4, 8, bias=1), TypeError, "bias must be a bool"),
    "PatchEmbed bias='no'": (lambda: patchgemm.PatchEmbed(3, 8, 2, bias="no"), TypeError, "bias must be a bool"),
    "PatchUnembed bias=None": (lambda: patchgemm.PatchUnembed(8, 3, 2, bias=None), TypeError, "bias must be a bool"),
    "GroupedPointwiseConv bias='no'": (lambda: patchgemm.GroupedPointwiseConv(8, 4, 2, bias="no"), TypeError,
                                       "bias must be a bool"),
    "PatchEmbed dims=0": (lambda: patchgemm.PatchEmbed(3, 8, 2, dims=0), ValueError, "dims=0"),
    "PatchUnembed dims=True": (lambda: patchgemm.PatchUnembed(8, 3, 2, dims=True), ValueError, "dims=True"),
    # instance_norm_act: parameters in another dtype than x's (float32 for 16-bit x is autocast's)
    "instance_norm_act float64 weight": (
        lambda: patchgemm.instance_norm_act(torch.randn(2, 3, 8), torch.randn(3, dtype=torch.float64)),
        RuntimeError, "weight must be a tensor of x's dtype"),
    "instance_norm_act int bias": (
        lambda: patchgemm.instance_norm_act(torch.randn(2, 3, 8), None, torch.ones(3, dtype=torch.long)),
        RuntimeError, "bias must be a tensor of x's dtype"),
    # a meta tensor among real ones: the fake kernel would hand back uninitialized memory
    "patch_embed meta weight, cpu x": (
        lambda: patchgemm.patch_embed(torch.randn(1, 3, 8, 8), torch.randn(4, 3, 2, 2, device="meta")),
        RuntimeError, "weight is on meta but x is on cpu"),
    "grouped_linear meta bias": (
        lambda: patchgemm.grouped_linear(torch.randn(2, 3, 4), torch.randn(3, 5, 4), torch.randn(3, 5, device="meta")),
        RuntimeError, "bias is on meta but x is on cpu"),
    "instance_norm_act meta weight": (
        lambda: patchgemm.instance_norm_act(torch.randn(2, 3, 8), torch.randn(3, device="meta")),
        RuntimeError, "weight is on meta"),
    "moe_experts meta w_gate_up": (
        lambda: patchgemm.moe_experts(*moe_args()[:3], torch.randn(4, 6, 8, device="meta"), moe_args()[4]),
        RuntimeError, "weight is on meta"),
    # FP8 regions: a ragged x of no dims, and the region's own switch
    "ragged 0-dim x in an fp8_autocast region": (lambda: in_fp8_region(
        lambda: patchgemm.grouped_linear(torch.tensor(1.0), torch.randn(2, 4, 4), group_sizes=[1, 0])),
        RuntimeError, r"x must be \[N, Din\]"),
    "fp8_autocast(everywhere='yes')": (lambda: in_fp8_region(lambda: None, everywhere="yes"), TypeError,
                                       "everywhere must be a bool"),
    "fp8_autocast(enabled=1)": (lambda: in_fp8_region(lambda: None, enabled=1), TypeError,
                                "enabled must be a bool"),
    "Float8Recipe(fast_accumulation='no')": (lambda: patchgemm.Float8Recipe(fast_accumulation="no"), TypeError,
                                             "fast_accumulation must be a bool"),
}


def in_fp8_region(call, **region):
    with patchgemm.fp8_autocast(**region):
        return call()


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_calls_raise_clear_errors(name):
    call, error, named = BAD_CALLS[name]
    with pytest.raises(error, match=named):
        call()


def test_expert_index_e_means_no_expert():
    # E itself is the documented "no expert" slot: it adds nothing (a slot of weight 0)
    x, index, weight, w_gate_up, w_down = moe_args(index=((0, 4), (1, 4)))
    alone = patchgemm.moe_experts(x, index[:, :1], weight[:, :1], w_gate_up, w_down)
    torch.testing.assert_close(patchgemm.moe_experts(x, index, weight, w_gate_up, w_down), alone)


def test_convert_report_repr_is_short():
    model = torch.nn.ModuleList([torch.nn.Conv2d(3, 3, 2, 2) for _ in range(50)])
    report = patchgemm.convert(model)
    assert repr(report) == "ConvertReport(model=ModuleList, swapped=50, skipped=0)"


def test_kernels_of_an_unknown_op_is_one_line_and_status_2():
    r = subprocess.run([sys.executable, "-m", "patchgemm", "kernels", "nope"], capture_output=True, text=True,
                       cwd="/")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no op named 'nope'" in r.stderr, r.stderr


@pytest.mark.parametrize("device", ["tpu", "xla"] + ([] if torch.cuda.is_available() else ["cuda"]))
def test_bench_with_a_device_it_cannot_use_is_a_usage_error(device):
    """No traceback: argparse's one line and status 2, naming the argument."""
    r = subprocess.run([sys.executable, "-m", "patchgemm", "bench", "--device", device], capture_output=True,
                       text=True, cwd="/")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "argument --device" in r.stderr, r.stderr
