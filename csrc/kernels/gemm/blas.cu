// The one BLAS wrapper: cuBLAS (hipBLAS after hipify) strided-batched GEMMs on PyTorch's handle and
// current stream, plus cuBLASLt on CUDA (the bias epilogue; the heuristic's algorithms, for
// autotune to time). Every status is checked.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include <array>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/gemm/gemm.h"

#ifndef USE_ROCM
#include <cublasLt.h>
#endif

#ifdef USE_ROCM
#define PATCHGEMM_BLAS_STATUS_STRING(status) hipblasStatusToString(status)
#else
#define PATCHGEMM_BLAS_STATUS_STRING(status) cublasGetStatusString(status)
#endif

#define PATCHGEMM_CUBLAS_CHECK(expr)                                                        \
  do {                                                                                      \
    const cublasStatus_t status_ = (expr);                                                  \
    TORCH_CHECK(status_ == CUBLAS_STATUS_SUCCESS, "patchgemm: ", #expr, " failed: ",        \
                PATCHGEMM_BLAS_STATUS_STRING(status_), " (", static_cast<int>(status_), ")"); \
  } while (0)

namespace patchgemm {

std::string blas_version() {
#ifdef USE_ROCM
  return "hipBLAS";  // the ROCm release is torch.version.hip
#else
  int major = 0, minor = 0, patch = 0;  // of the loaded library; needs no handle or GPU
  PATCHGEMM_CUBLAS_CHECK(cublasGetProperty(MAJOR_VERSION, &major));
  PATCHGEMM_CUBLAS_CHECK(cublasGetProperty(MINOR_VERSION, &minor));
  PATCHGEMM_CUBLAS_CHECK(cublasGetProperty(PATCH_LEVEL, &patch));
  return "cuBLAS " + std::to_string(major) + "." + std::to_string(minor) + "." +
         std::to_string(patch);
#endif
}

namespace cuda {
namespace {

// dtype -> (storage type, compute type, scale type): the one table. Half/bfloat16 accumulate in
// fp32; fp32 uses TF32 tensor cores only where `tf32` (the flag of the op the GEMM serves) allows.
struct BlasTypes {
  cudaDataType_t data;
  cublasComputeType_t compute;
  cudaDataType_t scale;
};

BlasTypes blas_types(at::ScalarType dtype, bool tf32) {
  switch (dtype) {
    case at::kFloat:
      return {CUDA_R_32F, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case at::kHalf:
      return {CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case at::kBFloat16:
      return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case at::kDouble:
      return {CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F};
    default:
      TORCH_CHECK(false, "patchgemm: no BLAS type for dtype ", dtype);
  }
}

// alpha/beta live on the host (PyTorch's handle uses host pointer mode); graph capture records
// them by value.
struct Scalars {
  double d_alpha = 1, d_beta = 0;
  float f_alpha = 1, f_beta = 0;
  Scalars(at::ScalarType dtype, bool accumulate)
      : d_beta(accumulate ? 1 : 0), f_beta(accumulate ? 1.f : 0.f), is_double(dtype == at::kDouble) {}
  const void* alpha() const { return is_double ? static_cast<const void*>(&d_alpha) : &f_alpha; }
  const void* beta() const { return is_double ? static_cast<const void*>(&d_beta) : &f_beta; }
  bool is_double;
};

// Keeps 16-bit split-K partial sums in fp32 (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION) for the
// calls made while it lives, unless `math` allows rounding them, then restores the handle's math mode.
struct ReductionPrecision {
  ReductionPrecision(cublasHandle_t handle, GemmMath math) : handle(handle) {
#ifndef USE_ROCM
    PATCHGEMM_CUBLAS_CHECK(cublasGetMathMode(handle, &saved_mode));
    if (!math.reduced_precision_sums) {
      PATCHGEMM_CUBLAS_CHECK(cublasSetMathMode(
          handle, static_cast<cublasMath_t>(saved_mode | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    }
#endif
  }
  ~ReductionPrecision() {
#ifndef USE_ROCM
    cublasSetMathMode(handle, saved_mode);  // no throwing from a destructor; the mode was valid
#endif
  }
  cublasHandle_t handle;
#ifndef USE_ROCM
  cublasMath_t saved_mode{};
#endif
};

cublasOperation_t op(bool trans) { return trans ? CUBLAS_OP_T : CUBLAS_OP_N; }

const char* byte_ptr(const at::Tensor& t) { return static_cast<const char*>(t.const_data_ptr()); }

// One classic-API call (cublasGemmStridedBatchedEx). c is of a and b's dtype, or fp32 for 16-bit
// a and b (partial sums, gemm.cpp).
void gemm_ex(const BlasCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, GemmMath math) {
  const at::ScalarType dtype = a.scalar_type();
  const BlasTypes types = blas_types(dtype, math.tf32);
  const cudaDataType_t c_type = c.scalar_type() == dtype ? types.data : blas_types(c.scalar_type(), math.tf32).data;
  const int64_t elem = a.element_size(), c_elem = c.element_size();
  const Scalars s(dtype, call.accumulate);
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();  // bound to the current stream
  const ReductionPrecision precision(handle, math);
  // BLAS A is the problem's b, BLAS B the problem's a (row-major <-> column-major).
  PATCHGEMM_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, op(call.trans_a), op(call.trans_b), static_cast<int>(call.m),
      static_cast<int>(call.n), static_cast<int>(call.k), s.alpha(),
      byte_ptr(b) + call.offset_a * elem, types.data, static_cast<int>(call.lda), call.stride_a,
      byte_ptr(a) + call.offset_b * elem, types.data, static_cast<int>(call.ldb), call.stride_b,
      s.beta(), static_cast<char*>(c.data_ptr()) + call.offset_c * c_elem, c_type,
      static_cast<int>(call.ldc), call.stride_c, static_cast<int>(call.batch), types.compute,
      CUBLAS_GEMM_DEFAULT));
}

#ifdef USE_ROCM
bool lt_matmul(const BlasCall&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
               const std::optional<at::Tensor>&, GemmMath, int) {
  return false;  // hipBLASLt not wired up: the bias is added through beta = 1
}
#else

// RAII owners for the cuBLASLt descriptors.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct LtHandle {
  T value = nullptr;
  ~LtHandle() {
    if (value) Destroy(value);
  }
};
using MatmulDesc = LtHandle<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using Layout = LtHandle<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using Preference = LtHandle<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

template <typename T>
void set_desc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr, const T& value) {
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, attr, &value, sizeof(value)));
}

// A column-major stored matrix of rows x cols with leading dimension ld, batched.
void make_layout(Layout& layout, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                 int64_t batch, int64_t batch_stride) {
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout.value, type, rows, cols, ld));
  const int32_t count = static_cast<int32_t>(batch);
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
      layout.value, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
      layout.value, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &batch_stride,
      sizeof(batch_stride)));
}

uint32_t pointer_alignment(const void* ptr) {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

// PATCHGEMM_DISABLE_LT=1 turns cuBLASLt off (the bias copied into C, then beta = 1), to compare.
bool lt_disabled() {
  static const bool disabled = [] {
    const char* v = std::getenv("PATCHGEMM_DISABLE_LT");
    return v != nullptr && std::string(v) == "1";
  }();
  return disabled;
}

// Everything cuBLASLt's heuristic sees of a matmul: device, types, transposes, sizes, leading
// dimensions, batch and strides, the epilogue, the operands' alignments, the workspace and whether
// partial sums must stay in fp32.
using LtShape = std::array<int64_t, 21>;

// The algorithms the heuristic proposes for a shape, best first (at most kLtAlgorithms): asked once
// per shape, as the query costs the host tens of microseconds, and kept for the process.
struct LtProposals {
  int count = 0;
  cublasLtMatmulAlgo_t algo[kLtAlgorithms];
};

struct LtAlgorithms {
  std::mutex mutex;
  std::map<LtShape, LtProposals> by_shape;  // (map nodes do not move)
};

LtAlgorithms& lt_algorithms() {
  static LtAlgorithms* known = new LtAlgorithms;  // never destroyed: GEMMs may run during shutdown
  return *known;
}

LtProposals ask_heuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t a,
                          cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, size_t workspace_size,
                          const uint32_t (&alignments)[3], bool fp32_sums) {
  Preference pref;
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.value));
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.value, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_size, sizeof(workspace_size)));
  if (fp32_sums) {  // no split-K reductions in place or in the output's type: unsplit, or in fp32
    const uint32_t schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    PATCHGEMM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref.value, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &schemes, sizeof(schemes)));
  }
  const cublasLtMatmulPreferenceAttributes_t attributes[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i) {
    const uint32_t& alignment = alignments[i < 3 ? i : 2];  // D is C
    PATCHGEMM_CUBLAS_CHECK(
        cublasLtMatmulPreferenceSetAttribute(pref.value, attributes[i], &alignment, sizeof(alignment)));
  }
  cublasLtMatmulHeuristicResult_t results[kLtAlgorithms] = {};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(handle, desc, a, b, c, c, pref.value, kLtAlgorithms, results, &found);
  LtProposals proposals;
  proposals.count = status == CUBLAS_STATUS_SUCCESS ? found : 0;  // none: the caller falls back
  for (int i = 0; i < proposals.count; ++i) proposals.algo[i] = results[i].algo;
  return proposals;
}

// The heuristic's proposals for `shape` (asked on its first sight). The reference stays valid:
// entries are never changed or removed after insertion, and map nodes do not move.
const LtProposals& lt_proposals(const LtShape& shape, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                size_t workspace_size, const uint32_t (&alignments)[3], bool fp32_sums) {
  LtAlgorithms& known = lt_algorithms();
  const std::lock_guard<std::mutex> lock(known.mutex);
  auto found = known.by_shape.find(shape);
  if (found == known.by_shape.end()) {
    found = known.by_shape.emplace(shape, ask_heuristic(handle, desc, a, b, c, workspace_size, alignments, fp32_sums))
                .first;
  }
  return found->second;
}

// One strided-batched cuBLASLt matmul with the `algorithm`-th algorithm its heuristic proposes, and
// the bias, if any, added in the epilogue (CUBLASLT_EPILOGUE_BIAS: one entry per row of the
// column-major output, i.e. per output feature). Returns false where it does not apply (fp64, an
// fp32 c for 16-bit inputs, accumulate, a misaligned bias, fewer algorithms proposed), so the
// caller falls back to the classic API.
bool lt_matmul(const BlasCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
               const std::optional<at::Tensor>& bias, GemmMath math, int algorithm) {
  const at::ScalarType dtype = c.scalar_type();
  if (lt_disabled() || dtype == at::kDouble || call.accumulate || a.scalar_type() != dtype) return false;
  if (bias && (bias->stride(1) != 1 || pointer_alignment(bias->const_data_ptr()) < 16)) return false;
  const BlasTypes types = blas_types(dtype, math.tf32);
  const bool fp32_sums = c.element_size() == 2 && !math.reduced_precision_sums;
  const int64_t elem = c.element_size();

  MatmulDesc desc;
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.value, types.compute, types.scale));
  set_desc(desc.value, CUBLASLT_MATMUL_DESC_TRANSA, op(call.trans_a));
  set_desc(desc.value, CUBLASLT_MATMUL_DESC_TRANSB, op(call.trans_b));
  if (bias) {
    set_desc(desc.value, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_desc(desc.value, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->const_data_ptr());
    set_desc(desc.value, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, static_cast<int64_t>(bias->stride(0)));
  }

  Layout layout_a, layout_b, layout_c;
  make_layout(layout_a, types.data, call.trans_a ? call.k : call.m, call.trans_a ? call.m : call.k,
              call.lda, call.batch, call.stride_a);
  make_layout(layout_b, types.data, call.trans_b ? call.n : call.k, call.trans_b ? call.k : call.n,
              call.ldb, call.batch, call.stride_b);
  make_layout(layout_c, types.data, call.m, call.n, call.ldc, call.batch, call.stride_c);

  // Workspace: PyTorch's per-handle/stream cuBLASLt workspace (caching allocator, graph-safe).
  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  // The heuristic assumes 16-byte aligned pointers unless told otherwise; views of a slice may not
  // be.
  const void* ptr_a = byte_ptr(b) + call.offset_a * elem;
  const void* ptr_b = byte_ptr(a) + call.offset_b * elem;
  void* ptr_c = static_cast<char*>(c.data_ptr()) + call.offset_c * elem;
  const uint32_t alignments[3] = {pointer_alignment(ptr_a), pointer_alignment(ptr_b), pointer_alignment(ptr_c)};
  const LtShape shape{c.get_device(), types.data, types.compute, call.trans_a, call.trans_b, call.m, call.n, call.k,
                      call.lda, call.ldb, call.ldc, call.batch, call.stride_a, call.stride_b, call.stride_c,
                      bias ? bias->stride(0) : -1, alignments[0], alignments[1], alignments[2],
                      static_cast<int64_t>(workspace_size), fp32_sums};

  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const LtProposals& proposals = lt_proposals(shape, handle, desc.value, layout_a.value, layout_b.value,
                                              layout_c.value, workspace_size, alignments, fp32_sums);
  if (algorithm >= proposals.count) return false;
  const cublasLtMatmulAlgo_t* chosen = &proposals.algo[algorithm];

  const Scalars s(dtype, false);
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatmul(
      handle, desc.value, s.alpha(), ptr_a, layout_a.value, ptr_b, layout_b.value, s.beta(), ptr_c,
      layout_c.value, ptr_c, layout_c.value, chosen, workspace, workspace_size,
      at::cuda::getCurrentCUDAStream()));
  return true;
}

cudaDataType_t fp8_type(at::ScalarType t) { return t == at::kFloat8_e4m3fn ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

// FP8 through cuBLASLt (run_scaled_gemm_lt). Row-major c = a @ b^T is column-major c^T = b @ a^T:
// BLAS A is b read transposed (K-major), BLAS B is a (K-major): the "TN" form Hopper's FP8 needs.
std::string scaled_lt_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                             const at::Tensor& scale_b, const at::Tensor& c, const std::optional<at::Tensor>& bias,
                             bool fast_accum) {
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(c.get_device());
  if (props->major * 10 + props->minor < 89) return "FP8 matmuls need sm_89 or newer";
  if (a.scalar_type() == at::kFloat8_e5m2 && b.scalar_type() == at::kFloat8_e5m2) {
    return "cuBLASLt multiplies no two e5m2 operands";
  }
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(1);
  if (batch == 0 || m == 0 || n == 0 || k == 0) return "an empty problem";
  if (a.stride(2) != 1 || b.stride(2) != 1) return "an operand whose K is not contiguous (FP8 reads both K-major)";
  const int64_t lda = m > 1 ? a.stride(1) : k, ldb = n > 1 ? b.stride(1) : k, ldc = m > 1 ? c.stride(1) : n;
  const auto off16 = [](int64_t v) { return v % 16 != 0; };
  if (off16(k) || off16(lda) || off16(ldb) || lda < k || ldb < k || ldc < n || c.stride(2) != 1 ||
      off16(ldc * c.element_size()) ||
      (batch > 1 && (off16(a.stride(0)) || off16(b.stride(0)) || off16(c.stride(0) * c.element_size())))) {
    return "K, the leading dimensions and batch strides must be multiples of 16 bytes for cuBLASLt's FP8";
  }
  if (pointer_alignment(a.const_data_ptr()) < 16 || pointer_alignment(b.const_data_ptr()) < 16 ||
      pointer_alignment(c.const_data_ptr()) < 16) {
    return "an operand not 16-byte aligned";
  }
  const cudaDataType_t out_type = blas_types(c.scalar_type(), false).data;
  // The epilogue adds a bias of the output's 16-bit type; other biases are added after.
  const bool bias_in_epilogue = bias && c.element_size() == 2 && bias->scalar_type() == c.scalar_type() &&
                                bias->stride(1) == 1 && pointer_alignment(bias->const_data_ptr()) >= 16;

  MatmulDesc desc;
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.value, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc(desc.value, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  set_desc(desc.value, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  set_desc(desc.value, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scale_b.const_data_ptr());
  set_desc(desc.value, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scale_a.const_data_ptr());
  set_desc(desc.value, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum));
  if (bias_in_epilogue) {
    set_desc(desc.value, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_BIAS);
    set_desc(desc.value, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias->const_data_ptr());
    set_desc(desc.value, CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE, static_cast<int64_t>(bias->stride(0)));
  }
  Layout layout_a, layout_b, layout_c;
  make_layout(layout_a, fp8_type(b.scalar_type()), k, n, ldb, batch, b.stride(0));
  make_layout(layout_b, fp8_type(a.scalar_type()), k, m, lda, batch, a.stride(0));
  make_layout(layout_c, out_type, n, m, ldc, batch, c.stride(0));

  const size_t workspace_size = at::cuda::getCUDABlasLtWorkspaceSize();
  void* workspace = at::cuda::getCUDABlasLtWorkspace();
  const uint32_t alignments[3] = {pointer_alignment(b.const_data_ptr()), pointer_alignment(a.const_data_ptr()),
                                  pointer_alignment(c.const_data_ptr())};
  // The key of lt_matmul's shapes, its last entry 2 (an FP8 matmul) where theirs is 0 or 1.
  const LtShape shape{c.get_device(), fp8_type(a.scalar_type()) * 100 + fp8_type(b.scalar_type()), out_type,
                      fast_accum, bias_in_epilogue ? bias->stride(0) : -1, m, n, k, lda, ldb, ldc, batch,
                      a.stride(0), b.stride(0), c.stride(0), 0, alignments[0], alignments[1], alignments[2],
                      static_cast<int64_t>(workspace_size), 2};
  cublasLtHandle_t handle = at::cuda::getCurrentCUDABlasLtHandle();
  const LtProposals& proposals = lt_proposals(shape, handle, desc.value, layout_a.value, layout_b.value,
                                              layout_c.value, workspace_size, alignments, false);
  if (proposals.count == 0) return "cuBLASLt proposes no FP8 algorithm for this shape";
  const float alpha = 1.f, beta = 0.f;
  void* ptr_c = c.data_ptr();
  PATCHGEMM_CUBLAS_CHECK(cublasLtMatmul(handle, desc.value, &alpha, b.const_data_ptr(), layout_a.value,
                                        a.const_data_ptr(), layout_b.value, &beta, ptr_c, layout_c.value, ptr_c,
                                        layout_c.value, &proposals.algo[0], workspace, workspace_size,
                                        at::cuda::getCurrentCUDAStream()));
  if (bias && !bias_in_epilogue) c.add_(bias->unsqueeze(1));
  return {};
}
#endif  // USE_ROCM

}  // namespace

SplitKGuard split_k_guard(const at::Tensor& input) {
#ifdef USE_ROCM
  return {};
#else
  // The K tile of cuBLAS's kernels is 128 bytes of k (the "64" of nvjet_sm90_tst_8x64_64x16 in 16
  // bits); reductions from 32 tiles on are guarded, a margin of 3.5x below the shortest loss seen.
  const int64_t sms = at::cuda::getDeviceProperties(input.get_device())->multiProcessorCount;
  const int64_t k_tile = 128 / static_cast<int64_t>(input.element_size());
  return {k_tile, 2 * sms, 32 * k_tile};
#endif
}

bool run_lt_call(const BlasCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                 const std::optional<at::Tensor>& bias, GemmMath math, int algorithm) {
  TORCH_CHECK(algorithm >= 0 && algorithm < kLtAlgorithms, "patchgemm: no cuBLASLt algorithm ", algorithm);
  const c10::cuda::CUDAGuard guard(c.device());
  return lt_matmul(call, a, b, c, bias, math, algorithm);
}

bool lt_reduction_fits(const BlasCall& call, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
#ifdef USE_ROCM
  (void)call, (void)a, (void)b, (void)c;
  return false;  // run_lt_call does not apply there
#else
  constexpr int64_t kMaxK = 8192;
  const int64_t elem = c.element_size();
  const auto whole = [elem](int64_t elements) { return elements * elem % 16 == 0; };
  const auto aligned = [elem](const at::Tensor& t, int64_t offset) {
    return pointer_alignment(byte_ptr(t) + offset * elem) >= 16;
  };
  const bool batches_whole =
      call.batch == 1 || (whole(call.stride_a) && whole(call.stride_b) && whole(call.stride_c));
  // (BLAS A is the problem's b, BLAS B its a, as everywhere here.)
  return call.k <= kMaxK && call.m >= 32 && call.n >= 32 && whole(call.lda) && whole(call.ldb) &&
         whole(call.ldc) && batches_whole && aligned(b, call.offset_a) && aligned(a, call.offset_b) &&
         aligned(c, call.offset_c);
#endif
}

std::string run_scaled_gemm_lt(const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale_a,
                               const at::Tensor& scale_b, const at::Tensor& c, const std::optional<at::Tensor>& bias,
                               bool fast_accum) {
#ifdef USE_ROCM
  return "ROCm (hipBLASLt's FP8 is not wired up)";
#else
  const c10::cuda::CUDAGuard guard(c.device());
  return scaled_lt_matmul(a, b, scale_a, scale_b, c, bias, fast_accum);
#endif
}

#ifndef USE_ROCM
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120500
#define PATCHGEMM_HAS_GROUPED_GEMM
bool has_grouped_gemm() { return true; }

void run_grouped_blas_calls(const std::vector<GroupedBlasCall>& calls, at::ScalarType dtype,
                            at::Device device, GemmMath math) {
  TORCH_INTERNAL_ASSERT(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16);
  if (calls.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  const BlasTypes types = blas_types(dtype, math.tf32);
  const int64_t elem = c10::elementSize(dtype);
  const size_t n = calls.size();
  std::vector<cublasOperation_t> trans_a(n), trans_b(n);
  std::vector<int> m(n), cols(n), k(n), lda(n), ldb(n), ldc(n), one_each(n, 1);
  std::vector<float> alpha(n, 1.f), beta(n, 0.f);
  // The pointer arrays go to the GPU from pinned memory, asynchronously (the caching host
  // allocator keeps the buffer until the copy has run).
  at::Tensor host = at::empty({static_cast<int64_t>(3 * n)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* pointers = host.mutable_data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) {
    const BlasCall& c = calls[i].call;
    TORCH_INTERNAL_ASSERT(c.batch == 1);
    trans_a[i] = op(c.trans_a);
    trans_b[i] = op(c.trans_b);
    m[i] = static_cast<int>(c.m);
    cols[i] = static_cast<int>(c.n);
    k[i] = static_cast<int>(c.k);
    lda[i] = static_cast<int>(c.lda);
    ldb[i] = static_cast<int>(c.ldb);
    ldc[i] = static_cast<int>(c.ldc);
    beta[i] = c.accumulate ? 1.f : 0.f;
    // BLAS A is the problem's b, BLAS B the problem's a (row-major <-> column-major).
    pointers[i] = reinterpret_cast<int64_t>(static_cast<const char*>(calls[i].b) + c.offset_a * elem);
    pointers[n + i] = reinterpret_cast<int64_t>(static_cast<const char*>(calls[i].a) + c.offset_b * elem);
    pointers[2 * n + i] = reinterpret_cast<int64_t>(static_cast<char*>(calls[i].c) + c.offset_c * elem);
  }
  const at::Tensor on_device = host.to(device, /*non_blocking=*/true);
  void* const* array = static_cast<void* const*>(on_device.const_data_ptr());
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const ReductionPrecision precision(handle, math);
  PATCHGEMM_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      handle, trans_a.data(), trans_b.data(), m.data(), cols.data(), k.data(), alpha.data(), array,
      types.data, lda.data(), array + n, types.data, ldb.data(), beta.data(), array + 2 * n, types.data,
      ldc.data(), static_cast<int>(n), one_each.data(), types.compute));
}
#endif
#endif  // USE_ROCM
#ifndef PATCHGEMM_HAS_GROUPED_GEMM
bool has_grouped_gemm() { return false; }

void run_grouped_blas_calls(const std::vector<GroupedBlasCall>&, at::ScalarType, at::Device, GemmMath) {
  TORCH_CHECK(false, "patchgemm: this build has no grouped GEMM (cuBLAS 12.5+)");
}
#endif

void run_blas_calls(const std::vector<BlasCall>& calls, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c, GemmMath math) {
  const c10::cuda::CUDAGuard guard(c.device());
  for (const BlasCall& call : calls) gemm_ex(call, a, b, c, math);
}

}  // namespace cuda
}  // namespace patchgemm
