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


def test_importing_patchgemm_loads_no_tooling():
    # (torch itself imports tqdm: only what patchgemm adds counts)
    code = ("import sys, torch; before = set(sys.modules); import patchgemm, patchgemm.nn; "
            "print(sorted(m for m in set(sys.modules) - before "
            "if m.startswith('patchgemm.tools') or m.split('.')[0] in ('tqdm', 'matplotlib')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]", out.stdout
