// `ft report RUN_DIR [--output FILE.html]`: one self-contained HTML page of a run's records
// (runtime/report/). What was missing or damaged is listed on the page and on stderr; the page is
// written all the same.
#include <fmt/format.h>

#include "commands.h"
#include "report/report.h"

namespace ft::app {

Run add_report(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "report",
      "Write an HTML page (inline SVG, no network) of a run's curves, step-time breakdown, ranks, "
      "memory and timeline; works on a running, resumed or damaged run directory");
  auto run_dir = std::make_shared<std::string>();
  auto output = std::make_shared<std::string>();
  cmd->add_option("RUN_DIR", *run_dir, "The --output directory of an ft train run")->required();
  cmd->add_option("--output,-o", *output, "The page to write (default: RUN_DIR/report.html)");
  return [run_dir, output]() -> int {
    const report::ReportResult r = report::write_report(*run_dir, *output);
    for (const auto& i : r.issues)
      fmt::print(stderr, "ft report: warning: {}: {}\n", i.file, i.what);
    fmt::print("ft report: {} steps -> {}\n", r.steps, r.path);
    return 0;
  };
}

}  // namespace ft::app
