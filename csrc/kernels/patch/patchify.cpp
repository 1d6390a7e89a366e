#include "kernels/patch/patchify.h"

namespace patchgemm {
namespace {

// x5 viewed with each spatial dim split into its level digits and its in-patch offset, permuted to
// [B, <level digits, coarse first, (d, h, w) each>, C, kd, kh, kw] (channels last: kd, kh, kw, C):
// the patch matrix's index order. Splitting a dim is always a view, whatever x5's strides.
at::Tensor patch_order_view(const at::Tensor& x5, const PatchGeometry& g) {
  const int64_t levels = static_cast<int64_t>(g.levels.size());
  std::vector<int64_t> shape{g.batch, g.channels};
  for (int dim = 0; dim < 3; ++dim) {
    for (const Dims3& level : g.levels) shape.push_back(level[dim]);
    shape.push_back(g.kernel[dim]);
  }
  // dim `d`, level `l` sits at 2 + d * (levels + 1) + l; its in-patch offset at l = levels.
  auto axis = [&](int dim, int64_t l) { return 2 + dim * (levels + 1) + l; };
  std::vector<int64_t> order{0};
  for (int64_t l = 0; l < levels; ++l) {
    for (int dim = 0; dim < 3; ++dim) order.push_back(axis(dim, l));
  }
  if (!g.channels_last) order.push_back(1);
  for (int dim = 0; dim < 3; ++dim) order.push_back(axis(dim, levels));
  if (g.channels_last) order.push_back(1);
  return x5.view(shape).permute(order);
}

// The first K columns of p [B, N, ld] in the same index order.
at::Tensor patch_matrix_view(const at::Tensor& p, const PatchGeometry& g) {
  std::vector<int64_t> shape{g.batch};
  for (const Dims3& level : g.levels) shape.insert(shape.end(), level.begin(), level.end());
  if (!g.channels_last) shape.push_back(g.channels);
  shape.insert(shape.end(), g.kernel.begin(), g.kernel.end());
  if (g.channels_last) shape.push_back(g.channels);
  return p.narrow(2, 0, g.patch_size()).view(shape);
}

// bias [C] shaped to broadcast against patch_order_view.
at::Tensor bias_in_patch_order(const at::Tensor& bias, const PatchGeometry& g, int64_t dims) {
  std::vector<int64_t> shape(dims, 1);
  shape[g.channels_last ? dims - 1 : dims - 4] = g.channels;
  return bias.view(shape);
}

}  // namespace

at::Tensor patchify(const at::Tensor& x5, const PatchGeometry& g, bool ones_column) {
  const int64_t ld = patch_row_width(g.patch_size() + ones_column, x5);
  at::Tensor p = at::empty({g.batch, g.tokens(), ld}, x5.options());
  if (p.numel() == 0) return p;
#ifdef PATCHGEMM_WITH_CUDA
  if (x5.is_cuda() && !g.channels_last && cuda::patchify(x5, g, ones_column, p)) return p;
#endif
  const at::Tensor patches = patch_matrix_view(p, g), source = patch_order_view(x5, g);
  if (!cpu::copy_runs(patches, source)) patches.copy_(source);
  p.narrow(2, g.patch_size(), ld - g.patch_size()).zero_();
  if (ones_column) p.select(2, g.patch_size()).fill_(1);
  return p;
}

void unpatchify(const at::Tensor& q, const PatchGeometry& g, const std::optional<at::Tensor>& bias,
                const at::Tensor& y5) {
  if (y5.numel() == 0) return;
#ifdef PATCHGEMM_WITH_CUDA
  if (y5.is_cuda() && !g.channels_last && cuda::unpatchify(q, g, bias, y5)) return;
#endif
  at::Tensor out = patch_order_view(y5, g);
  const at::Tensor patches = patch_matrix_view(q, g);
  if (cpu::copy_runs(out, patches)) {
    // (the same rounding as one add: the patches' values are copied exactly)
    if (bias) y5.add_(bias->view({1, g.channels, 1, 1, 1}));
  } else if (bias) {
    at::add_out(out, patches, bias_in_patch_order(*bias, g, out.dim()));
  } else {
    out.copy_(patches);
  }
}

}  // namespace patchgemm
