"""CUDA graphs: every op, forward and backward, captured and replayed on new inputs equals an eager
run on those inputs; and no path synchronizes with the host (torch.cuda.set_sync_debug_mode
"error" raises on any synchronizing call), so a captured step is the eager step."""

import subprocess
import sys

import pytest
import torch

import patchgemm
from conftest import assert_close_to_ref, capture_cuda_graph, needs_gpu, randn, syncs_forbidden

pytestmark = needs_gpu
DEV = "cuda"


def _sizes_on_gpu(sizes):
    return torch.tensor(sizes, device=DEV)


# name -> (make(dtype) -> (tensors that require grad, other inputs), call(*tensors, *others))
def _grouped_linear(layout):
    def make(dtype):
        x = randn(96, 6, 64, dtype=dtype, device=DEV) if layout == "bgd" else randn(6, 96, 64, dtype=dtype, device=DEV)
        return [x, randn(6, 80, 64, dtype=dtype, device=DEV), randn(6, 80, dtype=dtype, device=DEV)], []
    return make, lambda x, w, b: patchgemm.grouped_linear(x, w, b, layout)


def _ragged(on_gpu, fp8=False):
    sizes = [40, 0, 25, 63]

    def make(dtype):
        group_sizes = _sizes_on_gpu(sizes) if on_gpu else sizes
        return [randn(sum(sizes), 64, dtype=dtype, device=DEV), randn(4, 48, 64, dtype=dtype, device=DEV),
                randn(4, 48, dtype=dtype, device=DEV)], [group_sizes]
    return make, lambda x, w, b, group_sizes: patchgemm.grouped_linear(x, w, b, group_sizes=group_sizes, fp8=fp8)


def _pointwise(dtype):
    x = randn(4, 64, 12, 12, dtype=dtype, device=DEV).contiguous(memory_format=torch.channels_last)
    return [x, randn(96, 16, 1, 1, dtype=dtype, device=DEV), randn(96, dtype=dtype, device=DEV)], []


def _mlp(dtype):
    return [randn(32, 4, 64, dtype=dtype, device=DEV), randn(4, 2 * 48, 64, dtype=dtype, device=DEV),
            randn(4, 64, 48, dtype=dtype, device=DEV)], []


def _moe(dtype):
    tokens, top_k, experts = 96, 2, 6
    index = torch.stack([torch.randperm(experts, device=DEV)[:top_k] for _ in range(tokens)])
    return [randn(tokens, 64, dtype=dtype, device=DEV), randn(experts, 2 * 32, 64, dtype=dtype, device=DEV),
            randn(experts, 64, 32, dtype=dtype, device=DEV)], [index, torch.rand(tokens, top_k, device=DEV).to(dtype)]


def _patch(shape, kernel, embed=64):
    def make(dtype):
        return [randn(*shape, dtype=dtype, device=DEV), randn(embed, shape[1], *kernel, dtype=dtype, device=DEV),
                randn(embed, dtype=dtype, device=DEV)], []
    return make


def _unembed(grid, kernel, tokens):
    def make(dtype):
        x = randn(3, grid[0] * grid[1], 64, dtype=dtype, device=DEV) if tokens else randn(3, 64, *grid, dtype=dtype,
                                                                                          device=DEV)
        return [x, randn(64, 5, *kernel, dtype=dtype, device=DEV), randn(5, dtype=dtype, device=DEV)], []
    return make


def _norm(dtype):
    return [randn(3, 40, 6, 7, 8, dtype=dtype, device=DEV), randn(40, dtype=dtype, device=DEV),
            randn(40, dtype=dtype, device=DEV)], []


OPS = {
    "grouped_linear_bgd": _grouped_linear("bgd"),
    "grouped_linear_gbd": _grouped_linear("gbd"),
    "ragged_sizes_on_cpu": _ragged(False),
    "grouped_pointwise_conv": (_pointwise, lambda x, w, b: patchgemm.grouped_pointwise_conv(x, w, b, groups=4)),
    "swiglu": (lambda dtype: ([randn(64, 2 * 96, dtype=dtype, device=DEV)], []), patchgemm.swiglu),
    "grouped_mlp": (_mlp, patchgemm.grouped_mlp),
    "patch_embed_channels_first": (_patch((5, 3, 64, 48), (16, 16)), patchgemm.patch_embed),
    "patch_embed_tokens": (_patch((5, 3, 64, 48), (16, 16)),
                           lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format="tokens")),
    "patch_embed_3d": (_patch((2, 4, 16, 16, 16), (4, 4, 4)), patchgemm.patch_embed),
    "patch_embed_1d": (_patch((8, 2, 200), (8,)), patchgemm.patch_embed),
    "patch_unembed": (_unembed((4, 5), (4, 4), False), patchgemm.patch_unembed),
    "patch_unembed_tokens": (_unembed((4, 5), (4, 4), True),
                             lambda x, w, b: patchgemm.patch_unembed(x, w, b, in_format="tokens", grid=(4, 5))),
    "instance_norm_act": (_norm, patchgemm.instance_norm_act),
    "grouped_linear_fp8": (_grouped_linear("bgd")[0], lambda x, w, b: patchgemm.grouped_linear(x, w, b, fp8=True)),
    "ragged_fp8_sizes_on_cpu": _ragged(False, fp8=True),
    "patch_embed_fp8": (_patch((5, 3, 64, 48), (16, 16)), lambda x, w, b: patchgemm.patch_embed(x, w, b, fp8=True)),
    "patch_embed_3d_fp8": (_patch((2, 4, 16, 16, 16), (4, 4, 4)),
                           lambda x, w, b: patchgemm.patch_embed(x, w, b, out_format="tokens", fp8=True)),
    "patch_unembed_fp8": (_unembed((4, 5), (4, 4), False), lambda x, w, b: patchgemm.patch_unembed(x, w, b, fp8=True)),
}
# Ragged groups with their sizes on the GPU (moe_experts computes them there): read there by
# torch._grouped_mm (bfloat16, sm_90+) or our ragged_tiles kernel (every dtype); in FP8 by
# torch._scaled_grouped_mm (e4m3 to bfloat16, sm_90+), else the operands upcast for those.
GPU_SIZED = {"ragged_sizes_on_gpu": _ragged(True),
             "moe_experts": (_moe, lambda x, wgu, wd, index, weight: patchgemm.moe_experts(x, index, weight, wgu, wd)),
             "ragged_fp8_sizes_on_gpu": _ragged(True, fp8=True),
             "moe_experts_fp8": (_moe, lambda x, wgu, wd, index, weight: patchgemm.moe_experts(x, index, weight, wgu, wd,
                                                                                               fp8=True))}


def _step(call, params, others, grad_out):
    """Forward, then every parameter's gradient for the fixed output gradient."""
    def step():
        y = call(*params, *others)
        return (y, *torch.autograd.grad(y, params, grad_out))
    return step


def _refill(tensors):
    with torch.no_grad():
        for t in tensors:
            if t.is_floating_point():
                t.copy_(torch.randn_like(t))


def _sync_forbidden(step):
    with syncs_forbidden():
        return step()


def _check_replay(call, params, others, dtype, sync_free_eager=False):
    """`sync_free_eager`: the eager run it is checked against forbids syncs, as capture does, so that
    both run the same candidates (where groups are sized on the GPU, capture takes the sync-free
    ones, and an unrestricted eager run faster ones that read the sizes on the host)."""
    grad_out = torch.randn_like(call(*params, *others))
    step = _step(call, params, others, grad_out)
    step()  # (the choices made, the caches warm: what capture needs)
    _sync_forbidden(step)  # no host synchronization on the path
    graph, captured = capture_cuda_graph(step)
    _refill(params + [grad_out])
    graph.replay()
    eager = _sync_forbidden(step) if sync_free_eager else step()
    torch.cuda.synchronize()
    for name, got, want in zip(["y"] + [f"grad {i}" for i in range(len(params))], captured, eager):
        assert_close_to_ref(got, want, dtype, f"replayed {name}", tol=1e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("op", list(OPS))
def test_capture_replays_every_op_and_gradient(op, dtype):
    make, call = OPS[op]
    torch.manual_seed(0)
    params, others = make(dtype)
    for p in params:
        p.requires_grad_()
    _check_replay(call, params, others, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("op", list(GPU_SIZED))
def test_capture_replays_groups_sized_on_the_gpu(op, dtype):
    make, call = GPU_SIZED[op]
    params, others = make(dtype)
    for p in params:
        p.requires_grad_()
    _check_replay(call, params, others, dtype, sync_free_eager=True)


def test_a_forced_path_that_reads_gpu_sizes_on_the_host_refuses_capture():
    """Forcing a candidate that reads the group sizes on the host is a clear error under capture,
    never a graph that replays stale sizes."""
    make, call = GPU_SIZED["ragged_sizes_on_gpu"]
    params, others = make(torch.float32)
    ops = ("ragged_grouped_linear", "ragged_grouped_linear_grad_input", "ragged_grouped_linear_grad_weight")
    with patchgemm.force(**dict.fromkeys(ops, "loop")):
        call(*params, *others)
        with pytest.raises(RuntimeError, match="on the host"):
            capture_cuda_graph(lambda: call(*params, *others))


def test_hierarchical_stem_captures_a_training_step():
    stem = patchgemm.HierarchicalPatchEmbed(4, 64, (4, 2, 2), out_format="tokens").to(DEV, torch.bfloat16)
    x = randn(2, 4, 32, 32, 32, dtype=torch.bfloat16, device=DEV)
    params = list(stem.parameters())
    _check_replay(lambda x, *ps: stem(x), [x.requires_grad_()] + params, [], torch.bfloat16)


def test_delayed_fp8_layer_replays_its_history_updates():
    """A captured training step of a delayed-scaling layer records each replay's amaxes and scales by
    the history, as eager steps do: replayed over a sequence of inputs it gives the values, gradients
    and histories of its twin run eagerly over the same sequence, bit for bit."""
    torch.manual_seed(0)
    recipe = patchgemm.Float8Recipe(scaling="delayed", amax_history_len=4)
    captured = patchgemm.GroupedLinear(6, 64, 80, device=DEV, dtype=torch.bfloat16, fp8=recipe)
    twin = patchgemm.GroupedLinear(6, 64, 80, device=DEV, dtype=torch.bfloat16, fp8=recipe)
    twin.load_state_dict(captured.state_dict())
    inputs = [(randn(96, 6, 64, dtype=torch.bfloat16, device=DEV) * s, randn(96, 6, 80, dtype=torch.bfloat16,
                                                                             device=DEV) * s) for s in (1, 4, 0.5, 2, 1)]
    x, grad_y = (t.clone() for t in inputs[0])
    x.requires_grad_()

    def step(layer, x, grad_y):
        y = layer(x)
        return (y, *torch.autograd.grad(y, [x, layer.weight, layer.bias], grad_y))

    _sync_forbidden(lambda: step(captured, x, grad_y))  # no host synchronization on the path (the histories made here)
    # (the choices made; capture runs one more step on its side stream)
    graph, out = capture_cuda_graph(lambda: step(captured, x, grad_y))
    for _ in range(2):
        step(twin, inputs[0][0].clone().requires_grad_(), inputs[0][1])
    for new_x, new_grad in inputs[1:]:
        with torch.no_grad():
            x.copy_(new_x)
            grad_y.copy_(new_grad)
        graph.replay()
        want = step(twin, new_x.clone().requires_grad_(), new_grad)
        torch.cuda.synchronize()
        for got, expected in zip(out, want):
            assert torch.equal(got, expected)
        for which in ("x", "weight", "grad"):
            assert torch.equal(captured.fp8_history.amax(which), twin.fp8_history.amax(which)), which


# A fresh process: nothing has made a cuBLAS handle yet on its threads (the main one, autograd's).
FRESH_CAPTURE = """
import torch, patchgemm
sizes = [40, 0, 25, 63]
x = torch.randn(sum(sizes), 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4, 48, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
grad_y = torch.randn(sum(sizes), 48, device="cuda", dtype=torch.bfloat16)
def step():
    y = patchgemm.grouped_linear(x, w, group_sizes=sizes)
    return (y, *torch.autograd.grad(y, [x, w], grad_y))
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    want = step()
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    got = step()
graph.replay()
torch.cuda.synchronize()
print(max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want)))
"""


def test_a_capture_that_chooses_a_blas_path_no_warm_up_ran_makes_no_handle(tmp_path):
    """Ragged groups with host sizes run torch._grouped_mm eagerly (sm_90) and one cuBLAS GEMM per
    group under capture, where _grouped_mm would copy the sizes. In a process whose warm-up used no
    cuBLAS, the capture must not be the first to create a handle: that allocates, which capture
    forbids (cuBLAS fails to initialize and the capture is lost)."""
    out = subprocess.run([sys.executable, "-c", FRESH_CAPTURE], capture_output=True, text=True, timeout=300,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) < 1e-2  # bf16 roundings of two GEMM paths
