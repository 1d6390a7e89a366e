"""patchgemm: layers that are really one GEMM over strided views."""

from . import ops as _ops  # noqa: F401  (loads the compiled library, registers the fake kernels)
from .functional import grouped_linear, instance_norm_act, patch_embed, patch_unembed
from .nn import (ConvertReport, GroupedLinear, HierarchicalPatchEmbed, HierarchicalPatchUnembed,
                 PatchEmbed, PatchUnembed, convert)
from .selection import explain, force, kernels

__version__ = "0.2.0.dev0"
__all__ = [
    "grouped_linear", "patch_embed", "patch_unembed", "instance_norm_act", "GroupedLinear", "PatchEmbed", "PatchUnembed",
    "HierarchicalPatchEmbed", "HierarchicalPatchUnembed", "convert", "ConvertReport", "explain", "force", "kernels",
    "__version__",
]
