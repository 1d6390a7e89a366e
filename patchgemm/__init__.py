"""patchgemm: layers that are really one GEMM over strided views."""

from . import ops as _ops  # noqa: F401  (loads the compiled library, registers fake/autograd)
from .functional import grouped_linear
from .nn import GroupedLinear

__version__ = "0.1.0"
__all__ = ["grouped_linear", "GroupedLinear", "__version__"]
