// The geometry of a kernel == stride convolution's patches, as every layer sees it: the op builds
// it, the selection rules read it, the host paths and the kernels cut volumes by it.
//
// A volume x[B, C, D, H, W] cut into non-overlapping kd x kh x kw patches is the patch matrix
// P[B, N, K]: one row per patch ("token"), K = C * kd * kh * kw columns in the conv weight's order
// (c, i, j, l), or for channels-last volumes in (i, j, l, c) order, which copies runs of kw * C
// values as they lie. 1-D and 2-D problems are 3-D ones with leading spatial sizes of 1.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <optional>
#include <utility>
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
  // The column order of P: (i, j, l, c) when true (the weight then as weight.permute(0, 2.., 1)),
  // else (c, i, j, l). Only the gather / scatter + GEMM paths take the channels-last order.
  bool channels_last = false;
  // Set by channels_first_view: the channels-first geometry of a channels-last volume, whose patch
  // rows interleave this many channels (column k of a patch holds channel k % interleaved_channels;
  // the unembedding's bias needs it). 0: a volume's own geometry.
  int64_t interleaved_channels = 0;

  int64_t tokens() const { return grid[0] * grid[1] * grid[2]; }
  int64_t patch_size() const { return channels * kernel[0] * kernel[1] * kernel[2]; }
};

// Elements per 16 bytes: patch-matrix rows are padded to a multiple so BLAS and the kernels see
// aligned rows.
int64_t row_alignment(const at::Tensor& like);

// The padded width of a patch-matrix row holding `values` elements: a multiple of row_alignment,
// and for 16-bit rows of 1024 values or more a multiple of 64 (cuBLAS's K tile), so that a GEMM
// reducing over the row has no partial K tile and never needs the split-K guard's second call
// (kernels/gemm/strided_gemm.h). fp32 rows stay as they are: their GEMMs pick slower kernels at whole
// 32-value tiles (P5 fp32, 3%).
int64_t patch_row_width(int64_t values, const at::Tensor& like);

// [B, C, *S] -> [B, C, D, H, W] (a view).
inline at::Tensor to_5d(const at::Tensor& t) {
  at::Tensor v = t;
  while (v.dim() < 5) v = v.unsqueeze(2);
  return v;
}

// The fused kernels read and write channels-first patches: columns (c, i, j, l), rows of kw unit-stride
// elements. A channels-last volume v5 [B, C, D, H, W] (channel stride 1, W stride C) cut into g's
// patches is such a volume too: [B, 1, D, H, W * C] cut into kd x kh x (kw * C) patches, whose
// columns (i, j, l') are the channels-last (i, j, l, c). That view and geometry; v5 and g themselves
// for a channels-first g; nullopt where v5's strides leave gaps between pixels (has_channels_first_view).
bool has_channels_first_view(const at::Tensor& v5, const PatchGeometry& g);
// That view's geometry (g itself for a channels-first g).
PatchGeometry channels_first_geometry(const PatchGeometry& g);
std::optional<std::pair<at::Tensor, PatchGeometry>> channels_first_view(const at::Tensor& v5, const PatchGeometry& g);

// Whether runs of v elements of x5 [B, C, D, H, W] are v-aligned wherever a patch row starts (the
// pointer and every stride that moves, in elements).
inline bool runs_aligned(const at::Tensor& x5, int v) {
  if (reinterpret_cast<uintptr_t>(x5.const_data_ptr()) % (x5.element_size() * v)) return false;
  for (int d = 0; d < 4; ++d) {
    if (x5.size(d) > 1 && x5.stride(d) % v) return false;
  }
  return true;
}

// The longest run of x5, 8, 4 or 2 elements, that divides kw and that runs_aligned allows; 0 if none.
inline int widest_run(const at::Tensor& x5, int64_t kw) {
  for (int v : {8, 4, 2}) {
    if (kw % v == 0 && runs_aligned(x5, v)) return v;
  }
  return 0;
}

}  // namespace patchgemm
