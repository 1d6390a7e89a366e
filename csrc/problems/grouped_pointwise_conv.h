// Grouped pointwise convolution's problems (ops/grouped_pointwise_conv.cpp builds them after
// validation; selection/grouped_pointwise_conv_tables.cpp runs them). The channels of x are G groups; each op
// applies one small matrix per group to every position:
//   channels-first x [B, G, c_in, L] (a contiguous [B, C, *spatial] viewed so), or
//   tokens x [N, G, c_in] (a channels_last(_3d) x, N = B * spatial, viewed so).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

namespace patchgemm {

// How many BackwardFollows scopes are open on this thread.
inline int& backward_follows_depth() {
  static thread_local int depth = 0;
  return depth;
}
// While one lives, this thread's grouped pointwise conv forwards are a training step's: the autograd
// layer opens one around a forward whose backward it records. (A hint for the choice: a compiled
// graph's forward runs without it.)
struct BackwardFollows {
  BackwardFollows() { ++backward_follows_depth(); }
  ~BackwardFollows() { --backward_follows_depth(); }
  BackwardFollows(const BackwardFollows&) = delete;
  BackwardFollows& operator=(const BackwardFollows&) = delete;
};

struct GroupedPointwiseConvProblem {
  const char* op = "";
  bool backward_follows = false;  // the forward of a training step (BackwardFollows)
  bool tokens = false;
  at::Tensor x;                    // [B, G, c_in, L] or [N, G, c_in]
  at::Tensor matrix;               // [G, c_out, c_in]: weight (forward) or its transpose (grad_input)
  std::optional<at::Tensor> bias;  // [G, c_out]; forward only
  at::Tensor out;                  // the op's output, in x's view ([B, G, c_out, L] / [N, G, c_out])
  std::vector<int64_t> out_sizes;  // its shape as the op returns it, [B, C_out, *spatial]
  // x as F.conv takes it, [B, G * c_in, *spatial] (aten_conv: a grouped 1 x 1 conv of x by `matrix`).
  at::Tensor conv_x;
  int64_t groups = 0;
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)
};

// grad_weight [G, c_out, c_in] = sum over positions of grad_y_g x_g^T; with_bias: also the bias
// gradient [G, c_out], grad_y summed over the positions.
struct GroupedPointwiseConvWeightGradProblem {
  bool tokens = false;
  at::Tensor grad_y, x;  // [B, G, c_out, L] / [N, G, c_out], and x likewise with c_in
  bool with_bias = false;
  at::Device device() const { return x.device(); }  // where it runs (choices are kept per device)
};

}  // namespace patchgemm
