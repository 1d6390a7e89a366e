// The patch ops on gather (patchify) / scatter (unpatchify) + one GEMM, on every backend; see
// problems/patch_geometry.h for the patch matrix.
//
//   embed        y = P @ W^T (+ b): tokens [B, N, E] as one plain GEMM, channels-first [B, E, N] as
//                one GEMM batched over B (W shared, stride 0), or where that runs slowly as
//                tokens then one transposing copy.
//   unembed      Q = x_tokens @ W, then y = unpatchify(Q) + b (the bias rides on the scatter).
//   weight grad  dW = grad_y^T @ P, recomputing P from x (never saved); with a ones column in P the
//                same GEMM also yields dbias.
// Their GEMMs stand in for convolutions, so follow a conv's numerics (GemmConvention::kConv).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>

#include "kernels/gemm/gemm.h"
#include "kernels/patch/patch_gemm.h"
#include "kernels/patch/patchify.h"

namespace patchgemm {
namespace {

constexpr GemmConvention kConv = GemmConvention::kConv;

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
at::Tensor padded_weight(const at::Tensor& w2, const std::optional<at::Tensor>& bias, int64_t width) {
  const int64_t K = w2.size(1);
  if (width == K && !bias) return w2;
#ifdef PATCHGEMM_WITH_CUDA
  if (w2.is_cuda()) {
    at::Tensor w = at::empty({w2.size(0), width}, w2.options());
    if (cuda::pad_weight(w2, bias, w)) return w;
  }
#endif
  at::Tensor w = at::zeros({w2.size(0), width}, w2.options());
  w.narrow(1, 0, K).copy_(w2);
  if (bias) w.select(1, K).copy_(*bias);
  return w;
}

// Whether a weight gradient summed per sample runs as one GEMM per sample (a few samples, each a
// long reduction into an output of few tiles, which cuBLAS splits over the GPU) rather than one
// GEMM batched over them (whose few tiles, unsplit, would each run the whole reduction).
bool per_sample_gemms(const at::Tensor& on, int64_t batch, int64_t rows, int64_t cols, int64_t reduction) {
#ifdef PATCHGEMM_WITH_CUDA
  if (on.is_cuda() && batch <= 16 && reduction >= 4096) {
    return cuda::split_k_guard(on).under_half_a_wave(rows, cols, batch);
  }
#endif
  return false;
}

// Whether one GEMM batched over the samples would leave the GPU mostly idle: a long reduction into
// few output tiles, which cuBLAS does not split for a batch (dW of a k = 14 stem on 11 channels,
// two samples of 5,329 tokens into 192 x 2,156, ran several times slower than one split GEMM over
// every token).
bool batched_gemm_runs_unsplit(const at::Tensor& on, int64_t batch, int64_t rows, int64_t cols, int64_t reduction) {
#ifdef PATCHGEMM_WITH_CUDA
  if (on.is_cuda()) return cuda::split_k_guard(on).invites_split_k(rows, cols, reduction, batch);
#endif
  return false;
}

// Whether a bias goes into a patch GEMM as a ones column of P (against a bias column of the weight,
// whose gradient the weight gradient's GEMM then yields): where that column fits in P's alignment
// padding, or where the weight is at most a few times the output's `rows` tokens. Otherwise the
// column grows P by a whole alignment, makes the forward copy the whole weight into [W | bias | 0]
// and leaves dW a strided slice that the weight's gradient copies once more: passes over the
// weight (50M values for a 16^3 embedding of 16 channels into 768) that cost far more than a pass
// over y and a sum of grad_y (a few small kernels).
bool bias_as_ones_column(int64_t K, int64_t rows, const at::Tensor& x) {
  return patch_row_width(K + 1, x) == patch_row_width(K, x) || K <= 4 * rows;
}

// dst = src where one of them is the other's layout transposed (tokens <-> channels-first): our
// tiled transpose on CUDA, which moves both sides at full width, else ATen's copy.
void copy_transposed(const at::Tensor& dst, const at::Tensor& src) {
#ifdef PATCHGEMM_WITH_CUDA
  if (dst.is_cuda() && cuda::transposing_copy(dst, src)) return;
#endif
  dst.copy_(src);
}

// t's values in a contiguous tensor (t itself where it is one).
at::Tensor contiguous_by_transpose(const at::Tensor& t) {
  if (t.is_contiguous()) return t;
  at::Tensor out = at::empty(t.sizes(), t.options());
  copy_transposed(out, t);
  return out;
}

}  // namespace

std::optional<at::Tensor> patch_matrix_as_view(const at::Tensor& x5, const PatchGeometry& g) {
  if (g.tokens() != 1) return std::nullopt;
  int64_t expected = 1;
  // x5's dims from the patch matrix's fastest-moving column on.
  const std::array<int64_t, 4> dims = g.channels_last ? std::array<int64_t, 4>{1, 4, 3, 2}
                                                      : std::array<int64_t, 4>{4, 3, 2, 1};
  for (int64_t d : dims) {
    if (x5.size(d) != 1 && x5.stride(d) != expected) return std::nullopt;
    expected *= x5.size(d);
  }
  return x5.as_strided({g.batch, 1, g.patch_size()}, {x5.stride(0), g.patch_size(), 1});
}

at::Tensor weight_grad_in_weight_shape(const at::Tensor& rows, const WeightGradProblem& p) {
  if (!p.g.channels_last) return rows.reshape(p.w_shape);
  // Columns (i, j, l, c): [E, *k, C] -> [E, C, *k], channels-last strides (the op keeps them).
  std::vector<int64_t> shape{p.w_shape[0]}, order{0, p.rank + 1};
  for (int64_t d = 0; d < p.rank; ++d) {
    shape.push_back(p.w_shape[2 + d]);
    order.push_back(1 + d);
  }
  shape.push_back(p.w_shape[1]);
  return rows.reshape(shape).permute(order);
}

at::Tensor embed_output(const EmbedProblem& p, const at::Tensor& y_tokens) {
  if (p.tokens || !p.g.channels_last) return y_tokens.view(p.out_shape);
  // Channels-last output: [B, *grid, E] is its memory.
  std::vector<int64_t> shape{p.g.batch}, order{0, p.rank + 1};
  for (int64_t d = 0; d < p.rank; ++d) {
    shape.push_back(p.out_shape[2 + d]);
    order.push_back(1 + d);
  }
  shape.push_back(p.out_shape[1]);
  return y_tokens.view(shape).permute(order);
}

// The alignment of rows of n elements, in elements: the largest power of two up to `align` that
// divides n (cuBLAS picks its kernels by the alignment of every operand's rows).
static int64_t aligned_elements(int64_t n, int64_t align) {
  int64_t a = 1;
  while (a < align && n % (2 * a) == 0) a *= 2;
  return a;
}

// Channels-first output made through tokens (one GEMM over all B*N tokens, then one tiled
// transpose into y) where the GEMM batched over B runs slowly: rows of y (N tokens) less aligned
// than the tokens' rows (E), which keeps cuBLAS on slower kernels (N = 49 against E = 750: its
// one-element kernels, several times slower than the two-element ones), for patches of 256 values
// or more (shorter ones save about what the transpose costs); and long patches (8192 values or
// more) on B GEMMs of under 256 tokens each, a long reduction on few tiles that cuBLAS does not
// split for a batch, where the tokens' rows are aligned themselves.
bool embed_gemm_through_tokens(const EmbedProblem& p) {
  const int64_t N = p.g.tokens(), K = p.g.patch_size(), embed = p.weight.size(0), align = row_alignment(p.x);
  if (K >= 256 && aligned_elements(N, align) < aligned_elements(embed, align)) return true;
  return embed % align == 0 && K >= 8192 && p.g.batch > 1 && N < 256;
}

at::Tensor embed_by_gemm(const EmbedProblem& p) {
  const PatchGeometry& g = p.g;
  const int64_t embed = p.weight.size(0), N = g.tokens(), K = g.patch_size();
  const bool on_cpu = p.x.device().is_cpu();
  if (p.tokens_out || (!on_cpu && embed_gemm_through_tokens(p))) {
    const auto options = p.x.options();
    at::Tensor y = p.tokens_out ? at::empty({g.batch, N, embed}, options) : at::empty(p.out_shape, options);
    // (channels-first y of one token per sample is its tokens' memory too)
    at::Tensor tokens = p.tokens_out || N == 1 ? y.view({g.batch, N, embed}) : at::empty({g.batch, N, embed}, options);
    const auto view = patch_matrix_as_view(p.x5, g);
    // A ones column where it fits in the row's padding (the GEMM reads it against the weight's
    // zero padding): the weight gradient's GEMM then yields the bias gradient from the kept matrix.
    const bool ones_column = p.bias && !view && patch_row_width(K + 1, p.x) == patch_row_width(K, p.x);
    const at::Tensor pm = view ? *view : patchify(p.x5, g, ones_column);
    p.made_patch_matrix({pm, ones_column});
    // y[B*N, E] = P[B*N, ld] @ W'^T; the bias in the GEMM's epilogue where the backend has one.
    run_gemm(merge_batch(pm), padded_weight(p.w2(), std::nullopt, pm.size(2)).t().unsqueeze(0), merge_batch(tokens),
             p.bias ? std::optional<at::Tensor>(p.bias->unsqueeze(0)) : std::nullopt, false, kConv);
    if (p.tokens_out) return embed_output(p, tokens);
    if (N != 1) copy_transposed(y.view({g.batch, embed, N}), tokens.transpose(1, 2));
    return y;
  }
  // Channels-first: y[b] [E, N] = W' [E, K'] @ P[b]^T, batched over B with W' shared. The bias is
  // a column of W' against a ones column of P: no pass over y (whose bias would run along rows,
  // which BLAS epilogues do not offer). On the CPU only where copying W into W' costs less than a
  // pass over y (N > K), on a GPU where bias_as_ones_column; else the bias is added after, and W'
  // is W itself over P's first K columns.
  at::Tensor y = at::empty(p.out_shape, p.x.options());
  const bool atens_16_bit_loop =
      p.x.element_size() == 2 && !(p.x.scalar_type() == at::kBFloat16 && cpu::bf16_gemms_on_onednn());
  if (on_cpu && (atens_16_bit_loop || N < embed)) {
    // tokens [B*N, E] = P @ W^T + bias by linear, then one transposing copy into the channels-first
    // output: the orientation ATen's own 16-bit loop runs fastest, and the one whose product is
    // wide where a sample has fewer tokens than E (oneDNN's and MKL's GEMMs run an output of few,
    // long rows -- E x N -- up to 2x slower than its transpose).
    const at::Tensor pm = patchify(p.x5, g, /*ones_column=*/false).narrow(2, 0, g.patch_size());
    p.made_patch_matrix({pm});
    y.view({g.batch, embed, N}).copy_(at::linear(pm, p.w2(), p.bias).transpose(1, 2));
    return y;
  }
  const bool bias_in_gemm = p.bias.has_value() && (on_cpu ? N > g.patch_size()
                                                           : bias_as_ones_column(g.patch_size(), g.batch * N, p.x));
  const at::Tensor pm = patchify(p.x5, g, bias_in_gemm);
  p.made_patch_matrix({pm, bias_in_gemm});
  const at::Tensor w = padded_weight(p.w2(), bias_in_gemm ? p.bias : std::nullopt,
                                     on_cpu && !bias_in_gemm ? g.patch_size() : pm.size(2));
  const at::Tensor out = y.view({g.batch, embed, N});
  run_gemm(w.unsqueeze(0).expand({g.batch, embed, w.size(1)}), pm.narrow(2, 0, w.size(1)).transpose(1, 2), out,
           std::nullopt, false, kConv);
  if (p.bias && !bias_in_gemm) out.add_(p.bias->view({1, embed, 1}));
  return y;
}

at::Tensor embed_by_aten_linear(const EmbedProblem& p) {
  const PatchGeometry& g = p.g;
  // x [B, C, gd, kd, gh, kh, gw, kw] (splitting dims is always a view), its patches' columns in the
  // patch matrix's order, copied by reshape.
  const at::Tensor v = p.x5.view({g.batch, g.channels, g.grid[0], g.kernel[0], g.grid[1], g.kernel[1], g.grid[2],
                                  g.kernel[2]});
  const at::Tensor pm = g.channels_last ? v.permute({0, 2, 4, 6, 3, 5, 7, 1}) : v.permute({0, 2, 4, 6, 1, 3, 5, 7});
  const at::Tensor rows = pm.reshape({g.batch * g.tokens(), g.patch_size()});
  if (rows.stride(1) == 1) p.made_patch_matrix({rows.view({g.batch, g.tokens(), g.patch_size()})});
  const at::Tensor y = at::linear(rows, p.w2(), p.bias);
  return embed_output(p, y.view({g.batch, g.tokens(), p.weight.size(0)}));
}

// B GEMMs of fewer than 256 rows each (channels-first x, B > 1) make a small grid whose tiles stay
// mostly empty, and a leading dimension (N) of unaligned rows keeps cuBLAS off its fast kernels.
bool unembed_gemm_reads_x_poorly(const UnembedProblem& p) {
  const at::Tensor a = merge_batch(p.x_tokens);
  const bool few_rows = a.size(0) > 1 && p.g.tokens() < 256;
  const bool unaligned = a.stride(2) != 1 && a.stride(2) % row_alignment(p.x) != 0;
  return few_rows || unaligned;
}

// x is copied into tokens order once (copy_transposed) where the GEMM would read channels-first x
// poorly and its patches have over 64 elements. Shorter patches make a GEMM that reads x about
// once, which the copy would make three passes: its slower kernels and idle tiles cost less.
namespace {

bool unembed_gemm_copies_x(const UnembedProblem& p) {
  return p.g.patch_size() > 64 && unembed_gemm_reads_x_poorly(p);
}

}  // namespace

at::Tensor unembed_by_gemm(const UnembedProblem& p) {
  const PatchGeometry& g = p.g;
  const int64_t in_channels = p.weight.size(0), K = g.patch_size(), align = row_alignment(p.x);
  at::Tensor y = at::empty(p.out_shape, p.x.options().memory_format(p.out_format));
  at::Tensor q = at::empty({g.batch, g.tokens(), (K + align - 1) / align * align}, p.x.options());
  // Q[B*N, K] = x_tokens[B*N, C_in] @ W[C_in, K]: one GEMM (batched over B with W shared when
  // x's strides keep B and N apart, e.g. channels-first input).
  const at::Tensor a = merge_batch(unembed_gemm_copies_x(p) ? contiguous_by_transpose(p.x_tokens) : p.x_tokens);
  const at::Tensor w = padded_weight(p.w2(), std::nullopt, q.size(2));
  run_gemm(a, w.unsqueeze(0).expand({a.size(0), in_channels, w.size(1)}), a.size(0) == 1 ? merge_batch(q) : q,
           std::nullopt, false, kConv);
  const at::Tensor y5 = to_5d(y);
  unpatchify(q, g, p.bias, y5);
  return y;
}

at::Tensor unembed_by_aten_linear(const UnembedProblem& p) {
  const PatchGeometry& g = p.g;
  const int64_t in_channels = p.weight.size(0), out_channels = p.weight.size(1);
  // The usual hand rewrite: Q [B, N, C_out * k..] = tokens @ W (ATen folds or copies the tokens view
  // as matmul does), then Q's patches copied out to channels-first positions, then the bias.
  const at::Tensor q = at::matmul(p.x_tokens, p.weight.reshape({in_channels, -1}));
  at::Tensor y = at::empty(p.out_shape, p.x.options().memory_format(p.out_format));
  // y as [B, C_out, gd, kd, gh, kh, gw, kw]: splitting dims is a view in either memory format.
  to_5d(y)
      .view({g.batch, out_channels, g.grid[0], g.kernel[0], g.grid[1], g.kernel[1], g.grid[2], g.kernel[2]})
      .copy_(q.view({g.batch, g.grid[0], g.grid[1], g.grid[2], out_channels, g.kernel[0], g.kernel[1], g.kernel[2]})
                 .permute({0, 4, 1, 5, 2, 6, 3, 7}));
  if (p.bias) to_5d(y).add_(p.bias->view({1, out_channels, 1, 1, 1}));
  return y;
}

// The bias gradient where no GEMM yields it. On NVIDIA GPUs, tokens grad_y in one pass (column_sums);
// elsewhere on the GPU, tokens grad_y [B*N, E] with E < 1024 is folded to [B*N / f, f * E] first:
// ATen's reduction over rows spreads a few hundred columns poorly (P4's E = 192: 0.7 TB/s). Wide
// rows (P2's E = 1280) reduce well in one kernel, which takes a transient scratch there, as
// nn.Linear's bias gradient does. The CPU's reduction over rows runs
// at its best as it is (the fold's fp32 sums cost 5x more).
at::Tensor bias_grad_by_sum(const WeightGradProblem& p) {
  const PatchGeometry& g = p.g;
  const int64_t N = g.tokens(), embed = p.embed;
  if (!p.with_bias) return at::empty({0}, p.x.options());
  if (p.transposed) return sum_for_bias_grad(p.x5, {0, 2, 3, 4});  // patch_unembed's: x per channel
#if defined(PATCHGEMM_WITH_CUDA) && !defined(USE_ROCM)
  // Tokens grad_y whose rows merge over B: one pass of column_sums.
  if (p.x.is_cuda()) {
    const at::Tensor rows = merge_batch(p.dy);
    if (rows.size(0) == 1) {
      const at::Tensor grad_b = at::empty({embed}, p.x.options());
      if (cuda::column_sums(rows.select(0, 0), grad_b)) return grad_b;
    }
  }
#endif
  if (!p.x.is_cpu() && p.dy.is_contiguous() && embed < 1024) {
    int64_t f = 32;
    while (f > 1 && (g.batch * N) % f) f /= 2;
    const at::ScalarType acc = at::toOpMathType(p.x.scalar_type());
    return p.dy.reshape({g.batch * N / f, f * embed}).sum(0, false, acc).view({f, embed}).sum(0).to(p.x.scalar_type());
  }
  // Channels-first: its contiguous rows; other strides through the view (a reshape would copy
  // grad_y to sum it).
  if (!p.tokens && N > 1 && p.grad_y.is_contiguous()) {
    return sum_for_bias_grad(p.grad_y.view({g.batch, embed, N}), {0, 2});
  }
  return sum_for_bias_grad(p.dy, {0, 1});
}

namespace {

// dW = grad_y^T @ P for a patch matrix P [B, N, ld] of x; the bias gradient from P's ones column
// at K where `ones_column`, else by a sum.
WeightGrads weight_grad_from_patches(const WeightGradProblem& p, const at::Tensor& pm, bool ones_column) {
  const PatchGeometry& g = p.g;
  const int64_t N = g.tokens(), K = g.patch_size(), embed = p.embed;
  const int64_t ld = pm.size(2);
  at::Tensor dw;  // [1, E, ld]: [dW | dbias | (padding)]
  const at::Tensor& dy = p.dy;
  const at::ScalarType sums_type = at::toOpMathType(p.x.scalar_type());
  const bool tokens_merge = g.batch == 1 || dy.stride(0) == N * dy.stride(1);
  const bool per_sample = !tokens_merge && per_sample_gemms(p.x, g.batch, embed, ld, N);
  if (tokens_merge) {
    // One GEMM, reducing over all B*N tokens.
    dw = at::empty({1, embed, ld}, p.x.options());
    run_gemm(merge_batch(dy).transpose(1, 2), merge_batch(pm), dw, std::nullopt, false, kConv);
  } else if (ld * int64_t(c10::elementSize(sums_type)) < N * dy.element_size() &&
             (per_sample || !batched_gemm_runs_unsplit(p.x, g.batch, embed, ld, N))) {
    // Channels-first grad_y cannot merge B and N; each sample's sums [E, ld] (fp32 for 16-bit
    // data, rounded once at the end, as one GEMM's are) are smaller than its grad_y, so summing
    // per sample moves less than copying grad_y [B, E, N] into tokens order -- unless the only
    // GEMM left for it, one batched over the samples, would run unsplit on few tiles.
    if (per_sample) {
      // One GEMM per sample, accumulating: cuBLAS splits each long reduction over the GPU, which
      // a batched call of few tiles would leave mostly idle.
      const at::Tensor sums = at::empty({1, embed, ld}, p.x.options().dtype(sums_type));
      for (int64_t b = 0; b < g.batch; ++b) {
        run_gemm(dy.narrow(0, b, 1).transpose(1, 2), pm.narrow(0, b, 1), sums, std::nullopt, /*accumulate=*/b > 0,
                 kConv);
      }
      dw = sums.to(p.x.scalar_type());
    } else {
      // One GEMM batched over the samples, then one reduction over B.
      const at::Tensor sums = at::empty({g.batch, embed, ld}, p.x.options().dtype(sums_type));
      run_gemm(dy.transpose(1, 2), pm, sums, std::nullopt, false, kConv);
      dw = sums.sum(0, true).to(p.x.scalar_type());
    }
  } else {
    // One copy of grad_y into tokens order, then one GEMM over all B * N tokens.
    dw = at::empty({1, embed, ld}, p.x.options());
    run_gemm(merge_batch(contiguous_by_transpose(dy)).transpose(1, 2), merge_batch(pm), dw, std::nullopt, false, kConv);
  }
  if (g.batch == 0) dw.zero_();
  const at::Tensor grad_w = weight_grad_in_weight_shape(dw.select(0, 0).narrow(1, 0, K), p);
  at::Tensor grad_b = ones_column ? dw.select(0, 0).select(1, K).contiguous() : bias_grad_by_sum(p);
  return {grad_w, grad_b};
}

}  // namespace

WeightGrads weight_grad_by_gemm(const WeightGradProblem& p) {
  const PatchGeometry& g = p.g;
  const int64_t N = g.tokens(), K = g.patch_size();
  const auto view = patch_matrix_as_view(p.x5, g);
  // The bias gradient comes out of the GEMM where bias_as_ones_column (a 16^3 stem on 4 channels:
  // dW 12.6M values, 33 times grad_y, is summed apart).
  const bool ones_column = p.with_bias && !p.transposed && !view && bias_as_ones_column(K, g.batch * N, p.x);
  return weight_grad_from_patches(p, view ? *view : patchify(p.x5, g, ones_column), ones_column);
}

WeightGrads weight_grad_by_saved_patches(const WeightGradProblem& p) {
  TORCH_INTERNAL_ASSERT(p.saved_patches, "weight_grad_by_saved_patches: no saved patch matrix");
  const PatchMatrix& m = *p.saved_patches;
  TORCH_INTERNAL_ASSERT(m.rows.size(0) == p.g.batch && m.rows.size(1) == p.g.tokens() &&
                            m.rows.size(2) >= p.g.patch_size(),
                        "weight_grad_by_saved_patches: a patch matrix ", m.rows.sizes(), " for ", p.g.batch, " x ",
                        p.g.tokens(), " patches of ", p.g.patch_size());
  // (A transposed problem's bias gradient is summed from x, patch_unembed's grad_y: no ones column.)
  return weight_grad_from_patches(p, m.rows, m.ones_column && p.with_bias && !p.transposed);
}

}  // namespace patchgemm
