"""convert(): swaps a model's eligible modules for patchgemm's, sharing their parameters."""

import copy
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from torch import nn

from .._args import as_bool
from ..conv_rules import left_to_pytorch
from .conv import CONV_TRANSPOSES, CONVS, GroupedPointwiseConv, PatchEmbed, PatchUnembed, patch_conv_problem, pointwise_conv_problem
from .grouped import MoEExperts, moe_experts_problem
from .stems import HierarchicalPatchEmbed, HierarchicalPatchUnembed, StemNormError


@dataclass
class ConvertReport:
    """What :func:`convert` did: ``swapped`` (name, "Conv2d -> PatchEmbed") and ``skipped``
    (name, reason) per convolution or experts module found; ``model`` is the converted model."""
    model: nn.Module
    swapped: List[Tuple[str, str]] = field(default_factory=list)
    skipped: List[Tuple[str, str]] = field(default_factory=list)

    def __repr__(self) -> str:  # not the dataclass's: that prints the whole model
        return (f"ConvertReport(model={type(self.model).__name__}, swapped={len(self.swapped)}, "
                f"skipped={len(self.skipped)})")

    def __str__(self) -> str:
        lines = [f"patchgemm.convert: swapped {len(self.swapped)}, left {len(self.skipped)}"]
        lines += [f"  swapped {name or '<root>'}: {what}" for name, what in self.swapped]
        lines += [f"  left    {name or '<root>'}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def _patch_convs(seq: nn.Module) -> int:
    """How many of ``seq``'s children are kernel == stride convs (or conv-transposes) wider than 1."""
    return sum(type(m) in CONVS + CONV_TRANSPOSES and not patch_conv_problem(m) and not left_to_pytorch(m)
               for m in seq.children())


# Patch-embedding modules of timm and transformers whose kernel == stride conv feeds only a
# flatten-to-tokens (``proj(x).flatten(2).transpose(1, 2)``, a permute to channels-last order, or a
# ``.view`` of a one-patch grid): (module, class) -> the conv's attribute. Matched by name, so
# neither library is imported; subclasses are not matched (they may change forward). convert()
# gives them a PatchEmbed with out_format="channels_last": the GEMM writes the tokens and the
# flatten/transpose that follows is a free view. The module itself (its options, checks, norm and
# state_dict keys) stays.
_TOKEN_PATCH_EMBEDS = {
    ("timm.layers.patch_embed", "PatchEmbed"): "proj",
    ("timm.layers.patch_embed", "PatchEmbedWithSize"): "proj",
    ("transformers.models.vit.modeling_vit", "ViTPatchEmbeddings"): "projection",
    ("transformers.models.deit.modeling_deit", "DeiTPatchEmbeddings"): "projection",
    ("transformers.models.vit_mae.modeling_vit_mae", "ViTMAEPatchEmbeddings"): "projection",
    ("transformers.models.dinov2.modeling_dinov2", "Dinov2PatchEmbeddings"): "projection",
    ("transformers.models.videomae.modeling_videomae", "VideoMAEPatchEmbeddings"): "projection",
    ("transformers.models.clip.modeling_clip", "CLIPVisionEmbeddings"): "patch_embedding",
    ("transformers.models.siglip.modeling_siglip", "SiglipVisionEmbeddings"): "patch_embedding",
    ("transformers.models.qwen2_vl.modeling_qwen2_vl", "PatchEmbed"): "proj",
    ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VisionPatchEmbed"): "proj",
}


def _token_patch_embed(module: nn.Module) -> Optional[str]:
    """The attribute holding the conv of a known flatten-to-tokens patch embedding, or None."""
    attr = _TOKEN_PATCH_EMBEDS.get((type(module).__module__, type(module).__qualname__))
    if attr is None or type(getattr(module, attr, None)) not in CONVS:
        return None
    # timm's PatchEmbed can also return the conv's own NCHW map (flatten=False, output_fmt NCHW):
    # that output keeps the conv's memory format.
    if not getattr(module, "flatten", True) and getattr(module, "output_fmt", "NCHW") == "NCHW":
        return None
    return attr


def convert(model: nn.Module, *, inplace: bool = True) -> ConvertReport:
    """Swap, sharing parameters:

    - every ``nn.Sequential`` stem — two kernel == stride convs or more, each followed by an optional
      norm and an optional activation (hMLP stems) — for HierarchicalPatchEmbed /
      HierarchicalPatchUnembed, keeping its parameter names (a subclass too, unless it defines its
      own ``forward``: then its convs are swapped one by one, and the report says why);
    - the conv of every known patch embedding that flattens to tokens (timm's ``PatchEmbed``;
      transformers' ViT, DeiT, ViT-MAE, DINOv2, VideoMAE, CLIP, SigLIP and Qwen2-VL patch
      embeddings) for a PatchEmbed that writes the tokens directly, the module itself kept;
    - every other eligible ``nn.Conv{1,2,3}d`` / ``nn.ConvTranspose{1,2,3}d`` (kernel == stride,
      a kernel wider than 1, padding 0, dilation 1, groups 1, zeros padding, output_padding 0) for
      PatchEmbed / PatchUnembed (1 x 1 convs stay: cuDNN's GEMM, nothing to gather);
    - every grouped pointwise ``nn.Conv{1,2,3}d`` (kernel 1, stride 1, groups > 1, more than one
      input channel per group) for GroupedPointwiseConv. (Depthwise 1 x 1 convs, a per-channel
      scale, stay: on an H100 timm models with them swapped (GhostNetV3, LCNetV2, MobileOne) took
      7 to 11% more GPU time per training step.)
    - every transformers experts module of the SwiGLU layout (``gate_up_proj[E, 2H, D]``,
      ``down_proj[E, D, H]``: Mixtral, Qwen-MoE, OLMoE, DeepSeek, ...) for MoEExperts.

    Returns a :class:`ConvertReport` (``report.model`` is the model; with ``inplace=False`` a
    converted deep copy, the original untouched)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: expected an nn.Module, got {type(model).__name__}")
    if not as_bool(inplace, "convert: inplace"):
        model = copy.deepcopy(model)
    report = ConvertReport(model)

    def replacement(name: str, module: nn.Module) -> Optional[nn.Module]:
        attr = _token_patch_embed(module)
        conv = getattr(module, attr) if attr is not None else None
        if conv is not None and not patch_conv_problem(conv):
            setattr(module, attr, PatchEmbed.from_conv(conv, out_format="channels_last"))
            report.swapped.append((f"{name}.{attr}" if name else attr,
                                   f"{type(conv).__name__} -> PatchEmbed writing tokens "
                                   f"(in {type(module).__module__.split('.')[0]} {type(module).__name__})"))
            return module  # its other children stay as they are
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3:
            why = moe_experts_problem(module)  # (a transformers experts module, or one like it)
            if why:
                report.skipped.append((name, f"experts: {why}"))
                return None
            report.swapped.append((name, f"{type(module).__name__} -> MoEExperts"))
            return MoEExperts.from_experts(module)
        if isinstance(module, nn.Sequential) and _patch_convs(module) >= 2:
            # A subclass is a stem too when it computes as a Sequential does (its forward is
            # Sequential's); one with a forward of its own may compute anything, so its convs are
            # swapped one by one, and the report says so.
            if type(module).forward is not nn.Sequential.forward:
                report.skipped.append((name, f"not a whole stem: {type(module).__name__} defines its own "
                                             "forward (its convs are swapped one by one)"))
                return None
            first = next(iter(module.children()))
            stem = HierarchicalPatchEmbed if type(first) in CONVS else HierarchicalPatchUnembed
            try:
                new = stem.from_sequential(module)
            except StemNormError as e:  # laid out as a stem: say why its convs are swapped one by one
                report.skipped.append((name, f"not a whole stem: {e}"))
                return None
            except ValueError:  # not laid out as a stem
                return None
            convs = sum(type(m) in CONVS + CONV_TRANSPOSES for m in module.children())  # each one a stage
            report.swapped.append((name, f"{type(module).__name__} of {convs} convs -> {stem.__name__}"))
            return new
        if not isinstance(module, CONVS + CONV_TRANSPOSES):
            return None
        reason = patch_conv_problem(module)
        grouped_pointwise = bool(reason) and type(module) in CONVS and not pointwise_conv_problem(module)
        if grouped_pointwise or not reason:
            reason = left_to_pytorch(module)
        if reason:
            report.skipped.append((name, reason))
            return None
        if grouped_pointwise:
            new = GroupedPointwiseConv.from_conv(module)
        else:
            new = (PatchEmbed.from_conv(module) if type(module) in CONVS
                   else PatchUnembed.from_conv_transpose(module))
        report.swapped.append((name, f"{type(module).__name__} -> {type(new).__name__}"))
        return new

    root = replacement("", model)
    if root is not None:
        report.model = root
        return report
    # Top-down, so a replaced module's children are not visited. A module held under several names
    # (or by several parents) is converted once, and every holder gets the same replacement, as the
    # model shared it.
    done = {}  # id(original) -> (its first name, replacement or None)

    def visit(parent: nn.Module, prefix: str) -> None:
        for child_name, child in list(parent._modules.items()):  # (named_children skips repeats)
            if child is None:
                continue
            name = f"{prefix}.{child_name}" if prefix else child_name
            if id(child) in done:
                first, new = done[id(child)]
                if new is not None:
                    setattr(parent, child_name, new)
                    report.swapped.append((name, f"the same module as {first}"))
                continue
            new = replacement(name, child)
            done[id(child)] = (name, new)
            if new is not None:
                setattr(parent, child_name, new)
            else:
                visit(child, name)

    visit(model, "")
    return report
