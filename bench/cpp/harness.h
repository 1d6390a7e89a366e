// The microbenchmark harness: options, timing, ceilings and reports. No Python in the loop: every
// figure is the median of `reps` timed runs after `warmup` untimed ones, on fresh random inputs
// rotated through enough sets that they do not stay in the last-level cache.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace microbench {

struct Options {
  at::Device device{at::kCPU};
  std::vector<std::string> filters;  // a problem runs if its id contains any of them (all if none)
  std::vector<at::ScalarType> dtypes;
  std::vector<std::string> gemm_sizes;   // "BxGxDinxDout"
  std::vector<std::string> patch_sizes;  // "BxCx[Dx][Hx]W/k[/E]"
  int warmup = 5, reps = 30;
  std::string csv_path, json_path;
  bool list = false;
};

// Runs an implementation on input set `i` (modulo the number of sets).
using Runner = std::function<void(int64_t i)>;

// One problem at one size and dtype, timed for each of its implementations (patchgemm's first).
struct Problem {
  std::string family;  // gemm, gather, scatter, patch_embed, patch_unembed
  std::string dtype;   // bf16, fp16, fp32, fp64
  std::string sizes;   // as written on the command line
  std::vector<std::string> impls;
  double bytes = 0;  // each input read once + each output written once
  double flops = 0;
  // Allocates the input sets and returns one runner per impl (called only if the problem runs).
  std::function<std::vector<Runner>()> setup;

  std::string id(size_t impl) const { return family + "/" + impls[impl] + "/" + dtype + "/" + sizes; }
};

// What this machine can do, measured in the same run: a large GEMM per dtype and a large copy
// (bytes read + written).
struct Ceilings {
  std::map<std::string, double> gemm_tflops;
  double copy_gbps = 0;
};

struct Result {
  std::string id, family, impl, dtype, sizes;
  double ms = 0, gbps = 0, tflops = 0;
  double pct_copy = 0, pct_gemm = 0;  // of the measured ceilings
  double floor_ms = 0;                // max(flops / GEMM ceiling, bytes / copy ceiling)
  double ours_faster_by = 0;          // this impl's time / patchgemm's; 0 for patchgemm itself
};

// Median milliseconds of fn(i), i = 0, 1, ... (CUDA events on a GPU, a steady clock on the CPU).
double median_ms(const Runner& fn, at::Device device, int warmup, int reps);
// How many input sets of `bytes_per_set` to rotate so they exceed the last-level cache (1 to 8).
int64_t rotation_count(double bytes_per_set, at::Device device);
Ceilings measure_ceilings(at::Device device, const std::vector<at::ScalarType>& dtypes);
Result make_result(const Problem& p, size_t impl, double ms, double ours_ms, const Ceilings& c);

std::string dtype_name(at::ScalarType t);
std::string device_description(at::Device device);
void print_table(const std::vector<Result>& results);
void write_csv(const std::string& path, const std::vector<Result>& results);
void write_json(const std::string& path, const std::vector<Result>& results, const Ceilings& c,
                at::Device device);

// Every problem the options ask for, in order (problems.cpp); throws UsageError on bad sizes.
std::vector<Problem> make_problems(const Options& opts);

// A bad command line, impossible sizes or a filter that matches nothing: reported as one line and
// a non-zero exit, never a crash.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace microbench
