// `ft doctor [--preset NAME|FILE] [--model DIR|ORG/NAME] [--set k=v ...] [--max-size SIZE]
// [--json FILE]`: run under `ft launch` with the job's layout, it measures devices, collectives and
// node pairs, names the bottleneck and, with a preset, predicts the step time (runtime/doctor/).
#include "comm/dist_env.h"
#include "commands.h"
#include "doctor/doctor.h"
#include "plan/resources.h"
#include "train_options.h"

namespace ft::app {

Run add_doctor(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "doctor",
      "Measure devices, collectives and the links between nodes, name the bottleneck and, with "
      "--preset, predict the step time and scaling (run under `ft launch` with the job's layout)");
  struct Args {
    doctor::DoctorOptions o;
    std::string max_size;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--preset", a->o.preset,
                  "Shipped preset name or a preset JSON file: predict its step time");
  cmd->add_option("--model", a->o.model_dir,
                  "Hugging Face model directory, or a hub id the local hub cache holds: its "
                  "files' read throughput, and the model the prediction is for (default: the "
                  "preset's model shape)")
      ->type_name("DIR|ORG/NAME");
  cmd->add_option("--set", a->o.sets, "Override a preset key: --set train.micro_batch=2");
  cmd->add_option("--max-size", a->max_size,
                  "Largest collective timed, e.g. 16MiB (default 256MiB on GPUs, 64MiB on CPUs; "
                  "sizes stop early once a call takes a second)");
  cmd->add_option("--seconds-per-size", a->o.seconds_per_size,
                  "Time spent timing each collective size")
      ->check(CLI::Range(0.001, 60.0));
  cmd->add_option("--json", a->o.json_path, "Write every figure to this file as JSON (rank 0)");
  return [a]() -> int {
    if (!a->max_size.empty()) a->o.max_bytes = plan::parse_size(a->max_size, "--max-size");
    resolve_model_option(a->o.model_dir, "ft doctor", "--model",
                         comm::read_dist_env().rank == 0 ? stdout : nullptr);
    return doctor::run_doctor(a->o);
  };
}

}  // namespace ft::app
