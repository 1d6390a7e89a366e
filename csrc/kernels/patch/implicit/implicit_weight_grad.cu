// The implicit-GEMM weight gradient's entry (patchify.h: implicit_weight_grad): the checks, the
// split of the tokens into ranges (enough blocks for every SM), and the call of the kernel asked
// for: mma.sync, kw = 2 pairs (sm80/implicit_patch_weight_grad.cu, which explains the kernel), or
// wgmma: runs of kw % 4 == 0 and kw = 2 pairs (sm90/implicit_patch_weight_grad_sm90.cu), or tokens
// grad_y with kw = 16, 32, 64 by TMA (sm90/implicit_patch_weight_grad_rows_sm90.cu).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/patch/patchify.h"

namespace patchgemm {
namespace cuda {

std::optional<std::tuple<at::Tensor, at::Tensor>> implicit_weight_grad(Implicit kernel, const at::Tensor& grad_y,
                                                                       bool tokens, const at::Tensor& x5,
                                                                       const PatchGeometry& g, int64_t E,
                                                                       bool with_bias, bool ruled, std::string& why) {
  const int64_t K = g.patch_size(), N = g.tokens(), kw = g.kernel[2];
  const auto dtype = x5.scalar_type();
  const cudaDeviceProp* device = at::cuda::getDeviceProperties(x5.get_device());
  Problem p;
  if (dtype != at::kHalf && dtype != at::kBFloat16) return decline_grads(why, "16-bit dtypes only");
  if (kernel == Implicit::kPairsSm90) return decline_grads(why, "no such weight-gradient kernel");
  if (g.levels.size() != 1) return decline_grads(why, "row-major token order only (no levels)");
  if (K < 16 || E < 32) return decline_grads(why, "needs K >= 16 and E >= 32");
  if (x5.stride(4) != 1) return decline_grads(why, "x's last dim must be contiguous");
  if (device->major < 8) return decline_grads(why, "needs sm_80 or newer");
  if (!make_problem(x5, g, E, p)) return decline_grads(why, "sizes past the kernels' 32-bit indices");
  // Three kernels: on Hopper's wgmma, runs of 8 or 4 (kw % 4 == 0) or kw = 2 pairs with K % 4 == 0
  // (token indices in 32 bits), or (rows) the patches by TMA; elsewhere mma.sync, kw = 2 pairs. Pairs:
  // one 16-byte copy per pair of 4 tokens (grid rows of 4k patches). grad_y moves in 16-byte pieces of
  // 8 embeddings (tokens) or pieces of 8 (4 on wgmma) tokens of a sample (channels-first).
  const bool pairs = kw == 2 && g.grid[2] % 4 == 0 && runs_aligned(x5, 8);
  const int run = pairs ? 2 : widest_run(x5, kw);
  const bool wgmma = kernel != Implicit::kMma;
  if (wgmma && !wgmma_kernels_run_here(x5)) return decline_grads(why, "needs sm_90a kernels on a 9.0 GPU");
  if (wgmma && (p.rows >= INT_MAX || !(run >= 4 || (pairs && K % 4 == 0)))) {
    return decline_grads(why, "needs kw % 4 == 0 runs or kw = 2 pairs with K % 4 == 0, and fewer than 2^31 patches");
  }
  if (!wgmma && !pairs) return decline_grads(why, "needs kw = 2, gw a multiple of 4 and 16-byte aligned rows of x");
  const int dy_piece = tokens ? 0 : N % 8 == 0 ? 8 : N % 4 == 0 && wgmma ? 4 : -1;
  if (tokens && E % 8) return decline_grads(why, "E must be a multiple of 8");
  if (dy_piece < 0)
    return decline_grads(
        why, wgmma ? "patches per sample must be a multiple of 4" : "patches per sample must be a multiple of 8");
  const c10::cuda::CUDAGuard guard(x5.device());
  if (kernel == Implicit::kRowsSm90) {
    // Tokens grad_y with patch rows of 32-128 bytes: the patches by TMA, the bias gradient included.
    if (!tokens) return decline_grads(why, "tokens grad_y only");
    return implicit_weight_grad_rows_sm90(p, x5, contiguous_aligned(grad_y), with_bias, ruled, why);
  }
  if (p.rows == 0) return std::make_tuple(at::zeros({E, K}, x5.options()), at::Tensor());
  // Token ranges: enough for a block per SM (one fits an SM), each at least 4 slices long.
  constexpr int64_t kTileM = kWeightGradColumns, kTileK = kWeightGradTokens;
  const int64_t kTileN = E % 192 == 0 ? 192 : 128;  // as the forward
  const int64_t tiles = (K + kTileM - 1) / kTileM * ((E + kTileN - 1) / kTileN);
  int64_t splits = std::max<int64_t>(1, std::min<int64_t>(device->multiProcessorCount / tiles,
                                                          (p.rows + 4 * kTileK - 1) / (4 * kTileK)));
  const int64_t chunk = ((p.rows + splits - 1) / splits + kTileK - 1) / kTileK * kTileK;
  splits = (p.rows + chunk - 1) / chunk;
  TORCH_CHECK(splits * tiles < INT_MAX, "patch_weight_grad: ", splits * tiles, " blocks is too many");
  const at::Tensor dy = contiguous_aligned(grad_y);  // (grad_y is a fraction of x)
  if (wgmma) {
    // One token range: the kernel writes dW itself; more: fp32 partial sums (and the bias gradient's,
    // where E % 4 == 0), which sum_token_ranges adds.
    const auto fp32 = x5.options().dtype(at::kFloat);
    const bool fused_bias = with_bias && E % 4 == 0;
    const at::Tensor dw = at::empty({E, K}, x5.options()),
                     db = fused_bias ? at::empty({E}, x5.options()) : at::Tensor();
    const at::Tensor dw_partial = splits > 1 ? at::empty({splits, E, K}, fp32) : at::Tensor();
    const at::Tensor db_partial =
        fused_bias ? at::empty({splits * ((K + kTileM - 1) / kTileM), E}, fp32) : at::Tensor();
    if (!implicit_weight_grad_sm90(p, run, dy_piece, x5, dy, splits, chunk, splits > 1 ? dw_partial : dw, db_partial)) {
      return decline_grads(why, "its tiles do not fit in shared memory");
    }
    sum_token_ranges(dw_partial, db_partial, dw, db);
    return std::make_tuple(dw, db);
  }
  at::Tensor partial = at::empty({splits, E, K}, x5.options().dtype(at::kFloat));
  implicit_weight_grad_mma(p, tokens, x5, dy, splits, chunk, partial);
  return std::make_tuple((splits == 1 ? partial.select(0, 0) : partial.sum(0)).to(dtype), at::Tensor());
}

}  // namespace cuda
}  // namespace patchgemm
