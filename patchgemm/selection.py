"""Which implementation each op call runs: see it (``explain``, ``kernels``, ``PATCHGEMM_LOG_DISPATCH=1``),
choose how it is chosen (``set_selection``, ``PATCHGEMM_SELECTION``) and pin it (``force``,
``PATCHGEMM_FORCE="op=name,..."``).

Every op has a table of candidates, ours and PyTorch's own (``python -m patchgemm kernels`` prints
them). Three modes choose among those that apply to a call:

- ``"learned"`` (the default): a small model trained on autotune records (``python -m patchgemm tune``;
  the one shipped with the package was trained on H100 and H200 timings, including model families
  the rules were never fitted to) predicts the fastest, leaning toward PyTorch's own paths where the
  prediction is close; a signature already in the autotune cache takes the measured choice. Where
  the model has no timings of the op or the backend (ROCm), every candidate that applies is timed on
  the GPU once per signature (in memory, within the same timing budget), and another replaces
  PyTorch's own path, then the heuristic's pick, only where faster by more than 5% and 1 us; on the
  CPU, whose timings spread too widely to choose by, the heuristic chooses.
- ``"heuristic"``: the first candidate, in table order, whose rule expects it to win.
- ``"autotune"``: the first call of each problem signature (shapes, strides, dtype, device, TF32 and
  determinism flags) times every candidate that applies and keeps the fastest, in memory and in a
  cache file per GPU and software versions under ``~/.cache/patchgemm`` (``PATCHGEMM_CACHE_DIR``),
  so later processes start tuned. Never during CUDA-graph capture (the heuristic chooses there).

The state is process-wide, so calls made by autograd's backward threads follow it too.
"""

import contextlib
import json
import os
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Union

import torch

from .ops import ops

MODES = ("heuristic", "autotune", "learned")
# The time a process may spend, from set_selection("learned"), timing the contenders the model cannot
# tell apart (a first call of a new signature takes tens of ms): shapes that change without end
# then cost no more than this.
LEARNED_TIMING_BUDGET_MS = 2000.0
DEFAULT_MODE = "learned"  # judged on model families it never saw: see bench/RESULTS.md
MODEL_FORMAT = 1  # of the learned selector's model files (patchgemm.tools.learned writes them)
DEFAULT_MODEL = os.path.join(os.path.dirname(__file__), "data", "selector.json")


@dataclass(frozen=True)
class Candidate:
    """One implementation of an op: its stable name, where it runs and what it needs."""

    op: str
    name: str
    backends: str
    conditions: str


def kernels(op: Optional[str] = None) -> List[Candidate]:
    """Every candidate of every op (or of ``op``), in the order the default choice tries them."""
    rows = [Candidate(*row.split("|", 3)) for row in ops._kernels()]
    if op is not None:
        rows = [r for r in rows if r.op == op]
        if not rows:
            raise ValueError(f"patchgemm.kernels: no op named {op!r}; the ops are {sorted({r.op for r in kernels()})}")
    return rows


@contextlib.contextmanager
def force(**choices: str) -> Iterator[None]:
    """Pin implementations by name for the calls inside: ``with patchgemm.force(patch_embed="gather_gemm"):``.

    A call whose forced candidate does not apply to it raises a RuntimeError naming the reason.
    Unknown op or candidate names raise at once. Process-wide, restored on exit.
    """
    previous: Dict[str, str] = {}
    try:
        for op, name in choices.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"patchgemm.force: {op} needs a candidate name, got {name!r}")
            previous[op] = ops._force(op, name)
        yield
    finally:
        for op, name in previous.items():
            ops._force(op, name)


def default_cache_dir() -> str:
    """Where autotune keeps its files: ``$PATCHGEMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/patchgemm``,
    else ``~/.cache/patchgemm``."""
    if os.environ.get("PATCHGEMM_CACHE_DIR"):
        return os.environ["PATCHGEMM_CACHE_DIR"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "patchgemm")


def _software_key() -> str:
    from . import __version__

    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (f"torch {torch.__version__}; CUDA {torch.version.cuda}; HIP {torch.version.hip}; cuDNN {cudnn}; "
            f"patchgemm {__version__}")


# pins: op -> the name forced before set_selection pinned it; cache_dir and model: as last passed.
_selection = {"mode": "heuristic", "pins": {}, "cache_dir": None, "model": None, "unsure_gap": None}


def get_selection() -> str:
    """The current selection: a mode, or the implementation name ``set_selection`` pinned."""
    return _selection["mode"]


def set_selection(mode: str, *, cache_dir: Optional[str] = None, model: Optional[str] = None,
                  unsure_gap: Optional[float] = None) -> str:
    """Choose how every op picks its implementation; returns the previous setting.

    ``mode``: ``"heuristic"``, ``"autotune"``, ``"learned"`` (see the module's doc), or the name of an
    implementation (``"aten_conv"``, ``"gather_gemm"``...; ``python -m patchgemm kernels`` lists them),
    which is then forced for every op that has one of that name, the others staying heuristic.
    ``cache_dir``: autotune's directory (default ``default_cache_dir()``; ``""`` keeps the choices in
    memory only). ``model``: a learned model file (default: the one shipped with the package).
    ``unsure_gap``: in learned mode, time the candidates scored within this gap of the best (log-odds
    of being the fastest) on a signature's first call; default the model's, ``0`` never times (nor
    the candidates of an op without a model).
    Also set at import from ``PATCHGEMM_SELECTION``.
    """
    if not isinstance(mode, str) or not mode:
        raise ValueError(f"patchgemm.set_selection: mode must be one of {', '.join(MODES)} or an "
                         f"implementation name, got {mode!r}")
    previous = _selection["mode"]
    if mode not in MODES:
        ops_with_it = sorted({c.op for c in kernels() if c.name == mode})
        if not ops_with_it:
            names = sorted({c.name for c in kernels()})
            raise ValueError(f"patchgemm.set_selection: {mode!r} is neither a mode ({', '.join(MODES)}) nor an "
                             f"implementation name ({', '.join(names)})")
    if unsure_gap is not None and (isinstance(unsure_gap, bool) or not isinstance(unsure_gap, (int, float))
                                   or not 0 <= unsure_gap < float("inf")):
        raise ValueError(f"patchgemm.set_selection: unsure_gap must be a number >= 0 (0: never time), got {unsure_gap!r}")
    if mode == "learned":
        loaded = load_model(model)
        install_model(loaded)
        gap = loaded.get("unsure_gap", 0.0) if unsure_gap is None else unsure_gap
        ops._set_learned_unsure_gap(float(gap), LEARNED_TIMING_BUDGET_MS)
    directory = default_cache_dir() if cache_dir is None else cache_dir
    ops._set_selection_mode(mode if mode in MODES else "heuristic", directory if mode in MODES else "",
                            _software_key())
    for op, name in _selection["pins"].items():  # undo the previous pins
        ops._force(op, name)
    _selection["pins"] = {}
    if mode not in MODES:
        _selection["pins"] = {op: ops._force(op, mode) for op in ops_with_it}
    _selection.update(mode=mode, cache_dir=cache_dir, model=model, unsure_gap=unsure_gap)
    return previous


def load_model(path: Optional[str] = None) -> dict:
    """A learned selector's model file (default: the one shipped with the package)."""
    path = path or DEFAULT_MODEL
    try:
        with open(path) as f:
            model = json.load(f)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"patchgemm learned selector: cannot read the model file {path}: {e}") from e
    if not isinstance(model, dict) or model.get("format") != MODEL_FORMAT or not isinstance(model.get("ops"), dict):
        raise RuntimeError(f"patchgemm learned selector: {path} is not a model file of format {MODEL_FORMAT}")
    return model


def install_model(model: dict) -> None:
    """Hands a model's ops to the C++ selection (ops without a model: see the module's doc)."""
    for op in sorted({c.op for c in kernels()}):
        m = model["ops"].get(op)
        if m is None:
            ops._set_learned_model(op, [], [], 0, [], [])
            continue
        params = (m["mean"] + m["scale"] + [w for row in m["w1"] for w in row] + m["b1"]
                  + [w for row in m["w2"] for w in row] + m["b2"])
        ops._set_learned_model(op, m["candidates"], m["features"], m["hidden"], params, model.get("backends", []))


def select_at_import() -> None:
    """``PATCHGEMM_SELECTION``'s mode, else the default; a default model that cannot be read (a
    damaged install) leaves the rules choosing, with a warning, rather than failing the import."""
    if os.environ.get("PATCHGEMM_SELECTION"):
        set_selection(os.environ["PATCHGEMM_SELECTION"])
        return
    try:
        set_selection(DEFAULT_MODE)
    except RuntimeError as e:
        warnings.warn(f"patchgemm: the default selection ({DEFAULT_MODE}) could not start, so the rules choose: {e}")


@contextlib.contextmanager
def restored_selection():
    """Gives back the selection in force on entry (mode, autotune directory, model) on exit."""
    saved = dict(_selection)
    try:
        yield
    finally:
        set_selection(saved["mode"], cache_dir=saved["cache_dir"], model=saved["model"], unsure_gap=saved["unsure_gap"])


def autotune_records() -> List[str]:
    """The autotune records this process holds (its own and those read from cache files), one
    tab-separated line each: op, flags, signature, chosen, candidate=ms;..., feature=value;..."""
    return list(ops._autotune_records())


@dataclass
class Verdict:
    name: str
    status: str  # "chosen", "unsupported", "passed over" (its rule), "not reached"
    reason: str


@dataclass
class Choice:
    """One op call: the candidate that ran, how it was chosen, and every candidate's verdict.

    ``how``: ``"forced"``, ``"heuristic"`` (with the reason in parentheses where another mode could not
    choose), ``"autotune: timed now"``, ``"autotune: cached in <file>"``, ``"learned: predicted now"``...;
    ``"forced; run with PyTorch's autograd ..."`` (or ``"heuristic; ..."``) where the choice, PyTorch's
    convolution, runs as that op itself, so that no patchgemm op runs its backward.
    """

    op: str
    signature: str
    chosen: str
    how: str
    candidates: List[Verdict] = field(default_factory=list)

    @property
    def forced(self) -> bool:
        return self.how == "forced" or self.how.startswith("forced;")

    def __str__(self) -> str:
        lines = [f"{self.op} {self.signature} -> {self.chosen} ({self.how})"]
        if self.op in _GEMM_OPERANDS:
            lines.append(f"    (a, b: {_GEMM_OPERANDS[self.op]})")
        for v in self.candidates:
            if v.status != "chosen" or v.reason:  # autotune's chosen candidate shows its time
                lines.append(f"    {v.name}: {v.status}" + (f" ({v.reason})" if v.reason else ""))
        return "\n".join(lines)


# What the grouped-linear ops' signatures call a and b (the GEMM c = a @ b per group, on views of
# the caller's tensors, never copies).
_GEMM_OPERANDS = {
    "grouped_linear": "x as [G, B, D] and weight transposed, [G, D, N]",
    "grouped_linear_grad_input": "grad_y as [G, B, N] and weight [G, N, D]",
    "grouped_linear_grad_weight": "grad_y transposed, [G, N, B], and x as [G, B, D]",
}


class Explanation(list):
    """The choices recorded by ``explain``, in call order; printing shows them."""

    def __str__(self) -> str:
        return "\n".join(str(c) for c in self) if self else "(no patchgemm op ran)"


def _parse(record: str) -> Choice:
    d = json.loads(record)
    return Choice(d["op"], d["signature"], d["chosen"], d["how"],
                  [Verdict(v["name"], v["status"], v["reason"]) for v in d["candidates"]])


_open_recordings: List[Explanation] = []  # the explain() recordings open now, for note()


def note(op: str, signature: str, chosen: str, how: str) -> None:
    """A choice made in Python (no op's table ran), for every explain() recording open now; it lists
    before the ops' own choices of that recording."""
    for out in _open_recordings:
        out.append(Choice(op, signature, chosen, how))


@contextlib.contextmanager
def _recording() -> Iterator[Explanation]:
    out = Explanation()
    mark = ops._explain_start()
    _open_recordings.append(out)
    try:
        yield out
    finally:
        _open_recordings.remove(out)
        out.extend(_parse(r) for r in ops._explain_stop(mark))


def explain(fn: Optional[Callable] = None, *args, **kwargs) -> Union[Explanation, "contextlib.AbstractContextManager"]:
    """What ran, and why the other candidates did not.

    ``patchgemm.explain(patchgemm.patch_embed, x, w, b)`` runs the call and returns its choices;
    ``with patchgemm.explain() as e: model(x).sum().backward()`` records every op call inside
    (forward and backward), and ``print(e)`` shows them.
    """
    if fn is None:
        return _recording()
    if not callable(fn):
        raise TypeError(f"patchgemm.explain: expected a function to run (e.g. patchgemm.patch_embed) and its "
                        f"arguments, or nothing (a context manager), got {type(fn).__name__} {fn!r}")
    with _recording() as out:
        fn(*args, **kwargs)
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            torch.cuda.synchronize()
    return out
