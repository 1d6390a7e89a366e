#include "selection/registry.h"

#include <atomic>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

namespace patchgemm::selection {
namespace {

// All state is process-wide: backward runs on autograd's threads, and a force() or explain() around
// a training step must see those calls too.
struct State {
  std::mutex mutex;
  std::vector<CandidateInfo> rows;             // every table, in registration order
  std::map<std::string, std::string> forced;   // op -> candidate
  bool env_read = false;
  std::vector<std::string> records;            // explain()'s, while recording
  std::set<std::string> logged;                // signatures already logged
  std::set<std::string> excluded;              // set_testing's
};

State& state() {
  static State* s = new State;  // never destroyed: ops may run during interpreter shutdown
  return *s;
}

std::atomic<bool> g_any_forced{true};  // until PATCHGEMM_FORCE has been read
std::atomic<int> g_recording{0};
std::atomic<bool> g_rules{true}, g_any_excluded{false};

bool log_dispatch() {
  static const bool enabled = [] {
    const char* v = std::getenv("PATCHGEMM_LOG_DISPATCH");
    return v && *v && std::string(v) != "0";
  }();
  return enabled;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", ch);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out + "\"";
}

const char* kind_name(Verdict::Kind kind) {
  switch (kind) {
    case Verdict::kChosen: return "chosen";
    case Verdict::kUnsupported: return "unsupported";
    case Verdict::kRuledOut: return "passed over";
    default: return "not reached";
  }
}

// Checks that `op` has a candidate `name` (state's mutex held).
void check_known(const State& s, const std::string& op, const std::string& name, const char* source) {
  bool op_known = false;
  std::string names;
  for (const auto& row : s.rows) {
    if (row.op != op) continue;
    op_known = true;
    if (row.name == name) return;
    names += (names.empty() ? "" : ", ") + row.name;
  }
  if (!op_known) {
    std::set<std::string> ops;
    for (const auto& row : s.rows) ops.insert(row.op);
    std::string all;
    for (const auto& o : ops) all += (all.empty() ? "" : ", ") + o;
    TORCH_CHECK(false, source, ": no op named \"", op, "\"; the ops are ", all);
  }
  TORCH_CHECK(false, source, ": ", op, " has no implementation named \"", name, "\"; it has ", names);
}

// Reads PATCHGEMM_FORCE="op=name,..." once (state's mutex held).
void read_env(State& s) {
  if (s.env_read) return;
  s.env_read = true;
  if (const char* env = std::getenv("PATCHGEMM_FORCE")) {
    std::stringstream items(env);
    std::string item;
    while (std::getline(items, item, ',')) {
      if (item.empty()) continue;
      const size_t eq = item.find('=');
      TORCH_CHECK(eq != std::string::npos && eq > 0 && eq + 1 < item.size(),
                  "PATCHGEMM_FORCE: expected op=name items separated by commas, got \"", item, "\" in \"", env,
                  "\"");
      const std::string op = item.substr(0, eq), name = item.substr(eq + 1);
      check_known(s, op, name, "PATCHGEMM_FORCE");
      s.forced[op] = name;
    }
  }
  g_any_forced = !s.forced.empty();
}

}  // namespace

namespace detail {

void register_table(std::vector<CandidateInfo> rows) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& row : rows) s.rows.push_back(std::move(row));
}

std::string forced(const std::string& op) {
  if (!g_any_forced.load(std::memory_order_relaxed)) return {};
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  read_env(s);
  const auto it = s.forced.find(op);
  return it == s.forced.end() ? std::string() : it->second;
}

bool rules_apply() { return g_rules.load(std::memory_order_relaxed); }

bool excluded(const std::string& name) {
  if (!g_any_excluded.load(std::memory_order_relaxed)) return false;
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.excluded.count(name) > 0;
}

thread_local int t_unobserved = 0;  // Unobserved scopes open on this thread

bool observed() { return t_unobserved == 0 && (g_recording.load(std::memory_order_relaxed) > 0 || log_dispatch()); }

Unobserved::Unobserved() { ++t_unobserved; }
Unobserved::~Unobserved() { --t_unobserved; }

void note(const std::string& op, const std::string& signature, const std::string& how,
          std::vector<Verdict> verdicts) {
  std::string chosen;
  for (const auto& v : verdicts) {
    if (v.kind == Verdict::kChosen) chosen = v.name;
  }
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (log_dispatch() && s.logged.insert(op + signature).second) {
    std::fprintf(stderr, "patchgemm: %s %s -> %s%s\n", op.c_str(), signature.c_str(), chosen.c_str(),
                 how == "heuristic" ? "" : (" (" + how + ")").c_str());
  }
  if (g_recording.load() == 0) return;
  std::string json = "{\"op\": " + json_string(op) + ", \"signature\": " + json_string(signature) +
                     ", \"chosen\": " + json_string(chosen) + ", \"how\": " + json_string(how) +
                     ", \"candidates\": [";
  for (size_t i = 0; i < verdicts.size(); ++i) {
    json += (i ? ", " : "") + std::string("{\"name\": ") + json_string(verdicts[i].name) +
            ", \"status\": " + json_string(kind_name(verdicts[i].kind)) +
            ", \"reason\": " + json_string(verdicts[i].reason) + "}";
  }
  s.records.push_back(json + "]}");
}

}  // namespace detail

Text& Text::operator<<(int64_t v) {
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof digits, v).ptr;
  text_.append(digits, end);
  return *this;
}

Text& Text::operator<<(c10::IntArrayRef v) {
  text_ += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) text_ += ", ";
    *this << v[i];
  }
  text_ += ']';
  return *this;
}

Text& Text::operator<<(const at::Device& d) {
  if (d.is_cpu()) {
    text_ += "cpu";  // (the usual case, without Device::str's string)
  } else {
    text_ += d.str();
  }
  return *this;
}

std::string describe(const char* name, const at::Tensor& t) {
  Text out;
  out << name << " " << c10::toString(t.scalar_type()) << t.sizes();
  if (!t.is_contiguous()) out << " strides " << t.strides();
  out << " " << t.device();
  return out.str();
}

std::vector<CandidateInfo> candidates() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.rows;
}

std::string force(const std::string& op, const std::string& name) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  read_env(s);
  if (!name.empty()) check_known(s, op, name, "patchgemm.force");
  const auto it = s.forced.find(op);
  std::string previous = it == s.forced.end() ? std::string() : it->second;
  if (name.empty()) {
    s.forced.erase(op);
  } else {
    s.forced[op] = name;
  }
  g_any_forced = !s.forced.empty();
  return previous;
}

void set_testing(bool rules, std::vector<std::string> excluded) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (const auto& name : excluded) {
    bool known = false;
    for (const auto& row : s.rows) known = known || row.name == name;
    TORCH_CHECK(known, "_set_selection_testing: no candidate named \"", name, "\"");
  }
  s.excluded = std::set<std::string>(excluded.begin(), excluded.end());
  g_any_excluded = !s.excluded.empty();
  g_rules = rules;
}

int64_t start_recording() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (g_recording.fetch_add(1) == 0) s.records.clear();
  return static_cast<int64_t>(s.records.size());
}

std::vector<std::string> stop_recording(int64_t mark) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  TORCH_CHECK(g_recording.load() > 0 && mark >= 0 && mark <= static_cast<int64_t>(s.records.size()),
              "patchgemm.explain: not recording (mark ", mark, ")");
  std::vector<std::string> out(s.records.begin() + mark, s.records.end());
  if (g_recording.fetch_sub(1) == 1) s.records.clear();
  return out;
}

}  // namespace patchgemm::selection
