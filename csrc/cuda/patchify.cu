// Gather (patchify) and scatter (unpatchify) kernels.
//
// One thread block moves one tile: T consecutive patches along w (fixed b, nd, nh) times a chunk
// of Cc channels. The tile passes through shared memory in the patch matrix's layout, so both
// global sides are coalesced: the volume side reads (writes) runs of T*kw contiguous elements per
// (c, i, j) row (T*kw*C for channels-last input), the patch-matrix side Cc*kd*kh*kw contiguous
// elements per token. Data moves in 4-byte units where alignment allows (pairs of 16-bit
// elements), so a warp covers 128 contiguous bytes per access; the shared-memory row pitch is odd
// in units, so the transposing side is free of bank conflicts.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>
#include <cstdint>
#include <cstring>

#include "patchify.h"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxLevels = 4;
constexpr int64_t kTileBytes = 24 * 1024;    // shared memory per tile (several blocks per SM)
constexpr int64_t kMinRunBytes = 256;        // volume-side contiguous bytes per row we aim for

// Row of token (nd, nh, nw) within its batch: the digits of each grid coordinate, one per level
// (coarse first), weighted by the level-major row strides. A tile fixes (nd, nh), so the kernels
// take the (nd, nh) part once per tile and only the w part per token.
struct TokenOrder {
  int levels = 1;
  int size[kMaxLevels][3] = {};
  int64_t row_stride[kMaxLevels][3] = {};
};

__device__ __forceinline__ int64_t rows_of_dim(const TokenOrder& o, int d, int n) {
  int64_t row = 0;
  for (int l = o.levels - 1; l >= 0; --l) {
    const int s = o.size[l][d];
    row += (n % s) * o.row_stride[l][d];
    n /= s;
  }
  return row;
}

__device__ __forceinline__ int64_t w_rows(const TokenOrder& o, int nw) {
  return o.levels == 1 ? int64_t{nw} : rows_of_dim(o, 2, nw);
}

// Everything in "units" (the data moved per access: 1 or 2 elements).
struct Tiling {
  int64_t vol_stride[4] = {};  // of the volume [B, C, D, H]; W has unit stride (channels-first)
                               // or C elements (channels-last, where units are elements)
  int channels = 0;            // C
  int kd = 1, kh = 1, kw = 1;  // kw in units (channels-first)
  int kw_shift = -1;           // log2(kw) if kw is a power of two
  int64_t grid[3] = {};
  int tile_tokens = 1;         // T
  int tile_channels = 1;       // Cc
  int64_t w_tiles = 1, c_tiles = 1;
  int64_t ld = 0;              // patch-matrix row stride
  int64_t tokens = 0;          // N
  TokenOrder order;
};

struct Tile {
  int64_t b, row0;  // row0: first row of batch b's tokens with this tile's (nd, nh)
  int nd, nh, nw0;
  int count;   // tokens in this tile (the last along w may be short)
  int c0, cc;  // channel range
};

// 32-bit index math: the block count is below 2^31 (checked on the host).
__device__ __forceinline__ Tile decode_tile(const Tiling& t) {
  unsigned i = blockIdx.x;
  Tile tile;
  const unsigned ct = i % static_cast<unsigned>(t.c_tiles);
  i /= static_cast<unsigned>(t.c_tiles);
  const unsigned wt = i % static_cast<unsigned>(t.w_tiles);
  i /= static_cast<unsigned>(t.w_tiles);
  tile.nh = static_cast<int>(i % static_cast<unsigned>(t.grid[1]));
  i /= static_cast<unsigned>(t.grid[1]);
  tile.nd = static_cast<int>(i % static_cast<unsigned>(t.grid[0]));
  tile.b = i / static_cast<unsigned>(t.grid[0]);
  tile.nw0 = static_cast<int>(wt) * t.tile_tokens;
  const int left = static_cast<int>(t.grid[2]) - tile.nw0;
  tile.count = left < t.tile_tokens ? left : t.tile_tokens;
  tile.c0 = static_cast<int>(ct) * t.tile_channels;
  tile.cc = t.channels - tile.c0 < t.tile_channels ? t.channels - tile.c0 : t.tile_channels;
  tile.row0 = tile.b * t.tokens + rows_of_dim(t.order, 0, tile.nd) + rows_of_dim(t.order, 1, tile.nh);
  return tile;
}

__device__ __forceinline__ void split_w(int e, const Tiling& t, int& token, int& l) {
  token = t.kw_shift >= 0 ? e >> t.kw_shift : e / t.kw;
  l = e - token * t.kw;
}

// Patch-matrix side of a tile: token `tok` owns `row_units` contiguous units at column `col0`.
// Writing, the tile holding the last channels also fills the row's padding [pad_begin, ld):
// `pad_first` (the bits of a ones column, or 0) then zeros.
template <typename Unit, bool kToMatrix>
__device__ __forceinline__ void matrix_side(Unit* tile, int pitch, int row_units, int64_t col0,
                                            Unit* matrix, const Tiling& t, const Tile& tl,
                                            int64_t pad_begin = 0, Unit pad_first = 0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool pads = kToMatrix && tl.c0 + tl.cc == t.channels;
  for (int tok = warp; tok < tl.count; tok += kWarps) {
    const int64_t row = tl.row0 + w_rows(t.order, tl.nw0 + tok);
    Unit* m = matrix + row * t.ld + col0;
    Unit* s = tile + tok * pitch;
    for (int u = lane; u < row_units; u += 32) {
      if (kToMatrix) {
        m[u] = s[u];
      } else {
        s[u] = m[u];
      }
    }
    if (pads) {
      for (int64_t u = pad_begin + lane; u < t.ld; u += 32) {
        matrix[row * t.ld + u] = u == pad_begin ? pad_first : Unit(0);
      }
    }
  }
}

template <typename Unit>
__global__ void __launch_bounds__(kThreads)
    gather_channels_first(const Unit* __restrict__ x, Unit* __restrict__ p, int64_t pad_begin,
                          Unit pad_first, const Tiling t) {
  extern __shared__ __align__(16) unsigned char smem[];
  Unit* tile = reinterpret_cast<Unit*>(smem);
  const Tile tl = decode_tile(t);
  const int rows = tl.cc * t.kd * t.kh, row_units = rows * t.kw, pitch = row_units | 1;
  const int run = tl.count * t.kw;
  const Unit* base = x + tl.b * t.vol_stride[0] + tl.c0 * t.vol_stride[1] +
                     tl.nd * t.kd * t.vol_stride[2] + tl.nh * t.kh * t.vol_stride[3] +
                     tl.nw0 * t.kw;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += kWarps) {  // r = (c, i, j), the patch column r * kw + l
    const int j = r % t.kh, ci = r / t.kh, i = ci % t.kd, c = ci / t.kd;
    const Unit* src = base + c * t.vol_stride[1] + i * t.vol_stride[2] + j * t.vol_stride[3];
    for (int e = lane; e < run; e += 32) {
      int tok, l;
      split_w(e, t, tok, l);
      tile[tok * pitch + r * t.kw + l] = src[e];
    }
  }
  __syncthreads();
  matrix_side<Unit, true>(tile, pitch, row_units, int64_t{tl.c0} * t.kd * t.kh * t.kw,
                          p, t, tl, pad_begin, pad_first);
}

// Channels-last volume (c contiguous, w stride C): units are single elements and every tile holds
// all channels, so a (i, j) row is one run of T*kw*C contiguous elements.
template <typename Unit>
__global__ void __launch_bounds__(kThreads)
    gather_channels_last(const Unit* __restrict__ x, Unit* __restrict__ p, int64_t pad_begin,
                         Unit pad_first, const Tiling t) {
  extern __shared__ __align__(16) unsigned char smem[];
  Unit* tile = reinterpret_cast<Unit*>(smem);
  const Tile tl = decode_tile(t);
  const int C = t.channels, per_channel = t.kd * t.kh * t.kw;
  const int row_units = C * per_channel, pitch = row_units | 1;
  const int run = tl.count * t.kw * C;
  const Unit* base = x + tl.b * t.vol_stride[0] + tl.nd * t.kd * t.vol_stride[2] +
                     tl.nh * t.kh * t.vol_stride[3] + tl.nw0 * t.kw * C;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < t.kd * t.kh; r += kWarps) {  // r = (i, j)
    const int i = r / t.kh, j = r % t.kh;
    const Unit* src = base + i * t.vol_stride[2] + j * t.vol_stride[3];
    for (int e = lane; e < run; e += 32) {
      const int c = e % C;
      int tok, l;
      split_w(e / C, t, tok, l);
      tile[tok * pitch + c * per_channel + r * t.kw + l] = src[e];
    }
  }
  __syncthreads();
  matrix_side<Unit, true>(tile, pitch, row_units, 0, p, t, tl, pad_begin, pad_first);
}

// y (contiguous, channels-first) = the tile's patches (+ bias per channel).
template <typename scalar_t, typename Unit>
__global__ void __launch_bounds__(kThreads)
    scatter_channels_first(const Unit* __restrict__ q, Unit* __restrict__ y,
                           const scalar_t* __restrict__ bias, const Tiling t) {
  extern __shared__ __align__(16) unsigned char smem[];
  Unit* tile = reinterpret_cast<Unit*>(smem);
  const Tile tl = decode_tile(t);
  const int rows = tl.cc * t.kd * t.kh, row_units = rows * t.kw, pitch = row_units | 1;
  matrix_side<Unit, false>(tile, pitch, row_units, int64_t{tl.c0} * t.kd * t.kh * t.kw,
                           const_cast<Unit*>(q), t, tl);
  __syncthreads();
  constexpr int kPerUnit = sizeof(Unit) / sizeof(scalar_t);
  using opmath_t = at::opmath_type<scalar_t>;
  const int run = tl.count * t.kw;
  Unit* base = y + tl.b * t.vol_stride[0] + tl.c0 * t.vol_stride[1] +
               tl.nd * t.kd * t.vol_stride[2] + tl.nh * t.kh * t.vol_stride[3] + tl.nw0 * t.kw;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < rows; r += kWarps) {
    const int j = r % t.kh, ci = r / t.kh, i = ci % t.kd, c = ci / t.kd;
    Unit* dst = base + c * t.vol_stride[1] + i * t.vol_stride[2] + j * t.vol_stride[3];
    const opmath_t b = bias ? static_cast<opmath_t>(bias[tl.c0 + c]) : opmath_t(0);
    for (int e = lane; e < run; e += 32) {
      int tok, l;
      split_w(e, t, tok, l);
      Unit unit = tile[tok * pitch + r * t.kw + l];
      if (bias) {
        scalar_t* v = reinterpret_cast<scalar_t*>(&unit);
#pragma unroll
        for (int k = 0; k < kPerUnit; ++k) v[k] = static_cast<scalar_t>(static_cast<opmath_t>(v[k]) + b);
      }
      dst[e] = unit;
    }
  }
}

// ---- host side ----------------------------------------------------------------------------------

int64_t stride_or_zero(const at::Tensor& t, int d) { return t.size(d) == 1 ? 0 : t.stride(d); }

TokenOrder token_order(const PatchGeometry& g) {
  TokenOrder o;
  o.levels = static_cast<int>(g.levels.size());
  int64_t stride = 1;
  for (int l = o.levels - 1; l >= 0; --l) {
    for (int d = 2; d >= 0; --d) {
      o.size[l][d] = static_cast<int>(g.levels[l][d]);
      o.row_stride[l][d] = stride;
      stride *= g.levels[l][d];
    }
  }
  return o;
}

// Elements per unit: 2 for 16-bit data when every offset the kernel forms is even, else 1.
int elements_per_unit(const at::Tensor& vol, const at::Tensor& matrix, const PatchGeometry& g) {
  if (vol.element_size() != 2 || g.kernel[2] % 2 != 0) return 1;
  if (reinterpret_cast<uintptr_t>(vol.data_ptr()) % 4 || reinterpret_cast<uintptr_t>(matrix.data_ptr()) % 4)
    return 1;
  for (int d = 0; d < 4; ++d) {
    if (stride_or_zero(vol, d) % 2) return 1;
  }
  return matrix.stride(1) % 2 == 0 ? 2 : 1;
}

// Tile sizes for a channels-first volume: enough tokens for long contiguous volume runs, then as
// many channels as fit the shared-memory budget. False if one channel of one patch does not fit.
bool plan_tiles(Tiling& t, const PatchGeometry& g, int64_t unit_bytes, bool all_channels) {
  const int64_t per_channel = g.kernel[0] * g.kernel[1] * t.kw;  // units
  const int64_t run_tokens = (kMinRunBytes + t.kw * unit_bytes - 1) / (t.kw * unit_bytes);
  int64_t tokens = std::min<int64_t>(g.grid[2], std::max<int64_t>(1, run_tokens));
  const int64_t budget = kTileBytes / unit_bytes;
  int64_t channels = all_channels ? g.channels
                                  : std::min<int64_t>(g.channels, std::max<int64_t>(1, budget / (tokens * per_channel)));
  while (tokens > 1 && tokens * (channels * per_channel + 1) > budget) tokens = (tokens + 1) / 2;
  if (tokens * (channels * per_channel + 1) > budget) return false;
  t.tile_tokens = static_cast<int>(tokens);
  t.tile_channels = static_cast<int>(channels);
  t.w_tiles = (g.grid[2] + tokens - 1) / tokens;
  t.c_tiles = (g.channels + channels - 1) / channels;
  return g.batch * g.grid[0] * g.grid[1] * t.w_tiles * t.c_tiles <= INT_MAX;
}

Tiling base_tiling(const at::Tensor& vol, const at::Tensor& matrix, const PatchGeometry& g,
                   int per_unit) {
  Tiling t;
  for (int d = 0; d < 4; ++d) t.vol_stride[d] = stride_or_zero(vol, d) / per_unit;
  TORCH_INTERNAL_ASSERT(g.channels <= INT_MAX && g.kernel[0] * g.kernel[1] * g.kernel[2] <= INT_MAX);
  t.channels = static_cast<int>(g.channels);
  t.kd = static_cast<int>(g.kernel[0]);
  t.kh = static_cast<int>(g.kernel[1]);
  t.kw = static_cast<int>(g.kernel[2] / per_unit);
  t.kw_shift = (t.kw & (t.kw - 1)) == 0 ? __builtin_ctz(t.kw) : -1;
  for (int d = 0; d < 3; ++d) t.grid[d] = g.grid[d];
  t.ld = matrix.stride(1) / per_unit;
  t.tokens = g.tokens();
  t.order = token_order(g);
  return t;
}

int64_t smem_bytes(const Tiling& t, int64_t unit_bytes, int64_t row_units) {
  return t.tile_tokens * (row_units | 1) * unit_bytes;
}

// The bit pattern of 1 in `dtype` (as the low bits of a 64-bit word).
uint64_t one_as_bits(at::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: return c10::Half(1.0f).x;
    case at::kBFloat16: return c10::BFloat16(1.0f).x;
    case at::kFloat: { const float one = 1.0f; uint32_t bits; std::memcpy(&bits, &one, 4); return bits; }
    default: { const double one = 1.0; uint64_t bits; std::memcpy(&bits, &one, 8); return bits; }
  }
}

}  // namespace

bool patchify(const at::Tensor& x5_in, const PatchGeometry& g, bool ones_column,
              const at::Tensor& p) {
  if (g.patch_size() == 0 || g.levels.size() > kMaxLevels) return false;
  const c10::cuda::CUDAGuard guard(p.device());
  const bool w_contiguous = x5_in.size(4) == 1 || x5_in.stride(4) == 1;
  const bool channels_last = !w_contiguous && x5_in.stride(1) == 1 && x5_in.stride(4) == g.channels;
  // Any other strides: one copy to channels-first.
  const at::Tensor x5 = w_contiguous || channels_last ? x5_in : x5_in.contiguous();
  const int per_unit = channels_last ? 1 : elements_per_unit(x5, p, g);
  const int64_t unit_bytes = x5.element_size() * per_unit;
  Tiling t = base_tiling(x5, p, g, per_unit);
  if (!plan_tiles(t, g, unit_bytes, channels_last)) return false;
  const int64_t blocks = g.batch * g.grid[0] * g.grid[1] * t.w_tiles * t.c_tiles;
  const int64_t row_units = int64_t{t.tile_channels} * t.kd * t.kh * t.kw;
  const int64_t smem = smem_bytes(t, unit_bytes, row_units);
  // The padding's first element: 1 for a ones column, else 0 (in the low bits of its unit).
  const uint64_t one_bits = ones_column ? one_as_bits(x5.scalar_type()) : 0;
  auto run = [&](auto unit_tag) {
    using Unit = decltype(unit_tag);
    const Unit* x = static_cast<const Unit*>(x5.data_ptr());
    Unit* out = static_cast<Unit*>(p.data_ptr());
    auto kernel = channels_last ? gather_channels_last<Unit> : gather_channels_first<Unit>;
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
        x, out, g.patch_size() / per_unit, static_cast<Unit>(one_bits), t);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  switch (unit_bytes) {
    case 2: run(uint16_t{}); break;
    case 4: run(uint32_t{}); break;
    case 8: run(uint64_t{}); break;
    default: return false;
  }
  return true;
}

bool unpatchify(const at::Tensor& q, const PatchGeometry& g, const std::optional<at::Tensor>& bias,
                const at::Tensor& y5) {
  if (g.patch_size() == 0 || g.levels.size() > kMaxLevels || !y5.is_contiguous() ||
      q.stride(2) != 1) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(y5.device());
  const int per_unit = elements_per_unit(y5, q, g);
  const int64_t unit_bytes = y5.element_size() * per_unit;
  Tiling t = base_tiling(y5, q, g, per_unit);
  if (!plan_tiles(t, g, unit_bytes, false)) return false;
  const int64_t blocks = g.batch * g.grid[0] * g.grid[1] * t.w_tiles * t.c_tiles;
  const int64_t smem = smem_bytes(t, unit_bytes, int64_t{t.tile_channels} * t.kd * t.kh * t.kw);
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y5.scalar_type(), "patchgemm_unpatchify", [&] {
    const scalar_t* bias_ptr = bias ? b.const_data_ptr<scalar_t>() : nullptr;
    auto run = [&](auto unit_tag) {
      using Unit = decltype(unit_tag);
      scatter_channels_first<scalar_t, Unit>
          <<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
              static_cast<const Unit*>(q.const_data_ptr()), static_cast<Unit*>(y5.data_ptr()),
              bias_ptr, t);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if constexpr (sizeof(scalar_t) == 2) {
      per_unit == 2 ? run(uint32_t{}) : run(uint16_t{});
    } else if constexpr (sizeof(scalar_t) == 4) {
      run(uint32_t{});
    } else {
      run(uint64_t{});
    }
  });
  return true;
}

}  // namespace cuda
}  // namespace patchgemm
