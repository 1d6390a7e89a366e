"""The package's layout as a wheel ships it: every Python package is listed, and the runtime imports
no tooling."""

import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_every_package_is_in_the_wheel():
    packages = re.search(r"^packages = (\[.*?\])", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    listed = set(ast.literal_eval(packages.group(1)))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "patchgemm").rglob("__init__.py")}
    assert found == listed, f"pyproject.toml's packages {sorted(listed)} != the packages in the tree {sorted(found)}"


def modules_importing_patchgemm_adds(which: str):
    """The modules that `import patchgemm, patchgemm.nn` adds to a fresh interpreter's (after torch's
    own), among those the expression `which` of a module name `m` selects."""
    code = ("import sys, torch; before = set(sys.modules); import patchgemm, patchgemm.nn; "
            f"print(sorted(m for m in set(sys.modules) - before if {which}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd="/").stdout.strip()


def test_importing_patchgemm_loads_no_tooling():
    # (torch itself imports tqdm: only what patchgemm adds counts)
    assert modules_importing_patchgemm_adds(
        "m.startswith('patchgemm.tools') or m.split('.')[0] in ('tqdm', 'matplotlib')") == "[]"


def test_importing_patchgemm_leaves_the_compiler_stack_out():
    # torch._dynamo brings sympy and the compiler stack in (1 s of a 2-core CPU's import): a model
    # that never compiles must not pay for it.
    assert modules_importing_patchgemm_adds(
        "m.split('.')[0] == 'sympy' or m.startswith(('torch._dynamo', 'torch._inductor'))") == "[]"


def test_the_constant_result_mark_is_torchs():
    # patchgemm.fp8 marks a function as torch.compiler.assume_constant_result does, without importing
    # torch._dynamo; the mark must stay the one torch's own decorator sets.
    import torch

    from patchgemm.fp8 import _assume_constant_result

    def ours():
        return 0

    def torchs():
        return 0

    assert _assume_constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}
