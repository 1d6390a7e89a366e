// Selection: every op runs one implementation out of a table of named candidates, ours and
// PyTorch's own. A candidate says whether it applies to a problem (`supports`, which returns why
// not), and the table's order plus each candidate's `rule` (where the default choice passes over it
// though it applies) pick among those that do: the first supported candidate whose rule accepts the
// problem runs. The last candidate of every table supports every valid problem, so a choice always
// exists.
//
// Around that choice: `force` pins a candidate per op (process-wide; also PATCHGEMM_FORCE="op=name,
// ..."), forcing one that does not apply is an error naming the reason; `explain` records every
// choice with the verdict of every candidate; PATCHGEMM_LOG_DISPATCH=1 logs each new choice once
// per problem signature to stderr. Python reaches all of it through the ops in registration.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
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

namespace detail {
// Registers a table's rows for the listing (tables are namespace-scope statics).
void register_table(std::vector<CandidateInfo> rows);
// The candidate forced for `op` ("" for none): force(), else PATCHGEMM_FORCE.
std::string forced(const std::string& op);
// Whether calls are being explained or logged: only then are all verdicts and the signature made.
bool observed();
// The testing hook's state (set_testing): whether rules apply, and whether `name` is excluded.
bool rules_apply();
bool excluded(const std::string& name);
// Records a choice for explain() and the dispatch log.
void note(const std::string& op, const std::string& signature, bool forced, std::vector<Verdict> verdicts);
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
};

template <typename Problem, typename Result>
class Table {
 public:
  // `signature` names a problem in the log and explain() (shapes, strides, dtype, device, flags).
  Table(std::string op, std::vector<Candidate<Problem, Result>> candidates,
        std::function<std::string(const Problem&)> signature)
      : op_(std::move(op)), candidates_(std::move(candidates)), signature_(std::move(signature)) {
    std::vector<CandidateInfo> rows;
    for (const auto& c : candidates_) rows.push_back({op_, c.name, c.backends, c.conditions});
    detail::register_table(std::move(rows));
  }

  Result run(const Problem& p) const {
    const std::string forced = detail::forced(op_);
    const bool observed = detail::observed();
    std::vector<Verdict> verdicts;
    if (!forced.empty()) {
      const auto& c = find(forced);
      WhyNot why = c.supports(p);
      std::optional<Result> result;
      if (why.empty()) result = c.run(p, /*ruled=*/false, why);
      TORCH_CHECK(result, op_, ": the forced implementation \"", forced, "\" does not apply to this call (",
                  signature_(p), "): ", why);
      if (observed) {
        for (const auto& other : candidates_) {
          verdicts.push_back(other.name == forced ? Verdict{other.name, Verdict::kChosen, "forced"}
                                                  : Verdict{other.name, Verdict::kNotReached, "another is forced"});
        }
        detail::note(op_, signature_(p), true, std::move(verdicts));
      }
      return std::move(*result);
    }
    const bool rules = detail::rules_apply();
    for (size_t i = 0; i < candidates_.size(); ++i) {
      const auto& c = candidates_[i];
      WhyNot why = detail::excluded(c.name) ? "excluded (testing hook)" : c.supports(p);
      if (!why.empty()) {
        if (observed) verdicts.push_back({c.name, Verdict::kUnsupported, std::move(why)});
        continue;
      }
      if (c.rule && rules) why = c.rule(p);
      if (!why.empty()) {
        if (observed) verdicts.push_back({c.name, Verdict::kRuledOut, std::move(why)});
        continue;
      }
      std::optional<Result> result = c.run(p, rules, why);
      if (!result) {
        if (observed) verdicts.push_back({c.name, Verdict::kUnsupported, std::move(why)});
        continue;
      }
      if (observed) {
        verdicts.push_back({c.name, Verdict::kChosen, ""});
        for (size_t j = i + 1; j < candidates_.size(); ++j) {
          const WhyNot later = candidates_[j].supports(p);
          verdicts.push_back(later.empty() ? Verdict{candidates_[j].name, Verdict::kNotReached, c.name + " comes first"}
                                           : Verdict{candidates_[j].name, Verdict::kUnsupported, later});
        }
        detail::note(op_, signature_(p), false, std::move(verdicts));
      }
      return std::move(*result);
    }
    TORCH_CHECK(false, op_, ": no implementation applies to this call (", signature_(p), "); please report it");
  }

 private:
  const Candidate<Problem, Result>& find(const std::string& name) const {
    for (const auto& c : candidates_) {
      if (c.name == name) return c;
    }
    TORCH_CHECK(false, op_, ": no implementation named \"", name, "\"");
  }

  std::string op_;
  std::vector<Candidate<Problem, Result>> candidates_;
  std::function<std::string(const Problem&)> signature_;
};

// A tensor in a signature: dtype[sizes] (strides when not contiguous) and its device.
std::string describe(const char* name, const at::Tensor& t);

// The listing: every candidate of every op, in table order.
std::vector<CandidateInfo> candidates();
// Pins `name` for `op` ("" unpins); returns the previous one. Unknown names are errors.
std::string force(const std::string& op, const std::string& name);
// Testing hook: the default choice without its rules (the first candidate that applies runs), and
// without the candidates named in `excluded` (any op's). Returns nothing; reset with (true, {}).
void set_testing(bool rules, std::vector<std::string> excluded);
// explain(): start recording choices (returns a mark), or stop and return those recorded since the
// mark, one JSON object each. Recordings nest.
int64_t start_recording();
std::vector<std::string> stop_recording(int64_t mark);

}  // namespace patchgemm::selection
