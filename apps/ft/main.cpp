// ft: launcher and runtime for fine-tuning LLMs on many GPUs. main() only parses, dispatches and
// maps exceptions to exit codes; every subcommand lives in cmd_*.cpp.
#include <cstdio>
#include <cstring>
#include <map>

#include "comm/process_group.h"
#include "commands.h"
#include "core/build_info.h"
#include "core/error.h"
#include "core/worker_contract.h"

int main(int argc, char** argv) {
  // Everything after the first "--" belongs to the launched program, untouched by CLI11.
  std::vector<std::string> args(argv + 1, argv + argc), program;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--") {
      program.assign(args.begin() + i + 1, args.end());
      args.resize(i);
      break;
    }
  }

  CLI::App app{"ft: launch and fine-tune large language models on many GPUs across many machines",
               "ft"};
  app.require_subcommand(0, 1);
  bool show_version = false;
  app.add_flag("--version", show_version, "Print ft, LibTorch, CUDA and NCCL versions and exit");
  std::map<std::string, ft::app::Run> runs;
  auto* version_cmd = app.add_subcommand("version", "Print ft, LibTorch, CUDA and NCCL versions");
  runs["launch"] = ft::app::add_launch(app, program);
  runs["comm-check"] = ft::app::add_comm_check(app);
  runs["presets"] = ft::app::add_presets(app);
  runs["train"] = ft::app::add_train(app);
  runs["eval"] = ft::app::add_eval(app);
  runs["export"] = ft::app::add_export(app);
  runs["plan"] = ft::app::add_plan(app);
  runs["data"] = ft::app::add_data(app);
  runs["doctor"] = ft::app::add_doctor(app);
  runs["report"] = ft::app::add_report(app);

  try {
    std::vector<std::string> rev(args.rbegin(), args.rend());
    app.parse(rev);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (show_version || version_cmd->parsed()) {
      std::fputs(ft::version_text(ft::build_info()).c_str(), stdout);
      return 0;
    }
    for (auto* sub : app.get_subcommands()) return runs.at(sub->get_name())();
    std::fputs(app.help().c_str(), stdout);
    return 0;
  } catch (const std::exception& e) {
    // A collective or the store broke under this process: its peer's failure is the news.
    if (auto lost = ft::comm::peer_failure(e)) {
      std::fprintf(stderr,
                   "ft: error: lost the connection to another rank: %s\n"
                   "ft: a peer rank or node probably failed first; its own output or the "
                   "launcher's summary says why (exit %d)\n",
                   lost->c_str(), ft::contract::kExitPeerLost);
      return ft::contract::kExitPeerLost;
    }
    if (const auto* error = dynamic_cast<const ft::Error*>(&e)) {
      std::fprintf(stderr, "ft: error: %s\n", e.what());
      return error->exit_code();
    }
    std::fprintf(stderr, "ft: error: %s\n", e.what());
    return 1;
  }
}
