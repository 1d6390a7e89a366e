"""`python -m patchgemm bench --models`: a training step of real models, original and converted, in one run.

A step is forward + backward under bf16 autocast (loss: the mean of the output; no optimizer). Per
model and form it reports the GPU time per step (the profiler's sum of kernel, copy and memset
times, so host gaps do not count), the wall time per step (steps issued back to back, the host
included; the forms of a model take turns, round by round, so drift in the host's speed does not
favour one), the peak memory a step allocates (activations, gradients, workspace: above the weights
held before it), and the ratios original / converted. The wall time is the fastest round's: a
busy host's interruptions (other processes, clock changes) only ever add time, so the fastest
round is the one nearest the step's own cost, and its ratio repeats across runs better than a
median of rounds does. The garbage collector is off while rounds run, as `timeit` does. Models
are built from their libraries' configs with random weights (nothing is downloaded); a model
whose library is missing is skipped with a line saying so.
"""

import copy
import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .bench import kernel_ms
from ..nn import convert


# ---- a MATEY-style 3-D model ----------------------------------------------------------------------

class LinearPatchStage(nn.Module):
    """One stage of a patch stem as MATEY's ``use_linear`` writes it: the kernel == stride patches
    copied out by a reshape and a permute, then an ``nn.Linear``. Channels-first in and out."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, transposed: bool = False):
        super().__init__()
        self.kernel, self.out_channels, self.transposed = kernel, out_channels, transposed
        patch = kernel ** 3
        self.linear = (nn.Linear(in_channels, out_channels * patch, bias=False) if transposed
                       else nn.Linear(in_channels * patch, out_channels, bias=False))

    def forward(self, x):
        b, c, d, h, w = x.shape
        k = self.kernel
        if self.transposed:  # [B, C, D, H, W] -> [B, C_out, D k, H k, W k]
            y = self.linear(x.permute(0, 2, 3, 4, 1)).reshape(b, d, h, w, k, k, k, self.out_channels)
            return y.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(b, self.out_channels, d * k, h * k, w * k)
        patches = x.reshape(b, c, d // k, k, h // k, k, w // k, k).permute(0, 2, 4, 6, 3, 5, 7, 1)
        y = self.linear(patches.reshape(b, d // k, h // k, w // k, k * k * k * c))
        return y.permute(0, 4, 1, 2, 3)


class MateyStyle3d(nn.Module):
    """The 3-D physics model of MATEY's shape: an hMLP stem (Conv3d k4 -> InstanceNorm -> GELU ->
    Conv3d k2 -> ... -> Conv3d k2 -> InstanceNorm), transformer blocks over the tokens, and an hMLP
    output (ConvTranspose3d k2 -> InstanceNorm -> GELU -> ... -> ConvTranspose3d k4).
    ``stem="conv"`` writes the stages as convs, ``"linear"`` as MATEY's use_linear rewrite."""

    def __init__(self, channels: int = 4, dim: int = 768, hidden: int = 192, depth: int = 4, heads: int = 12,
                 stem: str = "conv", trailing_norm: bool = True):
        super().__init__()
        if stem not in ("conv", "linear"):
            raise ValueError(f"MateyStyle3d: stem must be 'conv' or 'linear', got {stem!r}")
        linear = stem == "linear"

        def down(cin, cout, k):
            return LinearPatchStage(cin, cout, k) if linear else nn.Conv3d(cin, cout, k, k, bias=False)

        def up(cin, cout, k):
            return LinearPatchStage(cin, cout, k, True) if linear else nn.ConvTranspose3d(cin, cout, k, k, bias=False)

        def norm(c):
            return nn.InstanceNorm3d(c, affine=True)

        self.embed = nn.Sequential(down(channels, hidden, 4), norm(hidden), nn.GELU(), down(hidden, hidden, 2),
                                   norm(hidden), nn.GELU(), down(hidden, dim, 2), *([norm(dim)] if trailing_norm else []))
        self.blocks = nn.Sequential(*[nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                                                 batch_first=True, norm_first=True)
                                      for _ in range(depth)])
        self.debed = nn.Sequential(up(dim, hidden, 2), norm(hidden), nn.GELU(), up(hidden, hidden, 2), norm(hidden),
                                   nn.GELU(), up(hidden, channels, 4))

    def forward(self, x):
        t = self.embed(x)
        grid = t.shape[2:]
        t = self.blocks(t.flatten(2).transpose(1, 2))
        return self.debed(t.transpose(1, 2).reshape(t.shape[0], t.shape[2], *grid))


# ---- the models -----------------------------------------------------------------------------------

@dataclass
class ModelSpec:
    name: str
    library: Optional[str]          # the package it needs (None: torch alone)
    build: Callable[[], nn.Module]
    input_shape: Sequence[int]
    forms: Sequence[str] = ("original", "converted")
    channels_last: bool = False     # the model and its input in channels_last (as CNNs are often trained)
    token_ids: int = 0              # > 0: the input is token ids below this (a language model), not randn
    weights: torch.dtype = torch.float32  # the parameters' dtype (the step runs under bf16 autocast either way)


def _timm(name: str) -> Callable[[], nn.Module]:
    def build():
        import timm
        return timm.create_model(name, pretrained=False)
    return build


def _videomae() -> nn.Module:
    from transformers import VideoMAEConfig, VideoMAEModel
    config = VideoMAEConfig(image_size=224, num_frames=16, tubelet_size=2, hidden_size=384, num_hidden_layers=12,
                            num_attention_heads=6, intermediate_size=1536)
    return VideoMAEModel(config)


def _moe(family: str, **sizes) -> Callable[[], nn.Module]:
    """A transformers mixture-of-experts language model (no head) of the family's config."""
    def build():
        import transformers
        config = getattr(transformers, f"{family}Config")(**sizes)
        return getattr(transformers, f"{family}Model")(config)
    return build


_mixtral = _moe("Mixtral", hidden_size=1024, intermediate_size=3584, num_hidden_layers=4, num_attention_heads=16,
                num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000)
_olmoe = _moe("Olmoe", hidden_size=2048, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=16,
              num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304)


def specs(tiny: bool = False) -> List[ModelSpec]:
    """The benchmark's models; ``tiny``: small sizes for a CPU smoke run."""
    if tiny:
        return [ModelSpec("MATEY-3D", None, lambda: MateyStyle3d(2, 64, 16, 1, 4), (1, 2, 32, 32, 32),
                          ("conv", "use_linear", "converted")),
                ModelSpec("OLMoE-S", "transformers", _moe("Olmoe", hidden_size=32, intermediate_size=16,
                                                          num_hidden_layers=1, num_attention_heads=4, num_experts=8,
                                                          num_experts_per_tok=2, vocab_size=64, eos_token_id=None,
                                                          pad_token_id=None), (2, 16), token_ids=64)]
    return [
        ModelSpec("ViT-B/16", "timm", _timm("vit_base_patch16_224"), (128, 3, 224, 224)),
        ModelSpec("ViT-L/14", "timm", _timm("vit_large_patch14_clip_224"), (32, 3, 224, 224)),
        ModelSpec("ConvNeXt-T", "timm", _timm("convnext_tiny"), (64, 3, 224, 224)),
        ModelSpec("ConvNeXt-CL", "timm", _timm("convnext_tiny"), (64, 3, 224, 224), channels_last=True),
        ModelSpec("Swin-T", "timm", _timm("swin_tiny_patch4_window7_224"), (64, 3, 224, 224)),
        ModelSpec("VideoMAE-S", "transformers", _videomae, (8, 16, 3, 224, 224)),
        ModelSpec("MATEY-3D", None, MateyStyle3d, (8, 4, 128, 128, 128), ("conv", "use_linear", "converted")),
        # Mixtures of experts, four layers, 4096 tokens: Mixtral's 8 wide experts (top 2), OLMoE's and
        # Qwen3-MoE's many narrow ones (top 8). Float32 weights, as mixed-precision training keeps them
        # (transformers' grouped_mm experts then run float32 GEMMs: torch._grouped_mm has no autocast
        # rule), and bfloat16 weights (-bf16).
        ModelSpec("Mixtral-S", "transformers", _mixtral, (8, 512), token_ids=32000),
        ModelSpec("Mixtral-S-bf16", "transformers", _mixtral, (8, 512), token_ids=32000, weights=torch.bfloat16),
        ModelSpec("OLMoE-S", "transformers", _olmoe, (4, 1024), token_ids=50304),
        ModelSpec("OLMoE-S-bf16", "transformers", _olmoe, (4, 1024), token_ids=50304, weights=torch.bfloat16),
        ModelSpec("Qwen3-MoE-S", "transformers", _moe("Qwen3Moe", hidden_size=2048, intermediate_size=6144,
                                                      moe_intermediate_size=768, num_hidden_layers=4,
                                                      num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                                      num_experts=128, num_experts_per_tok=8, vocab_size=151936),
                  (4, 1024), token_ids=151936),
    ]


# --compile: each model compiled three ways (the original, the model convert() returns, and the
# original through patchgemm's compiler integration), each without and with CUDA graphs ("-cg":
# mode="reduce-overhead"); the first is the base of the ratios.
COMPILE_FORMS = ("compile", "compile-cg", "convert+compile", "convert+compile-cg", "patchgemm.compile",
                 "patchgemm.compile-cg")


def _compiled(form: str, original: nn.Module) -> Tuple[nn.Module, str]:
    """A compile form of the model, and what the form's report says."""
    from ..compiler import compile as patchgemm_compile

    name, graphs = (form[:-3], True) if form.endswith("-cg") else (form, False)
    mode = "reduce-overhead" if graphs else None
    if name == "compile":
        return torch.compile(original, mode=mode), ""
    if name == "convert+compile":
        report = convert(original, inplace=False)
        return torch.compile(report.model, mode=mode), f"{len(report.swapped)} swapped"
    # (a copy: the integration may switch a transformers model's experts implementation, the model's
    # own setting, which the other forms of the original must not see)
    return patchgemm_compile(copy.deepcopy(original), mode=mode), ""


def _make(form: str, original: nn.Module) -> nn.Module:
    if form in ("original", "conv"):
        return original
    # use_linear: the same stem and output written as reshapes + nn.Linear (random weights of its own)
    conv = original
    return MateyStyle3d(conv.embed[0].in_channels, conv.blocks[0].linear1.in_features, conv.embed[0].out_channels,
                        len(conv.blocks), conv.blocks[0].self_attn.num_heads, stem="linear",
                        trailing_norm=len(conv.embed) == 8).to(next(conv.parameters()).device)


def _output(out) -> torch.Tensor:
    """The tensor a model returns (a ModelOutput's first field, a tuple's first element)."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "to_tuple"):
        return out.to_tuple()[0]
    return out[0]


# ---- measuring ------------------------------------------------------------------------------------

@dataclass
class ModelRow:
    model: str
    form: str
    gpu_ms: Optional[float]   # sum of the step's kernel times (on the CPU: its median time)
    wall_ms: Optional[float]  # wall time per step, steps back to back: the fastest round's
    peak_mb: Optional[float]  # peak memory a step allocates above what the model held before it
    vs_original_gpu: Optional[float] = None   # the original form's gpu_ms / this form's
    vs_original_wall: Optional[float] = None  # the original form's wall_ms / this form's
    # The median over rounds of the original form's wall time / this form's in the same round: the
    # ratio of times taken moments apart, which a host whose speed drifts between rounds moves less.
    vs_original_wall_paired: Optional[float] = None
    wall_rounds: List[float] = field(default_factory=list)  # wall ms per step, round by round
    note: str = ""


def paired_wall_ratio(base: ModelRow, row: ModelRow) -> Optional[float]:
    """The median over rounds of base's wall time / row's in the same round (None without rounds)."""
    pairs = [b / w for b, w in zip(base.wall_rounds, row.wall_rounds)]
    return statistics.median(pairs) if pairs else None


def _training_step(model: nn.Module, x: torch.Tensor, device: torch.device) -> Callable[[int], object]:
    model.train()
    x = x.requires_grad_(False)

    def step(_i):
        # (a new step for the CUDA-graph forms: without it, Inductor's graph trees cannot tell the forms'
        # steps apart when they take turns, and replay each behind checks and copies of the pool's state)
        torch.compiler.cudagraph_mark_step_begin()
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = _output(model(x)).float().mean()
        loss.backward()

    return step


def _wall_rounds(steps: Sequence[Callable[[int], object]], device: torch.device, count: int = 10,
                 rounds: int = 31) -> List[List[float]]:
    """Per form, per round, the wall time per step of ``count`` steps issued back to back. The forms
    take turns round by round (the first alternating too), so a drift in the host's speed over
    the run reaches all of them alike. The garbage collector is off meanwhile (its pauses land in
    whichever form happens to allocate past its threshold)."""
    times: List[List[float]] = [[] for _ in steps]
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            _round(steps, device, count, r, times)
    finally:
        if gc_was_enabled:
            gc.enable()
    return times


def _round(steps: Sequence[Callable[[int], object]], device: torch.device, count: int, r: int,
           times: List[List[float]]) -> None:
    """Round r: each form's ``count`` steps, timed, in turn (reversed order in odd rounds)."""
    order = list(range(len(steps)))
    if r % 2:
        order.reverse()
    for f in order:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(count):
            steps[f](i)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[f].append((time.perf_counter() - t0) * 1e3 / count)


def _peak_mb(model: nn.Module, step: Callable[[int], object], device: torch.device) -> Optional[float]:
    if device.type != "cuda":
        return None
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(0)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20


def measure(models: Sequence[nn.Module], x: torch.Tensor, device: torch.device, steps: int = 10) -> List[ModelRow]:
    """One row per form of a model: GPU time, wall time (the forms timed in turns) and peak memory."""
    train_steps = [_training_step(m, x, device) for m in models]
    rows = []
    for model, step in zip(models, train_steps):
        step(0)
        gpu = kernel_ms(step, device, warmup=2, reps=max(2, steps // 2))
        rows.append(ModelRow("", "", gpu, None, _peak_mb(model, step, device)))
    for row, walls in zip(rows, _wall_rounds(train_steps, device, steps)):
        row.wall_ms, row.wall_rounds = min(walls), walls
    for model in models:
        model.zero_grad(set_to_none=True)  # (a converted copy of the model must not copy its gradients)
    return rows


def _relative_diff(model: nn.Module, original: nn.Module, x: torch.Tensor) -> float:
    """|model(x) - original(x)| / |original(x)| under the step's bf16 autocast, in the modes the
    caller set (a compiled model is checked as the step runs it, training with gradients on, so it
    compiles its training graph once)."""
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        want, got = _output(original(x)).detach().float(), _output(model(x)).detach().float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def run(names: Optional[Sequence[str]] = None, device: Optional[str] = None, tiny: Optional[bool] = None,
        progress=print, on_rows: Callable[[List[ModelRow]], object] = lambda rows: None,
        compiled: bool = False) -> List[ModelRow]:
    """Every named model's rows (all models without names); ``on_rows`` sees the rows so far after
    each model. ``tiny`` (the default on the CPU): small sizes. ``compiled``: the COMPILE_FORMS
    instead of the model's own forms (those with CUDA graphs on a GPU only)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = dev.type == "cpu" if tiny is None else tiny
    wanted = [n.lower() for n in names or []]
    rows = []
    for spec in specs(tiny):
        if wanted and spec.name.lower() not in wanted:
            continue
        if spec.library:
            try:
                __import__(spec.library)
            except ImportError:
                progress(f"skipped {spec.name}: {spec.library} is not installed")
                continue
        torch.manual_seed(0)
        original = spec.build().to(dev, spec.weights)
        x = (torch.randint(0, spec.token_ids, spec.input_shape, device=dev) if spec.token_ids
             else torch.randn(*spec.input_shape, device=dev))
        if spec.channels_last:
            original = original.to(memory_format=torch.channels_last)
            x = x.contiguous(memory_format=torch.channels_last)
        forms = spec.forms
        if compiled:
            forms = [f for f in COMPILE_FORMS if dev.type == "cuda" or not f.endswith("-cg")]
        models, notes = [], []
        for form in forms:
            note = ""
            if form in COMPILE_FORMS:
                original.train()
                model, note = _compiled(form, original)
                if not form.endswith("-cg"):  # (a CUDA-graph form's outputs are its graphs' buffers)
                    note = "; ".join(filter(None, [note, f"output rel. diff {_relative_diff(model, original, x):.1e}"]))
            elif form == "converted":
                report = convert(original, inplace=False)
                model = report.model
                original.eval(), model.eval()  # (no dropout or drop-path: the same function twice)
                with torch.no_grad():
                    note = f"{len(report.swapped)} swapped; output rel. diff {_relative_diff(model, original, x):.1e}"
            else:
                model = _make(form, original)
            models.append(model)
            notes.append(note)
        measured = measure(models, x, dev)
        for i, model in enumerate(models):  # (the compiler's report fills as the model is traced)
            report = getattr(model, "patchgemm_report", None)
            if report is not None:
                notes[i] = "; ".join(filter(None, [f"{len(report.rewritten)} rewritten", notes[i]]))
        base = measured[0]
        for i, (form, note, row) in enumerate(zip(forms, notes, measured)):
            row.model, row.form, row.note = spec.name, form, note
            if row is not base:
                row.vs_original_gpu = base.gpu_ms / row.gpu_ms
                row.vs_original_wall = base.wall_ms / row.wall_ms
                row.vs_original_wall_paired = paired_wall_ratio(base, row)
            if i >= 2 and not compiled:  # e.g. converted against use_linear as well as against the conv original
                prev = measured[i - 1]
                row.note = "; ".join(filter(None, [
                    f"vs {forms[i - 1]}: {_time_unit(dev.type)} {prev.gpu_ms / row.gpu_ms:.3f}x, "
                    f"wall {prev.wall_ms / row.wall_ms:.3f}x", row.note]))
            progress(format_rows([row], header=False, device_type=dev.type))
            rows.append(row)
        on_rows(rows)
        del models, original
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _time_unit(device_type: str) -> str:
    """What gpu_ms measures on `device_type`: the GPU's kernel time, or the CPU's time."""
    return "GPU" if device_type == "cuda" else "CPU"


def format_rows(rows: List[ModelRow], header: bool = True, device_type: str = "cuda") -> str:
    """The table; on the CPU its first time is the CPU's (the median step, which wall ms bounds)."""
    def num(v, fmt):
        width = int(fmt.split(".")[0])
        return f"{'-':>{width}}" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    unit = _time_unit(device_type)
    lines = [f"{'model':<14} {'form':<20} {unit + ' ms':>8} {'wall ms':>8} {'peak MB':>8} {unit + ' x':>6} {'wall x':>6} "
             f"{'paired':>6}  note"]
    lines = lines if header else []
    for r in rows:
        lines.append(f"{r.model:<14} {r.form:<20} {num(r.gpu_ms, '8.2f')} {num(r.wall_ms, '8.2f')} "
                     f"{num(r.peak_mb, '8.0f')} {num(r.vs_original_gpu, '6.3f')} {num(r.vs_original_wall, '6.3f')} "
                     f"{num(r.vs_original_wall_paired, '6.3f')}  {r.note}")
    return "\n".join(lines)


def main(names: Optional[Sequence[str]] = None, device: Optional[str] = None, json_path: Optional[str] = None,
         tiny: Optional[bool] = None, compiled: bool = False) -> int:
    import json
    from dataclasses import asdict

    from .bench import environment

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tiny = dev.type == "cpu" if tiny is None else tiny  # GPU-sized models take minutes a step on a CPU
    known = [s.name.lower() for s in specs(tiny)]
    unknown = [n for n in names or [] if n.lower() not in known]
    if unknown:
        print(f"patchgemm bench --models: unknown model(s) {unknown}; the models are {[s.name for s in specs(tiny)]}")
        return 2
    def save(rows):  # after each model, so that a run cut short keeps what it measured
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"environment": environment(dev), "models": [asdict(r) for r in rows]}, f, indent=1)

    print(format_rows([], device_type=dev.type))
    rows = run(names, device=str(dev), tiny=tiny, on_rows=save, compiled=compiled)
    print("\n" + format_rows(rows, device_type=dev.type))
    return 0
