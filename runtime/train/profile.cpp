#include "train/profile.h"

#include <fmt/format.h>
#include <stdlib.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "core/error.h"

namespace ft::train {
namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::set<ActivityType> activities(bool cuda) {
  std::set<ActivityType> a{ActivityType::CPU};
  if (cuda) a.insert(ActivityType::CUDA);
  return a;
}

prof::ProfilerConfig config() {
  return prof::ProfilerConfig(torch::profiler::impl::ProfilerState::KINETO);
}

}  // namespace

StepProfiler::StepProfiler(int64_t first, int64_t count, int64_t total, bool cuda, std::string dir)
    : first_(count > 0 ? first : -1),
      last_(std::min(first + count - 1, total)),
      cuda_(cuda),
      dir_(std::move(dir)) {
  if (first_ <= 0) return;
  if (first_ > total) {
    fmt::print(
        "ft train: output.profile_steps: nothing to profile, the run ends at step {} and "
        "profiling starts after 3 warm-up steps (step {})\n",
        total, first_);
    first_ = -1;
    return;
  }
  // Kineto logs an ERROR line where it finds no GPU driver (a CPU job on a CPU machine): noise.
  if (!cuda_) ::setenv("KINETO_LOG_LEVEL", "5", /*overwrite=*/0);
  prof::prepareProfiler(config(), activities(cuda_));
}

StepProfiler::~StepProfiler() {
  if (active_) prof::disableProfiler();  // an aborted run: no trace
}

void StepProfiler::before_step(int64_t step) {
  if (step != first_ || active_) return;
  prof::enableProfiler(config(), activities(cuda_));
  active_ = true;
  started_s_ = now_s();
}

void StepProfiler::after_step(int64_t step) {
  if (!active_ || step < last_) return;
  finish(now_s() - started_s_);
}

void StepProfiler::finish(double wall_s) {
  active_ = false;
  std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  const std::string trace = (std::filesystem::path(dir_) / "profile.json").string();
  result->save(trace);
  const std::string table = profile_table(*result, cuda_, wall_s, last_ - first_ + 1);
  std::ofstream(std::filesystem::path(dir_) / "profile.txt") << table;
  fmt::print(
      "ft train: profiled steps {}-{} ({:.3f} s): Chrome trace {} (open in "
      "chrome://tracing or ui.perfetto.dev)\n{}",
      first_, last_, wall_s, trace, table);
  std::fflush(stdout);
}

std::string profile_table(const prof::ProfilerResult& result, bool cuda, double wall_s,
                          int64_t steps, size_t top) {
  struct Row {
    double ns = 0;       // inclusive (a GPU kernel: its own time)
    double self_ns = 0;  // CPU ops: less the ops it called on its thread
    int64_t calls = 0;
  };
  struct Span {
    uint64_t thread = 0;
    int64_t start = 0, dur = 0;
    std::string name;
  };
  std::map<std::string, Row> by_name;
  std::vector<Span> spans;
  double total_ns = 0;
  for (const auto& e : result.events()) {
    const bool on_device = e.deviceType() != c10::DeviceType::CPU;
    if (on_device != cuda) continue;
    Row& r = by_name[e.name()];
    r.ns += static_cast<double>(e.durationNs());
    r.calls += 1;
    total_ns += static_cast<double>(e.durationNs());
    if (!cuda)
      spans.push_back({e.startThreadId(), static_cast<int64_t>(e.startNs()),
                       static_cast<int64_t>(e.durationNs()), e.name()});
  }
  // CPU ops' self time: on each thread, an op's duration less that of the ops directly inside it
  // (the call tree from the nesting of the spans), so the self times add up to the busy time.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return std::tie(a.thread, a.start, b.dur) < std::tie(b.thread, b.start, a.dur);
  });
  std::vector<const Span*> stack;
  for (const Span& sp : spans) {
    while (!stack.empty() && (stack.back()->thread != sp.thread ||
                              stack.back()->start + stack.back()->dur <= sp.start))
      stack.pop_back();
    if (!stack.empty()) by_name[stack.back()->name].self_ns -= static_cast<double>(sp.dur);
    by_name[sp.name].self_ns += static_cast<double>(sp.dur);
    stack.push_back(&sp);
  }
  std::vector<std::pair<std::string, Row>> rows(by_name.begin(), by_name.end());
  std::sort(rows.begin(), rows.end(), [cuda](const auto& a, const auto& b) {
    return cuda ? a.second.ns > b.second.ns : a.second.self_ns > b.second.self_ns;
  });
  std::string out;
  if (cuda) {
    out = fmt::format(
        "GPU kernel time per step (of {:.2f} ms wall per step; kernels busy {:.2f} ms):\n",
        wall_s * 1e3 / steps, total_ns / 1e6 / steps);
    out += fmt::format("  {:>9} {:>6} {:>7}  {}\n", "ms/step", "share", "calls", "name");
  } else {
    double busy_ns = 0;
    for (const auto& [name, r] : rows) busy_ns += r.self_ns;
    out = fmt::format(
        "CPU operator time per step (of {:.2f} ms wall per step; operators busy {:.2f} ms), by "
        "self time (less the ops it called); inclusive beside it:\n",
        wall_s * 1e3 / steps, busy_ns / 1e6 / steps);
    out += fmt::format("  {:>9} {:>6} {:>9} {:>7}  {}\n", "ms/step", "share", "incl ms", "calls",
                       "name");
  }
  for (size_t i = 0; i < rows.size() && i < top; ++i) {
    const auto& [name, r] = rows[i];
    std::string shown = name.size() > 110 ? name.substr(0, 107) + "..." : name;
    const double ns = cuda ? r.ns : r.self_ns;
    const double share = 100.0 * ns / 1e9 / std::max(wall_s, 1e-9);
    if (cuda)
      out += fmt::format("  {:9.3f} {:5.1f}% {:7}  {}\n", ns / 1e6 / steps, share, r.calls / steps,
                         shown);
    else
      out += fmt::format("  {:9.3f} {:5.1f}% {:9.3f} {:7}  {}\n", ns / 1e6 / steps, share,
                         r.ns / 1e6 / steps, r.calls / steps, shown);
  }
  return out;
}

}  // namespace ft::train
