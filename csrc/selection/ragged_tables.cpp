// Ragged grouped linear's tables (forward, grad_input, grad_weight). In order:
//   aten_grouped_mm  PyTorch's torch._grouped_mm (CUTLASS on sm_90+): reads the offsets on the GPU,
//                    so a CUDA tensor of group sizes costs no host sync;
//   cublas_grouped   one cuBLAS grouped GEMM (cublasGemmGroupedBatchedEx) over the non-empty groups;
//   ragged_mma       our kernels (kernels/gemm/ragged_gemm.h): each block finds its group from the
//   ragged_tiles     offsets on the GPU, so they run with no host sync (CUDA graphs): 16-bit on
//                    tensor cores (sm_80+), and a portable one for any dtype;
//   loop             one GEMM per group through the planner (any device).
// cublas_grouped and loop need the sizes on the host: a sync where they live on the GPU, so they
// decline there while a sync is forbidden (capture, or sync debug mode "error").
#include <ATen/ATen.h>


#ifdef PATCHGEMM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include "kernels/gemm/gemm.h"
#include "kernels/gemm/ragged_gemm.h"
#include "selection/ragged_tables.h"
#include "selection/registry.h"

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;

std::string signature(const RaggedProblem& p) {
  selection::Text out;
  out << "(" << describe("a", p.a) << ", " << describe("b", p.b) << (p.bias ? ", bias" : "") << ", "
      << p.groups << " groups, offsets on " << p.offsets.device() << ")";
  return out.str();
}

// a [N, K] @ b [G, K, Nc] split by rows, or a [M, N] @ b [N, Nc] split along the reduction.
selection::ProblemFeatures features(const RaggedProblem& p) {
  return selection::features_on(p.a, {{"groups", double(p.groups)}, {"a_rows", double(p.a.size(0))},
                                      {"a_cols", double(p.a.size(1))}, {"n", double(p.b.size(-1))},
                                      {"ragged_k", p.ragged_k ? 1.0 : 0.0}, {"bias", p.bias ? 1.0 : 0.0},
                                      {"offsets_on_host", p.offsets.is_cpu() ? 1.0 : 0.0}});
}

// The rows each group spans in the ragged dim, read on the host.
std::vector<int64_t> host_offsets(const RaggedProblem& p) {
  return ragged_bounds(p.op, p.offsets, p.ragged_k ? p.a.size(1) : p.a.size(0));
}

// bias [G, Nc] repeated over each group's rows: [N, Nc].
at::Tensor bias_rows(const RaggedProblem& p) {
  return p.bias->repeat_interleave(ragged_sizes(p.offsets, p.a.device()), 0, p.a.size(0));
}

// The [N, Nc] output of a rows problem, or [G, M, Nc] of a ragged-k one.
at::Tensor empty_output(const RaggedProblem& p) {
  return p.ragged_k ? at::empty({p.groups, p.a.size(0), p.b.size(1)}, p.a.options())
                    : at::empty({p.a.size(0), p.b.size(2)}, p.a.options());
}

// Group g's GEMM as run_gemm's [1, ...] operands.
struct GroupGemm {
  at::Tensor a, b, c;
  std::optional<at::Tensor> bias;
};

GroupGemm group_gemm(const RaggedProblem& p, const at::Tensor& out, int64_t g, int64_t start, int64_t end) {
  if (p.ragged_k) {
    return {p.a.slice(1, start, end).unsqueeze(0), p.b.slice(0, start, end).unsqueeze(0), out[g].unsqueeze(0),
            std::nullopt};
  }
  std::optional<at::Tensor> bias;
  if (p.bias) bias = (*p.bias)[g].unsqueeze(0);
  return {p.a.slice(0, start, end).unsqueeze(0), p.b[g].unsqueeze(0), out.slice(0, start, end).unsqueeze(0), bias};
}

constexpr GemmConvention kLinear = GemmConvention::kMatmul;  // nn.Linear's numerics

WhyNot host_sizes_allowed(const RaggedProblem& p) { return ragged_host_sizes_allowed(p.offsets); }
WhyNot offsets_reach_device(const RaggedProblem& p) { return ragged_offsets_reach_device(p.offsets, p.a); }

// The offsets on a's device: CPU offsets go through pinned memory, so the copy does not wait for the GPU.
at::Tensor offsets_on_device(const RaggedProblem& p, at::ScalarType dtype) {
  at::Tensor offsets = p.offsets.to(dtype);
  if (offsets.is_cpu() && !p.a.is_cpu()) offsets = offsets.pin_memory().to(p.a.device(), /*non_blocking=*/true);
  return offsets.contiguous();
}

// Each operand row- or column-major with its outer stride a multiple of 16 bytes (so every group's
// first element is aligned too), as _grouped_mm requires.
WhyNot grouped_mm_layout(const char* name, const at::Tensor& t) {
  const int64_t inner = t.dim() - 1, elem = t.element_size();
  const bool row_major = t.stride(inner) == 1, col_major = t.stride(inner - 1) == 1;
  if (!row_major && !col_major) return std::string(name) + " is neither row- nor column-major";
  if (t.stride(row_major ? inner - 1 : inner) * elem % 16)
    return std::string(name) + "'s rows are not a multiple of 16 bytes";
  if (reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16) return std::string(name) + " is not 16-byte aligned";
  return "";
}

WhyNot grouped_mm_supports(const RaggedProblem& p) {
  const at::ScalarType dt = p.a.scalar_type();
  if (p.a.is_cuda()) {
#ifdef PATCHGEMM_WITH_CUDA
    if (dt != at::kBFloat16) return "torch._grouped_mm runs bfloat16 only on CUDA";
    if (at::cuda::getDeviceProperties(p.a.get_device())->major < 9) return "torch._grouped_mm needs sm_90 or newer";
#endif
  } else if (!p.a.is_cpu()) {
    return "a is on " + p.a.device().str();
  } else if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) {
    return "torch._grouped_mm takes float32, float16 or bfloat16";
  }
  if (WhyNot why = offsets_reach_device(p); !why.empty()) return why;
  WhyNot why = grouped_mm_layout("a", p.a);
  if (why.empty()) why = grouped_mm_layout("b", p.b);
  const int64_t cols = p.ragged_k ? p.b.size(1) : p.b.size(2);
  if (why.empty() && cols * p.a.element_size() % 16) why = "the output's rows are not a multiple of 16 bytes";
  return why;
}

#ifdef PATCHGEMM_WITH_CUDA
// A candidate of ours that reads the offsets on the GPU (kernels/gemm/ragged_gemm.h).
Candidate<RaggedProblem, at::Tensor> device_kernel(
    std::string name, std::string arch, std::string doc,
    std::string (*declines)(const at::Tensor&, const at::Tensor&, bool, int64_t),
    void (*into)(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, bool,
                 const at::Tensor&)) {
  return {std::move(name), std::move(arch), std::move(doc),
          [declines](const RaggedProblem& p) -> WhyNot {
            if (!p.a.is_cuda()) return "a is not on a GPU";
            if (WhyNot why = offsets_reach_device(p); !why.empty()) return why;
            return declines(p.a, p.b, p.ragged_k, p.groups);
          },
          // They take longer than cuBLAS (tensor-core GEMMs without its pipelining), so they run
          // where a sync is forbidden and the faster candidates decline.
          [](const RaggedProblem& p) { return ragged_only_where_sync_forbidden(p.offsets); },
          [into](const RaggedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
            at::Tensor out = empty_output(p);
            into(p.a, p.b, p.bias, offsets_on_device(p, p.offsets.scalar_type()), p.ragged_k, out);
            return out;
          }};
}
#endif

std::vector<Candidate<RaggedProblem, at::Tensor>> candidates() {
  return {
      {"aten_grouped_mm", "cpu cuda sm_90",
       "torch._grouped_mm: bfloat16 on CUDA (float32 / float16 too on the CPU), rows "
       "of 16 bytes; offsets read on the device (no host sync)",
       grouped_mm_supports, nullptr,
       [](const RaggedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
         at::Tensor out = at::_grouped_mm(p.a, p.b, offsets_on_device(p, at::kInt));
         if (p.bias) out.add_(bias_rows(p));
         return out;
       }},
#ifdef PATCHGEMM_WITH_CUDA
// (hipBLAS's grouped GEMM has another signature: not wired up on ROCm.)
#ifndef USE_ROCM
      {"cublas_grouped", "cuda",
       "one cuBLAS grouped GEMM (cublasGemmGroupedBatchedEx, cuBLAS 12.5+) over the non-empty "
       "groups; float32, float16, bfloat16; sizes read on the host",
       [](const RaggedProblem& p) -> WhyNot {
         if (!p.a.is_cuda()) return "a is not on a CUDA device";
         if (!cuda::has_grouped_gemm()) return "this build's BLAS has no grouped GEMM (cuBLAS 12.5+)";
         const at::ScalarType dt = p.a.scalar_type();
         if (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16) return "float64";
         // Its array of operand pointers is copied from pinned host memory, which the allocator
         // reuses once the copy is done: a graph replaying the copy would read whatever is there.
         if (selection::detail::capturing_graph(p.a.device()))
           return "its pointer array cannot be captured in a CUDA graph";
         return host_sizes_allowed(p);
       },
       nullptr,
       [](const RaggedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
         const std::vector<int64_t> bounds = host_offsets(p);
         at::Tensor out = empty_output(p);
         const SplitKGuard guard = cuda::split_k_guard(p.a);
         std::vector<cuda::GroupedBlasCall> calls;
         std::vector<int64_t> empty_groups;
         for (int64_t g = 0; g < p.groups; ++g) {
           if (bounds[g + 1] == bounds[g]) {
             empty_groups.push_back(g);
             continue;
           }
           const GroupGemm gg = group_gemm(p, out, g, bounds[g], bounds[g + 1]);
           const GemmProblem problem{1, matrix_view(gg.a), matrix_view(gg.b), matrix_view(gg.c)};
           if (!check_blas_layout(problem).ok()) {
             why = "an operand's strides have no BLAS layout";
             return std::nullopt;
           }
           const BlasPlan plan = plan_blas_calls(problem, blas_int_limit(), guard);
           if (!plan.error.empty() || plan.calls.size() != 1) {
             why = "group " + std::to_string(g) +
                   " needs more than one BLAS call (a long ragged K, or sizes past 32 bits)";
             return std::nullopt;
           }
           calls.push_back({plan.calls[0], gg.a.const_data_ptr(), gg.b.const_data_ptr(), gg.c.data_ptr()});
         }
         if (p.ragged_k) {
           for (int64_t g : empty_groups) out[g].zero_();
         } else if (p.bias) {  // the bias rows first, then every GEMM adds onto them
           out.copy_(bias_rows(p));
           for (auto& call : calls) call.call.accumulate = true;
         }
         cuda::run_grouped_blas_calls(calls, p.a.scalar_type(), p.a.device(), gemm_math(kLinear, p.a.scalar_type()));
         return out;
       }},
#endif  // USE_ROCM
#ifdef PATCHGEMM_PTX_KERNELS
      device_kernel("ragged_mma", "cuda sm_80",
                    "our kernel on tensor cores: a block per 128 x 128 tile of a group, found from the offsets on "
                    "the GPU (no host sync: CUDA graphs capture it); float16 / bfloat16, fp32 sums",
                    cuda::ragged_gemm_mma_declines, cuda::ragged_gemm_mma_into),
#endif
      device_kernel("ragged_tiles", "cuda rocm",
                    "our portable kernel: a block per 64 x 64 tile of a group, found from the offsets on the GPU "
                    "(no host sync: CUDA graphs capture it); any float dtype, fp32 products and sums (fp64 for "
                    "float64)",
                    cuda::ragged_gemm_declines, cuda::ragged_gemm_into),
#endif
      {"loop", "cpu cuda rocm", "any problem: one GEMM per group through the planner; sizes read on the host",
       host_sizes_allowed, nullptr,
       [](const RaggedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
         const std::vector<int64_t> bounds = host_offsets(p);
         at::Tensor out = empty_output(p);
         for (int64_t g = 0; g < p.groups; ++g) {
           const GroupGemm gg = group_gemm(p, out, g, bounds[g], bounds[g + 1]);
           run_gemm(gg.a, gg.b, gg.c, gg.bias, false, kLinear);
         }
         return out;
       }},
  };
}

const Table<RaggedProblem, at::Tensor> kForward("ragged_grouped_linear", candidates(), signature, features);
const Table<RaggedProblem, at::Tensor> kGradInput("ragged_grouped_linear_grad_input", candidates(), signature,
                                                  features);
const Table<RaggedProblem, at::Tensor> kGradWeight("ragged_grouped_linear_grad_weight", candidates(), signature,
                                                   features);

}  // namespace

at::Tensor select_ragged_gemm(const RaggedProblem& p) {
  const std::string op = p.op;
  if (op == "ragged_grouped_linear") return kForward.run(p);
  if (op == "ragged_grouped_linear_grad_input") return kGradInput.run(p);
  TORCH_INTERNAL_ASSERT(op == "ragged_grouped_linear_grad_weight", "no ragged table for ", op);
  return kGradWeight.run(p);
}

std::string ragged_host_sizes_allowed(const at::Tensor& offsets) {
  if (offsets.is_cpu() || !selection::detail::host_sync_forbidden(offsets.device())) return "";
  return "it reads the group sizes (on " + offsets.device().str() +
         ") on the host, a sync, which CUDA-graph capture or sync debug mode \"error\" forbids";
}

std::string ragged_offsets_reach_device(const at::Tensor& offsets, const at::Tensor& a) {
  if (offsets.is_cpu() && selection::detail::capturing_graph(a.device()))
    return "the sizes are on the host: their copy to the GPU cannot be captured in a CUDA graph";
  return "";
}

std::string ragged_only_where_sync_forbidden(const at::Tensor& offsets) {
  if (!offsets.is_cpu() && selection::detail::host_sync_forbidden(offsets.device())) return "";
  return "slower than the candidates that read the sizes on the host: taken where a sync is forbidden";
}

std::vector<int64_t> ragged_bounds(const char* op, const at::Tensor& offsets, int64_t rows) {
  // A copy to the host waits for the GPU: not allowed while a CUDA graph is captured (and a graph
  // could not replay another step's sizes anyway).
  TORCH_CHECK(offsets.is_cpu() || !selection::detail::capturing_graph(offsets.device()), op,
              ": this path reads the group sizes on the host, and they are on ", offsets.device(),
              " while a CUDA graph is being captured. Pass them on the CPU (the graph then keeps those sizes), or "
              "let a candidate that reads them on the GPU run (patchgemm.explain lists them)");
  const at::Tensor ends = offsets.to(at::kCPU, at::kLong).contiguous();
  const int64_t* e = ends.const_data_ptr<int64_t>();
  std::vector<int64_t> bounds{0};
  for (int64_t g = 0; g < ends.numel(); ++g) {
    TORCH_CHECK(e[g] >= bounds.back(), op, ": group sizes must be >= 0 (offsets non-decreasing), got offsets[", g,
                "] = ", e[g], " after ", bounds.back());
    bounds.push_back(e[g]);
  }
  TORCH_CHECK(bounds.back() == rows, op, ": the group sizes add up to ", bounds.back(), " but x has ", rows, " rows");
  return bounds;
}

at::Tensor ragged_sizes(const at::Tensor& offsets, at::Device device) {
  at::Tensor ends = offsets.to(at::kLong);
  // A copy to the GPU from pageable host memory waits for the GPU; from pinned memory it does not.
  if (ends.is_cpu() && !device.is_cpu()) ends = ends.pin_memory();
  ends = ends.to(device, at::kLong, /*non_blocking=*/true);
  return at::diff(ends, 1, 0, at::zeros({1}, ends.options()));
}

}  // namespace patchgemm
