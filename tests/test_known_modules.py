"""convert() on the patch embeddings of timm and transformers: their conv becomes a PatchEmbed that
writes the tokens directly; the module, its options and its state_dict keys stay, and the model
computes what it computed. Models are built from small configs (no weights are downloaded); the
tests of a library are skipped where it is not installed. The matching itself (by class name, no
import) is tested without either library."""

import pytest
import torch
from torch import nn

import patchgemm
from conftest import DEVICES, randn

F64 = torch.float64


def _check_converted(model, inputs, swapped_name, where, out=lambda y: y):
    """convert(model) in float64: the report names the swap, the state_dict keys stay, and the
    outputs and every parameter gradient match the original's."""
    model = model.to(F64).eval()
    keys = list(model.state_dict())
    report = patchgemm.convert(model, inplace=False)
    # (the library's own nesting above the module varies between its releases)
    swaps = [what for name, what in report.swapped if name == swapped_name or name.endswith("." + swapped_name)]
    assert len(swaps) == 1 and swaps[0].endswith(f" -> PatchEmbed writing tokens (in {where})"), str(report)
    converted = report.model
    assert list(converted.state_dict()) == keys
    converted.load_state_dict(model.state_dict())  # checkpoints of the original load
    results = []
    for m in (model, converted):
        y = out(m(*inputs))
        m.zero_grad(set_to_none=True)
        (y * torch.linspace(-1, 1, y.numel(), dtype=F64, device=y.device).view(y.shape)).sum().backward()
        results.append((y.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (y_ref, g_ref), (y_new, g_new) = results
    torch.testing.assert_close(y_new, y_ref, rtol=1e-10, atol=1e-10)
    assert g_new.keys() == g_ref.keys()
    for name in g_ref:
        torch.testing.assert_close(g_new[name], g_ref[name], rtol=1e-9, atol=1e-9, msg=name)
    return converted


# ---- matching by name, without the libraries ------------------------------------------------------

def _timm_like(module_name="timm.layers.patch_embed", qualname="PatchEmbed"):
    """A class laid out and named as timm's PatchEmbed (the parts convert reads)."""
    class PatchEmbed(nn.Module):
        def __init__(self, flatten=True, output_fmt="NCHW"):
            super().__init__()
            self.proj = nn.Conv2d(3, 8, 4, stride=4)
            self.norm = nn.LayerNorm(8)
            self.flatten, self.output_fmt = flatten, output_fmt

        def forward(self, x):
            x = self.proj(x)
            if self.flatten:
                x = x.flatten(2).transpose(1, 2)
            elif self.output_fmt == "NHWC":
                x = x.permute(0, 2, 3, 1)
            return self.norm(x) if self.flatten or self.output_fmt == "NHWC" else x

    PatchEmbed.__module__, PatchEmbed.__qualname__ = module_name, qualname
    return PatchEmbed


def test_known_modules_are_matched_by_name_only():
    x = randn(2, 3, 16, 12, dtype=F64)
    cls = _timm_like()
    m = _check_converted(nn.Sequential(cls()), (x,), "0.proj", "timm PatchEmbed")
    assert type(m[0]) is cls and isinstance(m[0].proj, patchgemm.PatchEmbed)
    assert m[0].proj.out_format == "channels_last"
    assert m[0].proj(x).flatten(2).transpose(1, 2).is_contiguous()  # the tokens, written directly
    _check_converted(nn.Sequential(cls(flatten=False, output_fmt="NHWC")), (x,), "0.proj", "timm PatchEmbed")

    # The conv's own map (flatten=False, NCHW), another library's class of the same name, and a
    # subclass: plain conv swaps, the output in the conv's memory format.
    for model in (cls(flatten=False), _timm_like("mylib.layers")(), type("Sub", (cls,), {})()):
        report = patchgemm.convert(model.to(F64), inplace=False)
        assert dict(report.swapped) == {"proj": "Conv2d -> PatchEmbed"}
        assert report.model.proj.out_format == "channels_first"


def test_a_known_module_with_an_ineligible_conv_is_left_alone():
    m = _timm_like()()
    m.proj = nn.Conv2d(3, 8, 4, stride=2)
    report = patchgemm.convert(m)
    assert not report.swapped and "kernel_size (4, 4) != stride (2, 2)" in dict(report.skipped)["proj"]


# ---- timm -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_timm_vision_transformer(device):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=5).to(device)
    x = randn(2, 3, 32, 32, dtype=F64, device=device)
    _check_converted(model, (x,), "patch_embed.proj", "timm PatchEmbed")


@pytest.mark.parametrize("options", [
    dict(dynamic_img_pad=True, strict_img_size=False), dict(norm_layer=nn.LayerNorm),
    dict(output_fmt="NHWC"), dict(img_size=None)])
def test_timm_patch_embed_options(options):
    pytest.importorskip("timm")
    from timm.layers import PatchEmbed
    torch.manual_seed(0)
    embed = PatchEmbed(img_size=options.pop("img_size", 32), patch_size=8, in_chans=3, embed_dim=16, **options)
    x = randn(2, 3, 30 if embed.dynamic_img_pad else 32, 32, dtype=F64)
    m = _check_converted(nn.Sequential(embed), (x,), "0.proj", "timm PatchEmbed")
    assert type(m[0]) is PatchEmbed and m[0].dynamic_img_pad == embed.dynamic_img_pad
    if embed.img_size is not None and embed.strict_img_size:
        with pytest.raises(AssertionError):  # timm's own check still runs
            m(randn(2, 3, 16, 32, dtype=F64))


def test_timm_swin_stem():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.models.swin_transformer.SwinTransformer(
        img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1,), num_heads=(2,), num_classes=3)
    _check_converted(model, (randn(2, 3, 32, 32, dtype=F64),), "patch_embed.proj", "timm PatchEmbed")


# ---- transformers -----------------------------------------------------------------------------------

def _hf(name):
    transformers = pytest.importorskip("transformers")
    return getattr(transformers, name)


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_vit(device):
    config = _hf("ViTConfig")(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                              num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = _hf("ViTModel")(config).to(device)
    x = randn(2, 3, 32, 32, dtype=F64, device=device)
    _check_converted(model, (x,), "embeddings.patch_embeddings.projection", "transformers ViTPatchEmbeddings",
                     out=lambda o: o.last_hidden_state)


def test_transformers_videomae():
    config = _hf("VideoMAEConfig")(image_size=32, patch_size=8, num_frames=4, tubelet_size=2, hidden_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    model = _hf("VideoMAEModel")(config)
    x = randn(2, 4, 3, 32, 32, dtype=F64)
    _check_converted(model, (x,), "embeddings.patch_embeddings.projection",
                     "transformers VideoMAEPatchEmbeddings", out=lambda o: o.last_hidden_state)


def test_transformers_clip_and_siglip_vision():
    for prefix in ("CLIP", "Siglip"):
        config = _hf(f"{prefix}VisionConfig")(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=64)
        torch.manual_seed(0)
        model = _hf(f"{prefix}VisionModel")(config)
        _check_converted(model, (randn(2, 3, 32, 32, dtype=F64),), "embeddings.patch_embedding",
                         f"transformers {prefix}VisionEmbeddings", out=lambda o: o.last_hidden_state)


def test_transformers_qwen2_vl_patch_embed():
    pytest.importorskip("transformers")
    from transformers.models.qwen2_vl.modeling_qwen2_vl import PatchEmbed
    torch.manual_seed(0)
    embed = PatchEmbed(patch_size=4, temporal_patch_size=2, in_channels=3, embed_dim=16)
    pixels = randn(6, 3 * 2 * 4 * 4, dtype=F64)  # six flattened patches, as the processor gives them
    _check_converted(nn.Sequential(embed), (pixels,), "0.proj", "transformers PatchEmbed")
