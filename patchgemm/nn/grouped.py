"""The grouped linear family's modules: GroupedLinear, GroupedMLP and MoEExperts."""

import math
import sys
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .. import functional as F
from .._args import as_bool, check_sizes
from ..fp8 import Float8History, Float8Recipe, quantize_weight
from ..fp8 import resolve as resolve_fp8


def _reused_fp8_weights(module: nn.Module, where: str, fp8, weights: Sequence[Tensor],
                       is_first_microbatch: Optional[bool]) -> Optional[tuple]:
    """TransformerEngine's ``is_first_microbatch`` contract for a module's grouped weights: in FP8,
    True quantizes them and keeps the copies on the module, False returns the copies kept, None
    (and outside FP8) returns None (the call quantizes)."""
    if is_first_microbatch is not None and not isinstance(is_first_microbatch, bool):
        raise TypeError(f"{where}: is_first_microbatch must be True, False or None, got {is_first_microbatch!r}")
    recipe = resolve_fp8(where, fp8)
    if recipe is None or is_first_microbatch is None:
        return None
    if is_first_microbatch:
        module._fp8_weights = tuple(quantize_weight(w, recipe) for w in weights)
    elif module._fp8_weights is None:
        raise RuntimeError(f"{where}: is_first_microbatch=False reuses the FP8 weights kept by an earlier call with "
                           f"is_first_microbatch=True, and none were made")
    return module._fp8_weights


class GroupedLinear(nn.Module):
    """``num_groups`` independent ``nn.Linear(in_features, out_features)`` over the groups of ``x``.

    ``x`` is ``[..., G, in_features]`` (``layout="bgd"``) or ``[G, ..., in_features]`` (``"gbd"``);
    parameters are ``weight[G, out_features, in_features]`` and ``bias[G, out_features]``, each group
    initialised like ``nn.Linear``. ``fp8``: run in FP8 (``True``, a ``Float8Recipe``), never
    (``False``), or as the enclosing ``fp8_autocast`` says (None).

    ``forward(x, is_first_microbatch=None)``, TransformerEngine's contract for gradient accumulation:
    in FP8, ``True`` quantizes the weight and keeps its FP8 copy, ``False`` reuses the copy kept (the
    weight must not have changed since), None quantizes it every call. Ignored outside FP8.
    ``fp8_history``: the amax history a delayed-scaling recipe keeps (``Float8History``).
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = True,
                 layout: str = "bgd", device=None, dtype=None, *, fp8: Union[None, bool, Float8Recipe] = None):
        super().__init__()
        if layout not in F.LAYOUTS:
            raise ValueError(f"GroupedLinear: layout must be one of {F.LAYOUTS}, got {layout!r}")
        resolve_fp8("GroupedLinear", fp8)  # checks its type
        self.fp8 = fp8
        num_groups, in_features, out_features = check_sizes("GroupedLinear", 0, num_groups=num_groups,
                                                       in_features=in_features, out_features=out_features)
        factory = {"device": device, "dtype": dtype}
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.layout = layout
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        self.bias = (nn.Parameter(torch.empty(num_groups, out_features, **factory))
                     if as_bool(bias, "GroupedLinear: bias") else None)
        self._fp8_weights: Optional[tuple] = None  # kept by is_first_microbatch=True
        self.fp8_history = Float8History()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's init per group: kaiming_uniform_(a=sqrt(5)) is U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
        # and so is its bias. (init.kaiming_uniform_ on the 3-D tensor would take the wrong fan_in.)
        bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0.0
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        kept = _reused_fp8_weights(self, "GroupedLinear", self.fp8, [self.weight], is_first_microbatch)
        return F.grouped_linear(x, self.weight, self.bias, self.layout, fp8=self.fp8,
                                fp8_weight=kept[0] if kept else None, fp8_history=self.fp8_history)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, layout={self.layout!r}"
                + (f", fp8={self.fp8!r}" if self.fp8 is not None else ""))

    @classmethod
    def from_linears(cls, linears: Sequence[nn.Linear], layout: str = "bgd") -> "GroupedLinear":
        """One GroupedLinear holding copies of the weights of ``linears`` (group g = ``linears[g]``)."""
        linears = list(linears)
        if not linears or not all(isinstance(l, nn.Linear) for l in linears):
            raise ValueError("GroupedLinear.from_linears: expected a non-empty list of nn.Linear")
        first = linears[0]
        for i, l in enumerate(linears):
            if (l.in_features, l.out_features) != (first.in_features, first.out_features):
                raise ValueError(
                    f"GroupedLinear.from_linears: linears[{i}] is {l.in_features}->{l.out_features} but "
                    f"linears[0] is {first.in_features}->{first.out_features}")
            if (l.bias is None) != (first.bias is None):
                raise ValueError("GroupedLinear.from_linears: either all linears have a bias or none does")
            if (l.weight.dtype, l.weight.device) != (first.weight.dtype, first.weight.device):
                raise ValueError(
                    f"GroupedLinear.from_linears: linears[{i}] is {l.weight.dtype} on {l.weight.device}, "
                    f"linears[0] is {first.weight.dtype} on {first.weight.device}")
        module = cls(len(linears), first.in_features, first.out_features, first.bias is not None,
                     layout, device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            module.weight.copy_(torch.stack([l.weight for l in linears]))
            if module.bias is not None:
                module.bias.copy_(torch.stack([l.bias for l in linears]))
        return module

    def to_linears(self) -> List[nn.Linear]:
        """Independent nn.Linear modules holding copies of each group's weights."""
        linears = []
        for g in range(self.num_groups):
            l = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                          device=self.weight.device, dtype=self.weight.dtype)
            with torch.no_grad():
                l.weight.copy_(self.weight[g])
                if self.bias is not None:
                    l.bias.copy_(self.bias[g])
            linears.append(l)
        return linears


class GroupedMLP(nn.Module):
    """``num_groups`` independent gated MLPs, ``dim -> hidden -> out_dim`` (default ``dim``), over the
    groups of ``x``: ``down(silu(gate(x)) * up(x))`` per group (SwiGLU), through grouped_mlp.

    Parameters: ``w_gate_up[G, 2*hidden, dim]`` (gate rows first, then up) and
    ``w_down[G, out_dim, hidden]``, plus ``bias_gate_up[G, 2*hidden]`` / ``bias_down[G, out_dim]``
    when ``bias``; each projection initialised like ``nn.Linear``. ``fp8``: both GEMMs in FP8, as
    GroupedLinear's; ``forward(x, is_first_microbatch=None)`` as GroupedLinear's, for both weights;
    ``fp8_histories``: the two GEMMs' ``Float8History`` (gate-up, down).
    """

    def __init__(self, num_groups: int, dim: int, hidden: int, activation: str = "swiglu", *,
                 out_dim: Optional[int] = None, bias: bool = False, layout: str = "bgd", device=None, dtype=None,
                 fp8: Union[None, bool, Float8Recipe] = None):
        super().__init__()
        resolve_fp8("GroupedMLP", fp8)  # checks its type
        self.fp8 = fp8
        out_dim = dim if out_dim is None else out_dim
        if activation not in F.ACTIVATIONS:
            raise ValueError(f"GroupedMLP: activation must be one of {F.ACTIVATIONS}, got {activation!r}")
        if layout not in F.LAYOUTS:
            raise ValueError(f"GroupedMLP: layout must be one of {F.LAYOUTS}, got {layout!r}")
        num_groups, dim, hidden, out_dim = check_sizes("GroupedMLP", 0, num_groups=num_groups, dim=dim, hidden=hidden,
                                                  out_dim=out_dim)
        factory = {"device": device, "dtype": dtype}
        self.num_groups, self.dim, self.hidden, self.out_dim = num_groups, dim, hidden, out_dim
        self.activation, self.layout = activation, layout
        self.w_gate_up = nn.Parameter(torch.empty(num_groups, 2 * hidden, dim, **factory))
        self.w_down = nn.Parameter(torch.empty(num_groups, out_dim, hidden, **factory))
        bias = as_bool(bias, "GroupedMLP: bias")
        self.bias_gate_up = nn.Parameter(torch.empty(num_groups, 2 * hidden, **factory)) if bias else None
        self.bias_down = nn.Parameter(torch.empty(num_groups, out_dim, **factory)) if bias else None
        self._fp8_weights: Optional[tuple] = None  # kept by is_first_microbatch=True
        self.fp8_histories = (Float8History(), Float8History())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight, bias, fan_in in ((self.w_gate_up, self.bias_gate_up, self.dim),
                                     (self.w_down, self.bias_down, self.hidden)):
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
            nn.init.uniform_(weight, -bound, bound)
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def forward(self, x: Tensor, is_first_microbatch: Optional[bool] = None) -> Tensor:
        kept = _reused_fp8_weights(self, "GroupedMLP", self.fp8, [self.w_gate_up, self.w_down], is_first_microbatch)
        return F.grouped_mlp(x, self.w_gate_up, self.w_down, self.layout, bias_gate_up=self.bias_gate_up,
                             bias_down=self.bias_down, activation=self.activation, fp8=self.fp8, fp8_weights=kept,
                             fp8_histories=self.fp8_histories)

    def extra_repr(self) -> str:
        return (f"num_groups={self.num_groups}, dim={self.dim}, hidden={self.hidden}, out_dim={self.out_dim}, "
                f"activation={self.activation!r}, bias={self.bias_down is not None}, layout={self.layout!r}"
                + (f", fp8={self.fp8!r}" if self.fp8 is not None else ""))


class MoEExperts(nn.Module):
    """The routed experts of a mixture of experts, ``num_experts`` SwiGLU MLPs ``dim -> hidden ->
    dim``, through moe_experts: ``forward(x [T, dim], expert_index [T, k], expert_weight [T, k])``.

    Parameters as transformers' experts modules name and lay them out, so their ``state_dict`` keys
    load: ``gate_up_proj[E, 2*hidden, dim]`` (gate rows first, then up) and
    ``down_proj[E, dim, hidden]``. ``convert`` swaps transformers' SwiGLU experts (Mixtral, Qwen-MoE,
    OLMoE, DeepSeek and the others of that layout) for one sharing their parameters. ``fp8``: both
    ragged GEMMs in FP8 (``True``, a ``Float8Recipe``), never (``False``), or as the enclosing
    ``fp8_autocast`` says (None). ``fp8_histories``: the two GEMMs' ``Float8History`` (gate-up, down).
    """

    fp8 = None  # (modules made by from_experts: as the enclosing region says)

    def __init__(self, num_experts: int, dim: int, hidden: int, *, device=None, dtype=None,
                 fp8: Union[None, bool, Float8Recipe] = None):
        super().__init__()
        resolve_fp8("MoEExperts", fp8)  # checks its type
        self.fp8 = fp8
        num_experts, dim, hidden = check_sizes("MoEExperts", 1, num_experts=num_experts, dim=dim, hidden=hidden)
        factory = {"device": device, "dtype": dtype}
        # (transformers' attribute names, which code around the experts may read)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, dim, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden, **factory))
        self.fp8_histories = (Float8History(), Float8History())
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight, fan_in in ((self.gate_up_proj, self.hidden_dim), (self.down_proj, self.intermediate_dim)):
            bound = 1 / math.sqrt(fan_in)
            nn.init.uniform_(weight, -bound, bound)

    @classmethod
    def from_experts(cls, module: nn.Module) -> "MoEExperts":
        """One sharing the parameters of a transformers experts module (``gate_up_proj``,
        ``down_proj``); ValueError saying why where that module computes something else."""
        why = moe_experts_problem(module)
        if why:
            raise ValueError(f"MoEExperts.from_experts: {why}")
        experts, two_hidden, dim = module.gate_up_proj.shape
        new = cls(experts, dim, two_hidden // 2, device="meta")
        new.gate_up_proj, new.down_proj = module.gate_up_proj, module.down_proj
        return new

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return F.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                             fp8=self.fp8, fp8_histories=self.fp8_histories)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, dim={self.hidden_dim}, hidden={self.intermediate_dim}"
                + (f", fp8={self.fp8!r}" if self.fp8 is not None else ""))


EXPERTS_IMPLEMENTATION = "patchgemm"  # the name under which transformers' ExpertsInterface knows moe_experts


def _experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts implementation "patchgemm": the module's own parameters through
    moe_experts. Its verdict (moe_experts_problem) is made once per module, before any trace
    (use_transformers_experts), as the check probes the activation."""
    why = module.__dict__.get("_patchgemm_experts_problem", moe_experts_problem)
    if why is moe_experts_problem:  # (selected by hand: checked at the first call)
        why = module.__dict__["_patchgemm_experts_problem"] = moe_experts_problem(module)
    if why is not None:
        raise ValueError(f"experts_implementation={EXPERTS_IMPLEMENTATION!r} cannot compute {type(module).__name__}: {why}")
    # (delayed FP8 scaling's amax histories: the module's, outside its state_dict)
    histories = module.__dict__.get("_patchgemm_fp8_histories")
    if histories is None:
        histories = module.__dict__["_patchgemm_fp8_histories"] = (Float8History(), Float8History())
    return F.moe_experts(hidden_states, top_k_index, top_k_weights, module.gate_up_proj, module.down_proj,
                         fp8_histories=histories)


def register_transformers_experts() -> bool:
    """Registers moe_experts as an experts implementation of transformers (``ExpertsInterface``),
    named "patchgemm": ``model.set_experts_implementation("patchgemm")`` then computes every experts
    module of the SwiGLU layout (moe_experts_problem) through moe_experts, with the model's own
    parameters and modules. False where transformers is not imported (nothing to register with)."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or not hasattr(moe, "ALL_EXPERTS_FUNCTIONS"):
        return False
    moe.ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, _experts_forward)
    return True


def use_transformers_experts(model: nn.Module) -> List[Tuple[str, Optional[str]]]:
    """Selects the "patchgemm" experts implementation (register_transformers_experts) on each
    transformers model in ``model`` whose experts modules all compute moe_experts' layout; models
    with one that does not are left as they are. Returns (module name, why not or None) per experts
    module found. The choice is the model's own switch (``config._experts_implementation``): the
    model runs it eager and compiled alike; ``model.set_experts_implementation(...)`` changes it back."""
    transformers = sys.modules.get("transformers")
    moe = sys.modules.get("transformers.integrations.moe")
    if transformers is None or not hasattr(moe, "ALL_EXPERTS_FUNCTIONS"):
        return []
    found: List[Tuple[str, Optional[str]]] = []
    done = set()
    for name, sub in model.named_modules():
        if not isinstance(sub, transformers.PreTrainedModel) or any(name.startswith(d) for d in done):
            continue
        verdicts = [(f"{name}.{n}" if name else n, m) for n, m in sub.named_modules()
                    if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and hasattr(m, "is_transposed")]
        if not verdicts:
            continue
        done.add(name + "." if name else "")
        checked = [(where, m, moe_experts_problem(m)) for where, m in verdicts]
        if any(why is not None for _, _, why in checked):  # one switch per model: all or none
            found += [(where, why or "its model has experts moe_experts does not compute") for where, _, why in checked]
            continue
        register_transformers_experts()
        for where, m, _ in checked:
            m.__dict__["_patchgemm_experts_problem"] = None
            m.__dict__.setdefault("_patchgemm_fp8_histories", (Float8History(), Float8History()))  # (before any trace)
            found.append((where, None))
        sub.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return found


def _acts_as_silu(act) -> bool:
    """Whether ``act`` computes SiLU (transformers' ACT2FN["silu"], nn.SiLU, F.silu, ...): probed."""
    if not callable(act):
        return False
    probe = torch.linspace(-6, 6, 25, dtype=torch.float64)
    try:
        with torch.no_grad():
            out = act(probe)
    except Exception:  # an activation that cannot run on a float64 CPU tensor is not one we know
        return False
    return isinstance(out, Tensor) and out.shape == probe.shape and torch.allclose(out, nn.functional.silu(probe))


def moe_experts_problem(module: nn.Module) -> Optional[str]:
    """Why a module is not a transformers experts module that MoEExperts computes, or None. Its
    layout must be the default of transformers' ``use_experts_implementation``: gate and up
    concatenated in ``gate_up_proj[E, 2H, D]``, ``down_proj[E, D, H]``, no biases, SiLU, the default
    gate, no norm after the experts, and no other parameters or submodules."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None or not type(module).__module__.startswith("transformers."):
        return "not a transformers module"
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gate_up, nn.Parameter) or not isinstance(down, nn.Parameter):
        return "no gate_up_proj / down_proj parameters"
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
              "has_post_expert_norm": False}
    odd = [f"{k}={getattr(module, k)}" for k, v in layout.items() if getattr(module, k, v) != v]
    if odd:
        return f"its layout ({', '.join(odd)}) is not the SwiGLU experts layout"
    if getattr(type(module), "_apply_gate", None) is not getattr(moe, "_default_apply_gate", ()):
        return "its own gate function"
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] % 2 or tuple(down.shape) != (
            gate_up.shape[0], gate_up.shape[2], gate_up.shape[1] // 2):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2H, D] and [E, D, H]"
    others = [n for n, _ in module.named_parameters() if n not in ("gate_up_proj", "down_proj")]
    others += [n for n, m in module.named_children() if n != "act_fn"]
    if others:
        return f"other parameters or submodules ({', '.join(others)})"
    if not _acts_as_silu(getattr(module, "act_fn", None)):
        return "its activation is not SiLU"
    return None
