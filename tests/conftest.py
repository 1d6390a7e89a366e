import contextlib
import math
import os

import pytest
import torch

# Under pytest-xdist, each worker takes its share of the cores: torch's default (every core per
# process) oversubscribes the machine N times over and makes CPU tests minutes slower.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import patchgemm  # noqa: E402

# The suite tests each kernel where the rules (and the testing hooks, `selection` below) send a
# problem: it runs under the heuristic. The default mode's own choices: test_selection.py.
patchgemm.set_selection("heuristic")

HAS_GPU = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_GPU else [])
DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

# ||out - ref|| / ||ref|| against a float64 reference, per dtype of the computation.
REL_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}

needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA/ROCm GPU")


@pytest.fixture(autouse=True)
def _strict_fp32():
    """fp32 means IEEE fp32 in tests (TF32 only where a test asks for it)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False):
    """Fresh random data (never zeros), made in float64 so every dtype sees the same values."""
    t = torch.randn(*shape, dtype=torch.float64).to(device=device, dtype=dtype)
    return t.requires_grad_(requires_grad)


def assert_close_to_ref(out, ref, dtype, what="output", tol=None, magnitude=None):
    """`out` (computed in `dtype`) against a float64 reference: shape, finiteness, relative error
    (at most `tol`, by default REL_TOL[dtype]), relative to ||ref|| or, where given, to ||magnitude||:
    for a sum, the sum of its terms' absolute values, which cancellation cannot shrink (a bias
    gradient of one channel may sum 2048 values to near zero: its rounding error is the terms')."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    out64 = out.detach().double().cpu()
    ref64 = ref.detach().double().cpu()
    assert torch.isfinite(out64).all(), f"{what}: non-finite values (unwritten output?)"
    denom = ref64.norm().item() if magnitude is None else magnitude.detach().double().cpu().norm().item()
    err = (out64 - ref64).norm().item()
    tol = REL_TOL[dtype] if tol is None else tol
    assert err <= tol * max(denom, 1e-30) or (denom == 0 and err == 0), (
        f"{what}: relative error {err / max(denom, 1e-30):.3g} > {tol:g} ({dtype})")


def rel_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 on ref's device (a GPU reference stays there); inf for a shape
    mismatch or non-finite values; the absolute error where ref is zero."""
    if out.shape != ref.shape:
        return math.inf
    ref = ref.detach().double()
    err = (out.detach().to(ref.device, torch.float64) - ref).norm().item()
    if not math.isfinite(err):
        return math.inf
    denom = ref.norm().item()
    return err / denom if denom > 0 else err


def capture_cuda_graph(step):
    """(graph, what step returned while captured): step runs once on a side stream first, as graph
    capture requires (kernels set up, memory cached); replay the graph to run it again."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@contextlib.contextmanager
def syncs_forbidden():
    """Any host synchronization inside raises (torch.cuda.set_sync_debug_mode "error"): a path that
    must not wait for the GPU (capture, sizes read on the device) is checked by running it here."""
    torch.cuda.synchronize()  # (so that work queued before is not blamed on the block)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def poison_allocator(nbytes, device):
    """Fill, then free, a block of the size the next output will take, so an op that forgets to
    write part of its output returns NaNs instead of lucky zeros (caching allocators reuse it)."""
    if nbytes > 0:
        torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device=device)


# The fused CUDA kernels' candidate names (selection tables), and those of them on Hopper's wgmma.
FUSED = ("narrow", "tiny", "implicit_rows_sm90", "implicit_pairs_sm90", "implicit_sm90", "implicit_mma")
WGMMA = ("implicit_rows_sm90", "implicit_pairs_sm90", "implicit_sm90")


@contextlib.contextmanager
def selection(rules=True, exclude=()):
    """The default choice with or without its rules (without: the first candidate that applies runs,
    as a kernel's tests need on small shapes), and without the candidates named in `exclude`."""
    import patchgemm

    known = {c.name for c in patchgemm.kernels()}
    torch.ops.patchgemm._set_selection_testing(rules, [n for n in exclude if n in known])
    try:
        yield
    finally:
        torch.ops.patchgemm._set_selection_testing(True, [])


def fused_mode(mode):
    """"never": no fused kernel (gather / scatter + GEMM); "always": a fused kernel wherever one
    applies; "auto": the default choice."""
    return {"never": lambda: selection(exclude=FUSED), "always": lambda: selection(rules=False),
            "auto": selection}[mode]()


@pytest.fixture
def fused_always():
    """The fused kernels wherever they apply (their rule would send these small shapes to cuBLAS)."""
    with fused_mode("always"):
        yield


def wgmma_built():
    """Whether the implicit forward's Hopper kernel (implicit_patch_gemm_sm90.cu) runs here: a 9.0 GPU
    and a build with sm_90a code."""
    return torch.cuda.get_device_capability() == (9, 0) and any(
        a.startswith("9.0a") for a in torch.ops.patchgemm.build_info()[1].split(";"))


@pytest.fixture(params=[True, False], ids=["wgmma", "mma_sync"])
def implicit_wgmma(request):
    """Whether the implicit kernels may take their Hopper (wgmma) candidates, rules off as
    fused_always; returns whether they should run here."""
    with selection(rules=False, exclude=() if request.param else WGMMA):
        yield request.param and wgmma_built()


# The references: F.conv{1,2,3}d (and the transpose) with stride = kernel, written as one float64
# matmul between views, which runs at BLAS speed on the CPU (test_references_are_the_convs).
def split_spatial(x, kernel):
    """[B, C, *S] -> [B, C, g1, k1, ..., gr, kr] (a view)."""
    shape = list(x.shape[:2])
    for s, k in zip(x.shape[2:], kernel):
        shape += [s // k, k]
    return x.reshape(shape)


def conv_ref(x, w, b, kernel):
    rank = len(kernel)
    v = split_spatial(x, kernel)  # [B, C, g1, k1, ...]
    grid = v.shape[2::2]
    order = [0] + [2 + 2 * d for d in range(rank)] + [1] + [3 + 2 * d for d in range(rank)]
    p = v.permute(order).reshape(x.shape[0], math.prod(grid), -1)  # [B, N, C * prod(k)]
    y = p @ w.reshape(w.shape[0], -1).T + (b if b is not None else 0)  # [B, N, E]
    return y.transpose(1, 2).reshape(x.shape[0], w.shape[0], *grid)


def conv_transpose_ref(x, w, b, kernel):
    rank, (B, c_in), grid = len(kernel), x.shape[:2], x.shape[2:]
    q = x.reshape(B, c_in, -1).transpose(1, 2) @ w.reshape(c_in, -1)  # [B, N, C_out * prod(k)]
    c_out = w.shape[1]
    v = q.reshape(B, *grid, c_out, *kernel)
    order = [0, rank + 1] + [i for d in range(rank) for i in (1 + d, rank + 2 + d)]
    y = v.permute(order).reshape(B, c_out, *[g * k for g, k in zip(grid, kernel)])
    return y + b.view(1, -1, *[1] * rank) if b is not None else y
