// ft report's reader and page on run directories written here by hand as a resumed, restarted and
// damaged run leaves them (torn last line, a line that is not JSON, missing files), and
// TensorBoard's record framing. Real files, no mocks.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include "ckpt/crc32c.h"
#include "core/error.h"
#include "report/report.h"
#include "report/run_records.h"
#include "report/svg.h"
#include "support/subprocess.h"
#include "train/tensorboard.h"

namespace fs = std::filesystem;
using namespace ft;
using ft::test::make_temp_dir;
using ft::test::read_file;

namespace {

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string step_line(int64_t step, double loss, bool skipped = false) {
  return nlohmann::json{{"step", step},
                        {"loss", loss},
                        {"lr", 0.001},
                        {"grad_norm", skipped ? nlohmann::json() : nlohmann::json(1.5)},
                        {"tokens_per_s", 1000.0},
                        {"mfu", 0.1},
                        {"step_time_s", 0.05},
                        {"skipped", skipped},
                        {"loss_scale", 65536.0},
                        {"time",
                         {{"data_s", 0.01},
                          {"compute_s", 0.02},
                          {"comm_s", 0.01},
                          {"optimizer_s", 0.005},
                          {"checkpoint_s", 0.0},
                          {"other_s", 0.005}}},
                        {"memory",
                         {{"param_bytes", 100},
                          {"grad_bytes", 100},
                          {"optimizer_bytes", 200},
                          {"peak_rss_bytes", 1 << 20}}}}
             .dump() +
         "\n";
}

// Every issue of `r` as "file: what" lines.
std::string issues_text(const report::RunRecords& r) {
  std::string text;
  for (const auto& i : r.issues) text += i.file + ": " + i.what + "\n";
  return text;
}

// The number in data-points="N" of the element with data-series="name" ("" when absent).
std::string points_of(const std::string& html, const std::string& series) {
  std::smatch m;
  const std::regex re("data-series=\"" + series + "\" data-points=\"(\\d+)\"");
  return std::regex_search(html, m, re) ? m[1].str() : "";
}

// A run that trained steps 1-5, was killed, restarted by the launcher after a lost node, resumed
// from the checkpoint of step 3, redid 4-5 (new losses) and is still writing step 9.
std::string resumed_run_dir() {
  const std::string dir = make_temp_dir() + "/run";
  fs::create_directories(dir);
  std::string m;
  for (int s = 1; s <= 5; ++s) m += step_line(s, 5.0 - 0.1 * s);
  for (int s = 4; s <= 8; ++s) m += step_line(s, 4.0 - 0.1 * s);
  m += step_line(8, 3.0, /*skipped=*/true);
  m += "{\"step\": 9, \"loss\": 2.";  // torn: being written
  write(dir + "/metrics.jsonl", m);
  std::string r1;
  for (int s = 1; s <= 8; ++s) r1 += step_line(s, 4.0);
  write(dir + "/metrics.rank0.jsonl", r1);
  write(dir + "/metrics.rank1.jsonl", r1.substr(0, r1.size() / 2) + "not json\n" + step_line(8, 1));
  write(dir + "/checkpoints.jsonl",
        "{\"step\":3,\"async\":true,\"stall_s\":0.01,\"previous_write_s\":0}\n"
        "{\"step\":6,\"error\":\"disk full on rank 1\"}\n");
  write(dir + "/events.jsonl",
        "{\"event\":\"start\",\"step\":0,\"restart_count\":0,\"world_size\":2,\"nnodes\":2,"
        "\"device\":\"cpu\",\"ft_version\":\"0.1.0\"}\n"
        "{\"event\":\"start\",\"step\":3,\"restart_count\":1,\"world_size\":3,\"nnodes\":2,"
        "\"device\":\"cpu\",\"ft_version\":\"0.1.0\",\"previous_failure\":{\"kind\":\"node\","
        "\"node_rank\":1,\"hostname\":\"node-b\",\"description\":\"sent no heartbeat\"}}\n");
  return dir;
}

}  // namespace

TEST_CASE("a resumed run's records read as one curve and damage is named, not fatal", "[unit]") {
  const report::RunRecords r = report::read_run(resumed_run_dir());
  REQUIRE(r.steps.size() == 8);
  for (size_t i = 0; i < r.steps.size(); ++i) CHECK(r.steps[i].step == static_cast<int64_t>(i + 1));
  // The restart's records of steps 4 and 5 replace the first attempt's.
  CHECK(r.steps[3].loss == Approx(4.0 - 0.4));
  CHECK(r.steps[2].loss == Approx(5.0 - 0.3));
  REQUIRE(r.skipped.size() == 1);
  CHECK(r.skipped[0].step == 8);
  REQUIRE(r.ranks.size() == 2);
  CHECK(r.ranks.at(0).size() == 8);
  CHECK(r.ranks.at(1).size() == 5);  // 4 before the bad line, then step 8
  CHECK(r.steps[0].busy_s() == Approx(0.04));
  CHECK(r.steps[0].model_state_bytes == 400);
  CHECK_FALSE(r.finished);

  const std::string issues = issues_text(r);
  INFO(issues);
  CHECK_THAT(issues, Catch::Contains("metrics.jsonl: line 12: the last line is incomplete"));
  CHECK_THAT(issues, Catch::Contains("metrics.rank1.jsonl: line 5: not a JSON object"));
  CHECK_THAT(issues, Catch::Contains("preset.json: missing"));
  CHECK_THAT(issues, Catch::Contains("metrics.rank2.jsonl: missing"));  // the start says 3 ranks
  CHECK(r.issues.size() == 4);

  std::vector<std::string> kinds;
  for (const auto& e : r.events) kinds.push_back(report::event_name(e.kind));
  const std::vector<std::string> expected = {"start",  "checkpoint",        "restart",
                                             "resume", "checkpoint failed", "skipped fp16 step"};
  CHECK(kinds == expected);
  bool lost_node = false;
  for (const auto& e : r.events)
    lost_node = lost_node || (e.kind == report::Event::Kind::kRestart &&
                              e.detail.find("lost node: node 1 (node-b)") != std::string::npos);
  CHECK(lost_node);
}

TEST_CASE("a start over after an attempt without a checkpoint, and damage found at a resume",
          "[unit]") {
  const std::string dir = make_temp_dir() + "/run";
  fs::create_directories(dir);
  std::string m;
  for (int s = 1; s <= 6; ++s) m += step_line(s, 5.0 - 0.1 * s);
  write(dir + "/metrics.jsonl", m);
  write(dir + "/events.jsonl",
        "{\"event\":\"start\",\"step\":0,\"device\":\"cpu\",\"model\":\"/m/base\","
        "\"data\":\"/d/chat.jsonl\",\"command\":\"ft train --model /m/base\"}\n"
        "{\"event\":\"start\",\"step\":0,\"device\":\"cpu\",\"started_over\":true,"
        "\"model\":\"/m/base\",\"data\":\"/d/chat.jsonl\"}\n"
        "{\"event\":\"checkpoint_damaged\",\"step\":4,\"dir\":\"run/checkpoints/step-4\","
        "\"reason\":\"meta.json is missing\"}\n"
        "{\"event\":\"start\",\"step\":2,\"device\":\"cpu\",\"model\":\"/m/base\","
        "\"data\":\"/d/chat.jsonl\",\"command\":\"ft train --model /m/base\"}\n");
  const report::RunRecords r = report::read_run(dir);
  std::vector<std::string> kinds;
  for (const auto& e : r.events) kinds.push_back(report::event_name(e.kind));
  const std::vector<std::string> expected = {"start", "started over", "resume",
                                             "checkpoint damaged"};
  CHECK(kinds == expected);
  const std::string html = report::render_report(r);
  CHECK_THAT(html, Catch::Contains("started over") && Catch::Contains("its steps lost") &&
                       Catch::Contains("meta.json is missing"));
  // What the run was given is in the environment table.
  CHECK_THAT(html, Catch::Contains("/d/chat.jsonl") && Catch::Contains("ft train --model /m/base"));
}

TEST_CASE("the page draws every figure with its points, lists the damage, loads nothing",
          "[unit]") {
  const std::string dir = resumed_run_dir();
  const report::ReportResult res = report::write_report(dir, dir + "/page.html");
  CHECK(res.path == dir + "/page.html");
  CHECK(res.steps == 8);
  const std::string html = read_file(res.path);
  CHECK(points_of(html, "loss") == "8");
  CHECK(points_of(html, "loss_smoothed") == "8");
  CHECK(points_of(html, "lr") == "8");
  CHECK(points_of(html, "grad_norm") == "8");
  CHECK(points_of(html, "tokens_per_s") == "8");
  CHECK(points_of(html, "mfu") == "8");
  CHECK(points_of(html, "skipped") == "1");
  for (const char* part : {"data", "compute", "comm", "optimizer", "checkpoint", "other"})
    CHECK(points_of(html, std::string("time\\.") + part + "_s") == "8");
  CHECK(points_of(html, "rank_busy") == "16");  // 2 ranks x 8 columns
  CHECK(points_of(html, "memory\\.peak") == "2");
  CHECK(points_of(html, "timeline\\.restart") == "1");
  CHECK(points_of(html, "timeline\\.checkpoint") == "1");
  CHECK_THAT(html, Catch::Contains("data-issues=\"4\""));
  CHECK_THAT(html, Catch::Contains("lost node: node 1 (node-b)"));
  // Self-contained: no script, no URL, nothing fetched.
  CHECK(html.find("<script") == std::string::npos);
  CHECK(html.find("http:") == std::string::npos);
  CHECK(html.find("https:") == std::string::npos);
  CHECK(html.find("src=") == std::string::npos);
  CHECK(html.find("url(") == std::string::npos);
}

TEST_CASE("a long run's page stays small: series thinned, spikes kept", "[unit]") {
  const std::string dir = make_temp_dir() + "/long";
  fs::create_directories(dir);
  std::string m;
  for (int s = 1; s <= 20000; ++s) m += step_line(s, s == 12345 ? 50.0 : 5.0 - s * 1e-4);
  write(dir + "/metrics.jsonl", m);
  const std::string html = read_file(report::write_report(dir).path);
  CHECK(std::stoi(points_of(html, "loss")) <= 2000);
  CHECK(std::stoi(points_of(html, "loss")) >= 1000);
  CHECK(std::stoi(points_of(html, "time\\.compute_s")) == 1000);
  CHECK(html.size() < 400000);
  // The spike survives thinning: the y axis reaches 50.
  CHECK_THAT(html, Catch::Contains(">50</text>"));
  const report::Series s = report::thin_extremes(
      {"x", "", "#000", {1, 2, 3, 4, 5, 6, 7, 8}, {1, 9, 2, 3, 0, 4, 5, 6}}, 4);
  const std::vector<double> kept = {1, 2, 5, 8};  // each half's lowest and highest, in x order
  CHECK(s.x == kept);
}

// Found by the full suite: `ft train` of one step wrote its report forever (16 GB and the OOM
// killer): the loss and its smoothed value a last bit apart made a tick step that never advanced.
TEST_CASE("a one-step run, and values a last bit apart, draw axes with a few ticks", "[unit]") {
  const std::string dir = make_temp_dir() + "/one";
  fs::create_directories(dir);
  const double loss = 6.997863292694092;
  write(dir + "/metrics.jsonl", step_line(1, loss));
  const std::string html = read_file(report::write_report(dir).path);
  CHECK(points_of(html, "loss") == "1");
  CHECK(html.size() < 200000);
  write(dir + "/metrics.jsonl",
        step_line(1, loss) + step_line(2, std::nextafter(loss, 10.0)) + step_line(3, 1e300));
  CHECK(read_file(report::write_report(dir).path).size() < 200000);
}

TEST_CASE("records with fields of other types are left out and named, never thrown", "[unit]") {
  const std::string dir = make_temp_dir() + "/odd";
  fs::create_directories(dir);
  write(dir + "/metrics.jsonl",
        step_line(1, 5.0) + R"({"step":2,"loss":4.0,"skipped":"no"})" + "\n" + step_line(3, 3.0));
  write(dir + "/events.jsonl", R"({"event":"start","step":0,"world_size":"two","nnodes":1})"
                               "\n"
                               R"({"event":"preempted","step":3,"signal":9})"
                               "\n");
  write(dir + "/checkpoints.jsonl", R"({"step":2,"error":false})"
                                    "\n");
  write(dir + "/metrics.rank99999999999.jsonl", step_line(1, 1.0));
  const report::RunRecords r = report::read_run(dir);
  CHECK(r.steps.size() == 2);
  const std::string issues = issues_text(r);
  INFO(issues);
  CHECK_THAT(issues, Catch::Contains("metrics.jsonl: 1 record(s) without"));
  CHECK_THAT(issues, Catch::Contains("events.jsonl: 2 record(s) with fields of unexpected types"));
  CHECK_THAT(issues, Catch::Contains("checkpoints.jsonl: 1 record(s) with fields"));
  CHECK(r.ranks.empty());  // not a rank number ft writes
  CHECK_NOTHROW(report::render_report(r));
}

TEST_CASE("an empty or absent run directory", "[unit]") {
  const std::string dir = make_temp_dir();
  const report::RunRecords r = report::read_run(dir);
  CHECK(r.steps.empty());
  const std::string html = report::render_report(r);
  CHECK_THAT(html, Catch::Contains("no records yet"));
  CHECK_THROWS_AS(report::read_run(dir + "/nothing"), ConfigError);
  CHECK_THROWS_WITH(report::read_run(dir + "/nothing"), Catch::Contains("is not a directory"));
}

TEST_CASE("TensorBoard records: TFRecord framing with masked CRC-32C, protobuf Event", "[unit]") {
  const std::string event = train::encode_event(1.5, 7, "", {{"loss", 2.0}});
  // wall_time (tag 0x09, 8 bytes), step (0x10, varint 7), summary (0x2a, length, then
  // value (0x0a, length, tag (0x0a, 4, "loss"), simple_value (0x15, 4 bytes))).
  double wall = 0;
  REQUIRE(event.size() == 1 + 8 + 2 + 2 + 2 + 6 + 5);
  CHECK(static_cast<unsigned char>(event[0]) == 0x09);
  std::memcpy(&wall, event.data() + 1, 8);
  CHECK(wall == 1.5);
  CHECK(event.substr(9, 2) == std::string("\x10\x07", 2));
  CHECK(event.substr(11, 2) == std::string("\x2a\x0d", 2));
  CHECK(event.substr(13, 2) == std::string("\x0a\x0b", 2));
  CHECK(event.substr(15, 6) == std::string("\x0a\x04loss", 6));
  CHECK(static_cast<unsigned char>(event[21]) == 0x15);
  float v = 0;
  std::memcpy(&v, event.data() + 22, 4);
  CHECK(v == 2.0f);

  const std::string rec = train::tfrecord(event);
  REQUIRE(rec.size() == 8 + 4 + event.size() + 4);
  uint64_t len = 0;
  std::memcpy(&len, rec.data(), 8);
  CHECK(len == event.size());
  const auto masked = [](const void* p, size_t n) {
    const uint32_t c = ckpt::crc32c(p, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
  };
  uint32_t crc_len = 0, crc_data = 0;
  std::memcpy(&crc_len, rec.data() + 8, 4);
  std::memcpy(&crc_data, rec.data() + 12 + event.size(), 4);
  CHECK(crc_len == masked(rec.data(), 8));
  CHECK(crc_data == masked(event.data(), event.size()));
  CHECK(rec.substr(12, event.size()) == event);

  // The writer's file starts with the file_version event.
  const std::string dir = make_temp_dir() + "/tb";
  train::EventWriter w(dir, 1);
  w.write(1, {{"loss", 3.0}});
  const std::string file = read_file(w.path());
  CHECK(fs::path(w.path()).filename().string().rfind("events.out.tfevents.", 0) == 0);
  CHECK(file.find("brain.Event:2") == 12 + 1 + 8 + 2 + 2);
  CHECK(file.find("loss") != std::string::npos);
  // The session start: Event{wall_time, step 5, session_log (7) {status (1): START (1)}}, as
  // TensorBoard's protobuf library encodes it.
  const std::string start = train::encode_session_start(1.5, 5);
  CHECK(start.substr(9) == std::string("\x10\x05\x3a\x02\x08\x01", 6));
}

TEST_CASE("a run with --model shows the model's config.json, not the preset's unused shape, "
          "and changed settings are on the timeline",
          "[unit]") {
  const std::string dir = make_temp_dir() + "/run";
  fs::create_directories(dir);
  write(dir + "/metrics.jsonl", step_line(1, 2.0) + step_line(2, 1.9));
  write(dir + "/preset.json",
        R"({"model": {"hidden_size": 4096, "num_layers": 32, "require_dir": true},
            "train": {"lr": 0.0002}})");
  write(dir + "/events.jsonl",
        "{\"event\":\"start\",\"step\":0,\"world_size\":1,\"model\":\"/m/SmolLM2\"}\n"
        "{\"event\":\"start\",\"step\":1,\"world_size\":1,\"model\":\"/m/SmolLM2\"}\n"
        "{\"event\":\"settings_changed\",\"step\":1,\"resume_changed\":true,\"changes\":"
        "[{\"key\":\"train.lr\",\"was\":0.0002,\"now\":0.0001,\"effect\":\"computes\"}]}\n");
  const std::string html = read_file(report::write_report(dir, dir + "/page.html").path);
  CHECK_THAT(html, Catch::Contains("/m/SmolLM2/config.json (with --model the preset&#39;s shape "
                                   "keys are not used)") ||
                       Catch::Contains("/m/SmolLM2/config.json (with --model the preset's shape "
                                       "keys are not used)"));
  CHECK(html.find("4096") == std::string::npos);
  CHECK_THAT(html, Catch::Contains("&quot;require_dir&quot;: true") ||
                       Catch::Contains("\"require_dir\": true"));
  CHECK_THAT(html, Catch::Contains("settings changed") &&
                       Catch::Contains("with --resume-changed: train.lr 0.0002 -&gt; 0.0001"));
}
