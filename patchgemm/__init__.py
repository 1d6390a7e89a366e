"""patchgemm: layers that are really one GEMM over strided views."""

import sys as _sys

from . import ops as _ops  # noqa: F401  (loads the compiled library, registers the fake kernels)
from .functional import (grouped_linear, grouped_mlp, grouped_pointwise_conv, instance_norm_act, moe_experts,
                         patch_embed, patch_unembed, swiglu)
from .nn import (ConvertReport, GroupedLinear, GroupedMLP, GroupedPointwiseConv, HierarchicalPatchEmbed, HierarchicalPatchUnembed,
                 MoEExperts, PatchEmbed, PatchUnembed, convert)
from .compiler import CompileReport, compile
from .fp8 import Float8History, Float8Recipe, Float8Weight, fp8_autocast, quantize_weight
from . import selection as _selection
from .selection import explain, force, get_selection, kernels, set_selection

__version__ = "0.2.0.dev0"


def __getattr__(name):
    # patchgemm.distributed without an import of its own (it loads torch.distributed: not at start)
    if name == "distributed":
        import importlib

        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'patchgemm' has no attribute {name!r}")

__all__ = [
    "grouped_linear", "grouped_mlp", "grouped_pointwise_conv", "swiglu", "moe_experts", "GroupedLinear", "GroupedMLP",
    "MoEExperts",
    "GroupedPointwiseConv", "patch_embed", "patch_unembed", "instance_norm_act", "PatchEmbed", "PatchUnembed",
    "HierarchicalPatchEmbed", "HierarchicalPatchUnembed", "convert", "ConvertReport", "compile", "CompileReport",
    "Float8History", "Float8Recipe", "Float8Weight", "fp8_autocast", "quantize_weight", "explain", "force", "kernels",
    "set_selection", "get_selection", "__version__",
]

if "torch.distributed.tensor" in _sys.modules:  # DTensors may reach the ops: their sharding rules
    from . import distributed  # noqa: F401

_selection.select_at_import()
