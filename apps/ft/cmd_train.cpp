// `ft train --preset NAME|FILE [--model DIR|ORG/NAME] [--data PATH] [--output DIR]
// [--set k=v ...]`; the options are declared in train_options.cpp, which `ft launch` shares to
// forward them.
#include <fmt/format.h>

#include "comm/dist_env.h"
#include "commands.h"
#include "config/settings.h"
#include "core/error.h"
#include "core/host_alloc.h"
#include "cuda/device.h"
#include "io/storage.h"
#include "plan/plan.h"
#include "plan/preflight.h"
#include "report/report.h"
#include "train/run.h"
#include "train/run_dir.h"
#include "train_options.h"

namespace ft::app {

namespace {
// The run's page (ft report) at the end, also of a preempted run. The model is saved by now: a
// page that cannot be written is a warning, not a failed run.
void write_run_report(const std::string& output_dir) {
  try {
    const report::ReportResult r = report::write_report(output_dir);
    fmt::print("ft train: report {}\n", r.path);
  } catch (const std::exception& e) {
    fmt::print(stderr, "ft train: warning: the report was not written: {}\n", e.what());
  }
}
}  // namespace

Run add_train(CLI::App& app) {
  auto* cmd = app.add_subcommand("train",
                                 "Fine-tune a Hugging Face decoder model (Llama, Qwen, Gemma, "
                                 "Mistral, Phi, OLMo, Granite, Mixtral...) as a preset says");
  auto args = std::make_shared<TrainCommandLine>();
  args->add_to(cmd, /*require=*/true, "Options");
  return [args]() -> int {
    core::configure_host_malloc();  // first, before any thread: see core/host_alloc.h
    const comm::DistEnv env = comm::read_dist_env();
    // A hub id becomes its cache directory here, so the run records the directory it read.
    args->resolve_model("ft train", env.rank == 0 ? stdout : nullptr);
    train::RunOptions opts = args->run_options();
    opts.settings = config::resolve_settings(args->value("preset"), args->values("set"));
    // An output nothing can be written to is refused before anything is loaded or allocated;
    // so is one that holds another run, or this run with changes it cannot continue with.
    io::check_writable_dir(opts.output_dir, "--output");
    train::OutputPlan out = train::plan_output(opts, env);
    if (out.finished) {
      if (env.rank == 0) fmt::print("ft train: {}\n", train::finished_text(out, opts.output_dir));
      return 0;
    }
    // Preflight: the job's plan against this node, before anything is allocated or written.
    plan::PreflightOptions po;
    po.settings = opts.settings;
    po.model_dir = opts.model_dir;
    po.output_dir = opts.output_dir;
    po.layout = {
        env.nnodes, env.local_world_size,
        cuda::choose_device(opts.settings.hardware.device, env.local_rank).device.is_cuda()};
    po.node_rank = env.node_rank;
    po.running = env.local_world_size;
    po.print = env.local_rank == 0;
    po.who = "ft train";
    const plan::Plan plan = plan::preflight(po);
    opts.expected_start_s = plan.first_step_s;
    opts.plan = plan::plan_json(plan);
    auto s = train::run_training(opts, std::move(out));
    const bool rank0 = comm::read_dist_env().rank == 0;
    if (rank0) write_run_report(opts.output_dir);
    if (s.preempted) return train::kExitPreempted;
    if (!rank0) return 0;
    const std::string steps =
        s.first_step > 1 ? fmt::format("steps {}-{} ({} in this process, resumed after step {})",
                                       s.first_step, s.steps, s.ran, s.first_step - 1)
                         : fmt::format("{} steps", s.steps);
    fmt::print("ft train: {}, loss {:.4f} -> {:.4f}{}\n", steps, s.first_loss, s.last_loss,
               s.skipped_steps ? fmt::format(", {} fp16 steps skipped", s.skipped_steps) : "");
    return 0;
  };
}

}  // namespace ft::app
