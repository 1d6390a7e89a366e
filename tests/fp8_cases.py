"""What the FP8 tests share: the formats, the quantization's reference, a GPU that runs FP8."""

import pytest
import torch

from conftest import HAS_GPU, randn

ops = torch.ops.patchgemm
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# Relative spacing of each format's values (3 and 2 mantissa bits): rounding to nearest errs by at
# most half of it per element.
HALF_ULP = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HAS_FP8_GPU = HAS_GPU and torch.version.cuda is not None and torch.cuda.get_device_capability() >= (8, 9)
needs_fp8_gpu = pytest.mark.skipif(not HAS_FP8_GPU, reason="needs an sm_89+ NVIDIA GPU")


def dequantized(data, scale):
    return data.double() * scale.double()


def quantize(x, fmt):
    """(data, scale) of quantize_fp8 without the transposed copy."""
    data, _, scale, _ = ops.quantize_fp8(x, fmt)
    return data, scale


def quantized(shape, device, fmt=E4M3, scale=1.0):
    return quantize(randn(*shape, device=device) * scale, fmt)


def deq(t, fmt):
    """t quantized to fmt and back, in float64: the exact operand an FP8 GEMM multiplies."""
    data, scale = quantize(t.detach().contiguous(), fmt)
    return dequantized(data, scale)
