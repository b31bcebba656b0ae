#include "train/run_dir.h"

#include <fmt/format.h>

#include <fstream>

#include "ckpt/checkpoint.h"
#include "config/settings.h"
#include "core/error.h"
#include "core/json.h"

namespace ft::train {

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

bool final_complete(const fs::path& run_dir) {
  std::error_code ec;
  return fs::exists(run_dir / "final" / "config.json", ec) ||
         fs::exists(run_dir / "final" / "adapter_config.json", ec);
}

// Whether this command asks for more steps than the finished run's `done`: a larger
// train.max_steps, or (when the length is in epochs) more epochs than the run was given.
bool asks_for_more(const config::TrainSettings& now, const std::optional<RunInputs>& was,
                   const std::string& output_dir, int64_t done) {
  if (now.max_steps > 0) return now.max_steps > done;
  if (!was) return false;
  const config::TrainSettings before =
      config::settings_from_json(was->preset, (fs::path(output_dir) / "preset.json").string())
          .train;
  return before.max_steps > 0 || now.epochs > before.epochs;
}

// The changes since the run's last start that it goes on with, said on rank 0.
void say_changes(const OutputPlan& out, const std::string& output_dir) {
  if (out.changes.empty()) return;
  std::string list;
  for (const auto& c : out.changes) list += (list.empty() ? "" : "; ") + change_text(c);
  fmt::print(stderr,
             "ft train: --output {} holds this run; changed since it last started ({}): {}\n",
             output_dir,
             out.resume_changed ? "--resume-changed: recorded in events.jsonl"
                                : "these keep what it computes",
             list);
}

}  // namespace

// A step-<N> directory appears only when its save commits (the temporary directory, meta.json
// included, is renamed into place), so one without meta.json lost it afterwards: damage, not a
// save that never finished.
json damaged_checkpoint(const std::string& dir, const std::string& reason) {
  return {{"event", "checkpoint_damaged"},
          {"step", ckpt::step_of_dir(dir)},
          {"dir", dir},
          {"reason", reason}};
}

int64_t final_step(const fs::path& run_dir) {
  if (!final_complete(run_dir)) return -1;
  std::error_code ec;
  const fs::path record = run_dir / "final_save.json";
  if (fs::is_regular_file(record, ec)) {
    const json j = json::parse(read_text_file<FormatError>(record.string()), nullptr, false);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer())
      return j["step"].get<int64_t>();
  }
  int64_t step = -1;
  std::ifstream events(run_dir / "events.jsonl");
  for (std::string line; std::getline(events, line);) {
    if (json_too_deep_at(line) != std::string_view::npos) continue;
    const json e = json::parse(line, nullptr, false);
    if (e.is_object() && e.value("event", "") == "finished" && e.contains("step") &&
        e["step"].is_number_integer())
      step = e["step"].get<int64_t>();
  }
  return step;
}

std::string finished_text(const OutputPlan& out, const std::string& output_dir) {
  return fmt::format(
      "{} already finished at step {} (its model is in final/): nothing to do; raise "
      "train.max_steps to train further, or give another --output",
      output_dir, out.finished_step);
}

OutputPlan plan_output(const RunOptions& o, const comm::DistEnv& env) {
  FT_CHECK(!o.output_dir.empty(), "--output is required");
  OutputPlan out;
  out.inputs = inputs_of(o, env.world_size);
  // A directory holding a run is continued only with the settings it was started with, up to
  // changes that keep what it computes (or that --resume-changed says are meant).
  const std::optional<RunInputs> was = recorded_inputs(o.output_dir);
  if (was && o.resume != "none") {
    out.changes = judge_changes(changes_between(*was, out.inputs, env.restart_count > 0),
                                o.output_dir, o.resume_changed);
    for (const auto& c : out.changes)
      out.resume_changed = out.resume_changed || c.effect != config::OnResume::kFree;
  }
  // A finished run (final/ complete) that this command asks no more steps of has nothing to do:
  // training again would write over its result. So has a launcher's later round that finds no
  // checkpoint beside final/: the round may have begun just as the job ended.
  out.ckpt_root = (fs::path(o.output_dir) / "checkpoints").string();
  const int64_t done = final_step(o.output_dir);
  const bool round_after_end = env.restart_count > 0 && ckpt::list_committed(out.ckpt_root).empty();
  if (done >= 0 && o.resume == "auto" &&
      (!asks_for_more(o.settings.train, was, o.output_dir, done) || round_after_end)) {
    out.finished = true;
    out.finished_step = done;
    return out;
  }
  if (env.rank == 0) say_changes(out, o.output_dir);
  // Which of the candidates is used is agreed once the strategy knows what this rank reads.
  if (o.resume == "auto") {
    out.candidates = ckpt::list_committed(out.ckpt_root);
    // Newer step directories without meta.json are damaged: skipped, said, and recorded.
    for (const auto& dir : ckpt::list_uncommitted(out.ckpt_root)) {
      if (!out.candidates.empty() && dir < out.candidates.front()) continue;
      out.damage.push_back(damaged_checkpoint(
          dir, fmt::format("{} is missing (deleted or lost after the save committed)",
                           ckpt::kMetaFile)));
      if (env.rank == 0)
        fmt::print(stderr,
                   "ft train: {} is damaged: it has no {}, which its save wrote before the "
                   "directory got its name (a step directory appears only when its save "
                   "commits), so it was deleted or lost since; skipped, resuming from {}\n",
                   dir, ckpt::kMetaFile,
                   out.candidates.empty() ? std::string("the beginning (no other checkpoint)")
                                          : out.candidates.front());
    }
  } else if (o.resume != "none") {
    FT_CHECK(fs::is_regular_file(fs::path(o.resume) / ckpt::kMetaFile), "--resume ", o.resume,
             ": not a committed checkpoint (no ", ckpt::kMetaFile,
             "); give a step-N directory under OUTPUT/checkpoints, auto or none");
    out.candidates = {o.resume};
  }
  const bool auto_fresh = o.resume == "auto" && out.candidates.empty();
  // A launcher restart without a checkpoint starts the run over in its own directory.
  // So does `--resume auto` in the directory of an ft run that was interrupted before its first
  // checkpoint was committed (it has preset.json but no final model): nothing there can be resumed.
  const bool interrupted_run =
      auto_fresh && was.has_value() && done < 0 && !fs::exists(fs::path(o.output_dir) / "final");
  out.started_over = interrupted_run;
  if (interrupted_run && env.rank == 0)
    fmt::print(stderr,
               "ft train: {} holds an interrupted run without a committed checkpoint: starting it "
               "over\n",
               o.output_dir);
  const bool empty = !fs::exists(o.output_dir) || fs::is_empty(o.output_dir);
  FT_CHECK(o.resume != "none" || empty, "--resume none starts afresh, but --output ", o.output_dir,
           " already holds a run; choose another directory so nothing is written over");
  FT_CHECK(
      !out.candidates.empty() || empty || (auto_fresh && env.restart_count > 0) || interrupted_run,
      "--output ", o.output_dir,
      done >= 0 ? fmt::format(" holds a run finished at step {} and no checkpoint to "
                              "continue it from; train the longer run into another "
                              "directory so nothing is written over",
                              done)
                : std::string(" already holds a run (it is not empty) and no checkpoint to "
                              "resume; choose another directory so nothing is written over"));
  return out;
}

}  // namespace ft::train
