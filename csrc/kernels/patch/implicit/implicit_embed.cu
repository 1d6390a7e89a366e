// The implicit-GEMM patch embedding's entry (patchify.h: implicit_embed): the checks every implicit
// kernel makes of a forward problem, its setup (the problem, the copies' runs, the weight padded to
// 16-byte rows), and the call of the kernel asked for: mma.sync (sm80/implicit_patch_gemm.cu, which
// explains the implicit GEMM) or wgmma (sm90/implicit_patch_gemm*_sm90.cu).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/patch/patchify.h"

namespace patchgemm {
namespace cuda {
namespace {

// The checks every implicit kernel makes of a forward problem (and kRowsSm90's and kPairsSm90's
// own, which need no allocation), and its setup: p, the run of elements each copy moves, whether kw
// = 2 copies go pair-major. False with the reason where the kernel does not apply.
bool prepare(Implicit kernel, const at::Tensor& x5, const PatchGeometry& g, int64_t E, bool ruled, Problem& p,
             int& run, bool& pair_major, std::string& why) {
  const int64_t K = g.patch_size(), N = g.tokens(), kw = g.kernel[2];
  const auto dtype = x5.scalar_type();
  const cudaDeviceProp* device = at::cuda::getDeviceProperties(x5.get_device());
  if (dtype != at::kHalf && dtype != at::kBFloat16) return decline(why, "16-bit dtypes only");
  if (g.levels.size() != 1) return decline(why, "row-major token order only (no levels)");
  if (kw % 2) return decline(why, "kw must be even");
  if (K < 16 || E < 32 || N < 2) return decline(why, "needs K >= 16, E >= 32 and 2+ patches per sample");
  if (x5.stride(4) != 1) return decline(why, "x's last dim must be contiguous");
  if (device->major < 8) return decline(why, "needs sm_80 or newer");
  if (kernel != Implicit::kMma && !wgmma_kernels_run_here(x5)) return decline(why, "needs sm_90a kernels on a 9.0 GPU");
  // Runs of V elements: the largest of 8, 4, 2 dividing kw, every stride and the address (in V).
  run = widest_run(x5, kw);
  if (run == 0) return decline(why, "x's strides and address are not 4-byte aligned along w");
  if (!make_problem(x5, g, E, p)) return decline(why, "sizes past the kernels' 32-bit indices");
  // kw = 2: pair-major copies of 4 tokens where every group of 4 starts a 16-byte aligned run.
  pair_major = kw == 2 && g.grid[2] % 4 == 0 && runs_aligned(x5, 8);
  if (kernel == Implicit::kRowsSm90) return implicit_embed_rows_sm90_fits(p, x5, ruled, why);
  if (kernel == Implicit::kPairsSm90) return implicit_embed_pairs_sm90_fits(p, x5, why);
  return true;
}

}  // namespace

bool implicit_embed_fits(Implicit kernel, const at::Tensor& x5, const PatchGeometry& g, int64_t E, bool ruled,
                         std::string& why) {
  Problem p;
  int run;
  bool pair_major;
  return prepare(kernel, x5, g, E, ruled, p, run, pair_major, why);
}

bool implicit_embed(Implicit kernel, const at::Tensor& x5, const at::Tensor& w2,
                    const std::optional<at::Tensor>& bias, const PatchGeometry& g, const at::Tensor& y,
                    bool tokens_out, bool ruled, std::string& why) {
  const int64_t E = w2.size(0), K = g.patch_size();
  Problem p;
  int run;
  bool pair_major;
  if (!prepare(kernel, x5, g, E, ruled, p, run, pair_major, why)) return false;
  if (p.rows == 0) return true;

  const c10::cuda::CUDAGuard guard(y.device());
  // W [E, K] with rows padded to 16 bytes (zero columns meet zero-filled patch columns).
  at::Tensor w = w2;
  if (K % 8 || !w2.is_contiguous()) {
    w = at::empty({E, (K + 7) / 8 * 8}, w2.options());
    TORCH_INTERNAL_ASSERT(pad_weight(w2, std::nullopt, w));
  }
  p.ldw = static_cast<int>(w.size(1));
  const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  switch (kernel) {
    case Implicit::kRowsSm90: return implicit_embed_rows_sm90(p, x5, w, b, y, ruled, why);
    case Implicit::kPairsSm90: return implicit_embed_pairs_sm90(p, x5, w, b, y, why);
    case Implicit::kSm90: return implicit_embed_sm90(p, run, pair_major, x5, w, b, tokens_out, y, why);
    default: break;
  }
  return implicit_embed_mma(p, run, pair_major, x5, w, b, tokens_out, y) ||
         decline(why, "the patch's runs do not fit in shared memory (K too long)");
}

}  // namespace cuda
}  // namespace patchgemm
