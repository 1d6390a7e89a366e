// Patchify (gather) and unpatchify (scatter): the data movement around the one GEMM of a
// kernel == stride convolution and its transpose, and the fused kernels' entry points. The patch
// matrix and its geometry: problems/patch_geometry.h.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "problems/patch_geometry.h"

namespace patchgemm {

// The patch matrix of x5 [B, C, D, H, W] (any strides): P [B, N, ld], ld = patch_row_width(K (+1)).
// The first K columns hold the patches; with `ones_column` column K holds 1 (so a
// GEMM against [W | bias] adds the bias, and the weight-gradient GEMM yields the bias gradient in
// that column); the other padding columns hold 0, so GEMMs can run over all ld (aligned) columns.
at::Tensor patchify(const at::Tensor& x5, const PatchGeometry& g, bool ones_column);

// The inverse: y5 [B, C, D, H, W] (contiguous, or channels-last with g.channels_last) = the patches in the first K
// columns of q [B, N, *] (unit column stride), plus bias[C] when given. Every element of y5 is written.
void unpatchify(const at::Tensor& q, const PatchGeometry& g, const std::optional<at::Tensor>& bias,
                const at::Tensor& y5);

namespace cpu {
// dst = src (same sizes and dtype, CPU) as copies of the runs where both have unit stride innermost
// (patchify_cpu.cpp); false where there is no such run or either is not on the CPU (the caller then
// runs ATen's copy).
bool copy_runs(const at::Tensor& dst, const at::Tensor& src);
}  // namespace cpu

#ifdef PATCHGEMM_WITH_CUDA
namespace cuda {
// The fused kernels' entry points. Each runs its kernel and returns true (or the gradients), or, where
// the kernel does not apply to the problem, returns false (nullopt) with the reason in `why` before
// anything runs. Which one runs where is chosen by the selection tables (selection/patch_tables.cpp),
// which hold the rules; a failure to launch is an error, never a false.

// Sets `why` and returns false (nullopt): an entry point's "does not apply".
inline bool decline(std::string& why, std::string reason) {
  why = std::move(reason);
  return false;
}
inline std::nullopt_t decline_grads(std::string& why, std::string reason) {
  why = std::move(reason);
  return std::nullopt;
}

// The tiled patchify / unpatchify (a gather or scatter for the GEMM paths); false where they do not
// apply (the caller then runs the ATen version).
bool patchify(const at::Tensor& x5, const PatchGeometry& g, bool ones_column, const at::Tensor& p);
bool unpatchify(const at::Tensor& q, const PatchGeometry& g, const std::optional<at::Tensor>& bias,
                const at::Tensor& y5);
// dst = src, both [B, R, S], where dst's rows (dim 2) and src's columns (dim 1) have unit stride: the
// tokens <-> channels-first layout change, as one tiled transpose (16- and 32-bit). False where it
// does not apply (the caller then runs ATen's copy).
bool transposing_copy(const at::Tensor& dst, const at::Tensor& src);
// w [rows, width] (contiguous) = [w2 | bias | 0] in one kernel: the GEMM paths' weight padded to an
// aligned row, w2 [rows, K] of any strides, the bias (of w2's dtype) as column K. False where it
// does not apply (the caller then runs the ATen version).
bool pad_weight(const at::Tensor& w2, const std::optional<at::Tensor>& bias, const at::Tensor& w);

// out [E] = rows [M, E] summed over its M rows (column_sums.cu; NVIDIA builds only): 16-bit, added
// in fp32 in a fixed order and rounded once, in one pass over rows. False where it does not apply
// (rows not 16-bit on the GPU, empty, E % 8, or rows with gaps between columns or not 16-byte
// aligned): the caller then runs ATen's reduction.
bool column_sums(const at::Tensor& rows, const at::Tensor& out);

// Whether the wgmma kernels (*_sm90.cu) run on the current device: built for sm_90a, on a 9.0 GPU.
bool wgmma_kernels_run_here(const at::Tensor& on);

// The fused embedding for patches of at most 64 elements (tiny_patch_gemm.cu): y [B, E, N]
// (contiguous, channels-first) = patch_embed(x5, w2 [E, K], bias), with no patch matrix in global
// memory.
bool tiny_embed(const at::Tensor& x5, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                const PatchGeometry& g, const at::Tensor& y, std::string& why);

// The fused embedding into at most kNarrowEmbeds embeddings (narrow_patch_gemm.cu): y =
// patch_embed(x5, weight [E, C, *k], bias), as tokens [B, N, E] (`tokens_out`) or channels-first
// [B, E, N], both contiguous; 16-bit and fp32 (fp32 sums, no TF32), x's rows contiguous,
// deterministic. Up to that many embeddings the forward is a reduction over x, read once.
constexpr int kNarrowEmbeds = 8;
constexpr int kNarrowThreads = 256;  // threads of a block
// A narrow block's tile: min(gw, 256 / kw) consecutive patches of one patch row, kw columns each.
// kw <= 256.
inline int64_t narrow_tile_tokens(const PatchGeometry& g) {
  return std::min<int64_t>(g.grid[2], kNarrowThreads / g.kernel[2]);
}
// The threads of a narrow block that share one column of its tile: each sums C / lanes of the channels.
inline int64_t narrow_lanes(const PatchGeometry& g) {
  return kNarrowThreads / (narrow_tile_tokens(g) * g.kernel[2]);
}
bool narrow_embed(const at::Tensor& x5, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const PatchGeometry& g, const at::Tensor& y, bool tokens_out, std::string& why);

// The implicit GEMMs (the patches read from x inside the GEMM) and their kernels: mma.sync (sm_80+),
// and on sm_90a wgmma with cp.async tiles, with whole patch rows by TMA (tokens out), or with pairs
// by TMA (kw = 2, channels-first out).
enum class Implicit { kMma, kSm90, kRowsSm90, kPairsSm90 };

// y = patch_embed(x5, w2 [E, K], bias) as tokens [B, N, E] or channels-first [B, E, N] (contiguous),
// 16-bit, kw even (implicit_patch_gemm.cu). kRowsSm90 writes tokens only and kPairsSm90
// channels-first only (kw = 2): the caller checks that. With `ruled`, the kernel's own tiling rule
// also declines (kRowsSm90: grid rows filling under 3/4 of a tile).
bool implicit_embed(Implicit kernel, const at::Tensor& x5, const at::Tensor& w2,
                    const std::optional<at::Tensor>& bias, const PatchGeometry& g, const at::Tensor& y,
                    bool tokens_out, bool ruled, std::string& why);
// Whether implicit_embed takes the problem (every check but its launch's: shared memory, 32-bit
// offsets, the bias's alignment), with no allocation: callers ask before making y and W.
bool implicit_embed_fits(Implicit kernel, const at::Tensor& x5, const PatchGeometry& g, int64_t E, bool ruled,
                         std::string& why);

// Which bias gradient a weight gradient adds: none, patch_embed's (grad_y summed per embedding), or
// patch_unembed's, whose weight gradient this is with x and grad_y in swapped roles (x summed per
// channel).
enum class BiasGrad { kNone, kEmbed, kUnembed };

// The fused weight gradient for patches of at most 64 elements, 16-bit, kw = 2
// (tiny_patch_weight_grad.cu): (dW [E, K], dbias or undefined) of patch_embed(x5, ...) for grad_y,
// tokens [B, N, E] or channels-first [B, E, N], E <= 256, reading grad_y and x once.
std::optional<std::tuple<at::Tensor, at::Tensor>> tiny_weight_grad(const at::Tensor& grad_y, bool tokens,
                                                                   const at::Tensor& x5, const PatchGeometry& g,
                                                                   int64_t E, BiasGrad bias, std::string& why);

// The implicit-GEMM weight gradient, 16-bit (implicit_patch_weight_grad.cu; kernels kMma, kSm90,
// kRowsSm90): (dW [E, K], dbias [E]) of patch_embed(x5, ...) for grad_y, tokens [B, N, E] or
// channels-first [B, E, N]. dbias is undefined unless with_bias and the kernel computed it (the
// caller then sums grad_y). With `ruled`, the kernel's own tiling rule also declines (kRowsSm90:
// tiles for too few SMs, too many boxes a slice).
std::optional<std::tuple<at::Tensor, at::Tensor>> implicit_weight_grad(Implicit kernel, const at::Tensor& grad_y,
                                                                       bool tokens, const at::Tensor& x5,
                                                                       const PatchGeometry& g, int64_t E,
                                                                       bool with_bias, bool ruled, std::string& why);

// The fused unembedding for patches of at most 64 elements, 16-bit, kw even (tiny_patch_unembed.cu):
// y5 (g's volume, contiguous) = patch_unembed(x, w2 [C_in, K], bias) for x tokens [B, N, C_in] or
// channels-first [B, C_in, N], C_in <= 256, reading x once and writing y once.
bool tiny_unembed(const at::Tensor& x, bool tokens, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                  const PatchGeometry& g, const at::Tensor& y5, std::string& why);
// Whether tiny_unembed takes the problem (all its checks), with no allocation: callers ask before
// making y and W.
bool tiny_unembed_fits(const at::Tensor& x, bool tokens, int64_t C_in, bool with_bias, const PatchGeometry& g,
                       std::string& why);

// The implicit-GEMM unembedding, 16-bit (implicit_patch_unembed.cu; kernels kMma for kw = 2, kSm90 for
// kw = 2 or 4): y5 = patch_unembed(x, w2 [C_in, K], bias), the GEMM's tiles scattered into y5 from
// its epilogue.
bool implicit_unembed(Implicit kernel, const at::Tensor& x, bool tokens, const at::Tensor& w2,
                      const std::optional<at::Tensor>& bias, const PatchGeometry& g, const at::Tensor& y5,
                      std::string& why);
}  // namespace cuda
#endif

}  // namespace patchgemm
