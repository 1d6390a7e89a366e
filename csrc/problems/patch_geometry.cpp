#include "problems/patch_geometry.h"

namespace patchgemm {

bool has_channels_first_view(const at::Tensor& v5, const PatchGeometry& g) {
  if (!g.channels_last) return true;
  return (g.channels <= 1 || v5.stride(1) == 1) && (g.size[2] <= 1 || v5.stride(4) == g.channels);
}

PatchGeometry channels_first_geometry(const PatchGeometry& g) {
  if (!g.channels_last) return g;
  PatchGeometry v = g;
  v.channels = 1;
  v.size[2] = g.size[2] * g.channels;
  v.kernel[2] = g.kernel[2] * g.channels;
  v.channels_last = false;
  v.interleaved_channels = g.channels;
  return v;
}

std::optional<std::pair<at::Tensor, PatchGeometry>> channels_first_view(const at::Tensor& v5, const PatchGeometry& g) {
  if (!g.channels_last) return std::make_pair(v5, g);
  if (!has_channels_first_view(v5, g)) return std::nullopt;
  const PatchGeometry v = channels_first_geometry(g);
  // (The channel dim has size 1: its stride is immaterial; this one keeps a dense volume contiguous.)
  const at::Tensor view = v5.as_strided({g.batch, 1, g.size[0], g.size[1], v.size[2]},
                                        {v5.stride(0), g.size[0] * v5.stride(2), v5.stride(2), v5.stride(3), 1});
  return std::make_pair(view, v);
}

int64_t row_alignment(const at::Tensor& like) { return 16 / like.element_size(); }

int64_t patch_row_width(int64_t values, const at::Tensor& like) {
  const int64_t align = values >= 1024 && like.element_size() == 2 ? 64 : row_alignment(like);
  return (values + align - 1) / align * align;
}

}  // namespace patchgemm
