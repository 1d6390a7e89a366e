// FP8 quantization. Current scaling in two kernels: amax(|x|), then the cast that reads it -- a flat
// one (each thread moves 16 bytes of x at a time) or one that also writes the transposed copy (and
// may sum x's columns on the way: an output gradient's bias gradient, without a pass of its own).
// The casts walk x from its end: the amax pass read that part last, so what of x the L2 still holds
// is read from there.
// Delayed scaling in one pass over x: the cast scales by the amax its history holds and observes x's
// own amax on the way; a one-block kernel then records it in the history (the amax kernel returns
// at once unless the history holds nothing yet, when it measures x as current scaling does). Every
// step rounds to nearest (explicit intrinsics: --use_fast_math would approximate and contract them),
// as ATen's reciprocal and multiplication do, so the result is bitwise quantize_fp8_aten's.
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_fp8.h>

#include <algorithm>

#include "kernels/quant/fp8.h"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// kVec consecutive values of x, and their kVec FP8 bytes, each moved as one aligned access.
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Vec {
  T v[kVec];
};
template <int kVec>
struct alignas(kVec) Bytes {
  __nv_fp8_storage_t v[kVec];
};

// 16 bytes of x: 4 float32 or 8 16-bit values.
template <typename T>
constexpr int kPack = 16 / sizeof(T);
template <typename T>
using Pack = Vec<T, kPack<T>>;

// Where a cast finds the amax it scales by, and where it records x's own. Current scaling: `amax`
// is the word amax_kernel measured x's amax into. Delayed: `amax` is the state's amax to scale
// from, and where that is 0 (nothing recorded yet) amax_kernel has measured x's amax into
// `measured` -- the same word as `observed`, which the cast's atomicMax then leaves unchanged.
struct AmaxWords {
  const unsigned int* amax;
  const unsigned int* measured;  // nullptr: none
  unsigned int* observed;        // nullptr: not asked
};

// The scale from amax's bits (amax / max; 1 for amax 0; NaN and inf carried) and its reciprocal,
// which every value is multiplied by before the saturating cast.
template <__nv_fp8_interpretation_t kFormat>
struct Scaling {
  float scale, inverse;
  __device__ __forceinline__ explicit Scaling(const AmaxWords& words) {
    constexpr float kMax = kFormat == __NV_E4M3 ? 448.f : 57344.f;
    const unsigned int bits = *words.amax;
    const float amax = __uint_as_float(bits != 0u || words.measured == nullptr ? bits : *words.measured);
    scale = amax == 0.f ? 1.f : __fdiv_rn(amax, kMax);
    inverse = __frcp_rn(scale);
  }
  template <typename T>
  __device__ __forceinline__ __nv_fp8_storage_t operator()(T v) const {
    return __nv_cvt_float_to_fp8(__fmul_rn(static_cast<float>(v), inverse), __NV_SATFINITE, kFormat);
  }
};

// The bits of |v|: non-negative floats order as their bit patterns, and a NaN (sign cleared) lies
// above +inf, so an integer max over them is amax with NaN propagated.
__device__ __forceinline__ unsigned int abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// The largest `local` of the block's threads, in thread 0 (every thread of the block must call it).
__device__ __forceinline__ unsigned int block_max(unsigned int local) {
  for (int offset = 16; offset > 0; offset /= 2) local = max(local, __shfl_xor_sync(0xffffffffu, local, offset));
  __shared__ unsigned int warps[kThreads / 32];
  if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = local;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w) local = max(local, warps[w]);
  }
  return local;
}

// The block's largest `local` max-ed into *amax_bits (every thread of the block must call it).
__device__ __forceinline__ void block_max_into(unsigned int local, unsigned int* amax_bits) {
  local = block_max(local);
  if (threadIdx.x == 0) atomicMax(amax_bits, local);
}

// amax_bits must hold 0 on entry; afterwards the bits of amax(|x|). Nothing where `unless_zero` is
// given and not 0 (delayed scaling with an amax to scale from).
template <typename T>
__global__ void __launch_bounds__(kThreads) amax_kernel(const T* __restrict__ x, int64_t n,
                                                          unsigned int* __restrict__ amax_bits,
                                                          const unsigned int* __restrict__ unless_zero) {
  if (unless_zero != nullptr && *unless_zero != 0u) return;  // (the same branch for the whole grid)
  using P = Pack<T>;
  constexpr int kSize = kPack<T>;
  unsigned int local = 0;
  const int64_t packs = n / kSize, stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  // kLoads packs in flight per thread: one 16-byte load at a time leaves HBM underused.
  constexpr int kLoads = 4;
  int64_t i = first;
  for (; i + (kLoads - 1) * stride < packs; i += kLoads * stride) {
    P p[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) p[k] = reinterpret_cast<const P*>(x)[i + k * stride];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
#pragma unroll
      for (int j = 0; j < kSize; ++j) local = max(local, abs_bits(static_cast<float>(p[k].v[j])));
    }
  }
  for (; i < packs; i += stride) {
    const P p = reinterpret_cast<const P*>(x)[i];
#pragma unroll
    for (int j = 0; j < kSize; ++j) local = max(local, abs_bits(static_cast<float>(p.v[j])));
  }
  for (int64_t i = packs * kSize + first; i < n; i += stride) local = max(local, abs_bits(static_cast<float>(x[i])));
  block_max_into(local, amax_bits);
}

// data = saturate(x * (1 / scale)), the scale as Scaling computes it from `words`. The scale goes to
// its own word: no block may overwrite amax's bits while another may still read them. With
// words.observed, the bits of x's own amax are max-ed into it on the way. Packs from the last.
template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads) cast_kernel(const T* __restrict__ x, int64_t n, AmaxWords words,
                                                          __nv_fp8_storage_t* __restrict__ data,
                                                          float* __restrict__ scale_out) {
  constexpr int kSize = kPack<T>;
  using Out = Bytes<kSize>;
  const Scaling<kFormat> quantize(words);
  const int64_t packs = n / kSize, stride = int64_t(gridDim.x) * kThreads;
  const int64_t first = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (first == 0) *scale_out = quantize.scale;
  unsigned int local = 0;
  for (int64_t step = first; step < packs; step += stride) {
    const int64_t i = packs - 1 - step;
    const Pack<T> p = reinterpret_cast<const Pack<T>*>(x)[i];
    Out o;
#pragma unroll
    for (int j = 0; j < kSize; ++j) {
      o.v[j] = quantize(p.v[j]);
      local = max(local, abs_bits(static_cast<float>(p.v[j])));
    }
    reinterpret_cast<Out*>(data)[i] = o;
  }
  for (int64_t i = packs * kSize + first; i < n; i += stride) {
    data[i] = quantize(x[i]);
    local = max(local, abs_bits(static_cast<float>(x[i])));
  }
  if (words.observed != nullptr) block_max_into(local, words.observed);  // (the same branch for the whole grid)
}

// A block's column sums of x[p] into parts_row[c0 ...]: each thread's kVec column sums (`sums`, of
// columns `column` ... of the tile) added across the lanes of its warp that hold the same columns (a
// butterfly from lane offset kFrom: each pair's sum the same both ways, so every lane ends with the
// same bits), written by the `lead` lane of each group into partial[slot], then partial's rows
// 0, kSlotStep, ... summed in order by the first threads. Every thread of the block calls it.
template <int kFrom, int kSlotStep, int kVec, int kSlots, int kCols>
__device__ __forceinline__ void store_column_sums(float (&sums)[kVec], bool lead, int slot, int column,
                                                  float (&partial)[kSlots][kCols], int64_t c0, int64_t C,
                                                  float* __restrict__ parts_row) {
#pragma unroll
  for (int offset = kFrom; offset < 32; offset *= 2) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) sums[j] = __fadd_rn(sums[j], __shfl_xor_sync(0xffffffffu, sums[j], offset));
  }
  if (lead) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) partial[slot][column + j] = sums[j];
  }
  __syncthreads();
  if (threadIdx.x < kCols && c0 + threadIdx.x < C) {
    float total = 0.f;
    for (int i = 0; i < kSlots; i += kSlotStep) total = __fadd_rn(total, partial[i][threadIdx.x]);
    parts_row[c0 + threadIdx.x] = total;
  }
  __syncthreads();
}

// The same cast for x viewed as [P, R, C], writing data [P, R, C] (if given) and data_t [P, C, R],
// where cast_transpose_8x8_kernel (below) does not apply (float32 x; R or C not multiples of 8):
// a block quantizes a 64 x 64 tile, reading x and writing data along C, and writes data_t from the
// tile in shared memory along R. kVec consecutive values per thread (8 where R and C are multiples
// of 8: 16-byte loads of 16-bit x, 8-byte stores both ways; 4 where they are multiples of 4; else 1),
// every load of a tile issued before the first store. With `sum_parts` [P, gridDim.y, C] (float32),
// a block also sums the columns of its tiles of each x[p], in registers in row order, then across the
// threads of a warp that hold the same columns (shuffles), then across warps, each step in a fixed
// order, and writes its partial sums there (the caller adds them up: no atomics, the same bits every
// run). `words` as cast_kernel's. At most 40 registers a thread, so that 6 blocks share an SM: the
// compiler's own choice (47) leaves 5, and the kernel moves a sixth less per second (8 would spill).
constexpr int kTile = 64;
constexpr int kCastTransposeBlocksPerSm = 6;

template <typename T, __nv_fp8_interpretation_t kFormat, int kVec>
__global__ void __launch_bounds__(kThreads, kCastTransposeBlocksPerSm)
    cast_transpose_kernel(const T* __restrict__ x, int64_t P, int64_t R, int64_t C, AmaxWords words,
                          __nv_fp8_storage_t* __restrict__ data, __nv_fp8_storage_t* __restrict__ data_t,
                          float* __restrict__ scale_out, float* __restrict__ sum_parts) {
  constexpr int kLanes = kTile / kVec, kRowsPerPass = kThreads / kLanes, kPasses = kTile / kRowsPerPass;
  constexpr int kRowsPerWarp = kLanes < 32 ? 32 / kLanes : 1;  // (threads of a warp with the same lane)
  // Rows of 68 bytes: 4-byte aligned, and the column reads of the transposed store spread over banks.
  __shared__ __align__(8) __nv_fp8_storage_t tile[kTile][kTile + 4];
  __shared__ float column_sums[kRowsPerPass][kTile];
  const Scaling<kFormat> quantize(words);
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *scale_out = quantize.scale;
  const int lane = threadIdx.x % kLanes, first_row = threadIdx.x / kLanes;
  const int64_t row_tiles = (R + kTile - 1) / kTile;
  const int64_t c0 = int64_t(blockIdx.x) * kTile;
  unsigned int local = 0;
  for (int64_t p = blockIdx.z; p < P; p += gridDim.z) {
    const T* in = x + p * R * C;
    float sums[kVec] = {};
    for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
      const int64_t r0 = rt * kTile, c = c0 + int64_t(lane) * kVec;  // C % kVec == 0: all kVec or none
      Vec<T, kVec> v[kPasses];
#pragma unroll
      for (int k = 0; k < kPasses; ++k) {
        const int64_t r = r0 + first_row + k * kRowsPerPass;
        if (r < R && c < C) v[k] = *reinterpret_cast<const Vec<T, kVec>*>(in + r * C + c);
      }
      if (sum_parts != nullptr) {
#pragma unroll
        for (int k = 0; k < kPasses; ++k) {
          if (r0 + first_row + k * kRowsPerPass < R && c < C) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) sums[j] = __fadd_rn(sums[j], static_cast<float>(v[k].v[j]));
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kPasses; ++k) {
        const int i = first_row + k * kRowsPerPass;
        const int64_t r = r0 + i;
        Bytes<kVec> q{};
        if (r < R && c < C) {
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            q.v[j] = quantize(v[k].v[j]);
            local = max(local, abs_bits(static_cast<float>(v[k].v[j])));
          }
          if (data != nullptr) *reinterpret_cast<Bytes<kVec>*>(data + p * R * C + r * C + c) = q;
        }
        // 4-byte pieces: a row of the tile is 68 bytes, so 8-byte pieces are not all 8-aligned.
#pragma unroll
        for (int j = 0; j < kVec; j += 4) {
          if constexpr (kVec >= 4) {
            *reinterpret_cast<Bytes<4>*>(&tile[i][lane * kVec + j]) = *reinterpret_cast<const Bytes<4>*>(&q.v[j]);
          } else {
            tile[i][lane * kVec + j] = q.v[j];
          }
        }
      }
      __syncthreads();
#pragma unroll
      for (int k = 0; k < kPasses; ++k) {  // row c0 + i of data_t[p], from column r0 + lane * kVec
        const int i = first_row + k * kRowsPerPass;
        const int64_t ct = c0 + i, r = r0 + int64_t(lane) * kVec;
        if (ct < C && r < R) {
          Bytes<kVec> q;
#pragma unroll
          for (int j = 0; j < kVec; ++j) q.v[j] = tile[lane * kVec + j][i];
          *reinterpret_cast<Bytes<kVec>*>(data_t + p * R * C + ct * R + r) = q;
        }
      }
      __syncthreads();
    }
    if (sum_parts != nullptr) {  // (the same branch for the whole block)
      // The rows first_row, first_row + kRowsPerPass / kRowsPerWarp, ... of a warp's lane, summed
      // by the butterfly, then the warps' rows in order.
      store_column_sums<kLanes, kRowsPerWarp>(sums, first_row % kRowsPerWarp == 0, first_row, lane * kVec, column_sums,
                                              c0, C, sum_parts + (p * gridDim.y + blockIdx.y) * C);
    }
  }
  if (words.observed != nullptr) block_max_into(local, words.observed);
}

// The transposing cast for 16-bit x whose R and C are multiples of 8 (data and data_t 8-byte
// aligned), with no shared memory for the data: a thread quantizes an 8 x 8 block of x[p] (eight
// 16-byte loads, all issued before the first use), writes its 8 rows to data and its 8 columns to
// data_t, transposing in registers (byte permutes of 4 x 4 bytes), 8 bytes a store. A warp's lanes
// hold 8 blocks along C (128-byte loads, 64-byte rows of data) and 4 along R (32-byte rows of
// data_t); a block's 8 warps stack along R: a 256 x 64 tile. Blocks run in reverse order of x's
// memory, so that the first to run read the end of x, the part amax_kernel read last (from L2
// where x is not much larger than it). Column sums as cast_transpose_kernel's, each thread's 8
// rows in row order, then across the warp's row groups (a butterfly), then across warps in order.
constexpr int kBlockRows = 8, kColGroups = 8, kRowGroups = 32 / kColGroups;
constexpr int kTile8x8Rows = kBlockRows * kRowGroups * (kThreads / 32), kTile8x8Cols = kBlockRows * kColGroups;

// The 4 x 4 bytes of rows a, b, c, d (a's byte j: row 0, column j) as columns: out[j] = rows 0..3 of column j.
__device__ __forceinline__ void transpose4x4(unsigned int a, unsigned int b, unsigned int c, unsigned int d,
                                             unsigned int (&out)[4]) {
  const unsigned int ab_lo = __byte_perm(a, b, 0x5140), ab_hi = __byte_perm(a, b, 0x7362);
  const unsigned int cd_lo = __byte_perm(c, d, 0x5140), cd_hi = __byte_perm(c, d, 0x7362);
  out[0] = __byte_perm(ab_lo, cd_lo, 0x5410);
  out[1] = __byte_perm(ab_lo, cd_lo, 0x7632);
  out[2] = __byte_perm(ab_hi, cd_hi, 0x5410);
  out[3] = __byte_perm(ab_hi, cd_hi, 0x7632);
}

template <typename T, __nv_fp8_interpretation_t kFormat>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_8x8_kernel(const T* __restrict__ x, int64_t P, int64_t R, int64_t C, AmaxWords words,
                              __nv_fp8_storage_t* __restrict__ data, __nv_fp8_storage_t* __restrict__ data_t,
                              float* __restrict__ scale_out, float* __restrict__ sum_parts) {
  static_assert(sizeof(T) == 2, "16-bit x: a 16-byte load is one row of a block");
  constexpr int kWarps = kThreads / 32;
  __shared__ float column_sums[kWarps][kTile8x8Cols];
  const Scaling<kFormat> quantize(words);
  if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 && threadIdx.x == 0) *scale_out = quantize.scale;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int col_group = lane % kColGroups, row_group = lane / kColGroups;
  const int64_t c0 = int64_t(gridDim.x - 1 - blockIdx.x) * kTile8x8Cols, c = c0 + col_group * kBlockRows;
  const int64_t row_tiles = (R + kTile8x8Rows - 1) / kTile8x8Rows;
  unsigned int local = 0;
  for (int64_t pi = blockIdx.z; pi < P; pi += gridDim.z) {
    const int64_t p = P - 1 - pi;
    const T* in = x + p * R * C;
    float sums[kBlockRows] = {};
    for (int64_t ti = blockIdx.y; ti < row_tiles; ti += gridDim.y) {
      const int64_t r = (row_tiles - 1 - ti) * kTile8x8Rows + (warp * kRowGroups + row_group) * kBlockRows;
      if (r >= R || c >= C) continue;  // R % 8 == C % 8 == 0: the block is all in x or all out
      Vec<T, kBlockRows> v[kBlockRows];
#pragma unroll
      for (int k = 0; k < kBlockRows; ++k) v[k] = *reinterpret_cast<const Vec<T, kBlockRows>*>(in + (r + k) * C + c);
      unsigned int rows[kBlockRows][2];  // row k's 8 bytes: columns 0-3, 4-7
#pragma unroll
      for (int k = 0; k < kBlockRows; ++k) {
        Bytes<kBlockRows> q;
#pragma unroll
        for (int j = 0; j < kBlockRows; ++j) {
          q.v[j] = quantize(v[k].v[j]);
          local = max(local, abs_bits(static_cast<float>(v[k].v[j])));
          if (sum_parts != nullptr) sums[j] = __fadd_rn(sums[j], static_cast<float>(v[k].v[j]));
        }
        const uint2 word = *reinterpret_cast<const uint2*>(&q);
        rows[k][0] = word.x;
        rows[k][1] = word.y;
        if (data != nullptr) *reinterpret_cast<uint2*>(data + p * R * C + (r + k) * C + c) = word;
      }
#pragma unroll
      for (int half = 0; half < 2; ++half) {  // columns 4 * half .. 4 * half + 3
        unsigned int top[4], bottom[4];        // rows 0-3 and 4-7 of each column
        transpose4x4(rows[0][half], rows[1][half], rows[2][half], rows[3][half], top);
        transpose4x4(rows[4][half], rows[5][half], rows[6][half], rows[7][half], bottom);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          *reinterpret_cast<uint2*>(data_t + p * R * C + (c + 4 * half + j) * R + r) = make_uint2(top[j], bottom[j]);
        }
      }
    }
    if (sum_parts != nullptr) {  // (the same branch for the whole block)
      store_column_sums<kColGroups, 1>(sums, row_group == 0, warp, col_group * kBlockRows, column_sums, c0, C,
                                       sum_parts + (p * gridDim.y + blockIdx.y) * C);
    }
  }
  if (words.observed != nullptr) block_max_into(local, words.observed);
}

// Records an observed amax in a delayed-scaling state (one block of kThreads):
// state = [amax to scale from, observed amax's bits, history[L] newest first]. history becomes
// [observed, history[0 .. L-2]], the amax to scale from its max (NaN propagated: abs_bits' order),
// and the observed word 0 again for the next cast.
constexpr int kMaxHistory = static_cast<int>(kMaxAmaxHistory);
static_assert(kMaxHistory % kThreads == 0);

__global__ void __launch_bounds__(kThreads) record_amax_kernel(float* __restrict__ state, int length) {
  unsigned int* bits = reinterpret_cast<unsigned int*>(state);
  float* history = state + 2;
  constexpr int kPer = kMaxHistory / kThreads;
  float shifted[kPer];
  unsigned int local = 0;
#pragma unroll
  for (int k = 0; k < kPer; ++k) {  // every read before any write
    const int i = threadIdx.x + k * kThreads;
    shifted[k] = i == 0 ? __uint_as_float(bits[1]) : (i < length ? history[i - 1] : 0.f);
    if (i < length) local = max(local, abs_bits(shifted[k]));
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int i = threadIdx.x + k * kThreads;
    if (i < length) history[i] = shifted[k];
  }
  local = block_max(local);
  if (threadIdx.x == 0) {
    bits[0] = local;
    bits[1] = 0u;
  }
}

}  // namespace

void quantize_fp8_into(const at::Tensor& x, const at::Tensor& data, const at::Tensor& data_t, const at::Tensor& scale,
                       const at::Tensor& sums, const at::Tensor& amax_state) {
  TORCH_INTERNAL_ASSERT(x.is_contiguous() && scale.scalar_type() == at::kFloat && scale.numel() == 1);
  TORCH_INTERNAL_ASSERT(data.defined() || data_t.defined());
  const at::Tensor& some = data.defined() ? data : data_t;
  const bool e4m3 = some.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_INTERNAL_ASSERT(e4m3 || some.scalar_type() == at::kFloat8_e5m2);
  const bool delayed = amax_state.defined();
  TORCH_INTERNAL_ASSERT(!delayed || (amax_state.scalar_type() == at::kFloat && amax_state.is_contiguous() &&
                                     amax_state.numel() >= 3 && amax_state.numel() - 2 <= kMaxHistory));
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t n = x.numel();
  // Current scaling: amax's bits live apart from the scale until the cast has read them (one
  // allocation, one memset). Delayed: the state's words (AmaxWords says how they are read).
  const at::Tensor amax_bits = delayed ? at::Tensor() : at::zeros({1}, x.options().dtype(at::kInt));
  auto* state = delayed ? reinterpret_cast<unsigned int*>(amax_state.mutable_data_ptr<float>()) : nullptr;
  auto* measure_into = delayed ? state + 1 : reinterpret_cast<unsigned int*>(amax_bits.mutable_data_ptr<int>());
  const AmaxWords words = delayed ? AmaxWords{state, state + 1, state + 1} : AmaxWords{measure_into, nullptr, nullptr};
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t pack = 16 / x.element_size();
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((n / pack + kThreads - 1) / kThreads, 8 * sms));
  // Pack loads need x 16-byte aligned (the caller checks), as do the flat cast's pack stores.
  TORCH_INTERNAL_ASSERT(reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0);
  auto* out = data.defined() ? reinterpret_cast<__nv_fp8_storage_t*>(data.mutable_data_ptr()) : nullptr;
  float* scale_out = scale.mutable_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "quantize_fp8", [&] {
    const auto* in = x.const_data_ptr<scalar_t>();
    if (n > 0) {
      amax_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(in, n, measure_into, state);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (!data_t.defined()) {  // the flat cast, 16 bytes of x per thread
      TORCH_INTERNAL_ASSERT(data.is_contiguous() && data.numel() == n &&
                            reinterpret_cast<uintptr_t>(data.const_data_ptr()) % 16 == 0);
      if (sums.defined()) sums.copy_(x.sum(-2));  // (no pass of ours reads x by columns)
      if (e4m3) {
        cast_kernel<scalar_t, __NV_E4M3><<<blocks, kThreads, 0, stream>>>(in, n, words, out, scale_out);
      } else {
        cast_kernel<scalar_t, __NV_E5M2><<<blocks, kThreads, 0, stream>>>(in, n, words, out, scale_out);
      }
    } else {  // [P, R, C] as the last two dims and the rest
      const int64_t C = x.dim() >= 1 ? x.size(-1) : 1, R = x.dim() >= 2 ? x.size(-2) : 1;
      const int64_t P = (R * C) ? n / (R * C) : 0;
      TORCH_INTERNAL_ASSERT(data_t.is_contiguous() && data_t.numel() == n);
      auto* out_t = reinterpret_cast<__nv_fp8_storage_t*>(data_t.mutable_data_ptr());
      const auto fits = [&](int64_t vec) {
        return R % vec == 0 && C % vec == 0 && reinterpret_cast<uintptr_t>(out_t) % vec == 0 &&
               (out == nullptr || reinterpret_cast<uintptr_t>(out) % vec == 0);
      };
      const bool blocks8x8 = x.element_size() == 2 && fits(8);
      const int64_t tile_c = blocks8x8 ? kTile8x8Cols : kTile, tile_r = blocks8x8 ? kTile8x8Rows : kTile;
      const int64_t col_tiles = (C + tile_c - 1) / tile_c, row_tiles = (R + tile_r - 1) / tile_r;
      TORCH_CHECK(col_tiles <= INT32_MAX, "quantize_fp8: x's last dim ", C, " is too long to transpose");
      const int64_t row_blocks = std::clamp<int64_t>(row_tiles, 1, 65535);
      const dim3 grid(static_cast<unsigned>(std::max<int64_t>(col_tiles, 1)), static_cast<unsigned>(row_blocks),
                      static_cast<unsigned>(std::clamp<int64_t>(P, 1, 65535)));
      // One partial sum per block and column: a 64th of x's rows in float32 (1/32 of a 16-bit x's
      // bytes), whatever the grid; blocks that sum several row tiles (R past 65535 tiles) keep fewer.
      const at::Tensor sum_parts =
          sums.defined() ? at::empty({P, row_blocks, C}, x.options().dtype(at::kFloat)) : at::Tensor();
      float* parts = sums.defined() ? sum_parts.mutable_data_ptr<float>() : nullptr;
      // kVec values per thread where every kVec-value group starts kVec-aligned in x, data and data_t.
      const bool by8 = fits(8), by4 = fits(4);
      const auto launch = [&](auto kernel) {
        kernel<<<grid, kThreads, 0, stream>>>(in, P, R, C, words, out, out_t, scale_out, parts);
      };
      // (a generic lambda, so that 32- and 64-bit x instantiate no 8 x 8 kernel)
      const auto launch8x8 = [&](auto value) {
        using T = decltype(value);
        if constexpr (sizeof(T) == 2) {
          e4m3 ? launch(cast_transpose_8x8_kernel<T, __NV_E4M3>) : launch(cast_transpose_8x8_kernel<T, __NV_E5M2>);
        }
      };
      if (blocks8x8) {
        launch8x8(scalar_t{});
      } else if (e4m3) {
        by8   ? launch(cast_transpose_kernel<scalar_t, __NV_E4M3, 8>)
        : by4 ? launch(cast_transpose_kernel<scalar_t, __NV_E4M3, 4>)
              : launch(cast_transpose_kernel<scalar_t, __NV_E4M3, 1>);
      } else {
        by8   ? launch(cast_transpose_kernel<scalar_t, __NV_E5M2, 8>)
        : by4 ? launch(cast_transpose_kernel<scalar_t, __NV_E5M2, 4>)
              : launch(cast_transpose_kernel<scalar_t, __NV_E5M2, 1>);
      }
      if (sums.defined()) {
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        // Rounded once into x's dtype; no rows (R = 0, so P = 0): zeros.
        P > 0 ? sums.view({P, C}).copy_(sum_parts.sum(1)) : sums.zero_();
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  if (delayed) {  // after the cast, on its stream: the history gains this call's amax
    record_amax_kernel<<<1, kThreads, 0, stream>>>(amax_state.mutable_data_ptr<float>(),
                                                   static_cast<int>(amax_state.numel() - 2));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace cuda
}  // namespace patchgemm
