"""The selection tables: every candidate can be forced by name and then runs (explain says so) with the
conv's / the linears' result; forcing one that does not apply is a clear error; explain, the dispatch
log and PATCHGEMM_FORCE report and pin what runs."""

import functools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from conftest import DEVICES, WGMMA, assert_close_to_ref, needs_gpu, poison_allocator, randn
from patchgemm.ops import ops

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}

# (x shape, kernel, E, out_format, dtype): between them, every candidate of the patch ops applies to
# one on a 9.0 GPU (the tiny kernels, the implicit GEMMs' four forms, the GEMM paths, ATen's).
PATCH_PROBLEMS = [
    ((2, 3, 16, 16), (16, 16), 32, "tokens", torch.float32),              # one patch per sample: a view
    ((2, 3, 12, 20), (2, 4), 24, "channels_first", torch.float32),        # odd sizes
    ((2, 4, 16, 16), (2, 2), 64, "channels_first", torch.bfloat16),       # tiny
    ((2, 4, 16, 16), (2, 2), 64, "tokens", torch.bfloat16),
    ((2, 3, 224, 224), (16, 16), 768, "tokens", torch.bfloat16),          # patch rows by TMA
    ((2, 8, 4, 32, 32), (2, 2, 2), 64, "channels_first", torch.bfloat16),  # pairs by TMA
    ((2, 16, 8, 8, 8), (4, 4, 4), 64, "tokens", torch.bfloat16),          # runs of 4
    ((2, 16, 8, 8, 16), (2, 2, 2), 64, "channels_first", torch.float16),
    ((2, 6, 12, 20), (2, 4), 4, "tokens", torch.bfloat16),                # 4 embeddings: narrow
]


def wgmma_built():
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and any(a.startswith("9.0a") for a in torch.ops.patchgemm.build_info()[1].split(";")))


def names(op, device):
    return [c.name for c in patchgemm.kernels(op) if device in c.backends]


def embed_case(problem, device):
    shape, kernel, embed, fmt, dtype = problem
    x = randn(*shape, dtype=dtype, device=device)
    w = randn(embed, shape[1], *kernel, dtype=dtype, device=device) / (shape[1] * torch.tensor(kernel).prod()) ** 0.5
    b = randn(embed, dtype=dtype, device=device)
    return x, w, b, kernel, fmt, dtype


def check_embed(problem, device):
    x, w, b, kernel, fmt, dtype = embed_case(problem, device)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = CONV[len(kernel)](x64, w64, b64, stride=kernel)
    dy = randn(*ref.shape, dtype=dtype, device=device)
    grads = torch.autograd.grad(ref, [x64, w64, b64], dy.double())
    tokens = fmt == "tokens"
    xr, wr, br = (t.requires_grad_() for t in (x, w, b))
    y = patchgemm.patch_embed(xr, wr, br, out_format=fmt)
    assert_close_to_ref(y, ref.flatten(2).transpose(1, 2) if tokens else ref, dtype, "y")
    out = torch.autograd.grad(y, [xr, wr, br], dy.flatten(2).transpose(1, 2) if tokens else dy)
    for g, r, what in zip(out, grads, ["grad_x", "grad_weight", "grad_bias"]):
        assert_close_to_ref(g, r, dtype, what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", ["patch_embed", "patch_unembed", "patch_weight_grad"])
def test_every_patch_candidate_runs_when_forced(op, device):
    """For every candidate of the op on this device: forced on each problem, it either runs (explain
    names it, the results are the conv's) or raises "does not apply"; and it runs on at least one."""
    ran = set()
    for problem in PATCH_PROBLEMS:
        if device == "cpu" and problem[4] != torch.float32:
            continue
        for name in names(op, device):
            try:
                with patchgemm.force(**{op: name}), patchgemm.explain() as e:
                    check_embed(problem, device)
            except RuntimeError as err:
                assert "does not apply" in str(err), err
                continue
            chosen = {c.chosen for c in e if c.op == op}
            assert chosen == {name}, (problem, name, [str(c) for c in e])
            ran.add(name)
    expected = set(names(op, device))
    if device == "cuda" and not wgmma_built():
        expected -= set(WGMMA)
    assert expected <= ran, f"never ran: {sorted(expected - ran)}"


def test_forcing_what_does_not_apply_names_the_reason():
    x = randn(2, 3, 8, 8)
    w = randn(16, 3, 2, 2)
    with patchgemm.force(patch_embed="view_gemm"):
        with pytest.raises(RuntimeError, match=r"forced implementation \"view_gemm\" does not apply.*x .*"
                                               r"not its own patch matrix"):
            patchgemm.patch_embed(x, w)
    with pytest.raises(RuntimeError, match="patch_embed has no implementation named \"nope\""):
        with patchgemm.force(patch_embed="nope"):
            pass
    with pytest.raises(RuntimeError, match="no op named \"patch_embedding\""):
        with patchgemm.force(patch_embedding="gather_gemm"):
            pass
    # The pin is gone after the block (and after an error inside it).
    assert patchgemm.explain(patchgemm.patch_embed, x, w)[0].forced is False


@pytest.mark.parametrize("device", DEVICES)
def test_explain_reports_every_candidate(device):
    x, w, b, kernel, fmt, dtype = embed_case(((2, 3, 12, 20), (2, 4), 24, "channels_first", torch.float32), device)
    (choice,) = patchgemm.explain(patchgemm.patch_embed, x, w, b)
    assert choice.op == "patch_embed" and not choice.forced
    assert [v.name for v in choice.candidates] == [c.name for c in patchgemm.kernels("patch_embed")]
    statuses = {v.name: v.status for v in choice.candidates}
    assert statuses[choice.chosen] == "chosen" and list(statuses.values()).count("chosen") == 1
    assert statuses["view_gemm"] == "unsupported"
    assert choice.chosen in str(choice)
    # Around a training step: the forward and both backward ops, from autograd's threads too.
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with patchgemm.explain() as e:
        patchgemm.patch_embed(xr, wr, b).sum().backward()
    assert {c.op for c in e} == {"patch_embed", "patch_unembed", "patch_weight_grad"}, str(e)


def _autograd_nodes(t):
    """The names of the autograd nodes t's graph reaches."""
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is not None and type(fn).__name__ not in seen:
            seen.add(type(fn).__name__)
            stack.extend(f for f, _ in fn.next_functions)
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["patch_embed", "patch_embed tokens", "patch_unembed"])
def test_a_settled_aten_conv_runs_with_pytorchs_autograd(device, case):
    """Where patch_embed's (patch_unembed's) choice is ATen's (transposed) convolution before anything
    runs (forced here; on CUDA the rules' channels-last case too), the op is that convolution as
    PyTorch's autograd records it: one convolution_backward gives dx, dW and db, and no patchgemm op
    runs the backward. Values, gradients and the output's memory format are the conv's; explain says
    how. A forced backward op (patch_unembed or patch_embed gives dx), or x that does not lie
    channels-last, keeps patchgemm's own autograd and backward ops."""
    tokens = case.endswith("tokens")
    if case == "patch_unembed":
        op, aten, dx_op, dx_impl = "patch_unembed", "aten_conv_transpose", "patch_embed", "gather_gemm"
        x, w, b = randn(2, 16, 4, 4), randn(16, 8, 2, 2), randn(8)
        run, ref_fn = patchgemm.patch_unembed, lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2)
    else:
        op, aten, dx_op, dx_impl = "patch_embed", "aten_conv", "patch_unembed", "gemm_scatter"
        x, w, b = randn(2, 8, 8, 8), randn(16, 8, 2, 2), randn(16)
        out_format = "tokens" if tokens else "channels_first"
        run = functools.partial(patchgemm.patch_embed, out_format=out_format)
        ref_fn = lambda x, w, b: F.conv2d(x, w, b, stride=2)  # noqa: E731
    x = x.to(device, torch.float64).contiguous(memory_format=torch.channels_last).requires_grad_()
    w, b = (t.to(device, torch.float64).requires_grad_() for t in (w, b))
    ref = ref_fn(x, w, b)
    ref = ref.flatten(2).transpose(1, 2) if tokens else ref
    g = randn(*ref.shape, dtype=torch.float64, device=device)
    ref_grads = torch.autograd.grad(ref, (x, w, b), g)

    def step(x):
        with patchgemm.explain() as e:
            y = run(x, w, b)
            grads = torch.autograd.grad(y, (x, w, b), g)
        return y, grads, e

    with patchgemm.force(**{op: aten}):
        y, grads, e = step(x)
    assert [c.op for c in e] == [op], str(e)
    assert e[0].chosen == aten and e[0].forced and "PyTorch's autograd" in e[0].how, str(e)
    assert "ConvolutionBackward0" in _autograd_nodes(y)
    assert y.is_contiguous() if tokens else y.is_contiguous(memory_format=torch.channels_last)
    assert_close_to_ref(y, ref, torch.float64)
    for got, want, name in zip(grads, ref_grads, ("dx", "dW", "db")):
        assert_close_to_ref(got, want, torch.float64, name)

    contiguous_x = x.detach().contiguous().requires_grad_()
    for forced, x_in in [({op: aten, dx_op: dx_impl}, x), ({op: aten, "patch_weight_grad": "gather_gemm"}, x),
                         ({op: aten}, contiguous_x)]:
        with patchgemm.force(**forced):
            y, grads, e = step(x_in)
        assert "ConvolutionBackward0" not in _autograd_nodes(y)
        assert {c.op for c in e} == {"patch_embed", "patch_unembed", "patch_weight_grad"}, str(e)
        assert e[0].how == "forced", str(e)
        for got, want, name in zip(grads, ref_grads, ("dx", "dW", "db")):
            assert_close_to_ref(got, want, torch.float64, name)


@needs_gpu
@pytest.mark.parametrize("op", ["patch_embed", "patch_unembed"])
def test_channels_last_cudnn_choice_runs_with_pytorchs_autograd(op):
    """Channels-last x with a short window into E >= 1024 (and an unembedding of 1 x 1 patches from
    512 channels): the rules choose cuDNN's (transposed) convolution, which then runs with PyTorch's
    autograd; in the autotune mode the choice is measured, and patchgemm's autograd stays."""
    if op == "patch_embed":
        x, w, k = randn(4, 64, 32, 32), randn(1024, 64, 2, 2), 2
        run, conv, aten = patchgemm.patch_embed, F.conv2d, "aten_conv"
    else:
        x, w, k = randn(4, 512, 32, 32), randn(512, 64, 1, 1), 1
        run, conv, aten = patchgemm.patch_unembed, F.conv_transpose2d, "aten_conv_transpose"
    x = x.to("cuda", torch.bfloat16).contiguous(memory_format=torch.channels_last)
    w = w.to("cuda", torch.bfloat16).requires_grad_()
    with patchgemm.explain() as e:
        y = run(x, w)
    assert [(c.op, c.chosen) for c in e] == [(op, aten)] and e[0].how.startswith("heuristic;"), str(e)
    assert "ConvolutionBackward0" in _autograd_nodes(y)
    assert y.is_contiguous(memory_format=torch.channels_last)
    assert_close_to_ref(y, conv(x.double(), w.double(), stride=k), torch.bfloat16)
    old = patchgemm.set_selection("autotune", cache_dir="")
    try:
        assert "ConvolutionBackward0" not in _autograd_nodes(run(x, w))
    finally:
        patchgemm.set_selection(old)


def test_cpu_grouped_linear_with_bias_runs_baddbmm():
    x, w, b = randn(4, 3, 8), randn(3, 5, 8), randn(3, 5)
    assert patchgemm.explain(patchgemm.grouped_linear, x, w, b)[0].chosen == "aten_bmm"
    assert patchgemm.explain(patchgemm.grouped_linear, x, w)[0].chosen == "strided_batched"
    # bfloat16: the planned call, whose operands are laid out for ATen's fast bf16 loop
    x, w, b = (t.to(torch.bfloat16) for t in (x, w, b))
    assert patchgemm.explain(patchgemm.grouped_linear, x, w, b)[0].chosen == "strided_batched"


def test_cpu_small_patch_embeddings_keep_the_gather_and_gemm():
    """On the CPU the gather + GEMM runs patch embeddings of under 256 rows (and their weight
    gradients), where ATen's convolution pays its set-up per call."""
    for x, w in [(randn(1, 4, 8, 8, 8), randn(16, 4, 2, 2, 2)), (randn(4, 1, 64), randn(8, 1, 16)),
                 (randn(2, 3, 16, 16), randn(8, 3, 4, 4))]:
        w.requires_grad_()
        with patchgemm.explain() as e:
            y = patchgemm.patch_embed(x, w)
            y.backward(randn(*y.shape))
        # (the weight gradient's GEMM reads the forward's patch matrix)
        assert {c.op: c.chosen for c in e} == {"patch_embed": "gather_gemm", "patch_weight_grad": "saved_patches"}, str(e)


@pytest.mark.parametrize("batch, groups, c_in, c_out, length, dtype, conv", [
    (4, 32, 32, 32, 256, torch.float32, True),   # the G2 benchmark's shape: 2^25 multiply-adds
    (1, 4, 64, 128, 1024, torch.float32, True),
    (4, 32, 32, 16, 256, torch.float32, False),  # c_out < 32
    (2, 16, 16, 64, 64, torch.float32, False),   # 2^20 multiply-adds
    (4, 32, 32, 32, 256, torch.bfloat16, False),  # 16-bit: torch.matmul
])
def test_cpu_fp32_grouped_pointwise_rule_chooses_onednn_convolution(batch, groups, c_in, c_out, length, dtype, conv):
    """fp32 channels-first x on the CPU, c_out >= 32 and 2^24 multiply-adds or more: a forward that no
    backward follows runs on ATen's grouped convolution, which explain() says; a training step's
    forward (the autograd layer's hint, in the signature) and its input gradient keep the GEMMs.
    Either way the values are the convolution's."""
    x = randn(batch, groups * c_in, length, dtype=dtype, requires_grad=True)
    w = randn(groups * c_out, c_in, 1, dtype=dtype) / math.sqrt(c_in)
    b = randn(groups * c_out, dtype=dtype)
    with torch.no_grad(), patchgemm.explain() as e:
        y_alone = patchgemm.grouped_pointwise_conv(x, w, b, groups)
    (alone,) = list(e)
    assert alone.chosen == ("aten_conv" if conv else "aten_matmul"), str(e)
    (matmul,) = [v for v in alone.candidates if v.name == "aten_matmul"]
    assert matmul.reason.startswith("rule: fp32 channels-first x on the CPU") == conv, str(e)
    assert "backward follows" not in alone.signature
    with patchgemm.explain() as e:
        y = patchgemm.grouped_pointwise_conv(x, w, b, groups)
        dy = randn(*y.shape, dtype=dtype)
        (grad_x,) = torch.autograd.grad(y, [x], dy)
    chosen = {c.op: c.chosen for c in e}
    assert chosen == {"grouped_pointwise_conv": "aten_matmul", "grouped_pointwise_conv_grad_input": "aten_matmul"}, str(e)
    assert "backward follows" in e[0].signature, str(e)
    xd = x.detach().double().requires_grad_()
    ref = F.conv1d(xd, w.double(), b.double(), groups=groups)
    (ref_grad_x,) = torch.autograd.grad(ref, [xd], dy.double())
    assert_close_to_ref(y_alone, ref, dtype)
    assert_close_to_ref(y, ref, dtype)
    assert_close_to_ref(grad_x, ref_grad_x, dtype)


@pytest.mark.parametrize("shape, kernel, fmt, dtype, conv", [
    ((1, 4, 16, 16, 16), (2, 2, 2), "channels_first", torch.float32, True),  # 512 rows: the rule
    ((4, 3, 64, 64), (4, 4), "channels_first", torch.float32, True),
    ((2, 8, 64, 64), (4, 4), "tokens", torch.float32, True),  # patches of 128 values
    ((8, 1, 512), (16,), "tokens", torch.float32, False),  # short patches into tokens
    ((1, 4, 16, 16, 16), (2, 2, 2), "channels_first", torch.bfloat16, False),  # 16-bit: no CPU conv
    ((1, 4, 8, 8, 8), (2, 2, 2), "channels_first", torch.float32, False),  # 64 rows
])
def test_cpu_fp32_rule_chooses_onednn_convolution(shape, kernel, fmt, dtype, conv):
    """fp32 on the CPU: channels-first outputs of 256 rows or more, and tokens of patches of 128 values
    or more, run on ATen's convolution (forward and weight gradient); the rest keep the gather + GEMM.
    Either way the values are the convolution's."""
    x, w = randn(*shape, dtype=dtype), randn(16, shape[1], *kernel, dtype=dtype, requires_grad=True)
    with patchgemm.explain() as e:
        y = patchgemm.patch_embed(x, w, out_format=fmt)
        dy = randn(*y.shape, dtype=dtype)
        (grad_w,) = torch.autograd.grad(y, [w], dy)
    chosen = {c.op: c.chosen for c in e}
    expected = {"patch_embed": "aten_conv", "patch_weight_grad": "aten_conv_backward"} if conv else \
        {"patch_embed": "gather_gemm", "patch_weight_grad": "saved_patches"}
    assert chosen == expected, str(e)
    if conv:  # the reason explain() gives for passing the gather over, forward and backward
        reasons = [v.reason for c in e for v in c.candidates if v.name == "gather_gemm"]
        assert len(reasons) == 2 and all(r.startswith("rule: fp32 on the CPU") for r in reasons), str(e)
    conv_nd = (F.conv1d, F.conv2d, F.conv3d)[len(kernel) - 1]
    wd = w.detach().double().requires_grad_()
    ref = conv_nd(x.double(), wd, stride=kernel)
    ref_tokens = ref.flatten(2).transpose(1, 2) if fmt == "tokens" else ref
    (ref_grad_w,) = torch.autograd.grad(ref_tokens, [wd], dy.double())
    assert_close_to_ref(y, ref_tokens, dtype)
    assert_close_to_ref(grad_w, ref_grad_w, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_16bit_convolution_is_never_a_patch_embedding(dtype):
    """torch's 16-bit CPU convolution returns wrong values for some problems (this one: relative error
    1.0): aten_conv does not apply there, so a forced call is an error and autotune keeps to the
    candidates that are right."""
    x, w = randn(2, 4, 976, dtype=dtype), randn(32, 4, 16, dtype=dtype)
    with pytest.raises(RuntimeError, match="16-bit on the CPU"), patchgemm.force(patch_embed="aten_conv"):
        patchgemm.patch_embed(x, w)
    ref = F.conv1d(x.double(), w.double(), stride=16)
    patchgemm.set_selection("autotune", cache_dir="")
    try:
        y = patchgemm.patch_embed(x, w)
    finally:
        patchgemm.set_selection("heuristic")
        ops._forget_selections()
    assert_close_to_ref(y, ref, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["bgd", "gbd"])
def test_grouped_candidates_match_the_linears(device, layout):
    G, B, din, dout = 3, 5, 7, 6
    x = randn(B, G, din, device=device) if layout == "bgd" else randn(G, B, din, device=device)
    w, b = randn(G, dout, din, device=device), randn(G, dout, device=device)
    dy = randn(*x.shape[:2], dout, device=device)
    xg = x if layout == "gbd" else x.transpose(0, 1)
    ref = (torch.bmm(xg.double(), w.double().transpose(1, 2)) + b.double()[:, None])
    ref = ref if layout == "gbd" else ref.transpose(0, 1)
    for name in names("grouped_linear", device):
        ops = {op: name for op in ("grouped_linear", "grouped_linear_grad_input", "grouped_linear_grad_weight")}
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        try:
            with patchgemm.force(**ops), patchgemm.explain() as e:
                y = patchgemm.grouped_linear(xr, wr, b, layout=layout)
                gx, gw = torch.autograd.grad(y, [xr, wr], dy)
        except RuntimeError as err:  # cuBLASLt may propose fewer algorithms than four
            assert name in LT_ALGORITHMS[1:] and "does not apply" in str(err), err
            continue
        assert {c.chosen for c in e} == {name} and len(e) == 3, str(e)
        assert_close_to_ref(y, ref, torch.float32, f"{name} y")
        dyg = dy.double() if layout == "gbd" else dy.double().transpose(0, 1)
        want_gx = torch.bmm(dyg, w.double())
        assert_close_to_ref(gx, want_gx if layout == "gbd" else want_gx.transpose(0, 1), torch.float32, f"{name} dx")
        assert_close_to_ref(gw, torch.bmm(dyg.transpose(1, 2), xg.double()), torch.float32, f"{name} dW")


LT_ALGORITHMS = [f"cublaslt_algo{k}" for k in range(1, 5)]


@needs_gpu
@pytest.mark.skipif(torch.version.hip is not None, reason="the cuBLASLt candidates are CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("has_bias", [True, False])
def test_cublaslt_algorithms_match_the_linears(dtype, has_bias):
    """Each of cuBLASLt's proposed algorithms, forced, computes the grouped linear and its gradients
    (the heuristic's first always applies to these shapes; later ones where it proposes them)."""
    assert set(LT_ALGORITHMS) <= set(names("grouped_linear", "cuda"))
    G, B, din, dout = 6, 40, 96, 72
    x = randn(B, G, din, dtype=dtype, device="cuda")
    w = randn(G, dout, din, dtype=dtype, device="cuda") / din ** 0.5
    b = randn(G, dout, dtype=dtype, device="cuda") if has_bias else None
    dy = randn(B, G, dout, dtype=dtype, device="cuda")
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    ref = torch.einsum("bgi,goi->bgo", x64, w64) + (0 if b is None else b.double())
    ran = []
    for name in LT_ALGORITHMS:
        ops = {op: name for op in ("grouped_linear", "grouped_linear_grad_input", "grouped_linear_grad_weight")}
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        poison_allocator(ref.numel() * x.element_size(), "cuda")
        try:
            with patchgemm.force(**ops), patchgemm.explain() as e:
                y = patchgemm.grouped_linear(xr, wr, b)
                gx, gw = torch.autograd.grad(y, [xr, wr], dy)
        except RuntimeError as err:
            assert name != "cublaslt_algo1" and "does not apply" in str(err), err
            continue
        assert {c.chosen for c in e} == {name}, str(e)
        assert_close_to_ref(y, ref, dtype, f"{name} y")
        assert_close_to_ref(gx, torch.einsum("bgo,goi->bgi", dy64, w64), dtype, f"{name} dx")
        assert_close_to_ref(gw, torch.einsum("bgo,bgi->goi", dy64, x64), dtype, f"{name} dW")
        ran.append(name)
    assert "cublaslt_algo1" in ran


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["channels_first", "tokens"])
def test_every_norm_candidate_runs_when_forced(device, layout):
    x_cf = randn(2, 6, 5, 7, device=device)
    w, b = randn(6, device=device), randn(6, device=device)
    x = x_cf.flatten(2).transpose(1, 2).contiguous() if layout == "tokens" else x_cf
    ref64 = [t.double().requires_grad_() for t in (x_cf, w, b)]
    ref = F.gelu(F.instance_norm(ref64[0], weight=ref64[1], bias=ref64[2], eps=1e-5))
    dy_cf = randn(*ref.shape, device=device)
    want = torch.autograd.grad(ref, ref64, dy_cf.double())
    dy = dy_cf.flatten(2).transpose(1, 2) if layout == "tokens" else dy_cf
    ops = ("instance_norm_act", "instance_norm_act_backward")
    for name in names("instance_norm_act", device):
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        with patchgemm.force(**{op: name for op in ops}), patchgemm.explain() as e:
            y = patchgemm.instance_norm_act(xr, wr, br, layout=layout)
            grads = torch.autograd.grad(y, [xr, wr, br], dy)
        assert [(c.op, c.chosen) for c in e] == [(op, name) for op in ops], str(e)
        y_cf = y.transpose(1, 2).reshape(x_cf.shape) if layout == "tokens" else y
        assert_close_to_ref(y_cf, ref, torch.float32, f"{name} y")
        gx = grads[0].transpose(1, 2).reshape(x_cf.shape) if layout == "tokens" else grads[0]
        for g, r, what in zip((gx, *grads[1:]), want, ["grad_x", "grad_weight", "grad_bias"]):
            assert_close_to_ref(g, r, torch.float32, f"{name} {what}")


def test_kernels_table_and_cli():
    rows = patchgemm.kernels()
    ops = {r.op for r in rows}
    assert {"patch_embed", "patch_unembed", "patch_weight_grad", "grouped_linear", "grouped_linear_grad_input",
            "grouped_linear_grad_weight", "instance_norm_act", "instance_norm_act_backward"} <= ops
    for op, last in [("patch_embed", "aten_conv"), ("patch_unembed", "aten_conv_transpose"),
                     ("patch_weight_grad", "aten_conv_backward")]:
        assert patchgemm.kernels(op)[-1].name == last
    out = subprocess.run([sys.executable, "-m", "patchgemm", "kernels"], capture_output=True, text=True,
                         cwd="/", check=True).stdout
    assert "patch_embed:" in out and "gather_gemm" in out and "aten_conv" in out


def test_env_force_and_dispatch_log():
    """PATCHGEMM_FORCE pins a candidate from the start; PATCHGEMM_LOG_DISPATCH logs each new choice once."""
    code = ("import torch, patchgemm\n"
            "x = torch.randn(2, 3, 8, 8); w = torch.randn(16, 3, 2, 2)\n"
            "for _ in range(3): y = patchgemm.patch_embed(x, w)\n"
            "ref = torch.nn.functional.conv2d(x, w, stride=2)\n"
            "assert torch.allclose(y, ref, atol=1e-5)\n")
    env = dict(os.environ, PATCHGEMM_FORCE="patch_embed=aten_conv", PATCHGEMM_LOG_DISPATCH="1")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("patchgemm: patch_embed")]
    assert len(lines) == 1 and lines[0].endswith("-> aten_conv (forced)"), run.stderr
    env["PATCHGEMM_FORCE"] = "patch_embed=nothing"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", env=env)
    assert run.returncode != 0 and "PATCHGEMM_FORCE: patch_embed has no implementation named" in run.stderr


def test_heldout_bench_measures_every_op_on_small_shapes():
    """bench/heldout.py's harness on CPU-sized shapes: a ratio and the chosen candidates per pass."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "heldout.py"
    spec = importlib.util.spec_from_file_location("heldout", path)
    heldout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heldout)
    from patchgemm.tools.shapes import _embed, _grouped, _unembed, channels_last_shapes

    shapes = [_embed("e", (2, 4, 8, 8), 16, (2, 2), channels_last=True),
              _unembed("u", (2, 3, 12), 4, (4,), tokens=True, grid=(3,)),
              _unembed("uc", (2, 16, 4, 4), 4, (2, 2), channels_last=True),
              _grouped("g", (4, 3, 8), 5, bias=False)]
    results = [r for s in shapes for r in heldout.measure(s, "tuning", torch.device("cpu"), candidates=True)]
    assert [(r.id, r.pass_) for r in results] == [(s.id, p) for s in shapes for p in ("fwd", "fwd+bwd")]
    for r in results:
        assert r.ratio > 0 and r.chosen[r.op] in {c.name for c in patchgemm.kernels(r.op)}
        assert r.how.keys() == r.chosen.keys() and all(r.how.values()), r.how
        assert r.candidates_ms  # every op of the pass, each candidate timed or marked unsupported
    pairs = results[1].candidates_ms["patch_embed+patch_weight_grad"]  # "e" forward + backward: every pairing
    assert pairs["gather_gemm+saved_patches"] > 0 and pairs["aten_conv+saved_patches"] is None
    # "u" forward + backward: its dx (an embedding of grad_y) paired with the weight gradient
    pairs = results[3].candidates_ms["patch_embed+patch_weight_grad"]
    assert pairs["gather_gemm+saved_patches"] > 0 and pairs["aten_conv+saved_patches"] is None
    assert {row["op"] for row in heldout.summary(results)} == {"patch_embed", "patch_unembed", "grouped_linear"}
    families = heldout.family_summary(results)  # (the ids name no family: TUNING-style ids, "image" / "grouped")
    assert sum(f["n"] for f in families) == len(results)
    assert all(0 <= f["below_0.97"] <= 1 and f["min"] <= f["geomean"] for f in families)
    markdown = heldout.format_markdown(results, {"selection": "heuristic"})
    slower = [r for r in results if r.ratio < 0.97]  # the per-call table lists only these
    per_call = markdown.split("The calls below 0.97x")[1]
    assert "Per model family" in markdown and per_call.count("\n| tuning |") == len(slower)
    assert markdown.startswith("`python bench/heldout.py --set all --selection heuristic`")
    command = "python bench/heldout.py --set drawn --count 40 --seed 2 --selection learned"  # as main records it
    assert heldout.format_markdown(results, {"selection": "learned", "command": command}).startswith(f"`{command}`")
    # --set channels-last: channels-last 16-bit embeddings, each followed by its transpose back to x
    cl = channels_last_shapes(3)
    assert [s.op for s in cl] == ["patch_embed", "patch_unembed"] * 3 and len({s.id for s in cl}) == 6
    for embed, transpose in zip(cl[::2], cl[1::2]):
        assert embed.channels_last and transpose.channels_last and embed.dtype in ("bf16", "fp16")
        assert transpose.x[:2] == (embed.x[0], embed.width) and transpose.width == embed.x[1]
        assert [g * k for g, k in zip(transpose.x[2:], transpose.kernel)] == list(embed.x[2:])


# The rules' choices on shapes they were fitted to (bench/results/tune-h100.json.gz): what each one is for.
RULE_CASES = [
    # channels-last 3-D with long kernels: cuDNN ran 20-90x slower than the GEMM path (few output
    # tiles over K = 49152: the fused kernels would not fill the GPU)
    # (the weight gradient multiplies the forward's patch matrix, its 16-bit bias summed apart from
    # grad_y, 0.4 MB; its own rule shows on the op alone, "patch_weight_grad op")
    ((2, 96, 32, 128, 32), (8, 8, 8), 384, "channels_last", {"patch_embed": "gather_gemm",
                                                             "patch_weight_grad": "saved_patches",
                                                             "patch_weight_grad op": "gather_gemm"}),
    # ConvNeXt's k = 2 downsampling, channels-last: the fused forward (1.2x-2x cuDNN's), and for
    # E > 256 cuDNN's weight gradient
    ((32, 192, 28, 28), (2, 2), 384, "channels_last", {"patch_embed": "implicit_sm90",
                                                       "patch_weight_grad": "aten_conv_backward"}),
    # ... but into E >= 1024, cuDNN's channels-last kernels, with PyTorch's autograd (its
    # convolution_backward: no patchgemm op runs the backward)
    ((16, 64, 32, 32), (2, 2), 1024, "channels_last", {"patch_embed": "aten_conv", "patch_weight_grad": None}),
    # Swin's stem: the wgmma weight gradient below 128 patch values
    ((64, 3, 224, 224), (4, 4), 96, "channels_first", {"patch_weight_grad": "implicit_sm90"}),
    # ViT-B/16 at batch 1, writing tokens: a patch matrix under 2 MB, ATen's permute copy + linear;
    # its weight gradient multiplies that copy, as the linear rewrite's backward does (the bias summed
    # apart from grad_y, 0.3 MB)
    ((1, 3, 224, 224), (16, 16), 768, "tokens", {"patch_embed": "aten_linear", "patch_weight_grad": "saved_patches"}),
    # one 64 x 64 output tile over K = 262144: the fused kernels would stream x on one SM (50x slower)
    ((1, 1024, 128, 128), (16, 16), 64, "channels_first", {"patch_embed": "gather_gemm"}),
    # a 1024 x 32768 weight gradient from 16 tokens: 2048 output tiles, past 8 per SM
    ((1, 128, 64, 64), (16, 16), 1024, "channels_first", {"patch_weight_grad op": "gather_gemm"}),
]


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                    reason="rules fitted on sm_90 (H100 / H200) choices")
@pytest.mark.parametrize("shape,kernel,embed,layout,expected", RULE_CASES)
def test_rules_choose_what_they_were_fitted_to(shape, kernel, embed, layout, expected):
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    x = randn(*shape, dtype=torch.bfloat16, device="cuda")
    if layout == "channels_last":
        x = x.contiguous(memory_format=fmt)
    w = randn(embed, shape[1], *kernel, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    b = randn(embed, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    expected = dict(expected)
    alone = expected.pop("patch_weight_grad op", None)
    tokens = layout == "tokens"
    with patchgemm.explain() as e:
        y = patchgemm.patch_embed(x, w, b, out_format="tokens" if tokens else "channels_first")
        grad_y = torch.randn_like(y)  # in y's memory format, as a network's next layer gives it
        y.backward(grad_y)
    chosen = {c.op: c.chosen for c in e}
    assert {op: chosen.get(op) for op in expected} == expected, str(e)
    if alone:
        with patchgemm.explain() as e:
            torch.ops.patchgemm.patch_weight_grad(grad_y, x, list(kernel), tokens, [], True)
        assert [c.chosen for c in e] == [alone], str(e)


def test_every_shape_has_a_model_family():
    """shapes.FAMILIES: whole families, ids that name them; family_of for the other sets' ids."""
    from patchgemm.tools import shapes, tune

    catalog = tune.shape_sets(["families"], 0, 0)["families"]
    assert len(catalog) == sum(len(v) for v in shapes.FAMILIES.values()) and len({s.id for s in catalog}) == len(catalog)
    for family, members in shapes.FAMILIES.items():
        assert len(members) >= 5 and {shapes.family_of(s.id) for s in members} == {family}
        for s in members:  # tokens in: as many as the grid has (SigLIP's 384 / 14 leaves pixels out, as the conv)
            if s.op == "patch_unembed" and s.tokens:
                assert s.x[1] == math.prod(s.grid) and len(s.grid) == len(s.kernel), s.id
    assert shapes.family_of("random-embed-3") == "random" and shapes.family_of("model-stem-7") == "model-like"
    assert {shapes.family_of(s.id) for s in shapes.TUNING + shapes.HELDOUT} >= {"image", "video", "volumes", "grouped"}
    assert not set(shapes.FAMILIES) & set(tune.NEVER_HELD_OUT)


def test_explain_names_the_grouped_gemm_operands_by_the_callers_tensors():
    x, w = randn(4, 3, 8, requires_grad=True), randn(3, 5, 8, requires_grad=True)
    with patchgemm.explain() as choices:
        patchgemm.grouped_linear(x, w).sum().backward()
    text = str(choices)
    assert [c.op for c in choices] == ["grouped_linear", "grouped_linear_grad_input", "grouped_linear_grad_weight"]
    for legend in ("x as [G, B, D] and weight transposed", "grad_y as [G, B, N] and weight [G, N, D]",
                   "grad_y transposed, [G, N, B], and x as [G, B, D]"):
        assert legend in text


def test_the_default_is_the_shipped_model_where_it_has_timings(tmp_path):
    """A fresh process chooses by the learned model, trained on GPU timings only: on the CPU each op
    falls back to the heuristic (and says so); on a GPU the model predicts."""
    from patchgemm import selection

    assert selection.load_model()["backends"] == ["cuda"]
    code = ("import patchgemm, torch; print(patchgemm.get_selection())\n"
            "for d in ['cpu'] + (['cuda'] if torch.cuda.is_available() else []):\n"
            "    x, w = torch.randn(2, 3, 32, 32, device=d), torch.randn(64, 3, 4, 4, device=d)\n"
            "    print(patchgemm.explain(patchgemm.patch_embed, x, w)[0].how)")
    env = {k: v for k, v in os.environ.items() if k != "PATCHGEMM_SELECTION"}
    env["PATCHGEMM_CACHE_DIR"] = str(tmp_path)  # no autotune records to recall
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[:2] == ["learned", "heuristic (learned: no usable model for patch_embed)"]
    if torch.cuda.is_available():
        assert lines[2] == "learned: predicted now"
