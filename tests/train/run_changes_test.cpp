// What differs between the run a directory holds and a command (train/run_changes.h): which
// changes are free, which change what the run computes or the state's shape, the global batch
// judged as one, and the refusal's words.
#include "train/run_changes.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "config/settings.h"
#include "core/error.h"
#include "support/subprocess.h"

using namespace ft;
using namespace ft::train;
using config::OnResume;

namespace {

RunInputs inputs(const std::vector<std::string>& sets, int64_t world_size = 1,
                 const std::string& model = "") {
  RunInputs in;
  in.preset = config::resolve_settings("tiny-demo", sets).resolved;
  in.model = model;
  in.model_config = model.empty() ? "" : "0000abcd";
  in.world_size = world_size;
  return in;
}

const SettingChange* find(const std::vector<SettingChange>& changes, const std::string& key) {
  for (const auto& c : changes)
    if (c.key == key) return &c;
  return nullptr;
}

}  // namespace

TEST_CASE("run changes: the same command changes nothing, each key has its schema effect",
          "[unit]") {
  const RunInputs was = inputs({"train.micro_batch=2"});
  CHECK(changes_between(was, inputs({"train.micro_batch=2"}), false).empty());

  const auto changes = changes_between(
      was,
      inputs({"train.micro_batch=2", "train.lr=1e-4", "train.max_steps=500", "output.save_every=7",
              "model.hidden_size=64", "strategy.kind=zero3"}),
      false);
  REQUIRE(changes.size() == 5);
  CHECK(find(changes, "train.lr")->effect == OnResume::kComputes);
  CHECK(find(changes, "train.max_steps")->effect == OnResume::kFree);
  CHECK(find(changes, "output.save_every")->effect == OnResume::kFree);
  CHECK(find(changes, "strategy.kind")->effect == OnResume::kFree);
  CHECK(find(changes, "model.hidden_size")->effect == OnResume::kState);
  CHECK(change_text(*find(changes, "train.lr")) == "train.lr 0.003 -> 0.0001");
  CHECK(change_json(*find(changes, "model.hidden_size"))["effect"] == "state");
}

TEST_CASE("run changes: with --model, config.json stands for the model section's shape", "[unit]") {
  const RunInputs was = inputs({}, 1, "/m/a");
  RunInputs now = inputs({"model.hidden_size=64"}, 1, "/m/a");
  CHECK(changes_between(was, now, false).empty());
  now.model = "/m/b";  // the same config.json elsewhere: other weights may be there
  auto changes = changes_between(was, now, false);
  REQUIRE(changes.size() == 1);
  CHECK(changes[0].effect == OnResume::kComputes);
  now.model_config = "ffff0000";  // another model
  changes = changes_between(was, now, false);
  REQUIRE(changes.size() == 1);
  CHECK(changes[0].effect == OnResume::kState);
  CHECK_THROWS_WITH(judge_changes(changes, "out", /*resume_changed=*/true),
                    Catch::Contains("--resume-changed cannot continue it") &&
                        Catch::Contains("--model \"/m/a\""));
}

TEST_CASE("run changes: micro-batch, accumulation and ranks are judged by the global batch",
          "[unit]") {
  const RunInputs was = inputs({"train.micro_batch=4", "train.grad_accum=2"}, 2);  // 16
  // 2 x 2 x 4 = 16: free, each said with the batch it keeps.
  auto kept = changes_between(was, inputs({"train.micro_batch=2", "train.grad_accum=2"}, 4), false);
  REQUIRE(kept.size() == 2);
  CHECK(find(kept, "train.micro_batch")->effect == OnResume::kFree);
  CHECK(find(kept, "ranks")->note == "the global batch stays 16 sequences");
  CHECK(judge_changes(kept, "out", false).size() == 2);
  // 4 x 2 x 1 = 8: one change of what the run computes.
  auto halved =
      changes_between(was, inputs({"train.micro_batch=4", "train.grad_accum=2"}, 1), false);
  REQUIRE(halved.size() == 1);
  CHECK(change_text(halved[0]) ==
        "global batch 4 x 2 x 2 = 16 -> 4 x 2 x 1 = 8 (train.micro_batch x train.grad_accum x "
        "ranks)");
  CHECK_THROWS_WITH(judge_changes(halved, "out", false),
                    Catch::Contains("add --resume-changed") && Catch::Contains("another --output"));
  CHECK(judge_changes(halved, "out", true).size() == 1);
  // An elastic launcher's later round with fewer ranks goes on as torchrun's would.
  auto elastic =
      changes_between(was, inputs({"train.micro_batch=4", "train.grad_accum=2"}, 1), true);
  REQUIRE(elastic.size() == 1);
  CHECK(elastic[0].key == "ranks");
  CHECK(elastic[0].effect == OnResume::kFree);
}

TEST_CASE("run changes: the refusal lists what changed and how to continue as it was", "[unit]") {
  RunInputs was = inputs({}), now = inputs({"train.lr=1e-4", "lora.enabled=true"});
  was.data = nlohmann::json::array({{{"path", "/d/a.jsonl"}, {"weight", 1.0}, {"bytes", 10}}});
  now.data = nlohmann::json::array({{{"path", "/d/a.jsonl"}, {"weight", 1.0}, {"bytes", 12}}});
  const auto changes = changes_between(was, now, false);
  REQUIRE(changes.size() == 3);
  try {
    judge_changes(changes, "runs/a", false);
    FAIL("not refused");
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    CHECK_THAT(m, Catch::Contains("--output runs/a holds a run with other settings"));
    CHECK_THAT(m, Catch::Contains("\n  train.lr 0.003 -> 0.0001\n"));
    CHECK_THAT(m,
               Catch::Contains("lora.enabled false -> true [the saved state has another shape]"));
    CHECK_THAT(m, Catch::Contains("--set train.lr=0.003 --set lora.enabled=false --data "
                                  "/d/a.jsonl:1"));
    CHECK_THAT(m, Catch::Contains("--resume-changed cannot continue it: lora.enabled"));
  }
}

TEST_CASE("run changes: a directory's records are read back, bad ones refused by name", "[unit]") {
  const std::string dir = test::make_temp_dir();
  CHECK_FALSE(recorded_inputs(dir).has_value());
  const RunInputs in = inputs({"train.lr=1e-4"}, 2, "/m/a");
  { std::ofstream(dir + "/preset.json") << in.preset.dump(2); }
  auto old = recorded_inputs(dir);  // a run of an ft before run.json
  REQUIRE(old.has_value());
  CHECK_FALSE(old->has_inputs);
  { std::ofstream(dir + "/run.json") << to_json(in).dump(2); }
  auto back = recorded_inputs(dir);
  REQUIRE(back.has_value());
  CHECK(back->has_inputs);
  CHECK(changes_between(*back, in, false).empty());
  { std::ofstream(dir + "/run.json") << "{\"model\": 3}"; }
  CHECK_THROWS_WITH(recorded_inputs(dir), Catch::Contains("run.json: not the record ft writes"));
  { std::ofstream(dir + "/preset.json") << "{not json"; }
  CHECK_THROWS_WITH(recorded_inputs(dir),
                    Catch::Contains("preset.json") && Catch::Contains("choose another --output"));
}
