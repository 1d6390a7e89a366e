"""The differentiable ops under torch.func transforms (grad, vjp, jacrev, jacfwd's vjp half, vmap).

The ops' autograd is C++ (csrc/ops/autograd.cpp) to keep host time per call low, and PyTorch
refuses C++ autograd functions while a functorch transform is active. So while one is, the
functional API calls these Python autograd Functions instead: the same backward ops, the same
gradients. functorch applies a Function once per transform level; its forward runs the op's
backend kernel (vmap batches it by PyTorch's per-sample fallback). The input gradients of the
GEMM ops are such ops again, called through `call`, so they are differentiable in turn; the
weight and bias gradients are not differentiable again. swiglu and instance_norm_act run as ATen
ops (differentiable to any order).
"""

import torch

from .ops import ops


def active() -> bool:
    """True inside a torch.func transform (torch.compile reads it as a constant)."""
    return torch._C._are_functorch_transforms_active()


def _below(op, *args):
    """The op's backend kernel (under vmap: per sample), skipping its C++ autograd."""
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)


def bias_grad_sum(t, dims):
    """A bias gradient: a sum accumulated in fp32 (fp64 for fp64) and rounded once, as ATen and
    Inductor sum 16-bit tensors by themselves (t's values where every summed dim has size 1, as the
    C++ autograd's sum_for_bias_grad)."""
    if all(t.shape[d] == 1 for d in dims):
        return t.squeeze(dims).contiguous()
    return t.sum(dims)


class _Function(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (x, weight, bias, *rest): x and weight saved, tensors of rest saved after them, the
        # other arguments of rest kept as they are.
        x, weight, bias, *rest = inputs
        ctx.has_bias = bias is not None
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in rest]
        ctx.save_for_backward(x, weight, *(a for a in rest if isinstance(a, torch.Tensor)))


def grouped_linear_grads(grad_y, x, weight, group_major: bool, need_x: bool, need_w: bool, need_b: bool):
    """grouped_linear's gradients (x, weight, bias), each None where not needed; all contiguous."""
    grad_x = ops.grouped_linear_grad_input.default(grad_y, weight, group_major) if need_x else None
    grad_w = ops.grouped_linear_grad_weight.default(grad_y, x, group_major) if need_w else None
    grad_b = bias_grad_sum(grad_y, (1 if group_major else 0,)) if need_b else None
    return grad_x, grad_w, grad_b


class GroupedLinear(_Function):
    @staticmethod
    def forward(x, weight, bias, group_major):
        return _below(ops.grouped_linear, x, weight, bias, group_major)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        group_major, = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # dx = grad_y @ W is grouped_linear again, differentiable in turn; dW is not (its operands
        # detached: the backend op refuses inputs that still require grad).
        grad_x = call("grouped_linear", grad_y, weight.transpose(1, 2), None, group_major) if need_x else None
        _, grad_w, _ = grouped_linear_grads(grad_y.detach(), x.detach(), weight, group_major, False, need_w, False)
        grad_b = bias_grad_sum(grad_y, (1 if group_major else 0,)) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


class RaggedGroupedLinear(_Function):
    @staticmethod
    def forward(x, weight, bias, offsets):
        return _below(ops.ragged_grouped_linear, x, weight, bias, offsets)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, offsets = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = call("ragged_grouped_linear", grad_y, weight.transpose(1, 2), None, offsets) if need_x else None
        grad_w = ops.ragged_grouped_linear_grad_weight(grad_y.detach(), x.detach(), offsets) if need_w else None
        grad_b = ragged_bias_grad(grad_y, offsets) if need_b and ctx.has_bias else None
        return grad_x, grad_w, grad_b, None


def ragged_bias_grad(grad_y, offsets):
    """Each group's sum of its rows of grad_y [N, Dout] (offsets: the groups' end rows), summed in
    fp32 (float64 for float64), without a host sync: [G, Dout] of grad_y's dtype. As the C++
    autograd's (ops/autograd.cpp): host offsets reach the GPU through pinned memory, or, while a
    CUDA graph is captured (which cannot copy them), give one sum per group; `unsafe`: the sizes
    were checked where they could be, and checking them against grad_y reads them on the host."""
    rows = grad_y.to(torch.float64 if grad_y.dtype == torch.float64 else torch.float32)
    ends = offsets.to(torch.int64)
    if ends.device != grad_y.device:
        if grad_y.is_cuda and torch.cuda.is_current_stream_capturing():
            sizes = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
            return torch.stack([r.sum(0) for r in rows.split(sizes)]).to(grad_y.dtype)
        ends = ends.pin_memory().to(grad_y.device, non_blocking=True) if grad_y.is_cuda else ends.to(grad_y.device)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    return torch.segment_reduce(rows, "sum", lengths=sizes, unsafe=True).to(grad_y.dtype)


class GroupedPointwiseConv(_Function):
    @staticmethod
    def forward(x, weight, bias, groups):
        return _below(ops.grouped_pointwise_conv, x, weight, bias, groups)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        groups, = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        grad_x = grad_w = grad_b = None
        if need_x:  # dx in x's memory format, as the conv's: the conv of grad_y by the groups' transposes
            fmt = torch._prims_common.suggest_memory_format(x) if x.numel() else torch.contiguous_format
            out_per_group, in_per_group = weight.shape[0] // groups, weight.shape[1]
            weight_t = weight.reshape(groups, out_per_group, in_per_group).transpose(1, 2).reshape(
                groups * in_per_group, out_per_group, *weight.shape[2:])
            grad_x = call("grouped_pointwise_conv", grad_y.contiguous(memory_format=fmt), weight_t, None, groups)
        if need_w:
            grad_w, grad_b = ops.grouped_pointwise_conv_grad_weight(grad_y.detach(), x.detach(), groups, need_b)
        elif need_b:
            grad_b = bias_grad_sum(grad_y, (0, *range(2, grad_y.dim())))
        return grad_x, grad_w, grad_b if need_b else None, None


class PatchEmbed(_Function):
    @staticmethod
    def forward(x, weight, bias, tokens, levels):
        return _below(ops.patch_embed, x, weight, bias, tokens, levels)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        tokens, levels = ctx.args
        kernel = list(weight.shape[2:])
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        grad_x = grad_w = grad_b = None
        if need_x:  # row-major tokens unpatchify with one level, the grid
            unembed_levels = [s // k for s, k in zip(x.shape[2:], kernel)] if tokens and not levels else levels
            grad_x = call("patch_unembed", grad_y, weight, None, tokens, unembed_levels)
        if need_w or need_b:  # (x detached: a view cut by call() records its slice, and dW is not differentiable again)
            grad_w, grad_b = ops.patch_weight_grad(grad_y, x.detach(), kernel, tokens, levels, need_b, False)
        return grad_x, grad_w if need_w else None, grad_b if need_b else None, None, None


class PatchUnembed(_Function):
    @staticmethod
    def forward(x, weight, bias, tokens, levels):
        return _below(ops.patch_unembed, x, weight, bias, tokens, levels)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight = ctx.saved_tensors
        tokens, levels = ctx.args
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and ctx.has_bias
        grad_x = grad_w = grad_b = None
        if need_x:
            grad_x = call("patch_embed", grad_y, weight, None, tokens, levels)
        if need_w:
            grad_w, grad_b = ops.patch_weight_grad(x, grad_y, list(weight.shape[2:]), tokens, levels,
                                    need_b, True)
        elif need_b:
            grad_b = bias_grad_sum(grad_y, (0, *range(2, grad_y.dim())))
        return grad_x, grad_w, grad_b if need_b else None, None, None


# swiglu and instance_norm_act run as ATen ops here: differentiable to any order (their fused
# backward kernels are not), vmap batching them natively.

def _swiglu_composite(gate_up):
    gate, up = gate_up.to(_opmath(gate_up.dtype)).chunk(2, -1)
    return (torch.nn.functional.silu(gate) * up).to(gate_up.dtype)


def _instance_norm_act_composite(x, weight, bias, eps, gelu, tokens):
    """(y, mean, rstd) as the op returns them, computed as its ATen implementation computes them
    (csrc/kernels/norm/instance_norm_aten.cpp)."""
    xf = (x.transpose(1, 2) if tokens else x.flatten(2)).to(_opmath(x.dtype))  # [B, C, N]
    mean = xf.mean(-1, keepdim=True)
    rstd = (xf.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
    z = (xf - mean) * rstd
    if weight is not None:
        z = z * weight.to(z.dtype).unsqueeze(-1)
    if bias is not None:
        z = z + bias.to(z.dtype).unsqueeze(-1)
    if gelu:
        z = torch.nn.functional.gelu(z)
    z = z.to(x.dtype)
    return (z.transpose(1, 2) if tokens else z.view(x.shape)), mean.squeeze(-1).detach(), rstd.squeeze(-1).detach()


def _opmath(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


_UNDER_TRANSFORMS = {
    "grouped_linear": GroupedLinear.apply, "ragged_grouped_linear": RaggedGroupedLinear.apply,
    "grouped_pointwise_conv": GroupedPointwiseConv.apply, "patch_embed": PatchEmbed.apply,
    "patch_unembed": PatchUnembed.apply, "swiglu": _swiglu_composite, "instance_norm_act": _instance_norm_act_composite,
}


# Each op's one overload, called directly: that skips the packet's overload resolution by argument
# matching (torch.ops.patchgemm.<name>(...)). Outside torch.compile, its C++ callable is called
# without OpOverload.__call__'s Python frame (the same call, which dynamo traces only through the
# OpOverload itself).
_OVERLOADS = {name: getattr(ops, name).default for name in _UNDER_TRANSFORMS}
_CALLABLES = {name: overload._op for name, overload in _OVERLOADS.items()}


def _whole_patches(x, weight, levels):
    """x without the positions a kernel == stride conv leaves out (a differentiable view), as the
    C++ autograd layer cuts them (csrc/ops/patch_embed.cpp: whole_patches)."""
    if levels or x.dim() != weight.dim():
        return x
    for d in range(2, x.dim()):
        size, k = x.shape[d], weight.shape[d]
        if k >= 1 and size > k and size % k:
            x = x.narrow(d, 0, size - size % k)
    return x


def call(name: str, *args):
    """``torch.ops.patchgemm.<name>(*args)``: through its C++ autograd normally, through the Python
    Function above inside a torch.func transform."""
    if active():
        if name == "patch_embed":
            args = (_whole_patches(args[0], args[1], args[4]), *args[1:])
        return _UNDER_TRANSFORMS[name](*args)
    if torch.compiler.is_compiling():
        return _OVERLOADS[name](*args)
    return _CALLABLES[name](*args)
