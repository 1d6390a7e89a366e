// What the implicit-GEMM patch kernels share (implicit_patch_gemm*.cu: the forward;
// implicit_patch_weight_grad*.cu: the weight gradient; implicit_patch_unembed*.cu: the transpose),
// and with them the tiny-patch weight gradient and transpose (tiny_patch_*.cu): where a token's
// patch and a patch element sit in x, division-free index arithmetic, the host-side checks that
// x's strides allow reading patches as aligned runs, and the forward kernels' epilogue.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <optional>

#include <climits>
#include <cstdint>

#include "problems/patch_geometry.h"

namespace patchgemm {
namespace cuda {

struct Problem {
  int64_t stride[4];  // x5 strides of b, c, d, h in elements (w has stride 1)
  int kd, kh, kw;
  int K;              // patch size
  int ldw;            // weight row length: K rounded up to 8 (zero columns); the forward's only
  int E;
  int gh, gw, tokens;  // patch grid rows and columns, tokens per sample
  int64_t rows;        // B * tokens
  int interleaved;     // PatchGeometry::interleaved_channels: column k's channel is k % it where > 0
};

// n / d for 0 <= n < 2^31 by a multiply-high (Granlund and Montgomery), for coordinates that change
// every pipeline slice: integer division is a long instruction sequence.
struct FastDiv {
  uint32_t d, mul, shift;
  explicit FastDiv(uint32_t divisor) : d(divisor), shift(0) {
    while ((uint64_t{1} << shift) < d) ++shift;
    mul = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d) / d + 1);
  }
  __device__ __forceinline__ int operator()(int n) const {
    return static_cast<int>((__umulhi(static_cast<uint32_t>(n), mul) + static_cast<uint32_t>(n)) >> shift);
  }
  // The quotient; the remainder in `rem`.
  __device__ __forceinline__ int divmod(int n, int& rem) const {
    const int q = (*this)(n);
    rem = n - q * static_cast<int>(d);
    return q;
  }
};

// The tiny-patch kernels' walk over a problem's slices (runs of kSlice tokens of one sample, the
// last one of a sample possibly short): slices blockIdx.x, + gridDim.x, ... go to one block, so the
// blocks running at once read neighbouring slices (whole DRAM pages rather than 128 bytes here and
// there). Steps by mixed-radix addition: no divisions in the loop.
template <int kSlice>
struct SliceWalk {
  int b, s;                        // the current slice: sample b, its slice s (tokens kSlice s ..)
  int step_b, step_s, per_sample;  // gridDim.x slices as (samples, slices)

  __device__ __forceinline__ explicit SliceWalk(const FastDiv& slices_per_sample) {
    per_sample = static_cast<int>(slices_per_sample.d);
    b = slices_per_sample.divmod(blockIdx.x, s);
    step_b = slices_per_sample.divmod(gridDim.x, step_s);
  }
  // How many slices of `slices` this block walks.
  __device__ __forceinline__ static int count(int slices) {
    return (slices - static_cast<int>(blockIdx.x) + gridDim.x - 1) / gridDim.x;
  }
  __device__ __forceinline__ int t0() const { return s * kSlice; }
  __device__ __forceinline__ void next() {
    s += step_s, b += step_b;
    if (s >= per_sample) s -= per_sample, ++b;
  }
};

// The patch-row kernels' (*_rows_sm90.cu) walk over patch-grid rows: row r = (b, d, h) and the image
// row (of contiguous x viewed as [B*C*D*H, W]) where its patches start in channel 0, stepped row by
// row without divisions, the producer thread's per-slice work (divisions per box left it the
// bottleneck). Geometry: the kernel's, with x's C, D, H, the patch's kd, kh and the grid's gd, gh.
template <typename Geometry>
struct GridRowCursor {
  int r, d, h, origin;

  __device__ __forceinline__ GridRowCursor(const Geometry& g, int row) : r(row) {
    h = row % g.gh;
    const int rest = row / g.gh;
    d = rest % g.gd;
    origin = (rest / g.gd * g.C * g.D + d * g.kd) * g.H + h * g.kh;
  }
  __device__ __forceinline__ void next(const Geometry& g) {
    ++r, origin += g.kh;
    if (++h == g.gh) {
      h = 0, origin += g.kd * g.H - g.gh * g.kh;
      if (++d == g.gd) d = 0, origin += (g.C * g.D - g.gd * g.kd) * g.H;
    }
  }
};

// The kw = 2 pair-box kernels' tiles (implicit_patch_gemm_pairs_sm90.cu; the unembedding's TMA
// stores): 128 tokens = 128 / gw whole patch-grid rows of one depth plane of one sample, gw = 8, 16
// or 32 and gh a multiple of 128 / gw (pair_tiles_fit).
struct PairTiles {
  int per_sample, plane, gw;  // N / 128; gh * gw tokens per depth plane

  // Tile m's sample b, first token n0 (of N), depth plane z and first grid row y0.
  struct Origin {
    int b, n0, z, y0;
  };
  __device__ __forceinline__ Origin origin(int m) const {
    Origin o;
    o.b = m / per_sample;
    o.n0 = (m - o.b * per_sample) * 128;
    o.z = o.n0 / plane;
    o.y0 = (o.n0 - o.z * plane) / gw;
    return o;
  }
};

inline bool pair_tiles_fit(const Problem& p) {
  return p.kw == 2 && (p.gw == 8 || p.gw == 16 || p.gw == 32) && p.gh % (128 / p.gw) == 0;
}

inline PairTiles pair_tiles(const Problem& p) { return {p.tokens / 128, p.gh * p.gw, p.gw}; }

// Offset in x of the first element of token `row`'s patch.
__device__ __forceinline__ int64_t patch_origin(const Problem& p, int64_t row) {
  const int64_t b = row / p.tokens;
  const int n = static_cast<int>(row - b * p.tokens);
  const int nw = n % p.gw, nh = n / p.gw % p.gh, nd = n / p.gw / p.gh;
  return b * p.stride[0] + int64_t{nd} * p.kd * p.stride[2] + int64_t{nh} * p.kh * p.stride[3] +
         int64_t{nw} * p.kw;
}

// Offset in x of patch element k = (c, i, j, l) from the patch's first element (< 2^31: checked).
__device__ __forceinline__ int patch_offset(const Problem& p, int k) {
  const int l = k % p.kw, r = k / p.kw, j = r % p.kh, i = r / p.kh % p.kd, c = r / p.kh / p.kd;
  return static_cast<int>(c * p.stride[1] + i * p.stride[2] + j * p.stride[3] + l);
}

// patch_offset without divisions, for kernels that take it per store: multiply-high divisions by
// the patch's kw, kh and kd (built on the host). Also gives element k's channel (of a volume's own
// geometry, or interleaved in the rows of a channels_first_view).
struct PatchDivs {
  FastDiv kw, kh, kd;
  explicit PatchDivs(const Problem& p)
      : kw(static_cast<uint32_t>(p.kw)), kh(static_cast<uint32_t>(p.kh)), kd(static_cast<uint32_t>(p.kd)) {}

  __device__ __forceinline__ int channel(const Problem& p, int k) const {
    return p.interleaved > 0 ? k % p.interleaved : kd(kh(kw(k)));
  }
  __device__ __forceinline__ int offset(const Problem& p, int k) const {
    int l, j, i;
    const int c = kd.divmod(kh.divmod(kw.divmod(k, l), j), i);
    return static_cast<int>(c * p.stride[1] + i * p.stride[2] + j * p.stride[3] + l);
  }
};

// t itself where it is one contiguous, 16-byte aligned block (what the kernels' 16-byte copies and
// tensor maps read), else such a copy.
inline at::Tensor contiguous_aligned(const at::Tensor& t) {
  if (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// The geometry of x5 cut into g's patches for E embeddings; false where the kernels' index types
// cannot hold it (ints within a patch and a sample).
inline bool make_problem(const at::Tensor& x5, const PatchGeometry& g, int64_t E, Problem& p) {
  const int64_t K = g.patch_size(), N = g.tokens();
  const int64_t patch_extent = (g.channels - 1) * x5.stride(1) + (g.kernel[0] - 1) * x5.stride(2) +
                               (g.kernel[1] - 1) * x5.stride(3) + g.kernel[2];
  if (N >= (int64_t{1} << 30) || K >= (int64_t{1} << 30) || E >= (int64_t{1} << 30) || patch_extent >= INT_MAX) {
    return false;
  }
  for (int d = 0; d < 4; ++d) p.stride[d] = x5.size(d) > 1 ? x5.stride(d) : 0;
  p.kd = static_cast<int>(g.kernel[0]);
  p.kh = static_cast<int>(g.kernel[1]);
  p.kw = static_cast<int>(g.kernel[2]);
  p.K = static_cast<int>(K);
  p.ldw = p.K;
  p.E = static_cast<int>(E);
  p.gh = static_cast<int>(g.grid[1]);
  p.gw = static_cast<int>(g.grid[2]);
  p.tokens = static_cast<int>(N);
  p.rows = g.batch * N;
  p.interleaved = static_cast<int>(g.interleaved_channels);
  return true;
}

// Writes n 16-bit values (n = 8, 4, 2 or 1; dst aligned to n elements).
__device__ __forceinline__ void store_vector(uint16_t* dst, const uint16_t* src, int n) {
  switch (n) {
    case 8: *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src); break;
    case 4: *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src); break;
    case 2: *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src); break;
    default: *dst = *src;
  }
}

// The forward kernels' epilogue for a kTileM-token x kTileN-embedding tile at (m0, e0): results
// (bias added in fp32, rounded once) are staged in shared memory as [token][embedding] (tokens out)
// or [embedding][token] (channels-first), then leave in coalesced vectors of the final layout,
// tokens [B, N, E] or channels-first [B, E, N].
template <int kTileM, int kTileN>
struct EmbedEpilogue {
  static constexpr int kTokenPitch = kTileN + 8, kChannelPitch = kTileM + 8;  // 16-byte rows, no conflicts
  static constexpr int kBytes = 2 * (kTileM * kTokenPitch > kTileN * kChannelPitch ? kTileM * kTokenPitch
                                                                                   : kTileN * kChannelPitch);
  uint16_t* stage;
  bool tokens_out;

  // Stages the packed pair v of token m, embeddings n and n + 1 (tile coordinates).
  __device__ __forceinline__ void put(int m, int n, uint32_t v) const {
    if (tokens_out) {
      *reinterpret_cast<uint32_t*>(stage + m * kTokenPitch + n) = v;
    } else {
      stage[n * kChannelPitch + m] = static_cast<uint16_t>(v);
      stage[(n + 1) * kChannelPitch + m] = static_cast<uint16_t>(v >> 16);
    }
  }

  // After a barrier: every thread of the block writes its share of the staged tile.
  template <int kThreads>
  __device__ __forceinline__ void write(const Problem& p, int64_t m0, int e0, uint16_t* out) const {
    if (tokens_out) {  // y[row, e]: vectors of 8 embeddings
      constexpr int kVectors = kTileN / 8;
      const int vec = p.E % 8 == 0 ? 8 : 1;
      for (int u = threadIdx.x; u < kTileM * kVectors; u += kThreads) {
        const int m = u / kVectors, n = u % kVectors * 8;
        const int64_t row = m0 + m;
        if (row >= p.rows) continue;
        for (int s = 0; s < 8 && e0 + n + s < p.E; s += vec) {
          store_vector(out + row * p.E + e0 + n + s, stage + m * kTokenPitch + n + s, vec);
        }
      }
    } else {  // y[b, e, n]: vectors of up to 8 tokens, as long as the sample's row length allows
      constexpr int kVectors = kTileM / 8;
      const int vec = p.tokens % 8 == 0 ? 8 : p.tokens % 4 == 0 ? 4 : p.tokens % 2 == 0 ? 2 : 1;
      const int64_t b0 = m0 / p.tokens;
      const int n0 = static_cast<int>(m0 - b0 * p.tokens);
      for (int u = threadIdx.x; u < kTileN * kVectors; u += kThreads) {
        const int n = u / kVectors, m = u % kVectors * 8, e = e0 + n;
        if (e >= p.E) continue;
        for (int s = 0; s < 8 && m0 + m + s < p.rows; s += vec) {
          const int local = n0 + m + s;  // vectors never straddle two samples: tokens % vec == 0
          const int64_t b = b0 + local / p.tokens;
          store_vector(out + (b * p.E + e) * p.tokens + local % p.tokens, stage + n * kChannelPitch + m + s, vec);
        }
      }
    }
  }
};

// The weight-gradient kernels' tiles, mma.sync's and wgmma's alike: patch columns per block, and
// the tokens of a pipeline slice (implicit_weight_grad splits the tokens into ranges of whole slices).
constexpr int kWeightGradColumns = 128, kWeightGradTokens = 64;

// The forward on mma.sync (sm80/implicit_patch_gemm.cu), for a problem implicit_embed has checked
// and set up, as implicit_embed_sm90's below. false where it cannot run: the patch's runs do not fit
// in shared memory.
bool implicit_embed_mma(const Problem& p, int run, bool pair_major, const at::Tensor& x5, const at::Tensor& w,
                        const std::optional<at::Tensor>& bias, bool tokens_out, const at::Tensor& y);

// The weight gradient on mma.sync, kw = 2 pairs (sm80/implicit_patch_weight_grad.cu), for a problem
// implicit_weight_grad has checked and set up: grad_y dy contiguous and 16-byte aligned, tokens
// [B*N, E] or channels-first [B, E, N]; the fp32 partial sums [splits, E, K] of token ranges of
// `chunk` tokens into `partial`.
void implicit_weight_grad_mma(const Problem& p, bool tokens, const at::Tensor& x5, const at::Tensor& dy,
                              int64_t splits, int64_t chunk, const at::Tensor& partial);

// The unembedding on mma.sync, kw = 2 (sm80/implicit_patch_unembed.cu), for a problem
// implicit_unembed has checked and set up (its p; x contiguous, w2 [C_in, K]).
void implicit_unembed_mma(const Problem& p, bool tokens, const at::Tensor& x, const at::Tensor& w2,
                          const std::optional<at::Tensor>& bias, const at::Tensor& y5);

// The forward on Hopper's wgmma (implicit_patch_gemm_sm90.cu), for a problem implicit_embed has
// checked and set up: runs of `run` elements (pair-major copies where pair_major), w [E, p.ldw]
// contiguous. false where it cannot run: shared memory.
bool implicit_embed_sm90(const Problem& p, int run, bool pair_major, const at::Tensor& x5, const at::Tensor& w,
                         const std::optional<at::Tensor>& bias, bool tokens_out, const at::Tensor& y,
                         std::string& why);

// The forward on Hopper's wgmma with the patches by TMA, whole patch-grid rows per copy
// (implicit_patch_gemm_rows_sm90.cu), tokens out, for a problem implicit_embed has checked and set
// up. false where it does not apply: kw other than 8, 16, 32, 64; kh not a multiple of 64 / kw; x
// not contiguous; E % 8; grid rows wider than 128 patches; shared memory; with `ruled`, tiles that
// would leave a quarter of their MMA rows idle (slower than the other kernels there).
bool implicit_embed_rows_sm90(const Problem& p, const at::Tensor& x5, const at::Tensor& w,
                              const std::optional<at::Tensor>& bias, const at::Tensor& y, bool ruled,
                              std::string& why);
// Whether implicit_embed_rows_sm90 takes p (all but its launch's checks), with no allocation.
bool implicit_embed_rows_sm90_fits(const Problem& p, const at::Tensor& x5, bool ruled, std::string& why);

// The forward on Hopper's wgmma for kw = 2 with a K slice's patches by one TMA box
// (implicit_patch_gemm_pairs_sm90.cu), channels-first out y [B, E, N], for a problem implicit_embed
// has checked and set up. false where it does not apply: gw other than 8, 16, 32; gh not a
// multiple of 128 / gw; kd * kh not dividing 32, or C not a multiple of 32 / (kd * kh); E % 8; x not
// contiguous; shared memory.
bool implicit_embed_pairs_sm90(const Problem& p, const at::Tensor& x5, const at::Tensor& w,
                               const std::optional<at::Tensor>& bias, const at::Tensor& y, std::string& why);
// Whether implicit_embed_pairs_sm90 takes p (all but its launch's checks), with no allocation.
bool implicit_embed_pairs_sm90_fits(const Problem& p, const at::Tensor& x5, std::string& why);

// The weight gradient on Hopper's wgmma (implicit_patch_weight_grad_sm90.cu), runs of `run` (8: kw %
// 8 == 0; 4: kw % 4 == 0; 2: kw = 2 in pairs of 4 tokens, grid rows of 4k patches, K % 4 == 0), for
// a problem implicit_weight_grad has checked and set up: grad_y dy contiguous and 16-byte aligned,
// channels-first [B, E, N] copied dy_piece (8 or 4) tokens at a time, or tokens [B*N, E] (dy_piece
// 0); `out` the fp32 partial sums [splits, E, K], or dW [E, K] itself where splits = 1; db_partial
// (fp32 [splits * K / 128 rounded up, E]) the bias gradient's partial sums, or undefined. false
// where it cannot run: shared memory.
bool implicit_weight_grad_sm90(const Problem& p, int run, int dy_piece, const at::Tensor& x5, const at::Tensor& dy,
                               int64_t splits, int64_t chunk, const at::Tensor& out, const at::Tensor& db_partial);

// dW [E, K] and, where db is defined, dbias [E] (16-bit): the weight-gradient kernels' fp32 partial
// sums over their token ranges, dw_partial [ranges, E, K] (undefined where a kernel wrote dW itself,
// or where only a bias gradient is summed: column_sums.cu) and db_partial [db_ranges, E], added in a
// fixed order (sum_token_ranges.cu). E * K and E are multiples of 4.
void sum_token_ranges(const at::Tensor& dw_partial, const at::Tensor& db_partial, const at::Tensor& dw,
                      const at::Tensor& db);

// The weight gradient on Hopper's wgmma with the patches by TMA (implicit_patch_weight_grad_rows_sm90.cu)
// for tokens grad_y dy [B*N, E], a problem implicit_weight_grad has checked and set up: (dW [E, K],
// dbias [E] where with_bias, else undefined). nullopt where it does not apply: kw other than 16, 32,
// 64; kh not a multiple of 128 / kw; x or dy not contiguous and 16-byte aligned; E % 8; grid rows
// wider than 128 patches or too short for a slice's boxes to fit 3 slots; no tokens; or, with
// `ruled`, where its rule expects gather + cuBLAS to be faster.
std::optional<std::tuple<at::Tensor, at::Tensor>> implicit_weight_grad_rows_sm90(const Problem& p,
                                                                                const at::Tensor& x5,
                                                                                const at::Tensor& dy, bool with_bias,
                                                                                bool ruled, std::string& why);

// The unembedding on Hopper's wgmma (implicit_patch_unembed_sm90.cu), for a problem implicit_unembed
// has checked and set up (its p, x contiguous, w [C_in, K] contiguous). false where it cannot run:
// shared memory, or x and w not readable by TMA (channels-first needs N % 64 == 0; K % 8 == 0).
bool implicit_unembed_sm90(const Problem& p, bool tokens, const at::Tensor& x, const at::Tensor& w,
                           const std::optional<at::Tensor>& bias, const at::Tensor& y5, std::string& why);

}  // namespace cuda
}  // namespace patchgemm
