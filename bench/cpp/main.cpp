// patchgemm_microbench: the library's kernels and BLAS calls timed from C++, against the PyTorch
// ways of doing the same work. `patchgemm_microbench --help` lists the options.
#include <ATen/Context.h>

#include <cstdio>
#include <sstream>

#include "harness.h"

namespace microbench {
namespace {

const char* kUsage = R"(usage: patchgemm_microbench [options]
  --list               print the ids of the problems the options select, and exit
  --filter A,B         run only ids containing any of these texts (e.g. gemm, gather/, patch_embed/patchgemm)
  --device cpu|cuda    default: cuda when this build and machine have a GPU
  --dtype bf16,fp32    dtypes (bf16, fp16, fp32, fp64); default bf16,fp32
  --gemm S1,S2         grouped-linear sizes BxGxDinxDout (default: a sweep, see README)
  --patch S1,S2        patch sizes BxCx[Dx][Hx]W/k/E: the volume, the patch (one size or one per
                       dim) and the features per token (default: the suite's P1-P5/U1-U2 shapes)
  --smoke              tiny sizes and few runs (CI)
  --warmup N --reps N  untimed and timed runs per measurement (default 5 and 30)
  --csv PATH --json PATH   also write the results there
ids are family/impl/dtype/sizes; the first impl of each problem is patchgemm's, and "ours by" is
how many times faster it is than the impl on that row.)";

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

at::ScalarType parse_dtype(const std::string& s) {
  if (s == "bf16") return at::kBFloat16;
  if (s == "fp16") return at::kHalf;
  if (s == "fp32") return at::kFloat;
  if (s == "fp64") return at::kDouble;
  throw UsageError("unknown --dtype '" + s + "' (bf16, fp16, fp32 or fp64)");
}

int parse_count(const std::string& flag, const std::string& s, int min) {
  size_t used = 0;
  int v = -1;
  try {
    v = std::stoi(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != s.size() || v < min) {
    throw UsageError(flag + " needs an integer >= " + std::to_string(min) + ", got '" + s + "'");
  }
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  bool smoke = false, cuda = at::hasCUDA();
  std::vector<std::string> dtypes{"bf16", "fp32"};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--help" || arg == "-h") {
      std::puts(kUsage);
      std::exit(0);
    } else if (arg == "--list") {
      o.list = true;
    } else if (arg == "--smoke") {
      smoke = true;
    } else if (arg == "--filter") {
      o.filters = split(value());
    } else if (arg == "--device") {
      const std::string d = value();
      if (d != "cpu" && d != "cuda") throw UsageError("--device must be cpu or cuda, got '" + d + "'");
      if (d == "cuda" && !at::hasCUDA()) {
        throw UsageError("--device cuda: no CUDA GPU here, or this build (and its torch) has no CUDA");
      }
      cuda = d == "cuda";
    } else if (arg == "--dtype") {
      dtypes = split(value());
    } else if (arg == "--gemm") {
      o.gemm_sizes = split(value());
    } else if (arg == "--patch") {
      o.patch_sizes = split(value());
    } else if (arg == "--warmup") {
      o.warmup = parse_count(arg, value(), 0);
    } else if (arg == "--reps") {
      o.reps = parse_count(arg, value(), 1);
    } else if (arg == "--csv") {
      o.csv_path = value();
    } else if (arg == "--json") {
      o.json_path = value();
    } else {
      throw UsageError("unknown option '" + arg + "' (see --help)");
    }
  }
  o.device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  if (dtypes.empty()) throw UsageError("--dtype is empty");
  for (const std::string& d : dtypes) o.dtypes.push_back(parse_dtype(d));
  // Defaults: the suite's shapes on a GPU; small ones on the CPU and in smoke runs.
  const bool big = cuda && !smoke;
  if (o.gemm_sizes.empty()) {
    o.gemm_sizes = big ? std::vector<std::string>{"2560x12x1024x3072", "8192x64x100x100", "16384x8x256x256",
                                                  "4096x32x512x512", "65536x4x64x64"}
                 : smoke ? std::vector<std::string>{"64x4x32x48"}
                         : std::vector<std::string>{"512x12x256x256", "2048x64x32x32"};
  }
  if (o.patch_sizes.empty()) {
    o.patch_sizes = big ? std::vector<std::string>{"128x3x224x224/16/768", "4096x3x2x14x14/2x14x14/1280",
                                                   "8x4x128x128x128/2/192", "8x192x64x64x64/2/192",
                                                   "8x192x32x32x32/4/768"}
                  : smoke ? std::vector<std::string>{"2x3x32x32/8/16", "2x4x8x8x8/2/24"}
                          : std::vector<std::string>{"8x3x224x224/16/768", "2x4x32x32x32/2/96"};
  }
  if (smoke) {
    o.warmup = std::min(o.warmup, 1);
    o.reps = std::min(o.reps, 3);
  }
  return o;
}

bool selected(const Options& o, const Problem& p, size_t impl) {
  if (o.filters.empty()) return true;
  const std::string id = p.id(impl);
  for (const std::string& f : o.filters) {
    if (id.find(f) != std::string::npos) return true;
  }
  return false;
}

int run(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const std::vector<Problem> problems = make_problems(o);
  std::vector<std::pair<const Problem*, std::vector<size_t>>> chosen;
  for (const Problem& p : problems) {
    std::vector<size_t> impls;
    for (size_t i = 0; i < p.impls.size(); ++i) {
      if (selected(o, p, i)) impls.push_back(i);
    }
    if (!impls.empty()) chosen.emplace_back(&p, impls);
  }
  if (chosen.empty()) {
    std::string families;
    for (const char* f : {"gemm", "gather", "scatter", "patch_embed", "patch_weight_grad", "patch_unembed"})
      families += std::string(" ") + f;
    throw UsageError("no problem id matches --filter (families:" + families + "; see --list)");
  }
  if (o.list) {
    for (const auto& [p, impls] : chosen) {
      for (size_t i : impls) std::puts(p->id(i).c_str());
    }
    return 0;
  }

  std::printf("patchgemm_microbench: %s\n", device_description(o.device).c_str());
  const Ceilings ceilings = measure_ceilings(o.device, o.dtypes);
  std::printf("ceilings: copy %.0f GB/s;", ceilings.copy_gbps);
  for (const auto& [dtype, tflops] : ceilings.gemm_tflops) std::printf(" %s GEMM %.1f TFLOP/s;", dtype.c_str(), tflops);
  std::printf("\n\n");

  std::vector<Result> results;
  for (const auto& [p, impls] : chosen) {
    std::vector<Runner> runners;
    try {
      runners = p->setup();
    } catch (const c10::Error& e) {
      throw UsageError("cannot allocate the inputs of " + p->family + " " + p->sizes + " (" + p->dtype +
                       "): " + e.what_without_backtrace());
    }
    double ours_ms = 0;
    for (size_t i : impls) {
      const double ms = median_ms(runners[i], o.device, o.warmup, o.reps);
      if (i == 0) ours_ms = ms;
      results.push_back(make_result(*p, i, ms, ours_ms, ceilings));
    }
  }
  print_table(results);
  if (!o.csv_path.empty()) write_csv(o.csv_path, results);
  if (!o.json_path.empty()) write_json(o.json_path, results, ceilings, o.device);
  return 0;
}

}  // namespace
}  // namespace microbench

int main(int argc, char** argv) {
  try {
    return microbench::run(argc, argv);
  } catch (const microbench::UsageError& e) {
    std::fprintf(stderr, "patchgemm_microbench: %s\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "patchgemm_microbench: %s\n", e.what_without_backtrace());
    return 1;
  }
}
