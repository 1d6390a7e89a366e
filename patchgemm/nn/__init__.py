"""Modules: drop-in replacements built on the functional ops, one file per family (grouped
linears, convolutions, hierarchical stems), and convert(), which swaps them into a model."""

from .conv import GroupedPointwiseConv, PatchEmbed, PatchUnembed
from .convert import ConvertReport, convert
from .grouped import GroupedLinear, GroupedMLP, MoEExperts, register_transformers_experts, use_transformers_experts
from .stems import HierarchicalPatchEmbed, HierarchicalPatchUnembed

__all__ = ["GroupedLinear", "GroupedMLP", "MoEExperts", "GroupedPointwiseConv", "PatchEmbed", "PatchUnembed",
           "HierarchicalPatchEmbed", "HierarchicalPatchUnembed", "convert", "ConvertReport",
           "register_transformers_experts", "use_transformers_experts"]
