// Every normalizer and pre-tokenizer configuration ft implements, and the pipelines of Qwen,
// SmolLM, DeepSeek and Gemma, against Hugging Face tokenizers on a multilingual text: the
// normalized text, the pre-tokenizer's splits, the ids and the decoded text must be identical to
// what tests/tokenizer/fixtures/make_component_fixtures.py recorded from HF.
#include <catch2/catch.hpp>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "tokenizer/json_fields.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pretokenizer.h"
#include "tokenizer/tokenizer.h"

using ft::tokenizer::JsonFields;
using ft::tokenizer::Normalizer;
using ft::tokenizer::Piece;
using ft::tokenizer::PreTokenizer;
using ft::tokenizer::Tokenizer;
using Json = nlohmann::json;

namespace {

const std::string kDir = std::string(FT_TEST_DIR) + "/tokenizer/fixtures/components";

struct Fixtures {
  std::vector<std::string> texts;
  Json bases;
  std::vector<Json> configs;
};

const Fixtures& fixtures() {
  static const Fixtures f = [] {
    Fixtures r;
    std::ifstream bases(kDir + "/bases.json");
    REQUIRE(bases.good());
    r.bases = Json::parse(bases);
    std::ifstream in(kDir + "/expected.jsonl");
    REQUIRE(in.good());
    std::string line;
    while (std::getline(in, line)) {
      Json j = Json::parse(line);
      if (j.contains("meta")) {
        r.texts = j["meta"]["texts"].get<std::vector<std::string>>();
      } else {
        r.configs.push_back(std::move(j));
      }
    }
    return r;
  }();
  return f;
}

// Checks each configuration of `group`; returns how many there were.
size_t check_group(const std::string& group) {
  const Fixtures& fx = fixtures();
  REQUIRE(fx.texts.size() >= 10);
  const JsonFields fields("fixture");
  size_t n = 0;
  for (const Json& cfg : fx.configs) {
    if (cfg["group"] != group) continue;
    ++n;
    const std::string name = cfg["name"];
    const Json& comp = cfg["components"];
    Json spec = fx.bases[cfg["base"].get<std::string>()];
    for (const auto& [key, value] : comp.items()) spec[key] = value;
    const Tokenizer tok = Tokenizer::from_json(spec, name);
    std::optional<Normalizer> normalizer;
    std::optional<PreTokenizer> pre_tokenizer;
    if (comp.contains("normalizer")) normalizer.emplace(comp["normalizer"], "normalizer", fields);
    if (comp.contains("pre_tokenizer")) {
      pre_tokenizer.emplace(comp["pre_tokenizer"], "pre_tokenizer", fields);
    }
    const Json& cases = cfg["cases"];
    REQUIRE(cases.size() == fx.texts.size());
    for (size_t i = 0; i < cases.size(); ++i) {
      const std::string& text = fx.texts[i];
      const Json& c = cases[i];
      INFO(name << " on " << Json(text).dump());
      if (normalizer) {
        std::string normalized = text;
        normalizer->normalize(normalized);
        CHECK(normalized == c["normalized"].get<std::string>());
      }
      if (pre_tokenizer) {
        std::vector<Piece> pieces;
        if (!text.empty()) pieces.push_back(Piece{text, -1, 1});
        pre_tokenizer->pre_tokenize(pieces);
        std::vector<std::string> words;
        for (const Piece& p : pieces) words.push_back(p.text);
        CHECK(words == c["pre_tokens"].get<std::vector<std::string>>());
      }
      const auto ids = c["ids"].get<std::vector<int32_t>>();
      CHECK(tok.encode(text, false) == ids);
      CHECK(tok.encode(text, true) ==
            (c.contains("ids_special") ? c["ids_special"].get<std::vector<int32_t>>() : ids));
      CHECK(tok.decode(ids, false) == c["decoded"].get<std::string>());
    }
  }
  return n;
}

}  // namespace

TEST_CASE("normalizers (NFC/NFD/NFKC/NFKD, Lowercase, Replace, Strip, Bert, ...) equal HF",
          "[tokenizer]") {
  CHECK(check_group("normalizer") >= 23);
}

TEST_CASE("pre-tokenizers (Digits, Punctuation, Whitespace, Metaspace, Split, ...) equal HF",
          "[tokenizer]") {
  CHECK(check_group("pre_tokenizer") >= 41);
}

TEST_CASE("Qwen2, SmolLM, DeepSeek V3 and Gemma pipelines equal HF", "[tokenizer]") {
  CHECK(check_group("pipeline") == 4);
}

TEST_CASE("subword prefix / word suffix, normalized added tokens, BOS+EOS template equal HF",
          "[tokenizer]") {
  CHECK(check_group("model") == 3);
}

TEST_CASE("component options are checked, naming file and key", "[tokenizer]") {
  const JsonFields f("t.json");
  auto refused = [&](const char* json, const char* needle) {
    INFO(json);
    CHECK_THROWS_WITH(PreTokenizer(Json::parse(json), "pre_tokenizer", f),
                      Catch::Contains("t.json: pre_tokenizer") && Catch::Contains(needle));
  };
  refused(R"({"type": "Punctuation", "behavior": "Sideways"})", "Sideways");
  refused(R"({"type": "CharDelimiterSplit", "delimiter": "ab"})", "delimiter");
  refused(R"({"type": "Digits", "individual_digits": "yes"})", "individual_digits");
  refused(R"({"type": "FixedLength", "length": 5})", "FixedLength");
  CHECK_THROWS_WITH(
      Normalizer(Json::parse(R"({"type": "Sequence", "normalizers": [{"type": "Precompiled"}]})"),
                 "normalizer", f),
      Catch::Contains("t.json: normalizer.normalizers[0].type") && Catch::Contains("Precompiled"));
  CHECK_THROWS_WITH(
      Normalizer(Json::parse(R"({"type": "Replace", "pattern": {"Regex": "(x"}, "content": ""})"),
                 "normalizer", f),
      Catch::Contains("normalizer.pattern.Regex"));
  CHECK_THROWS_WITH(
      Normalizer(Json::parse(R"({"type": "Strip", "strip_left": 1})"), "normalizer", f),
      Catch::Contains("normalizer.strip_left"));
}
