// The selection modes' memory and measurement (registry.h): the mode, the choices remembered per
// problem key, the autotune cache files, the timing of candidates and the device's properties.
//
// Cache files: one per device and environment, `<dir>/autotune-<device name>-<hash>.tsv`, where the
// hash covers the environment (device name, compute capability, SMs, driver, CUDA runtime, cuBLASLt,
// torch, cuDNN and patchgemm versions), which the file's second line also spells out. A file of
// another environment is not read (stale records would be wrong); a line that does not parse is
// skipped with a warning. A file is only ever replaced whole (written beside it, then renamed), under
// an exclusive lock on `<file>.lock`, after merging what other processes wrote meanwhile: several
// processes can tune at once. Record lines, tab-separated:
//   op, flags, signature, chosen, name=ms;... (- where a candidate does not apply), feature=value;...
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <utility>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/gemm/gemm.h"
#include "selection/registry.h"

#ifdef PATCHGEMM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#ifndef USE_ROCM
#include <cublasLt.h>
#endif
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>
#define PATCHGEMM_FILE_LOCKS 1
#endif

namespace patchgemm::selection {
namespace {

constexpr const char* kMagic = "# patchgemm autotune records, format 1";
constexpr const char* kEnvironmentPrefix = "# environment: ";

std::atomic<int> g_mode{static_cast<int>(Mode::kHeuristic)};

// What one device's choices are, and where its cache file is.
struct DeviceMemory {
  bool loaded = false;
  std::string path;  // "" without a cache directory: memory only
  std::string environment;
  std::map<std::string, std::string> records;     // key -> record line (the measured ones: the file's)
  std::map<std::string, detail::Remembered> chosen;  // key -> choice
};

struct Memory {
  std::mutex mutex;
  std::string cache_dir, environment;
  std::map<std::pair<int, int>, DeviceMemory> devices;  // by device type and index
};

Memory& memory() {
  static Memory* m = new Memory;  // never destroyed: ops may run during interpreter shutdown
  return *m;
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> parts;
  std::string part;
  std::stringstream in(s);
  while (std::getline(in, part, sep)) parts.push_back(part);
  if (!s.empty() && s.back() == sep) parts.emplace_back();
  return parts;
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (const unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

// ---- the device ----------------------------------------------------------------------------------

struct DeviceInfo {
  std::string name, key;  // key: what its timings depend on besides the software
  std::vector<std::pair<std::string, double>> features;
};

DeviceInfo describe_device(const at::Device& device) {
  DeviceInfo info;
#ifdef PATCHGEMM_WITH_CUDA
  if (device.is_cuda()) {
    const int index = device.index() < 0 ? at::cuda::current_device() : device.index();
    const auto* prop = at::cuda::getDeviceProperties(index);
    int clock_khz = 0, bus_bits = 0, driver = 0, runtime = 0;
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, index);
    cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, index);
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    (void)cudaGetLastError();  // an attribute this runtime lacks reads as 0
    const double bandwidth_gbs = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
    std::ostringstream key;
    key << prop->name << "; cc " << prop->major << "." << prop->minor << "; " << prop->multiProcessorCount
        << " SMs; driver " << driver << "; runtime " << runtime;
#ifndef USE_ROCM
    key << "; cublasLt " << cublasLtGetVersion();
#endif
    info.name = prop->name;
    info.key = key.str();
    info.features = {{"device_sms", prop->multiProcessorCount},
                     {"device_cc", prop->major + prop->minor / 10.0},
                     {"device_l2_mb", prop->l2CacheSize / 1048576.0},
                     {"device_bandwidth_gbs", bandwidth_gbs}};
    return info;
  }
#endif
  info.name = "cpu";
  info.key = "cpu; " + std::to_string(at::get_num_threads()) + " threads";
  info.features = {{"device_sms", static_cast<double>(at::get_num_threads())},
                   {"device_cc", 0.0},
                   {"device_l2_mb", 0.0},
                   {"device_bandwidth_gbs", 0.0}};
  return info;
}

std::string file_name(const std::string& device_name, const std::string& environment) {
  std::string clean;
  for (const char ch : device_name) clean += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '-';
  char hash[17];
  std::snprintf(hash, sizeof hash, "%016llx", static_cast<unsigned long long>(fnv1a(environment)));
  return "autotune-" + clean + "-" + hash + ".tsv";
}

// ---- cache files ---------------------------------------------------------------------------------

// A record line's key (op, flags, signature) and chosen candidate, or false where it does not parse.
bool parse_record(const std::string& line, std::string& key, std::string& chosen) {
  const std::vector<std::string> fields = split(line, '\t');
  if (fields.size() != 6 || fields[0].empty() || fields[3].empty()) return false;
  bool chosen_timed = false;
  for (const auto& item : split(fields[4], ';')) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos || eq == 0) return false;
    const std::string value = item.substr(eq + 1);
    if (value == "-") continue;
    char* end = nullptr;
    const double ms = std::strtod(value.c_str(), &end);
    if (end == value.c_str() || *end != '\0' || !(ms >= 0) || !std::isfinite(ms)) return false;
    chosen_timed = chosen_timed || item.compare(0, eq, fields[3]) == 0;
  }
  if (!chosen_timed) return false;
  key = fields[0] + "\t" + fields[1] + "\t" + fields[2];
  chosen = fields[3];
  return true;
}

// Reads a cache file's records into `records` (keys not there already); warns (unless `quiet`) about
// a file of another environment or lines that do not parse. A missing file is no error.
void read_file(const std::string& path, const std::string& environment, std::map<std::string, std::string>& records,
               bool quiet = false) {
  std::ifstream in(path);
  if (!in) return;
  std::string magic, env_line, line;
  std::getline(in, magic);
  std::getline(in, env_line);
  if (magic != kMagic || env_line != kEnvironmentPrefix + environment) {
    if (quiet) return;
    TORCH_WARN("patchgemm autotune: ignoring the cache file ", path,
               magic == kMagic ? ": it was written for another environment ("
                               : ": it is not an autotune cache file or is corrupt (",
               magic == kMagic ? env_line : magic.substr(0, 60), "); it will be rewritten");
    return;
  }
  int64_t bad = 0;
  while (std::getline(in, line)) {
    std::string key, chosen;
    if (line.empty()) continue;
    if (!parse_record(line, key, chosen)) {
      ++bad;
      continue;
    }
    records.emplace(key, line);
  }
  if (bad > 0 && !quiet) TORCH_WARN("patchgemm autotune: skipped ", bad, " corrupt line(s) of the cache file ", path);
}

void adopt(DeviceMemory& dm, const std::map<std::string, std::string>& records) {
  for (const auto& [key, line] : records) {
    if (!dm.records.emplace(key, line).second) continue;
    std::string k, chosen;
    parse_record(line, k, chosen);
    dm.chosen.emplace(key, detail::Remembered{chosen, "autotune: cached in " + dm.path});
  }
}

#ifdef PATCHGEMM_FILE_LOCKS
// An exclusive lock on `path` while it lives (advisory: every patchgemm process takes it).
class FileLock {
 public:
  explicit FileLock(const std::string& path) : fd_(::open(path.c_str(), O_CREAT | O_RDWR, 0644)) {
    if (fd_ < 0) throw std::runtime_error("cannot open the lock file " + path);
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) throw std::runtime_error("cannot lock " + path);
    }
  }
  ~FileLock() {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_;
};
#endif

// Writes the device's records to its file, merged with what the file holds now (memory's mutex held).
void write_file(DeviceMemory& dm) {
  namespace fs = std::filesystem;
  try {
    fs::create_directories(fs::path(dm.path).parent_path());
#ifdef PATCHGEMM_FILE_LOCKS
    FileLock lock(dm.path + ".lock");
    const std::string tmp = dm.path + ".tmp." + std::to_string(::getpid());
#else
    const std::string tmp = dm.path + ".tmp";
#endif
    std::map<std::string, std::string> on_disk;  // what other processes wrote since (warned on load)
    read_file(dm.path, dm.environment, on_disk, /*quiet=*/true);
    adopt(dm, on_disk);
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << kMagic << "\n" << kEnvironmentPrefix << dm.environment << "\n";
      for (const auto& [key, line] : dm.records) out << line << "\n";
      out.close();
      if (!out) throw std::runtime_error("cannot write " + tmp);
    }
    fs::rename(tmp, dm.path);
  } catch (const std::exception& e) {
    TORCH_WARN_ONCE("patchgemm autotune: cannot write the cache file ", dm.path, " (", e.what(),
                    "); the choices are kept in memory only");
  }
}

// The device's memory, its cache file read on first use (memory's mutex held).
DeviceMemory& device_memory(Memory& m, const at::Device& device) {
  DeviceMemory& dm = m.devices[{static_cast<int>(device.type()), device.index()}];
  if (dm.loaded) return dm;
  dm.loaded = true;
  if (m.cache_dir.empty()) return dm;
  const DeviceInfo info = describe_device(device);
  dm.environment = info.key + "; " + m.environment;
  dm.path = (std::filesystem::path(m.cache_dir) / file_name(info.name, dm.environment)).string();
  std::map<std::string, std::string> on_disk;
  read_file(dm.path, dm.environment, on_disk);
  adopt(dm, on_disk);
  return dm;
}

std::string format_pairs(const std::vector<std::pair<std::string, double>>& pairs, bool negative_is_dash) {
  std::string out;
  char buf[64];
  for (const auto& [name, value] : pairs) {
    if (negative_is_dash && value < 0) {
      std::snprintf(buf, sizeof buf, "-");
    } else {
      std::snprintf(buf, sizeof buf, "%.6g", value);
    }
    out += (out.empty() ? "" : ";") + name + "=" + buf;
  }
  return out;
}

// ---- timing --------------------------------------------------------------------------------------

constexpr int kRounds = 5;
constexpr double kRoundMs = 0.3;  // each function's reps per round fill about this much
constexpr int kMaxReps = 100;

// One function's time over `reps` calls, in ms: GPU time on CUDA, as the benchmarks take it. A spin
// kernel ahead of the calls keeps the GPU busy while the host queues them, so the events measure the
// kernels, not the host's pace; `spin_ms` grows to cover the queuing time. The calls run back to
// back: a write over the L2 before each (to time them with cold operands) leaves dirty lines that the
// call then writes back, charging the candidates that touch the most memory, which on DiT-style
// latents made the slower of two candidates by GPU time look the faster.
double time_reps(const at::Device& device, const std::function<void()>& fn, int reps, double& spin_ms) {
#ifdef PATCHGEMM_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index());
    int clock_khz = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device.index()));
    std::vector<cudaEvent_t> events(2 * reps);
    for (auto& e : events) C10_CUDA_CHECK(cudaEventCreate(&e));
    at::cuda::sleep(static_cast<int64_t>(spin_ms * std::max(clock_khz, 1000)));
    const auto queued = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) {
      C10_CUDA_CHECK(cudaEventRecord(events[2 * i], stream));
      fn();
      C10_CUDA_CHECK(cudaEventRecord(events[2 * i + 1], stream));
    }
    const double host_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - queued).count();
    C10_CUDA_CHECK(cudaEventSynchronize(events.back()));
    double total = 0;
    for (int i = 0; i < reps; ++i) {
      float ms = 0;
      C10_CUDA_CHECK(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]));
      total += ms;
    }
    for (auto& e : events) C10_CUDA_CHECK(cudaEventDestroy(e));
    spin_ms = std::min(std::max(spin_ms, 1.5 * host_ms), 50.0);
    return total;
  }
#endif
  (void)spin_ms;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

namespace detail {

Mode mode() { return static_cast<Mode>(g_mode.load(std::memory_order_relaxed)); }

std::string memory_key(const std::string& op, const std::string& signature) {
  const auto& ctx = at::globalContext();
  std::string key;
  key.reserve(op.size() + signature.size() + 72);
  key.append(op).append("\ttf32 matmul ").append(tf32_allowed(GemmConvention::kMatmul) ? "1" : "0");
  key.append(" conv ").append(tf32_allowed(GemmConvention::kConv) ? "1" : "0");
  key.append(", cudnn.benchmark ").append(ctx.benchmarkCuDNN() ? "1" : "0");
  key.append(", deterministic ").append(ctx.deterministicAlgorithms() ? "1" : "0");
  return key.append("\t").append(signature);
}

std::optional<Remembered> recall(const at::Device& device, const std::string& key) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  const DeviceMemory& dm = device_memory(m, device);
  const auto it = dm.chosen.find(key);
  if (it == dm.chosen.end()) return std::nullopt;
  return it->second;
}

bool remembers_any(const at::Device& device) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  return !device_memory(m, device).chosen.empty();
}

void remember_measured(const ProblemFeatures& f, const std::string& key,
                       const std::vector<std::pair<std::string, double>>& times, const std::string& chosen) {
  auto features = f.values;
  const DeviceInfo info = describe_device(f.device);
  features.insert(features.end(), info.features.begin(), info.features.end());
  const std::string line =
      key + "\t" + chosen + "\t" + format_pairs(times, true) + "\t" + format_pairs(features, false);
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  DeviceMemory& dm = device_memory(m, f.device);
  dm.records[key] = line;
  dm.chosen[key] = {chosen, dm.path.empty() ? "autotune: timed in this process" : "autotune: cached in " + dm.path};
  if (!dm.path.empty()) write_file(dm);
}

void remember_learned(const at::Device& device, const std::string& key, const std::string& name,
                      const std::string& how) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  device_memory(m, device).chosen[key] = {name, how};
}

#ifdef PATCHGEMM_WITH_CUDA
namespace {
// Makes this thread's cuBLAS (and cuBLASLt) handles on `device`, once. Creating a handle allocates
// device memory, which a CUDA-graph capture forbids (cublasCreate fails and the capture is lost),
// and a choice made under capture can be a BLAS candidate that no warm-up run used: one the faster
// candidates leave to it there (ragged groups with host sizes run torch._grouped_mm eagerly, one
// cuBLAS GEMM per group under capture). Every such choice asks capturing_graph in the warm-up too.
void make_blas_handles(const at::Device& device) {
  thread_local uint64_t made = 0;  // a bit per device index
  const int index = device.has_index() ? device.index() : c10::cuda::current_device();
  if (index >= 64 || (made >> index & 1)) return;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  at::cuda::getCurrentCUDABlasHandle();
#ifndef USE_ROCM
  at::cuda::getCurrentCUDABlasLtHandle();
#endif
  made |= uint64_t{1} << index;
}
}  // namespace
#endif

bool capturing_graph(const at::Device& device) {
#ifdef PATCHGEMM_WITH_CUDA
  if (device.is_cuda()) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(at::cuda::getCurrentCUDAStream(device.index()), &status));
    if (status == cudaStreamCaptureStatusNone) make_blas_handles(device);
    return status != cudaStreamCaptureStatusNone;
  }
#endif
  return false;
}

bool host_sync_forbidden(const at::Device& device) {
#ifdef PATCHGEMM_WITH_CUDA
  if (device.is_cuda()) {
    return capturing_graph(device) ||
           c10::cuda::warning_state().get_sync_debug_mode() == c10::cuda::SyncDebugMode::L_ERROR;
  }
#endif
  return false;
}

std::vector<double> time_in_turns(const at::Device& device, const std::vector<std::function<void()>>& fns) {
  std::vector<int> reps(fns.size());
  double spin_ms = 0.2;
  for (size_t i = 0; i < fns.size(); ++i) {
    const double once = time_reps(device, fns[i], 1, spin_ms);
    reps[i] = static_cast<int>(std::clamp(std::ceil(kRoundMs / std::max(once, 1e-4)), 1.0, double(kMaxReps)));
  }
  std::vector<std::vector<double>> samples(fns.size());
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < fns.size(); ++i) {
      samples[i].push_back(time_reps(device, fns[i], reps[i], spin_ms) / reps[i]);
    }
  }
  std::vector<double> medians;
  for (auto& s : samples) {
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    medians.push_back(s[s.size() / 2]);
  }
  return medians;
}

std::vector<std::pair<std::string, double>> device_features(const at::Device& device) {
  return describe_device(device).features;
}

}  // namespace detail

void set_mode(Mode mode, const std::string& cache_dir, const std::string& environment) {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (cache_dir != m.cache_dir || environment != m.environment) {
    m.devices.clear();  // read again from the new place
    m.cache_dir = cache_dir;
    m.environment = environment;
  }
  g_mode = static_cast<int>(mode);
}

std::vector<std::string> autotune_records() {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  std::vector<std::string> lines;
  for (const auto& [where, dm] : m.devices) {
    for (const auto& [key, line] : dm.records) lines.push_back(line);
  }
  return lines;
}

void forget() {
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.devices.clear();
}

}  // namespace patchgemm::selection
