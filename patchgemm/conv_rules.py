"""Which convolutions a patchgemm op computes, shared by ``convert`` (modules) and ``compile``
(calls in a traced graph): each function takes anything with an nn.Conv*d / nn.ConvTranspose*d's
attributes and returns why it is not eligible, or None."""

from typing import Optional


def patch_problem(conv) -> Optional[str]:
    """Why a convolution is not a kernel == stride patch (un)embedding, or None. ``conv`` has the
    attributes of an nn.Conv*d / nn.ConvTranspose*d: a module, or a call the compiler traced."""
    reasons = []
    if tuple(conv.kernel_size) != tuple(conv.stride):
        reasons.append(f"kernel_size {tuple(conv.kernel_size)} != stride {tuple(conv.stride)}")
    if isinstance(conv.padding, str) and conv.padding != "valid" or (
            not isinstance(conv.padding, str) and any(conv.padding)):
        reasons.append(f"padding={conv.padding}")
    if any(d != 1 for d in conv.dilation):
        reasons.append(f"dilation={tuple(conv.dilation)}")
    if conv.groups != 1:
        reasons.append(f"groups={conv.groups}")
    if conv.padding_mode != "zeros":
        reasons.append(f"padding_mode={conv.padding_mode!r}")
    if conv.transposed and any(conv.output_padding):
        reasons.append(f"output_padding={tuple(conv.output_padding)}")
    return ", ".join(reasons) or None


def pointwise_problem(conv) -> Optional[str]:
    """Why a (not transposed) convolution is not a grouped pointwise conv, or None; ``conv`` as
    for patch_problem."""
    reasons = []
    if any(k != 1 for k in conv.kernel_size) or any(s != 1 for s in conv.stride):
        reasons.append(f"kernel_size {tuple(conv.kernel_size)} / stride {tuple(conv.stride)} are not all 1")
    if isinstance(conv.padding, str) and conv.padding not in ("valid", "same") or (
            not isinstance(conv.padding, str) and any(conv.padding)):
        reasons.append(f"padding={conv.padding}")
    if any(d != 1 for d in conv.dilation):
        reasons.append(f"dilation={tuple(conv.dilation)}")
    if conv.groups == 1:
        reasons.append("groups=1")
    return ", ".join(reasons) or None


def left_to_pytorch(module) -> Optional[str]:
    """Why convert() (and the compiler) leaves a conv that a patchgemm op could compute, or None
    (``module`` as for patch_problem). 1 x 1 convs have
    no patches to gather: one GEMM, or with one input channel per group a per-channel scale, which
    cuDNN runs as well. Swapped, they cost timm models 2 to 21% more GPU time per training step on
    an H100 (visformer, NextViT, InceptionNeXt, StarNet, EfficientFormerV2; depthwise: GhostNetV3,
    LCNetV2, MobileOne); grouped ones with wider groups gain (EfficientViT-B0)."""
    if any(k != 1 for k in module.kernel_size):
        return None
    if module.groups == 1:
        return "kernel 1: a pointwise conv is one GEMM in cuDNN too; left to PyTorch"
    if module.in_channels == module.groups:
        return "one input channel per group: a per-channel scale (depthwise 1 x 1), one elementwise pass in cuDNN; " \
               "left to PyTorch"
    return None
