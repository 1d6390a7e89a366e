"""Which implementation each op call runs: see it (``explain``, ``kernels``, ``PATCHGEMM_LOG_DISPATCH=1``)
and pin it (``force``, ``PATCHGEMM_FORCE="op=name,..."``).

Every op has a table of candidates, ours and PyTorch's own (``python -m patchgemm kernels`` prints
them). The default choice takes the first candidate, in table order, that applies to the call and
whose rule expects it to win. The state is process-wide, so calls made by autograd's backward
threads are seen and forced too.
"""

import contextlib
import json
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Union

import torch

from .ops import ops


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


@dataclass
class Verdict:
    name: str
    status: str  # "chosen", "unsupported", "passed over" (its rule), "not reached"
    reason: str


@dataclass
class Choice:
    """One op call: the candidate that ran, and every candidate's verdict."""

    op: str
    signature: str
    chosen: str
    forced: bool
    candidates: List[Verdict] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.op} {self.signature} -> {self.chosen}" + (" (forced)" if self.forced else "")]
        for v in self.candidates:
            if v.status != "chosen":
                lines.append(f"    {v.name}: {v.status}" + (f" ({v.reason})" if v.reason else ""))
        return "\n".join(lines)


class Explanation(list):
    """The choices recorded by ``explain``, in call order; printing shows them."""

    def __str__(self) -> str:
        return "\n".join(str(c) for c in self) if self else "(no patchgemm op ran)"


def _parse(record: str) -> Choice:
    d = json.loads(record)
    return Choice(d["op"], d["signature"], d["chosen"], d["forced"],
                  [Verdict(v["name"], v["status"], v["reason"]) for v in d["candidates"]])


@contextlib.contextmanager
def _recording() -> Iterator[Explanation]:
    out = Explanation()
    mark = ops._explain_start()
    try:
        yield out
    finally:
        out.extend(_parse(r) for r in ops._explain_stop(mark))


def explain(fn: Optional[Callable] = None, *args, **kwargs) -> Union[Explanation, "contextlib.AbstractContextManager"]:
    """What ran, and why the other candidates did not.

    ``patchgemm.explain(patchgemm.patch_embed, x, w, b)`` runs the call and returns its choices;
    ``with patchgemm.explain() as e: model(x).sum().backward()`` records every op call inside
    (forward and backward), and ``print(e)`` shows them.
    """
    if fn is None:
        return _recording()
    with _recording() as out:
        fn(*args, **kwargs)
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            torch.cuda.synchronize()
    return out
