#include "report/run_records.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "core/error.h"
#include "core/json.h"

namespace ft::report {

namespace fs = std::filesystem;
using nlohmann::json;

const char* event_name(Event::Kind kind) {
  switch (kind) {
    case Event::Kind::kStart:
      return "start";
    case Event::Kind::kStartOver:
      return "started over";
    case Event::Kind::kCheckpointDamaged:
      return "checkpoint damaged";
    case Event::Kind::kResume:
      return "resume";
    case Event::Kind::kRestart:
      return "restart";
    case Event::Kind::kCheckpoint:
      return "checkpoint";
    case Event::Kind::kCheckpointFailed:
      return "checkpoint failed";
    case Event::Kind::kPreempted:
      return "preempted";
    case Event::Kind::kFinished:
      return "finished";
    case Event::Kind::kSkipped:
      return "skipped fp16 step";
    case Event::Kind::kSettingsChanged:
      return "settings changed";
  }
  return "?";
}

std::vector<json> read_jsonl(const std::string& path, const std::string& name,
                             std::vector<Issue>& issues) {
  std::vector<json> out;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    issues.push_back({name, "missing"});
    return out;
  }
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  size_t pos = 0;
  int64_t line_no = 0;
  while (pos < text.size()) {
    const size_t end = text.find('\n', pos);
    const bool torn = end == std::string::npos;  // no newline yet: being written, or cut short
    const std::string line = text.substr(pos, torn ? std::string::npos : end - pos);
    pos = torn ? text.size() : end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j;
    if (json_too_deep_at(line) == std::string_view::npos)
      j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) {
      out.push_back(std::move(j));
      continue;
    }
    issues.push_back(
        {name, torn ? fmt::format("line {}: the last line is incomplete (a run still writing it, "
                                  "or one stopped while writing it); left out",
                                  line_no)
                    : fmt::format("line {}: not a JSON object ({}); left out", line_no,
                                  excerpt(line, 40))});
  }
  return out;
}

namespace {

double number(const json& j, const char* key, double def = 0) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : def;
}

// metrics.jsonl's "moe" object; fields of the wrong type are left out, as elsewhere.
void read_moe(const json& m, StepPoint& p) {
  if (m.contains("aux_loss") && m["aux_loss"].is_number() && m["aux_loss"].get<double>() > 0)
    p.aux_loss = m["aux_loss"].get<double>();
  if (!m.contains("layers") || !m["layers"].is_array()) return;
  for (const json& l : m["layers"])
    if (l.is_object() && l.contains("layer") && l["layer"].is_number_integer() &&
        l.contains("imbalance") && l["imbalance"].is_number())
      p.expert_imbalance[l["layer"].get<int64_t>()] = l["imbalance"].get<double>();
}

std::optional<StepPoint> to_step_fields(const json& j) {
  if (!j.contains("step") || !j["step"].is_number_integer() || !j.contains("loss") ||
      !j["loss"].is_number())
    return std::nullopt;
  StepPoint p;
  p.step = j["step"].get<int64_t>();
  p.loss = j["loss"].get<double>();
  if (j.contains("eval_loss") && j["eval_loss"].is_number()) p.eval_loss = j["eval_loss"];
  p.lr = number(j, "lr");
  if (j.contains("grad_norm") && j["grad_norm"].is_number()) p.grad_norm = j["grad_norm"];
  p.tokens_per_s = number(j, "tokens_per_s");
  p.mfu = number(j, "mfu");
  p.step_time_s = number(j, "step_time_s");
  p.skipped = j.value("skipped", false) == true;
  p.loss_scale = number(j, "loss_scale", 1);
  for (const auto& [field, out] : {std::pair{"source_records", &p.source_records},
                                   std::pair{"source_tokens", &p.source_tokens}}) {
    if (!j.contains(field) || !j[field].is_object()) continue;
    for (const auto& [name, v] : j[field].items())
      if (v.is_number()) (*out)[name] = static_cast<int64_t>(v.get<double>());
  }
  if (j.contains("moe") && j["moe"].is_object()) read_moe(j["moe"], p);
  if (j.contains("time") && j["time"].is_object()) {
    const json& t = j["time"];
    p.data_s = number(t, "data_s");
    p.compute_s = number(t, "compute_s");
    p.comm_s = number(t, "comm_s");
    p.optimizer_s = number(t, "optimizer_s");
    p.checkpoint_s = number(t, "checkpoint_s");
    p.other_s = number(t, "other_s");
  }
  if (j.contains("memory") && j["memory"].is_object()) {
    const json& m = j["memory"];
    p.peak_on_gpu = m.contains("cuda_peak_allocated_bytes");
    p.peak_bytes = static_cast<int64_t>(
        number(m, p.peak_on_gpu ? "cuda_peak_allocated_bytes" : "peak_rss_bytes"));
    p.model_state_bytes = static_cast<int64_t>(number(m, "param_bytes") + number(m, "grad_bytes") +
                                               number(m, "optimizer_bytes"));
  }
  return p;
}

// A record whose fields have other types than ft writes is no step.
std::optional<StepPoint> to_step(const json& j) {
  try {
    return to_step_fields(j);
  } catch (const json::exception&) {
    return std::nullopt;
  }
}

// One curve from a metrics file's records in the order they were written. A record whose step is
// not past the last one (and is not a skipped step, which repeats the number) was written by a
// restart that redid those steps: the records it supersedes go.
void collect_steps(const std::vector<json>& records, const std::string& name,
                   std::vector<StepPoint>& steps, std::vector<StepPoint>* skipped,
                   std::vector<Issue>& issues) {
  int64_t unreadable = 0;
  for (const json& j : records) {
    const auto p = to_step(j);
    if (!p) {
      ++unreadable;
      continue;
    }
    if (p->skipped) {
      if (skipped) skipped->push_back(*p);
      continue;
    }
    while (!steps.empty() && steps.back().step >= p->step) steps.pop_back();
    if (skipped)
      while (!skipped->empty() && skipped->back().step >= p->step) skipped->pop_back();
    steps.push_back(*p);
  }
  std::stable_sort(steps.begin(), steps.end(),
                   [](const StepPoint& a, const StepPoint& b) { return a.step < b.step; });
  if (unreadable > 0)
    issues.push_back({name, fmt::format("{} record(s) without an integer \"step\" and a numeric "
                                        "\"loss\"; left out",
                                        unreadable)});
}

json read_json_file(const fs::path& path, const std::string& name, std::vector<Issue>& issues) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    issues.push_back({name, "missing"});
    return nullptr;
  }
  std::stringstream buf;
  buf << in.rdbuf();
  const std::string text = buf.str();
  json j;
  if (json_too_deep_at(text) == std::string_view::npos)
    j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    issues.push_back({name, "not a JSON object (damaged or cut short); left out"});
    return nullptr;
  }
  return j;
}

// "node 1 (host-b): no heartbeat for 15 s" from a launcher's failure record.
std::string describe_failure(const json& f) {
  const std::string kind = f.value("kind", "?");
  std::string who = fmt::format("node {} ({})", f.value("node_rank", -1), f.value("hostname", "?"));
  if (kind == "worker" && f.contains("rank") && f["rank"].is_number_integer())
    who = fmt::format("rank {} on {}", f["rank"].get<int>(), who);
  const std::string what = kind == "node"     ? "lost node"
                           : kind == "worker" ? "worker failed"
                           : kind == "hang"   ? "hang"
                           : kind == "signal" ? "signal"
                           : kind == "rejoin" ? "node joined"
                                              : kind;
  std::string description = f.value("description", "");
  if (description.size() > 160) description = description.substr(0, 157) + "...";
  return fmt::format("{}: {} {}", what, who, description);
}

// One record of events.jsonl onto the timeline (nlohmann's type_error on a field of another type).
void add_event(const json& e, RunRecords& r) {
  const std::string kind = e.value("event", "");
  const int64_t step =
      e.contains("step") && e["step"].is_number_integer() ? e["step"].get<int64_t>() : 0;
  if (kind == "start") {
    if (e.contains("previous_failure") && e["previous_failure"].is_object())
      r.events.push_back({Event::Kind::kRestart, step,
                          fmt::format("launcher round {}: {}", e.value("restart_count", 0),
                                      describe_failure(e["previous_failure"]))});
    else if (e.value("restart_count", 0) > 0)
      r.events.push_back({Event::Kind::kRestart, step,
                          fmt::format("launcher round {}", e.value("restart_count", 0))});
    // A start from step 0 after another start: the attempt before committed no checkpoint.
    const bool over =
        step == 0 && (e.value("started_over", false) ||
                      std::any_of(r.events.begin(), r.events.end(), [](const Event& x) {
                        return x.kind == Event::Kind::kStart || x.kind == Event::Kind::kResume;
                      }));
    r.events.push_back(
        {step > 0 ? Event::Kind::kResume
         : over   ? Event::Kind::kStartOver
                  : Event::Kind::kStart,
         step,
         fmt::format("{}{} rank(s) on {} node(s), {}{}",
                     over ? "the attempt before ended without a checkpoint, its steps lost; " : "",
                     e.value("world_size", 1), e.value("nnodes", 1), e.value("device", "?"),
                     step > 0 ? fmt::format(", from the checkpoint of step {}", step) : "")});
    r.environment = e;
    r.finished = false;
  } else if (kind == "preempted") {
    r.events.push_back({Event::Kind::kPreempted, step,
                        fmt::format("{}: checkpoint written, stopped", e.value("signal", "?"))});
  } else if (kind == "checkpoint_damaged") {
    r.events.push_back({Event::Kind::kCheckpointDamaged, step,
                        fmt::format("{}: {}; skipped when resuming", e.value("dir", "?"),
                                    e.value("reason", "?"))});
  } else if (kind == "settings_changed" && e.contains("changes") && e["changes"].is_array()) {
    std::string list;
    for (const json& c : e["changes"])
      if (c.is_object())
        list += fmt::format("{}{} {} -> {}", list.empty() ? "" : "; ", c.value("key", "?"),
                            c.contains("was") ? c["was"].dump() : "?",
                            c.contains("now") ? c["now"].dump() : "?");
    r.events.push_back(
        {Event::Kind::kSettingsChanged, step,
         fmt::format("{}{}", e.value("resume_changed", false) ? "with --resume-changed: " : "",
                     list)});
  } else if (kind == "finished") {
    r.events.push_back({Event::Kind::kFinished, step, "final model saved"});
    r.finished = true;
  }
}

void add_checkpoint(const json& c, RunRecords& r) {
  if (!c.contains("step") || !c["step"].is_number_integer()) return;
  const int64_t step = c["step"].get<int64_t>();
  if (c.contains("error"))
    r.events.push_back({Event::Kind::kCheckpointFailed, step, c.value("error", "")});
  else if (c.contains("stall_s"))
    r.events.push_back(
        {Event::Kind::kCheckpoint, step,
         fmt::format("{}, training paused {:.3f} s", c.value("async", false) ? "async" : "sync",
                     number(c, "stall_s"))});
}

// Each record through `add`; one whose fields have other types than ft writes is left out and
// named.
template <class Add>
void add_records(const std::vector<json>& records, const std::string& name, Add add,
                 RunRecords& r) {
  int64_t bad = 0;
  for (const json& j : records) {
    try {
      add(j, r);
    } catch (const json::exception&) {
      ++bad;
    }
  }
  if (bad > 0)
    r.issues.push_back(
        {name, fmt::format("{} record(s) with fields of unexpected types; left out", bad)});
}

void read_events(const fs::path& dir, RunRecords& r) {
  add_records(read_jsonl((dir / "events.jsonl").string(), "events.jsonl", r.issues), "events.jsonl",
              add_event, r);
  // Checkpoints, in the order they were committed (events.jsonl and checkpoints.jsonl are two
  // files: their records are merged by step, checkpoint after the start it follows).
  std::vector<Issue> ck_issues;
  add_records(read_jsonl((dir / "checkpoints.jsonl").string(), "checkpoints.jsonl", ck_issues),
              "checkpoints.jsonl", add_checkpoint, r);
  // A run that never checkpoints has no checkpoints.jsonl: that is not damage.
  for (auto& i : ck_issues)
    if (i.what != "missing") r.issues.push_back(i);
}

}  // namespace

RunRecords read_run(const std::string& dir_name) {
  const fs::path dir(dir_name);
  std::error_code ec;
  FT_CHECK(fs::is_directory(dir, ec), "ft report: ", dir_name,
           " is not a directory; give the --output directory of an ft train run");
  RunRecords r;
  r.dir = dir_name;
  collect_steps(read_jsonl((dir / "metrics.jsonl").string(), "metrics.jsonl", r.issues),
                "metrics.jsonl", r.steps, &r.skipped, r.issues);
  const std::regex rank_file(R"(metrics\.rank(\d{1,6})\.jsonl)");
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = e.path().filename().string();
    if (!std::regex_match(name, m, rank_file)) continue;
    collect_steps(read_jsonl(e.path().string(), name, r.issues), name, r.ranks[std::stoi(m[1])],
                  nullptr, r.issues);
  }
  r.preset = read_json_file(dir / "preset.json", "preset.json", r.issues);
  std::vector<Issue> plan_issues;  // runs from before plan.json existed have none
  r.plan = read_json_file(dir / "plan.json", "plan.json", plan_issues);
  for (auto& i : plan_issues)
    if (i.what != "missing") r.issues.push_back(i);
  read_events(dir, r);
  // Every rank of a multi-rank run writes its own file; a missing one is named.
  const auto world =
      static_cast<int>(r.environment.is_object() ? number(r.environment, "world_size", 1) : 1);
  for (int k = 0; world > 1 && k < world && k < 100000; ++k)
    if (!r.ranks.count(k)) r.issues.push_back({fmt::format("metrics.rank{}.jsonl", k), "missing"});
  for (const auto& s : r.skipped)
    r.events.push_back({Event::Kind::kSkipped, s.step,
                        fmt::format("fp16 overflow, loss scale {:g}", s.loss_scale)});
  // In step order; at one step, what ended an attempt (a checkpoint, a preemption) before the
  // restart and the resume from it.
  const auto phase = [](Event::Kind k) {
    switch (k) {
      case Event::Kind::kStart:
      case Event::Kind::kStartOver:
        return 0;
      case Event::Kind::kCheckpointDamaged:
        return 3;
      case Event::Kind::kCheckpoint:
      case Event::Kind::kCheckpointFailed:
      case Event::Kind::kSkipped:
        return 1;
      case Event::Kind::kPreempted:
      case Event::Kind::kFinished:
        return 2;
      case Event::Kind::kRestart:
        return 3;
      case Event::Kind::kResume:
        return 4;
      case Event::Kind::kSettingsChanged:
        return 5;
    }
    return 0;
  };
  std::stable_sort(r.events.begin(), r.events.end(), [&](const Event& a, const Event& b) {
    return a.step != b.step ? a.step < b.step : phase(a.kind) < phase(b.kind);
  });
  if (!r.finished && (fs::exists(dir / "final" / "config.json", ec) ||
                      fs::exists(dir / "final" / "adapter_config.json", ec)))
    r.finished = true;
  return r;
}

}  // namespace ft::report
