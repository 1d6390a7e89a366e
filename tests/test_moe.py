"""moe_experts and MoEExperts: values and gradients against a float64 loop over tokens, slots with no
expert, autocast, torch.compile, bad input; convert() on transformers' mixture-of-experts models
(skipped where transformers is not installed)."""

import pytest
import torch
import torch.nn.functional as F

import patchgemm
from conftest import DEVICES, DTYPES, assert_close_to_ref, capture_cuda_graph, needs_gpu, randn, syncs_forbidden


def experts_reference(x, index, weight, w_gate_up, w_down, dtype=torch.float64):
    """Token by token, slot by slot, on the CPU in `dtype` (float64: the reference; 16-bit: what
    PyTorch's own ops give in that dtype): the chosen expert's SwiGLU MLP, weighted and summed
    (index E: no expert). Differentiable."""
    x, weight, w_gate_up, w_down = (t.to(dtype).cpu() for t in (x, weight, w_gate_up, w_down))
    experts, hidden = w_gate_up.shape[0], w_down.shape[2]
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros(x.shape[1], dtype=dtype)
        for j in range(index.shape[1]):
            e = int(index[t, j])
            if e == experts:
                continue
            gate_up = w_gate_up[e] @ x[t]
            row = row + weight[t, j] * (w_down[e] @ (F.silu(gate_up[:hidden]) * gate_up[hidden:]))
        rows.append(row)
    return torch.stack(rows) if rows else torch.zeros(0, x.shape[1], dtype=dtype)


def problem(tokens, top_k, experts, dim, hidden, dtype, device, no_expert=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, experts + (1 if no_expert else 0), (tokens, top_k), generator=gen)
    return (randn(tokens, dim, dtype=dtype, device=device, requires_grad=True), index.to(device),
            torch.rand(tokens, top_k, generator=gen).to(device=device, dtype=dtype).requires_grad_(),
            (randn(experts, 2 * hidden, dim, dtype=dtype, device=device) / dim ** 0.5).requires_grad_(),
            (randn(experts, dim, hidden, dtype=dtype, device=device) / hidden ** 0.5).requires_grad_())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sizes", [(9, 2, 4, 16, 24), (17, 3, 8, 32, 8), (5, 1, 1, 8, 16), (6, 4, 3, 16, 16)])
def test_values_and_gradients_match_float64(device, dtype, sizes):
    x, index, weight, w_gate_up, w_down = problem(*sizes, dtype, device)
    y = patchgemm.moe_experts(x, index, weight, w_gate_up, w_down)
    grad_y = randn(*y.shape, dtype=dtype, device=device)
    grads = torch.autograd.grad(y, (x, weight, w_gate_up, w_down), grad_y)
    inputs = [t.detach().double().cpu().requires_grad_() for t in (x, weight, w_gate_up, w_down)]
    ref = experts_reference(inputs[0], index.cpu(), *inputs[1:])
    ref_grads = torch.autograd.grad(ref, inputs, grad_y.double().cpu())
    # Three roundings in a row (gate_up, SwiGLU, down): in 16 bits the bound is twice the error of
    # the same loop in PyTorch's ops in that dtype, where that is above the usual tolerance.
    low = [t.detach().to(dtype).cpu().requires_grad_() for t in (x, weight, w_gate_up, w_down)]
    low_y = experts_reference(low[0], index.cpu(), *low[1:], dtype=dtype)
    low_grads = torch.autograd.grad(low_y, low, grad_y.cpu())

    def tol(got, want):
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        err = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
        return max(2 * err.item(), {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype])

    assert y.dtype == dtype and y.device == x.device
    assert_close_to_ref(y, ref, dtype, "y", tol(low_y, ref))
    for name, g, r, lg in zip(("x", "expert_weight", "w_gate_up", "w_down"), grads, ref_grads, low_grads):
        assert_close_to_ref(g, r, dtype, f"grad {name}", tol(lg, r))


@pytest.mark.parametrize("device", DEVICES)
def test_a_slot_with_no_expert_adds_nothing(device):
    x, index, weight, w_gate_up, w_down = problem(12, 3, 4, 16, 8, torch.float32, device, no_expert=True, seed=3)
    index[0] = 4  # a token with no expert at all: zeros
    assert (index == 4).sum() > 3
    y = patchgemm.moe_experts(x, index, weight, w_gate_up, w_down)
    grads = torch.autograd.grad(y.sum(), (x, weight, w_gate_up, w_down))
    inputs = [t.detach().double().cpu().requires_grad_() for t in (x, weight, w_gate_up, w_down)]
    ref = experts_reference(inputs[0], index.cpu(), *inputs[1:])
    ref_grads = torch.autograd.grad(ref.sum(), inputs)
    assert_close_to_ref(y, ref, torch.float32, "y")
    assert torch.equal(y[0], torch.zeros_like(y[0]))
    for g, r in zip(grads, ref_grads):
        assert_close_to_ref(g, r, torch.float32, "grad")


def test_gradcheck():
    x, index, weight, w_gate_up, w_down = problem(5, 2, 3, 4, 3, torch.float64, "cpu", no_expert=True, seed=1)
    assert torch.autograd.gradcheck(lambda *t: patchgemm.moe_experts(t[0], index, *t[1:]),
                                    (x, weight, w_gate_up, w_down))


def test_torch_func_grad_matches_autograd():
    x, index, weight, w_gate_up, w_down = problem(7, 2, 3, 8, 4, torch.float64, "cpu", seed=2)

    def loss(x, w_gate_up, w_down):
        return patchgemm.moe_experts(x, index, weight, w_gate_up, w_down).pow(2).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(x, w_gate_up, w_down)
    want = torch.autograd.grad(loss(x, w_gate_up, w_down), (x, w_gate_up, w_down))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # per-sample gradients: vmap over grad
    xs = torch.stack([x.detach(), 2 * x.detach()])
    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=2), in_dims=(0, None, None))(xs, w_gate_up, w_down)
    for i in range(2):
        torch.testing.assert_close(per_sample[i], torch.autograd.grad(loss(xs[i], w_gate_up, w_down), w_down)[0])


def test_no_tokens():
    x, index, weight, w_gate_up, w_down = problem(0, 2, 3, 8, 4, torch.float32, "cpu")
    y = patchgemm.moe_experts(x, index, weight, w_gate_up, w_down)
    assert y.shape == (0, 8)
    y.sum().backward()
    assert w_gate_up.grad is not None and torch.equal(w_gate_up.grad, torch.zeros_like(w_gate_up))


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_runs_the_experts_in_the_autocast_dtype_and_returns_x_dtype(device):
    # As nn.Linear under autocast: the GEMMs in bfloat16; the result in x's dtype, as transformers' experts.
    x, index, weight, w_gate_up, w_down = problem(16, 2, 4, 32, 16, torch.float32, device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = patchgemm.moe_experts(x, index, weight, w_gate_up, w_down)
        with patchgemm.explain() as e:
            patchgemm.moe_experts(x, index, weight, w_gate_up, w_down)
    assert y.dtype == torch.float32
    assert "BFloat16" in str(e) and "Float[" not in str(e)
    ref = experts_reference(x, index.cpu(), weight, w_gate_up, w_down)
    assert_close_to_ref(y, ref, torch.bfloat16, "y")


def test_compiles_fullgraph():
    x, index, weight, w_gate_up, w_down = problem(10, 2, 4, 16, 8, torch.float32, "cpu", no_expert=True)
    compiled = torch.compile(patchgemm.moe_experts, fullgraph=True, backend="aot_eager")
    y = compiled(x, index, weight, w_gate_up, w_down)
    y.sum().backward()
    assert_close_to_ref(y, experts_reference(x, index, weight, w_gate_up, w_down), torch.float32, "y")
    assert w_down.grad is not None


def _needs_grouped_mm():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("torch._grouped_mm's CUDA path needs sm_90")


@needs_gpu
def test_cuda_no_host_sync_forward_and_backward():
    """The offsets are found on the device and torch._grouped_mm reads them there: a training step
    of the experts never waits for the GPU."""
    _needs_grouped_mm()
    x, index, weight, w_gate_up, w_down = problem(256, 4, 8, 64, 32, torch.bfloat16, "cuda", no_expert=True)
    patchgemm.moe_experts(x, index, weight, w_gate_up, w_down).sum().backward()  # warm up
    with syncs_forbidden():
        y = patchgemm.moe_experts(x, index, weight, w_gate_up, w_down)
        grads = torch.autograd.grad(y.sum(), (x, weight, w_gate_up, w_down))
    inputs = [t.detach().double().cpu().requires_grad_() for t in (x, weight, w_gate_up, w_down)]
    ref = experts_reference(inputs[0], index.cpu(), *inputs[1:])
    assert_close_to_ref(y, ref, torch.bfloat16, "y")
    for g, r in zip(grads, torch.autograd.grad(ref.sum(), inputs)):
        assert_close_to_ref(g, r, torch.bfloat16, "grad")


@needs_gpu
def test_cuda_graph_capture_and_replay():
    _needs_grouped_mm()
    x, index, weight, w_gate_up, w_down = problem(128, 2, 8, 64, 32, torch.bfloat16, "cuda")
    params = (x, weight, w_gate_up, w_down)

    def step():
        y = patchgemm.moe_experts(x, index, weight, w_gate_up, w_down)
        return (y, *torch.autograd.grad(y.float().pow(2).sum(), params))

    graph, outs = capture_cuda_graph(step)
    with torch.no_grad():  # new tokens and a new routing, replayed
        x.copy_(torch.randn_like(x))
        index.copy_(torch.randint(0, 8, index.shape, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    inputs = [t.detach().double().cpu().requires_grad_() for t in params]
    ref = experts_reference(inputs[0], index.cpu(), *inputs[1:])
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), inputs)
    assert_close_to_ref(outs[0], ref, torch.bfloat16, "y")
    for g, r in zip(outs[1:], ref_grads):
        assert_close_to_ref(g, r, torch.bfloat16, "grad")


@needs_gpu
def test_cuda_inductor_compiles_a_training_step():
    x, index, weight, w_gate_up, w_down = problem(64, 2, 4, 64, 32, torch.bfloat16, "cuda")
    compiled = torch.compile(patchgemm.moe_experts, fullgraph=True)
    y = compiled(x, index, weight, w_gate_up, w_down)
    grads = torch.autograd.grad(y.float().sum(), (x, w_gate_up, w_down))
    inputs = [t.detach().double().cpu().requires_grad_() for t in (x, weight, w_gate_up, w_down)]
    ref = experts_reference(inputs[0], index.cpu(), *inputs[1:])
    ref_grads = torch.autograd.grad(ref.sum(), [inputs[0], inputs[2], inputs[3]])
    assert_close_to_ref(y, ref, torch.bfloat16, "y")
    for g, r in zip(grads, ref_grads):
        assert_close_to_ref(g, r, torch.bfloat16, "grad")


def test_bad_input_names_the_argument():
    x, index, weight, w_gate_up, w_down = problem(4, 2, 3, 8, 4, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=r"x must be \[T, D\] with D = 8"):
        patchgemm.moe_experts(x[:, :6], index, weight, w_gate_up, w_down)
    with pytest.raises(RuntimeError, match="expert_index must be"):
        patchgemm.moe_experts(x, index.float(), weight, w_gate_up, w_down)
    with pytest.raises(RuntimeError, match="expert_index must be"):
        patchgemm.moe_experts(x, index[:3], weight, w_gate_up, w_down)
    with pytest.raises(RuntimeError, match="expert_weight must have expert_index's shape"):
        patchgemm.moe_experts(x, index, weight[:, :1], w_gate_up, w_down)
    with pytest.raises(RuntimeError, match=r"w_gate_up must be \[E, 2H, D\]"):
        patchgemm.moe_experts(x, index, weight, w_gate_up, w_down[:, :, :3])
    with pytest.raises(TypeError, match="w_down must be a tensor"):
        patchgemm.moe_experts(x, index, weight, w_gate_up, None)
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        patchgemm.MoEExperts(0, 8, 4)


def test_module():
    torch.manual_seed(0)
    m = patchgemm.MoEExperts(4, 16, 8)
    assert list(m.state_dict()) == ["gate_up_proj", "down_proj"]
    assert m.gate_up_proj.shape == (4, 16, 16) and m.down_proj.shape == (4, 16, 8)
    assert "num_experts=4, dim=16, hidden=8" in repr(m)
    x, index, weight, *_ = problem(6, 2, 4, 16, 8, torch.float32, "cpu")
    ref = experts_reference(x, index, weight, m.gate_up_proj, m.down_proj)
    assert_close_to_ref(m(x, index, weight), ref, torch.float32)
    with pytest.raises(ValueError, match="not a transformers module"):
        patchgemm.MoEExperts.from_experts(torch.nn.Linear(2, 2))


# ---- transformers' mixture-of-experts models -----------------------------------------------------

def _moe_model(family, **sizes):
    transformers = pytest.importorskip("transformers")
    config = getattr(transformers, f"{family}Config")(**sizes)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}Model")(config).double()
    model.set_experts_implementation("eager")  # (transformers' grouped_mm path takes no float64)
    return model


MOE_MODELS = {
    "Mixtral": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64),
    "Olmoe": dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=8, num_experts_per_tok=3, vocab_size=64, eos_token_id=None,
                  pad_token_id=None),
    "Qwen3Moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                     vocab_size=64),
    "Qwen2Moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=32,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                     num_experts_per_tok=2, vocab_size=64),
    "DeepseekV3": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                       n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
                       qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, vocab_size=64, n_group=2, topk_group=1),
    "Glm4Moe": dict(hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                    first_k_dense_replace=0, vocab_size=64, head_dim=8),
}


def _assert_same_model_function(got, model, want, reference):
    """`got` (from `model`) against `want` (from `reference`, whose parameters have the same names),
    then every parameter's gradient of the sum of squares, in float64."""
    assert_close_to_ref(got, want, torch.float64, "output")
    want.pow(2).sum().backward()
    got.pow(2).sum().backward()
    original = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        if original[name].grad is not None:
            assert_close_to_ref(p.grad, original[name].grad, torch.float64, f"grad {name}")


@pytest.mark.parametrize("family", sorted(MOE_MODELS))
def test_convert_transformers_moe_models(family):
    model = _moe_model(family, **MOE_MODELS[family])
    report = patchgemm.convert(model, inplace=False)
    converted = report.model
    experts = [name for name, m in converted.named_modules() if isinstance(m, patchgemm.MoEExperts)]
    assert experts == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert [what for name, what in report.swapped if name in experts] == [
        f"{type(model.layers[0].mlp.experts).__name__} -> MoEExperts"] * 2
    assert list(converted.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 64, (2, 7))
    _assert_same_model_function(converted(input_ids=ids).last_hidden_state, converted,
                                model(input_ids=ids).last_hidden_state, model)
    # The state_dict loads back into the original's class.
    model.load_state_dict(converted.state_dict())


def test_convert_leaves_experts_of_another_layout():
    gpt_oss = _moe_model("GptOss", hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=64, head_dim=8)
    report = patchgemm.convert(gpt_oss)
    assert not any(isinstance(m, patchgemm.MoEExperts) for m in gpt_oss.modules())
    assert [why for name, why in report.skipped if name == "layers.0.mlp.experts"] == [
        "experts: its layout (has_bias=True, is_transposed=True, is_concatenated=False) is not the SwiGLU experts layout"]
    model = _moe_model("Mixtral", **dict(MOE_MODELS["Mixtral"], hidden_act="gelu"))
    report = patchgemm.convert(model)
    assert not any(isinstance(m, patchgemm.MoEExperts) for m in model.modules())
    assert ("layers.0.mlp.experts", "experts: its activation is not SiLU") in report.skipped
    model = _moe_model("Mixtral", **MOE_MODELS["Mixtral"])
    model.layers[0].mlp.experts.is_transposed = True
    report = patchgemm.convert(model)
    assert ("layers.0.mlp.experts", "experts: its layout (is_transposed=True) is not the SwiGLU experts layout") \
        in report.skipped
    assert isinstance(model.layers[1].mlp.experts, patchgemm.MoEExperts)


@pytest.mark.parametrize("family", ["Mixtral", "Olmoe", "Qwen3Moe"])
def test_compile_selects_the_patchgemm_experts_implementation(family):
    """patchgemm.compile routes transformers' experts through moe_experts by transformers' own
    switch (ExpertsInterface): the module tree, the parameters and the state_dict stay; the report
    names each experts module; forward and gradients match the eager loop in float64."""
    model = _moe_model(family, **MOE_MODELS[family])
    reference = _moe_model(family, **MOE_MODELS[family])  # same seed: the same weights
    keys = list(model.state_dict())
    compiled = patchgemm.compile(model, backend="aot_eager")
    experts = ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert [where for where, what in compiled.patchgemm_report.rewritten if "experts" in what] == experts
    assert model.config._experts_implementation == "patchgemm"
    assert not any(isinstance(m, patchgemm.MoEExperts) for m in model.modules()) and list(model.state_dict()) == keys
    ids = torch.randint(0, 64, (2, 7))
    with patchgemm.explain() as calls:
        got = compiled(input_ids=ids).last_hidden_state
    assert any(call.startswith("moe_experts") or "ragged_grouped_linear" in call for call in map(str, calls))
    _assert_same_model_function(got, model, reference(input_ids=ids).last_hidden_state, reference)
    model.set_experts_implementation("eager")  # the model's own switch takes it back
    assert model.config._experts_implementation == "eager"


def test_patchgemm_experts_implementation_keeps_delayed_fp8_histories():
    """Under a delayed FP8 recipe, transformers' experts run through moe_experts with two amax
    histories kept on each experts module (outside its state_dict), as MoEExperts keeps its own."""
    model = _moe_model("Mixtral", **MOE_MODELS["Mixtral"]).float()
    keys = list(model.state_dict())
    compiled = patchgemm.compile(model, backend="aot_eager")
    with patchgemm.fp8_autocast(recipe=patchgemm.Float8Recipe(scaling="delayed"), everywhere=True):
        out = compiled(input_ids=torch.randint(0, 64, (2, 7))).last_hidden_state
    out.square().sum().backward()
    experts = model.layers[0].mlp.experts
    gate_up, down = experts.__dict__["_patchgemm_fp8_histories"]
    assert gate_up.amax("weight")[0] == experts.gate_up_proj.detach().abs().max()
    assert down.amax("x")[0] > 0 and list(model.state_dict()) == keys


def test_patchgemm_experts_implementation_refuses_another_layout():
    """Selected by hand on experts moe_experts does not compute, the implementation raises, naming
    why; compile leaves such a model's switch alone and reports each module it left."""
    model = _moe_model("Mixtral", **dict(MOE_MODELS["Mixtral"], hidden_act="gelu"))
    compiled = patchgemm.compile(model, backend="aot_eager")
    assert model.config._experts_implementation == "eager"
    assert ("layers.0.mlp.experts", "experts: its activation is not SiLU") in compiled.patchgemm_report.left
    assert patchgemm.nn.register_transformers_experts()
    model.set_experts_implementation("patchgemm")
    with pytest.raises(ValueError, match="experts_implementation='patchgemm' cannot compute MixtralExperts: its activation is not SiLU"):
        model(input_ids=torch.randint(0, 64, (1, 3)))


def test_model_bench_runs_a_moe_language_model_on_the_cpu(tmp_path):
    """`python -m patchgemm bench --models` on a tiny OLMoE: token ids in, both forms, the experts
    swapped, and the JSON written."""
    pytest.importorskip("transformers")
    import json

    from patchgemm.tools import model_bench

    path = tmp_path / "models.json"
    assert model_bench.main(["OLMoE-S"], device="cpu", json_path=str(path), tiny=True) == 0
    rows = json.loads(path.read_text())["models"]
    assert [r["form"] for r in rows] == ["original", "converted"]
    assert rows[1]["note"].startswith("1 swapped; output rel. diff ")
    assert float(rows[1]["note"].split("diff ")[1]) < 2e-2
