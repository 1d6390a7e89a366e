// Selection: every op runs one implementation out of a table of named candidates, ours and
// PyTorch's own. A candidate says whether it applies to a problem (`supports`, which returns why
// not), and the table's order plus each candidate's `rule` (where the default choice passes over it
// though it applies) pick among those that do: the first supported candidate whose rule accepts the
// problem runs. The last candidate of every table supports every valid problem, so a choice always
// exists.
//
// That is the heuristic mode. Two other modes choose per problem signature, once, and remember the
// choice (set_mode): autotune times every candidate that applies on the first call of a signature
// and keeps the fastest, in memory and in a cache file per device (selection/autotune.cpp); learned
// asks a small model trained on such timings (selection/learned.cpp). Both run the chosen candidate
// without its rule, as it was timed, and fall back to the heuristic where they cannot choose (no
// new choice during CUDA-graph capture, no model for the op).
//
// Around that choice: `force` pins a candidate per op (process-wide; also PATCHGEMM_FORCE="op=name,
// ..."), forcing one that does not apply is an error naming the reason; `explain` records every
// choice with the verdict of every candidate and the mode that chose; PATCHGEMM_LOG_DISPATCH=1 logs
// each new choice once per problem signature to stderr. Python reaches all of it through the ops in
// registration.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// Candidates built from NVIDIA PTX (mma.sync, wgmma, TMA) exist in CUDA builds only; ROCm tables
// have none.
#if defined(PATCHGEMM_WITH_CUDA) && !defined(USE_ROCM)
#define PATCHGEMM_PTX_KERNELS 1
#endif

namespace patchgemm::selection {

// Why a candidate does not apply (or why the rule passes over it); empty when it does.
using WhyNot = std::string;

// One row of `python -m patchgemm kernels`.
struct CandidateInfo {
  std::string op, name, backends, conditions;
};

// The verdict on one candidate for one call.
struct Verdict {
  std::string name;
  enum Kind { kChosen, kUnsupported, kRuledOut, kNotReached } kind = kNotReached;
  std::string reason;
};

// How the default choice is made (set_mode).
enum class Mode { kHeuristic, kAutotune, kLearned };

// What the learned model and the autotune records know of a problem: its device and named sizes
// and flags (raw values; the model takes log2(1 + v)). The device's own properties are added by
// the selection code.
struct ProblemFeatures {
  at::Device device = at::kCPU;
  std::vector<std::pair<std::string, double>> values;
};

// Features on `t`'s device, with its element size and whether it is fp32 (TF32 flags matter then).
inline ProblemFeatures features_on(const at::Tensor& t, std::vector<std::pair<std::string, double>> values) {
  values.emplace_back("dtype_bytes", static_cast<double>(t.element_size()));
  values.emplace_back("fp32", t.scalar_type() == at::kFloat ? 1.0 : 0.0);
  return {t.device(), std::move(values)};
}

namespace detail {
// Registers a table's rows for the listing (tables are namespace-scope statics).
void register_table(std::vector<CandidateInfo> rows);
// The candidate forced for `op` ("" for none): force(), else PATCHGEMM_FORCE.
std::string forced(const std::string& op);
// Whether calls are being explained or logged: only then are all verdicts and the signature made.
bool observed();
// While one lives, this thread's calls are neither explained nor logged (the steps a mode runs
// while it times a choice: not the user's calls).
struct Unobserved {
  Unobserved();
  ~Unobserved();
  Unobserved(const Unobserved&) = delete;
  Unobserved& operator=(const Unobserved&) = delete;
};
// The testing hook's state (set_testing): whether rules apply, and whether `name` is excluded.
bool rules_apply();
bool excluded(const std::string& name);
// Records a choice for explain() and the dispatch log; `how`: "forced", "heuristic", "autotune: ...",
// "learned: ...".
void note(const std::string& op, const std::string& signature, const std::string& how,
          std::vector<Verdict> verdicts);

Mode mode();
// The key of a problem in the autotune / learned memory: op, signature and the flags that change
// which candidate wins (TF32, reduced-precision reductions, determinism).
std::string memory_key(const std::string& op, const std::string& signature);
// A choice remembered for `key` on `device` (autotune loads the device's cache file on first use):
// the candidate and how it was made, for explain().
struct Remembered {
  std::string name, how;
};
std::optional<Remembered> recall(const at::Device& device, const std::string& key);
// Whether any choice is remembered on `device` (a cheap check before building a problem's key).
bool remembers_any(const at::Device& device);
// Remembers a measured choice (and writes it to the device's cache file): every candidate's time
// in ms, negative where it does not apply.
void remember_measured(const ProblemFeatures& f, const std::string& key,
                       const std::vector<std::pair<std::string, double>>& times, const std::string& chosen);
// Remembers a learned choice (memory only), made `how` ("learned: predicted ...", "learned: timed ...").
void remember_learned(const at::Device& device, const std::string& key, const std::string& name,
                      const std::string& how);
// Whether `device`'s current stream is capturing a CUDA graph (then nothing is timed, and no
// new choice runs a candidate the graph would not need). Where it is not, it makes this thread's
// BLAS handles first, so that a capture that chooses otherwise need not create one.
bool capturing_graph(const at::Device& device);
// Whether a host sync on `device` must be avoided: a CUDA graph is being captured, or
// torch.cuda.set_sync_debug_mode("error") makes every sync raise. Candidates that read GPU data on
// the host decline then, so that a table with a sync-free candidate runs it.
bool host_sync_forbidden(const at::Device& device);
// Each function's time in ms (median over rounds in which they take turns), on `device`'s current
// stream (CUDA events) or the host's clock.
std::vector<double> time_in_turns(const at::Device& device, const std::vector<std::function<void()>>& fns);
// The device's properties as features: SMs, compute capability, L2 size, memory bandwidth.
std::vector<std::pair<std::string, double>> device_features(const at::Device& device);
// The learned model's score of each of `names` for the problem (higher: expected faster; -inf
// for a name the model does not know), or empty without a model for `op`.
std::vector<double> learned_scores(const std::string& op, const std::vector<std::string>& names,
                                   const ProblemFeatures& f);
// Whether a learned model for `op` covers `device`'s backend (else learned_scores is empty).
bool learned_model_covers(const std::string& op, const at::Device& device);
// The learned mode times the candidates scored within this gap of the best (0: never; set with the
// model, set_learned_unsure_gap) where timing is allowed on `device`: not while a CUDA graph is
// captured or host syncs are forbidden, nor under torch.use_deterministic_algorithms(True), where
// the prediction alone decides, the same in every process; nor once the timing budget is spent.
double learned_unsure_gap(const at::Device& device);
// Counts `ms` of the learned mode's timing against its budget.
void spent_timing(double ms);
}  // namespace detail

template <typename Problem, typename Result>
struct Candidate {
  std::string name;        // stable: force(op=name), explain(), the tests
  std::string backends;    // where it can run, e.g. "cuda sm_90a", "cpu cuda rocm"
  std::string conditions;  // what it needs, in words (the listing)
  // The checks that need no work: dtype, device, layout. A kernel's finer conditions (alignment,
  // shared memory, index ranges) are checked by `run`, which then declines with the reason.
  std::function<WhyNot(const Problem&)> supports;
  // Where the default choice passes over it though it applies (measured slower there); none: never.
  std::function<WhyNot(const Problem&)> rule;
  // The result, or nullopt with the reason in `why` where it does not apply after all. `ruled`: the
  // default choice (false when forced), for kernels whose rule needs their own tiling.
  std::function<std::optional<Result>(const Problem&, bool ruled, WhyNot& why)> run;
  // Whether it reuses what an earlier step of the call left in the problem (patch_embed's
  // backward: the forward's patch matrix). Such a candidate is another's computation with a step
  // already done, so wherever it applies and its rule accepts the problem it runs, in every mode
  // but forcing; the modes never time, predict or remember it (a signature does not say whether
  // the earlier work exists).
  bool reuses = false;
  // Whether its run leaves work that a later step reuses where one follows (FollowUp: patch_embed's
  // patch matrix, which its weight gradient multiplies without gathering x again).
  bool leaves_reusable = false;
};

// The step that follows a call and costs more or less by the candidate the call ran (patch_embed's
// forward in training: its weight gradient, one GEMM on a patch matrix the forward left, or a
// gather or a fused kernel of its own). Given a problem: that step, run after a candidate's result
// (`reusable`: the candidate is marked leaves_reusable), or an empty function where none follows.
// Where one follows, the autotune and learned modes time each candidate together with it, and the
// learned mode times, beside the contenders it cannot tell apart, every candidate that leaves
// reusable work: a prediction of the call alone does not see what that work saves.
template <typename Problem, typename Result>
using FollowUp = std::function<std::function<void(const Result&, bool reusable)>(const Problem&)>;

template <typename Problem, typename Result>
class Table {
 public:
  // `signature` names a problem in the log and explain() (shapes, strides, dtype, device, flags);
  // `features` describes it to the autotune records and the learned model.
  // `follow_up`: where the modes time a call with the step after it (FollowUp).
  Table(std::string op, std::vector<Candidate<Problem, Result>> candidates,
        std::function<std::string(const Problem&)> signature, std::function<ProblemFeatures(const Problem&)> features,
        FollowUp<Problem, Result> follow_up = {})
      : op_(std::move(op)),
        candidates_(std::move(candidates)),
        signature_(std::move(signature)),
        features_(std::move(features)),
        follow_up_(std::move(follow_up)) {
    std::vector<CandidateInfo> rows;
    for (const auto& c : candidates_) {
      rows.push_back({op_, c.name, c.backends, c.conditions});
      names_.push_back(c.name);
      has_reusing_ = has_reusing_ || c.reuses;
    }
    detail::register_table(std::move(rows));
  }

  Result run(const Problem& p) const {
    const std::string forced = detail::forced(op_);
    if (!forced.empty()) return run_forced(p, forced);
    if (has_reusing_) {
      if (std::optional<Result> result = run_reusing(p)) return std::move(*result);
    }
    std::string fallback;  // why the mode's own choice was not made
    const Mode mode = detail::mode();
    if (mode != Mode::kHeuristic) {
      std::optional<Result> result = run_chosen_by_mode(p, mode, fallback);
      if (result) return std::move(*result);
    }
    return run_heuristic(p, fallback.empty() ? "heuristic" : "heuristic (" + fallback + ")");
  }

  // Whether this call's choice is `name`, settled without running anything: forced, or (in the
  // heuristic mode) the first candidate that applies and whose rule accepts the problem. The caller
  // relies on `name` never declining in its run. If so, the choice is noted for explain() as made
  // "forced; <how>" or "heuristic; <how>", and the caller runs `name`'s computation itself.
  bool settled_on(const Problem& p, const std::string& name, const std::string& how) const {
    const std::string forced = detail::forced(op_);
    if (!forced.empty()) {
      if (forced != name || !why_not(*find(forced, /*required=*/true), p).empty()) return false;
      if (detail::observed()) note_single(p, name, "forced; " + how, "another is forced");
      return true;
    }
    if (detail::mode() != Mode::kHeuristic) return false;
    const bool rules = detail::rules_apply(), observed = detail::observed();
    std::vector<Verdict> verdicts;
    for (size_t i = 0; i < candidates_.size(); ++i) {
      const auto& c = candidates_[i];
      WhyNot why;
      const Verdict::Kind kind = screen(c, p, rules, why);
      if (kind == Verdict::kChosen) {  // the heuristic would run c first (which, were it not `name`, may decline)
        if (c.name != name) return false;
        if (observed) {
          verdicts.push_back({c.name, Verdict::kChosen, ""});
          add_later_verdicts(i, p, verdicts);
          detail::note(op_, signature_(p), "heuristic; " + how, std::move(verdicts));
        }
        return true;
      }
      if (observed) verdicts.push_back({c.name, kind, std::move(why)});
    }
    return false;
  }

 private:
  using Candidates = std::vector<Candidate<Problem, Result>>;

  Result run_forced(const Problem& p, const std::string& forced) const {
    const auto& c = *find(forced, /*required=*/true);
    WhyNot why = c.supports(p);
    std::optional<Result> result;
    if (why.empty()) result = c.run(p, /*ruled=*/false, why);
    TORCH_CHECK(result, op_, ": the forced implementation \"", forced, "\" does not apply to this call (",
                signature_(p), "): ", why);
    if (detail::observed()) note_single(p, c.name, "forced", "another is forced");
    return std::move(*result);
  }

  // The first candidate that reuses earlier work (Candidate::reuses), applies and is not ruled out,
  // run; nullopt where none does.
  std::optional<Result> run_reusing(const Problem& p) const {
    const bool rules = detail::rules_apply();
    for (const auto& c : candidates_) {
      if (!c.reuses) continue;
      WhyNot why;
      std::optional<Result> result;
      if (screen(c, p, rules, why) == Verdict::kChosen) result = c.run(p, rules, why);
      if (!result) continue;
      if (detail::observed()) note_single(p, c.name, "reused: " + c.conditions, c.name + " reuses earlier work");
      return result;
    }
    return std::nullopt;
  }

  // The heuristic's choice, noted for explain() as made `how`.
  Result run_heuristic(const Problem& p, const std::string& how) const {
    const bool observed = detail::observed();
    std::vector<Verdict> verdicts;
    auto [result, chosen] = run_rules(p, observed ? &verdicts : nullptr);
    if (observed) detail::note(op_, signature_(p), how, std::move(verdicts));
    return std::move(result);
  }

  // The heuristic's choice: the first supported candidate, in table order, whose rule accepts the
  // problem and whose run does not decline. Its result and index; every candidate's verdict goes to
  // `verdicts` where given.
  std::pair<Result, size_t> run_rules(const Problem& p, std::vector<Verdict>* verdicts) const {
    const bool rules = detail::rules_apply();
    for (size_t i = 0; i < candidates_.size(); ++i) {
      const auto& c = candidates_[i];
      WhyNot why;
      const Verdict::Kind kind = screen(c, p, rules, why);
      if (kind != Verdict::kChosen) {
        if (verdicts) verdicts->push_back({c.name, kind, std::move(why)});
        continue;
      }
      std::optional<Result> result = c.run(p, rules, why);
      if (!result) {
        if (verdicts) verdicts->push_back({c.name, Verdict::kUnsupported, std::move(why)});
        continue;
      }
      if (verdicts) {
        verdicts->push_back({c.name, Verdict::kChosen, ""});
        add_later_verdicts(i, p, *verdicts);
      }
      return {std::move(*result), i};
    }
    TORCH_CHECK(false, op_, ": no implementation applies to this call (", signature_(p), "); please report it");
  }

  // The heuristic's verdict on `c` before running it: kUnsupported, or kRuledOut by its rule (where
  // `rules` apply), with the reason in `why`; kChosen where it would run `c`.
  Verdict::Kind screen(const Candidate<Problem, Result>& c, const Problem& p, bool rules, WhyNot& why) const {
    why = why_not(c, p);
    if (!why.empty()) return Verdict::kUnsupported;
    if (c.rule && rules) why = c.rule(p);
    return why.empty() ? Verdict::kChosen : Verdict::kRuledOut;
  }

  // explain()'s verdicts on the candidates after the chosen one, `chosen`: not reached, or unsupported.
  void add_later_verdicts(size_t chosen, const Problem& p, std::vector<Verdict>& verdicts) const {
    for (size_t j = chosen + 1; j < candidates_.size(); ++j) {
      const WhyNot why = why_not(candidates_[j], p);
      verdicts.push_back(why.empty() ? Verdict{candidates_[j].name, Verdict::kNotReached,
                                               candidates_[chosen].name + " comes first"}
                                     : Verdict{candidates_[j].name, Verdict::kUnsupported, why});
    }
  }

  // Autotune or learned: the remembered choice for this signature, else a new one (remembered).
  // nullopt, with the reason in `fallback`, where the mode cannot choose.
  // (`fallback` is filled where the call is observed only: it is explain()'s and the log's.)
  std::optional<Result> run_chosen_by_mode(const Problem& p, Mode mode, std::string& fallback) const {
    const at::Device device = p.device();
    // Learned without a model for this op here: on a GPU, its candidates are timed once per
    // signature (run_timed_without_model); elsewhere, with no remembered choice, the
    // heuristic runs, without the signature and features a new choice needs (their cost recurs on
    // every call). (CPU timings spread too widely from run to run to choose by.)
    const bool covered = mode == Mode::kLearned && detail::learned_model_covers(op_, device);
    const bool times_without_model = mode == Mode::kLearned && !covered && !device.is_cpu() &&
                                     detail::learned_unsure_gap(device) > 0;
    if (mode == Mode::kLearned && !covered && !times_without_model && !detail::remembers_any(device)) {
      if (detail::observed()) fallback = "learned: no usable model for " + op_;
      return std::nullopt;
    }
    const std::string signature = signature_(p);
    const std::string key = detail::memory_key(op_, signature);
    if (const auto remembered = detail::recall(device, key)) {
      // A choice of another build may name a candidate this one lacks or that no longer applies.
      const auto* c = find(remembered->name, /*required=*/false);
      WhyNot why = c ? why_not_in_modes(*c, p) : "not in this build";
      std::optional<Result> result;
      if (why.empty()) result = c->run(p, /*ruled=*/false, why);
      if (result) {
        if (detail::observed()) note_single(p, c->name, remembered->how, "not chosen for this signature");
        return result;
      }
      fallback = "the remembered \"" + remembered->name + "\" does not apply: " + why;
      return std::nullopt;
    }
    // A new choice. Both modes record what the heuristic runs, by running it (a kernel may decline
    // its problem). A CUDA graph being captured would keep that extra run, and autotune cannot time
    // there: the heuristic chooses instead, and nothing is remembered.
    if (detail::capturing_graph(device)) {
      fallback = std::string(mode == Mode::kAutotune ? "autotune: no timing" : "learned: no new choice") +
                 " during CUDA-graph capture";
      return std::nullopt;
    }
    std::vector<Verdict> verdicts;
    auto [heuristic_result, heuristic_pick] = run_rules(p, detail::observed() ? &verdicts : nullptr);
    ProblemFeatures f = features_(p);
    add_rule_features(p, heuristic_pick, f);
    if (mode == Mode::kAutotune) return run_timed(p, f, signature, key, all_candidates(), /*learned=*/false);
    const std::vector<double> scores = detail::learned_scores(op_, names_, f);
    if (scores.empty() && times_without_model) {
      if (std::optional<Result> result = run_timed_without_model(p, f, signature, key, heuristic_pick)) {
        return std::move(*result);
      }
    }
    if (scores.empty()) {  // the heuristic's choice stands (its result is at hand)
      if (detail::observed()) {
        detail::note(op_, signature, "heuristic (learned: no usable model for " + op_ + ")", std::move(verdicts));
      }
      return heuristic_result;
    }
    return run_learned(p, scores, f, signature, key, heuristic_pick, std::move(heuristic_result));
  }

  std::vector<size_t> all_candidates() const {
    std::vector<size_t> all(candidates_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = i;
    return all;
  }

  // Times the candidates `which` (indices, ascending or not) that apply (each runs once first: a
  // kernel declining in `run`, or running out of memory, drops out; any other error propagates),
  // remembers the fastest and returns its result. Autotune times every candidate and keeps the
  // times (and the cache file); the learned mode times the contenders it cannot tell apart and
  // keeps the choice in memory.
  std::optional<Result> run_timed(const Problem& p, const ProblemFeatures& f, const std::string& signature,
                                  const std::string& key, const std::vector<size_t>& which, bool learned,
                                  std::optional<size_t> rules_pick = std::nullopt) const {
    const bool without_model = rules_pick.has_value();  // (learned mode, an op its model does not cover)
    std::vector<std::string> why(candidates_.size());
    std::vector<bool> asked(candidates_.size(), false);
    std::vector<size_t> timed;
    std::vector<std::function<void()>> calls;
    const auto after = follow_up_ ? follow_up_(p) : std::function<void(const Result&, bool)>();
    for (size_t i : which) {
      const auto& c = candidates_[i];
      asked[i] = true;
      why[i] = why_not_in_modes(c, p);
      if (!why[i].empty()) continue;
      try {
        std::optional<Result> result = c.run(p, /*ruled=*/false, why[i]);
        if (!result) continue;
        if (after) {  // (its own choices made here, before the timing)
          const detail::Unobserved quiet;
          after(*result, c.leaves_reusable);
        }
      } catch (const c10::OutOfMemoryError& e) {  // its workspace: another candidate may still fit
        why[i] = std::string("out of memory: ") + e.what_without_backtrace();
        continue;
      }
      timed.push_back(i);
      calls.push_back([&p, &c, &after] {
        WhyNot unused;
        std::optional<Result> result = c.run(p, /*ruled=*/false, unused);
        if (after && result) {
          const detail::Unobserved quiet;
          after(*result, c.leaves_reusable);
        }
      });
    }
    if (timed.empty()) return std::nullopt;  // the heuristic's error names the problem
    const std::vector<double> ms = detail::time_in_turns(f.device, calls);
    const size_t fastest = std::min_element(ms.begin(), ms.end()) - ms.begin();
    size_t best = timed[fastest];
    if (learned) {
      // Toward PyTorch's own path: the learned mode takes the fastest ATen candidate where it is
      // within kTowardPyTorch of the fastest, or kTowardPyTorchMs. Calls of a few microseconds time
      // a few per cent apart from one process to the next, each timed call's events count the gaps
      // between its kernels (PyTorch's path often launches two), and there PyTorch's path costs
      // exactly what PyTorch's does.
      const double within = std::max(ms[fastest] * (1 + kTowardPyTorch), ms[fastest] + kTowardPyTorchMs);
      double aten_ms = -1;
      for (size_t t = 0; t < timed.size(); ++t) {
        if (!pytorch_path(candidates_[timed[t]]) || ms[t] > within) continue;
        if (aten_ms < 0 || ms[t] < aten_ms) best = timed[t], aten_ms = ms[t];
      }
      // Without a model, the rules' pick likewise stands unless another is faster by more than
      // that: a timing that cannot tell two candidates apart changes nothing.
      for (size_t t = 0; t < timed.size() && aten_ms < 0 && rules_pick; ++t) {
        if (timed[t] == *rules_pick && ms[t] <= within) best = timed[t];
      }
    }
    std::vector<double> time_of(candidates_.size(), -1.0);
    for (size_t t = 0; t < timed.size(); ++t) time_of[timed[t]] = ms[t];
    if (learned) {
      detail::remember_learned(f.device, key, candidates_[best].name,
                               without_model ? "learned: no model; timed earlier in this process"
                                             : "learned: contenders timed earlier in this process");
    } else {
      std::vector<std::pair<std::string, double>> times;
      for (size_t i = 0; i < candidates_.size(); ++i) times.emplace_back(candidates_[i].name, time_of[i]);
      detail::remember_measured(f, key, times, candidates_[best].name);
    }
    WhyNot unused;
    std::optional<Result> result = candidates_[best].run(p, /*ruled=*/false, unused);
    TORCH_CHECK(result, op_, ": the timed \"", candidates_[best].name, "\" declined on its second run");
    if (detail::observed()) {
      std::vector<Verdict> verdicts;
      for (size_t i = 0; i < candidates_.size(); ++i) {
        if (time_of[i] >= 0) {
          verdicts.push_back({candidates_[i].name, i == best ? Verdict::kChosen : Verdict::kRuledOut,
                              format_ms(time_of[i])});
        } else if (WhyNot reason = asked[i] ? why[i] : why_not_in_modes(candidates_[i], p); !reason.empty()) {
          verdicts.push_back({candidates_[i].name, Verdict::kUnsupported, reason});
        } else {
          verdicts.push_back({candidates_[i].name, Verdict::kNotReached, "scored lower than the contenders"});
        }
      }
      std::string how = !learned       ? "autotune: timed now"
                        : without_model ? "learned: no model for " + op_ + "; every candidate timed now"
                                        : "learned: unsure between the contenders, timed now";
      if (after) how += " with the step that follows";
      if (best != timed[fastest]) {
        how += std::string(pytorch_path(candidates_[best]) ? "; PyTorch's path" : "; the rules' pick") + ", within " +
               std::to_string(static_cast<int>(kTowardPyTorch * 100 + 0.5)) +
               "% or " + std::to_string(static_cast<int>(kTowardPyTorchMs * 1000 + 0.5)) + " us of the fastest";
      }
      detail::note(op_, signature, how, std::move(verdicts));
    }
    return result;
  }

  // The best-scored candidate that applies and runs (the heuristic's pick has run: its result is
  // taken as it is); remembered in memory. Where others that apply score within the unsure gap of
  // the best, the model cannot tell them apart: those contenders are timed instead (run_timed), with
  // PyTorch's own paths and, where a step follows, every candidate that leaves it reusable work.
  Result run_learned(const Problem& p, const std::vector<double>& scores, const ProblemFeatures& f,
                     const std::string& signature, const std::string& key, size_t heuristic_pick,
                     Result heuristic_result) const {
    std::vector<size_t> order = all_candidates();
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scores[a] > scores[b]; });
    if (const double gap = detail::learned_unsure_gap(f.device); gap > 0) {
      const bool followed = follow_up_ && follow_up_(p);
      // Where unsure (more than one contender), PyTorch's own paths that apply are timed too,
      // however they score: the choice then loses to PyTorch's path only by what timing misjudges.
      // The rules' pick is a contender where the model does not know it (-inf: a candidate newer
      // than the model's records), so a new kernel is taken where timing finds it faster.
      std::vector<size_t> contenders, pytorch_paths;
      for (size_t i : order) {
        if (!why_not_in_modes(candidates_[i], p).empty()) continue;
        const bool close = contenders.empty() || scores[i] >= scores[contenders.front()] - gap;
        const bool unknown_pick = i == heuristic_pick && scores[i] == -std::numeric_limits<double>::infinity();
        if (close || unknown_pick || (followed && candidates_[i].leaves_reusable)) {
          contenders.push_back(i);
        } else if (pytorch_path(candidates_[i])) {
          pytorch_paths.push_back(i);
        }
      }
      if (contenders.size() > 1) {
        contenders.insert(contenders.end(), pytorch_paths.begin(), pytorch_paths.end());
        const auto start = std::chrono::steady_clock::now();
        std::optional<Result> result = run_timed(p, f, signature, key, contenders, /*learned=*/true);
        const std::chrono::duration<double, std::milli> spent = std::chrono::steady_clock::now() - start;
        detail::spent_timing(spent.count());
        if (result) return std::move(*result);
      }
    }
    // The candidates scored above the heuristic's pick are tried in order; reaching the pick, its
    // result (in hand) is taken.
    for (size_t i : order) {
      if (i == heuristic_pick) break;
      const auto& c = candidates_[i];
      WhyNot why = why_not_in_modes(c, p);
      if (!why.empty()) continue;
      std::optional<Result> result = c.run(p, /*ruled=*/false, why);
      if (!result) continue;
      remember_predicted(p, f.device, key, c.name);
      return std::move(*result);
    }
    remember_predicted(p, f.device, key, candidates_[heuristic_pick].name);
    return heuristic_result;
  }

  // Learned mode for an op without a model: every candidate that applies timed, as autotune does
  // (within the learned mode's timing budget, remembered in memory only), PyTorch's own path taken
  // where it is about as fast, else the rules' pick where it is (run_timed's leans). The rules,
  // fitted to the shapes they were written for, then decide nothing a timing can: on no other shape
  // does the choice lose to PyTorch's path by more than timing misjudges. nullopt where fewer than
  // two apply.
  std::optional<Result> run_timed_without_model(const Problem& p, const ProblemFeatures& f,
                                                const std::string& signature, const std::string& key,
                                                size_t rules_pick) const {
    std::vector<size_t> contenders;
    for (size_t i : all_candidates()) {
      if (why_not_in_modes(candidates_[i], p).empty()) contenders.push_back(i);
    }
    if (contenders.size() < 2) return std::nullopt;
    const auto start = std::chrono::steady_clock::now();
    std::optional<Result> result = run_timed(p, f, signature, key, contenders, /*learned=*/true, rules_pick);
    const std::chrono::duration<double, std::milli> spent = std::chrono::steady_clock::now() - start;
    detail::spent_timing(spent.count());
    return result;
  }

  void remember_predicted(const Problem& p, const at::Device& device, const std::string& key,
                          const std::string& name) const {
    detail::remember_learned(device, key, name, "learned: predicted earlier in this process");
    if (detail::observed()) note_single(p, name, "learned: predicted now", "scored lower");
  }

  // Adds, per candidate, whether it applies (its `supports`) and whether it is the one the heuristic
  // runs (`pick`): the learned model starts from what the heuristic knows.
  void add_rule_features(const Problem& p, size_t pick, ProblemFeatures& f) const {
    for (size_t i = 0; i < candidates_.size(); ++i) {
      const auto& c = candidates_[i];
      f.values.emplace_back("applies:" + c.name, why_not_in_modes(c, p).empty() ? 1.0 : 0.0);
      f.values.emplace_back("rules_pick:" + c.name, i == pick ? 1.0 : 0.0);
    }
  }

  WhyNot why_not(const Candidate<Problem, Result>& c, const Problem& p) const {
    return detail::excluded(c.name) ? "excluded (testing hook)" : c.supports(p);
  }

  // why_not for the autotune and learned modes, which never offer a candidate that reuses earlier
  // work (Candidate::reuses).
  WhyNot why_not_in_modes(const Candidate<Problem, Result>& c, const Problem& p) const {
    return c.reuses ? "reuses earlier work: taken by its rule, never by a mode" : why_not(c, p);
  }

  // explain()'s record of a choice made without trying the others: their verdicts say only
  // whether they apply.
  void note_single(const Problem& p, const std::string& chosen, const std::string& how,
                   const std::string& applies_but) const {
    std::vector<Verdict> verdicts;
    for (const auto& c : candidates_) {
      if (c.name == chosen) {
        verdicts.push_back({c.name, Verdict::kChosen, ""});
      } else {
        const WhyNot why = why_not(c, p);
        verdicts.push_back(why.empty() ? Verdict{c.name, Verdict::kNotReached, applies_but}
                                       : Verdict{c.name, Verdict::kUnsupported, why});
      }
    }
    detail::note(op_, signature_(p), how, std::move(verdicts));
  }

  // PyTorch's own path (an ATen candidate: the op PyTorch would run, or its usual rewrite).
  static bool pytorch_path(const Candidate<Problem, Result>& c) { return c.name.rfind("aten_", 0) == 0; }

  static constexpr double kTowardPyTorch = 0.05;
  static constexpr double kTowardPyTorchMs = 0.001;

  static std::string format_ms(double ms) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.4f ms", ms);
    return buf;
  }

  const Candidate<Problem, Result>* find(const std::string& name, bool required) const {
    for (const auto& c : candidates_) {
      if (c.name == name) return &c;
    }
    TORCH_CHECK(!required, op_, ": no implementation named \"", name, "\"");
    return nullptr;
  }

  std::string op_;
  Candidates candidates_;
  std::vector<std::string> names_;
  std::function<std::string(const Problem&)> signature_;
  std::function<ProblemFeatures(const Problem&)> features_;
  FollowUp<Problem, Result> follow_up_;
  bool has_reusing_ = false;  // a candidate reuses earlier work (run_reusing)
};

// A tensor in a signature: dtype[sizes] (strides when not contiguous) and its device.
std::string describe(const char* name, const at::Tensor& t);

// Builds a signature as std::ostringstream would print it (sizes as "[1, 3, 224]", devices as
// "cuda:0"), at a fraction of its cost: the autotune and learned modes key every call by one.
class Text {
 public:
  Text& operator<<(const char* s) { text_ += s; return *this; }
  Text& operator<<(const std::string& s) { text_ += s; return *this; }
  Text& operator<<(int64_t v);
  Text& operator<<(c10::IntArrayRef v);
  Text& operator<<(const at::Device& d);
  const std::string& str() const { return text_; }

 private:
  std::string text_;
};

// The listing: every candidate of every op, in table order.
std::vector<CandidateInfo> candidates();
// Pins `name` for `op` ("" unpins); returns the previous one. Unknown names are errors.
std::string force(const std::string& op, const std::string& name);
// The selection mode, and where autotune keeps its cache files ("" for none: memory only) with the
// software part of their key (torch, cuDNN, patchgemm versions; the device part is added here).
void set_mode(Mode mode, const std::string& cache_dir, const std::string& environment);
// The measured records held (this process's and those read from cache files), one line each.
std::vector<std::string> autotune_records();
// Forgets every remembered choice (the cache files stay).
void forget();
// Installs the learned model of `op` (selection/learned.cpp has the layout of `params`); an empty
// `candidates` removes it. It scores problems on the `backends` ("cpu", "cuda", "rocm") whose records
// trained it (empty: every backend); elsewhere the heuristic chooses.
void set_learned_model(const std::string& op, std::vector<std::string> candidates, std::vector<std::string> features,
                       int64_t hidden, std::vector<double> params, std::vector<std::string> backends);
// The learned mode's unsure gap (detail::learned_unsure_gap; 0 never times) and the time in ms this
// process may spend timing (from now).
void set_learned_unsure_gap(double gap, double budget_ms);
// Testing hook: the default choice without its rules (the first candidate that applies runs), and
// without the candidates named in `excluded` (any op's). Returns nothing; reset with (true, {}).
void set_testing(bool rules, std::vector<std::string> excluded);
// explain(): start recording choices (returns a mark), or stop and return those recorded since the
// mark, one JSON object each. Recordings nest.
int64_t start_recording();
std::vector<std::string> stop_recording(int64_t mark);

}  // namespace patchgemm::selection
