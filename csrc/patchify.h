// Patchify (gather) and unpatchify (scatter): the data movement around the one GEMM of a
// kernel == stride convolution and its transpose.
//
// A volume x[B, C, D, H, W] cut into non-overlapping kd x kh x kw patches is the patch matrix
// P[B, N, K]: one row per patch ("token"), K = C * kd * kh * kw columns in the conv weight's order
// (c, i, j, l). 1-D and 2-D problems are 3-D ones with leading spatial sizes of 1.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

namespace patchgemm {

using Dims3 = std::array<int64_t, 3>;

struct PatchGeometry {
  int64_t batch = 0, channels = 0;
  Dims3 size{1, 1, 1};    // spatial sizes (D, H, W)
  Dims3 kernel{1, 1, 1};  // patch sizes
  Dims3 grid{1, 1, 1};    // patches per dim: size / kernel
  // The order of the rows of P within a batch: tokens are enumerated level by level, coarse
  // first, each level's (d, h, w) digits in row-major order; per dim, the level sizes multiply to
  // the grid. One level {grid} is the usual row-major patch grid (conv(x).flatten(2) order); more
  // levels make every group of later-stage patches contiguous rows (hierarchical stems).
  std::vector<Dims3> levels;

  int64_t tokens() const { return grid[0] * grid[1] * grid[2]; }
  int64_t patch_size() const { return channels * kernel[0] * kernel[1] * kernel[2]; }
};

// Elements per 16 bytes: patch-matrix rows are padded to a multiple so BLAS and the kernels see
// aligned rows.
int64_t row_alignment(const at::Tensor& like);

// The padded width of a patch-matrix row holding `values` elements: a multiple of row_alignment,
// and for 16-bit rows of 1024 values or more a multiple of 64 (cuBLAS's K tile), so that a GEMM
// reducing over the row has no partial K tile and never needs the split-K guard's second call
// (core/strided_gemm.h). fp32 rows stay as they are: their GEMMs pick slower kernels at whole
// 32-value tiles (P5 fp32, 3%).
int64_t patch_row_width(int64_t values, const at::Tensor& like);

// The patch matrix of x5 [B, C, D, H, W] (any strides): P [B, N, ld], ld = patch_row_width(K (+1)).
// The first K columns hold the patches; with `ones_column` column K holds 1 (so a
// GEMM against [W | bias] adds the bias, and the weight-gradient GEMM yields the bias gradient in
// that column); the other padding columns hold 0, so GEMMs can run over all ld (aligned) columns.
at::Tensor patchify(const at::Tensor& x5, const PatchGeometry& g, bool ones_column);

// The inverse: y5 [B, C, D, H, W] (contiguous) = the patches in the first K columns of q [B, N, *]
// (unit column stride), plus bias[C] when given. Every element of y5 is written.
void unpatchify(const at::Tensor& q, const PatchGeometry& g, const std::optional<at::Tensor>& bias,
                const at::Tensor& y5);

// Testing and benchmarking hook: whether the patch ops take the fused CUDA kernels (tiny and
// implicit GEMM) where they apply and their rule picks them (kAuto), wherever they apply (kAlways),
// or never (gather/scatter + GEMM everywhere). Returns the previous setting.
enum class FusedKernels { kNever, kAuto, kAlways };
FusedKernels set_fused_patch_kernels(FusedKernels mode);

// Testing hook: whether the implicit-GEMM forward, weight gradient and unembedding may take their
// wgmma kernels (built for sm_90a, run on a 9.0 GPU; else the mma.sync ones). On by default.
// Returns the previous setting.
bool set_implicit_wgmma(bool enabled);
bool implicit_wgmma_enabled();

#ifdef PATCHGEMM_WITH_CUDA
namespace cuda {
// The tiled kernels; false where they do not apply (the caller then runs the ATen version).
bool patchify(const at::Tensor& x5, const PatchGeometry& g, bool ones_column, const at::Tensor& p);
bool unpatchify(const at::Tensor& q, const PatchGeometry& g, const std::optional<at::Tensor>& bias,
                const at::Tensor& y5);

// The fused embedding for patches of at most 64 elements, 16-bit dtypes (tiny_patch_gemm.cu):
// y [B, E, N] (contiguous, channels-first) = patch_embed(x5, w2 [E, K], bias), with no patch matrix
// in global memory. false where it does not apply (the caller then gathers and runs the GEMM).
bool tiny_embed(const at::Tensor& x5, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                const PatchGeometry& g, const at::Tensor& y);

// Which bias gradient a weight gradient adds: none, patch_embed's (grad_y summed per embedding), or
// patch_unembed's, whose weight gradient this is with x and grad_y in swapped roles (x summed per
// channel).
enum class BiasGrad { kNone, kEmbed, kUnembed };

// The fused weight gradient for patches of at most 64 elements, 16-bit dtypes, kw = 2
// (tiny_patch_weight_grad.cu): (dW [E, K], dbias or undefined) of patch_embed(x5, ...) for grad_y,
// tokens [B, N, E] or channels-first [B, E, N], E <= 256, reading grad_y and x once. nullopt where
// it does not apply (the caller then gathers and runs the GEMM).
std::optional<std::tuple<at::Tensor, at::Tensor>> tiny_weight_grad(const at::Tensor& grad_y, bool tokens,
                                                                   const at::Tensor& x5, const PatchGeometry& g,
                                                                   int64_t E, BiasGrad bias);

// The fused unembedding for patches of at most 64 elements, 16-bit dtypes, kw even
// (tiny_patch_unembed.cu): y5 (g's volume, contiguous) = patch_unembed(x, w2 [C_in, K], bias) for x
// tokens [B, N, C_in] or channels-first [B, C_in, N], C_in <= 256, reading x once and writing y
// once. false where it does not apply (the caller then runs GEMM -> scatter).
bool tiny_unembed(const at::Tensor& x, bool tokens, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                  const PatchGeometry& g, const at::Tensor& y5);

// The implicit-GEMM embedding for 16-bit dtypes, kw even, w contiguous (implicit_patch_gemm.cu):
// y = patch_embed(x5, w2 [E, K], bias) as tokens [B, N, E] or channels-first [B, E, N] (contiguous),
// the patches read from x inside the GEMM. false where it does not apply or, unless `always`, where
// gather + cuBLAS is faster.
bool implicit_embed(const at::Tensor& x5, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                    const PatchGeometry& g, const at::Tensor& y, bool tokens_out, bool always);

// The implicit-GEMM weight gradient for 16-bit dtypes, kw = 2 (implicit_patch_weight_grad.cu; on
// Hopper kw % 4 == 0 too, and the bias gradient with it):
// (dW [E, K], dbias [E]) of patch_embed(x5, ...) for grad_y, tokens [B, N, E] or channels-first
// [B, E, N], the patches read from x inside the GEMM. dbias is undefined unless with_bias and the
// kernel computed it (the caller then sums grad_y). nullopt where it does not apply or, unless
// `always`, where gather + cuBLAS is faster.
std::optional<std::tuple<at::Tensor, at::Tensor>> implicit_weight_grad(const at::Tensor& grad_y, bool tokens,
                                                                       const at::Tensor& x5, const PatchGeometry& g,
                                                                       int64_t E, bool with_bias, bool always);

// The implicit-GEMM unembedding for 16-bit dtypes, kw = 2 (implicit_patch_unembed.cu; on Hopper
// kw = 4 too): y5 (g's
// volume, contiguous) = patch_unembed(x, w2 [C_in, K], bias) for x tokens [B, N, C_in] or
// channels-first [B, C_in, N], the GEMM's tiles scattered into y5 from its epilogue. false where it
// does not apply or, unless `always`, where GEMM + scatter is faster.
bool implicit_unembed(const at::Tensor& x, bool tokens, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                      const PatchGeometry& g, const at::Tensor& y5, bool always);
}  // namespace cuda
#endif

}  // namespace patchgemm
