#include "harness.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/version.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fstream>

#ifdef PATCHGEMM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace microbench {

double median_ms(const Runner& fn, at::Device device, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn(i);
  std::vector<double> times;
  if (device.is_cpu()) {
    for (int i = 0; i < reps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      fn(warmup + i);
      times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
  } else {
    // Events on the current stream bracket just the work queued by fn (host overhead included
    // only where it is longer than the GPU work it launches, as in a real program).
    c10::impl::VirtualGuardImpl guard(device.type());
    const c10::Stream stream = guard.getStream(device);
    for (int i = 0; i < reps; ++i) {
      c10::Event start(device.type(), c10::EventFlag::BACKEND_DEFAULT);
      c10::Event end(device.type(), c10::EventFlag::BACKEND_DEFAULT);
      start.record(stream);
      fn(warmup + i);
      end.record(stream);
      end.synchronize();
      times.push_back(start.elapsedTime(end));
    }
  }
  std::nth_element(times.begin(), times.begin() + times.size() / 2, times.end());
  return times[times.size() / 2];
}

namespace {

double cache_bytes(at::Device device) {
#ifdef PATCHGEMM_WITH_CUDA
  if (device.is_cuda()) return at::cuda::getDeviceProperties(device.index())->l2CacheSize;
#endif
  const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return static_cast<double>(std::max({l3, l2, 32L << 20}));
}

std::string today() {
  char buf[16];
  const std::time_t now = std::time(nullptr);
  std::strftime(buf, sizeof buf, "%Y-%m-%d", std::localtime(&now));
  return buf;
}

}  // namespace

int64_t rotation_count(double bytes_per_set, at::Device device) {
  const double sets = std::ceil(3 * cache_bytes(device) / std::max(bytes_per_set, 1.0));
  return static_cast<int64_t>(std::clamp(sets, 1.0, 8.0));
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    case at::kFloat: return "fp32";
    case at::kDouble: return "fp64";
    default: return c10::toString(t);
  }
}

Ceilings measure_ceilings(at::Device device, const std::vector<at::ScalarType>& dtypes) {
  const bool gpu = !device.is_cpu();
  Ceilings c;
  const int64_t n = gpu ? 8192 : 512;
  for (at::ScalarType dtype : dtypes) {
    const auto opts = at::TensorOptions().device(device).dtype(dtype);
    const at::Tensor a = at::randn({n, n}, opts), b = at::randn({n, n}, opts);
    const double ms = median_ms([&](int64_t) { at::mm(a, b); }, device, 2, gpu ? 10 : 3);
    c.gemm_tflops[dtype_name(dtype)] = 2.0 * n * n * n / ms / 1e9;
  }
  const int64_t bytes = gpu ? (int64_t{1} << 30) : (int64_t{1} << 26);
  const auto opts = at::TensorOptions().device(device).dtype(at::kByte);
  const at::Tensor src = at::randint(0, 255, {bytes}, opts), dst = at::empty_like(src);
  const double ms = median_ms([&](int64_t) { dst.copy_(src); }, device, 2, 10);
  c.copy_gbps = 2.0 * bytes / ms / 1e6;
  return c;
}

Result make_result(const Problem& p, size_t impl, double ms, double ours_ms, const Ceilings& c) {
  Result r{p.id(impl), p.family, p.impls[impl], p.dtype, p.sizes};
  r.ms = ms;
  r.gbps = p.bytes / ms / 1e6;
  r.tflops = p.flops / ms / 1e9;
  const double peak = c.gemm_tflops.at(p.dtype);
  r.pct_copy = 100 * r.gbps / c.copy_gbps;
  r.pct_gemm = 100 * r.tflops / peak;
  r.floor_ms = std::max(p.flops / peak / 1e9, p.bytes / c.copy_gbps / 1e6);
  r.ours_faster_by = (impl == 0 || ours_ms <= 0) ? 0 : ms / ours_ms;
  return r;
}

std::string device_description(at::Device device) {
  std::string s = "torch " TORCH_VERSION;
#ifdef PATCHGEMM_WITH_CUDA
  if (device.is_cuda()) {
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device.index());
    s += std::string(", ") + prop->name + ", CUDA runtime " + std::to_string(CUDART_VERSION);
    return s;
  }
#endif
  return s + ", CPU (" + std::to_string(at::get_num_threads()) + " threads)";
}

void print_table(const std::vector<Result>& results) {
  std::printf("%-58s %10s %9s %8s %6s %6s %8s %8s\n", "id", "ms", "GB/s", "TFLOP/s", "%copy",
              "%gemm", "x floor", "ours by");
  std::printf("%s\n", std::string(120, '-').c_str());
  for (const Result& r : results) {
    char faster[16] = "";
    if (r.ours_faster_by > 0) std::snprintf(faster, sizeof faster, "%.2fx", r.ours_faster_by);
    std::printf("%-58s %10.4f %9.1f %8.2f %6.1f %6.1f %8.2f %8s\n", r.id.c_str(), r.ms, r.gbps,
                r.tflops, r.pct_copy, r.pct_gemm, r.ms / r.floor_ms, faster);
  }
}

void write_csv(const std::string& path, const std::vector<Result>& results) {
  std::ofstream f(path);
  if (!f) throw UsageError("cannot write --csv " + path);
  f << "id,family,impl,dtype,sizes,ms,gbps,tflops,pct_copy_ceiling,pct_gemm_ceiling,floor_ms,"
       "ours_faster_by\n";
  for (const Result& r : results) {
    f << r.id << ',' << r.family << ',' << r.impl << ',' << r.dtype << ',' << r.sizes << ','
      << r.ms << ',' << r.gbps << ',' << r.tflops << ',' << r.pct_copy << ',' << r.pct_gemm << ','
      << r.floor_ms << ',' << r.ours_faster_by << '\n';
  }
}

void write_json(const std::string& path, const std::vector<Result>& results, const Ceilings& c,
                at::Device device) {
  std::ofstream f(path);
  if (!f) throw UsageError("cannot write --json " + path);
  // Every string written here is an identifier, a size spec or a device name: no escaping needed.
  f << "{\n \"environment\": {\"date\": \"" << today() << "\", \"device\": \""
    << device_description(device) << "\"},\n \"ceilings\": {\"copy_gbps\": " << c.copy_gbps
    << ", \"gemm_tflops\": {";
  const char* sep = "";
  for (const auto& [dtype, tflops] : c.gemm_tflops) {
    f << sep << '"' << dtype << "\": " << tflops;
    sep = ", ";
  }
  f << "}},\n \"results\": [";
  sep = "\n  ";
  for (const Result& r : results) {
    f << sep << "{\"id\": \"" << r.id << "\", \"family\": \"" << r.family << "\", \"impl\": \""
      << r.impl << "\", \"dtype\": \"" << r.dtype << "\", \"sizes\": \"" << r.sizes
      << "\", \"ms\": " << r.ms << ", \"gbps\": " << r.gbps << ", \"tflops\": " << r.tflops
      << ", \"pct_copy_ceiling\": " << r.pct_copy << ", \"pct_gemm_ceiling\": " << r.pct_gemm
      << ", \"floor_ms\": " << r.floor_ms << ", \"ours_faster_by\": " << r.ours_faster_by << "}";
    sep = ",\n  ";
  }
  f << "\n ]\n}\n";
}

}  // namespace microbench
