// The patch ops' implementation tables, in the order the default choice tries them: a fused kernel
// where it applies and its rule expects it to win, else gather / scatter + one cuBLAS GEMM, else
// PyTorch's own convolution. The rules come from same-run measurements (bench/RESULTS.md); where a
// kernel's rule needs its own tiling, its entry point applies it (the `ruled` argument).
#include <ATen/ATen.h>


#include "kernels/gemm/gemm.h"
#include "kernels/patch/patch_gemm.h"
#include "kernels/patch/patchify.h"
#include "selection/patch_tables.h"
#include "selection/registry.h"

#ifdef PATCHGEMM_PTX_KERNELS
#include <ATen/cuda/CUDAContext.h>
#endif

namespace patchgemm {
namespace {

using selection::Candidate;
using selection::describe;
using selection::Table;
using selection::WhyNot;
using selection::ProblemFeatures;
using selection::features_on;

// Where the fused kernels and ATen's path need the default row-major token order.
WhyNot row_major_tokens(const PatchGeometry& g) {
  return g.levels.size() == 1 ? WhyNot() : "row-major token order only (levels given)";
}

std::vector<int64_t> kernel_of(const PatchGeometry& g, int64_t rank) {
  return std::vector<int64_t>(g.kernel.end() - rank, g.kernel.end());
}

std::vector<int64_t> grid_of(const PatchGeometry& g, int64_t rank) {
  return std::vector<int64_t>(g.grid.end() - rank, g.grid.end());
}

// at::convolution's arguments for kernel == stride.
at::Tensor aten_conv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     const std::vector<int64_t>& kernel, bool transposed) {
  const std::vector<int64_t> zeros(kernel.size(), 0), ones(kernel.size(), 1);
  return at::convolution(x, weight, bias, kernel, zeros, ones, transposed, zeros, 1);
}

#ifdef PATCHGEMM_PTX_KERNELS
// What the fused kernels need of every problem: CUDA tensors, and channels-first patches, which a
// channels-last volume v5 also is where its pixels lie without gaps (problems/patch_geometry.h: channels_first_view).
WhyNot fused_kernels_apply(const at::Tensor& t, const PatchGeometry& g, const at::Tensor& v5) {
  if (!t.is_cuda()) return "CUDA tensors only";
  return has_channels_first_view(v5, g) ? WhyNot() : "channels-last x with gaps between pixels (W stride != C)";
}

int64_t sm_count(const at::Tensor& on) { return at::cuda::getDeviceProperties(on.get_device())->multiProcessorCount; }

// The mma.sync implicit GEMMs run at well under half of cuBLAS's GEMM rate, so the gather they save
// (4 bytes per patch element) pays only for thin GEMMs, at most 256 wide, with a 128-token tile per
// SM to fill the GPU.
WhyNot implicit_mma_pays(int64_t width, int64_t rows, const at::Tensor& on) {
  if (width > 256) return "rule: GEMMs wider than 256 run faster on cuBLAS after the gather";
  if (rows < 128 * sm_count(on)) return "rule: fewer than 128 tokens per SM";
  return {};
}

// The fused GEMMs do not split K: an output of 128 x 128 tiles for under half the SMs, over a long
// K, leaves most SMs idle, where cuBLAS splits K (ViT-B/16 at batch 1 to 4: 12 to 42 tiles, K = 768).
// Thin outputs (width <= 128) are memory-bound, and the gather that cuBLAS needs costs more, down to a
// quarter of the SMs: below that a few CTAs stream all of x alone (up to 50x slower than the gather +
// cuBLAS, e.g. 64 tokens x 64 wide over K = 65536; bench/results/tune-h100.json.gz).
WhyNot fills_the_gpu(int64_t rows, int64_t width, int64_t K, const at::Tensor& on) {
  const int64_t tiles = output_tiles(rows, width);
  if (K >= 512 && (4 * tiles < sm_count(on) || (width > 128 && 2 * tiles < sm_count(on)))) {
    return "rule: a few output tiles over a long K run faster split by cuBLAS";
  }
  return {};
}

// The tiny kernels are built for thin GEMMs that only move data (writing y dominates): a block per
// 128-token tile runs all of E x K for its tokens. From 8192 multiply-adds per token (patch
// elements x width; e.g. Moirai's k = 64 into E = 384) the work is a real GEMM: in fp32 (FMA
// units) cuBLAS's GEMM after the gather runs it faster, and in 16 bits so do the tensor-core
// paths where the token tiles leave a quarter of the SMs idle, splitting E as well. Where this rule
// passes tiny over in the tuning records (bench/results/tune-*.json.gz), the rules' next choice
// takes 0.47x (fp32), 0.62x (16-bit embeddings) and 0.80x (transposes) of tiny's time, geometric
// means; with more tiles tiny keeps up or wins (Chronos's 32768 tokens of k = 16 into E = 512).
constexpr int64_t kTinyMacsPerToken = 8192;

WhyNot tiny_pays(const at::Tensor& x, const PatchGeometry& g, int64_t width) {
  if (g.patch_size() * width < kTinyMacsPerToken) return {};
  if (x.scalar_type() == at::kFloat) {
    return "rule: fp32 at 8192 or more multiply-adds per token (patch x width) runs faster as gather + GEMM";
  }
  if (4 * output_tiles(g.batch * g.tokens(), 1) < 3 * sm_count(x)) {
    return "rule: 8192 or more multiply-adds per token (patch x width) over 128-token tiles for under 3/4 of the "
           "SMs run faster on a tensor-core GEMM";
  }
  return {};
}

// The forward's wgmma kernels beat gather + cuBLAS over the sizes measured (E 64 to 2048), but for
// 4-byte runs copied one token at a time into GEMMs wider than 128 (ViT-L/14's kw = 14; thinner
// ones are memory-bound, and the gather's extra pass costs more), and for large wide GEMMs, where
// cuBLAS's higher throughput outweighs the gather (E >= 1024 over many tokens); the row-TMA kernel
// keeps up with cuBLAS there. (bench/heldout.py --candidates measures them all.)
WhyNot implicit_wgmma_embed_pays(cuda::Implicit kernel, const EmbedProblem& p) {
  const auto& [x5, g] = p.fused();
  const int64_t kw = g.kernel[2], embed = p.weight.size(0), rows = g.batch * g.tokens();
  WhyNot why = fills_the_gpu(rows, embed, g.patch_size(), p.x);
  if (!why.empty()) return why;
  if (kernel == cuda::Implicit::kSm90 && embed >= 1024 && rows >= 128 * sm_count(p.x)) {
    return "rule: large GEMMs of E >= 1024 run faster on cuBLAS after the gather";
  }
  const bool pair_major = kw == 2 && g.grid[2] % 4 == 0 && runs_aligned(x5, 8);
  if (widest_run(x5, kw) >= 4 || pair_major || embed <= 128) return {};
  return "rule: 4-byte runs one token at a time (odd kw / 2) into E > 128 run faster as gather + cuBLAS";
}

// The narrow kernel's threads each read one element of x per channel row; it wins where each
// thread sums at least 8 channels (C >= 8 lanes: x's rows long enough to fill a block with few
// lanes, or many channels) and the patch is more than one element (a 1 x 1 embedding is one GEMM
// over x as it lies, which cuBLAS and cuDNN run near the memory floor). Fitted on the forced
// forward times of 110 random E <= 8 embeddings against every other candidate (H200).
WhyNot narrow_pays(const EmbedProblem& p) {
  const PatchGeometry& g = p.g;
  if (g.patch_size() == g.channels) return "rule: 1 x 1 embeddings run faster as one GEMM over x";
  if (g.kernel[2] > cuda::kNarrowThreads) return {};  // the kernel declines it with its reason
  const int64_t lanes = cuda::narrow_lanes(g);
  if (g.channels < 8 * lanes) {
    return "rule: under 8 channels per thread (C < 8 x " + std::to_string(lanes) +
           " lanes: short patch rows) run faster on the GEMM paths";
  }
  return {};
}
#endif

// ---- patch_embed ---------------------------------------------------------------------------------

// Multiply-adds of a patch op's GEMM: small ones are launch-bound, where the fewest launches win.
constexpr double kSmallEmbedMacs = double(1 << 24);  // 16-bit embeddings writing tokens
constexpr double kTinyWeightGradMacs = double(1 << 21);  // channels-first weight gradients
// Small patch matrices: the gather (and any weight padding) costs fixed launches, where ATen's one
// permute copy, or an implicit kernel that reads x itself, has none (fitted on
// bench/results/tune-*.json, whatever the GEMM's size).
constexpr double kSmallEmbedPatchBytes = 2e6;  // 16-bit embeddings writing tokens: ATen's copy + linear
constexpr double kSmallWeightGradPatchBytes = 8e6;  // tokens weight gradients: the wgmma implicit kernel

double patch_matrix_elements(const PatchGeometry& g) {
  return double(g.batch) * double(g.tokens()) * double(g.patch_size());
}

double gemm_macs(const PatchGeometry& g, int64_t width) { return patch_matrix_elements(g) * double(width); }

double patch_matrix_bytes(const PatchGeometry& g, const at::Tensor& x) {
  return patch_matrix_elements(g) * double(x.element_size());
}

// A 1 x 1 embedding of channels-first x is one GEMM over x as it lies: the gather only transposes
// x, where cuDNN's convolution reads x in place. On an H200 cuDNN ran it faster than gather + GEMM
// and the tiny kernel wherever it is narrow against its channels (E <= 8, or 4 E <= C: 1.2-6x,
// tokens or channels-first out); wider, cuDNN's 1 x 1 kernels fall behind the GEMM (E = 768 from
// C = 64: 2.8x slower).
WhyNot one_by_one_runs_on_cudnn(const EmbedProblem& p) {
  const int64_t embed = p.weight.size(0), channels = p.g.channels;
  if (!p.x.is_cuda() || p.g.channels_last || p.g.patch_size() != channels || channels == 0) return {};
  if (embed > 8 && 4 * embed > channels) return {};
  return "rule: a 1 x 1 embedding into E <= max(8, C / 4) has nothing to gather: cuDNN's convolution reads x "
         "in place";
}

// A 16-bit embedding writing tokens that ATen's permute copy + linear runs at least as fast as the
// gather + GEMM: a small GEMM or a small patch matrix.
bool small_tokens_embed(const EmbedProblem& p) {
  return gemm_macs(p.g, p.weight.size(0)) < kSmallEmbedMacs || patch_matrix_bytes(p.g, p.x) < kSmallEmbedPatchBytes;
}

// Why at::linear may not run this embedding (it may round 16-bit partial sums where the conv would
// not), or empty.
WhyNot aten_linear_sums_unlike_a_conv(const EmbedProblem& p) {
  return aten_matmul_sums_unlike_a_conv(p.x, p.g.batch * p.g.tokens(), p.weight.size(0), p.g.patch_size());
}

// Channels-last x on CUDA: cuDNN's channels-last kernels read x as it lies and write the channels-last
// output. They beat the channels-last gather + GEMM only for short kernels over many channels and
// tokens (ConvNeXt's k = 2 downsampling, 2-D and 3-D, forward and backward); with longer kernels or
// few channels they run up to 90x slower (bench/results/tune-*.json). Not on the CPU: torch 2.11's
// oneDNN bf16 convolution returns wrong values for channels-last x [3, 24, 28, 176] with
// k = (14, 16) (tests/test_fuzz.py).
WhyNot cudnn_wins_channels_last(const at::Tensor& x, const PatchGeometry& g) {
  if (!x.is_cuda() || !g.channels_last || g.levels.size() != 1) return {};
  const int64_t window = g.kernel[0] * g.kernel[1] * g.kernel[2];
  if (window <= 16 && g.channels >= 64 && g.batch * g.tokens() >= 1024) {
    return "rule: channels-last x with a window of at most 16 over >= 64 channels and >= 1024 tokens runs "
           "faster on cuDNN's channels-last convolution";
  }
  return {};
}

// fp32 on the CPU: ATen's convolution (oneDNN's direct kernels) reads x as it lies, where the gather
// writes the patch matrix and a BLAS GEMM reads it again. Swept on a 2-core AVX-512 VM (64 random
// problems), the convolution ran the forward 1.5x faster (geomean; in 30 of 37) and the weight
// gradient 1.07x faster where this rule passes the gather over: channels-first outputs of 256 rows or
// more, and tokens outputs of patches of 128 values or more. The gather + GEMM keeps few rows and
// short patches written as tokens (it ran those 1.25x faster). Not in 16 bits: ATen's CPU
// convolution is never offered there (wrong values, aten_conv's condition).
WhyNot onednn_conv_wins_fp32(const at::Tensor& x, const PatchGeometry& g, bool tokens) {
  if (!x.is_cpu() || x.scalar_type() != at::kFloat || g.channels == 0 || !row_major_tokens(g).empty()) return {};
  if (g.batch * g.tokens() < 256 || (tokens && g.patch_size() < 128)) return {};
  return "rule: fp32 on the CPU with 256 rows or more (tokens: patches of 128 values or more) runs faster on "
         "ATen's convolution";
}

// patch_embed's and patch_unembed's problems in the log and explain().
template <typename Problem>
std::string patch_signature(const Problem& p) {
  selection::Text out;
  out << "(" << describe("x", p.x) << ", weight " << p.weight.sizes() << (p.bias ? ", bias" : "")
      << (p.tokens ? ", tokens" : ", channels-first") << (p.g.levels.size() > 1 ? ", levels" : "") << ")";
  return out.str();
}

// What the patch ops' records and the learned model know of a problem: the GEMM's sizes, the patch
// and grid shape, layouts. `width`: E (embed, weight gradient) or C_out (unembed).
ProblemFeatures patch_features(const at::Tensor& x, const PatchGeometry& g, int64_t width, bool tokens,
                               std::vector<std::pair<std::string, double>> more) {
  std::vector<std::pair<std::string, double>> v{
      {"batch", double(g.batch)}, {"channels", double(g.channels)}, {"tokens", double(g.tokens())},
      {"patch", double(g.patch_size())}, {"width", double(width)}, {"rows", double(g.batch * g.tokens())},
      {"kd", double(g.kernel[0])}, {"kh", double(g.kernel[1])}, {"kw", double(g.kernel[2])},
      {"gh", double(g.grid[1])}, {"gw", double(g.grid[2])}, {"tokens_layout", tokens ? 1.0 : 0.0},
      {"channels_last", g.channels_last ? 1.0 : 0.0}, {"levels", double(g.levels.size())}};
  v.insert(v.end(), more.begin(), more.end());
  return features_on(x, std::move(v));
}

#ifdef PATCHGEMM_PTX_KERNELS
WhyNot not_a_view(const at::Tensor& x5, const PatchGeometry& g) {
  return patch_matrix_as_view(x5, g) ? "rule: the patch matrix is a view of x (one patch per sample)" : WhyNot();
}

Candidate<EmbedProblem, at::Tensor> implicit_embed(const char* name, cuda::Implicit kernel, const char* backends,
                                                  const char* conditions) {
  return {name, backends, conditions,
          [kernel](const EmbedProblem& p) -> WhyNot {  // (the output's layout here: before y is allocated)
            const WhyNot why = fused_kernels_apply(p.x, p.g, p.x5);
            if (!why.empty()) return why;
            if (kernel == cuda::Implicit::kRowsSm90 && !p.tokens_out) return "tokens output only";
            if (kernel == cuda::Implicit::kPairsSm90 && p.tokens_out) return "channels-first output only";
            if (kernel == cuda::Implicit::kPairsSm90 && p.g.kernel[2] != 2) return "kw = 2 only";
            return {};
          },
          [kernel](const EmbedProblem& p) {
            WhyNot why = not_a_view(p.x5, p.g);
            if (why.empty() && p.weight.size(0) >= 1024 && !cudnn_wins_channels_last(p.x, p.g).empty()) {
              why = "rule: channels-last x with short windows into E >= 1024 runs faster on cuDNN";
            }
            if (!why.empty()) return why;
            if (kernel != cuda::Implicit::kMma) return implicit_wgmma_embed_pays(kernel, p);
            const int64_t rows = p.g.batch * p.g.tokens();
            why = fills_the_gpu(rows, p.weight.size(0), p.g.patch_size(), p.x);
            return !why.empty() ? why : implicit_mma_pays(p.weight.size(0), rows, p.x);
          },
          [kernel](const EmbedProblem& p, bool ruled, WhyNot& why) -> std::optional<at::Tensor> {
            const int64_t embed = p.weight.size(0), N = p.g.tokens();
            const auto& [x5, g] = p.fused();
            // (Asked first: y and W's rows cost allocations, and for channels-last x a copy.)
            if (!cuda::implicit_embed_fits(kernel, x5, g, embed, ruled, why)) return std::nullopt;
            const at::Tensor y = p.tokens_out ? at::empty({p.g.batch, N, embed}, p.x.options())
                                              : at::empty({p.g.batch, embed, N}, p.x.options());
            if (!cuda::implicit_embed(kernel, x5, p.w2(), p.bias, g, y, p.tokens_out, ruled, why)) return std::nullopt;
            return p.tokens_out ? embed_output(p, y) : y.view(p.out_shape);
          }};
}
#endif

// Each run starts without the patch matrix an earlier run on the problem left (the heuristic's, a
// timed candidate's): the autograd layer keeps the chosen candidate's matrix, or none.
std::vector<Candidate<EmbedProblem, at::Tensor>> each_run_alone(std::vector<Candidate<EmbedProblem, at::Tensor>> cs) {
  for (auto& c : cs) {
    c.run = [run = std::move(c.run)](const EmbedProblem& p, bool ruled, WhyNot& why) {
      p.forget_patch_matrix();
      return run(p, ruled, why);
    };
  }
  return cs;
}

const Table<EmbedProblem, at::Tensor> kEmbedTable(
    "patch_embed",
    each_run_alone({
        {"view_gemm", "cpu cuda rocm", "one patch covers each sample and x's strides make it the patch matrix",
         [](const EmbedProblem& p) {
           return patch_matrix_as_view(p.x5, p.g) ? WhyNot() : "x is not its own patch matrix (one patch per sample)";
         },
         nullptr,
         [](const EmbedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> { return embed_by_gemm(p); },
         /*reuses=*/false, /*leaves_reusable=*/true},
#ifdef PATCHGEMM_PTX_KERNELS
        {"narrow", "cuda", "1 to 8 embeddings, row-major tokens, x's rows contiguous; 16-bit and fp32",
         [](const EmbedProblem& p) -> WhyNot {
           if (!p.x.is_cuda()) return "CUDA tensors only";
           if (p.weight.size(0) > cuda::kNarrowEmbeds) return "1 to 8 embeddings only";
           if (p.g.levels.size() != 1) return "row-major token order only (levels given)";
           return p.x5.size(4) > 1 && p.x5.stride(4) != 1 ? "x's rows must be contiguous (W stride 1)" : WhyNot();
         },
         narrow_pays,
         [](const EmbedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
           const int64_t E = p.weight.size(0);
           at::Tensor y = p.tokens_out ? at::empty({p.g.batch, p.g.tokens(), E}, p.x.options())
                                       : at::empty(p.out_shape, p.x.options());
           if (!cuda::narrow_embed(p.x5, p.weight, p.bias, p.g, y, p.tokens_out, why)) return std::nullopt;
           return p.tokens_out ? embed_output(p, y) : y;
         }},
        {"tiny", "cuda sm_80+", "channels-first out, patches of at most 64 elements, E % 16 == 0 (fp32: 8), E <= 512, "
                                "N % 8 == 0; 16-bit and fp32",
         [](const EmbedProblem& p) {
           const WhyNot why = fused_kernels_apply(p.x, p.g, p.x5);
           return !why.empty() ? why : p.tokens_out ? "channels-first output only" : WhyNot();
         },
         [](const EmbedProblem& p) {
           const WhyNot why = one_by_one_runs_on_cudnn(p);
           return why.empty() ? tiny_pays(p.x, p.g, p.weight.size(0)) : why;
         },
         [](const EmbedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
           at::Tensor y = at::empty(p.out_shape, p.x.options());
           if (!cuda::tiny_embed(p.x5, p.w2(), p.bias, p.g, y.view({p.g.batch, p.weight.size(0), p.g.tokens()}), why)) {
             return std::nullopt;
           }
           return y;
         }},
        implicit_embed("implicit_rows_sm90", cuda::Implicit::kRowsSm90, "cuda sm_90a",
                       "16-bit, tokens out, x contiguous, kw of 8 to 64, kh a multiple of 64 / kw, K % 64 == 0, "
                       "E % 8 == 0, grid rows filling 3/4 of a 128-token tile"),
        implicit_embed("implicit_pairs_sm90", cuda::Implicit::kPairsSm90, "cuda sm_90a",
                       "16-bit, channels-first out, x contiguous, kw = 2, gw of 8, 16 or 32, kd * kh dividing 32"),
        implicit_embed("implicit_sm90", cuda::Implicit::kSm90, "cuda sm_90a",
                       "16-bit, kw even, x's rows contiguous, K >= 16, E >= 32"),
        implicit_embed("implicit_mma", cuda::Implicit::kMma, "cuda sm_80+",
                       "16-bit, kw even, x's rows contiguous, K >= 16, E >= 32"),
#endif
        {"gather_gemm", "cpu cuda rocm", "any problem: the patch matrix gathered, then one GEMM",
         [](const EmbedProblem&) { return WhyNot(); },
         [](const EmbedProblem& p) -> WhyNot {
           if (p.x.is_cpu()) return onednn_conv_wins_fp32(p.x, p.g, p.tokens);
           if (!p.x.is_cuda()) return {};
           if (p.g.levels.size() != 1) return {};
           WhyNot why = one_by_one_runs_on_cudnn(p);
           if (!why.empty()) return why;
           const bool fp32 = p.x.scalar_type() == at::kFloat;
           // fp32 k = 2 merges into channels-first outputs: memory-bound, where the gather of 4-byte
           // values costs more than cuDNN's implicit TF32 GEMM (e.g. Conv2d(64, 128, k = 2)).
           const bool merge = p.g.kernel[0] <= 2 && p.g.kernel[1] <= 2 && p.g.kernel[2] <= 2;
           if (fp32 && !p.tokens_out && p.g.channels > 0 && merge && p.g.patch_size() <= 256) {
             return "rule: fp32 k = 2 merges of at most 256 values into channels-first outputs run faster on cuDNN";
           }
           why = cudnn_wins_channels_last(p.x, p.g);
           if (!why.empty()) return why;
           // Small 16-bit problems writing tokens: launch-bound, and ATen's permute copy + linear
           // makes fewer launches than the gather with its padding -- where linear may run them.
           if (!fp32 && p.tokens_out && small_tokens_embed(p) && aten_linear_sums_unlike_a_conv(p).empty()) {
             return "rule: 16-bit problems writing tokens of under 2^24 multiply-adds or a patch matrix under 2 MB "
                    "run faster as ATen's copy + linear";
           }
           return {};
         },
         [](const EmbedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> { return embed_by_gemm(p); },
         /*reuses=*/false, /*leaves_reusable=*/true},
        {"aten_linear", "cpu cuda rocm", "tokens-major out, row-major tokens; 16-bit on CUDA: the usual hand rewrite, "
                                         "x's patches copied by ATen (permute + reshape), then linear",
         [](const EmbedProblem& p) -> WhyNot {
           if (!p.tokens_out) return "channels-first output (linear writes tokens)";
           // at::linear follows the matmul flags; a conv replacement follows the conv's.
           if (p.x.is_cuda() && p.x.scalar_type() == at::kFloat)
             return "fp32 on CUDA (linear's TF32 flag is not the conv's)";
           WhyNot why = aten_linear_sums_unlike_a_conv(p);
           return why.empty() ? row_major_tokens(p.g) : why;
         },
         [](const EmbedProblem& p) -> WhyNot {
           WhyNot why = cudnn_wins_channels_last(p.x, p.g);
           if (!why.empty()) return why;
           if (p.x.is_cuda() && small_tokens_embed(p)) return {};
           return "rule: gather_gemm runs larger problems at least as fast";
         },
         [](const EmbedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> { return embed_by_aten_linear(p); },
         /*reuses=*/false, /*leaves_reusable=*/true},
        {"aten_conv", "cpu cuda rocm", "PyTorch's convolution (cuDNN on CUDA); row-major tokens, C > 0",
         [](const EmbedProblem& p) -> WhyNot {
           // cuDNN returns [B, 0, ...] for no input channels instead of the bias.
           if (p.g.channels == 0) return "no input channels";
           // torch's (2.11 to 2.13) 16-bit CPU convolution returns wrong values for some problems
           // (x [2, 4, 976] with k = 16, relative error 1.0; channels-last x [3, 24, 28, 176] with
           // k = (14, 16)): never offered, so neither autotune nor a forced choice can pick it there.
           if (p.x.is_cpu() && p.x.element_size() == 2) return "16-bit on the CPU (torch's convolution is wrong there)";
           return row_major_tokens(p.g);
         },
         nullptr,
         [](const EmbedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> { return embed_by_aten_conv(p); }},
    }),
    // In training the choice is the forward's with its weight gradient: remembered apart.
    [](const EmbedProblem& p) {
      std::string signature = patch_signature(p);
      return p.weight_grad_after ? signature.insert(signature.size() - 1, ", weight gradient follows") : signature;
    },
    [](const EmbedProblem& p) {
      return patch_features(p.x, p.g, p.weight.size(0), p.tokens,
                            {{"bias", p.bias ? 1.0 : 0.0}, {"tokens_out", p.tokens_out ? 1.0 : 0.0},
                             {"weight_grad_follows", p.weight_grad_after ? 1.0 : 0.0}});
    },
    [](const EmbedProblem& p) { return p.weight_grad_after; });

// ---- patch_unembed -------------------------------------------------------------------------------

#ifdef PATCHGEMM_PTX_KERNELS
// The fused unembeddings write y, which they allocate without gaps in the output's memory format:
// they need only CUDA tensors.
WhyNot fused_unembed_applies(const UnembedProblem& p) { return p.x.is_cuda() ? WhyNot() : "CUDA tensors only"; }

// A fused unembedding's run: y in the op's output format, written through its channels-first view,
// from x as tokens [B, N, C_in] (also channels-last x) or channels-first [B, C_in, N].
template <typename Kernel>
std::optional<at::Tensor> fused_unembed(const UnembedProblem& p, Kernel kernel) {
  at::Tensor y = at::empty(p.out_shape, p.x.options().memory_format(p.out_format));
  const auto [y5, g] = fused_view(to_5d(y), p.g);
  const bool tokens = p.fused_reads_tokens();
  if (!kernel(tokens ? p.x_tokens : p.x_fused, tokens, g, y5)) return std::nullopt;
  return y;
}

// The unembedding's implicit kernels need a full 128-column tile of the patch (K); on wgmma they
// win at any C_in measured (192 to 1536), on mma.sync where it pays.
Candidate<UnembedProblem, at::Tensor> implicit_unembed(const char* name, cuda::Implicit kernel, const char* backends,
                                                      const char* conditions) {
  return {name,
          backends,
          conditions,
          fused_unembed_applies,
          [kernel](const UnembedProblem& p) -> WhyNot {
            if (p.g.patch_size() < 128) return "rule: patches under 128 elements leave the tiles idle";
            if (kernel == cuda::Implicit::kMma)
              return implicit_mma_pays(p.weight.size(0), p.g.batch * p.g.tokens(), p.x);
            return {};
          },
          [kernel](const UnembedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
            return fused_unembed(p,
                                 [&](const at::Tensor& x, bool tokens, const PatchGeometry& g, const at::Tensor& y5) {
                                   return cuda::implicit_unembed(kernel, x, tokens, p.w2(), p.bias, g, y5, why);
                                 });
          }};
}
#endif

const Table<UnembedProblem, at::Tensor> kUnembedTable(
    "patch_unembed",
    {
#ifdef PATCHGEMM_PTX_KERNELS
        {"tiny", "cuda sm_80+", "16-bit, kw even, patches of at most 64 elements, C_in <= 512", fused_unembed_applies,
         // Over 256 input channels one block fills an SM, and GEMM -> scatter runs faster, but where
         // its GEMM reads channels-first x poorly (a small grid, unaligned rows).
         [](const UnembedProblem& p) -> WhyNot {
           WhyNot why = tiny_pays(p.x, p.g, p.weight.size(0));
           if (!why.empty() || p.weight.size(0) <= 256 || unembed_gemm_reads_x_poorly(p)) return why;
           return "rule: over 256 input channels GEMM -> scatter runs faster where its GEMM reads x well";
         },
         [](const UnembedProblem& p, bool, WhyNot& why) -> std::optional<at::Tensor> {
           // (Asked first: y and W's rows cost allocations, and for channels-last x a copy.)
           const bool tokens = p.fused_reads_tokens();
           if (!cuda::tiny_unembed_fits(p.x, tokens, p.weight.size(0), p.bias.has_value(), channels_first_geometry(p.g),
                                        why)) {
             return std::nullopt;
           }
           return fused_unembed(p, [&](const at::Tensor& x, bool tokens, const PatchGeometry& g, const at::Tensor& y5) {
             return cuda::tiny_unembed(x, tokens, p.w2(), p.bias, g, y5, why);
           });
         }},
        implicit_unembed("implicit_sm90", cuda::Implicit::kSm90, "cuda sm_90a",
                         "16-bit, kw = 2, 4 or a multiple of 8 (channels-last: kw * C), C_in % 8 == 0 (tokens) or "
                         "N % 64 == 0, K % 8 == 0"),
        implicit_unembed("implicit_mma", cuda::Implicit::kMma, "cuda sm_80+",
                         "16-bit, kw = 2, C_in % 8 == 0 (tokens) or N % 8 == 0, K >= 16"),
#endif
        {"gemm_scatter", "cpu cuda rocm", "any problem: one GEMM, then the patches scattered with the bias",
         [](const UnembedProblem&) { return WhyNot(); },
         [](const UnembedProblem& p) { return cudnn_wins_channels_last(p.x, p.g); },
         [](const UnembedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> { return unembed_by_gemm(p); }},
        {"aten_linear", "cpu cuda rocm",
         "row-major tokens; 16-bit on CUDA: the usual hand rewrite, tokens @ W by ATen's "
         "matmul, then the patches copied out by a permute, then the bias",
         [](const UnembedProblem& p) -> WhyNot {
           // at::matmul follows the matmul flags; a conv replacement follows the conv's.
           if (p.x.is_cuda() && p.x.scalar_type() == at::kFloat)
             return "fp32 on CUDA (matmul's TF32 flag is not the conv's)";
           WhyNot why = aten_matmul_sums_unlike_a_conv(p.x, p.g.batch * p.g.tokens(), p.g.patch_size(),
                                                        p.weight.size(0));
           return why.empty() ? row_major_tokens(p.g) : why;
         },
         [](const UnembedProblem& p) -> WhyNot {
           WhyNot why = cudnn_wins_channels_last(p.x, p.g);
           return !why.empty() ? why : "rule: gemm_scatter writes the output in one pass after the GEMM, not two";
         },
         [](const UnembedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> { return unembed_by_aten_linear(p); }},
        {"aten_conv_transpose", "cpu cuda rocm", "PyTorch's transposed convolution (cuDNN on CUDA); row-major tokens",
         [](const UnembedProblem& p) { return row_major_tokens(p.g); }, nullptr,
         [](const UnembedProblem& p, bool, WhyNot&) -> std::optional<at::Tensor> {
           return unembed_by_aten_conv_transpose(p);
         }},
    },
    patch_signature<UnembedProblem>, [](const UnembedProblem& p) {
      return patch_features(p.x, p.g, p.weight.size(0), p.tokens, {{"bias", p.bias ? 1.0 : 0.0}});
    });

// ---- patch_weight_grad ---------------------------------------------------------------------------

std::string weight_grad_signature(const WeightGradProblem& p) {
  selection::Text out;
  out << "(" << describe("grad_y", p.grad_y) << ", " << describe("x", p.x) << ", kernel "
      << c10::IntArrayRef(kernel_of(p.g, p.rank)) << (p.with_bias ? ", bias" : "")
      << (p.tokens ? ", tokens" : ", channels-first") << (p.transposed ? ", transposed" : "")
      << (p.g.levels.size() > 1 ? ", levels" : "") << ")";
  return out.str();
}

#ifdef PATCHGEMM_PTX_KERNELS
// Whether grad_y lies tokens-major: tokens, one patch per sample, or channels-last.
bool dy_tokens(const WeightGradProblem& p) { return p.tokens || p.g.tokens() == 1 || p.dy.stride(2) == 1; }

// The kernels read grad_y as tokens [B, N, E] or channels-first [B, E, N].
at::Tensor dy_for_kernels(const WeightGradProblem& p) { return dy_tokens(p) ? p.dy : p.dy.transpose(1, 2); }

WeightGrads finish(const WeightGradProblem& p, const WeightGrads& grads) {
  const auto& [grad_w, grad_b] = grads;
  return {weight_grad_in_weight_shape(grad_w, p), grad_b.defined() ? grad_b : bias_grad_by_sum(p)};
}

// The weight gradient's wgmma kernel wins wherever grad_y is channels-first (which cuBLAS needs
// copied into tokens order), but with tokens grad_y only for thinner GEMMs: runs up to E = 256, pairs
// (which gather 4 bytes per patch element) up to E = 512; wider, cuBLAS's rate outweighs the gather.
// Both wgmma kernels lose to it over wide gradients from few tokens: 8 or more 128 x 128 tiles of
// the E x K gradient per SM (0.67x the time after the gather, 73 of the random shapes in
// bench/results/tune-*.json.gz; no real model's stem comes near).
WhyNot implicit_weight_grad_rule(cuda::Implicit kernel, const WeightGradProblem& p) {
  WhyNot why = not_a_view(p.x5, p.g);
  if (why.empty() && kernel != cuda::Implicit::kMma &&
      output_tiles(p.embed, p.g.patch_size()) >= 8 * sm_count(p.x)) {
    why = "rule: 8 or more output tiles per SM run faster as gather + cuBLAS";
  }
  if (!why.empty() || kernel == cuda::Implicit::kRowsSm90) return why;  // rows: its own rule (ruled)
  if (kernel == cuda::Implicit::kMma) {
    // mma.sync needs a full 128-column tile of the patch; the wgmma kernel wins below it too.
    if (p.g.patch_size() < 128) return "rule: patches under 128 elements leave the tiles idle";
    return implicit_mma_pays(p.embed, p.g.batch * p.g.tokens(), p.x);
  }
  const auto& [x5, g] = p.fused();
  const bool pairs = g.kernel[2] == 2 && g.grid[2] % 4 == 0 && runs_aligned(x5, 8);
  if (dy_tokens(p) && p.embed > (pairs ? 512 : 256) && patch_matrix_bytes(p.g, p.x) >= kSmallWeightGradPatchBytes) {
    return "rule: tokens grad_y with E over 256 (pairs: 512) and a patch matrix of 8 MB or more runs faster as "
           "gather + cuBLAS";
  }
  return {};
}

Candidate<WeightGradProblem, WeightGrads> implicit_weight_grad(const char* name, cuda::Implicit kernel,
                                                               const char* backends, const char* conditions) {
  return {name, backends, conditions,
          [](const WeightGradProblem& p) { return fused_kernels_apply(p.x, p.g, p.x5); },
          [kernel](const WeightGradProblem& p) { return implicit_weight_grad_rule(kernel, p); },
          [kernel](const WeightGradProblem& p, bool ruled, WhyNot& why) -> std::optional<WeightGrads> {
            const auto& [x5, g] = p.fused();
            auto grads = cuda::implicit_weight_grad(kernel, dy_for_kernels(p), dy_tokens(p), x5, g, p.embed,
                                                    p.with_bias && !p.transposed, ruled, why);
            if (!grads) return std::nullopt;
            return finish(p, *grads);
          }};
}
#endif

}  // namespace

namespace {

// A 16-bit bias gradient that the forward's patch matrix has no ones column for is summed from
// grad_y apart (column_sums), a second pass over grad_y after the GEMM's. Measured against the
// weight gradient's other candidates on every 16-bit embedding of bench/heldout.py's sets (H200,
// forward and weight gradient forced in pairs, --candidates; with each model family left out in turn, the
// thresholds come out the same but for time series), the matrix pays where grad_y lies tokens-major
// (the sum reads it in rows; channels-first, the fused kernels read it as it lies), where its rows
// are aligned (ATen's copy of K % 8 != 0 patches keeps cuBLAS off its fast kernels: up to 2.6x),
// and unless grad_y is large and over twice as wide as the patch (DiT and video-DiT latents, E =
// 1152 over K = 16; audio spectrograms, K = 256 into E = 768), where the second pass over it costs
// more than a fused kernel's one pass. On the CPU, which has no fused kernels, the last holds too
// (against the gather's ones column: DiT's latent, channels-first, 1.4x slower), while channels-first
// grad_y of a narrow embedding sums quickly, and the matrix spares a gather of x (x [2, 8, 1792,
// 896] by 32 x 32 patches into 64, bf16: 1.6x faster; 2-core VM).
constexpr double kSavedPatchesBiasSumBytes = 4e6;

WhyNot saved_patches_rule(const PatchMatrix& m, bool with_bias, bool transposed, const at::Tensor& x, int64_t embed,
                          bool dy_tokens) {
  // patch_unembed's bias gradient is summed from its grad_y by every path but the tiny kernel, and
  // the matrix spares the gather the others would make.
  if (transposed || !with_bias || m.ones_column || x.element_size() != 2) return {};
  if (!dy_tokens && x.is_cuda()) {
    return "rule: a 16-bit bias gradient summed apart from channels-first grad_y runs faster fused";
  }
  const int64_t row_stride = m.rows.size(1) == 1 ? m.rows.stride(0) : m.rows.stride(1);
  if (x.is_cuda() && row_stride % 8 != 0) {
    return "rule: the forward's matrix has unaligned rows (K % 8 != 0), which cuBLAS reads slowly";
  }
  const int64_t rows = m.rows.size(0) * m.rows.size(1), width = m.rows.size(2);
  if (embed > 2 * width && double(rows) * double(embed) * 2.0 >= kSavedPatchesBiasSumBytes) {
    return "rule: a 16-bit bias gradient summed apart from a grad_y of 4 MB or more, over twice as wide as the "
           "patch, runs faster summed in the weight gradient's own pass";
  }
  return {};
}

}  // namespace

bool weight_grad_takes_patch_matrix(const EmbedProblem& p, bool with_bias, bool transposed) {
  const std::string forced = selection::detail::forced("patch_weight_grad");
  if (!forced.empty()) return forced == "saved_patches";
  return !selection::detail::rules_apply() ||
         saved_patches_rule(*p.patch_matrix(), with_bias, transposed, p.x, p.weight.size(0), p.tokens_out).empty();
}

namespace {

const Table<WeightGradProblem, WeightGrads> kWeightGradTable(
    "patch_weight_grad",
    {
        {"saved_patches", "cpu cuda rocm",
         "patch_embed's backward where its forward gathered the patch matrix (patch_unembed's: dx's "
         "embedding of grad_y): that matrix, one GEMM",
         [](const WeightGradProblem& p) -> WhyNot {
           return p.saved_patches ? WhyNot() : "no patch matrix kept from the forward";
         },
         [](const WeightGradProblem& p) {
           return saved_patches_rule(*p.saved_patches, p.with_bias, p.transposed, p.x, p.embed, p.dy.stride(2) == 1);
         },
         [](const WeightGradProblem& p, bool, WhyNot&) -> std::optional<WeightGrads> {
           return weight_grad_by_saved_patches(p);
         },
         /*reuses=*/true},
#ifdef PATCHGEMM_PTX_KERNELS
        {"tiny", "cuda sm_80+",
         "16-bit, kw = 2, gw % 4 == 0, patches of at most 64 elements, E <= 256; the bias "
         "gradient in the same pass",
         [](const WeightGradProblem& p) { return fused_kernels_apply(p.x, p.g, p.x5); },
         [](const WeightGradProblem& p) { return not_a_view(p.x5, p.g); },
         [](const WeightGradProblem& p, bool, WhyNot& why) -> std::optional<WeightGrads> {
           const auto bias = !p.with_bias ? cuda::BiasGrad::kNone
                             : p.transposed ? cuda::BiasGrad::kUnembed
                                            : cuda::BiasGrad::kEmbed;
           const auto& [x5, g] = p.fused();
           auto grads = cuda::tiny_weight_grad(dy_for_kernels(p), dy_tokens(p), x5, g, p.embed, bias, why);
           if (!grads) return std::nullopt;
           const auto& [grad_w, grad_b] = *grads;
           return WeightGrads{weight_grad_in_weight_shape(grad_w, p),
                              p.with_bias ? grad_b : at::empty({0}, p.x.options())};
         }},
        implicit_weight_grad("implicit_rows_sm90", cuda::Implicit::kRowsSm90, "cuda sm_90a",
                             "16-bit, tokens grad_y, x contiguous, kw of 16 to 64, kh a multiple of 128 / kw, "
                             "E % 8 == 0; the bias gradient in the same pass"),
        implicit_weight_grad("implicit_sm90", cuda::Implicit::kSm90, "cuda sm_90a",
                             "16-bit, kw % 4 == 0 runs or kw = 2 pairs, K >= 16, E >= 32"),
        implicit_weight_grad("implicit_mma", cuda::Implicit::kMma, "cuda sm_80+",
                             "16-bit, kw = 2, gw % 4 == 0, K >= 16, E >= 32"),
#endif
        {"gather_gemm", "cpu cuda rocm",
         "any problem: the patch matrix gathered (or a view of x), one GEMM; the "
         "bias gradient from a ones column",
         [](const WeightGradProblem&) { return WhyNot(); },
         [](const WeightGradProblem& p) -> WhyNot {
           if (p.x.is_cpu()) return p.transposed ? WhyNot() : onednn_conv_wins_fp32(p.x, p.g, p.tokens);
           // Tiny channels-first problems: cuDNN's one kernel beats the gather, GEMM and bias launches.
           if (p.x.is_cuda() && !p.tokens && p.g.levels.size() == 1 && p.g.channels > 0 &&
               gemm_macs(p.g, p.embed) < kTinyWeightGradMacs) {
             return "rule: channels-first problems of under 2^21 multiply-adds run faster on cuDNN";
           }
           return cudnn_wins_channels_last(p.x, p.g);
         },
         [](const WeightGradProblem& p, bool, WhyNot&) -> std::optional<WeightGrads> {
           return weight_grad_by_gemm(p);
         }},
        {"aten_conv_backward", "cpu cuda rocm", "PyTorch's convolution backward (cuDNN on CUDA); row-major tokens",
         [](const WeightGradProblem& p) { return row_major_tokens(p.g); }, nullptr,
         [](const WeightGradProblem& p, bool, WhyNot&) -> std::optional<WeightGrads> {
           std::vector<int64_t> shape{p.g.batch, p.embed};
           for (int64_t s : grid_of(p.g, p.rank)) shape.push_back(s);
           const at::Tensor grad = p.tokens ? p.grad_y.transpose(1, 2).reshape(shape) : p.grad_y;
           const bool conv_bias = p.with_bias && !p.transposed;
           const std::vector<int64_t> kernel = kernel_of(p.g, p.rank), zeros(kernel.size(), 0),
                                      ones(kernel.size(), 1), bias_sizes{p.embed};
           auto [unused, grad_w, grad_b] = at::convolution_backward(
               grad, p.x, at::empty(p.w_shape, p.x.options()),
               conv_bias ? std::optional<at::IntArrayRef>(bias_sizes) : std::nullopt, kernel, zeros, ones, false,
               zeros, 1, {false, true, conv_bias});
           return WeightGrads{grad_w, conv_bias ? grad_b : bias_grad_by_sum(p)};
         }},
    },
    weight_grad_signature, [](const WeightGradProblem& p) {
      return patch_features(p.x, p.g, p.embed, p.tokens, {{"bias", p.with_bias ? 1.0 : 0.0},
                                                          {"transposed", p.transposed ? 1.0 : 0.0},
                                                          {"grad_y_tokens", p.dy.stride(2) == 1 ? 1.0 : 0.0}});
    });

}  // namespace

at::Tensor embed_by_aten_conv(const EmbedProblem& p) {
  const at::Tensor y = aten_conv(p.x, p.weight, p.bias, kernel_of(p.g, p.rank), false);
  if (p.tokens) return y.flatten(2).transpose(1, 2).contiguous();
  return y.contiguous(p.g.channels_last ? p.x.suggest_memory_format() : at::MemoryFormat::Contiguous);
}

at::Tensor unembed_by_aten_conv_transpose(const UnembedProblem& p) {
  std::vector<int64_t> shape{p.g.batch, p.weight.size(0)};
  for (int64_t s : grid_of(p.g, p.rank)) shape.push_back(s);
  const at::Tensor x = p.tokens ? p.x.transpose(1, 2).reshape(shape) : p.x;
  return aten_conv(x, p.weight, p.bias, kernel_of(p.g, p.rank), true).contiguous(p.out_format);
}

namespace {

constexpr const char* kWithPyTorchsAutograd = "run with PyTorch's autograd (backward: its convolution_backward)";

// A forced backward candidate must run: then the backward stays with patchgemm's ops.
bool backward_forced(const char* grad_input_op) {
  return !selection::detail::forced(grad_input_op).empty() || !selection::detail::forced("patch_weight_grad").empty();
}

}  // namespace

bool embed_settles_on_aten_conv(const EmbedProblem& p) {
  return !backward_forced("patch_unembed") && kEmbedTable.settled_on(p, "aten_conv", kWithPyTorchsAutograd);
}

bool unembed_settles_on_aten_conv_transpose(const UnembedProblem& p) {
  return !backward_forced("patch_embed") && kUnembedTable.settled_on(p, "aten_conv_transpose", kWithPyTorchsAutograd);
}

at::Tensor select_patch_embed(const EmbedProblem& p) { return kEmbedTable.run(p); }
at::Tensor select_patch_unembed(const UnembedProblem& p) { return kUnembedTable.run(p); }
WeightGrads select_patch_weight_grad(const WeightGradProblem& p) { return kWeightGradTable.run(p); }

}  // namespace patchgemm
