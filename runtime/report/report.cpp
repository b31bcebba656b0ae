#include "report/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <limits>
#include <map>

#include "io/durable_file.h"
#include "report/svg.h"

namespace ft::report {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The palette of every figure (colour-blind safe, Okabe and Ito).
constexpr const char* kBlue = "#0072b2";
constexpr const char* kOrange = "#e69f00";
constexpr const char* kGreen = "#009e73";
constexpr const char* kRed = "#d55e00";
constexpr const char* kPurple = "#cc79a7";
constexpr const char* kSky = "#56b4e9";
constexpr const char* kGrey = "#999999";
constexpr const char* kYellow = "#f0e442";

Chart chart(std::string id, std::string title, std::string x_label, std::string y_label = "",
            TickFormat y_format = nullptr, bool y_from_zero = false) {
  Chart c;
  c.id = std::move(id);
  c.title = std::move(title);
  c.x_label = std::move(x_label);
  c.y_label = std::move(y_label);
  c.y_format = std::move(y_format);
  c.y_from_zero = y_from_zero;
  return c;
}

// TensorBoard's smoothing: an exponential moving average with weight 0.9, debiased at the start
// (so the first points are not pulled toward 0).
std::vector<double> smoothed(const std::vector<double>& y, double weight = 0.9) {
  std::vector<double> out;
  double ema = 0;
  int n = 0;
  for (double v : y) {
    if (!std::isfinite(v)) {
      out.push_back(kNaN);
      continue;
    }
    ema = ema * weight + (1 - weight) * v;
    ++n;
    out.push_back(ema / (1 - std::pow(weight, n)));
  }
  return out;
}

// A field of every step (thinned on long runs: svg.h).
template <class F>
Series series_of(const std::vector<StepPoint>& steps, std::string name, std::string label,
                 std::string color, F value, bool thin = true) {
  Series s{std::move(name), std::move(label), std::move(color), {}, {}};
  for (const auto& p : steps) {
    const double v = value(p);
    if (!std::isfinite(v)) continue;
    s.x.push_back(static_cast<double>(p.step));
    s.y.push_back(v);
  }
  return thin ? thin_extremes(std::move(s)) : s;
}

std::string loss_chart(const RunRecords& r) {
  // Smoothed over every step, then both thinned.
  Series raw = series_of(
      r.steps, "loss", "loss", "#9ecae1", [](const StepPoint& p) { return p.loss; }, false);
  raw.width = 1.2;
  Series smooth{"loss_smoothed", "smoothed (EMA 0.9)", kBlue, raw.x, smoothed(raw.y)};
  smooth.width = 2.2;
  std::vector<Series> all = {thin_extremes(raw), thin_extremes(smooth)};
  Series eval = series_of(r.steps, "eval_loss", "eval loss", kRed,
                          [](const StepPoint& p) { return p.eval_loss ? *p.eval_loss : kNaN; });
  if (!eval.x.empty()) {
    eval.markers = eval.x.size() < 3;
    eval.width = 2;
    all.push_back(eval);
  }
  if (!r.skipped.empty()) {
    Series sk = series_of(r.skipped, "skipped", "skipped fp16 step", kOrange,
                          [](const StepPoint& p) { return p.loss; });
    sk.markers = true;
    all.push_back(sk);
  }
  return line_chart(chart("loss", "Training loss", "step", "loss (nats per target token)"), all);
}

std::string lr_chart(const RunRecords& r) {
  return line_chart(
      chart("lr", "Learning rate", "step", "learning rate", nullptr, true),
      {series_of(r.steps, "lr", "lr", kGreen, [](const StepPoint& p) { return p.lr; })});
}

std::string grad_norm_chart(const RunRecords& r) {
  return line_chart(chart("grad_norm", "Gradient norm (before clipping)", "step", "global L2 norm"),
                    {series_of(r.steps, "grad_norm", "grad norm", kPurple, [](const StepPoint& p) {
                      return p.grad_norm ? *p.grad_norm : kNaN;
                    })});
}

std::string throughput_chart(const RunRecords& r) {
  return line_chart(
      chart("tokens_per_s", "Throughput (rank 0)", "step", "tokens / s", nullptr, true),
      {series_of(r.steps, "tokens_per_s", "tokens/s", kBlue,
                 [](const StepPoint& p) { return p.tokens_per_s; })});
}

std::string mfu_chart(const RunRecords& r) {
  return line_chart(
      chart("mfu", "Model FLOPs utilisation (rank 0)", "step", "MFU", format_percent, true),
      {series_of(r.steps, "mfu", "MFU", kRed, [](const StepPoint& p) { return p.mfu; })});
}

std::string step_time_chart(const RunRecords& r) {
  const auto part = [&](const char* name, const char* label, const char* color, auto f) {
    Series s{name, label, color, {}, {}};
    for (const auto& p : r.steps) {
      s.x.push_back(static_cast<double>(p.step));
      s.y.push_back(f(p) * 1e3);
    }
    return thin_mean(std::move(s));
  };
  return stacked_chart(
      chart("step_time", "Where the step time went (rank 0)", "step", "milliseconds per step",
            nullptr, true),
      {part("time.data_s", "data", kYellow, [](const StepPoint& p) { return p.data_s; }),
       part("time.compute_s", "compute", kBlue, [](const StepPoint& p) { return p.compute_s; }),
       part("time.comm_s", "exposed comm", kRed, [](const StepPoint& p) { return p.comm_s; }),
       part("time.optimizer_s", "optimizer", kGreen,
            [](const StepPoint& p) { return p.optimizer_s; }),
       part("time.checkpoint_s", "checkpoint", kPurple,
            [](const StepPoint& p) { return p.checkpoint_s; }),
       part("time.other_s", "other", kGrey, [](const StepPoint& p) { return p.other_s; })});
}

// Columns of at most kColumns step ranges; each cell the mean busy time of that rank there.
std::string rank_heat_map(const RunRecords& r) {
  constexpr int64_t kColumns = 120;
  HeatMap m;
  int64_t last = 0;
  for (const auto& [rank, steps] : r.ranks)
    if (!steps.empty()) last = std::max(last, steps.back().step);
  if (r.ranks.empty() || last == 0)
    return heat_map(chart("rank_heat_map", "Per-rank work per step", "step"), m);
  const int64_t per = (last + kColumns - 1) / kColumns;
  const int64_t cols = (last + per - 1) / per;
  for (int64_t k = 0; k < cols; ++k)
    m.column_steps.push_back(static_cast<double>(std::min(last, (k + 1) * per)));
  for (const auto& [rank, steps] : r.ranks) {
    m.row_labels.push_back(fmt::format("rank {}", rank));
    std::vector<double> sum(cols, 0), n(cols, 0);
    for (const auto& p : steps) {
      if (p.step < 1 || p.step > last) continue;
      const int64_t k = (p.step - 1) / per;
      sum[k] += p.busy_s();
      n[k] += 1;
    }
    std::vector<double> row;
    for (int64_t k = 0; k < cols; ++k) row.push_back(n[k] > 0 ? sum[k] / n[k] : kNaN);
    m.cells.push_back(row);
  }
  Chart c = chart(
      "rank_heat_map",
      "Per-rank work per step (step time less exposed communication; stragglers are hot)", "step");
  c.width = 1140;
  c.height = std::max(140.0, 80 + 26.0 * static_cast<double>(m.row_labels.size()));
  return heat_map(c, m);
}

std::string memory_chart(const RunRecords& r) {
  Bars b;
  Series peak{"memory.peak", "measured peak", kBlue, {}, {}};
  Series state{"memory.model_state", "model state", kSky, {}, {}};
  bool gpu = false;
  const auto add = [&](const std::string& group, const std::vector<StepPoint>& steps) {
    int64_t p = 0, s = 0;
    for (const auto& x : steps) {
      p = std::max(p, x.peak_bytes);
      s = std::max(s, x.model_state_bytes);
      gpu = gpu || x.peak_on_gpu;
    }
    b.groups.push_back(group);
    peak.y.push_back(static_cast<double>(p));
    state.y.push_back(static_cast<double>(s));
  };
  if (r.ranks.empty())
    add("rank 0", r.steps);
  else
    for (const auto& [rank, steps] : r.ranks) add(fmt::format("rank {}", rank), steps);
  peak.label = gpu ? "peak (GPU)" : "peak (RSS)";
  b.series = {peak, state};
  if (r.plan.is_object() && r.plan.contains("rank") && r.plan["rank"].is_object()) {
    const json& pr = r.plan["rank"];
    if (pr.value("step_peak_bytes", 0.0) > 0)
      b.lines.push_back(
          {"plan.step_peak", "plan: peak", kRed, {0}, {pr.value("step_peak_bytes", 0.0)}});
    const double planned_state = pr.value("param_bytes", 0.0) + pr.value("grad_bytes", 0.0) +
                                 pr.value("optimizer_bytes", 0.0);
    if (planned_state > 0)
      b.lines.push_back({"plan.model_state", "plan: state", kOrange, {0}, {planned_state}});
  }
  Chart c =
      chart("memory", "Memory per rank against the plan", "rank", "bytes", format_bytes, true);
  return bar_chart(c, b);
}

std::string timeline_chart(const RunRecords& r) {
  const std::vector<std::string> rows = {"start / resume", "restart",   "checkpoint",
                                         "failed save",    "preempted", "skipped fp16",
                                         "finished"};
  const std::vector<std::string> colors = {kGreen, kRed, kBlue, kRed, kOrange, kPurple, "#333333"};
  std::vector<Mark> marks;
  double max_step = r.steps.empty() ? 1 : static_cast<double>(r.steps.back().step);
  for (const auto& e : r.events) {
    int row = 0;
    switch (e.kind) {
      case Event::Kind::kStart:
      case Event::Kind::kStartOver:
      case Event::Kind::kResume:
      case Event::Kind::kSettingsChanged:
        row = 0;
        break;
      case Event::Kind::kRestart:
        row = 1;
        break;
      case Event::Kind::kCheckpoint:
        row = 2;
        break;
      case Event::Kind::kCheckpointFailed:
      case Event::Kind::kCheckpointDamaged:
        row = 3;
        break;
      case Event::Kind::kPreempted:
        row = 4;
        break;
      case Event::Kind::kSkipped:
        row = 5;
        break;
      case Event::Kind::kFinished:
        row = 6;
        break;
    }
    marks.push_back({static_cast<double>(e.step), row,
                     fmt::format("step {}: {}: {}", e.step, event_name(e.kind), e.detail)});
    max_step = std::max(max_step, static_cast<double>(e.step));
  }
  Chart c =
      chart("timeline", "Timeline: checkpoints, restarts, preemptions, skipped steps", "step");
  c.width = 1140;
  c.height = 250;
  return timeline(c, rows, colors, marks, max_step);
}

// A mixture's sources (metrics.jsonl source_tokens): each one's cumulative tokens over the
// steps, and a table of the totals with each source's share of the records and tokens.
std::string sources_section(const RunRecords& r) {
  std::map<std::string, int64_t> records, tokens;
  for (const auto& p : r.steps) {
    for (const auto& [name, n] : p.source_records) records[name] += n;
    for (const auto& [name, n] : p.source_tokens) tokens[name] += n;
  }
  if (tokens.empty()) return "";
  const char* colors[] = {kBlue, kOrange, kGreen, kRed, kPurple, kSky, kGrey, kYellow};
  std::vector<Series> curves;
  int64_t all_records = 0, all_tokens = 0;
  for (const auto& [name, total] : tokens) {
    Series s{"source." + name, name, colors[curves.size() % 8], {}, {}};
    double sum = 0;
    for (const auto& p : r.steps) {
      const auto it = p.source_tokens.find(name);
      sum += it == p.source_tokens.end() ? 0 : static_cast<double>(it->second);
      s.x.push_back(static_cast<double>(p.step));
      s.y.push_back(sum);
    }
    curves.push_back(thin_extremes(std::move(s)));
    all_records += records[name];
    all_tokens += total;
  }
  std::string h = "<section><h2>Data sources</h2><div class=\"grid\">\n";
  h += line_chart(chart("source_tokens", "Tokens trained by source (cumulative, all ranks)", "step",
                        "input tokens", nullptr, true),
                  curves);
  h += "</div><table class=\"events\" data-sources=\"" + std::to_string(tokens.size()) +
       "\"><tr><th>source</th><th>records</th><th>share of records</th><th>tokens</th><th>share "
       "of tokens</th></tr>";
  for (const auto& [name, total] : tokens)
    h += fmt::format("<tr><td>{}</td><td>{}</td><td>{:.1f}%</td><td>{}</td><td>{:.1f}%</td></tr>",
                     escape(name), records[name],
                     100.0 * static_cast<double>(records[name]) / std::max<int64_t>(1, all_records),
                     total, 100.0 * static_cast<double>(total) / std::max<int64_t>(1, all_tokens));
  return h + "</table></section>\n";
}

// A mixture-of-experts model (metrics.jsonl moe): per MoE layer, its most-loaded expert's tokens
// over the mean (1 is perfect balance; k x E / k would be one expert taking every pick), and the
// load-balancing loss when the run added it.
std::string experts_section(const RunRecords& r) {
  std::map<int64_t, Series> layers;
  Series aux{"aux_loss", "load-balancing loss", kPurple, {}, {}};
  const char* colors[] = {kBlue, kOrange, kGreen, kRed, kPurple, kSky, kGrey, kYellow};
  for (const auto& p : r.steps) {
    for (const auto& [layer, v] : p.expert_imbalance) {
      auto it = layers.find(layer);
      if (it == layers.end())
        it = layers
                 .emplace(layer, Series{fmt::format("imbalance.{}", layer),
                                        fmt::format("layer {}", layer),
                                        colors[layers.size() % 8],
                                        {},
                                        {}})
                 .first;
      it->second.x.push_back(static_cast<double>(p.step));
      it->second.y.push_back(v);
    }
    if (p.aux_loss) {
      aux.x.push_back(static_cast<double>(p.step));
      aux.y.push_back(*p.aux_loss);
    }
  }
  if (layers.empty()) return "";
  std::vector<Series> curves;
  for (auto& [layer, series] : layers) curves.push_back(thin_extremes(std::move(series)));
  std::string h = "<section><h2>Experts</h2><div class=\"grid\">\n";
  h += line_chart(
      chart("expert_imbalance", "Expert load: most-loaded expert's tokens / mean, per MoE layer",
            "step", "max / mean (1 = balanced)"),
      curves);
  if (!aux.x.empty())
    h += line_chart(chart("aux_loss", "Load-balancing loss (E x sum f_e P_e)", "step", "aux loss"),
                    {thin_extremes(std::move(aux))});
  return h + "</div></section>\n";
}

std::string table_row(const std::string& key, const std::string& value) {
  return fmt::format("<tr><th>{}</th><td>{}</td></tr>", escape(key), escape(value));
}

std::string scalar_text(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

std::string environment_table(const RunRecords& r) {
  if (!r.environment.is_object())
    return "<p class=\"note\">No start record (events.jsonl): the environment is unknown.</p>";
  std::string s = "<table class=\"kv\">";
  for (const auto& [k, v] : r.environment.items()) {
    if (k == "event" || k == "previous_failure" || v.is_object()) continue;
    if (k == "time" && v.is_number()) {  // Unix seconds: the start, in UTC
      const std::time_t t = static_cast<std::time_t>(v.get<double>());
      std::tm tm{};
      gmtime_r(&t, &tm);
      char buf[32];
      std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
      s += table_row("started", buf);
      continue;
    }
    s += table_row(k, scalar_text(v));
  }
  return s + "</table>";
}

// The preset as the run used it: with --model, the model's shape came from its config.json, and
// the preset's shape keys (Llama-7B's hidden_size 4096 in the shipped `lora`) were not used.
json shown_preset(const RunRecords& r) {
  json p = r.preset;
  const std::string model =
      r.environment.is_object() ? r.environment.value("model", std::string()) : "";
  if (model.empty() || !p.contains("model") || !p["model"].is_object()) return p;
  json kept = json::object();
  if (p["model"].contains("require_dir")) kept["require_dir"] = p["model"]["require_dir"];
  kept["shape"] = model + "/config.json (with --model the preset's shape keys are not used)";
  p["model"] = kept;
  return p;
}

std::string events_table(const RunRecords& r) {
  if (r.events.empty()) return "<p class=\"note\">No events recorded.</p>";
  std::string s = "<table class=\"events\"><tr><th>step</th><th>event</th><th>detail</th></tr>";
  for (const auto& e : r.events)
    s += fmt::format("<tr class=\"ev-{}\"><td>{}</td><td>{}</td><td>{}</td></tr>",
                     e.kind == Event::Kind::kCheckpointFailed ||
                             e.kind == Event::Kind::kCheckpointDamaged ||
                             e.kind == Event::Kind::kRestart || e.kind == Event::Kind::kStartOver ||
                             e.kind == Event::Kind::kSettingsChanged
                         ? "bad"
                         : "ok",
                     e.step, escape(event_name(e.kind)), escape(e.detail));
  return s + "</table>";
}

std::string skipped_table(const RunRecords& r) {
  if (r.skipped.empty())
    return "<p class=\"note\" data-skipped=\"0\">No fp16 step was skipped.</p>";
  std::string s = fmt::format(
      "<table class=\"events\" data-skipped=\"{}\"><tr><th>after step</th><th>loss</th><th>loss "
      "scale</th></tr>",
      r.skipped.size());
  for (const auto& p : r.skipped)
    s += fmt::format("<tr><td>{}</td><td>{}</td><td>{:g}</td></tr>", p.step, format_number(p.loss),
                     p.loss_scale);
  return s + "</table>";
}

std::string issues_box(const RunRecords& r) {
  if (r.issues.empty()) return "";
  std::string s = fmt::format(
      "<section class=\"issues\" data-issues=\"{}\"><h2>Missing or damaged records</h2><p>The "
      "report shows what could be read; these were left out:</p><ul>",
      r.issues.size());
  for (const auto& i : r.issues)
    s += fmt::format("<li><code>{}</code>: {}</li>", escape(i.file), escape(i.what));
  return s + "</ul></section>";
}

const char* kStyle = R"(
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;margin:0;
background:#f6f7f9;color:#1d2330}
header{background:#1d2330;color:#fff;padding:18px 28px}
header h1{margin:0 0 6px;font-size:22px;font-weight:600}
header .sub{color:#c6cbd6;font-size:13px}
main{padding:18px 28px;max-width:1200px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin-bottom:16px}
.card{background:#fff;border-radius:8px;padding:10px 16px;box-shadow:0 1px 2px rgba(0,0,0,.08);
min-width:120px}
.card .k{font-size:12px;color:#667}.card .v{font-size:20px;font-weight:600}
.grid{display:flex;flex-wrap:wrap;gap:14px}
figure.chart{margin:0;background:#fff;border-radius:8px;box-shadow:0 1px 2px rgba(0,0,0,.08);
padding:6px}
svg text{font-size:11px;fill:#334}
svg text.title{font-size:13px;font-weight:600;fill:#1d2330}
svg text.label{font-size:11.5px;fill:#556}
svg text.empty{font-size:13px;fill:#999}
svg .grid{stroke:#e6e8ec;stroke-width:1}
svg .axis,svg .tickmark{stroke:#889;stroke-width:1}
section{margin-top:22px}
h2{font-size:17px;margin:0 0 10px}
table{border-collapse:collapse;background:#fff;font-size:13px;box-shadow:0 1px 2px rgba(0,0,0,.08)}
td,th{padding:4px 10px;border-bottom:1px solid #eceef2;text-align:left;vertical-align:top}
table.kv th{color:#556;font-weight:500}
tr.ev-bad td{color:#b00020}
.issues{background:#fff4e5;border-left:4px solid #e69f00;padding:8px 16px;border-radius:6px}
.note{color:#667;font-size:13px}
pre{background:#fff;padding:10px;border-radius:6px;font-size:12px;overflow:auto;max-height:420px;
box-shadow:0 1px 2px rgba(0,0,0,.08)}
)";

std::string card(const std::string& key, const std::string& value) {
  return fmt::format("<div class=\"card\"><div class=\"k\">{}</div><div class=\"v\">{}</div></div>",
                     escape(key), escape(value));
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

}  // namespace

std::string render_report(const RunRecords& r) {
  const std::string name =
      r.preset.is_object() && r.preset.contains("name") && r.preset["name"].is_string()
          ? r.preset["name"].get<std::string>()
          : "?";
  std::string h = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">";
  h += fmt::format("<title>ft report: {}</title><style>{}</style></head><body>\n",
                   escape(fs::path(r.dir).filename().string()), kStyle);
  h += fmt::format(
      "<header><h1>ft report: {}</h1><div class=\"sub\">{} &middot; preset {} &middot; {} "
      "&middot; written {}</div></header><main>\n",
      escape(fs::path(r.dir).filename().string()), escape(r.dir), escape(name),
      r.finished ? "finished" : "running or stopped", now_utc());
  h += "<div class=\"cards\">";
  h += card("steps", r.steps.empty() ? "0" : std::to_string(r.steps.back().step));
  if (!r.steps.empty()) {
    h += card("loss first / last",
              fmt::format("{:.4f} / {:.4f}", r.steps.front().loss, r.steps.back().loss));
    double tps = 0;
    for (const auto& p : r.steps) tps += p.tokens_per_s;
    h += card("mean tokens/s (rank 0)",
              fmt::format("{:.0f}", tps / static_cast<double>(r.steps.size())));
  }
  for (auto it = r.steps.rbegin(); it != r.steps.rend(); ++it)
    if (it->eval_loss) {
      h +=
          card(fmt::format("eval loss (step {})", it->step), fmt::format("{:.4f}", *it->eval_loss));
      break;
    }
  h += card("ranks", std::to_string(std::max<size_t>(1, r.ranks.size())));
  h += card("skipped fp16 steps", std::to_string(r.skipped.size()));
  int restarts = 0;
  for (const auto& e : r.events) restarts += e.kind == Event::Kind::kRestart;
  h += card("restarts", std::to_string(restarts));
  h += "</div>\n";
  h += issues_box(r);
  h += "<section><h2>Training</h2><div class=\"grid\">\n";
  h += loss_chart(r) + lr_chart(r) + grad_norm_chart(r) + throughput_chart(r) + mfu_chart(r) +
       step_time_chart(r) + memory_chart(r);
  h += "</div></section>\n" + sources_section(r) + experts_section(r);
  h += "<section><h2>Ranks</h2><div class=\"grid\">\n";
  h += rank_heat_map(r);
  h += "</div></section>\n<section><h2>Timeline</h2><div class=\"grid\">\n";
  h += timeline_chart(r);
  h += "</div>\n" + events_table(r) + "</section>\n";
  h += "<section><h2>Skipped fp16 steps</h2>" + skipped_table(r) + "</section>\n";
  h += "<section><h2>Environment</h2>" + environment_table(r) + "</section>\n";
  h += "<section><h2>Resolved preset</h2>";
  h += r.preset.is_object() ? "<pre>" + escape(shown_preset(r).dump(2)) + "</pre>"
                            : "<p class=\"note\">preset.json is missing.</p>";
  h += "</section>\n</main></body></html>\n";
  return h;
}

ReportResult write_report(const std::string& run_dir, const std::string& output) {
  const RunRecords records = read_run(run_dir);
  ReportResult result;
  result.path = output.empty() ? (fs::path(run_dir) / "report.html").string() : output;
  result.issues = records.issues;
  result.steps = records.steps.empty() ? 0 : records.steps.back().step;
  io::write_file_durably(result.path, render_report(records));
  return result;
}

}  // namespace ft::report
