// Preset schema and resolution: shipped presets validate, inheritance and --set work, and every bad
// input names its file / key with a suggestion.
#include <catch2/catch.hpp>
#include <fstream>

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
  for (const char* want : {"tiny-demo", "tiny-lora", "lora-7b", "full-7b", "lora-70b", "full-70b"})
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
                    Catch::Contains("typo.json: unknown key \"train.learning_rate\""));
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
