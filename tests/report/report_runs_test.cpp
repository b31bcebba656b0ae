// ft report on real runs: `ft train` writes the page at the end, a 2-rank job's page has both
// ranks, a preempted and resumed run reads as one curve with the preemption and the resume on its
// timeline, and a damaged run directory still renders and says what is missing.
#include <signal.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <regex>

#include "support/runs.h"
#include "support/subprocess.h"

namespace fs = std::filesystem;
using namespace ft::test;

namespace {

std::string points_of(const std::string& html, const std::string& series) {
  std::smatch m;
  const std::regex re("data-series=\"" + series + "\" data-points=\"(\\d+)\"");
  return std::regex_search(html, m, re) ? m[1].str() : "";
}

Finished run(const std::vector<std::string>& argv,
             const std::map<std::string, std::string>& env = {}) {
  return run_to_end(argv, env, make_temp_dir() + "/out.txt", 240);
}

}  // namespace

TEST_CASE("ft train of a 2-rank job writes report.html with every step and both ranks drawn",
          "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  Finished r = run(tiny_job_argv(2, out, {"train.max_steps=6", "output.save_every=3"}));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("ft train: report " + out + "/report.html"));
  const std::string html = read_file(out + "/report.html");
  CHECK(points_of(html, "loss") == "6");
  CHECK(points_of(html, "time\\.compute_s") == "6");
  CHECK_THAT(html, Catch::Contains("data-ranks=\"2\""));
  CHECK(points_of(html, "memory\\.peak") == "2");
  CHECK(points_of(html, "plan\\.step_peak") == "1");       // plan.json was written
  CHECK(points_of(html, "timeline\\.checkpoint") == "2");  // steps 3 and 6
  CHECK(points_of(html, "timeline\\.finished") == "1");
  CHECK(html.find("data-issues") == std::string::npos);  // nothing missing
  CHECK_THAT(html, Catch::Contains("<th>world_size</th><td>2</td>"));

  // ft report writes the same page anywhere.
  const std::string page = make_temp_dir() + "/page.html";
  CHECK(run_ft({"report", out, "--output", page}, make_temp_dir() + "/r.txt") == 0);
  CHECK(points_of(read_file(page), "loss") == "6");
}

TEST_CASE(
    "a running, then preempted, then resumed run: one curve, the preemption and the resume on "
    "the timeline",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const auto argv = tiny_job_argv(2, out, {"train.max_steps=12", "output.save_every=100"});
  // Slow steps, so that SIGTERM lands mid-run.
  Child c = start(argv, {{"FT_FAULT_STEP_DELAY", "0:0.15"}}, make_temp_dir() + "/out.txt");
  wait_for_steps(out, 4, std::chrono::steady_clock::now() + std::chrono::seconds(120));
  // While it runs: the page of what is written so far.
  const std::string live = make_temp_dir() + "/live.html";
  CHECK(run_ft({"report", out, "--output", live}, make_temp_dir() + "/r.txt") == 0);
  CHECK(std::stoi("0" + points_of(read_file(live), "loss")) >= 4);
  CHECK_THAT(read_file(live), Catch::Contains("running or stopped"));
  ::kill(c.pid, SIGTERM);
  const int code = wait_for(c, 60).value_or(-1);
  INFO(output_tail(c.output()));
  REQUIRE(code == 75);
  const std::string stopped = read_file(out + "/report.html");  // written by the preempted run
  CHECK(points_of(stopped, "timeline\\.preempted") == "1");
  const size_t done = read_metrics(out).size();
  Finished again = run(argv);
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  const std::string html = read_file(out + "/report.html");
  CHECK(points_of(html, "loss") == "12");
  CHECK(points_of(html, "timeline\\.preempted") == "1");
  CHECK(points_of(html, "timeline\\.start / resume") == "2");
  CHECK_THAT(html, Catch::Contains("from the checkpoint of step " + std::to_string(done)));
  CHECK(points_of(html, "timeline\\.finished") == "1");
}

TEST_CASE("a worker killed mid-run: the launcher's restart and its cause are on the timeline",
          "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  Child c = start(
      ft_launch_argv(
          {"--nproc-per-node", "2", "--master-port", std::to_string(free_port()), "--max-restarts",
           "1", "--term-grace", "3"},
          ft_train_argv({"--preset", "tiny-demo", "--output", out},
                        {"train.max_steps=10", "output.save_every=2", "output.async_save=false"})),
      {{"FT_FAULT_STEP_DELAY", "0:0.1"}}, make_temp_dir() + "/out.txt");
  wait_for_steps(out, 5, std::chrono::steady_clock::now() + std::chrono::seconds(120));
  std::vector<pid_t> workers = children_of(c.pid);
  REQUIRE(workers.size() == 2);
  const pid_t rank1 = rank_of_worker(workers[0]) == 1 ? workers[0] : workers[1];
  REQUIRE(rank_of_worker(rank1) == 1);
  ::kill(rank1, SIGKILL);
  const auto rc = wait_for(c, 180);
  if (!rc) kill_and_reap(c);
  INFO(output_tail(c.output()));
  REQUIRE(rc.value_or(-1) == 0);
  // The restarted workers were told why, and wrote it down.
  const auto events = read_jsonl(out + "/events.jsonl");
  REQUIRE(events.size() == 3);  // start, start after the restart, finished
  CHECK(events[1]["restart_count"] == 1);
  CHECK(events[1]["previous_failure"]["kind"] == "worker");
  CHECK(events[1]["previous_failure"]["rank"] == 1);
  const std::string html = read_file(out + "/report.html");
  CHECK(points_of(html, "loss") == "10");
  CHECK(points_of(html, "timeline\\.restart") == "1");
  CHECK_THAT(html, Catch::Contains("launcher round 1: worker failed: rank 1 on node 0"));
  CHECK_THAT(html, Catch::Contains("SIGKILL"));
}

TEST_CASE("a damaged run directory still renders and says what is missing", "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  Finished r = run(tiny_job_argv(1, out, {"train.max_steps=5"}));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  // Cut the last record in half, lose the preset.
  std::string metrics = read_file(out + "/metrics.jsonl");
  metrics.resize(metrics.size() - 40);
  std::ofstream(out + "/metrics.jsonl", std::ios::trunc) << metrics;
  fs::remove(out + "/preset.json");
  const std::string log = make_temp_dir() + "/r.txt";
  REQUIRE(run_ft({"report", out}, log) == 0);
  const std::string said = read_file(log);
  CHECK_THAT(said, Catch::Contains("ft report: warning: metrics.jsonl: line 5: the last line is "
                                   "incomplete"));
  CHECK_THAT(said, Catch::Contains("ft report: warning: preset.json: missing"));
  CHECK_THAT(said, Catch::Contains("ft report: 4 steps -> " + out + "/report.html"));
  const std::string html = read_file(out + "/report.html");
  CHECK(points_of(html, "loss") == "4");
  CHECK_THAT(html, Catch::Contains("data-issues=\"2\""));
  CHECK_THAT(html, Catch::Contains("preset.json is missing"));

  // Not a run directory at all: a typed error, exit 2, naming it.
  const std::string bad = make_temp_dir() + "/b.txt";
  CHECK(run_ft({"report", out + "/nowhere"}, bad) == 2);
  CHECK_THAT(read_file(bad), Catch::Contains(out + "/nowhere is not a directory"));
}
