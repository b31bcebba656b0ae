// `ft report`: one self-contained HTML page (inline SVG and CSS; no script, no network) that shows
// a run directory's records: loss and eval loss, learning rate, grad norm, throughput and MFU, the
// step-time breakdown, a per-rank heat map, memory against the plan, the timeline of checkpoints,
// restarts and preemptions, skipped fp16 steps, the preset and the environment (docs/report.md).
// Reads only; the page is written through a durable file. Thread-safe.
#pragma once

#include <string>
#include <vector>

#include "report/run_records.h"

namespace ft::report {

// The page of `records` (what render_report draws from is read_run's).
std::string render_report(const RunRecords& records);

struct ReportResult {
  std::string path;           // the page written
  std::vector<Issue> issues;  // what was missing or damaged (also listed on the page)
  int64_t steps = 0;          // steps drawn
};

// Reads `run_dir` and writes its page to `output` ("" = <run_dir>/report.html). Throws ConfigError
// when run_dir is not a directory, and io errors when the page cannot be written.
ReportResult write_report(const std::string& run_dir, const std::string& output = "");

}  // namespace ft::report
