// What the implicit-GEMM patch kernels share (implicit_patch_gemm.cu: the forward;
// implicit_patch_weight_grad.cu: the weight gradient): where a token's patch and a patch element
// sit in x, and the host-side checks that x's strides allow reading patches as aligned runs.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <climits>
#include <cstdint>

#include "patchify.h"

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
};

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

// Whether runs of v elements of x5 are v-aligned wherever a patch row starts (the pointer and every
// stride that moves, in elements).
inline bool runs_aligned(const at::Tensor& x5, int v) {
  if (reinterpret_cast<uintptr_t>(x5.const_data_ptr()) % (x5.element_size() * v)) return false;
  for (int d = 0; d < 4; ++d) {
    if (x5.size(d) > 1 && x5.stride(d) % v) return false;
  }
  return true;
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
  return true;
}

// The rule for taking an implicit kernel over gather + cuBLAS unless told to always (H200,
// bench/RESULTS.md): their mma.sync runs at 200-300 TFLOP/s, cuBLAS's GEMM at up to ~700, so the
// gather they save (4 bytes per patch element) pays only for thin GEMMs, E <= 256 (P4's 192: 1.5x
// forward; E = 384: 0.9x), and only with a 128-token tile per SM to fill the GPU.
inline bool implicit_pays(int64_t E, int64_t rows, const cudaDeviceProp& device) {
  return E <= 256 && rows >= int64_t{128} * device.multiProcessorCount;
}

}  // namespace cuda
}  // namespace patchgemm
