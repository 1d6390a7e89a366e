"""patchgemm.compile / torch.compile(backend="patchgemm"): the traced graph's eligible convs become
patchgemm ops (forward and backward equal to the original's), the rest is left with a reason, the
model's modules and state_dict do not change, dynamic shapes recompile nothing they should not."""

import pytest
import torch
from torch import nn

import patchgemm
from conftest import DEVICES


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles Model.forward anew: Dynamo keeps a few compiled versions of a function
    (its recompile limit) and runs it eagerly past them."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Model(nn.Module):
    """One conv of every kind the rewrite meets: a patch stem whose tokens are read as the ViTs
    read them, one read channels-last (Swin, ConvNeXt), a plain one, a transpose, grouped and
    ungrouped 1 x 1 convs, a depthwise 1 x 1 and a 3 x 3."""

    def __init__(self):
        super().__init__()
        self.tokens = nn.Conv2d(3, 32, 4, 4)
        self.nhwc = nn.Conv2d(3, 32, 4, 4)
        self.proj = nn.Conv2d(3, 32, (4, 2), (4, 2))
        self.grouped = nn.Conv2d(32, 48, 1, groups=4)
        self.pointwise = nn.Conv2d(48, 48, 1)
        self.depthwise = nn.Conv2d(48, 48, 1, groups=48)
        self.conv3 = nn.Conv2d(48, 32, 3, padding=1)
        self.up = nn.ConvTranspose2d(32, 3, (4, 2), (4, 2))
        self.series = nn.Conv1d(2, 16, 8, 8)

    def forward(self, x, s):
        t = self.tokens(x).flatten(2).transpose(1, 2)
        c = self.nhwc(x).permute(0, 2, 3, 1)
        y = self.conv3(self.depthwise(self.pointwise(self.grouped(self.proj(x)))))
        return t, c, self.up(y), self.series(s).transpose(1, 2)


REWRITTEN = {"tokens": "patch_embed writing tokens", "nhwc": "patch_embed writing tokens", "proj": "patch_embed",
             "grouped": "grouped_pointwise_conv", "up": "patch_unembed", "series": "patch_embed writing tokens"}
LEFT = {"pointwise": "kernel 1", "depthwise": "one input channel per group", "conv3": "kernel_size (3, 3) != stride"}


def inputs(device, dtype=torch.float64, size=(16, 12), length=64):
    x = torch.randn(2, 3, *size, device=device, dtype=dtype, requires_grad=True)
    s = torch.randn(3, 2, length, device=device, dtype=dtype, requires_grad=True)
    return x, s


def outputs_and_grads(model, x, s):
    outs = model(x, s)
    loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype, device=o.device).view(o.shape)).sum()
               for o in outs)
    params = [x, s] + list(model.parameters())
    return outs, torch.autograd.grad(loss, params)


def assert_same(got, want, tol):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_rewrites_every_eligible_conv_and_says_why_it_left_the_rest(device):
    torch.manual_seed(0)
    model = Model().to(device, torch.float64)
    names = {n: type(m) for n, m in model.named_modules()}
    keys = list(model.state_dict())
    compiled = patchgemm.compile(model, backend="aot_eager", fullgraph=True)
    x, s = inputs(device)
    got, got_grads = outputs_and_grads(compiled, x, s)
    want, want_grads = outputs_and_grads(model, x, s)
    assert_same(got, want, 1e-10)
    assert_same(got_grads, want_grads, 1e-10)
    report = compiled.patchgemm_report
    assert {where: what.split(" -> ")[1] for where, what in report.rewritten} == REWRITTEN, str(report)
    left = dict(report.left)
    assert set(left) == set(LEFT), str(report)
    for where, reason in LEFT.items():
        assert reason in left[where], (where, left[where])
    assert "rewrote 6, left 3" in str(report)
    # The model itself is untouched: the same modules, the same state_dict keys.
    assert {n: type(m) for n, m in model.named_modules()} == names
    assert list(model.state_dict()) == keys


def test_the_tokens_are_written_contiguous():
    """The GEMM writes the tokens' layout: the flatten + transpose after it is a view of
    contiguous memory (the original's is a transposed view, copied by whatever reads it)."""
    model = Model().double()
    x, s = inputs("cpu")
    t, c, _, series = patchgemm.compile(model, backend="aot_eager")(x, s)
    assert t.is_contiguous() and c.is_contiguous() and series.is_contiguous()
    assert not model(x, s)[0].is_contiguous()


def test_dynamic_shapes_recompute_the_grid():
    """dynamic=True: new image sizes, including ones that leave a partial patch (dropped, as by the
    conv), run the same rewritten graph."""
    torch.manual_seed(0)
    model = Model().double()
    compiled = patchgemm.compile(model, backend="aot_eager", dynamic=True)
    for size, length in [((16, 12), 64), ((20, 14), 72), ((23, 9), 70)]:
        x, s = inputs("cpu", size=size, length=length)
        got, got_grads = outputs_and_grads(compiled, x, s)
        want, want_grads = outputs_and_grads(model, x, s)
        assert_same(got, want, 1e-10)
        assert_same(got_grads, want_grads, 1e-10)
    assert len(compiled.patchgemm_report.rewritten) == len(REWRITTEN)  # each call listed once


def test_inductor_compiles_the_rewritten_graph():
    torch.manual_seed(0)
    model = Model()
    compiled = patchgemm.compile(model)  # Inductor, its default mode
    x, s = inputs("cpu", dtype=torch.float32)
    got, got_grads = outputs_and_grads(compiled, x, s)
    want, want_grads = outputs_and_grads(model, x, s)
    assert_same(got, want, 1e-4)
    assert_same(got_grads, want_grads, 1e-4)
    assert len(compiled.patchgemm_report.rewritten) == len(REWRITTEN)


def test_torch_compile_finds_the_backend_by_name(caplog):
    """The package's entry point registers "patchgemm" with Dynamo; the report goes to the log."""
    model = Model().double()
    x, s = inputs("cpu")
    compiled = torch.compile(model, backend="patchgemm", mode="default")
    with caplog.at_level("INFO", logger="patchgemm.compiler"):
        assert_same(compiled(x, s), model(x, s), 1e-10)
    assert "patchgemm" in torch._dynamo.list_backends()
    assert "rewrote 6, left 3" in caplog.text


def test_calls_it_cannot_read_are_left():
    """A conv with a stride traced as a value, a float16 / float64 mix, and convs in a function
    (not a module) are handled as the calls they are."""
    def f(x, w, b):
        return torch.nn.functional.conv2d(x, w, b, stride=4), torch.nn.functional.conv2d(x, w, None, 2, 1)

    x, w, b = torch.randn(2, 3, 8, 8), torch.randn(16, 3, 4, 4), torch.randn(16)
    compiled = patchgemm.compile(f, backend="aot_eager")
    assert_same(compiled(x, w, b), f(x, w, b), 1e-5)
    report = compiled.patchgemm_report
    assert [what for _, what in report.rewritten] == ["conv2d(weight (16, 3, 4, 4), stride (4, 4)) -> patch_embed"]
    assert "kernel_size (4, 4) != stride (2, 2), padding=(1, 1)" in report.left[0][1]


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Conv2d(3, 8, 4, 4)

    def forward(self, x):
        torch._dynamo.graph_break()  # Dynamo traces the rest from this module's own frame
        return self.proj(x)


class _Wrapped(nn.Module):  # as transformers' task models hold their backbone
    def __init__(self):
        super().__init__()
        self.backbone = _Body()
        self.other = nn.Conv2d(3, 8, 4, 4)

    def forward(self, x):
        return self.backbone(x) + self.other(x)


def test_calls_are_named_from_the_model_after_a_graph_break():
    """A graph traced from a submodule's frame names its calls from that submodule ("proj"); the
    report names them from the compiled model ("backbone.proj"), in training and eval alike."""
    model = _Wrapped()
    compiled = patchgemm.compile(model, backend="aot_eager")
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    compiled(x).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
    assert sorted(where for where, _ in compiled.patchgemm_report.rewritten) == ["backbone.proj", "other"], \
        str(compiled.patchgemm_report)


def test_bad_arguments():
    with pytest.raises(TypeError, match="expected a module or function"):
        patchgemm.compile(42)
    with pytest.raises(ValueError, match="mode and options are Inductor's"):
        patchgemm.compile(Model(), backend="aot_eager", mode="reduce-overhead")


@pytest.mark.parametrize("name", ["vit_small_patch16_224", "convnext_atto", "swin_tiny_patch4_window7_224"])
def test_timm_models_compile_through_patchgemm(name):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10).eval()
    x = torch.randn(2, 3, 224, 224)
    compiled = patchgemm.compile(model, backend="aot_eager")
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    assert any(what.endswith("writing tokens") for _, what in compiled.patchgemm_report.rewritten), \
        str(compiled.patchgemm_report)


def test_autocast_regions_are_rewritten():
    """Under autocast a conv's input is bfloat16 while its weight is float32 (the op casts both, as
    the conv does): still rewritten, with the conv's result."""
    torch.manual_seed(0)
    model = Model()
    compiled = patchgemm.compile(model, backend="aot_eager")
    x, s = inputs("cpu", dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x, s), model(x, s)
    assert_same([g.float() for g in got], [w.float() for w in want], 3e-2)
    assert len(compiled.patchgemm_report.rewritten) == len(REWRITTEN), str(compiled.patchgemm_report)


def grouped_linears(x, w, w_god, x_gbd):
    """Grouped linears as models write them: einsums, and bmm over x[B, G, D].transpose(0, 1)."""
    return (torch.einsum("bgd,gdo->bgo", x, w),
            torch.einsum("n b g d, g o d -> n b g o", x.view(2, 3, 4, 5), w_god),
            torch.einsum("gbd,gdo->gbo", x_gbd, w),
            torch.bmm(x.transpose(0, 1), w).transpose(0, 1),
            x.permute(1, 0, 2).bmm(w_god.transpose(1, 2)).permute(1, 0, 2) + 1,
            torch.bmm(x.transpose(0, 1), w) * 2,          # the [G, B, O] result itself is read: left
            torch.einsum("bd,gdo->bgo", x[:, 0], w),      # one x for every group: not a grouped linear
            torch.bmm(x_gbd, w))                          # group-major: one strided-batched GEMM already


def test_grouped_linears_written_as_einsum_or_bmm_become_grouped_linear():
    torch.manual_seed(0)
    args = [torch.randn(6, 4, 5, dtype=torch.float64, requires_grad=True),
            torch.randn(4, 5, 7, dtype=torch.float64, requires_grad=True),
            torch.randn(4, 7, 5, dtype=torch.float64, requires_grad=True),
            torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)]
    compiled = patchgemm.compile(grouped_linears, backend="aot_eager", fullgraph=True)
    got, want = compiled(*args), grouped_linears(*args)
    assert_same(got, want, 1e-12)
    weights = [torch.randn_like(t) for t in want]
    assert_same(torch.autograd.grad(sum((g * r).sum() for g, r in zip(got, weights)), args),
                torch.autograd.grad(sum((t * r).sum() for t, r in zip(want, weights)), args), 1e-12)
    rewritten = [what for _, what in compiled.patchgemm_report.rewritten]
    assert len(rewritten) == 5 and all(w.endswith("-> grouped_linear") for w in rewritten), rewritten
    assert got[0].is_contiguous() and got[3].is_contiguous()  # [B, G, O] written directly
