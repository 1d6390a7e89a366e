"""The README's and docs' Python examples run as written (on the CPU)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_python_examples_run(doc):
    from patchgemm.selection import restored_selection

    blocks = re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S)
    namespace = {}
    with restored_selection():  # an example may set a selection mode: later tests run the default
        for i, block in enumerate(blocks):  # one namespace: later blocks use earlier imports
            exec(compile(block, f"{doc.name} block {i}", "exec"), namespace)


def test_readme_has_examples():
    assert len(re.findall(r"```python\n", (ROOT / "README.md").read_text())) >= 2
