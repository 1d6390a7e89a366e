// Fused unembedding (the transpose) for patches of at most 64 elements from up to 512 input
// channels, 16-bit, kw even (U2's ConvTranspose3d(192, 4, 2), a decoder's last layer, and so the
// input gradient of the tiny embeddings):
//   y[b, :, patch of token n] = x[b, :, n] @ W [C_in, K] (+ bias), the patch scattered into y.
// The GEMM is thin (K outputs per C_in inputs), so GEMM -> scatter moves the patch matrix through
// HBM twice for nothing; here one kernel reads x once and writes y once.
//
// Every block walks its share of the 64-token slices (SliceWalk, implicit_patch.cuh), copied by a
// 2-stage cp.async pipeline; W^T [K][C_in] stays in shared memory. Two blocks share an SM where
// they fit (C_in up to 256), so their barriers and store phases interleave (faster than one block
// of 4 stages per SM). A slice is one product
// Q [64 tokens, K] = X [64, C_in] @ W: 8 warps of mma.sync, warp w the 16 tokens of m-tile w % 4 and
// half the patch's n-tiles, the whole C_in reduction. x channels-first [c][token] is read by
// ldmatrix.trans, tokens [token][c] by ldmatrix. An accumulator pair (patch columns 2q, 2q + 1) is
// the (l, l + 1) pair of one y row (kw even), so it leaves as one 4-byte store: 8 lanes write 32
// contiguous bytes (whole sectors) of a row.
#include <ATen/ATen.h>

#include "kernels/patch/patchify.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "kernels/patch/implicit_patch.cuh"
#include "kernels/primitives/launch_setup.cuh"
#include "kernels/primitives/mma.cuh"

namespace patchgemm {
namespace cuda {
namespace {

constexpr int kThreads = 256;  // 8 warps: 4 m-tiles of tokens x 2 halves of the patch columns
constexpr int kSlice = 64;             // tokens per pipeline stage: 4 m-tiles
constexpr int kStages = 2;
constexpr int kMaxK = 64, kMaxC = 512;  // patch columns (8 n-tiles), input channels
constexpr int kRowPitch = kSlice + 8;   // elements of a channels-first x row (144 bytes)

// y's geometry: [B, C_out, D, H, W] contiguous, patches kd x kh x kw, the patch grid gd x gh x gw.
struct Output {
  int K, C_in, C_out, kd, kh, kw, tokens;
  int64_t plane, row, volume;  // H * W, W, D * H * W
};

// Shared memory: W^T [Kp][Cp + 8], then kStages slots of x (Cp = C_in rounded up to 16, Kp = 16
// columns per n-tile of a warp: 32 or 64).
struct Layout {
  int cp, kp, w_pitch, x_pitch, w_bytes, slot_bytes;
  Layout(int C_in, bool tokens, int tiles_n) {
    cp = (C_in + 15) / 16 * 16;
    kp = 16 * tiles_n;
    w_pitch = cp + 8;  // an odd count of 16 bytes: conflict-free ldmatrix
    x_pitch = tokens ? cp + 8 : kRowPitch;
    w_bytes = kp * w_pitch * 2;
    slot_bytes = (tokens ? kSlice : cp) * x_pitch * 2;
  }
};

// kTilesN: n-tiles (8 patch columns) per warp, 2 (K <= 32) or 4 (K <= 64). kPiece: the tokens per
// copy of channels-first x, 8 (16 bytes) where N % 8 == 0, else 4 (N % 4 == 0: rows 8-byte aligned).
template <typename T, bool kTokensX, int kTilesN, int kPiece>
__global__ void __launch_bounds__(kThreads, 2)
    tiny_unembed_kernel(Output o, Layout s, FastDiv per_sample, FastDiv gw, FastDiv gh, int slices,
                        const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                        T* __restrict__ y) {
#if __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) unsigned char smem[];
  const uint32_t base = smem_address(smem), x_base = base + s.w_bytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  // W^T, zero past K and C_in; x's slots zero where no copy ever lands (channels past C_in).
  T* wt = reinterpret_cast<T*>(smem);
  for (int i = threadIdx.x; i < s.kp * s.cp; i += kThreads) {
    const int k = i / s.cp, c = i % s.cp;
    wt[k * s.w_pitch + c] = k < o.K && c < o.C_in ? w[int64_t{c} * o.K + k] : zero<T>();
  }
  for (int i = threadIdx.x; i < kStages * s.slot_bytes / 16; i += kThreads) {
    reinterpret_cast<uint4*>(smem + s.w_bytes)[i] = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();  // before any copy lands in a slot

  const int k_tiles = SliceWalk<kSlice>::count(slices);
  SliceWalk<kSlice> loading(per_sample), storing(per_sample);  // the next slice to load, to store

  auto load_slice = [&](int slot) {
    const int t0 = loading.t0(), count = min(kSlice, o.tokens - t0);
    const uint32_t dst = x_base + slot * s.slot_bytes;
    if constexpr (kTokensX) {  // rows of tokens, 16-byte pieces of 8 channels (C_in % 8 == 0)
      const int pieces = o.C_in / 8;
      const T* rows = x + (int64_t{loading.b} * o.tokens + t0) * o.C_in;
      for (int i = threadIdx.x; i < kSlice * pieces; i += kThreads) {
        const int t = i / pieces, c = i % pieces * 8;
        cp_async<16>(dst + (t * s.x_pitch + c) * 2, t < count ? rows + t * o.C_in + c : x, t < count);
      }
    } else {  // rows of channels, pieces of kPiece tokens (count is a multiple of kPiece)
      constexpr int kPieces = kSlice / kPiece;  // per row of the slice
      const int t = threadIdx.x % kPieces * kPiece;
      const T* row = x + (int64_t{loading.b} * o.C_in + threadIdx.x / kPieces) * o.tokens + t0 + t;
      for (int c = threadIdx.x / kPieces; c < o.C_in;
           c += kThreads / kPieces, row += int64_t{kThreads / kPieces} * o.tokens) {
        cp_async<kPiece * 2>(dst + (c * kRowPitch + t) * 2, t < count ? row : x, t < count);
      }
    }
    loading.next();
  };

  // This warp: tokens 16 mt .. of the slice, n-tiles nt0 .. nt0 + kTilesN - 1 (patch columns 8 n ..).
  const int mt = warp % 4, nt0 = warp / 4 * kTilesN;
  // The y offset of this lane's patch-column pairs (2q, 2q + 1 of n-tile nt0 + j: a (co, i, jj, l)
  // with l even) within a patch, and their bias.
  int64_t col_offset[kTilesN];
  float col_bias[kTilesN];
  bool col_valid[kTilesN];
#pragma unroll
  for (int j = 0; j < kTilesN; ++j) {
    const int k = (nt0 + j) * 8 + 2 * q, l = k % o.kw, r = k / o.kw, jj = r % o.kh, i = r / o.kh % o.kd,
              co = r / o.kh / o.kd;
    col_valid[j] = k < o.K;
    col_offset[j] = co * o.volume + i * o.plane + jj * o.row + l;
    col_bias[j] = bias && col_valid[j] ? to_float(bias[co]) : 0.f;
  }
  // ldmatrix lane addresses. A (x), m-tile mt, k-step kk: channels-first rows are channels
  // (kk + lane % 8 + 8 (lane / 16)), columns tokens (16 mt + 8 (lane / 8 % 2)); tokens rows are
  // tokens (16 mt + lane % 8 + 8 (lane / 8 % 2)), columns channels (kk + 8 (lane / 16)).
  const uint32_t a_lane = kTokensX ? ((16 * mt + lane % 8 + lane / 8 % 2 * 8) * s.x_pitch + lane / 16 * 8) * 2
                                   : ((lane % 8 + lane / 16 * 8) * kRowPitch + 16 * mt + lane / 8 % 2 * 8) * 2;
  // B (W^T), n-tiles nt0 + j, j + 1: rows patch columns 8 (nt0 + j) + lane % 8 + 8 (lane / 16),
  // columns channels kk + 8 (lane / 8 % 2).
  const uint32_t b_lane = base + ((nt0 * 8 + lane % 8 + lane / 16 * 8) * s.w_pitch + lane / 8 % 2 * 8) * 2;
  const int k_steps = s.cp / 16;

  for (int st = 0; st < kStages - 1; ++st) {
    if (st < k_tiles) load_slice(st);
    cp_async_commit();
  }
  for (int kt = 0, slot = 0; kt < k_tiles; ++kt, slot = slot + 1 == kStages ? 0 : slot + 1) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // slice kt has landed (and W^T is in place); slice kt - 1's slot is free
    if (kt + kStages - 1 < k_tiles) load_slice(slot == 0 ? kStages - 1 : slot - 1);
    cp_async_commit();

    float acc[kTilesN][4] = {};
    const uint32_t a_slot = x_base + slot * s.slot_bytes + a_lane;
    for (int ks = 0; ks < k_steps; ++ks) {
      uint32_t a[4];
      if constexpr (kTokensX) {
        ldmatrix_x4(a, a_slot + ks * 16 * 2);
      } else {
        ldmatrix_x4_trans(a, a_slot + ks * 16 * kRowPitch * 2);
      }
#pragma unroll
      for (int j = 0; j < kTilesN; j += 2) {
        uint32_t bw[4];
        ldmatrix_x4(bw, b_lane + (j * 8 * s.w_pitch + ks * 16) * 2);
        const uint32_t b0[2] = {bw[0], bw[1]}, b1[2] = {bw[2], bw[3]};
        mma_16816<T>(acc[j], a, b0);
        mma_16816<T>(acc[j + 1], a, b1);
      }
    }

    // acc[j]: tokens 16 mt + g (c0, c1) and + 8 (c2, c3), patch columns 2q, 2q + 1 of n-tile nt0 + j.
    const int b = storing.b, t0 = storing.t0(), count = min(kSlice, o.tokens - t0);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int t = 16 * mt + g + 8 * half;
      if (t >= count) continue;
      int nw, nh;
      const int nd = gh.divmod(gw.divmod(t0 + t, nw), nh);
      T* origin = y + int64_t{b} * o.C_out * o.volume + int64_t{nd} * o.kd * o.plane + int64_t{nh} * o.kh * o.row +
                  nw * o.kw;
#pragma unroll
      for (int j = 0; j < kTilesN; ++j) {
        if (!col_valid[j]) continue;
        *reinterpret_cast<uint32_t*>(origin + col_offset[j]) =
            pack2<T>(acc[j][2 * half] + col_bias[j], acc[j][2 * half + 1] + col_bias[j]);
      }
    }
    storing.next();
  }
  cp_async_wait<0>();
#endif
}

template <typename T, bool kTokensX, int kPiece>
void launch(int tiles_n, const Output& o, const Layout& s, int slices, const at::Tensor& x, const at::Tensor& w,
            const at::Tensor* bias, const at::Tensor& y, const PatchGeometry& g) {
  // (Two tile shapes: K <= 32 and K <= 64.)
  auto kernel =
      tiles_n == 2 ? tiny_unembed_kernel<T, kTokensX, 2, kPiece> : tiny_unembed_kernel<T, kTokensX, 4, kPiece>;
  const int smem = s.w_bytes + kStages * s.slot_bytes;
  const LaunchShape shape = prepare_launch(reinterpret_cast<const void*>(kernel), kThreads, static_cast<int>(smem));
  // Two blocks per SM where they fit: three ran slower on U2.
  const int64_t blocks = std::min<int64_t>(
      slices, int64_t{std::clamp(shape.blocks_per_sm, 1, 2)} * shape.sms);
  kernel<<<static_cast<unsigned>(blocks), kThreads, smem, at::cuda::getCurrentCUDAStream()>>>(
      o, s, FastDiv(static_cast<uint32_t>((g.tokens() + kSlice - 1) / kSlice)),
      FastDiv(static_cast<uint32_t>(g.grid[2])), FastDiv(static_cast<uint32_t>(g.grid[1])), slices,
      static_cast<const T*>(x.const_data_ptr()), static_cast<const T*>(w.const_data_ptr()),
      bias ? static_cast<const T*>(bias->const_data_ptr()) : nullptr, static_cast<T*>(y.data_ptr()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool tiny_unembed_fits(const at::Tensor& x, bool tokens, int64_t C_in, bool with_bias, const PatchGeometry& g,
                       std::string& why) {
  const int64_t K = g.patch_size(), N = g.tokens();
  const auto dtype = x.scalar_type();
  if (dtype != at::kHalf && dtype != at::kBFloat16) return decline(why, "16-bit dtypes only");
  if (g.levels.size() != 1) return decline(why, "row-major token order only (no levels)");
  if (K == 0 || K > kMaxK) return decline(why, "patches of 1 to 64 elements only");
  if (C_in == 0 || C_in > kMaxC) return decline(why, "1 to 512 input channels only");
  if (g.kernel[2] % 2) return decline(why, "kw must be even");
  // (A column pair shares its channel's bias, which interleaved channels do not.)
  if (with_bias && g.interleaved_channels > 1) return decline(why, "a bias over channels-last patches");
  if (tokens ? C_in % 8 : N % 4)
    return decline(why, tokens ? "C_in must be a multiple of 8" : "patches per sample must be a multiple of 4");
  const cudaDeviceProp* device = at::cuda::getDeviceProperties(x.get_device());
  if (device->major < 8) return decline(why, "needs sm_80 or newer");
  if (g.batch * ((N + kSlice - 1) / kSlice) >= INT_MAX || N >= INT_MAX) {
    return decline(why, "too many patches for 32-bit indices");
  }
  const Layout s(static_cast<int>(C_in), tokens, K <= 32 ? 2 : 4);
  if (s.w_bytes + kStages * s.slot_bytes > static_cast<int>(device->sharedMemPerBlockOptin)) {
    return decline(why, "W and two slices of x do not fit in shared memory (C_in too large for this GPU)");
  }
  return true;
}

bool tiny_unembed(const at::Tensor& x, bool tokens, const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                  const PatchGeometry& g, const at::Tensor& y5, std::string& why) {
  const int64_t K = g.patch_size(), N = g.tokens(), C_in = w2.size(0);
  const auto dtype = x.scalar_type();
  if (!tiny_unembed_fits(x, tokens, C_in, bias.has_value(), g, why)) return false;
  const int64_t slices = g.batch * ((N + kSlice - 1) / kSlice);
  const c10::cuda::CUDAGuard guard(y5.device());
  if (slices == 0) return true;  // y is empty
  const at::Tensor xc = contiguous_aligned(x);  // [B, N, C_in] or [B, C_in, N]
  const at::Tensor w = w2.contiguous();
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  Output o;
  o.K = static_cast<int>(K);
  o.C_in = static_cast<int>(C_in);
  o.C_out = static_cast<int>(g.channels);
  o.kd = static_cast<int>(g.kernel[0]);
  o.kh = static_cast<int>(g.kernel[1]);
  o.kw = static_cast<int>(g.kernel[2]);
  o.tokens = static_cast<int>(N);
  o.row = g.size[2];
  o.plane = g.size[1] * g.size[2];
  o.volume = g.size[0] * o.plane;
  const int tiles_n = K <= 32 ? 2 : 4;
  const Layout s(o.C_in, tokens, tiles_n);
  const at::Tensor* bp = bias ? &b : nullptr;
  const int n = static_cast<int>(slices);
  const bool whole = N % 8 == 0;  // 16-byte copies of channels-first rows
  if (dtype == at::kHalf) {
    tokens  ? launch<__half, true, 8>(tiles_n, o, s, n, xc, w, bp, y5, g)
    : whole ? launch<__half, false, 8>(tiles_n, o, s, n, xc, w, bp, y5, g)
            : launch<__half, false, 4>(tiles_n, o, s, n, xc, w, bp, y5, g);
  } else {
    tokens  ? launch<__nv_bfloat16, true, 8>(tiles_n, o, s, n, xc, w, bp, y5, g)
    : whole ? launch<__nv_bfloat16, false, 8>(tiles_n, o, s, n, xc, w, bp, y5, g)
            : launch<__nv_bfloat16, false, 4>(tiles_n, o, s, n, xc, w, bp, y5, g);
  }
  return true;
}

}  // namespace cuda
}  // namespace patchgemm
