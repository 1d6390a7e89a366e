#include "problems/patch.h"

namespace patchgemm {

at::Tensor weight_rows(const at::Tensor& weight, bool channels_last) {
  const int64_t rows = weight.size(0), K = c10::multiply_integers(weight.sizes().slice(1));
  if (!channels_last) return weight.reshape({rows, K});
  std::vector<int64_t> order{0};
  for (int64_t d = 2; d < weight.dim(); ++d) order.push_back(d);
  order.push_back(1);
  return weight.permute(order).reshape({rows, K});
}

}  // namespace patchgemm
