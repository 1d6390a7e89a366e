// Autograd for the differentiable ops, registered on the Autograd dispatch key. It lives in C++
// because a Python autograd.Function costs tens of microseconds of host time per layer and call,
// which is as long as the GPU work of a ViT patch embedding (P1/P2 in BENCHMARKS.md).
//
// Forward and backward call the ops through the dispatcher: that reaches the right backend, and
// under torch.compile the fake kernels (patchgemm/ops.py), so the compiled backward traces the same
// ops. The patch ops, whose checks and choice cost the most host time, run a plain call (dense CPU
// or CUDA tensors, no mode: ops/checks.h) from its problem instead, checked once here.
//
//   grouped_linear  dx = grouped_linear_grad_input, dW = grouped_linear_grad_weight, db = sum
//   ragged_grouped_linear  the same through its ragged ops, db = per-group sums (segment_reduce)
//   grouped_pointwise_conv  its _grad_input and _grad_weight ops (db from the latter, with_bias)
//   patch_embed     dx = patch_unembed with the same weight, (dW, db) = patch_weight_grad
//   patch_unembed   dx = patch_embed with the same weight, (dW, db) = patch_weight_grad (roles
//                   swapped, transposed = true), on the patch matrix of grad_y that dx gathered
//                   where it gathered one (unembed_grads_sharing_patches)
//   instance_norm_act  instance_norm_act_backward, from x and the per-channel statistics
//   swiglu          swiglu_backward, from gate_up (h is not saved: the backward recomputes it)
//   patch_matrix    patch_matrix_backward (the gather's adjoint scatter), and the other way round
// One exception: where patch_embed's (patch_unembed's) choice settles on ATen's (transposed)
// convolution before anything runs (channels-last x on cuDNN, plain calls), the op is that
// convolution with PyTorch's autograd (ops/patch_embed.h: may_settle_on_aten).
// patch_embed's backward takes the patch matrix its forward gathered, where the forward's
// implementation made one (gather + GEMM, the linear rewrite; not the implicit kernels, which read
// x in place): the weight gradient's GEMM reads it (the saved_patches candidate) as the linear
// rewrite's backward does, instead of gathering x again. Elsewhere patch_weight_grad recomputes it
// from x, an input of the op (saving an input costs no memory). The normalized activation is never
// saved: the norm's backward recomputes it from x.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "kernels/gemm/gemm.h"
#include "kernels/norm/instance_norm.h"
#include "ops/checks.h"
#include "ops/instance_norm.h"
#include "ops/patch_embed.h"
#include "ops/ragged_grouped_linear.h"
#include "problems/grouped_pointwise_conv.h"
#include "selection/norm_tables.h"
#include "selection/patch_tables.h"
#include "selection/ragged_tables.h"
#include "selection/registry.h"

namespace patchgemm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::Function;
using torch::autograd::variable_list;

using OptionalTensor = std::optional<at::Tensor>;
using Weighted = at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool);
using Patch = at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, bool,
                         at::OptionalIntArrayRef);
using PatchWeightGrad = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                           c10::IntArrayRef, bool,
                                                           at::OptionalIntArrayRef, bool, bool);
using GradInput = at::Tensor(const at::Tensor&, const at::Tensor&, bool);

template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Runs the backend (or, under torch.compile, the fake) kernel of `op`. The op validates its
// arguments there, so the forward functions save their context only after this returns.
template <typename Op, typename... Args>
at::Tensor call_below_autograd(const Op& op, Args&&... args) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

bool has_value(const OptionalTensor& t) { return t.has_value() && t->defined(); }

// An optional tensor as plain_call takes it (undefined: absent).
at::Tensor or_undefined(const OptionalTensor& t) { return t.value_or(at::Tensor()); }

// Runs `fn` (the op's C++ on a plain call) as its backend kernel would run: below autograd.
template <typename Fn>
auto below_autograd(Fn fn) {
  at::AutoDispatchBelowADInplaceOrView below;
  return fn();
}

// Whether a call must go through its autograd Function: grad mode on and an input that requires
// grad, or an input with a forward-mode tangent (which Function::apply reports as unsupported).
// Otherwise the op runs its backend directly, as ATen's own ops do under no_grad: no graph node,
// context or saved data per call.
bool tracked(const at::Tensor& t) {
  return t.defined() && ((t.requires_grad() && at::GradMode::is_enabled()) || t._fw_grad(0).defined());
}
bool tracked(const OptionalTensor& t) { return t.has_value() && tracked(*t); }
template <typename... Inputs>
bool needs_autograd(const Inputs&... inputs) {
  return (tracked(inputs) || ...);
}

// Sizes as plain integers; under torch.compile with dynamic shapes this specializes them (the
// ops take int[] arguments).
std::vector<int64_t> concrete(c10::SymIntArrayRef sizes) {
  std::vector<int64_t> out;
  out.reserve(sizes.size());
  for (const c10::SymInt& s : sizes) out.push_back(s.guard_int(__FILE__, __LINE__));
  return out;
}

// The edge index of each differentiable input: bias has one only when it is given (an absent
// optional tensor is not a graph input), so it comes after x (0) and weight (1).
constexpr size_t kX = 0, kWeight = 1, kBias = 2;

bool needs_bias_grad(AutogradContext* ctx) {
  return ctx->saved_data["has_bias"].toBool() && ctx->needs_input_grad(kBias);
}

// create_graph=True (grad mode on in backward): a gradient made by an op with no derivative of its
// own would enter the graph as a constant, and a second derivative through it would silently
// leave it out. Refused instead, naming what; torch.func transforms differentiate them again.
void refuse_second_derivative(bool computed, const char* op, const char* what) {
  TORCH_CHECK(!(computed && at::GradMode::is_enabled()), "patchgemm.", op, ": the ", what,
              " is not differentiable again, so backward with create_graph=True cannot compute it "
              "(torch.func transforms, e.g. torch.func.grad, can)");
}

// create_graph=True for the ops whose fused backward has no derivative (swiglu, the norm): the
// gradient of their forward recomputed in ATen ops, which autograd differentiates again.
variable_list grad_of_recomputation(const at::Tensor& y, const variable_list& inputs, const at::Tensor& grad_y) {
  return torch::autograd::grad({y}, inputs, {grad_y}, /*retain_graph=*/true, /*create_graph=*/true,
                               /*allow_unused=*/true);
}

// ---- grouped_linear ------------------------------------------------------------------------------

const auto& grouped_linear_op() {
  static const auto op = find_op<Weighted>("patchgemm::grouped_linear");
  return op;
}

struct GroupedLinear : Function<GroupedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptionalTensor& bias, bool group_major) {
    at::Tensor y = call_below_autograd(grouped_linear_op(), x, weight, bias, group_major);
    // Keep only what backward reads: x for dW, the weight for dx (inputs: no copies).
    ctx->save_for_backward({weight.requires_grad() ? x : at::Tensor(),
                            x.requires_grad() ? weight : at::Tensor()});
    ctx->saved_data["group_major"] = group_major;
    ctx->saved_data["has_bias"] = has_value(bias);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &grad_y = grads[0];
    const bool group_major = ctx->saved_data["group_major"].toBool();
    refuse_second_derivative(ctx->needs_input_grad(kX) || ctx->needs_input_grad(kWeight), "grouped_linear",
                             "gradient of x and of the weight");
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(kX)) {
      static const auto op = find_op<GradInput>("patchgemm::grouped_linear_grad_input");
      grad_x = op.call(grad_y, weight, group_major);
    }
    if (ctx->needs_input_grad(kWeight)) {
      static const auto op = find_op<GradInput>("patchgemm::grouped_linear_grad_weight");
      grad_w = op.call(grad_y, x, group_major);
    }
    if (needs_bias_grad(ctx)) grad_b = sum_for_bias_grad(grad_y, {group_major ? 1 : 0});
    return {grad_x, grad_w, grad_b, at::Tensor()};
  }
};

at::Tensor grouped_linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                                   const OptionalTensor& bias, bool group_major) {
  if (!needs_autograd(x, weight, bias)) return call_below_autograd(grouped_linear_op(), x, weight, bias, group_major);
  return GroupedLinear::apply(x, weight, bias, group_major);
}

// ---- ragged_grouped_linear -----------------------------------------------------------------------

using Ragged = at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&);
using RaggedGrad = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&);

const auto& ragged_grouped_linear_op() {
  static const auto op = find_op<Ragged>("patchgemm::ragged_grouped_linear");
  return op;
}

// `plain`: every tensor plain (ops/checks.h), so the op's C++ runs directly, forward and backward.
struct RaggedGroupedLinear : Function<RaggedGroupedLinear> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptionalTensor& bias, const at::Tensor& offsets, bool plain) {
    at::Tensor y = plain ? below_autograd([&] { return ragged_grouped_linear(x, weight, bias, offsets); })
                         : call_below_autograd(ragged_grouped_linear_op(), x, weight, bias, offsets);
    ctx->save_for_backward({weight.requires_grad() ? x : at::Tensor(),
                            x.requires_grad() ? weight : at::Tensor(), offsets});
    ctx->saved_data["has_bias"] = has_value(bias);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &offsets = saved[2], &grad_y = grads[0];
    refuse_second_derivative(ctx->needs_input_grad(kX) || ctx->needs_input_grad(kWeight), "grouped_linear",
                             "gradient of x and of the weight (ragged groups)");
    // (Grad mode is off here: the refusal above.)
    const bool plain = plain_call({grad_y, x, weight, offsets});
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(kX)) {
      static const auto op = find_op<RaggedGrad>("patchgemm::ragged_grouped_linear_grad_input");
      grad_x = plain ? below_autograd([&] { return ragged_grouped_linear_grad_input(grad_y, weight, offsets); })
                     : op.call(grad_y, weight, offsets);
    }
    if (ctx->needs_input_grad(kWeight)) {
      static const auto op = find_op<RaggedGrad>("patchgemm::ragged_grouped_linear_grad_weight");
      grad_w = plain ? below_autograd([&] { return ragged_grouped_linear_grad_weight(grad_y, x, offsets); })
                     : op.call(grad_y, x, offsets);
    }
    if (needs_bias_grad(ctx)) {
      // Per-group sums of grad_y's rows, accumulated in the op-math dtype (ATen's segment sums of
      // 16-bit data accumulate in 16 bits). `unsafe`: no check of the sizes against grad_y, which
      // would read them on the host (a sync); they were checked where they could be.
      const at::Tensor rows = grad_y.to(at::toOpMathType(grad_y.scalar_type()));
      if (offsets.is_cpu() && selection::detail::capturing_graph(grad_y.device())) {
        // A CUDA graph cannot copy the sizes to the GPU: one sum per group over host bounds.
        const std::vector<int64_t> bounds = ragged_bounds("ragged_grouped_linear", offsets, grad_y.size(0));
        std::vector<at::Tensor> sums;
        for (size_t g = 0; g + 1 < bounds.size(); ++g) sums.push_back(rows.slice(0, bounds[g], bounds[g + 1]).sum(0));
        grad_b = at::stack(sums).to(grad_y.scalar_type());
      } else {
        grad_b = at::segment_reduce(rows, "sum", ragged_sizes(offsets, grad_y.device()), {}, {}, 0, /*unsafe=*/true)
                     .to(grad_y.scalar_type());
      }
    }
    return {grad_x, grad_w, grad_b, at::Tensor(), at::Tensor()};
  }
};

at::Tensor ragged_grouped_linear_autograd(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias,
                                          const at::Tensor& offsets) {
  const bool plain = plain_call({x, weight, or_undefined(bias), offsets});
  if (!needs_autograd(x, weight, bias)) {
    return plain ? below_autograd([&] { return ragged_grouped_linear(x, weight, bias, offsets); })
                 : call_below_autograd(ragged_grouped_linear_op(), x, weight, bias, offsets);
  }
  return RaggedGroupedLinear::apply(x, weight, bias, offsets, plain);
}

// ---- grouped_pointwise_conv ----------------------------------------------------------------------

using Pointwise = at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, int64_t);
using PointwiseGrad = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using PointwiseWeightGrad = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t, bool);

const auto& grouped_pointwise_conv_op() {
  static const auto op = find_op<Pointwise>("patchgemm::grouped_pointwise_conv");
  return op;
}

struct GroupedPointwiseConv : Function<GroupedPointwiseConv> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptionalTensor& bias, int64_t groups) {
    at::Tensor y;
    {
      const BackwardFollows training;
      y = call_below_autograd(grouped_pointwise_conv_op(), x, weight, bias, groups);
    }
    ctx->save_for_backward({weight.requires_grad() ? x : at::Tensor(), x.requires_grad() ? weight : at::Tensor()});
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["has_bias"] = has_value(bias);
    // dx takes x's memory format, as the conv's does: the op follows grad_y's, so backward hands
    // it grad_y in y's (= x's) format.
    // (is_contiguous, not suggest_memory_format: it also works on the symbolic sizes of torch.compile.)
    at::MemoryFormat format = at::MemoryFormat::Contiguous;
    const auto channels_last = y.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d;
    if (y.dim() >= 4 && !y.is_contiguous() && y.is_contiguous(channels_last)) format = channels_last;
    ctx->saved_data["format"] = static_cast<int64_t>(format);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &weight = saved[1], &grad_y = grads[0];
    const int64_t groups = ctx->saved_data["groups"].toInt();
    refuse_second_derivative(ctx->needs_input_grad(kX) || ctx->needs_input_grad(kWeight), "grouped_pointwise_conv",
                             "gradient of x and of the weight");
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(kX)) {
      static const auto op = find_op<PointwiseGrad>("patchgemm::grouped_pointwise_conv_grad_input");
      const auto format = static_cast<at::MemoryFormat>(ctx->saved_data["format"].toInt());
      grad_x = op.call(grad_y.contiguous(format), weight, groups);
    }
    if (ctx->needs_input_grad(kWeight)) {  // with the bias gradient, which some kernels sum in the same pass
      static const auto op = find_op<PointwiseWeightGrad>("patchgemm::grouped_pointwise_conv_grad_weight");
      std::tie(grad_w, grad_b) = op.call(grad_y, x, groups, needs_bias_grad(ctx));
      if (!needs_bias_grad(ctx)) grad_b = at::Tensor();
    } else if (needs_bias_grad(ctx)) {  // (a frozen weight: rare)
      std::vector<int64_t> dims{0};
      for (int64_t d = 2; d < grad_y.dim(); ++d) dims.push_back(d);
      // (one reduction in the op-math dtype: it also traces with the symbolic sizes of torch.compile)
      grad_b = grad_y.sum(dims, false, at::toOpMathType(grad_y.scalar_type())).to(grad_y.scalar_type());
    }
    return {grad_x, grad_w, grad_b, at::Tensor()};
  }
};

at::Tensor grouped_pointwise_conv_autograd(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias,
                                           int64_t groups) {
  if (!needs_autograd(x, weight, bias))
    return call_below_autograd(grouped_pointwise_conv_op(), x, weight, bias, groups);
  return GroupedPointwiseConv::apply(x, weight, bias, groups);
}

// ---- patch_embed / patch_unembed -----------------------------------------------------------------

// The patch matrix patch_embed's forward `p` made, where its weight gradient takes it; else none.
std::optional<PatchMatrix> patches_for_weight_grad(const EmbedProblem& p, bool with_bias) {
  if (!p.patch_matrix() || !weight_grad_takes_patch_matrix(p, with_bias)) return std::nullopt;
  return p.patch_matrix();
}

// What both backward passes keep: x when the weight gradient is needed (patch_weight_grad
// recomputes the patch matrix from it, unless patch_embed's forward `problem` made one that the
// weight gradient takes), the weight when dx is.

void save_patch_context(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                        const OptionalTensor& bias, bool tokens, c10::IntArrayRef levels,
                        const EmbedProblem* problem = nullptr) {
  const bool needs_b = has_value(bias) && bias->requires_grad();
  const bool needs_w = weight.requires_grad() || needs_b;
  const std::optional<PatchMatrix> patches =
      needs_w && problem ? patches_for_weight_grad(*problem, needs_b) : std::nullopt;
  const bool keeps_patches = patches.has_value();
  ctx->save_for_backward({needs_w ? x : at::Tensor(), x.requires_grad() ? weight : at::Tensor(),
                          keeps_patches ? patches->rows : at::Tensor()});
  ctx->saved_data["patches_ones_column"] = keeps_patches && patches->ones_column;
  ctx->saved_data["tokens"] = tokens;
  ctx->saved_data["levels"] = levels.vec();
  ctx->saved_data["has_bias"] = has_value(bias);
  ctx->saved_data["kernel"] = concrete(weight.sym_sizes().slice(2));
}

// What save_patch_context kept, read back in backward.
struct PatchContext {
  at::Tensor x, weight;
  std::optional<PatchMatrix> patches;
  bool tokens;
  std::vector<int64_t> levels, kernel;
};

PatchContext load_patch_context(AutogradContext* ctx) {
  const variable_list saved = ctx->get_saved_variables();
  std::optional<PatchMatrix> patches;
  if (saved[2].defined()) patches = PatchMatrix{saved[2], ctx->saved_data["patches_ones_column"].toBool()};
  return {saved[0], saved[1], std::move(patches), ctx->saved_data["tokens"].toBool(),
          ctx->saved_data["levels"].toIntVector(), ctx->saved_data["kernel"].toIntVector()};
}

const auto& patch_embed_op() {
  static const auto op = find_op<Patch>("patchgemm::patch_embed");
  return op;
}
const auto& patch_unembed_op() {
  static const auto op = find_op<Patch>("patchgemm::patch_unembed");
  return op;
}
const auto& patch_weight_grad_op() {
  static const auto op = find_op<PatchWeightGrad>("patchgemm::patch_weight_grad");
  return op;
}

// The patch ops' autograd kernels, which backward calls directly for dx (the other op) where the
// call is plain: they record it under create_graph=True, as through the dispatcher.
at::Tensor patch_embed_autograd(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias, bool tokens,
                                at::OptionalIntArrayRef levels);
at::Tensor patch_unembed_autograd(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias,
                                  bool tokens, at::OptionalIntArrayRef levels);

// dW (and db) in backward, directly where the call is plain (grad mode is off: a second derivative
// of it is refused), there from `patches` where the forward kept its patch matrix of x.
std::tuple<at::Tensor, at::Tensor> patch_weight_grad_in_backward(
    const at::Tensor& grad_y, const at::Tensor& x, c10::IntArrayRef kernel, bool tokens, c10::IntArrayRef levels,
    bool with_bias, bool transposed, const std::optional<PatchMatrix>& patches = std::nullopt) {
  if (!plain_call({grad_y, x}) || at::GradMode::is_enabled()) {
    return patch_weight_grad_op().call(grad_y, x, kernel, tokens, levels, with_bias, transposed);
  }
  return below_autograd([&] {
    WeightGradProblem p = weight_grad_problem(grad_y, x, kernel, tokens, levels, with_bias, transposed);
    p.saved_patches = patches;
    return patch_weight_grads(p);
  });
}

// patch_unembed's dx and (dW, db) in backward where the call is plain: dx is patch_embed of grad_y,
// and where that embedding gathers grad_y's patch matrix (gather + GEMM, the linear rewrite), dW
// multiplies the same matrix (saved_patches) instead of gathering grad_y again, as the linear
// rewrite's backward gathers it once for both. The modes choose dx's embedding with that weight
// gradient following it, as they choose patch_embed's forward in training.
std::tuple<at::Tensor, at::Tensor, at::Tensor> unembed_grads_sharing_patches(const at::Tensor& grad_y,
                                                                           const PatchContext& c, bool with_bias) {
  return below_autograd([&] {
    EmbedProblem dx = embed_problem(grad_y, c.weight, std::nullopt, c.tokens, c.levels);
    const WeightGradProblem checked = weight_grad_problem(c.x, grad_y, c.kernel, c.tokens, c.levels, with_bias, true);
    const auto weight_grads = [&](bool reusable) {
      WeightGradProblem w = checked;
      if (reusable && dx.patch_matrix() && weight_grad_takes_patch_matrix(dx, with_bias, /*transposed=*/true)) {
        w.saved_patches = dx.patch_matrix();
      }
      return patch_weight_grads(w);
    };
    dx.weight_grad_after = [&weight_grads](const at::Tensor&, bool reusable) { weight_grads(reusable); };
    at::Tensor grad_x = select_patch_embed(dx);
    auto [grad_w, grad_b] = weight_grads(/*reusable=*/true);  // (the chosen candidate's matrix, or none)
    return std::make_tuple(std::move(grad_x), std::move(grad_w), std::move(grad_b));
  });
}

// The Functions' forward runs the op on `problem` where the call is plain (the problem the autograd
// kernel checked), else through the dispatcher.
struct PatchEmbed : Function<PatchEmbed> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptionalTensor& bias, bool tokens, c10::IntArrayRef levels,
                            const EmbedProblem* problem) {
    at::Tensor y = problem ? below_autograd([&] { return select_patch_embed(*problem); })
                           : call_below_autograd(patch_embed_op(), x, weight, bias, tokens, levels);
    save_patch_context(ctx, x, weight, bias, tokens, levels, problem);
    if (tokens && levels.empty() && x.requires_grad()) {
      // dx unpatchifies tokens, which needs the grid: row-major tokens are one level, the grid.
      const std::vector<int64_t> size = concrete(x.sym_sizes().slice(2));
      const std::vector<int64_t> kernel = ctx->saved_data["kernel"].toIntVector();
      std::vector<int64_t> grid(kernel.size());
      for (size_t d = 0; d < grid.size(); ++d) grid[d] = size[d] / kernel[d];
      ctx->saved_data["grid"] = grid;
    }
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const PatchContext c = load_patch_context(ctx);
    const at::Tensor& grad_y = grads[0];
    refuse_second_derivative(ctx->needs_input_grad(kWeight), "patch_embed", "weight gradient");
    at::Tensor grad_x, grad_w, grad_b;
    if (ctx->needs_input_grad(kX)) {
      const std::vector<int64_t> unembed_levels =
          ctx->saved_data.count("grid") ? ctx->saved_data["grid"].toIntVector() : c.levels;
      grad_x = plain_call({grad_y, c.weight})
                   ? patch_unembed_autograd(grad_y, c.weight, std::nullopt, c.tokens, unembed_levels)
                   : patch_unembed_op().call(grad_y, c.weight, std::nullopt, c.tokens, unembed_levels);
    }
    const bool needs_b = needs_bias_grad(ctx);
    if (ctx->needs_input_grad(kWeight) || needs_b) {
      std::tie(grad_w, grad_b) =
          patch_weight_grad_in_backward(grad_y, c.x, c.kernel, c.tokens, c.levels, needs_b, false, c.patches);
    }
    return {grad_x, ctx->needs_input_grad(kWeight) ? grad_w : at::Tensor(),
            needs_b ? grad_b : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct PatchUnembed : Function<PatchUnembed> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight,
                            const OptionalTensor& bias, bool tokens, c10::IntArrayRef levels,
                            const UnembedProblem* problem) {
    at::Tensor y = problem ? below_autograd([&] { return select_patch_unembed(*problem); })
                           : call_below_autograd(patch_unembed_op(), x, weight, bias, tokens, levels);
    save_patch_context(ctx, x, weight, bias, tokens, levels);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const PatchContext c = load_patch_context(ctx);
    const at::Tensor& grad_y = grads[0];
    refuse_second_derivative(ctx->needs_input_grad(kWeight), "patch_unembed", "weight gradient");
    const bool needs_b = needs_bias_grad(ctx);
    at::Tensor grad_x, grad_w, grad_b;
    // (Grad mode is off here: refused above for a weight gradient.)
    if (ctx->needs_input_grad(kX) && ctx->needs_input_grad(kWeight) && plain_call({grad_y, c.weight, c.x})) {
      std::tie(grad_x, grad_w, grad_b) = unembed_grads_sharing_patches(grad_y, c, needs_b);
      return {grad_x, grad_w, needs_b ? grad_b : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    }
    if (ctx->needs_input_grad(kX)) {
      grad_x = plain_call({grad_y, c.weight})
                   ? patch_embed_autograd(grad_y, c.weight, std::nullopt, c.tokens, c.levels)
                   : patch_embed_op().call(grad_y, c.weight, std::nullopt, c.tokens, c.levels);
    }
    if (ctx->needs_input_grad(kWeight)) {
      // The bias gradient in the same pass over grad_y where a kernel can (tiny_patch_weight_grad.cu).
      std::tie(grad_w, grad_b) =
          patch_weight_grad_in_backward(c.x, grad_y, c.kernel, c.tokens, c.levels, needs_b, true);
    } else if (needs_b) {
      std::vector<int64_t> dims{0};
      for (int64_t d = 2; d < grad_y.dim(); ++d) dims.push_back(d);
      grad_b = sum_for_bias_grad(grad_y, dims);
    }
    return {grad_x, grad_w, needs_b ? grad_b : at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor patch_embed_autograd(const at::Tensor& x_given, const at::Tensor& weight,
                                const OptionalTensor& bias, bool tokens, at::OptionalIntArrayRef levels_given) {
  const c10::IntArrayRef levels = token_levels(levels_given);
  // What a conv leaves out is cut here, above autograd: its positions get a zero gradient.
  const at::Tensor x = whole_patches(x_given, weight, levels);
  const bool tracked = needs_autograd(x, weight, bias);
  if (!plain_call({x, weight, or_undefined(bias)})) {
    if (!tracked) return call_below_autograd(patch_embed_op(), x, weight, bias, tokens, levels);
    return PatchEmbed::apply(x, weight, bias, tokens, levels, static_cast<const EmbedProblem*>(nullptr));
  }
  EmbedProblem p = embed_problem(x, weight, bias, tokens, levels);
  if (!tracked) return below_autograd([&] { return select_patch_embed(p); });
  if (may_settle_on_aten(p.g) && embed_settles_on_aten_conv(p)) return embed_by_aten_conv(p);
  const bool needs_b = has_value(bias) && bias->requires_grad();
  if (weight.requires_grad() || needs_b) {
    // The modes choose the forward with its weight gradient: some forwards leave the patch matrix
    // that gradient would otherwise gather again (save_patch_context keeps it on the same terms).
    p.weight_grad_after = [&p, needs_b, levels = levels.vec()](const at::Tensor& y, bool reusable) {
      WeightGradProblem w = weight_grad_problem(y, p.x, p.weight.sizes().slice(2), p.tokens, levels, needs_b, false);
      if (reusable) w.saved_patches = patches_for_weight_grad(p, needs_b);
      patch_weight_grads(w);
    };
  }
  return PatchEmbed::apply(x, weight, bias, tokens, levels, &p);
}

at::Tensor patch_unembed_autograd(const at::Tensor& x, const at::Tensor& weight,
                                  const OptionalTensor& bias, bool tokens,
                                  at::OptionalIntArrayRef levels_given) {
  const c10::IntArrayRef levels = token_levels(levels_given);
  const bool tracked = needs_autograd(x, weight, bias);
  if (!plain_call({x, weight, or_undefined(bias)})) {
    if (!tracked) return call_below_autograd(patch_unembed_op(), x, weight, bias, tokens, levels);
    return PatchUnembed::apply(x, weight, bias, tokens, levels, static_cast<const UnembedProblem*>(nullptr));
  }
  const UnembedProblem p = unembed_problem(x, weight, bias, tokens, levels);
  if (!tracked) return below_autograd([&] { return select_patch_unembed(p); });
  if (may_settle_on_aten(p.g) && unembed_settles_on_aten_conv_transpose(p)) return unembed_by_aten_conv_transpose(p);
  return PatchUnembed::apply(x, weight, bias, tokens, levels, &p);
}

// ---- patch_matrix --------------------------------------------------------------------------------

using PatchMatrix = at::Tensor(const at::Tensor&, c10::IntArrayRef);
using PatchMatrixBackward = at::Tensor(const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef);

const auto& patch_matrix_op() {
  static const auto op = find_op<PatchMatrix>("patchgemm::patch_matrix");
  return op;
}
const auto& patch_matrix_backward_op() {
  static const auto op = find_op<PatchMatrixBackward>("patchgemm::patch_matrix_backward");
  return op;
}

// A gather and its adjoint scatter: each the other's gradient.
struct PatchMatrixFn : Function<PatchMatrixFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, c10::IntArrayRef kernel) {
    ctx->saved_data["x_shape"] = x.sizes().vec();
    ctx->saved_data["kernel"] = kernel.vec();
    return call_below_autograd(patch_matrix_op(), x, kernel);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto x_shape = ctx->saved_data["x_shape"].toIntVector(), kernel = ctx->saved_data["kernel"].toIntVector();
    return {patch_matrix_backward_op().call(grads[0], x_shape, kernel), at::Tensor()};
  }
};

struct PatchMatrixBackwardFn : Function<PatchMatrixBackwardFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& grad, c10::IntArrayRef x_shape,
                            c10::IntArrayRef kernel) {
    ctx->saved_data["kernel"] = kernel.vec();
    return call_below_autograd(patch_matrix_backward_op(), grad, x_shape, kernel);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {patch_matrix_op().call(grads[0], ctx->saved_data["kernel"].toIntVector()), at::Tensor(), at::Tensor()};
  }
};

at::Tensor patch_matrix_autograd(const at::Tensor& x, c10::IntArrayRef kernel) {
  if (!needs_autograd(x)) return call_below_autograd(patch_matrix_op(), x, kernel);
  return PatchMatrixFn::apply(x, kernel);
}

at::Tensor patch_matrix_backward_autograd(const at::Tensor& grad, c10::IntArrayRef x_shape, c10::IntArrayRef kernel) {
  if (!needs_autograd(grad)) return call_below_autograd(patch_matrix_backward_op(), grad, x_shape, kernel);
  return PatchMatrixBackwardFn::apply(grad, x_shape, kernel);
}

// ---- swiglu --------------------------------------------------------------------------------------

const auto& swiglu_op() {
  static const auto op = find_op<at::Tensor(const at::Tensor&)>("patchgemm::swiglu");
  return op;
}

struct Swiglu : Function<Swiglu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate_up) {
    at::Tensor h = call_below_autograd(swiglu_op(), gate_up);
    ctx->save_for_backward({gate_up});
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor gate_up = ctx->get_saved_variables()[0];
    if (at::GradMode::is_enabled()) {
      const std::vector<at::Tensor> halves = gate_up.chunk(2, -1);
      return grad_of_recomputation(at::silu(halves[0]) * halves[1], {gate_up}, grads[0]);
    }
    static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&)>("patchgemm::swiglu_backward");
    return {op.call(grads[0], gate_up)};
  }
};

at::Tensor swiglu_autograd(const at::Tensor& gate_up) {
  if (!needs_autograd(gate_up)) return call_below_autograd(swiglu_op(), gate_up);
  return Swiglu::apply(gate_up);
}

// ---- instance_norm_act ---------------------------------------------------------------------------

using NormResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Norm = NormResult(const at::Tensor&, const OptionalTensor&, const OptionalTensor&, double,
                        bool, bool);
using NormBackward = NormResult(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                const OptionalTensor&, const at::Tensor&, const at::Tensor&, bool,
                                bool);

const auto& instance_norm_act_op() {
  static const auto op = find_op<Norm>("patchgemm::instance_norm_act");
  return op;
}

NormResult instance_norm_act_below_autograd(const at::Tensor& x, const OptionalTensor& weight,
                                            const OptionalTensor& bias, double eps, bool gelu, bool tokens) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return instance_norm_act_op().call(x, weight, bias, eps, gelu, tokens);
}

struct InstanceNormAct : Function<InstanceNormAct> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const OptionalTensor& weight, const OptionalTensor& bias,
                               double eps, bool gelu, bool tokens) {
    const NormResult result = instance_norm_act_below_autograd(x, weight, bias, eps, gelu, tokens);
    const auto& [y, mean, rstd] = result;
    ctx->save_for_backward({x, weight.value_or(at::Tensor()), bias.value_or(at::Tensor()), mean, rstd});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["gelu"] = gelu;
    ctx->saved_data["tokens"] = tokens;
    ctx->saved_data["has_weight"] = has_value(weight);
    ctx->saved_data["has_bias"] = has_value(bias);
    ctx->mark_non_differentiable({mean, rstd});
    return {y, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = find_op<NormBackward>("patchgemm::instance_norm_act_backward");
    const variable_list saved = ctx->get_saved_variables();
    const bool has_weight = ctx->saved_data["has_weight"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const OptionalTensor weight = has_weight ? OptionalTensor(saved[1]) : std::nullopt;
    const OptionalTensor bias = has_bias ? OptionalTensor(saved[2]) : std::nullopt;
    // Edges: x, then weight and bias where given.
    const size_t weight_edge = 1, bias_edge = has_weight ? 2 : 1;
    if (at::GradMode::is_enabled()) {  // (its statistics recomputed too, unlike the saved ones)
      std::vector<std::pair<size_t, at::Tensor>> wanted;  // (output slot, input)
      if (ctx->needs_input_grad(0)) wanted.emplace_back(0, saved[0]);
      if (has_weight && ctx->needs_input_grad(weight_edge)) wanted.emplace_back(1, saved[1]);
      if (has_bias && ctx->needs_input_grad(bias_edge)) wanted.emplace_back(2, saved[2]);
      variable_list inputs, out(6);
      for (const auto& w : wanted) inputs.push_back(w.second);
      if (inputs.empty()) return out;
      const bool tokens = ctx->saved_data["tokens"].toBool();
      const at::Tensor y = std::get<0>(instance_norm_act_aten(
          saved[0], saved[1], saved[2], ctx->saved_data["eps"].toDouble(), ctx->saved_data["gelu"].toBool(),
          norm_shape("instance_norm_act", saved[0], tokens)));
      const variable_list g = grad_of_recomputation(y, inputs, grads[0]);
      for (size_t i = 0; i < wanted.size(); ++i) out[wanted[i].first] = g[i];
      return out;
    }
    auto [grad_x, grad_w, grad_b] = op.call(grads[0], saved[0], weight, bias, saved[3], saved[4],
                                            ctx->saved_data["gelu"].toBool(),
                                            ctx->saved_data["tokens"].toBool());
    return {ctx->needs_input_grad(0) ? grad_x : at::Tensor(),
            has_weight && ctx->needs_input_grad(weight_edge) ? grad_w : at::Tensor(),
            has_bias && ctx->needs_input_grad(bias_edge) ? grad_b : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

NormResult instance_norm_act_autograd(const at::Tensor& x, const OptionalTensor& weight,
                                      const OptionalTensor& bias, double eps, bool gelu,
                                      bool tokens) {
  if (!needs_autograd(x, weight, bias)) return instance_norm_act_below_autograd(x, weight, bias, eps, gelu, tokens);
  const variable_list out = InstanceNormAct::apply(x, weight, bias, eps, gelu, tokens);
  return {out[0], out[1], out[2]};
}

}  // namespace

TORCH_LIBRARY_IMPL(patchgemm, Autograd, m) {
  m.impl("instance_norm_act", &instance_norm_act_autograd);
  m.impl("swiglu", &swiglu_autograd);
  m.impl("patch_matrix", &patch_matrix_autograd);
  m.impl("patch_matrix_backward", &patch_matrix_backward_autograd);
  m.impl("grouped_linear", &grouped_linear_autograd);
  m.impl("ragged_grouped_linear", &ragged_grouped_linear_autograd);
  m.impl("grouped_pointwise_conv", &grouped_pointwise_conv_autograd);
  m.impl("patch_embed", &patch_embed_autograd);
  m.impl("patch_unembed", &patch_unembed_autograd);
}

}  // namespace patchgemm
