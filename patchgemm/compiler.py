"""patchgemm as a ``torch.compile`` backend: the calls in the traced graph that a patchgemm op
computes are rewritten to it, then the graph goes on to Inductor (or another backend). The model's
modules, code and ``state_dict`` stay as they are.

    model = patchgemm.compile(model, mode="reduce-overhead")  # or torch.compile(model, backend="patchgemm")
    model(x)                                                   # compiles, rewriting as it goes
    print(model.patchgemm_report)                              # what was rewritten, what was left and why

Rewritten (the rules are :func:`convert`'s, applied to calls instead of modules):

- ``conv{1,2,3}d`` with kernel == stride (wider than 1), padding 0, dilation 1, groups 1 ->
  ``patch_embed``; when every use of the result flattens it to tokens (``.flatten(2)``) or permutes
  it to channels-last order, the GEMM writes the tokens' layout and those become free views;
- ``conv_transpose{1,2,3}d`` likewise (output_padding 0) -> ``patch_unembed``;
- grouped pointwise ``conv{1,2,3}d`` (kernel 1, stride 1, groups > 1, more than one input channel
  per group) -> ``grouped_pointwise_conv``;
- grouped linears written as ``torch.einsum("bgd,gdo->bgo", x, w)`` (or ``"bgd,god->bgo"``, more
  batch dims, group-major ``"gbd,..."``), or as ``bmm`` of ``x[B, G, D].transpose(0, 1)`` whose
  every use transposes the result back -> ``grouped_linear``, which writes ``[B, G, O]`` directly.

Every other call is left to the backend; 1 x 1 convs with one group, and depthwise ones, stay
(cuDNN computes them as well), as in :func:`convert`.

A mixture of experts' routed experts run a data-dependent loop that no trace holds whole. For
transformers models, :func:`compile` selects the experts implementation transformers lets libraries
register (``ExpertsInterface``; ``patchgemm.nn.use_transformers_experts``): "patchgemm", which
computes each experts module of the SwiGLU layout through ``moe_experts`` with the module's own
parameters. That switch is the model's (``config._experts_implementation``), so the model runs
it uncompiled too.
"""

import logging
import re
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple, Union

import torch
from torch import fx

from . import functional
from .conv_rules import left_to_pytorch, patch_problem, pointwise_problem
from .nn.grouped import EXPERTS_IMPLEMENTATION, use_transformers_experts

__all__ = ["compile", "backend", "CompileReport"]
_log = logging.getLogger(__name__)

# The torch functions a traced conv module calls, with their parameters in order.
_CONV_PARAMS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_TRANSPOSE_PARAMS = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
_CONVS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}
_CONV_TRANSPOSES = {torch.conv_transpose1d: 1, torch.conv_transpose2d: 2, torch.conv_transpose3d: 3}
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1, "output_padding": 0}
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class CompileReport:
    """What the backend rewrote: ``rewritten`` (where, "conv2d -> patch_embed ...") per call
    rewritten, and ``left`` (where, why) per convolution it met and left. ``where`` is the module path of the call
    (``patch_embed.proj``) where the trace names it. A graph traced again (new shapes, a graph
    break) adds its calls; a call is listed once."""
    rewritten: List[Tuple[str, str]] = field(default_factory=list)
    left: List[Tuple[str, str]] = field(default_factory=list)
    # The compiled model's module paths: a graph traced from a submodule's frame (after a graph break)
    # names its calls from that submodule, and is named from the model wherever that is unambiguous.
    _module_paths: List[str] = field(default_factory=list, repr=False)

    def _add(self, entries: List[Tuple[str, str]], entry: Tuple[str, str]) -> None:
        where, what = entry
        if where not in self._module_paths:
            whole = [p for p in self._module_paths if p.endswith("." + where)]
            if len(whole) == 1:
                entry = (whole[0], what)
        if entry not in entries:
            entries.append(entry)

    def __str__(self) -> str:
        lines = [f"patchgemm.compile: rewrote {len(self.rewritten)}, left {len(self.left)}"]
        lines += [f"  rewrote {where}: {what}" for where, what in self.rewritten]
        lines += [f"  left    {where}: {why}" for where, why in self.left]
        return "\n".join(lines)


@dataclass
class _ConvCall:
    """A traced conv call, with the attributes of the nn.Conv module it may come from (what the
    eligibility rules of nn.py read)."""
    kernel_size: Tuple[int, ...]
    stride: Tuple[int, ...]
    padding: Union[str, Tuple[int, ...]]
    dilation: Tuple[int, ...]
    groups: int
    output_padding: Tuple[int, ...]
    in_channels: int
    transposed: bool
    padding_mode: str = "zeros"


def _value(node) -> Optional[torch.Tensor]:
    """The example (fake) tensor the trace recorded for a graph value, or None."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _sizes(value, rank: int) -> Optional[Tuple[int, ...]]:
    """An int or a sequence of ints as a tuple of `rank` ints; None for anything else (a traced
    value, a symbolic size)."""
    if type(value) is int:
        return (value,) * rank
    if isinstance(value, (tuple, list)) and len(value) == rank and all(type(v) is int for v in value):
        return tuple(value)
    return None


def _where(node: fx.Node) -> str:
    """The module path of a traced call (``blocks.0.proj``), or the graph's name for it."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return node.name
    path = list(stack.values())[-1][0]
    path = re.sub(r"^L\['[^']*'\]\.?", "", path)        # Dynamo's name of the module called
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    return re.sub(r"\[(\d+)\]", r".\1", path) or node.name


def _call(node: fx.Node, params: Tuple[str, ...]) -> Optional[dict]:
    """A conv node's arguments by parameter name (defaults filled), or None if it names others."""
    if len(node.args) > len(params) or set(node.kwargs) - set(params):
        return None
    args = dict(_DEFAULTS)
    args.update(zip(params, node.args))
    args.update(node.kwargs)
    return args


def _is_method(node: fx.Node, name: str) -> bool:
    """Whether `node` calls Tensor.<name> or torch.<name> (the two spellings a trace records)."""
    return (node.op == "call_method" and node.target == name) or (
        node.op == "call_function" and node.target is getattr(torch, name, None))


def _dims(node: fx.Node) -> tuple:
    """The int arguments after the tensor of a permute / flatten / transpose call."""
    rest = list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = list(rest[0])
    return tuple(rest) + tuple(node.kwargs.values())


def _uses_tokens(node: fx.Node, rank: int) -> bool:
    """Whether every use of a conv's [B, E, *grid] result reads it as tokens: ``.flatten(2)``, a
    permute to channels-last order (for one spatial dim also ``.transpose(1, 2)``). Then the
    channels-last layout (the tokens' memory) makes each of those a view of contiguous memory."""
    last = rank + 1
    channels_last = (0, *range(2, rank + 2), 1)

    def reads_tokens(user: fx.Node) -> bool:
        if user.args[:1] != (node,):
            return False
        dims = _dims(user)
        if _is_method(user, "flatten"):
            return dims in ((2,), (2, -1), (2, last))
        if _is_method(user, "permute"):
            return tuple(d % (rank + 2) for d in dims if type(d) is int) == channels_last and len(dims) == rank + 2
        if _is_method(user, "transpose") and rank == 1:
            return len(dims) == 2 and {d % 3 for d in dims if type(d) is int} == {1, 2}
        return False

    return bool(node.users) and all(reads_tokens(user) for user in node.users)


def _rewrite_conv(node: fx.Node, report: CompileReport) -> Optional[Tuple[Callable, tuple, dict, List[fx.Node]]]:
    """The patchgemm call computing a conv node (and the node it replaces), or None (with the
    reason in the report)."""
    transposed = node.target in _CONV_TRANSPOSES
    rank = (_CONV_TRANSPOSES if transposed else _CONVS)[node.target]
    name = node.target.__name__
    where = _where(node)
    args = _call(node, _CONV_TRANSPOSE_PARAMS if transposed else _CONV_PARAMS)
    if args is None:
        report._add(report.left, (where, f"{name}: arguments not understood"))
        return None
    x, weight, bias = _value(args["input"]), _value(args["weight"]), args["bias"]
    if x is None or weight is None or (bias is not None and _value(bias) is None):
        report._add(report.left, (where, f"{name}: input, weight or bias not a traced tensor"))
        return None
    # (x and the weight may differ in dtype inside an autocast region: the op casts them, as the conv)
    if x.dtype not in _FLOATS or weight.dtype not in _FLOATS or x.dim() not in (rank + 1, rank + 2):
        report._add(report.left, (where, f"{name}: x {x.dtype} {tuple(x.shape)}, weight {weight.dtype}"))
        return None
    kernel = tuple(weight.shape[2:])
    if not all(type(k) is int for k in kernel):
        report._add(report.left, (where, f"{name}: symbolic weight shape"))
        return None
    padding = args["padding"] if isinstance(args["padding"], str) else _sizes(args["padding"], rank)
    conv = _ConvCall(kernel_size=kernel, stride=_sizes(args["stride"], rank), padding=padding,
                     dilation=_sizes(args["dilation"], rank), groups=args["groups"],
                     output_padding=_sizes(args["output_padding"], rank), transposed=transposed,
                     in_channels=int(weight.shape[0] if transposed else weight.shape[1] * args["groups"]))
    if None in (conv.stride, conv.padding, conv.dilation, conv.output_padding) or type(conv.groups) is not int:
        report._add(report.left, (where, f"{name}: stride, padding, dilation or groups not constant"))
        return None
    described = f"{name}(weight {tuple(weight.shape)}, stride {conv.stride})"
    reason = patch_problem(conv)
    pointwise = bool(reason) and not transposed and not pointwise_problem(conv)
    if pointwise or not reason:
        reason = left_to_pytorch(conv)
    if reason:
        report._add(report.left, (where, f"{described}: {reason}"))
        return None
    operands = (args["input"], args["weight"], bias)
    if pointwise:
        report._add(report.rewritten, (where, f"{described} -> grouped_pointwise_conv"))
        return functional.grouped_pointwise_conv, operands, {"groups": conv.groups}, [node]
    if transposed:
        report._add(report.rewritten, (where, f"{described} -> patch_unembed"))
        return functional.patch_unembed, operands, {}, [node]
    tokens = x.dim() == rank + 2 and _uses_tokens(node, rank)
    report._add(report.rewritten, (where, f"{described} -> patch_embed" + (" writing tokens" if tokens else "")))
    return functional.patch_embed, operands, {"out_format": "channels_last" if tokens else "channels_first"}, [node]


def _swaps_first_two(node) -> bool:
    """Whether `node` is a 3-D tensor's ``.transpose(0, 1)`` (or ``.permute(1, 0, 2)``)."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function"):
        return False
    value = _value(node)
    if value is None or value.dim() != 3:
        return False
    dims = _dims(node)
    if _is_method(node, "transpose"):
        return len(dims) == 2 and {d % 3 for d in dims if type(d) is int} == {0, 1}
    return _is_method(node, "permute") and tuple(d % 3 for d in dims if type(d) is int) == (1, 0, 2) and len(dims) == 3


def _floats(*nodes) -> bool:
    return all(_value(n) is not None and _value(n).dtype in _FLOATS for n in nodes)


def _rewrite_bmm(node: fx.Node, report: CompileReport) -> Optional[Tuple[Callable, tuple, dict, List[fx.Node]]]:
    """``bmm(x.transpose(0, 1), w).transpose(0, 1)`` as grouped_linear(x, w^T): the call and the
    nodes it replaces (the transposes that read the bmm), or None."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, w = node.args
    users = list(node.users)
    if not (_swaps_first_two(a) and users and all(_swaps_first_two(u) and u.args[0] is node for u in users)):
        return None  # (a bmm over group-major operands is one strided-batched GEMM already)
    x = a.args[0]
    if not _floats(x, w):
        return None
    report._add(report.rewritten, (_where(node), f"bmm(x{tuple(_value(x).shape)}.transpose(0, 1), "
                                                 f"w{tuple(_value(w).shape)}).transpose(0, 1) -> grouped_linear"))
    return _grouped_linear_in_out, (x, w, "bgd"), {}, users


def _grouped_linear_in_out(x, w, layout):
    """grouped_linear of a weight laid out [G, D_in, D_out] (bmm's, and einsum's "gdo")."""
    return functional.grouped_linear(x, w.transpose(1, 2), None, layout)


def _grouped_einsum(equation: str) -> Optional[Tuple[str, bool]]:
    """(layout, whether w is [G, D, O]) when the einsum is a grouped linear of x and w, else None."""
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation or equation.count(",") != 1:
        return None
    lhs, out = equation.split("->")
    xs, ws = lhs.split(",")
    if len(ws) != 3 or len(set(ws)) != 3 or len(set(xs)) != len(xs) or len(xs) < 2:
        return None
    g, d = ws[0], xs[-1]
    if g == d or d not in ws[1:]:
        return None
    o = ws[2] if ws[1] == d else ws[1]
    if o in xs or out != xs[:-1] + o:
        return None
    if xs[-2] == g:
        layout = "bgd"
    elif xs[0] == g and len(xs) >= 3:
        layout = "gbd"
    else:
        return None
    return layout, ws[1] == d


def _rewrite_einsum(node: fx.Node, report: CompileReport) -> Optional[Tuple[Callable, tuple, dict, List[fx.Node]]]:
    args = list(node.args)
    if node.kwargs or not args or not isinstance(args[0], str):
        return None
    operands = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:]
    form = _grouped_einsum(args[0])
    if form is None or len(operands) != 2 or not _floats(*operands):
        return None
    x, w = operands
    layout, w_is_gdo = form
    report._add(report.rewritten, (_where(node), f"einsum({args[0]!r}) -> grouped_linear"))
    if w_is_gdo:
        return _grouped_linear_in_out, (x, w, layout), {}, [node]
    return functional.grouped_linear, (x, w, None, layout), {}, [node]


def rewrite(gm: fx.GraphModule, report: Optional[CompileReport] = None) -> CompileReport:
    """Rewrite, in place, the calls of a Dynamo-traced graph that patchgemm ops compute (see the
    module's docstring); returns the report (``report``, added to, if given)."""
    report = CompileReport() if report is None else report
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op == "call_function" and (node.target in _CONVS or node.target in _CONV_TRANSPOSES):
            call = _rewrite_conv(node, report)
        elif _is_method(node, "bmm"):
            call = _rewrite_bmm(node, report)
        elif node.op == "call_function" and node.target is torch.einsum:
            call = _rewrite_einsum(node, report)
        else:
            continue
        if call is None:
            continue
        fn, args, kwargs, replaced = call
        _replace(graph, node, replaced, fn, args, kwargs)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return report


def _replace(graph: fx.Graph, node: fx.Node, replaced: List[fx.Node], fn: Callable, args: tuple, kwargs: dict) -> None:
    """Insert ``fn(*args, **kwargs)`` after `node` and let it stand for every node in `replaced`
    (each computes the value it computes); then erase what is left unused."""
    with graph.inserting_after(node):
        new = graph.call_function(fn, args, kwargs)
    new.meta.update(replaced[-1].meta)
    example = _value(replaced[-1])
    if example is not None:  # the new call's own fake result: its strides may differ
        with example.fake_mode:
            new.meta["example_value"] = fn(*[_value(a) if isinstance(a, fx.Node) else a for a in args], **kwargs)
    for old in replaced:
        old.replace_all_uses_with(new)
    for old in dict.fromkeys([*replaced, node]):
        if not old.users:
            inputs = old.all_input_nodes
            graph.erase_node(old)
            for n in inputs:  # (the bmm's transpose of x, when nothing else reads it)
                if n.op != "placeholder" and not n.users and n is not node and n not in replaced:
                    graph.erase_node(n)


def _inner_compiler(backend: Union[str, Callable], mode: Optional[str], options: Optional[dict]) -> Callable:
    """The compiler the rewritten graph goes to: Inductor with torch.compile's mode and options, or
    any other Dynamo backend (a name or a callable)."""
    if backend == "inductor":
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        config = dict(list_mode_options(mode)) if mode else {}  # (no mode: it lists them all)
        config.update(options or {})
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=config)
    if mode or options:
        raise ValueError(f"patchgemm.compile: mode and options are Inductor's; backend={backend!r} takes neither")
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(backend)


class _Backend:
    """A torch.compile backend: rewrite each traced graph, then hand it to the inner compiler."""

    def __init__(self, backend: Union[str, Callable] = "inductor", mode: Optional[str] = None,
                 options: Optional[dict] = None):
        self.report = CompileReport()
        self._inner = _inner_compiler(backend, mode, options)

    def __call__(self, gm: fx.GraphModule, example_inputs):
        rewrite(gm, self.report)
        return self._inner(gm, example_inputs)


def backend(gm: fx.GraphModule, example_inputs, mode: Optional[str] = None, options: Optional[dict] = None):
    """The backend ``torch.compile(model, backend="patchgemm")`` names (mode and options are
    Inductor's). Each traced graph's report goes to the ``patchgemm.compiler`` logger (INFO);
    :func:`compile` keeps them on the compiled model instead."""
    rewriting = _Backend("inductor", mode, options)
    compiled = rewriting(gm, example_inputs)
    _log.info("%s", rewriting.report)
    return compiled


def compile(model: Callable, *, backend: Union[str, Callable] = "inductor", mode: Optional[str] = None,
            options: Optional[dict] = None, **kwargs) -> Callable:
    """``torch.compile(model, **kwargs)`` with every call a patchgemm op computes rewritten to it in
    the traced graphs (see the module's docstring). ``backend`` compiles the rewritten graph:
    ``"inductor"`` (with torch.compile's ``mode`` and ``options``: ``mode="reduce-overhead"`` for
    CUDA graphs) or any other Dynamo backend (``"aot_eager"``, ``"eager"``, a callable). The
    compiled model's ``patchgemm_report`` (a :class:`CompileReport`) fills as graphs are traced."""
    if not callable(model):
        raise TypeError(f"patchgemm.compile: expected a module or function, got {type(model).__name__}")
    rewriting = _Backend(backend, mode, options)
    if isinstance(model, torch.nn.Module):  # experts run as a module, not as calls a trace can see
        rewriting.report._module_paths = [name for name, _ in model.named_modules() if name]
        for where, why in use_transformers_experts(model):
            entry = (where, "experts -> moe_experts (transformers' experts implementation "
                            f"{EXPERTS_IMPLEMENTATION!r})") if why is None else (where, f"experts: {why}")
            rewriting.report._add(rewriting.report.rewritten if why is None else rewriting.report.left, entry)
    compiled = torch.compile(model, backend=rewriting, **kwargs)
    # (on the compiled wrapper itself: an nn.Module's OptimizedModule forwards attribute writes to it)
    object.__setattr__(compiled, "patchgemm_report", rewriting.report)
    return compiled
