// Preset schema and resolution: shipped presets validate, inheritance and --set work, and every bad
// input names its file / key with a suggestion.
#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <regex>

#include "config/foreign_keys.h"
#include "config/preset.h"
#include "config/schema.h"
#include "core/error.h"
#include "core/json.h"
#include "support/subprocess.h"

using namespace ft::config;
using nlohmann::json;

TEST_CASE("every shipped preset resolves and validates", "[unit]") {
  std::vector<std::string> names;
  for (const auto& p : shipped_presets()) names.push_back(p.name);
  for (const char* want : {"tiny-demo", "tiny-lora", "lora-7b", "full-7b", "lora-70b", "qlora-70b",
                           "full-70b", "lora", "full"})
    CHECK(std::find(names.begin(), names.end(), want) != names.end());
  for (const auto& n : names) {
    INFO(n);
    json p = resolve_preset(n, {});
    for (const auto& s : preset_schema()) {
      std::string pointer = "/" + s.key;
      std::replace(pointer.begin(), pointer.end(), '.', '/');
      CHECK(p.contains(json::json_pointer(pointer)));
    }
    CHECK_FALSE(preset_description(n).empty());
  }
  json l7 = resolve_preset("lora-7b", {});
  CHECK(l7["lora"]["r"] == 16);
  CHECK(l7["lora"]["alpha"] == 32.0);
  CHECK(l7["model"]["hidden_size"] == 4096);
  CHECK(l7["precision"]["mode"] == "bf16");
  json f70 = resolve_preset("full-70b", {});
  CHECK(f70["model"]["num_kv_heads"] == 8);
  CHECK(f70["strategy"]["kind"] == "zero3");
}

TEST_CASE("base inheritance and --set overrides with type checks", "[unit]") {
  json t = resolve_preset("tiny-lora", {"train.lr=5e-4", "lora.target_modules=q_proj,v_proj",
                                        "train.max_steps=7", "data.pack=false"});
  CHECK(t["lora"]["enabled"] == true);      // from tiny-lora
  CHECK(t["model"]["hidden_size"] == 128);  // from its base tiny-demo
  CHECK(t["train"]["lr"] == 5e-4);          // --set
  CHECK(t["train"]["max_steps"] == 7);
  CHECK(t["data"]["pack"] == false);
  CHECK(t["lora"]["target_modules"] == json::array({"q_proj", "v_proj"}));
  CHECK(t["train"]["beta2"] == 0.999);  // schema default

  std::string dir = ft::test::make_temp_dir();
  std::ofstream(dir + "/mine.json") << R"({"base": "lora-7b", "train": {"lr": 1e-4}})";
  json m = resolve_preset(dir + "/mine.json", {});
  CHECK(m["train"]["lr"] == 1e-4);
  CHECK(m["lora"]["r"] == 16);
  // A base given as a file relative to the preset.
  std::ofstream(dir + "/child.json") << R"({"base": "mine.json", "lora": {"r": 8}})";
  json c = resolve_preset(dir + "/child.json", {});
  CHECK(c["lora"]["r"] == 8);
  CHECK(c["train"]["lr"] == 1e-4);
}

TEST_CASE("bad presets are refused naming file and key", "[unit]") {
  std::string dir = ft::test::make_temp_dir();
  auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  std::string f = file("typo.json", R"({"base": "tiny-demo", "train": {"learning_rate": 1}})");
  CHECK_THROWS_WITH(resolve_preset(f, {}),
                    Catch::Contains("typo.json: unknown key \"train.learning_rate\" (did you mean "
                                    "\"train.lr\"?"));
  f = file("typo2.json", R"({"train": {"micro_bach": 2}})");
  CHECK_THROWS_WITH(resolve_preset(f, {}), Catch::Contains("did you mean \"train.micro_batch\"?"));
  f = file("type.json", R"({"train": {"micro_batch": "8"}})");
  CHECK_THROWS_WITH(
      resolve_preset(f, {}),
      Catch::Contains("type.json: \"train.micro_batch\" must be an integer, got \"8\""));
  f = file("range.json", R"({"train": {"micro_batch": 0}})");
  CHECK_THROWS_WITH(resolve_preset(f, {}),
                    Catch::Contains("\"train.micro_batch\" must be in [1, 1048576], got 0"));
  f = file("choice.json", R"({"strategy": {"kind": "zero2"}})");
  CHECK_THROWS_WITH(resolve_preset(f, {}), Catch::Contains("must be one of ddp|zero3|fsdp"));
  f = file("list.json", R"({"lora": {"target_modules": ["q_proj", "qkv"]}})");
  CHECK_THROWS_WITH(resolve_preset(f, {}), Catch::Contains("\"lora.target_modules\""));
  f = file("json.json", R"({"train": {)");
  CHECK_THROWS_WITH(resolve_preset(f, {}), Catch::Contains("json.json: not valid JSON"));
  f = file("cycle_a.json", R"({"base": "cycle_b.json"})");
  file("cycle_b.json", R"({"base": "cycle_a.json"})");
  CHECK_THROWS_WITH(resolve_preset(f, {}), Catch::Contains("preset base cycle"));
  CHECK_THROWS_WITH(resolve_preset("no-such-preset", {}), Catch::Contains("shipped presets: "));
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"train.lr"}),
                    Catch::Contains("--set expects key.path=value"));
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"train.lr=fast"}),
                    Catch::Contains("--set: \"train.lr\" must be a number, got 'fast'"));
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"train.lrr=1"}),
                    Catch::Contains("unknown key \"train.lrr\" (did you mean \"train.lr\"?)"));
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"train=1"}), Catch::Contains("section"));
  CHECK_THROWS_AS(resolve_preset("tiny-demo", {"precision.mode=fp8"}), ft::ConfigError);
}

TEST_CASE("data.sources: typed entries, and bad entries refused naming the entry and key",
          "[unit]") {
  std::string dir = ft::test::make_temp_dir();
  auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  const ft::config::Settings s = settings_from_json(
      resolve_preset(file("mix.json", R"({"base": "tiny-demo", "data": {"format": "auto",
        "sources": [{"path": "a.jsonl", "weight": 0.7, "max_records": 100},
                    {"path": "b.jsonl", "weight": 3, "name": "bee", "format": "chat",
                     "template": "chatml", "columns": {"messages": "conv", "system": "sys"},
                     "tags": {"role": "speaker", "assistant": ["bot"]}, "tools": "t.json"}]},
        "eval": {"split": 0.02}})"),
                     {}),
      "test");
  REQUIRE(s.data.sources.size() == 2);
  CHECK(s.data.sources[0].path == "a.jsonl");
  CHECK(s.data.sources[0].weight == 0.7);
  CHECK(s.data.sources[0].max_records == 100);
  CHECK(s.data.sources[0].format.empty());  // data.format's
  CHECK(s.data.sources[1].name == "bee");
  CHECK(s.data.sources[1].weight == 3.0);
  CHECK(s.data.sources[1].format == "chat");
  CHECK(s.data.sources[1].chat_template == "chatml");
  // A source's own columns and tags replace only the keys it gives.
  CHECK_FALSE(s.data.sources[0].shape.messages.has_value());
  const ft::config::RecordShapeSettings own = s.data.sources[1].shape.over(s.data.shape);
  CHECK(own.messages == "conv");
  CHECK(own.system == "sys");
  CHECK(own.tools == s.data.shape.tools);
  CHECK(own.role == "speaker");
  CHECK(own.content == s.data.shape.content);
  CHECK(own.assistant == std::vector<std::string>{"bot"});
  CHECK(own.user == s.data.shape.user);
  CHECK(own.tools_file == "t.json");
  CHECK(s.eval.split == 0.02);
  const auto refused = [&](const std::string& sources) {
    return resolve_preset(file("bad.json", R"({"data": {"sources": )" + sources + "}}"), {});
  };
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl", "wieght": 2}])"),
                    Catch::Contains("bad.json: unknown key \"data.sources[0].wieght\" (did you "
                                    "mean \"weight\"?)"));
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl"}, {"path": "b.jsonl", "weight": 0}])"),
                    Catch::Contains("\"data.sources[1].weight\" must be > 0, got 0"));
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl", "weight": -1}])"),
                    Catch::Contains("\"data.sources[0].weight\" must be > 0, got -1"));
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl", "weight": "heavy"}])"),
                    Catch::Contains("\"data.sources[0].weight\" must be a number"));
  CHECK_THROWS_WITH(refused(R"([{"weight": 1}])"),
                    Catch::Contains("\"data.sources[0]\" has no \"path\""));
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl", "format": "csv"}])"),
                    Catch::Contains("\"data.sources[0].format\" must be one of"));
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl", "columns": {"mesages": "c"}}])"),
                    Catch::Contains("unknown key \"data.sources[0].columns.mesages\" (did you "
                                    "mean \"columns.messages\"?)"));
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl", "columns": "conv"}])"),
                    Catch::Contains("\"data.sources[0].columns\" must be an object with the keys "
                                    "messages, system, tools"));
  CHECK_THROWS_WITH(refused(R"([{"path": "a.jsonl", "tags": {"user": "human"}}])"),
                    Catch::Contains("\"data.sources[0].tags.user\" must be a list of strings"));
  CHECK_THROWS_WITH(refused(R"(["a.jsonl"])"),
                    Catch::Contains("\"data.sources[0]\" must be an object"));
  CHECK_THROWS_WITH(refused(R"({"path": "a.jsonl"})"),
                    Catch::Contains("\"data.sources\" must be a list of objects"));
  // --set takes the list as JSON.
  const json j = resolve_preset("tiny-demo", {R"(data.sources=[{"path": "x.jsonl"}])"});
  CHECK(j["data"]["sources"][0]["path"] == "x.jsonl");
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"data.sources=x.jsonl"}),
                    Catch::Contains("is not a JSON list of objects"));
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"eval.split=-0.1"}),
                    Catch::Contains("\"eval.split\""));
}

TEST_CASE("docs/presets.md carries the generated schema table", "[unit]") {
  std::ifstream in(std::string(FT_TEST_DIR) + "/../docs/presets.md");
  std::string doc((std::istreambuf_iterator<char>(in)), {});
  INFO("regenerate with: build/bin/ft presets --print-schema-md");
  CHECK(doc.find(schema_markdown()) != std::string::npos);
}

// Found by an adversarial user (issue 13): a preset nested 100,000 levels deep crashed the JSON
// parser; integers past INT64_MAX wrapped to -1; a huge bad value was echoed whole.
TEST_CASE("hostile presets and --set values are refused with short messages", "[unit]") {
  std::string dir = ft::test::make_temp_dir();
  auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  for (int depth : {300, 100000}) {
    const std::string f =
        file("deep.json", R"({"base": "tiny-demo", "train": {"lr": )" + std::string(depth, '[') +
                              std::string(depth, ']') + "}}");
    CHECK_THROWS_WITH(resolve_preset(f, {}),
                      Catch::Contains("deep.json: JSON nested deeper than 256 levels"));
  }
  // The scan: brackets inside strings (escaped quotes included) are not nesting.
  CHECK(ft::json_too_deep_at(R"([[["a\"[[[["]]])", 3) == std::string_view::npos);
  CHECK(ft::json_too_deep_at(R"({"a": [[{}]]})", 3) == 8);
  CHECK(ft::json_too_deep_at("[]", 0) == 0);
  CHECK(ft::excerpt("short") == "short");
  CHECK(ft::excerpt(std::string(100, 'y'), 4) == "yyyy... (100 characters)");
  // A --set key that is not UTF-8 under a setting (found by the preset fuzzer: the error message
  // quoted the value through nlohmann's dump(), which threw type_error 316).
  CHECK_THROWS_AS(resolve_preset("tiny-demo", {"train.warmup_steps.x\x98y=5"}), ft::ConfigError);
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"train.warmup_steps.x\x98y=5"}),
                    Catch::Contains("\"train.warmup_steps\" must be an integer"));
  CHECK(ft::excerpt_json(nlohmann::json("a\x98")) == "\"a\xEF\xBF\xBD\"");
  // Strings full of brackets are not nesting.
  const std::string brackets = file("brackets.json", R"({"base": "tiny-demo", "description": ")" +
                                                         std::string(1000, '[') + R"("})");
  CHECK_NOTHROW(resolve_preset(brackets, {}));

  const std::string u64max = "18446744073709551615";
  for (const char* key : {"train.micro_batch", "train.grad_accum", "train.warmup_steps",
                          "train.max_steps", "model.hidden_size", "output.save_every"}) {
    INFO(key);
    CHECK_THROWS_WITH(resolve_preset("tiny-demo", {std::string(key) + "=" + u64max}),
                      Catch::Contains("must be in [") && Catch::Contains("got " + u64max));
    const std::string f =
        file("big.json", R"({"base": "tiny-demo", ")" +
                             std::string(key).substr(0, std::string(key).find('.')) + R"(": {")" +
                             std::string(key).substr(std::string(key).find('.') + 1) + R"(": )" +
                             u64max + "}}");
    CHECK_THROWS_WITH(resolve_preset(f, {}), Catch::Contains("got " + u64max));
  }
  // The seed takes any non-negative int64, and nothing past it.
  CHECK(resolve_preset("tiny-demo", {"train.seed=9223372036854775807"})["train"]["seed"] ==
        INT64_MAX);
  CHECK_THROWS_AS(resolve_preset("tiny-demo", {"train.seed=9223372036854775808"}), ft::ConfigError);
  CHECK_THROWS_WITH(resolve_preset("tiny-demo", {"train.lr=1e999"}),
                    Catch::Contains("\"train.lr\" must be a number"));

  // A 10 MB bad value is quoted by its start and its length, not whole.
  const std::string huge(10'000'000, 'x');
  try {
    resolve_preset(
        file("huge.json", R"({"base": "tiny-demo", "train": {"lr": ")" + huge + R"("}})"), {});
    FAIL("a 10 MB string for train.lr was accepted");
  } catch (const ft::ConfigError& e) {
    const std::string what = e.what();
    CHECK(what.size() < 1000);
    CHECK_THAT(what, Catch::Contains("(10000002 characters)"));
  }
  try {
    resolve_preset("tiny-demo", {"train.lr=" + huge});
    FAIL("a 10 MB --set value was accepted");
  } catch (const ft::ConfigError& e) {
    CHECK(std::string(e.what()).size() < 1000);
  }
}

namespace {
// The error message resolving tiny-demo with `sets` gives ("" when it resolves).
std::string error_of(const std::string& preset, const std::vector<std::string>& sets) {
  try {
    resolve_preset(preset, sets);
  } catch (const ft::ConfigError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

// Issue 28: the names users bring from HF TrainingArguments, LLaMA-Factory and axolotl got
// "unknown key" with no suggestion (the docs' own example among them).
TEST_CASE("other tools' names for ft's settings are answered with ft's key", "[unit]") {
  const std::vector<std::pair<std::string, std::string>> named = {
      {"train.learning_rate", "train.lr"},
      {"learning_rate", "train.lr"},
      {"micro_batch_size", "train.micro_batch"},
      {"per_device_train_batch_size", "train.micro_batch"},
      {"train.per_device_train_batch_size", "train.micro_batch"},
      {"gradient_accumulation_steps", "train.grad_accum"},
      {"num_train_epochs", "train.epochs"},
      {"lora.rank", "lora.r"},
      {"lora_alpha", "lora.alpha"},
      {"lora.lora_alpha", "lora.alpha"},
      {"warmup_ratio", "train.warmup_ratio"},
      {"lr_scheduler_type", "train.schedule"},
      {"cutoff_len", "data.seq_len"},
      {"sequence_len", "data.seq_len"},
      {"lora_r", "lora.r"},
      {"max_grad_norm", "train.grad_clip"},
      {"val_size", "eval.split"},
      {"val_set_size", "eval.split"},
      {"interleave_probs", "data.sources"},
  };
  const std::string dir = ft::test::make_temp_dir();
  for (const auto& [foreign, ours] : named) {
    INFO(foreign);
    const std::string want = "(did you mean \"" + ours + "\"?";
    CHECK_THAT(error_of("tiny-demo", {foreign + "=1"}),
               Catch::Contains("--set: unknown key \"" + foreign + "\" " + want));
    // The same name in a preset file, nested by its dots.
    json layer = {{"base", "tiny-demo"}};
    layer[json::json_pointer("/" + std::regex_replace(foreign, std::regex("\\."), "/"))] = 1;
    const std::string path = dir + "/foreign.json";
    std::ofstream(path) << layer.dump();
    CHECK_THAT(error_of(path, {}),
               Catch::Contains("foreign.json: unknown key \"" + foreign + "\" " + want));
  }
  CHECK_THAT(error_of("tiny-demo", {"learning_rate=1e-4"}),
             Catch::Contains("\"learning_rate\" is the name in HF TrainingArguments, "
                             "LLaMA-Factory and axolotl)"));
  CHECK_THAT(error_of("tiny-demo", {"bf16=true"}),
             Catch::Contains("(did you mean \"precision.mode\"?") &&
                 Catch::Contains("true is precision.mode=bf16"));
  // Names of what ft takes on its command line, not in a preset.
  CHECK_THAT(error_of("tiny-demo", {"output_dir=runs/x"}),
             Catch::Contains("ft takes it on the command line: --output DIR"));
  CHECK_THAT(error_of("tiny-demo", {"model_name_or_path=m"}),
             Catch::Contains("ft takes it on the command line: --model DIR"));
  // A plain typo still gets the nearest key.
  CHECK_THAT(error_of("tiny-demo", {"train.micro_bach=1"}),
             Catch::Contains("(did you mean \"train.micro_batch\"?)"));
  // Every row names a setting of the schema or one of ft train's options.
  for (const ForeignKey& k : foreign_keys()) {
    INFO(k.name);
    const std::string target(k.ft);
    CHECK((target.rfind("--", 0) == 0 || find_setting(target) != nullptr));
    CHECK(find_setting(std::string(k.name)) == nullptr);
  }
}

TEST_CASE("docs/presets.md quotes the unknown-key error ft gives", "[unit]") {
  std::ifstream in(std::string(FT_TEST_DIR) + "/../docs/presets.md");
  const std::string doc((std::istreambuf_iterator<char>(in)), {});
  std::string message = error_of("tiny-demo", {"train.learning_rate=1e-4"});
  REQUIRE(message.rfind("--set: ", 0) == 0);
  message = message.substr(7);
  INFO(message);
  CHECK(doc.find(message) != std::string::npos);
}

// Issue 28: a 10 MB unknown key was echoed whole into the error (and compared letter by letter
// with every setting for the suggestion).
TEST_CASE("a huge unknown key is quoted short, in preset files and --set", "[unit]") {
  const std::string dir = ft::test::make_temp_dir();
  const std::string huge(10 * 1024 * 1024, 'k');
  const auto t0 = std::chrono::steady_clock::now();
  std::ofstream(dir + "/huge.json")
      << R"({"base": "tiny-demo", "train": {")" << huge << R"(": 1}})";
  for (const std::string& message :
       {error_of(dir + "/huge.json", {}), error_of("tiny-demo", {"train." + huge + "=1"}),
        error_of("tiny-demo", {huge + "=1"}), error_of("tiny-demo", {huge}), error_of(huge, {})}) {
    INFO(message.substr(0, 300));
    CHECK_FALSE(message.empty());
    CHECK(message.size() < 1000);
    CHECK_THAT(message, Catch::Contains("characters)"));
  }
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE("train.warmup_ratio and train.warmup_steps: one warm-up, the nearest layer's", "[unit]") {
  const std::string dir = ft::test::make_temp_dir();
  auto file = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir + "/" + name) << text;
    return dir + "/" + name;
  };
  // tiny-demo warms up for 20 steps; a --set of the ratio replaces that.
  json p = resolve_preset("tiny-demo", {"train.warmup_ratio=0.03"});
  CHECK(p["train"]["warmup_steps"] == 0);
  CHECK(p["train"]["warmup_ratio"] == 0.03);
  CHECK(resolve_preset("tiny-demo", {"train.lr=1e-3"})["train"]["warmup_steps"] == 20);
  // Both non-zero in one layer: refused, in --set and in a file.
  CHECK_THAT(error_of("tiny-demo", {"train.warmup_steps=5", "train.warmup_ratio=0.1"}),
             Catch::Contains("--set: train.warmup_steps (5) and train.warmup_ratio (0.1) are both "
                             "set, but warm-up is one or the other"));
  CHECK_THAT(error_of(file("both.json", R"({"base": "tiny-demo", "train": {"warmup_steps": 5,
                                          "warmup_ratio": 0.1}})"),
                      {}),
             Catch::Contains("both.json: train.warmup_steps (5) and train.warmup_ratio (0.1)"));
  // Setting the other to 0 in the same layer is allowed.
  CHECK(resolve_preset("tiny-demo", {"train.warmup_steps=0",
                                     "train.warmup_ratio=0.1"})["train"]["warmup_ratio"] == 0.1);
  // A file over a base: its ratio replaces the base's steps; a file that sets neither keeps them;
  // --set steps over a file's ratio replaces the ratio.
  const std::string ratio =
      file("ratio.json", R"({"base": "tiny-demo", "train": {"warmup_ratio": 0.05}})");
  p = resolve_preset(ratio, {});
  CHECK(p["train"]["warmup_steps"] == 0);
  CHECK(p["train"]["warmup_ratio"] == 0.05);
  p = resolve_preset(file("child.json", R"({"base": "ratio.json", "train": {"lr": 1e-3}})"), {});
  CHECK(p["train"]["warmup_ratio"] == 0.05);
  p = resolve_preset(ratio, {"train.warmup_steps=7"});
  CHECK(p["train"]["warmup_steps"] == 7);
  CHECK(p["train"]["warmup_ratio"] == 0.0);
  CHECK_THAT(error_of("tiny-demo", {"train.warmup_ratio=1.5"}),
             Catch::Contains("\"train.warmup_ratio\" must be in [0, 1]"));

  // The steps of a run's warm-up.
  ft::config::TrainSettings t;
  t.warmup_steps = 20;
  CHECK(t.warmup_for(20) == 20);
  CHECK(t.warmup_for(1000) == 20);
  t.warmup_steps = 0;
  t.warmup_ratio = 0.03;
  CHECK(t.warmup_for(20) == 1);     // 0.6, rounded up
  CHECK(t.warmup_for(1000) == 30);  // within rounding of 30: not 31
  t.warmup_ratio = 0.1;
  CHECK(t.warmup_for(30) == 3);  // 0.1 x 30 is 3.0000000000000004 in doubles
  t.warmup_ratio = 0;
  CHECK(t.warmup_for(100) == 0);
}

TEST_CASE("the lora and full presets take the model from --model", "[unit]") {
  for (const char* name : {"lora", "full"}) {
    INFO(name);
    const json p = resolve_preset(name, {});
    CHECK(p["model"]["require_dir"] == true);
    CHECK(p["train"]["warmup_ratio"] == 0.03);
    CHECK(p["train"]["warmup_steps"] == 0);
    CHECK(p["train"]["schedule"] == "cosine");
    CHECK(p["data"]["seq_len"] == 2048);
  }
  CHECK(resolve_preset("lora", {})["train"]["lr"] == 2e-4);
  CHECK(resolve_preset("lora", {})["lora"]["enabled"] == true);
  CHECK(resolve_preset("full", {})["train"]["lr"] == 1e-5);
  CHECK(resolve_preset("full", {})["lora"]["enabled"] == false);
  CHECK(resolve_preset("tiny-demo", {})["model"]["require_dir"] == false);
}
