// SwiGLU on the CPU (swiglu.h): one parallel loop over rows, float math.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "kernels/swiglu/swiglu.h"

namespace patchgemm {
namespace {

// Rows per task: enough elements that a task outweighs its scheduling.
int64_t grain(int64_t hidden) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(hidden, 1)); }

}  // namespace

void swiglu_cpu(const at::Tensor& gate_up, const at::Tensor& h) {
  const int64_t hidden = h.size(-1), rows = hidden ? h.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "swiglu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    scalar_t* out = h.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * hidden;
        const scalar_t* up = gate + hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          const acc_t g = gate[i];
          out[r * hidden + i] = static_cast<scalar_t>(g / (acc_t(1) + std::exp(-g)) * static_cast<acc_t>(up[i]));
        }
      }
    });
  });
}

void swiglu_backward_cpu(const at::Tensor& grad_h, const at::Tensor& gate_up, const at::Tensor& grad_gate_up) {
  const int64_t hidden = grad_h.size(-1), rows = hidden ? grad_h.numel() / hidden : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gate_up.scalar_type(), "swiglu_backward", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const scalar_t* dh = grad_h.const_data_ptr<scalar_t>();
    const scalar_t* in = gate_up.const_data_ptr<scalar_t>();
    scalar_t* out = grad_gate_up.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(hidden), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * hidden;
        const scalar_t* up = gate + hidden;
        scalar_t* d_gate = out + r * 2 * hidden;
        scalar_t* d_up = d_gate + hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          const acc_t g = gate[i], u = up[i], d = dh[r * hidden + i];
          const acc_t s = acc_t(1) / (acc_t(1) + std::exp(-g));
          d_gate[i] = static_cast<scalar_t>(d * u * s * (acc_t(1) + g * (acc_t(1) - s)));
          d_up[i] = static_cast<scalar_t>(d * g * s);
        }
      }
    });
  });
}

}  // namespace patchgemm
