// The learned selector's inference (registry.h: learned_scores). One small MLP per op, trained by
// patchgemm/learned.py on autotune records and installed from Python (set_learned_model):
//   x = (log2(1 + max(v, 0)) - mean) / scale    over the model's features, by name
//   scores = W2 relu(W1 x + b1) + b2            one score per candidate the model knows
// `params` holds mean [F], scale [F], W1 [H, F], b1 [H], W2 [C, H], b2 [C], row-major, in that order.
// A query costs F * H + H * C multiply-adds (about 3,000): a few microseconds, once per signature.
// Scores within the model's unsure gap of the best are ties the model cannot break: the registry
// times those contenders (registry.h, run_learned).
#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "selection/registry.h"

namespace patchgemm::selection {
namespace {

struct Model {
  std::vector<std::string> candidates, features, backends;
  int64_t hidden = 0;
  std::vector<double> mean, scale, w1, b1, w2, b2;
};

struct Models {
  std::mutex mutex;
  std::map<std::string, Model> by_op;
};

std::atomic<double> g_unsure_gap{0.0};
// The time this process may spend timing contenders, and what it has spent (microseconds): new
// signatures without end (a shape that changes every step) then cost their first calls no more.
std::atomic<int64_t> g_timing_budget_us{0}, g_timing_spent_us{0};

Models& models() {
  static Models* m = new Models;  // never destroyed: ops may run during interpreter shutdown
  return *m;
}

// "cpu", "cuda" or "rocm": a model trained on one backend's timings says nothing of another's.
std::string backend_of(const at::Device& device) {
  if (device.is_cpu()) return "cpu";
#ifdef USE_ROCM
  return "rocm";
#else
  return "cuda";
#endif
}

}  // namespace

void set_learned_model(const std::string& op, std::vector<std::string> candidates, std::vector<std::string> features,
                       int64_t hidden, std::vector<double> params, std::vector<std::string> backends) {
  Models& m = models();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (candidates.empty()) {
    m.by_op.erase(op);
    return;
  }
  const int64_t f = static_cast<int64_t>(features.size()), c = static_cast<int64_t>(candidates.size());
  TORCH_CHECK(f > 0 && hidden > 0, "patchgemm learned model for ", op, ": needs features and hidden units, got ", f,
              " and ", hidden);
  const int64_t expected = 2 * f + hidden * f + hidden + c * hidden + c;
  TORCH_CHECK(static_cast<int64_t>(params.size()) == expected, "patchgemm learned model for ", op, ": expected ",
              expected, " parameters for ", f, " features, ", hidden, " hidden units and ", c, " candidates, got ",
              params.size());
  Model model{std::move(candidates), std::move(features), std::move(backends), hidden};
  auto take = [&, at = size_t(0)](int64_t n) mutable {
    std::vector<double> part(params.begin() + at, params.begin() + at + n);
    at += n;
    return part;
  };
  model.mean = take(f);
  model.scale = take(f);
  model.w1 = take(hidden * f);
  model.b1 = take(hidden);
  model.w2 = take(c * hidden);
  model.b2 = take(c);
  for (double s : model.scale) TORCH_CHECK(s > 0, "patchgemm learned model for ", op, ": scales must be positive");
  m.by_op[op] = std::move(model);
}

void set_learned_unsure_gap(double gap, double budget_ms) {
  TORCH_CHECK(std::isfinite(gap) && gap >= 0,
              "patchgemm learned selector: the unsure gap must be finite and >= 0, got ", gap);
  TORCH_CHECK(std::isfinite(budget_ms) && budget_ms >= 0,
              "patchgemm learned selector: the timing budget must be finite and >= 0 ms, got ", budget_ms);
  g_unsure_gap = gap;
  g_timing_budget_us = static_cast<int64_t>(budget_ms * 1000);
  g_timing_spent_us = 0;
}

namespace detail {

double learned_unsure_gap(const at::Device& device) {
  const double gap = g_unsure_gap.load(std::memory_order_relaxed);
  if (gap <= 0 || g_timing_spent_us.load() >= g_timing_budget_us.load()) return 0;
  if (at::globalContext().deterministicAlgorithms() || host_sync_forbidden(device)) return 0;
  return gap;
}

void spent_timing(double ms) { g_timing_spent_us += static_cast<int64_t>(ms * 1000); }

bool learned_model_covers(const std::string& op, const at::Device& device) {
  Models& m = models();
  std::lock_guard<std::mutex> lock(m.mutex);
  const auto it = m.by_op.find(op);
  if (it == m.by_op.end()) return false;
  const std::vector<std::string>& backends = it->second.backends;
  return backends.empty() || std::find(backends.begin(), backends.end(), backend_of(device)) != backends.end();
}

std::vector<double> learned_scores(const std::string& op, const std::vector<std::string>& names,
                                   const ProblemFeatures& f) {
  Models& m = models();
  std::lock_guard<std::mutex> lock(m.mutex);
  const auto it = m.by_op.find(op);
  if (it == m.by_op.end()) return {};
  const Model& model = it->second;
  if (!model.backends.empty() &&
      std::find(model.backends.begin(), model.backends.end(), backend_of(f.device)) == model.backends.end()) {
    return {};  // (learned_model_covers)
  }
  std::map<std::string, double> values(f.values.begin(), f.values.end());
  for (const auto& [name, v] : device_features(f.device)) values[name] = v;
  const size_t nf = model.features.size(), nh = static_cast<size_t>(model.hidden);
  std::vector<double> x(nf), h(nh);
  for (size_t i = 0; i < nf; ++i) {
    const std::string& name = model.features[i];
    const auto v = values.find(name);
    // A candidate this build lacks (the CPU build has no CUDA kernels) neither applies nor is picked.
    if (v == values.end() && (name.rfind("applies:", 0) == 0 || name.rfind("rules_pick:", 0) == 0)) {
      x[i] = (0.0 - model.mean[i]) / model.scale[i];
      continue;
    }
    if (v == values.end()) {
      TORCH_WARN_ONCE("patchgemm learned model for ", op, ": the problem has no feature \"", name,
                      "\" (a model of another version?); using the heuristic");
      return {};
    }
    x[i] = (std::log2(1.0 + std::max(v->second, 0.0)) - model.mean[i]) / model.scale[i];
  }
  for (size_t j = 0; j < nh; ++j) {
    double a = model.b1[j];
    for (size_t i = 0; i < nf; ++i) a += model.w1[j * nf + i] * x[i];
    h[j] = a > 0 ? a : 0;
  }
  std::vector<double> scores(names.size(), -std::numeric_limits<double>::infinity());
  for (size_t c = 0; c < model.candidates.size(); ++c) {
    double s = model.b2[c];
    for (size_t j = 0; j < nh; ++j) s += model.w2[c * nh + j] * h[j];
    for (size_t n = 0; n < names.size(); ++n) {
      if (names[n] == model.candidates[c]) scores[n] = s;
    }
  }
  return scores;
}

}  // namespace detail
}  // namespace patchgemm::selection
