// Fused patch embedding into at most 8 embeddings (a head into a few channels, e.g. x [1, 1024,
// 224, 112] by 7 x 7 into E = 4): y = patches @ W^T (+ bias), tokens or channels-first.
//
// With so few outputs per patch the GEMM is a reduction over x: each element of x is read once and
// multiplied into E sums. The gather + GEMM path writes and reads the whole patch matrix again and
// runs a GEMM whose N is 1 to 8 (cuBLAS's tiles are mostly padding there); ATen's rewrite copies x
// the same way. Here a block takes a tile of consecutive patch columns of one row of patches, its
// threads reading x's rows along W (coalesced, through x's strides) for a share of the channels,
// each thread keeping E fp32 sums for the one token its column belongs to. The block sums its
// threads' partial sums per token in a fixed order in shared memory; where the channels are split
// over blocks to fill the GPU, each block writes its sums to an fp32 scratch and a second kernel
// adds the splits in order, so the result is the same on every run.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = kNarrowThreads;
constexpr int kUnroll = 8;  // channels read ahead per thread
// Each thread reads at least this many elements of x per block: fewer, and the block's fixed costs
// (the shared-memory sums, the scratch) outweigh its reads.
constexpr int64_t kMinReadsPerThread = 16;

// x5 [B, C, D, H, W] (its strides, 0 where a size is 1) cut into kd x kh x kw patches; tokens
// row-major over the grid (gd, gh, gw).
struct Narrow {
  int64_t stride[5];
  int64_t channels, K, tokens, batch;
  int kd, kh, kw, gd, gh, gw;
  int E;
  int tile_tokens;         // tokens of a block's tile (consecutive along gw)
  int lanes;               // threads per column: kThreads / (tile_tokens * kw)
  int tiles;               // tiles per row of patches: ceil(gw / tile_tokens)
  int64_t split_channels;  // channels per block (blockIdx.y splits them)
  bool tokens_out;         // y [B, N, E], else [B, E, N]
};

template <typename T>
__device__ __forceinline__ void store(T* p, float v) {
  if constexpr (std::is_same_v<T, float>) {
    *p = v;
  } else {
    *p = from_float<T>(v);
  }
}

template <typename T>
__device__ __forceinline__ void store_output(const Narrow& v, T* y, const T* bias, int64_t b, int64_t n, int e,
                                             float sum) {
  if (bias) sum += to_float(bias[e]);
  store(y + (v.tokens_out ? (b * v.tokens + n) * v.E + e : (b * v.E + e) * v.tokens + n), sum);
}

// blockIdx.x: (row of patches (b, pd, ph), tile along gw); blockIdx.y: the channel split. Writes the
// block's sums to `partials` [splits, B * N, E] where the channels are split, else y.
template <typename T, int E>
__global__ void __launch_bounds__(kThreads, 2) narrow_embed_kernel(Narrow v, const T* __restrict__ x,
                                                                const T* __restrict__ w, const T* bias,
                                                                float* partials, T* y) {
  __shared__ float sums[kThreads * kNarrowEmbeds];
  const int columns = v.tile_tokens * v.kw;
  const int t = threadIdx.x, column = t % columns, lane = t / columns;
  const int64_t tile = blockIdx.x % v.tiles, row = blockIdx.x / v.tiles;
  const int64_t ph = row % v.gh, pd = (row / v.gh) % v.gd, b = row / (int64_t(v.gh) * v.gd);
  const int64_t pw = tile * v.tile_tokens + column / v.kw;
  const int j = column % v.kw;

  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  if (lane < v.lanes && pw < v.gw) {
    const int64_t c_begin = blockIdx.y * v.split_channels + lane;
    const int64_t c_end = min(v.channels, (blockIdx.y + 1) * v.split_channels);
    const int64_t x_step = v.lanes * v.stride[1], w_step = v.lanes * int64_t(v.kd) * v.kh * v.kw;
    for (int id = 0; id < v.kd; ++id) {
      for (int ih = 0; ih < v.kh; ++ih) {
        // This thread's element of each of its channels' rows (id, ih): column (c, id, ih, j) of W.
        const T* xr = x + b * v.stride[0] + (pd * v.kd + id) * v.stride[2] + (ph * v.kh + ih) * v.stride[3] +
                      (pw * v.kw + j) * v.stride[4] + c_begin * v.stride[1];
        const T* wr = w + c_begin * v.kd * v.kh * v.kw + (id * v.kh + ih) * v.kw + j;
        int64_t c = c_begin;
        // kUnroll channels' loads in flight before their multiply-adds: one at a time, the reads
        // wait out the memory's latency in turn (a tenth of HBM's bandwidth).
        for (; c + (kUnroll - 1) * v.lanes < c_end; c += kUnroll * v.lanes) {
          float value[kUnroll];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) value[u] = to_float(xr[u * x_step]);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
            for (int e = 0; e < E; ++e) acc[e] = fmaf(value[u], to_float(__ldg(wr + u * w_step + e * v.K)), acc[e]);
          }
          xr += kUnroll * x_step;
          wr += kUnroll * w_step;
        }
        for (; c < c_end; c += v.lanes, xr += x_step, wr += w_step) {
          const float value = to_float(*xr);
#pragma unroll
          for (int e = 0; e < E; ++e) acc[e] = fmaf(value, to_float(__ldg(wr + e * v.K)), acc[e]);
        }
      }
    }
  }
#pragma unroll
  for (int e = 0; e < E; ++e) sums[t * kNarrowEmbeds + e] = acc[e];
  __syncthreads();
  // Each token of the tile: its columns' sums over lanes, then over j, in that fixed order.
  for (int o = t; o < v.tile_tokens * E; o += kThreads) {
    const int token = o / E, e = o % E;
    const int64_t w_index = tile * v.tile_tokens + token;
    if (w_index >= v.gw) continue;
    float sum = 0.f;
    for (int l = 0; l < v.lanes; ++l) {
      for (int jj = 0; jj < v.kw; ++jj) sum += sums[(l * columns + token * v.kw + jj) * kNarrowEmbeds + e];
    }
    const int64_t n = (pd * v.gh + ph) * v.gw + w_index;
    if (partials) {
      partials[(blockIdx.y * v.batch * v.tokens + b * v.tokens + n) * v.E + e] = sum;
    } else {
      store_output(v, y, bias, b, n, e, sum);
    }
  }
}

// y from the splits' partial sums, added in split order.
template <typename T>
__global__ void narrow_embed_sum_kernel(Narrow v, int splits, const float* __restrict__ partials, const T* bias,
                                        T* y) {
  const int64_t outputs = v.batch * v.tokens * v.E;
  for (int64_t o = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; o < outputs; o += int64_t(gridDim.x) * blockDim.x) {
    float sum = 0.f;
    for (int s = 0; s < splits; ++s) sum += partials[s * outputs + o];
    const int64_t e = o % v.E, bn = o / v.E;
    store_output(v, y, bias, bn / v.tokens, bn % v.tokens, static_cast<int>(e), sum);
  }
}

}  // namespace

bool narrow_embed(const at::Tensor& x5, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  const PatchGeometry& g, const at::Tensor& y, bool tokens_out, std::string& why) {
  const int64_t E = weight.size(0), K = g.patch_size(), N = g.tokens();
  const auto dtype = x5.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16 && dtype != at::kFloat) return decline(why, "16-bit and fp32 only");
  if (E < 1 || E > kNarrowEmbeds) return decline(why, "1 to 8 embeddings only");
  if (g.levels.size() != 1) return decline(why, "row-major token order only (no levels)");
  if (g.kernel[2] > kThreads) return decline(why, "kw of at most 256");
  if (x5.size(4) > 1 && x5.stride(4) != 1) return decline(why, "x's rows must be contiguous (W stride 1)");
  if (g.batch * N * K == 0) return decline(why, "empty problem");
  if (g.grid[0] * g.grid[1] * g.grid[2] > INT_MAX || g.grid[2] > INT_MAX) return decline(why, "grids of under 2^31");

  Narrow v{};
  for (int d = 0; d < 5; ++d) v.stride[d] = x5.size(d) == 1 ? 0 : x5.stride(d);
  v.channels = g.channels;
  v.K = K;
  v.tokens = N;
  v.batch = g.batch;
  v.kd = static_cast<int>(g.kernel[0]);
  v.kh = static_cast<int>(g.kernel[1]);
  v.kw = static_cast<int>(g.kernel[2]);
  v.gd = static_cast<int>(g.grid[0]);
  v.gh = static_cast<int>(g.grid[1]);
  v.gw = static_cast<int>(g.grid[2]);
  v.E = static_cast<int>(E);
  v.tile_tokens = static_cast<int>(narrow_tile_tokens(g));
  v.lanes = static_cast<int>(narrow_lanes(g));
  v.tiles = static_cast<int>((g.grid[2] + v.tile_tokens - 1) / v.tile_tokens);
  const int64_t rows = g.batch * g.grid[0] * g.grid[1] * v.tiles;  // blocks per split
  if (rows > INT_MAX) return decline(why, "too many patch rows for one grid");

  v.tokens_out = tokens_out;
  const c10::cuda::CUDAGuard guard(y.device());
  auto run = [&](auto tag, auto embeds) {
    using T = decltype(tag);
    constexpr int kEmbeds = decltype(embeds)::value;
    const auto kernel = narrow_embed_kernel<T, kEmbeds>;
    // Split the channels until the blocks fill one wave, each thread still reading a channel per
    // lane kUnroll times over and kMinReadsPerThread elements of x; a second wave of a few blocks
    // would cost as much as the first.
    const LaunchShape shape = prepare_launch(reinterpret_cast<const void*>(kernel), kThreads, 0);
    TORCH_CHECK(shape.blocks_per_sm > 0, "narrow_embed: no block of ", kThreads, " threads fits on this GPU");
    const int64_t wave = int64_t{shape.blocks_per_sm} * shape.sms;
    const int64_t rows_per_channel = int64_t(v.kd) * v.kh;
    const int64_t min_channels =
        v.lanes * std::max<int64_t>(kUnroll, (kMinReadsPerThread + rows_per_channel - 1) / rows_per_channel);
    int64_t splits = std::clamp<int64_t>(wave / rows, 1, std::max<int64_t>(1, g.channels / min_channels));
    splits = std::min<int64_t>(splits, 65535);
    v.split_channels = (g.channels + splits - 1) / splits;
    splits = (g.channels + v.split_channels - 1) / v.split_channels;

    const at::Tensor w = weight.reshape({E, K}).contiguous();
    const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
    at::Tensor partials;
    if (splits > 1) partials = at::empty({splits, g.batch * N, E}, x5.options().dtype(at::kFloat));
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const T* bias_ptr = bias ? static_cast<const T*>(b.const_data_ptr()) : nullptr;
    float* partial_ptr = splits > 1 ? partials.data_ptr<float>() : nullptr;
    kernel<<<dim3(static_cast<unsigned>(rows), static_cast<unsigned>(splits)), kThreads, 0, stream>>>(
        v, static_cast<const T*>(x5.const_data_ptr()), static_cast<const T*>(w.const_data_ptr()), bias_ptr,
        partial_ptr, static_cast<T*>(y.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (splits > 1) {
      const int64_t outputs = g.batch * N * E;
      const int64_t blocks = std::min<int64_t>((outputs + kThreads - 1) / kThreads, wave);
      narrow_embed_sum_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
          v, static_cast<int>(splits), partials.const_data_ptr<float>(), bias_ptr, static_cast<T*>(y.data_ptr()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    return true;
  };
  auto with_embeds = [&](auto tag) {
    switch (E) {
      case 1: return run(tag, std::integral_constant<int, 1>{});
      case 2: return run(tag, std::integral_constant<int, 2>{});
      case 3: return run(tag, std::integral_constant<int, 3>{});
      case 4: return run(tag, std::integral_constant<int, 4>{});
      case 5: return run(tag, std::integral_constant<int, 5>{});
      case 6: return run(tag, std::integral_constant<int, 6>{});
      case 7: return run(tag, std::integral_constant<int, 7>{});
      default: return run(tag, std::integral_constant<int, 8>{});
    }
  };
  if (dtype == at::kFloat) return with_embeds(float{});
  return dtype == at::kHalf ? with_embeds(__half{}) : with_embeds(__nv_bfloat16{});
}

}  // namespace cuda
}  // namespace patchgemm
