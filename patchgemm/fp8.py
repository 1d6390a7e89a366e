"""FP8 grouped linears and patch embeddings: each GEMM's operands quantized on the fly, one FP8
strided-batched GEMM per pass.

The default recipe is the usual "current scaling" one (TransformerEngine's ``Float8CurrentScaling``,
torchao's tensorwise ``Float8LinearConfig``): every call computes one scale per tensor from the
tensor's own amax, so no history is kept and nothing needs calibrating; finding that amax is a pass
over the tensor of its own. ``Float8Recipe(scaling="delayed")`` is TransformerEngine's
``DelayedScaling``: each tensor is scaled by the largest amax of its last ``amax_history_len`` calls
and its own amax is recorded from the quantizing pass, so that pass is the only one. The history is
kept per layer (``Float8History``: ``GroupedLinear``, ``GroupedMLP`` and ``MoEExperts`` keep their
own; the functional ``grouped_linear`` takes one as ``fp8_history``, ``grouped_mlp`` and
``moe_experts`` two as ``fp8_histories``); a layer's first call seeds it with
current scaling. Values above the scale's range (an amax that grew past every recorded one)
saturate to the format's largest value, as the recipe does everywhere; patch embeddings keep
no history and scale currently under either recipe. The forward quantizes ``x``
and the weight to e4m3; the backward quantizes the output gradient to e5m2 (the "hybrid" formats),
reuses the saved FP8 ``x`` and weight, and writes ``grad_x`` and ``grad_weight`` in the inputs' own
dtypes (fp32 master weights get fp32 gradients). The output and the bias stay in the compute dtype.

Turn it on per module (``GroupedLinear(..., fp8=True)``), per call (``grouped_linear(..., fp8=True)``),
or for a region (``with patchgemm.fp8_autocast(): ...``), which reaches every grouped linear, grouped
MLP and ragged group (mixture-of-experts layer) inside that was not told otherwise, unless
``everywhere=True`` only where FP8 pays: dense grouped linears where ``fp8_pays``, ragged groups
never (they measure slower in FP8 than in bf16). Patch
embeddings, unembeddings and hierarchical stems run in FP8 only when asked (``fp8=True`` or a
recipe on the module or call), not by a region: their GEMMs are small beside the patch gather, which
FP8 adds passes to, and they measure slower in FP8 than in bf16 (bench/fp8.py). A patch embedding
is the grouped linear of one group over its patch matrix: x's patches gathered once
(torch.ops.patchgemm.patch_matrix, the GEMM paths' gather), quantized, one FP8 GEMM. Ragged groups (grouped_linear
with group_sizes / offsets, moe_experts) run their forward and input gradient in FP8 and their weight
gradient in the compute dtype (see _RaggedLinearFp8). With the sizes on the GPU (as moe_experts
has them), torch._scaled_grouped_mm runs a GEMM without a host sync on sm_90 where its operands
are e4m3 and its output bfloat16; other GEMMs read the sizes on the host, except where a sync is
forbidden (CUDA-graph capture, sync debug mode "error"): there the FP8 operands are upcast, exactly,
for ragged_grouped_linear's sync-free kernels, at the compute dtype's rate.

Weights reused across microbatches: between two optimizer steps a weight does not change, so its
FP8 copy can be made once per step instead of once per call (TransformerEngine's
``is_first_microbatch``). ``GroupedLinear(...)(x, is_first_microbatch=True)`` quantizes the weight
and keeps the copy, ``False`` reuses it, None (the default) quantizes every call;
``grouped_linear(..., fp8_weight=quantize_weight(w))`` is the same for the functional form. The
contract is the caller's: a copy made before the weight changed (an optimizer step, a
``load_state_dict``, ``weight.data`` written) is stale, and nothing checks the weight's values.
"""

import contextlib
import dataclasses
import math
from typing import Optional, Union

import torch

from ._args import as_bool, unsafe_view
from ._functorch import bias_grad_sum, ragged_bias_grad
from .ops import ops
from .selection import note

__all__ = ["Float8History", "Float8Recipe", "Float8Weight", "fp8_autocast", "fp8_pays", "quantize_weight"]

_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCALINGS = ("current", "delayed")
_MAX_HISTORY = 1024  # (kMaxAmaxHistory, csrc/problems/fp8.h)


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
    """How a grouped linear runs in FP8.

    Attributes:
        forward_format: the format of ``x`` and the weight (``torch.float8_e4m3fn``).
        backward_format: the format of the output's gradient: ``torch.float8_e5m2`` (the hybrid
            recipe: gradients need range more than precision) or ``torch.float8_e4m3fn``.
        fast_accumulation: Hopper's faster FP8 accumulation in the forward GEMM, as torchao and
            TransformerEngine use there; the gradients' GEMMs always accumulate in full fp32.
        scaling: ``"current"`` (each tensor's scale from its own amax, an extra pass over it) or
            ``"delayed"`` (from the largest amax of its last ``amax_history_len`` calls, kept in a
            ``Float8History``; one pass). Patch embeddings scale currently.
        amax_history_len: how many calls' amaxes delayed scaling keeps (1 to 1024).
    """

    forward_format: torch.dtype = torch.float8_e4m3fn
    backward_format: torch.dtype = torch.float8_e5m2
    fast_accumulation: bool = True
    scaling: str = "current"
    amax_history_len: int = 16

    def __post_init__(self):
        if self.forward_format != torch.float8_e4m3fn:
            raise ValueError(f"Float8Recipe: forward_format must be torch.float8_e4m3fn, got {self.forward_format}")
        if self.backward_format not in _FORMATS:
            raise ValueError(f"Float8Recipe: backward_format must be torch.float8_e4m3fn or torch.float8_e5m2, "
                             f"got {self.backward_format}")
        as_bool(self.fast_accumulation, "Float8Recipe: fast_accumulation")
        if self.scaling not in _SCALINGS:
            raise ValueError(f"Float8Recipe: scaling must be 'current' or 'delayed', got {self.scaling!r}")
        if (not isinstance(self.amax_history_len, int) or isinstance(self.amax_history_len, bool)
                or not 1 <= self.amax_history_len <= _MAX_HISTORY):
            raise ValueError(f"Float8Recipe: amax_history_len must be an int from 1 to {_MAX_HISTORY}, got "
                             f"{self.amax_history_len!r}")

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"


class Float8History:
    """The amax history delayed scaling keeps for one grouped linear: of its ``x``, its weight and
    its output gradient, each a float32 tensor on the device the layer runs on, made by the layer's
    first call there and updated in place by every call after, without a host sync (a CUDA graph
    captured after the first call replays with it). While a history holds no nonzero amax, a call
    scales by its tensor's own amax (current scaling). Not part of a ``state_dict``; ``reset()``
    forgets it.

    ``amax(which)`` (``"x"``, ``"weight"``, ``"grad"``): the recorded amaxes, newest first, or None.
    """

    _WHICH = ("x", "weight", "grad")

    def __init__(self):
        self._states: dict = {}  # which -> float32 [L + 2] (the layout csrc/problems/fp8.h states)

    def reset(self) -> None:
        self._states.clear()

    def amax(self, which: str) -> Optional[torch.Tensor]:
        if which not in self._WHICH:
            raise ValueError(f"Float8History.amax: which must be one of {self._WHICH}, got {which!r}")
        state = self._states.get(which)
        return None if state is None else state[2:]

    def made(self, which: str, device: torch.device, length: int) -> bool:
        """Whether the state of `which` keeping `length` amaxes exists on `device`."""
        state = self._states.get(which)
        return state is not None and state.device == device and state.numel() == length + 2

    def state(self, which: str, device: torch.device, length: int) -> torch.Tensor:
        """The state of `which` on `device` keeping `length` amaxes (made, all zeros, where it has none
        of that length there)."""
        if not self.made(which, device, length):
            self._states[which] = torch.zeros(length + 2, device=device, dtype=torch.float32)
        return self._states[which]

    def __repr__(self) -> str:
        kept = ", ".join(f"{w}: {self._states[w].numel() - 2}" for w in self._WHICH if w in self._states)
        return f"Float8History({kept})"


_regions: list = []  # (recipe or None: off, everywhere) of the enclosing fp8_autocast regions, innermost last

# Where FP8 pays for a grouped linear of M rows per group, K in, N out (bench/fp8_sweep.py,
# docs/design.md "FP8"): its GEMMs save time as M K N, its quantizing passes cost M K + K N + M N, so
# h = 1 / (1/M + 1/K + 1/N) must be large, and the call must carry enough work for the extra launches.
PAYS_H, PAYS_FLOPS = 500.0, 5e10


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Optional[Float8Recipe] = None, everywhere: bool = False):
    """Run the grouped linears and grouped MLPs inside in FP8 (``enabled``) or not, with ``recipe``
    (default ``Float8Recipe()``), unless a module or call chose for itself. Process-wide, as
    TransformerEngine's: enter it on the thread that runs the model, around the forward; the
    backward uses the recipe each call was made with. A compiled model reads it when traced and
    recompiles when it changes.

    A region runs a dense grouped linear in FP8 only where FP8 pays (``fp8_pays``: on sm_89+ GPUs,
    problems large enough that the GEMMs' savings outweigh the quantizing passes), and ragged groups
    (``moe_experts``) not at all, as they measure slower in FP8; those run in the compute dtype and
    ``explain`` says why. ``everywhere=True`` runs every one in FP8, as TransformerEngine's region
    does."""
    as_bool(enabled, "fp8_autocast: enabled")
    as_bool(everywhere, "fp8_autocast: everywhere")
    if recipe is not None and not isinstance(recipe, Float8Recipe):
        raise TypeError(f"fp8_autocast: recipe must be a patchgemm.Float8Recipe or None, got {type(recipe).__name__}")
    _regions.append(((recipe or Float8Recipe()) if enabled else None, everywhere))
    try:
        yield
    finally:
        _regions.pop()


def resolve(where: str, fp8: Union[None, bool, Float8Recipe], region: bool = True) -> Optional[Float8Recipe]:
    """The recipe a call runs with: its own choice (False: none, True: the default recipe), else the
    innermost fp8_autocast region's (where `region`: the ops a region reaches), else none."""
    if fp8 is None:
        return _regions[-1][0] if _regions and region else None
    if isinstance(fp8, Float8Recipe):
        return fp8
    if isinstance(fp8, bool):
        return Float8Recipe() if fp8 else None
    raise TypeError(f"{where}: fp8 must be None, a bool or a patchgemm.Float8Recipe, got {type(fp8).__name__}")


def _assume_constant_result(fn):
    """``torch.compiler.assume_constant_result`` (a compiled region's trace reads ``fn`` once), marked
    as it marks a function, without its import of torch._dynamo, which brings sympy and the
    compiler stack in and made ``import patchgemm`` take 1.0 s, not 0.04 s, on a 2-core CPU.
    tests/test_packaging.py checks that importing patchgemm leaves torch._dynamo out and that this
    mark is still torch's."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _fp8_gemms_on(index: int) -> bool:
    """Whether CUDA device `index` (-1: the current one) runs our FP8 GEMMs: an NVIDIA sm_89+ GPU (on
    ROCm the FP8 GEMMs are emulated: hipBLASLt's FP8 is not wired up)."""
    return torch.version.hip is None and torch.cuda.get_device_capability(None if index < 0 else index) >= (8, 9)


def harmonic_size(rows: int, in_features: int, out_features: int) -> float:
    """h = 1 / (1/M + 1/K + 1/N): FP8's GEMM savings over its quantizing passes (0 for an empty problem)."""
    if min(rows, in_features, out_features) <= 0:
        return 0.0
    return 1.0 / (1.0 / rows + 1.0 / in_features + 1.0 / out_features)


def shape_pays(rows: int, in_features: int, out_features: int, groups: int) -> bool:
    """The rule's shape test: h > PAYS_H and 2 G M K N >= PAYS_FLOPS."""
    return (harmonic_size(rows, in_features, out_features) > PAYS_H
            and 2.0 * groups * rows * in_features * out_features >= PAYS_FLOPS)


def fp8_pays(rows: int, in_features: int, out_features: int, groups: int, device: torch.device) -> bool:
    """Whether a grouped linear of `groups` groups of `rows` rows, `in_features` to `out_features`,
    trains faster in FP8 than in bf16 on `device`: on NVIDIA sm_89+ GPUs where 1 / (1/M + 1/K + 1/N) >
    PAYS_H and 2 G M K N >= PAYS_FLOPS (measured on an H200: bench/fp8_sweep.py). Never on the CPU,
    whose FP8 is an exact emulation."""
    if device.type != "cuda" or not _fp8_gemms_on(device.index if device.index is not None else -1):
        return False
    return shape_pays(rows, in_features, out_features, groups)


def region_declines(where: str, fp8, rows: int, weight: torch.Tensor, device: torch.device,
                    ragged: bool = False) -> bool:
    """Whether the enclosing region's recipe stays off for this grouped linear (`fp8` None: the call
    did not choose; weight [G, N, K]; `rows`: per group, on average where `ragged`): the region is
    not `everywhere`, and FP8 does not pay (dense groups: fp8_pays; ragged groups: never, as
    measured). Says so to ``explain``."""
    if fp8 is not None or not _regions or _regions[-1][0] is None or _regions[-1][1]:
        return False
    groups, out_features, in_features = weight.shape
    if not ragged and fp8_pays(rows, in_features, out_features, groups, device):
        return False
    if ragged:
        why = "ragged groups train slower in FP8 than in bf16 (bench/fp8_sweep.py --ragged)"
    elif device.type != "cuda":
        why = "FP8 on the CPU is an exact emulation"
    else:
        why = (f"FP8 pays where 1/(1/M + 1/K + 1/N) > {PAYS_H:.0f} and 2 G M K N >= {PAYS_FLOPS:.0e} FLOP; here "
               f"{harmonic_size(rows, in_features, out_features):.0f} and "
               f"{2.0 * groups * rows * in_features * out_features:.1e}")
    note("fp8_autocast", f"({where}: M {rows} rows a group{' on average' if ragged else ''}, G {groups}, "
         f"K {in_features} -> N {out_features}, {device})", "the compute dtype",
         f"{why}; everywhere=True or fp8=True runs it in FP8")
    return True


def _quantize(t: torch.Tensor, fmt: torch.dtype, group_major: bool, rowwise: bool, batch_major: bool,
              sums: bool = False, amax_state: Optional[torch.Tensor] = None):
    """(t in fmt in its layout or None, t's [G, D, B] copy or None, scale, t summed over B [G, D] or
    None) for an activation or gradient t [B, G, D] ([G, B, D] when group_major): the copy is what a
    GEMM summing over B reads; the sums (a bias gradient) come from the same pass where it writes
    that copy. Scaled currently, or from `amax_state` (delayed)."""
    if group_major:
        data, data_t, scale, total = ops.quantize_fp8(t, fmt, rowwise, batch_major, sums, amax_state)
        return (data if rowwise else None), (data_t if batch_major else None), scale, (total if sums else None)
    B, G, D = t.shape
    data, data_t, scale, total = ops.quantize_fp8(t.reshape(B, G * D), fmt, rowwise, batch_major, sums, amax_state)
    return ((data.view(B, G, D) if rowwise else None), (data_t.view(G, D, B) if batch_major else None), scale,
            (total.view(G, D) if sums else None))


@dataclasses.dataclass(frozen=True, eq=False)
class Float8Weight:
    """A grouped weight's FP8 copy, made by ``quantize_weight`` and reused by the calls given it
    (``fp8_weight=``): ``data`` [G, Dout, Din] and ``data_t`` [G, Din, Dout] (what the input
    gradient's GEMM reads) in e4m3, one float32 dequantization ``scale``, and the shape, dtype and
    device of the weight it was made from (a call checks them against its weight)."""

    data: torch.Tensor
    data_t: torch.Tensor
    scale: torch.Tensor
    shape: tuple
    dtype: torch.dtype
    device: torch.device

    def check(self, where: str, weight: torch.Tensor) -> None:
        if (tuple(weight.shape), weight.dtype, weight.device) != (self.shape, self.dtype, self.device):
            raise ValueError(f"{where}: fp8_weight was made from a {self.dtype} weight {list(self.shape)} on "
                             f"{self.device}; this call's weight is {weight.dtype} {list(weight.shape)} on "
                             f"{weight.device}")


def quantize_weight(weight: torch.Tensor, recipe: Optional[Float8Recipe] = None) -> Float8Weight:
    """The FP8 copy of a grouped weight [G, Dout, Din] (float32, float16 or bfloat16) under ``recipe``
    (default ``Float8Recipe()``), for ``grouped_linear(..., fp8_weight=)``: made once, reused by every
    call until the weight changes (then make it again)."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.dtype not in _COMPUTE_DTYPES:
        got = f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"quantize_weight: weight must be a float32, float16 or bfloat16 tensor [G, Dout, Din], "
                        f"got {got}")
    if recipe is not None and not isinstance(recipe, Float8Recipe):
        raise TypeError(f"quantize_weight: recipe must be a patchgemm.Float8Recipe or None, got "
                        f"{type(recipe).__name__}")
    recipe = recipe or Float8Recipe()
    with torch.no_grad():
        data, data_t, scale, _ = ops.quantize_fp8(weight.detach(), recipe.forward_format, True, True)
    return Float8Weight(data, data_t, scale, tuple(weight.shape), weight.dtype, weight.device)


class _GroupedLinearFp8(torch.autograd.Function):
    """y = x_g @ weight_g^T + bias_g with x and the weight quantized to e4m3 (one scale each); the
    backward quantizes grad_y and runs both gradients' GEMMs in FP8. Hopper's FP8 GEMMs read both
    operands K-major, so each quantization also writes the transposed copy a gradient's GEMM needs
    (in the same pass): the weight's for grad_x, x's and grad_y's (batch-major) for grad_weight; the
    forward saves those copies, in FP8, and nothing else. A given `weight8` (Float8Weight) stands in
    for the weight's quantization; `states` (x's, the weight's, grad_y's amax states, or None)
    scale them as a delayed recipe does."""

    @staticmethod
    def forward(ctx, x, weight, bias, group_major: bool, out_dtype: torch.dtype, recipe: Float8Recipe,
                need_grad_x: bool, need_grad_w: bool, weight8: Optional[Float8Weight], states: Optional[tuple]):
        fmt = recipe.forward_format
        x_state, w_state, grad_state = states or (None, None, None)
        x8, x8_t, x_scale, _ = _quantize(x, fmt, group_major, True, need_grad_w, amax_state=x_state)
        if weight8 is None:
            w8, w8_t, w_scale, _ = ops.quantize_fp8(weight, fmt, True, need_grad_x, False, w_state)
        else:
            w8, w8_t, w_scale = weight8.data, weight8.data_t, weight8.scale
        ctx.save_for_backward(x8_t, x_scale, w8_t if need_grad_x else None, w_scale)
        ctx.group_major, ctx.recipe, ctx.x_dtype, ctx.w_dtype = group_major, recipe, x.dtype, weight.dtype
        # Not saved for backward: the backward updates it in place, and another call's backward may
        # have updated it since (microbatches), which saved tensors refuse.
        ctx.grad_state = grad_state
        return ops.scaled_grouped_mm(x8, w8, x_scale, w_scale, bias, group_major, out_dtype,
                                     recipe.fast_accumulation)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x8_t, x_scale, w8_t, w_scale = ctx.saved_tensors
        group_major = ctx.group_major
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x or need_w:  # the bias gradient in the same pass where grad_y's batch-major copy is written
            g8, g8_t, g_scale, grad_b = _quantize(grad_y, ctx.recipe.backward_format, group_major, need_x, need_w,
                                                  need_b and need_w, ctx.grad_state)
        if need_x:  # grad_x_g [B, Din] = grad_y_g [B, Dout] @ weight_g [Dout, Din]
            grad_x = ops.scaled_grouped_mm(g8, w8_t, g_scale, w_scale, None, group_major, ctx.x_dtype, False)
        if need_w:  # grad_w_g [Dout, Din] = grad_y_g^T [Dout, B] @ x_g [B, Din]
            grad_w = ops.scaled_grouped_mm(g8_t, x8_t, g_scale, x_scale, None, True, ctx.w_dtype, False)
        if need_b and grad_b is None:
            grad_b = bias_grad_sum(grad_y, (1 if group_major else 0,))
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None


def check_history(where: str, recipe: Optional[Float8Recipe], history) -> None:
    """A delayed recipe needs the layer's history; a history needs a type it is."""
    if history is not None and not isinstance(history, Float8History):
        raise TypeError(f"{where}: fp8_history must be a patchgemm.Float8History or None, got "
                        f"{type(history).__name__}")
    if recipe is not None and recipe.delayed and history is None:
        raise ValueError(f"{where}: a delayed-scaling recipe keeps an amax history per layer: pass "
                         f"fp8_history=patchgemm.Float8History(), made once per layer and kept across steps (the "
                         f"modules keep their own)")


def grouped_linear(x3: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], group_major: bool,
                   recipe: Float8Recipe, out_dtype: torch.dtype, weight8: Optional[Float8Weight] = None,
                   history: Optional[Float8History] = None) -> torch.Tensor:
    """The FP8 grouped linear of a 3-D x ([B, G, Din], or [G, B, Din] when group_major); out_dtype is
    the compute dtype (autocast's, else x's), the bias cast to it; `weight8`: the weight's FP8 copy
    to use (made from `weight`), else the weight is quantized now; `history`: a delayed recipe's
    (else current scaling)."""
    for name, t in (("x", x3), ("weight", weight)):
        if t.dtype not in _COMPUTE_DTYPES:
            raise TypeError(f"grouped_linear: FP8 needs float32, float16 or bfloat16 {name}, got {t.dtype} "
                            f"(shape {tuple(t.shape)})")
    if weight8 is not None:
        weight8.check("grouped_linear", weight)
    if bias is not None and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    grad = torch.is_grad_enabled()
    return _GroupedLinearFp8.apply(x3, weight, bias, group_major, out_dtype, recipe, grad and x3.requires_grad,
                                   grad and weight.requires_grad, weight8, _history_states(recipe, history, x3.device))


def _history_states(recipe: Float8Recipe, history: Optional[Float8History], device: torch.device):
    """The amax states (x's, the weight's, the output gradient's) a delayed recipe scales by, or None."""
    if history is None or not recipe.delayed:
        return None
    # Under torch.compile the backward may update a state that is an input of the traced forward, but
    # not one the trace itself makes (a graph intermediate): a history's first traced call scales
    # grad_y currently, and the call after, traced again with the state made, updates it.
    grad_made = history.made("grad", device, recipe.amax_history_len)
    states = tuple(history.state(which, device, recipe.amax_history_len) for which in Float8History._WHICH)
    if torch.compiler.is_compiling() and not grad_made:
        states = (*states[:2], None)
    return states


# ---- ragged groups (mixture-of-experts layers) ------------------------------------------------------

class _RaggedLinearFp8(torch.autograd.Function):
    """y_g = x_g @ weight[g]^T + bias[g] over ragged row groups with x and the weight in e4m3; the
    input gradient's GEMM in FP8 as well (grad_y in the recipe's backward format), the weight's in
    the compute dtype, as torchao's rowwise MoE recipe with a high-precision weight gradient: its
    reduction runs over each group's rows, which no FP8 grouped GEMM takes at arbitrary group sizes
    (their K-major operands need every group a multiple of 16 rows). The forward saves x in the
    compute dtype and the weight's transposed FP8 copy. `states`: as the dense Function's."""

    @staticmethod
    def forward(ctx, x, weight, bias, offsets, out_dtype: torch.dtype, recipe: Float8Recipe, need_grad_x: bool,
                need_grad_w: bool, states: Optional[tuple]):
        fmt = recipe.forward_format
        x_state, w_state, ctx.grad_state = states or (None, None, None)  # (grad's: see the dense Function)
        x8, _, x_scale, _ = ops.quantize_fp8(x, fmt, True, False, False, x_state)
        w8, w8_t, w_scale, _ = ops.quantize_fp8(weight, fmt, True, need_grad_x, False, w_state)
        ctx.save_for_backward(x.to(out_dtype) if need_grad_w else None, w8_t if need_grad_x else None, w_scale,
                              offsets)
        ctx.recipe, ctx.x_dtype, ctx.w_dtype, ctx.out_dtype = recipe, x.dtype, weight.dtype, out_dtype
        return ops.scaled_ragged_mm(x8, w8, x_scale, w_scale, bias, offsets, out_dtype, recipe.fast_accumulation)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        x, w8_t, w_scale, offsets = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = grad_w = grad_b = None
        if need_x:  # grad_x_g [rows, Din] = grad_y_g [rows, Dout] @ weight[g] [Dout, Din]
            g8, _, g_scale, _ = ops.quantize_fp8(grad_y, ctx.recipe.backward_format, True, False, False,
                                                 ctx.grad_state)
            grad_x = ops.scaled_ragged_mm(g8, w8_t, g_scale, w_scale, None, offsets, ctx.x_dtype, False)
        if need_w:
            grad_w = ops.ragged_grouped_linear_grad_weight(grad_y.to(ctx.out_dtype), x, offsets).to(ctx.w_dtype)
        if need_b:
            grad_b = ragged_bias_grad(grad_y, offsets)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def ragged_grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], offsets: torch.Tensor,
                          recipe: Float8Recipe, out_dtype: torch.dtype,
                          history: Optional[Float8History] = None) -> torch.Tensor:
    """The FP8 ragged grouped linear of x [N, Din] sorted by group (offsets: the groups' end rows, as
    ragged_grouped_linear takes them); out_dtype the compute dtype, the bias cast to it; `history`:
    a delayed recipe's (else current scaling)."""
    op = "grouped_linear"
    if x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise RuntimeError(f"{op}: with ragged groups, x must be [N, Din] with Din = {weight.shape[2]} (weight "
                           f"{tuple(weight.shape)}), got shape {tuple(x.shape)}")
    _check_operands(op, x, weight, None, 0)
    if bias is not None:
        if bias.shape != weight.shape[:2] or bias.device != weight.device:
            raise RuntimeError(f"{op}: bias must be [G, Dout] = {list(weight.shape[:2])} on {weight.device}, got "
                               f"shape {tuple(bias.shape)} on {bias.device}")
        bias = bias.to(out_dtype)
    grad = torch.is_grad_enabled()
    return _RaggedLinearFp8.apply(x, weight, bias, offsets, out_dtype, recipe, grad and x.requires_grad,
                                  grad and weight.requires_grad, _history_states(recipe, history, x.device))


# ---- kernel == stride convolutions: one GEMM of the patch matrix, in FP8 -------------------------

def _check_operands(op: str, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], channels: int):
    """What the FP8 path needs beyond the shapes its caller checked: floating operands on one device
    and a bias of `channels` values."""
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _COMPUTE_DTYPES:
            raise TypeError(f"{op}: FP8 needs float32, float16 or bfloat16 {name}, got {t.dtype} "
                            f"(shape {tuple(t.shape)})")
    if x.device != weight.device:
        raise RuntimeError(f"{op}: x is on {x.device} but weight is on {weight.device}")
    if bias is not None and (bias.shape != (channels,) or bias.device != weight.device):
        raise RuntimeError(f"{op}: bias must be [{channels}] on {weight.device} to match weight "
                           f"{tuple(weight.shape)}, got shape {tuple(bias.shape)} on {bias.device}")


def _gemm(patches: torch.Tensor, weight2: torch.Tensor, bias: Optional[torch.Tensor], recipe: Float8Recipe,
          out_dtype: torch.dtype) -> torch.Tensor:
    """patches [T, K] @ weight2 [N, K]^T (+ bias [N]) as the FP8 grouped linear of one group: [T, N]."""
    y = grouped_linear(patches.unsqueeze(1), weight2.unsqueeze(0), None if bias is None else bias.unsqueeze(0),
                       False, recipe, out_dtype)
    return y.squeeze(1)


def patch_embed(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], out_format: str,
                recipe: Float8Recipe, out_dtype: torch.dtype) -> torch.Tensor:
    """patch_embed of a batched x [B, C, *S] in FP8: the patch matrix [B * N, C * prod(k)] (one
    copy of x, which autograd scatters back), one FP8 GEMM with the weight [E, C * prod(k)], the
    tokens reshaped to out_format. Spatial positions that fill no whole patch are left out, as the
    conv leaves them."""
    op = "patch_embed"
    (batch, channels), kernel = x.shape[:2], weight.shape[2:]
    if channels != weight.shape[1]:
        raise RuntimeError(f"{op}: x has {channels} channels (shape {tuple(x.shape)}) but weight [E, C, *kernel] "
                           f"expects {weight.shape[1]} (shape {tuple(weight.shape)})")
    if any(s < k for s, k in zip(x.shape[2:], kernel)):
        raise RuntimeError(f"{op}: x {tuple(x.shape)} is smaller than one patch {tuple(kernel)} (weight "
                           f"{tuple(weight.shape)})")
    _check_operands(op, x, weight, bias, weight.shape[0])
    grid = [s // k for s, k in zip(x.shape[2:], kernel)]
    whole = x[(slice(None), slice(None), *(slice(0, g * k) for g, k in zip(grid, kernel)))]
    # [B * N, C * prod(k)]: rows are tokens, columns the conv's (c, k...) order; the gather of the
    # GEMM paths (a tiled kernel on CUDA, runs of kw values on the CPU), whose gradient scatters.
    patches = torch.ops.patchgemm.patch_matrix(whole, list(kernel))
    tokens = _gemm(patches, weight.reshape(weight.shape[0], -1), bias, recipe, out_dtype).view(batch, -1, weight.shape[0])
    if out_format == "tokens":
        return tokens
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    if out_format == "channels_last" or (channels_last is not None and not x.is_contiguous()
                                         and x.is_contiguous(memory_format=channels_last)):
        # Channels-last strides over the tokens' memory (not a view of them, as the op returns it):
        # the conv's output follows x's memory format.
        return unsafe_view(tokens.transpose(1, 2), (batch, weight.shape[0], *grid))
    # Contiguous channels-first: the tokens scattered as patches of one position each (a transpose).
    return torch.ops.patchgemm.patch_matrix_backward(tokens.view(-1, weight.shape[0]),
                                                     [batch, weight.shape[0], *grid], [1] * len(grid))


def patch_unembed(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], grid: Optional[list],
                  recipe: Float8Recipe, out_dtype: torch.dtype) -> torch.Tensor:
    """patch_unembed of a batched x (tokens [B, N, C_in] where `grid` is given, else channels-first
    [B, C_in, *grid]) in FP8: one FP8 GEMM of the tokens [B * N, C_in] with the weight as
    [C_out * prod(k), C_in] (the bias repeated per kernel position), then the patches scattered into
    [B, C_out, *(grid * k)], contiguous."""
    op = "patch_unembed"
    rank, (in_channels, out_channels), kernel = weight.dim() - 2, weight.shape[:2], list(weight.shape[2:])
    if grid is not None:
        if x.dim() != 3 or x.shape[2] != in_channels or x.shape[1] != math.prod(grid):
            raise RuntimeError(f"{op}: x must be tokens [B, N, {in_channels}] with N = {math.prod(grid)} (grid "
                               f"{tuple(grid)}) for weight {tuple(weight.shape)}, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, in_channels)
    else:
        if x.dim() != rank + 2 or x.shape[1] != in_channels:
            raise RuntimeError(f"{op}: x must be [B, {in_channels}, *grid] ({rank} grid dims) for weight "
                               f"{tuple(weight.shape)}, got shape {tuple(x.shape)}")
        grid = list(x.shape[2:])
        tokens = torch.ops.patchgemm.patch_matrix(x, [1] * rank)  # patches of one position: [B * N, C_in]
    _check_operands(op, x, weight, bias, out_channels)
    per_patch = math.prod(kernel)
    weight2 = weight.reshape(in_channels, out_channels * per_patch).t()  # [C_out * prod(k), C_in]
    bias2 = None if bias is None else bias.repeat_interleave(per_patch)
    patches = _gemm(tokens, weight2, bias2, recipe, out_dtype)  # [B * N, C_out * prod(k)]
    # The patch matrix's scatter (the adjoint of patch_embed's gather; its gradient gathers).
    shape = [x.shape[0], out_channels, *(g * k for g, k in zip(grid, kernel))]
    return torch.ops.patchgemm.patch_matrix_backward(patches, shape, kernel)
