"""Build patchgemm._C against the torch that is installed.

Flavour (PATCHGEMM_BUILD=auto|cpu|cuda|rocm, default auto):
  rocm  torch is a ROCm build: the .cu sources are hipified by torch.utils.cpp_extension;
  cuda  torch is a CUDA build and nvcc is found (CUDA_HOME);
  cpu   otherwise: a plain C++ extension.
TORCH_CUDA_ARCH_LIST and MAX_JOBS are honoured (read by torch.utils.cpp_extension); 9.0 is built as
9.0a (Hopper's wgmma kernels).
"""

import glob
import os
import re
import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:
    sys.exit(
        "patchgemm: building needs PyTorch already installed. Install torch first, then run "
        "`pip install --no-build-isolation .` (without --no-build-isolation pip builds in an "
        "empty environment that has no torch)."
    )

# Hopper first; Ampere/Ada too. Used only when nothing chooses for us (no GPU visible at build time).
DEFAULT_CUDA_ARCHS = "8.0;8.6;8.9;9.0"


def choose_flavour():
    asked = os.environ.get("PATCHGEMM_BUILD", "auto").lower()
    if asked not in ("auto", "cpu", "cuda", "rocm"):
        sys.exit(f"patchgemm: PATCHGEMM_BUILD must be auto, cpu, cuda or rocm, not {asked!r}.")
    is_rocm = torch.version.hip is not None
    has_cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if asked == "rocm" and not is_rocm:
        sys.exit("patchgemm: PATCHGEMM_BUILD=rocm needs a ROCm build of torch.")
    if asked == "cuda" and not has_cuda:
        sys.exit(
            "patchgemm: PATCHGEMM_BUILD=cuda needs a CUDA build of torch and nvcc "
            f"(torch.version.cuda={torch.version.cuda}, CUDA_HOME={cpp_extension.CUDA_HOME})."
        )
    if asked != "auto":
        return asked
    return "rocm" if is_rocm else "cuda" if has_cuda else "cpu"


def cuda_arch_list():
    """TORCH_CUDA_ARCH_LIST, else the visible GPUs' (as torch would pick them), else DEFAULT_CUDA_ARCHS;
    with 9.0 built as 9.0a: Hopper's wgmma kernels need sm_90a code, which runs on the same GPUs."""
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or "native"
    if archs == "native":
        if torch.cuda.is_available():
            sms = [int(re.sub(r"\D", "", a[3:])) for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
            newest = max((sm // 10, sm % 10) for sm in sms)  # what this torch (and its nvcc) supports
            caps = {min(torch.cuda.get_device_capability(i), newest) for i in range(torch.cuda.device_count())}
            archs = ";".join(f"{major}.{minor}" for major, minor in sorted(caps))
        else:
            archs = DEFAULT_CUDA_ARCHS
    return ";".join("9.0a" + a[3:] if a.startswith("9.0") and not a.startswith("9.0a") else a
                    for a in archs.replace(" ", ";").split(";") if a)


def default_max_jobs():
    # nvcc can take several GB per job; stay inside the machine's memory.
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = 8
    return max(1, min(os.cpu_count() or 1, int(mem_gb // 4)))


flavour = choose_flavour()
os.environ.setdefault("MAX_JOBS", str(default_max_jobs()))

# csrc/ is ops -> selection -> kernels. Every .cpp builds everywhere; the .cu files only for GPUs,
# and those under NVIDIA_ONLY (PTX: mma.sync, wgmma, TMA; cuda_fp8.h) not for ROCm, whose selection tables then
# have no such candidates. cmake/CMakeLists.txt applies the same rule.
NVIDIA_ONLY = ("csrc/kernels/gemm/sm80/", "csrc/kernels/patch/implicit/", "csrc/kernels/patch/sm80/",
               "csrc/kernels/patch/sm90/", "csrc/kernels/primitives/", "csrc/kernels/quant/sm89/")
sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
gpu_sources = sorted(s for s in glob.glob("csrc/**/*.cu", recursive=True)
                     if flavour == "cuda" or not s.startswith(NVIDIA_ONLY))
cxx_flags = ["-O3", f"-DPATCHGEMM_FLAVOUR=\"{flavour}\""]
# nvcc's flags, the list cmake/CMakeLists.txt reads too.
with open("csrc/nvcc_flags.txt") as f:
    NVCC_FLAGS = [flag for line in f if not line.startswith("#") for flag in line.split()]

if flavour == "cpu":
    Extension = cpp_extension.CppExtension
    extra_compile_args = {"cxx": cxx_flags}
    libraries = []
else:
    Extension = cpp_extension.CUDAExtension
    sources += gpu_sources
    cxx_flags.append("-DPATCHGEMM_WITH_CUDA")
    extra_compile_args = {"cxx": cxx_flags, "nvcc": ["-DPATCHGEMM_WITH_CUDA", f"-DPATCHGEMM_FLAVOUR=\"{flavour}\""]}
    if flavour == "cuda":
        extra_compile_args["nvcc"] += NVCC_FLAGS
        libraries = ["cublas", "cublasLt"]
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch_list()
        if any(a.startswith("9.0a") for a in os.environ["TORCH_CUDA_ARCH_LIST"].split(";")):  # or 9.0a+PTX
            extra_compile_args["nvcc"].append("-DPATCHGEMM_SM90A")
            cxx_flags.append("-DPATCHGEMM_SM90A")
    else:
        extra_compile_args["nvcc"].append("-O3")  # (hipcc)
        libraries = ["hipblas"]
    # Recorded in the binary so `python -m patchgemm info` can say what was built.
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or "native"
    extra_compile_args["nvcc"].append(f"-DPATCHGEMM_ARCHS=\"{archs}\"")
    extra_compile_args["cxx"].append(f"-DPATCHGEMM_ARCHS=\"{archs}\"")

# at::parallel_for is a header template: under torch's OpenMP backend our CPU loops run in parallel only
# when compiled with OpenMP. The libgomp torch loads (same soname) then serves them, one thread pool.
extra_link_args = []
if torch.backends.openmp.is_available() and sys.platform.startswith("linux"):
    cxx_flags.append("-fopenmp")
    extra_link_args.append("-fopenmp")

# The torch the library is compiled against: an import under another torch says so (ops.py), where
# the loader would only report a missing symbol.
with open(os.path.join("patchgemm", "_built_with.py"), "w") as f:
    f.write(f'"""Written by setup.py: the torch patchgemm._C was built against."""\nTORCH = "{torch.__version__}"\n')

setup(
    ext_modules=[
        Extension(
            "patchgemm._C",
            sources,
            include_dirs=[os.path.abspath("csrc")],
            extra_compile_args=extra_compile_args,
            libraries=libraries,
            extra_link_args=extra_link_args,
            py_limited_api=True,  # no pybind11: torch defines Py_LIMITED_API, one wheel per platform
        )
    ],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
