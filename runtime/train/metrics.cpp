#include "train/metrics.h"

#include <fmt/format.h>
#include <unistd.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"
#include "io/durable_file.h"
#include "train/expert_load.h"
#include "train/stragglers.h"

namespace ft::train {

namespace {
// A "Key:   123 kB" line of /proc/self/status, in bytes (0 where absent).
int64_t status_bytes(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string prefix = std::string(key) + ":";
  while (std::getline(in, line))
    if (line.rfind(prefix, 0) == 0) return std::stoll(line.substr(prefix.size())) * 1024;
  return 0;
}
}  // namespace

int64_t peak_rss_bytes() { return status_bytes("VmHWM"); }

int64_t rss_bytes() { return status_bytes("VmRSS"); }

bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return out.good();
}

namespace {

// A phase's host-memory figures (both records carry them the same way) and the file write.
void add_peak(nlohmann::json& j, int64_t rss_before, int64_t peak, bool reset) {
  j["rss_before_bytes"] = rss_before;
  j["peak_rss_bytes"] = peak;
  j["peak_delta_bytes"] = peak - rss_before;
  j["peak_reset"] = reset;
}

void write_json(const std::string& path, const nlohmann::json& j) {
  io::write_file_durably(path, j.dump(2) + "\n");
}

}  // namespace

void write_load_record(const std::string& path, const LoadRecord& r, int rank, int world_size) {
  nlohmann::json j = {
      {"rank", rank},         {"world_size", world_size},   {"source", r.source},
      {"seconds", r.seconds}, {"bytes_read", r.bytes_read}, {"param_bytes", r.param_bytes}};
  add_peak(j, r.rss_before_bytes, r.peak_rss_bytes, r.peak_reset);
  write_json(path, j);
}

void write_final_save_record(const std::string& path, const FinalSaveRecord& r) {
  nlohmann::json j = {{"step", r.step}, {"seconds", r.seconds}, {"bytes", r.bytes}};
  add_peak(j, r.rss_before_bytes, r.peak_rss_bytes, r.peak_reset);
  write_json(path, j);
}

MetricsLog::MetricsLog(const std::string& path, int64_t keep_through_step) : path_(path) {
  if (path.empty()) return;
  std::string kept;
  if (keep_through_step >= 0) {
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      // (Our own file; a line nested absurdly deep is not ours and is dropped like a torn one.)
      if (json_too_deep_at(line) != std::string_view::npos) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("step", int64_t{-1}) <= keep_through_step) kept += line + "\n";
    }
  }
  out_.open(path, std::ios::out | std::ios::trunc);
  out_ << kept;
  FT_CHECK(out_.good(), "cannot write ", path);
}

void MetricsLog::write(const StepRecord& r) {
  if (!out_.is_open()) return;
  const auto& s = r.stats;
  nlohmann::json j = {
      {"step", s.step},
      {"loss", s.loss},
      {"lr", s.lr},
      {"grad_norm", std::isfinite(s.grad_norm) ? nlohmann::json(s.grad_norm) : nlohmann::json()},
      {"tokens", s.tokens},
      {"input_tokens", r.input_tokens},
      {"tokens_per_s", r.tokens_per_s},
      {"step_time_s", r.step_time_s},
      {"skipped", s.skipped},
      {"skipped_total", s.skipped_total},
      {"loss_scale", s.loss_scale},
      {"samples", r.samples_consumed},
      {"time",
       {{"data_s", r.times.data_s},
        {"compute_s", r.times.compute_s},
        {"comm_s", r.times.comm_s},
        {"optimizer_s", r.times.optimizer_s},
        {"checkpoint_s", r.times.checkpoint_s},
        {"other_s", r.times.other_s}}},
      {"flops", r.flops},
      {"mfu", r.mfu()},
      {"memory",
       {{"param_bytes", r.memory.param_bytes},
        {"grad_bytes", r.memory.grad_bytes},
        {"optimizer_bytes", r.memory.optimizer_bytes},
        {"host_param_bytes", r.memory.engine.host_param_bytes},
        {"host_grad_bytes", r.memory.engine.host_grad_bytes},
        {"host_optimizer_bytes", r.memory.host_optimizer_bytes},
        {"gathered_peak_bytes", r.memory.engine.gathered_peak_bytes},
        {"largest_unit_bytes", r.memory.engine.largest_unit_bytes},
        {"host_pool_bytes", r.memory.host_pool_bytes},
        {"host_pool_peak_bytes", r.memory.host_pool_peak_bytes},
        {"peak_rss_bytes", r.peak_rss_bytes}}},
      {"comm",
       {{"all_gathers", r.memory.engine.all_gathers},
        {"all_gather_bytes", r.memory.engine.all_gather_bytes},
        {"reduce_scatters", r.memory.engine.reduce_scatters},
        {"reduce_scatter_bytes", r.memory.engine.reduce_scatter_bytes},
        {"all_reduces", r.memory.engine.all_reduces},
        {"all_reduce_bytes", r.memory.engine.all_reduce_bytes},
        {"scalar_collectives", r.memory.engine.scalar_collectives},
        {"wait_s", r.memory.engine.comm_wait_s}}}};
  for (const auto& c : r.sources) {
    j["source_records"][c.name] = c.records;
    j["source_tokens"][c.name] = c.tokens;
  }
  if (!s.expert_tokens.empty()) j["moe"] = moe_record(s.aux_loss, s.expert_tokens, s.moe_layers);
  // The host step of the step before that ran beside this one (issue 32: delayed, beside its
  // forward and backward; overlapped, beside its forward), what of it this step waited for, and
  // the rest, hidden.
  if (s.host_update_s >= 0)
    j["time"][s.host_update_delayed ? "delayed_update" : "overlapped_update"] = {
        {"update_s", s.host_update_s},
        {"waited_s", s.host_update_wait_s},
        {"hidden_s", std::max(0.0, s.host_update_s - s.host_update_wait_s)}};
  if (s.host_update_s >= 0 && !s.host_update_delayed)
    j["time"]["overlapped_update"]["during_backward"] = s.host_update_during_backward;
  // The optimizer offloaded (issue 32): the clip norm's part after the backward, and how many of
  // the masters' norms the host thread had taken beside it (of which before its end).
  if (s.norms >= 0)
    j["time"]["grad_norm"] = {{"after_backward_s", s.norm_s},
                              {"masters", s.norms},
                              {"beside_backward", s.norms_beside_backward},
                              {"before_backward_end", s.norms_before_backward_end}};
  if (r.exchanged)
    j["moe"]["exchange"] = {{"dispatch_s", r.dispatch_s},
                            {"combine_s", r.combine_s},
                            {"counts_s", r.exchange_counts_s},
                            {"bytes_sent", r.exchange_bytes_sent},
                            {"bytes_received", r.exchange_bytes_received}};
  if (r.eval_tokens > 0) {
    j["eval_loss"] = r.eval_loss;
    j["eval_tokens"] = r.eval_tokens;
    j["eval_s"] = r.eval_s;
  }
  if (r.ranks.known)
    j["ranks"] = {{"busy_median_s", r.ranks.busy_median_s},
                  {"busy_max_s", r.ranks.busy_max_s},
                  {"slowest_rank", r.ranks.slowest_rank}};
  if (r.memory.on_gpu) {
    nlohmann::json& m = j["memory"];
    m["cuda_allocated_bytes"] = r.memory.gpu_allocated_bytes;
    m["cuda_reserved_bytes"] = r.memory.gpu_reserved_bytes;
    m["cuda_peak_allocated_bytes"] = r.memory.gpu_peak_allocated_bytes;
  }
  out_ << j.dump() << '\n';
  out_.flush();
  FT_CHECK(out_.good(), "writing ", path_, " failed (disk full?)");
}

Progress::Progress(int64_t total_steps, int64_t log_every, int64_t from_step)
    : total_(total_steps),
      every_(std::max<int64_t>(1, log_every)),
      from_(from_step),
      tty_(::isatty(STDOUT_FILENO) == 1),
      start_(std::chrono::steady_clock::now()) {}

double Progress::eta(double elapsed_s, int64_t step) {
  recent_.emplace_back(elapsed_s, step);
  if (recent_.size() > kPaceWindow + 1) recent_.pop_front();
  // The median seconds per step between the window's updates: a step that also measured the
  // device's peak, evaluated or saved does not set the pace of all the others (a mean over the
  // window made the demo's ETA 152 s at step 20 and 6 s at step 40). Over this process's own
  // steps until the window has two points.
  std::vector<double> per_step;
  for (size_t k = 1; k < recent_.size(); ++k)
    if (recent_[k].second > recent_[k - 1].second)
      per_step.push_back((recent_[k].first - recent_[k - 1].first) /
                         static_cast<double>(recent_[k].second - recent_[k - 1].second));
  if (per_step.empty()) {
    if (step <= from_) return 0;
    per_step.push_back(elapsed_s / static_cast<double>(step - from_));
  }
  // The lower median: of two intervals, the faster (the other is the outlier as often as not).
  return lower_median(std::move(per_step)) *
         static_cast<double>(std::max<int64_t>(0, total_ - step));
}

namespace {

// A MoE model's figures on the progress line: the aux loss (when added) and the worst layer's
// most-loaded expert against the mean.
std::string moe_text(const StepStats& s) {
  if (s.expert_tokens.empty()) return "";
  double worst = 0;
  for (const LayerLoad& l : layer_loads(s.expert_tokens, s.moe_layers))
    worst = std::max(worst, l.imbalance());
  return fmt::format("{} experts max/mean {:.2f}",
                     s.aux_loss > 0 ? fmt::format(" aux {:.4f}", s.aux_loss) : "", worst);
}

}  // namespace

void Progress::update(const StepRecord& r) {
  const auto& s = r.stats;
  double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const double eta = this->eta(elapsed, s.step);
  std::string text = fmt::format(
      "step {}/{} loss {:.4f}{} lr {:.2e} grad_norm {:.3f} {:.0f} tok/s{} MFU {:.1f}% comm "
      "{:.0f}%{}",
      s.step, total_, s.loss, moe_text(s), s.lr, s.grad_norm, r.job_tokens_per_s(),
      r.ranks.known ? " (job)" : "", 100 * r.mfu(),
      100 * r.times.comm_s / std::max(r.step_time_s, 1e-12),
      s.skipped ? " (fp16 overflow: step skipped)" : "");
  if (tty_) {
    const int width = 24;
    int filled = total_ > 0 ? static_cast<int>(width * s.step / total_) : 0;
    fmt::print("\r[{}{}] {} ETA {:.0f}s   ", std::string(filled, '#'),
               std::string(width - filled, '.'), text, eta);
    std::fflush(stdout);
  } else if (s.step % every_ == 0 || s.step == total_ || s.skipped) {
    fmt::print("{} elapsed {:.1f}s ETA {:.0f}s\n", text, elapsed, eta);
    std::fflush(stdout);
  }
}

void Progress::finish() {
  if (tty_) fmt::print("\n");
}

}  // namespace ft::train
