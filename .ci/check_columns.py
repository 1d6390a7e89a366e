"""The C++ / CUDA sources keep to 120 columns (.clang-format's ColumnLimit; ruff's line length for
Python). Lists each line over it and exits 1; `clang-format -i --lines=N:N FILE` rewraps one."""

import pathlib
import sys

LIMIT = 120
ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [p for folder in ("csrc", "bench/cpp") for p in sorted((ROOT / folder).rglob("*"))
           if p.suffix in (".cpp", ".cu", ".h", ".cuh")]

long_lines = [f"{path.relative_to(ROOT)}:{number}: {len(line)} columns"
              for path in SOURCES
              for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > LIMIT]
print("\n".join(long_lines) or f"{len(SOURCES)} C++ / CUDA files within {LIMIT} columns")
sys.exit(1 if long_lines else 0)
