// The patch ops (kernel == stride convolutions and their transposes): argument checks and the
// geometry of the patches, once, at the boundary; then each op's selection table
// (selection/patch_tables.cpp) runs one of its implementations.
//
//   patch_embed       y = conv(x, W, b, stride = k), tokens [B, N, E] or channels-first
//   patch_unembed     y = conv_transpose(x, W, b, stride = k)
//   patch_weight_grad (dW, db) of either
// The adjoint of patch_embed is patch_unembed with the same weight and vice versa, so autograd needs
// only these three ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "kernels/patch/patchify.h"
#include "ops/checks.h"
#include "ops/patch_embed.h"
#include "selection/patch_tables.h"

namespace patchgemm {
namespace {

constexpr int64_t kMaxLevels = 4;

// The weight's spatial rank (1, 2 or 3), checked.
int64_t spatial_rank(const char* op, const at::Tensor& weight, const char* layout) {
  TORCH_CHECK(weight.dim() >= 3 && weight.dim() <= 5, op, ": weight must be ", layout,
              " with 1, 2 or 3 kernel dims, got shape ", weight.sizes());
  check_floating(op, "weight", weight);
  for (int64_t d = 2; d < weight.dim(); ++d) {
    TORCH_CHECK(weight.size(d) >= 1, op, ": kernel sizes must be >= 1, weight has shape ",
                weight.sizes());
  }
  return weight.dim() - 2;
}

void check_bias(const char* op, const std::optional<at::Tensor>& bias, int64_t channels,
                const at::Tensor& weight) {
  if (!bias) return;
  TORCH_CHECK(bias->dim() == 1 && bias->size(0) == channels, op, ": bias must be [", channels,
              "] to match weight ", weight.sizes(), ", got shape ", bias->sizes());
  check_like(op, "bias", *bias, "weight", weight);
}

// Spatial sizes padded at the front to 3 dims.
Dims3 to_dims3(c10::IntArrayRef v) {
  Dims3 d{1, 1, 1};
  std::copy(v.begin(), v.end(), d.begin() + (3 - v.size()));
  return d;
}

// Fills g.levels from the flattened `levels` argument (groups of `rank` sizes, coarse first), or
// the single row-major level when it is empty.
void set_levels(const char* op, PatchGeometry& g, c10::IntArrayRef levels, int64_t rank) {
  if (levels.empty()) {
    g.levels = {g.grid};
    return;
  }
  const int64_t count = static_cast<int64_t>(levels.size()) / rank;
  TORCH_CHECK(static_cast<int64_t>(levels.size()) % rank == 0 && count <= kMaxLevels, op,
              ": levels must hold 1 to ", kMaxLevels, " groups of ", rank,
              " sizes (one per spatial dim), got ", levels);
  Dims3 total{1, 1, 1};
  for (int64_t l = 0; l < count; ++l) {
    const Dims3 level = to_dims3(levels.slice(l * rank, rank));
    for (int d = 0; d < 3; ++d) {
      TORCH_CHECK(level[d] >= 0, op, ": levels must be >= 0, got ", levels);
      total[d] *= level[d];
    }
    g.levels.push_back(level);
  }
  TORCH_CHECK(total == g.grid, op, ": levels ", levels, " multiply to grid ",
              c10::IntArrayRef(total).slice(3 - rank), " per dim, but the patch grid is ",
              c10::IntArrayRef(g.grid).slice(3 - rank));
}

void check_kernel_size(const char* op, c10::IntArrayRef kernel) {
  TORCH_CHECK(!kernel.empty() && kernel.size() <= 3, op, ": kernel_size must have 1 to 3 entries, got ", kernel);
  for (int64_t k : kernel) TORCH_CHECK(k >= 1, op, ": kernel sizes must be >= 1, got ", kernel);
}

// The geometry of cutting x [B, C, *S] into patches of `kernel`.
PatchGeometry embed_geometry(const char* op, const char* name, const at::Tensor& x,
                             c10::IntArrayRef kernel, c10::IntArrayRef levels,
                             const at::Tensor& weight) {
  const int64_t rank = static_cast<int64_t>(kernel.size());
  TORCH_CHECK(x.dim() == rank + 2, op, ": ", name, " must be [B, C, ", rank == 1 ? "L" : rank == 2 ? "H, W" : "D, H, W",
              "] for a ", rank, "-D kernel (weight ", weight.sizes(), "), got shape ", x.sizes());
  PatchGeometry g;
  g.batch = x.size(0);
  g.channels = x.size(1);
  g.size = to_dims3(x.sizes().slice(2));
  g.kernel = to_dims3(kernel);
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(g.size[d] % g.kernel[d] == 0, op, ": spatial size ", x.sizes().slice(2),
                " of ", name, " (shape ", x.sizes(), ") is not divisible by the patch size ", kernel);
    g.grid[d] = g.size[d] / g.kernel[d];
  }
  set_levels(op, g, levels, rank);
  return g;
}

}  // namespace

// patch_embed's arguments, checked, as its problem.
EmbedProblem embed_problem(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                           bool tokens, c10::IntArrayRef levels) {
  constexpr const char* op = "patch_embed";
  const int64_t rank = spatial_rank(op, weight, "[E, C, *kernel]");
  check_floating(op, "x", x);
  check_like(op, "x", x, "weight", weight);
  TORCH_CHECK(tokens || levels.empty(), op, ": levels (a token order) need tokens output");
  // The channels before the sizes, as the conv checks them: an unbatched x [C, *S] is read as
  // [1, C, *S], whose wrong channel count would otherwise be reported as a size that does not fit.
  TORCH_CHECK(x.dim() != weight.dim() || x.size(1) == weight.size(1), op, ": x has ", x.size(1), " channels (shape ",
              x.sizes(), ") but weight [E, C, *kernel] expects ", weight.size(1), " (shape ", weight.sizes(), ")");
  EmbedProblem p;
  p.g = embed_geometry(op, "x", x, weight.sizes().slice(2), levels, weight);
  const PatchGeometry& g = p.g;
  const int64_t embed = weight.size(0), N = g.tokens();
  check_bias(op, bias, embed, weight);
  p.x = x, p.weight = weight, p.bias = bias, p.tokens = tokens, p.rank = rank;
  p.g.channels_last = lies_channels_last(x);
  // One patch per sample: channels-first [B, E, 1..] and tokens [B, 1, E] are the same memory, as
  // are channels-last [B, E, *grid] and tokens.
  p.tokens_out = tokens || N == 1 || g.channels_last;
  p.x5 = to_5d(x);
  if (tokens) {
    p.out_shape = {g.batch, N, embed};
  } else {
    p.out_shape = {g.batch, embed};
    p.out_shape.insert(p.out_shape.end(), g.grid.end() - rank, g.grid.end());
  }
  return p;
}

// patch_unembed's arguments, checked, as its problem.
UnembedProblem unembed_problem(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                               bool tokens, c10::IntArrayRef levels) {
  constexpr const char* op = "patch_unembed";
  const int64_t rank = spatial_rank(op, weight, "[C_in, C_out, *kernel]");
  check_floating(op, "x", x);
  check_like(op, "x", x, "weight", weight);
  const int64_t in_channels = weight.size(0), out_channels = weight.size(1);
  check_bias(op, bias, out_channels, weight);

  UnembedProblem p;
  PatchGeometry& g = p.g;
  g.channels = out_channels;
  g.kernel = to_dims3(weight.sizes().slice(2));
  if (tokens) {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == in_channels, op, ": x must be tokens [B, N, ",
                in_channels, "] for weight ", weight.sizes(), ", got shape ", x.sizes());
    TORCH_CHECK(!levels.empty(), op, ": tokens input needs the patch grid (grid=...)");
    g.batch = x.size(0);
    Dims3 grid{1, 1, 1};
    for (size_t i = 0; i < levels.size(); ++i) grid[(3 - rank) + i % rank] *= levels[i];
    g.grid = grid;
    set_levels(op, g, levels, rank);
    TORCH_CHECK(x.size(1) == g.tokens(), op, ": x has ", x.size(1), " tokens (shape ", x.sizes(),
                ") but the grid ", c10::IntArrayRef(g.grid).slice(3 - rank), " has ", g.tokens());
    p.x_tokens = x;
    p.x_fused = x;
  } else {
    TORCH_CHECK(levels.empty(), op, ": channels-first input takes its grid from x; levels need tokens input");
    TORCH_CHECK(x.dim() == rank + 2 && x.size(1) == in_channels, op, ": x must be [B, ",
                in_channels, ", *grid] (", rank, " grid dims) for weight ", weight.sizes(),
                ", got shape ", x.sizes());
    g.batch = x.size(0);
    g.grid = to_dims3(x.sizes().slice(2));
    g.levels = {g.grid};
    g.channels_last = lies_channels_last(x);
    p.x_fused = x.reshape({g.batch, in_channels, g.tokens()});
    p.x_tokens = p.x_fused.transpose(1, 2);
  }
  for (int d = 0; d < 3; ++d) g.size[d] = g.grid[d] * g.kernel[d];
  p.x = x, p.weight = weight, p.bias = bias, p.tokens = tokens, p.rank = rank;
  p.out_format = g.channels_last ? x.suggest_memory_format() : at::MemoryFormat::Contiguous;
  p.out_shape = {g.batch, out_channels};
  p.out_shape.insert(p.out_shape.end(), g.size.end() - rank, g.size.end());
  return p;
}

at::Tensor whole_patches(const at::Tensor& x, const at::Tensor& weight, c10::IntArrayRef levels) {
  // Symbolic sizes first: size(d) of a tensor traced with symbolic sizes reads all of them as
  // ints, which pins every dim (torch.export's dynamic batch) to the traced value.
  if (!levels.empty() || x.dim() != weight.dim() || x.dim() < 3 ||
      x.unsafeGetTensorImpl()->has_symbolic_sizes_strides() ||
      weight.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || x.size(1) != weight.size(1)) {
    return x;  // (the op's checks name what does not fit)
  }
  at::Tensor whole = x;
  for (int64_t d = 2; d < x.dim(); ++d) {
    const int64_t size = x.size(d), k = weight.size(d);
    if (k < 1 || size % k == 0) continue;
    TORCH_CHECK(size > k, "patch_embed: x ", x.sizes(), " is smaller than one patch ", weight.sizes().slice(2),
                " in spatial dim ", d - 2, " (weight ", weight.sizes(), ")");
    whole = whole.narrow(d, 0, size - size % k);
  }
  return whole;
}

at::Tensor patch_embed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       bool tokens, at::OptionalIntArrayRef levels) {
  const c10::IntArrayRef order = token_levels(levels);
  return select_patch_embed(embed_problem(whole_patches(x, weight, order), weight, bias, tokens, order));
}

at::Tensor patch_unembed(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, bool tokens,
                         at::OptionalIntArrayRef levels) {
  return select_patch_unembed(unembed_problem(x, weight, bias, tokens, token_levels(levels)));
}

WeightGradProblem weight_grad_problem(const at::Tensor& grad_y, const at::Tensor& x, c10::IntArrayRef kernel,
                                      bool tokens, c10::IntArrayRef levels, bool with_bias, bool transposed) {
  constexpr const char* op = "patch_weight_grad";
  check_kernel_size(op, kernel);
  check_floating(op, "x", x);
  check_like(op, "grad_y", grad_y, "x", x);
  TORCH_CHECK(tokens || levels.empty(), op, ": levels (a token order) need tokens grad_y");
  WeightGradProblem p;
  p.g = embed_geometry(op, "x", x, kernel, levels, x);
  const PatchGeometry& g = p.g;
  const int64_t rank = static_cast<int64_t>(kernel.size()), N = g.tokens();
  const int64_t embed = tokens ? grad_y.size(-1) : (grad_y.dim() > 1 ? grad_y.size(1) : -1);
  std::vector<int64_t> expected = tokens ? std::vector<int64_t>{g.batch, N, embed}
                                         : std::vector<int64_t>{g.batch, embed};
  if (!tokens) expected.insert(expected.end(), g.grid.end() - rank, g.grid.end());
  TORCH_CHECK(grad_y.sizes() == c10::IntArrayRef(expected), op, ": grad_y has shape ",
              grad_y.sizes(), " but x ", x.sizes(), " with patches ", kernel, " gives ",
              c10::IntArrayRef(expected));
  p.grad_y = grad_y, p.x = x, p.tokens = tokens, p.with_bias = with_bias, p.transposed = transposed;
  p.rank = rank, p.embed = embed;
  p.w_shape = {embed, g.channels};
  p.w_shape.insert(p.w_shape.end(), kernel.begin(), kernel.end());
  p.x5 = to_5d(x);
  p.g.channels_last = lies_channels_last(x);
  // [B, N, E] (the GEMM's A^T); channels-first grad_y is read through its strides.
  p.dy = tokens || N == 1 ? grad_y.reshape({g.batch, N, embed}) : grad_y.reshape({g.batch, embed, N}).transpose(1, 2);
  return p;
}

WeightGrads patch_weight_grads(const WeightGradProblem& p) {
  // As PyTorch's convolution backward: a channels-last x gives a channels-last weight gradient (the
  // GEMM's own [E, *k, C] order), which a channels-last weight takes without a copy.
  auto [grad_w, grad_b] = select_patch_weight_grad(p);
  const auto format = p.g.channels_last ? p.x.suggest_memory_format() : at::MemoryFormat::Contiguous;
  return {grad_w.contiguous(format), grad_b};
}

std::tuple<at::Tensor, at::Tensor> patch_weight_grad(const at::Tensor& grad_y, const at::Tensor& x,
                                                     c10::IntArrayRef kernel, bool tokens,
                                                     at::OptionalIntArrayRef levels, bool with_bias,
                                                     bool transposed) {
  return patch_weight_grads(
      weight_grad_problem(grad_y, x, kernel, tokens, token_levels(levels), with_bias, transposed));
}

at::Tensor patch_matrix(const at::Tensor& x, c10::IntArrayRef kernel) {
  constexpr const char* op = "patch_matrix";
  check_kernel_size(op, kernel);
  check_floating(op, "x", x);
  const PatchGeometry g = embed_geometry(op, "x", x, kernel, {}, x);  // (columns in (c, k...) order)
  const int64_t K = g.patch_size();
  const at::Tensor p = patchify(to_5d(x), g, /*ones_column=*/false);
  return p.narrow(2, 0, K).reshape({g.batch * g.tokens(), K}).contiguous();  // (a copy only where rows are padded)
}

at::Tensor patch_matrix_backward(const at::Tensor& grad, c10::IntArrayRef x_shape, c10::IntArrayRef kernel) {
  constexpr const char* op = "patch_matrix_backward";
  check_kernel_size(op, kernel);
  check_floating(op, "grad", grad);
  at::Tensor x = at::empty(x_shape, grad.options());
  const PatchGeometry g = embed_geometry(op, "x_shape", x, kernel, {}, x);
  TORCH_CHECK(grad.dim() == 2 && grad.size(0) == g.batch * g.tokens() && grad.size(1) == g.patch_size(), op,
              ": grad must be [", g.batch * g.tokens(), ", ", g.patch_size(), "] for x ", x_shape, " cut into ",
              kernel, ", got shape ", grad.sizes());
  const at::Tensor q = grad.stride(1) == 1 ? grad : grad.contiguous();
  unpatchify(q.view({g.batch, g.tokens(), g.patch_size()}), g, std::nullopt, to_5d(x));
  return x;
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("patch_matrix", &patch_matrix);
  m.impl("patch_matrix_backward", &patch_matrix_backward);
  m.impl("patch_embed", &patch_embed);
  m.impl("patch_unembed", &patch_unembed);
  m.impl("patch_weight_grad", &patch_weight_grad);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("patch_matrix", &patch_matrix);
  m.impl("patch_matrix_backward", &patch_matrix_backward);
  m.impl("patch_embed", &patch_embed);
  m.impl("patch_unembed", &patch_unembed);
  m.impl("patch_weight_grad", &patch_weight_grad);
}
#endif

}  // namespace patchgemm
