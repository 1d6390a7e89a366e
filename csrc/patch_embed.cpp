// Kernel == stride convolutions (patch embeddings) and their transposes as one GEMM between a
// gather (patchify) and a scatter (unpatchify); see patchify.h for the patch matrix.
//
//   patch_embed       y = P @ W^T (+ b): tokens [B, N, E] as one plain GEMM, channels-first
//                     [B, E, N] as one GEMM batched over B (W shared, stride 0).
//   patch_unembed     Q = x_tokens @ W, then y = unpatchify(Q) + b (the bias rides on the scatter).
//                     (16-bit kw = 2: an implicit GEMM scattering from its epilogue instead.)
//   patch_weight_grad dW = grad_y^T @ P, recomputing P from x (never saved); with a ones column in
//                     P the same GEMM also yields dbias. (16-bit kw = 2: an implicit GEMM reading
//                     the patches from x instead.)
// The adjoint of patch_embed is patch_unembed with the same weight and vice versa, so autograd needs
// only these three ops.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <atomic>
#include <numeric>

#include "checks.h"
#include "gemm.h"
#include "patchify.h"

namespace patchgemm {
namespace {

constexpr int64_t kMaxLevels = 4;

std::atomic<FusedKernels> g_fused_kernels{FusedKernels::kAuto};
std::atomic<bool> g_implicit_wgmma{true};

int64_t product(c10::IntArrayRef v) {
  return std::accumulate(v.begin(), v.end(), int64_t{1}, std::multiplies<int64_t>());
}

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

// [B, C, *S] -> [B, C, D, H, W] (a view).
at::Tensor to_5d(const at::Tensor& t) {
  at::Tensor v = t;
  while (v.dim() < 5) v = v.unsqueeze(2);
  return v;
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
                " of ", name, " (shape ", x.sizes(), ") is not divisible by the patch size ",
                kernel, "; crop or pad the input (patchgemm.patch_embed(..., pad=\"dynamic\") "
                "zero-pads at the end)");
    g.grid[d] = g.size[d] / g.kernel[d];
  }
  set_levels(op, g, levels, rank);
  return g;
}

// x5 [B, C, D, H, W] as its own patch matrix [B, 1, K] when one patch covers the whole volume and
// the strides allow a view (no gather at all: e.g. Qwen2-VL's patch embedding).
std::optional<at::Tensor> patch_matrix_as_view(const at::Tensor& x5, const PatchGeometry& g) {
  if (g.tokens() != 1) return std::nullopt;
  int64_t expected = 1;
  for (int64_t d = 4; d >= 1; --d) {
    if (x5.size(d) != 1 && x5.stride(d) != expected) return std::nullopt;
    expected *= x5.size(d);
  }
  return x5.as_strided({g.batch, 1, g.patch_size()}, {x5.stride(0), g.patch_size(), 1});
}

// t [B, N, C] as [1, B*N, C] when the strides allow a view, else as is (the GEMM then runs
// batched over B). N == 1 always merges: otherwise a batch of B one-row products reads the
// weight B times.
at::Tensor merge_batch(const at::Tensor& t) {
  const int64_t row_stride = t.size(1) == 1 ? t.stride(0) : t.stride(1);
  if (t.size(0) <= 1 || t.size(1) == 1 || t.stride(0) == t.size(1) * t.stride(1)) {
    return t.as_strided({1, t.size(0) * t.size(1), t.size(2)},
                        {t.size(0) * t.size(1) * row_stride, row_stride, t.stride(2)});
  }
  return t;
}

// w2 [rows, K] as a GEMM operand of `width` (>= K) columns against a zero-padded patch matrix:
// [W | bias | 0] (the bias meets P's ones column), or w2 itself when there is nothing to pad.
// Full, aligned widths keep BLAS on its fast kernels (an odd K can cost several times).
at::Tensor padded_weight(const at::Tensor& w2, const std::optional<at::Tensor>& bias,
                         int64_t width) {
  const int64_t K = w2.size(1);
  if (width == K && !bias) return w2;
  at::Tensor w = at::zeros({w2.size(0), width}, w2.options());
  w.narrow(1, 0, K).copy_(w2);
  if (bias) w.select(1, K).copy_(*bias);
  return w;
}

}  // namespace

FusedKernels set_fused_patch_kernels(FusedKernels mode) { return g_fused_kernels.exchange(mode); }
bool set_implicit_wgmma(bool enabled) { return g_implicit_wgmma.exchange(enabled); }
bool implicit_wgmma_enabled() { return g_implicit_wgmma; }

at::Tensor patch_embed(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, bool tokens,
                       c10::IntArrayRef levels) {
  constexpr const char* op = "patch_embed";
  const int64_t rank = spatial_rank(op, weight, "[E, C, *kernel]");
  check_floating(op, "x", x);
  check_like(op, "x", x, "weight", weight);
  TORCH_CHECK(tokens || levels.empty(), op, ": levels (a token order) need tokens output");
  const PatchGeometry g = embed_geometry(op, "x", x, weight.sizes().slice(2), levels, weight);
  TORCH_CHECK(g.channels == weight.size(1), op, ": x has ", g.channels, " channels (shape ",
              x.sizes(), ") but weight [E, C, *kernel] expects ", weight.size(1), " (shape ",
              weight.sizes(), ")");
  const int64_t embed = weight.size(0), K = g.patch_size(), N = g.tokens();
  check_bias(op, bias, embed, weight);
  const at::Tensor x5 = to_5d(x);
  const at::Tensor w2 = weight.reshape({embed, K});

  std::vector<int64_t> cf_shape{g.batch, embed};
  cf_shape.insert(cf_shape.end(), g.grid.end() - rank, g.grid.end());
  // One patch per sample: channels-first [B, E, 1..] and tokens [B, 1, E] are the same memory.
  if (tokens || N == 1) {
    at::Tensor y = at::empty({g.batch, N, embed}, x.options());
    const auto view = patch_matrix_as_view(x5, g);
#ifdef PATCHGEMM_WITH_CUDA
    const FusedKernels fused = g_fused_kernels;
    if (!view && x.is_cuda() && fused != FusedKernels::kNever &&
        cuda::implicit_embed(x5, w2, bias, g, y, /*tokens_out=*/true, fused == FusedKernels::kAlways)) {
      return tokens ? y : y.view(cf_shape);
    }
#endif
    const at::Tensor p = view ? *view : patchify(x5, g, /*ones_column=*/false);
    // y[B*N, E] = P[B*N, ld] @ W'^T; the bias in the GEMM's epilogue where the backend has one.
    run_gemm(merge_batch(p), padded_weight(w2, std::nullopt, p.size(2)).t().unsqueeze(0),
             merge_batch(y), bias ? std::optional<at::Tensor>(bias->unsqueeze(0)) : std::nullopt);
    return tokens ? y : y.view(cf_shape);
  }
  at::Tensor y = at::empty(cf_shape, x.options());
#ifdef PATCHGEMM_WITH_CUDA
  // Patches of at most 64 elements take the fused tiny kernel (tiny_patch_gemm.cu), 16-bit thin
  // GEMMs with kw even the implicit GEMM (implicit_patch_gemm.cu, which says where it runs):
  // neither materializes the patch matrix.
  const FusedKernels fused = g_fused_kernels;
  if (x.is_cuda() && fused != FusedKernels::kNever &&
      (cuda::tiny_embed(x5, w2, bias, g, y.view({g.batch, embed, N})) ||
       cuda::implicit_embed(x5, w2, bias, g, y.view({g.batch, embed, N}), /*tokens_out=*/false,
                            fused == FusedKernels::kAlways))) {
    return y;
  }
#endif
  // Channels-first: y[b] [E, N] = W' [E, K'] @ P[b]^T, batched over B with W' shared. The bias is
  // a column of W' against a ones column of P: no pass over y (whose bias would run along rows,
  // which BLAS epilogues do not offer).
  const at::Tensor p = patchify(x5, g, /*ones_column=*/bias.has_value());
  const at::Tensor w = padded_weight(w2, bias, p.size(2));
  run_gemm(w.unsqueeze(0).expand({g.batch, embed, w.size(1)}), p.transpose(1, 2),
           y.view({g.batch, embed, N}));
  return y;
}

at::Tensor patch_unembed(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, bool tokens,
                         c10::IntArrayRef levels) {
  constexpr const char* op = "patch_unembed";
  const int64_t rank = spatial_rank(op, weight, "[C_in, C_out, *kernel]");
  check_floating(op, "x", x);
  check_like(op, "x", x, "weight", weight);
  const int64_t in_channels = weight.size(0), out_channels = weight.size(1);
  check_bias(op, bias, out_channels, weight);

  PatchGeometry g;
  g.channels = out_channels;
  g.kernel = to_dims3(weight.sizes().slice(2));
  at::Tensor x_tokens;  // [B, N, C_in]
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
    x_tokens = x;
  } else {
    TORCH_CHECK(levels.empty(), op, ": channels-first input takes its grid from x; levels need tokens input");
    TORCH_CHECK(x.dim() == rank + 2 && x.size(1) == in_channels, op, ": x must be [B, ",
                in_channels, ", *grid] (", rank, " grid dims) for weight ", weight.sizes(),
                ", got shape ", x.sizes());
    g.batch = x.size(0);
    g.grid = to_dims3(x.sizes().slice(2));
    g.levels = {g.grid};
    x_tokens = x.reshape({g.batch, in_channels, g.tokens()}).transpose(1, 2);
  }
  for (int d = 0; d < 3; ++d) g.size[d] = g.grid[d] * g.kernel[d];

  std::vector<int64_t> y_shape{g.batch, out_channels};
  y_shape.insert(y_shape.end(), g.size.end() - rank, g.size.end());
  at::Tensor y = at::empty(y_shape, x.options());
  const int64_t K = g.patch_size(), align = row_alignment(x);
#ifdef PATCHGEMM_WITH_CUDA
  // 16-bit, kw even: patches of at most 64 elements take the fused kernel (tiny_patch_unembed.cu: x
  // read once, y written once); larger ones (kw = 2, or 4 on Hopper) the implicit GEMM, which
  // scatters its tiles into y from the epilogue (implicit_patch_unembed.cu, which says where it runs).
  const FusedKernels fused = g_fused_kernels;
  if (x.is_cuda() && fused != FusedKernels::kNever) {
    const at::Tensor x_arg = tokens ? x : x.reshape({g.batch, in_channels, g.tokens()});
    const at::Tensor w2 = weight.reshape({in_channels, K});
    if (cuda::tiny_unembed(x_arg, tokens, w2, bias, g, to_5d(y)) ||
        cuda::implicit_unembed(x_arg, tokens, w2, bias, g, to_5d(y), fused == FusedKernels::kAlways)) {
      return y;
    }
  }
#endif
  at::Tensor q = at::empty({g.batch, g.tokens(), (K + align - 1) / align * align}, x.options());
  // Q[B*N, K] = x_tokens[B*N, C_in] @ W[C_in, K]: one GEMM (batched over B with W shared when
  // x's strides keep B and N apart, e.g. channels-first input).
  const at::Tensor a = merge_batch(x_tokens);
  const at::Tensor w = padded_weight(weight.reshape({in_channels, K}), std::nullopt, q.size(2));
  run_gemm(a, w.unsqueeze(0).expand({a.size(0), in_channels, w.size(1)}),
           a.size(0) == 1 ? merge_batch(q) : q);
  unpatchify(q, g, bias, to_5d(y));
  return y;
}

std::tuple<at::Tensor, at::Tensor> patch_weight_grad(const at::Tensor& grad_y, const at::Tensor& x,
                                                     c10::IntArrayRef kernel, bool tokens,
                                                     c10::IntArrayRef levels, bool with_bias,
                                                     bool transposed) {
  constexpr const char* op = "patch_weight_grad";
  TORCH_CHECK(!kernel.empty() && kernel.size() <= 3, op, ": kernel_size must have 1 to 3 entries, got ", kernel);
  for (int64_t k : kernel) TORCH_CHECK(k >= 1, op, ": kernel sizes must be >= 1, got ", kernel);
  check_floating(op, "x", x);
  check_like(op, "grad_y", grad_y, "x", x);
  TORCH_CHECK(tokens || levels.empty(), op, ": levels (a token order) need tokens grad_y");
  const PatchGeometry g = embed_geometry(op, "x", x, kernel, levels, x);
  const int64_t rank = static_cast<int64_t>(kernel.size()), N = g.tokens(), K = g.patch_size();
  const int64_t embed = tokens ? grad_y.size(-1) : (grad_y.dim() > 1 ? grad_y.size(1) : -1);
  std::vector<int64_t> expected = tokens ? std::vector<int64_t>{g.batch, N, embed}
                                         : std::vector<int64_t>{g.batch, embed};
  if (!tokens) expected.insert(expected.end(), g.grid.end() - rank, g.grid.end());
  TORCH_CHECK(grad_y.sizes() == c10::IntArrayRef(expected), op, ": grad_y has shape ",
              grad_y.sizes(), " but x ", x.sizes(), " with patches ", kernel, " gives ",
              c10::IntArrayRef(expected));

  std::vector<int64_t> w_shape{embed, g.channels};
  w_shape.insert(w_shape.end(), kernel.begin(), kernel.end());
  const at::Tensor x5 = to_5d(x);
  // [B, N, E] (the GEMM's A^T); channels-first grad_y is read through its strides.
  const at::Tensor dy = tokens || N == 1 ? grad_y.reshape({g.batch, N, embed})
                                         : grad_y.reshape({g.batch, embed, N}).transpose(1, 2);
  const auto view = patch_matrix_as_view(x5, g);
  // The bias gradient where no GEMM yields it (sum_for_bias_grad). Tokens grad_y [B*N, E] with E <
  // 1024 is folded to [B*N / f, f * E] first: ATen's reduction over rows spreads a few hundred
  // columns poorly (P4's E = 192: 0.7 TB/s). Wide rows (P2's E = 1280) reduce well in one kernel
  // (3 fewer us on P2's 0.07 ms fwd+bwd), which takes a transient 40 MB scratch there, as
  // nn.Linear's bias gradient does (the fold: 0.2 MB).
  auto bias_grad = [&] {
    if (!with_bias) return at::empty({0}, x.options());
    if (transposed) return sum_for_bias_grad(x5, {0, 2, 3, 4});  // patch_unembed's: x per channel
    if (dy.is_contiguous() && embed < 1024) {
      int64_t f = 32;
      while (f > 1 && (g.batch * N) % f) f /= 2;
      const at::ScalarType acc = at::toOpMathType(x.scalar_type());
      return dy.reshape({g.batch * N / f, f * embed}).sum(0, false, acc).view({f, embed}).sum(0).to(x.scalar_type());
    }
    // Channels-first: its contiguous rows (P4's 100 MB: 97 us through the transposed view, H200);
    // other strides through the view (a reshape would copy grad_y to sum it).
    if (!tokens && N > 1 && grad_y.is_contiguous()) {
      return sum_for_bias_grad(grad_y.view({g.batch, embed, N}), {0, 2});
    }
    return sum_for_bias_grad(dy, {0, 1});
  };
#ifdef PATCHGEMM_WITH_CUDA
  // 16-bit, kw = 2: patches of at most 64 elements take the fused kernel (tiny_patch_weight_grad.cu: one
  // pass over grad_y and x, the bias gradient included); larger ones the implicit GEMM, which reads
  // the patches from x (implicit_patch_weight_grad.cu, which says where it runs).
  const FusedKernels fused = g_fused_kernels;
  if (!view && x.is_cuda() && fused != FusedKernels::kNever) {
    const bool dy_tokens = tokens || N == 1;  // else dy is [B, E, N] transposed
    const at::Tensor dy_arg = dy_tokens ? dy : dy.transpose(1, 2);
    const auto tiny_bias = !with_bias ? cuda::BiasGrad::kNone
                           : transposed ? cuda::BiasGrad::kUnembed
                                        : cuda::BiasGrad::kEmbed;
    if (const auto tiny = cuda::tiny_weight_grad(dy_arg, dy_tokens, x5, g, embed, tiny_bias)) {
      const auto& [grad_w, grad_b] = *tiny;
      return {grad_w.view(w_shape), with_bias ? grad_b : at::empty({0}, x.options())};
    }
    if (const auto grads = cuda::implicit_weight_grad(dy_arg, dy_tokens, x5, g, embed, with_bias && !transposed,
                                                      fused == FusedKernels::kAlways)) {
      const auto& [grad_w, grad_b] = *grads;
      return {grad_w.view(w_shape), grad_b.defined() ? grad_b : bias_grad()};
    }
  }
#endif
  const bool ones_column = with_bias && !transposed && !view;  // the bias gradient comes out of the GEMM
  const at::Tensor p = view ? *view : patchify(x5, g, ones_column);
  at::Tensor dw = at::empty({1, embed, p.size(2)}, x.options());  // [dW | dbias | (padding)]
  if (g.batch == 1 || dy.stride(0) == N * dy.stride(1)) {
    // One GEMM, reducing over all B*N tokens.
    run_gemm(merge_batch(dy).transpose(1, 2), merge_batch(p), dw);
  } else if (g.batch <= 16 && (g.batch - 1) * p.size(2) < g.batch * N) {
    // Channels-first grad_y cannot merge B and N: one accumulating GEMM per sample. Each after
    // the first re-reads and re-writes dW [E, ld], so this wins only while that traffic is below
    // the copy of grad_y [B, E, N] the other branch makes (P3: ld 40, N 262144; not P5: ld 12288,
    // N 512).
    for (int64_t b = 0; b < g.batch; ++b) {
      run_gemm(dy.narrow(0, b, 1).transpose(1, 2), p.narrow(0, b, 1), dw, std::nullopt,
               /*accumulate=*/b > 0);
    }
  } else {
    // One copy of grad_y into tokens order, then one GEMM over all B * N tokens.
    run_gemm(merge_batch(dy.contiguous()).transpose(1, 2), merge_batch(p), dw);
  }
  if (g.batch == 0) dw.zero_();
  at::Tensor grad_w = dw.select(0, 0).narrow(1, 0, K).reshape(w_shape).contiguous();
  at::Tensor grad_b = ones_column ? dw.select(0, 0).select(1, K).contiguous() : bias_grad();
  return {grad_w, grad_b};
}

TORCH_LIBRARY_IMPL(patchgemm, CPU, m) {
  m.impl("patch_embed", &patch_embed);
  m.impl("patch_unembed", &patch_unembed);
  m.impl("patch_weight_grad", &patch_weight_grad);
}

#ifdef PATCHGEMM_WITH_CUDA
TORCH_LIBRARY_IMPL(patchgemm, CUDA, m) {
  m.impl("patch_embed", &patch_embed);
  m.impl("patch_unembed", &patch_unembed);
  m.impl("patch_weight_grad", &patch_weight_grad);
}
#endif

}  // namespace patchgemm
