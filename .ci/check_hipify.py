"""Hipify csrc/ with torch's own tool and fail if any CUDA API is left unmapped in what the ROCm build
compiles: every source but the NVIDIA-only kernels (setup.py's NVIDIA_ONLY), outside `#ifndef
USE_ROCM` blocks."""

import ast
import pathlib
import re
import shutil
import sys
import tempfile

from torch.utils.hipify import hipify_python


def setup_constant(name: str):
    """A literal assigned at the top of setup.py (read, not run: running it builds)."""
    tree = ast.parse((pathlib.Path(__file__).resolve().parent.parent / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    sys.exit(f"check_hipify: setup.py assigns no {name}")


NVIDIA_ONLY = setup_constant("NVIDIA_ONLY")
CUDA_API = re.compile(r"\b(cuda[A-Z]\w*|cublas\w*|CUBLAS_\w+|CUDA_R_\w+|cusparse\w*|cusolver\w*)\b")


def without_cuda_only_blocks(text: str) -> str:
    """Drop comments and the lines the ROCm build never compiles (`#ifndef USE_ROCM` up to its
    #else/#endif, and the #else branch of `#ifdef USE_ROCM`)."""
    out, stack = [], []  # per open #if: (is this branch CUDA-only?, does #else flip that?)
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#if"):
            rocm_test = s in ("#ifndef USE_ROCM", "#ifdef USE_ROCM")
            stack.append([s == "#ifndef USE_ROCM", rocm_test])
        elif s.startswith("#else") and stack and stack[-1][1]:
            stack[-1][0] = not stack[-1][0]
        elif s.startswith("#endif") and stack:
            stack.pop()
        elif not any(cuda_only for cuda_only, _ in stack) and not s.startswith("//"):
            out.append(line)
    return "\n".join(out)


def main() -> int:
    root = pathlib.Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        project = pathlib.Path(tmp) / "project"
        shutil.copytree(root / "csrc", project / "csrc")
        results = hipify_python.hipify(
            project_directory=str(project), output_directory=str(project),
            includes=[str(project / "csrc" / "*")], show_detailed=False, show_progress=False,
            is_pytorch_extension=True)
        # What the ROCm build compiles: each source's hipified version (or itself, if unchanged).
        outputs = sorted({pathlib.Path(r.hipified_path or src) for src, r in results.items()})
        problems = []
        outputs = [p for p in outputs if not str(p.relative_to(project)).startswith(NVIDIA_ONLY)]
        for path in outputs:
            for line in without_cuda_only_blocks(path.read_text()).splitlines():
                for m in CUDA_API.finditer(line.split("//")[0]):
                    problems.append(f"{path.relative_to(project)}: {m.group(0)}: {line.strip()}")
        hipified = [p for p in outputs if "hip" in p.name]
        print(f"hipify: checked {len(outputs)} files, {len(hipified)} hipified: "
              + ", ".join(str(p.relative_to(project)) for p in hipified))
        if not any(p.suffix == ".hip" for p in outputs):
            problems.append("no .cu source was hipified: the check saw nothing")
        for p in problems:
            print("unmapped CUDA API:", p)
        return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
