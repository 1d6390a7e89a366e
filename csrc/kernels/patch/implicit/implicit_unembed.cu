// The implicit-GEMM patch unembedding's entry (patchify.h: implicit_unembed): the checks, the
// problem's setup, and the call of the kernel asked for: mma.sync, kw = 2
// (sm80/implicit_patch_unembed.cu, which explains the kernel) or wgmma, kw = 2, 4 or a multiple of
// 8 (sm90/implicit_patch_unembed_sm90.cu).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/patch/patchify.h"

namespace patchgemm {
namespace cuda {

bool implicit_unembed(Implicit kernel, const at::Tensor& x, bool tokens, const at::Tensor& w2,
                      const std::optional<at::Tensor>& bias, const PatchGeometry& g, const at::Tensor& y5,
                      std::string& why) {
  const int64_t C_in = w2.size(0), K = g.patch_size(), N = g.tokens();
  const auto dtype = y5.scalar_type();
  const cudaDeviceProp* device = at::cuda::getDeviceProperties(x.get_device());
  Problem p;
  // x moves in 16-byte pieces of 8 channels (tokens) or 8 tokens of a sample (channels-first); y
  // takes 16-byte stores of the kw-element runs of 8 / kw tokens of a grid row: kw = 2, and on
  // wgmma kw = 4 too, or of 8 elements of one token's run (wgmma, kw % 8 == 0).
  const bool wgmma = kernel == Implicit::kSm90;
  const int64_t kw = g.kernel[2];
  if (dtype != at::kHalf && dtype != at::kBFloat16) return decline(why, "16-bit dtypes only");
  if (kernel != Implicit::kMma && kernel != Implicit::kSm90) return decline(why, "no such unembedding kernel");
  if (tokens ? C_in % 8 : N % 8)
    return decline(why, tokens ? "C_in must be a multiple of 8" : "patches per sample must be a multiple of 8");
  if (g.levels.size() != 1) return decline(why, "row-major token order only (no levels)");
  if (!(kw == 2 || (wgmma && (kw == 4 || kw % 8 == 0)))) {
    return decline(why, wgmma ? "kw must be 2, 4 or a multiple of 8" : "kw must be 2");
  }
  if (kw < 8 && g.grid[2] % (8 / kw)) return decline(why, "gw must be a multiple of 8 / kw");
  // (mma.sync adds one channel's bias to a column pair, which interleaved channels do not share:
  // channels-last kw = 1 over 2+ channels makes rows of kw * C = 2.)
  if (!wgmma && bias && g.interleaved_channels > 1) return decline(why, "a bias over channels-last patches");
  if (K < 16 || C_in < 16) return decline(why, "needs K >= 16 and C_in >= 16");
  if (!runs_aligned(y5, 8)) return decline(why, "the output's rows must be multiples of 8 elements");
  if (device->major < 8) return decline(why, "needs sm_80 or newer");
  if (wgmma && !wgmma_kernels_run_here(x)) return decline(why, "needs sm_90a kernels on a 9.0 GPU");
  if (!make_problem(y5, g, C_in, p)) return decline(why, "sizes past the kernels' 32-bit indices");
  if (p.rows == 0) return true;
  const c10::cuda::CUDAGuard guard(y5.device());
  const at::Tensor xc = contiguous_aligned(x);  // (x is a fraction of y)
  const std::optional<at::Tensor> b = bias ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  if (wgmma) return implicit_unembed_sm90(p, tokens, xc, w2.contiguous(), b, y5, why);
  implicit_unembed_mma(p, tokens, xc, w2, b, y5);
  return true;
}

}  // namespace cuda
}  // namespace patchgemm
