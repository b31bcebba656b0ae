// Tool-call and ShareGPT records: parsed as LLaMA-Factory aligns them, rendered and tokenized as
// transformers' apply_chat_template(messages, tools=...) does with the real templates that render
// tools (fixtures/tool_records.json, made by fixtures/make_record_fixtures.py), their masks turn by
// turn, configurable columns and tags, the refusals of bad records and of built-in templates.
#include "support/catch_torch.h"
// (catch_torch.h first: it drops c10's CHECK before Catch defines its own)
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/schema.h"
#include "config/settings.h"
#include "core/error.h"
#include "data/chat_template.h"
#include "data/inspect.h"
#include "data/jsonl_source.h"
#include "data/records.h"
#include "support/subprocess.h"
#include "tokenizer/tokenizer.h"

using namespace ft::data;
using ft::tokenizer::Tokenizer;
using Json = nlohmann::json;

namespace {

const std::string kFixtures = ft::test::test_dir() + "/data/fixtures/tool_records.json";
const std::string kTemplates = ft::test::test_dir() + "/template/fixtures/templates/";
const std::string kTokenizers = ft::test::test_dir() + "/tokenizer/fixtures/";

const Json& fixtures() {
  static const Json doc = Json::parse(ft::test::read_file(kFixtures));
  return doc;
}

const Tokenizer& tokenizer(const std::string& kind) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& t = cache[kind];
  if (!t)
    t = std::make_unique<Tokenizer>(Tokenizer::from_file(kTokenizers + kind + "/tokenizer.json"));
  return *t;
}

ModelChatTemplate fixture_template(const std::string& name) {
  const Json& t = fixtures()["templates"][name];
  return {ft::test::read_file(kTemplates + name + ".jinja"),
          name + ".jinja",
          t["bos_token"],
          t["eos_token"],
          {}};
}

const JinjaChatTemplate& jinja(const std::string& name) {
  static std::map<std::string, std::unique_ptr<JinjaChatTemplate>> cache;
  auto& t = cache[name];
  if (!t) t = std::make_unique<JinjaChatTemplate>(fixture_template(name));
  return *t;
}

Record fixture_record(const std::string& name) {
  return parse_record(fixtures()["records"][name]["line"].get<std::string>(), RecordFormat::kAuto,
                      "tools.jsonl:1");
}

// A parsed message as transformers receives it (null content dropped), for comparing with the
// messages the fixture script aligned in Python.
Json as_json(const Message& m) {
  Json j = {{"role", m.role}};
  if (!m.null_content) j["content"] = m.content;
  if (!m.tool_calls.is_null()) j["tool_calls"] = Json::parse(m.tool_calls.dump());
  if (!m.tool_call_id.empty()) j["tool_call_id"] = m.tool_call_id;
  if (!m.name.empty()) j["name"] = m.name;
  return j;
}

Json without_nulls(Json messages) {
  for (Json& m : messages) {
    for (auto it = m.begin(); it != m.end();) it = it->is_null() ? m.erase(it) : std::next(it);
  }
  return messages;
}

std::vector<std::string> trained(const std::vector<Segment>& segments) {
  std::vector<std::string> out;
  for (const Segment& s : segments)
    if (s.trained) out.push_back(s.text);
  return out;
}

std::string untrained_text(const std::vector<Segment>& segments) {
  std::string out;
  for (const Segment& s : segments)
    if (!s.trained) out += s.text + "\x1f";  // a separator no fixture text holds
  return out;
}

std::string parse_error(const std::string& line, RecordFormat format = RecordFormat::kAuto,
                        const RecordShape& shape = {}) {
  try {
    parse_record(line, format, "train.jsonl:17", shape);
  } catch (const ft::FormatError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("ShareGPT and tool-call records align to the messages LLaMA-Factory's converter gives") {
  for (const auto& [name, r] : fixtures()["records"].items()) {
    INFO(name);
    const std::string line = r["line"];
    CHECK(name_of(detect_format(line, "tools.jsonl:1")) == r["format"].get<std::string>());
    const Record rec = fixture_record(name);
    CHECK(rec.format == RecordFormat::kChat);
    Json got = Json::array();
    for (const Message& m : rec.messages) got.push_back(as_json(m));
    CHECK(got == without_nulls(r["messages"]));
    CHECK(Json::parse(rec.tools.dump()) == r["tools"]);
  }
}

TEST_CASE("tool records render and tokenize as transformers' apply_chat_template(tools=...)") {
  size_t rendered = 0, masked = 0, refused = 0;
  for (const Json& c : fixtures()["cases"]) {
    const std::string tmpl = c["template"], record = c["record"];
    INFO(tmpl << " / " << record);
    const Record r = fixture_record(record);
    const JinjaChatTemplate& t = jinja(tmpl);
    const Tokenizer& tok = tokenizer(fixtures()["templates"][tmpl]["tokenizer"]);
    if (c.contains("error")) {
      // The template raises for this conversation in jinja2 too; ft says so naming the record.
      CHECK_THROWS_WITH(render(r, ChatTemplate::kModel, true, "tools.jsonl:4", &t),
                        Catch::StartsWith("tools.jsonl:4: chat record: the model's chat template "
                                          "failed: " +
                                          tmpl + ".jinja:"));
      const std::string why = c["error"];
      if (why.find("dict object") == std::string::npos)  // raise_exception's own words
        CHECK_THROWS_WITH(render(r, ChatTemplate::kModel, true, "t", &t), Catch::Contains(why));
      ++refused;
      continue;
    }
    std::string text;
    for (const Segment& s : render(r, ChatTemplate::kModel, true, "t", &t)) text += s.text;
    CHECK(text == c["text"].get<std::string>());
    const std::vector<int64_t> ids = c["ids"];
    CHECK(tokenize_record(r, ChatTemplate::kModel, true, tok, "t", &t).ids == ids);
    ++rendered;
    try {
      const TokenizedRecord m = tokenize_record(r, ChatTemplate::kModel, false, tok, "t", &t);
      CHECK(m.ids == ids);
      ++masked;
    } catch (const ft::FormatError& e) {
      // Mistral writes the tools before the last user message: with two user turns the earlier
      // rendering is not a prefix of the whole one, and no mask can follow it.
      CHECK_THAT(e.what(), Catch::Contains("is not a prefix of the whole rendering"));
      CHECK(tmpl.rfind("mistral", 0) == 0);
    }
  }
  CHECK(rendered >= 30);
  // Mistral's templates keep a system message for the last message, and tools for the last user
  // message: of their records only those without either of two are masked.
  CHECK(masked >= 27);
  CHECK(refused >= 5);
}

TEST_CASE("masks follow the roles: answers and tool calls trained, tool results and prompts not") {
  struct Case {
    const char* tmpl;
    const char* record;
    std::vector<std::string> trained;
  };
  const std::vector<Case> cases = {
      {"qwen2.5-instruct",
       "openai_tool_call",
       {"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>",
        "It is 21 degrees and clear in Paris.<|im_end|>"}},
      // Qwen3 gives the conversation's last answer an empty think block, and (as the last turn
      // of a prefix) would give one to every answer after the last user message: the tool call
      // is trained as the whole rendering writes it, without one.
      {"qwen3",
       "openai_multi_turn",
       {"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n"
        "</tool_call><|im_end|>",
        "Yes, 27 degrees.<|im_end|>", "<think>\n\n</think>\n\nYou are welcome.<|im_end|>"}},
      {"qwen3",
       "sharegpt_parallel_calls",
       {"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Tokyo\"}}\n"
        "</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"tz\": "
        "\"Asia/Tokyo\"}}\n</tool_call><|im_end|>",
        "<think>\n\n</think>\n\n18 degrees, and it is 09:30.<|im_end|>"}},
      {"llama-3.1-instruct",
       "sharegpt_function_call",
       {"{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}<|eot_id|>",
        "It is 21 degrees in Paris.<|eot_id|>"}},
      // Arguments given as JSON text stay text: Mistral's tojson of the call quotes them.
      {"mistral-v3-instruct",
       "openai_string_arguments",
       {"[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": "
        "\\\"Oslo\\\", \\\"unit\\\": \\\"celsius\\\"}\", \"id\": \"call00002\"}]</s>",
        " It is -3 °C in Oslo.</s>"}},
  };
  for (const Case& c : cases) {
    INFO(c.tmpl << " / " << c.record);
    const std::vector<Segment> segs =
        render(fixture_record(c.record), ChatTemplate::kModel, false, "t", &jinja(c.tmpl));
    CHECK(trained(segs) == c.trained);
  }
  // Every masked fixture: each answer and each call's name lies in trained text; tool results,
  // user and system turns only in untrained text.
  size_t checked = 0;
  for (const Json& c : fixtures()["cases"]) {
    if (!c.contains("text")) continue;
    INFO(c["template"] << " / " << c["record"]);
    const Record r = fixture_record(c["record"]);
    std::vector<Segment> segs;
    try {
      segs = render(r, ChatTemplate::kModel, false, "t", &jinja(c["template"]));
    } catch (const ft::FormatError&) {
      continue;  // the prefix refusal, checked above
    }
    std::string all_trained;
    for (const std::string& s : trained(segs)) all_trained += s + "\x1f";
    const std::string prompt = untrained_text(segs);
    for (const Message& m : r.messages) {
      if (m.role == "assistant") {
        if (!m.content.empty()) CHECK(all_trained.find(m.content) != std::string::npos);
        for (const auto& call : m.tool_calls)
          CHECK(all_trained.find(call["function"]["name"].get<std::string>()) != std::string::npos);
      } else if (!m.content.empty()) {
        // Llama 3.1 writes a tool result as JSON text (tojson of the string).
        const std::string quoted = Json(m.content).dump();
        CHECK(all_trained.find(m.content) == std::string::npos);
        CHECK(all_trained.find(quoted) == std::string::npos);
        CHECK((prompt.find(m.content) != std::string::npos ||
               prompt.find(quoted) != std::string::npos));
      }
    }
    ++checked;
  }
  CHECK(checked >= 27);
}

TEST_CASE("train_on_prompt trains tool results too: the whole rendering is one trained segment") {
  const std::vector<Segment> segs = render(fixture_record("openai_tool_call"), ChatTemplate::kModel,
                                           true, "t", &jinja("qwen2.5-instruct"));
  REQUIRE(segs.size() == 1);
  CHECK(segs[0].trained);
  CHECK(segs[0].text.find("<tool_response>") != std::string::npos);
}

TEST_CASE("bad ShareGPT and tool-call records are FormatErrors naming the line and the field") {
  const std::string human = R"({"from": "human", "value": "q"})";
  const std::string gpt = R"({"from": "gpt", "value": "a"})";
  auto sharegpt = [](const std::string& turns, const std::string& more = "") {
    return R"({"conversations": [)" + turns + "]" + more + "}";
  };
  CHECK(parse_error(sharegpt(R"({"from": "bot", "value": "q"}, )" + gpt)) ==
        "train.jsonl:17: sharegpt record: conversations[0].from 'bot' is not one of human, user, "
        "observation, gpt, assistant, function_call (data.tags.* name them)");
  CHECK_THAT(parse_error(sharegpt(gpt + ", " + human)),
             Catch::StartsWith("train.jsonl:17: sharegpt record: conversations[0].from is 'gpt' "
                               "where one of human, user, observation must come"));
  CHECK_THAT(parse_error(sharegpt(human + ", " + gpt + ", " + human)),
             Catch::StartsWith("train.jsonl:17: sharegpt record: conversations ends with a human "
                               "turn"));
  CHECK_THAT(parse_error(sharegpt(human + ", " + R"({"from": "system", "value": "s"})")),
             Catch::Contains("conversations[1].from 'system' is not one of") &&
                 Catch::Contains("(a system turn only first)"));
  CHECK_THAT(parse_error(sharegpt(human + R"(, {"from": "function_call", "value": "{not json"})")),
             Catch::StartsWith("train.jsonl:17: sharegpt record: conversations[1].value is not "
                               "valid JSON ({not json)"));
  CHECK(parse_error(
            sharegpt(human + R"(, {"from": "function_call", "value": "{\"arguments\": {}}"})")) ==
        "train.jsonl:17: sharegpt record: missing \"conversations[1].value.name\"");
  CHECK_THAT(
      parse_error(sharegpt(
          human +
          R"(, {"from": "function_call", "value": "{\"name\": \"f\", \"arguments\": \"{x\"}"})")),
      Catch::StartsWith("train.jsonl:17: sharegpt record: conversations[1].value.arguments is "
                        "not valid JSON ({x)"));
  // JSON inside a string is held to the line's nesting limit (nlohmann's parser recurses).
  CHECK(parse_error(sharegpt(human + R"(, {"from": "function_call", "value": ")" +
                             std::string(300, '[') + std::string(300, ']') + "\"}")) ==
        "train.jsonl:17: sharegpt record: conversations[1].value holds JSON nested deeper than "
        "256 levels");
  CHECK_THAT(parse_error(sharegpt(human + ", " + gpt, R"(, "tools": "[{\"name\": ")")),
             Catch::StartsWith("train.jsonl:17: sharegpt record: tools is not valid JSON"));
  CHECK(parse_error(sharegpt(human + ", " + gpt, R"(, "tools": "{\"name\": \"f\"}")")) ==
        "train.jsonl:17: sharegpt record: tools must be a list of tools, got object");
  CHECK(parse_error(sharegpt(human + ", " + gpt, R"(, "system": 3)")) ==
        "train.jsonl:17: sharegpt record: system must be a string, got number");
  CHECK(parse_error(sharegpt(R"({"from": "human"}, )" + gpt)) ==
        "train.jsonl:17: sharegpt record: missing \"conversations[0].value\"");

  const std::string user = R"({"role": "user", "content": "q"})";
  auto chat = [&](const std::string& assistant) {
    return R"({"messages": [)" + user + ", " + assistant + "]}";
  };
  CHECK_THAT(
      parse_error(chat(
          R"({"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{\"a\": 1"}}]})")),
      Catch::StartsWith("train.jsonl:17: chat record: messages[1].tool_calls[0].function."
                        "arguments is not valid JSON ({\"a\": 1)"));
  CHECK(
      parse_error(chat(
          R"({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": [1]}}]})")) ==
      "train.jsonl:17: chat record: messages[1].tool_calls[0].function.arguments must be an "
      "object or a JSON string of one, got array");
  CHECK(
      parse_error(chat(
          R"({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]})")) ==
      "train.jsonl:17: chat record: messages[1].tool_calls[0].function.arguments must hold a "
      "JSON object, got array");
  CHECK(
      parse_error(chat(
          R"({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": {}}}]})")) ==
      "train.jsonl:17: chat record: messages[1].tool_calls[0].type must be \"function\", got "
      "\"code\"");
  CHECK(parse_error(
            chat(R"({"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]})")) ==
        "train.jsonl:17: chat record: missing \"messages[1].tool_calls[0].function.name\"");
  CHECK(parse_error(chat(R"({"role": "assistant", "content": null})")) ==
        "train.jsonl:17: chat record: missing \"messages[1].content\"");
  CHECK(parse_error(R"({"messages": [{"role": "user", "content": "q", "tool_calls": []}]})") ==
        "train.jsonl:17: chat record: messages[0].tool_calls: only an assistant turn calls tools, "
        "this is 'user'");
  CHECK(parse_error(chat(R"({"role": "tool", "content": "r", "tool_call_id": 7})")) ==
        "train.jsonl:17: chat record: messages[1].tool_call_id must be a string, got number");
  CHECK(parse_error(chat(R"({"role": "bot", "content": "r"})")) ==
        "train.jsonl:17: chat record: messages[1].role 'bot' is not system/user/assistant/tool");
  CHECK(parse_error(R"({"messages": [)" + user + R"(], "tools": [1]})") ==
        "train.jsonl:17: chat record: tools[0] must be an object (a tool schema), got number");
}

TEST_CASE("built-in templates refuse tool records instead of dropping the tools") {
  const Record calls = fixture_record("openai_tool_call");
  Record offered = parse_record(
      R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "tools": [{"name": "f"}]})",
      RecordFormat::kAuto, "t");
  for (ChatTemplate t : {ChatTemplate::kLlama3, ChatTemplate::kChatml, ChatTemplate::kMistral,
                         ChatTemplate::kLlama2}) {
    INFO(name_of(t));
    for (const Record* r : std::vector<const Record*>{&calls, &offered}) {
      CHECK_THROWS_WITH(render(*r, t, false, "train.jsonl:3"),
                        "train.jsonl:3: chat record: it has tools, tool calls or tool turns, which "
                        "the built-in template '" +
                            std::string(name_of(t)) +
                            "' cannot render; use --set data.template=auto with a --model "
                            "directory whose own chat template renders tools (Llama 3.1, Qwen2.5, "
                            "Qwen3 and Mistral's do)");
    }
  }
  // The same conversation without tools still renders with a built-in.
  offered.tools = nullptr;
  CHECK_FALSE(render(offered, ChatTemplate::kChatml, false, "t").empty());
}

TEST_CASE("columns and tags are configurable as LLaMA-Factory's dataset_info.json maps them") {
  RecordShape shape;
  shape.messages = "dialog";
  shape.role = "speaker";
  shape.content = "text";
  shape.user = {"q"};
  shape.assistant = {"a"};
  shape.function_call = {"call"};
  shape.observation = {"result"};
  shape.system = "preamble";
  shape.tools = "functions";
  const std::string line =
      R"({"dialog": [{"speaker": "q", "text": "weather?"}, {"speaker": "call", "text": "{\"name\": \"w\", \"arguments\": {}}"}, {"speaker": "result", "text": "sunny"}, {"speaker": "a", "text": "Sunny."}], "preamble": "Be brief.", "functions": [{"name": "w"}]})";
  CHECK(detect_format(line, "t", shape) == RecordFormat::kSharegpt);
  const Record r = parse_record(line, RecordFormat::kAuto, "t", shape);
  REQUIRE(r.messages.size() == 5);
  CHECK(r.messages[0].role == "system");
  CHECK(r.messages[0].content == "Be brief.");
  CHECK(r.messages[2].role == "assistant");
  CHECK(r.messages[2].tool_calls.dump() ==
        R"([{"type":"function","function":{"name":"w","arguments":{}}}])");
  CHECK(r.messages[3].role == "tool");
  CHECK(r.tools.dump() == R"([{"name":"w"}])");
  // With these tags the default speakers are unknown.
  CHECK_THAT(
      parse_error(R"({"dialog": [{"speaker": "human", "text": "x"}]})", RecordFormat::kAuto, shape),
      Catch::Contains("dialog[0].speaker 'human' is not one of q, result, a, call"));
  // A renamed turns key holding OpenAI messages is a chat record.
  CHECK(detect_format(R"({"dialog": [{"role": "user", "content": "x"}]})", "t", shape) ==
        RecordFormat::kChat);

  // data.tools: a file of tools for records without their own; a record's own list wins.
  const std::string dir = ft::test::make_temp_dir();
  std::ofstream(dir + "/tools.json") << R"([{"type": "function", "function": {"name": "g"}}])";
  // The schema's defaults are RecordShape's.
  ft::config::RecordShapeSettings s =
      ft::config::settings_from_json(ft::config::schema_defaults(), "defaults").data.shape;
  CHECK(record_shape(s).key() == RecordShape{}.key());
  s.tools_file = dir + "/tools.json";
  const RecordShape with_file = record_shape(s);
  const std::string plain =
      R"({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]})";
  CHECK(parse_record(plain, RecordFormat::kAuto, "t", with_file).tools.dump() ==
        R"([{"type":"function","function":{"name":"g"}}])");
  CHECK(
      parse_record(
          R"({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}], "tools": [{"name": "own"}]})",
          RecordFormat::kAuto, "t", with_file)
          .tools.dump() == R"([{"name":"own"}])");
  CHECK(with_file.key() != RecordShape{}.key());
  std::ofstream(dir + "/bad.json") << R"({"name": "g"})";
  s.tools_file = dir + "/bad.json";
  CHECK_THROWS_WITH(record_shape(s), Catch::StartsWith("data.tools " + dir +
                                                       "/bad.json must hold a "
                                                       "non-empty JSON list of tools"));
  s.tools_file = dir + "/missing.json";
  CHECK_THROWS_AS(record_shape(s), ft::ConfigError);
  s.tools_file = "";
  s.user.clear();
  CHECK_THROWS_WITH(record_shape(s), "data.tags.user is an empty list: name at least one speaker");
}

TEST_CASE("JsonlSource reads ShareGPT tool records, and ft data show marks their trained tokens") {
  const std::string dir = ft::test::make_temp_dir();
  {
    std::ofstream f(dir + "/tools.jsonl");
    f << fixtures()["records"]["sharegpt_function_call"]["line"].get<std::string>() << "\n";
    f << fixtures()["records"]["openai_tool_call"]["line"].get<std::string>() << "\n";
  }
  std::ofstream(dir + "/chat_template.jinja")
      << ft::test::read_file(kTemplates + "qwen2.5-instruct.jinja");
  std::ofstream(dir + "/tokenizer_config.json") << R"({"eos_token": "<|im_end|>"})";
  JsonlOptions o;
  o.path = dir + "/tools.jsonl";
  o.tokenizer = std::make_shared<const Tokenizer>(
      Tokenizer::from_file(kTokenizers + "llama3/tokenizer.json"));
  o.chat_template = ChatTemplate::kAuto;
  o.model_dir = dir;
  o.seq_len = 4096;
  JsonlSource source(o);
  CHECK(source.format() == RecordFormat::kSharegpt);
  const std::string shown = show_record(source, 0, false);
  INFO(shown);
  CHECK_THAT(shown,
             Catch::StartsWith("--- " + dir + "/tools.jsonl:1 (sharegpt):") &&
                 Catch::Contains("<|im_start|>assistant\n⟦<tool_call>\n{\"name\": \"get_weather\", "
                                 "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>⟧\n"
                                 "<|im_start|>user\n<tool_response>\n{\"temperature\": 21}\n"
                                 "</tool_response><|im_end|>\n<|im_start|>assistant\n"
                                 "⟦It is 21 degrees in Paris.<|im_end|>⟧"));
  // The same ids as transformers gives (the fixture of that record and template).
  for (const Json& c : fixtures()["cases"]) {
    if (c["template"] == "qwen2.5-instruct" && c["record"] == "sharegpt_function_call")
      CHECK(source.tokenize_whole(0).ids == c["ids"].get<std::vector<int64_t>>());
  }
  // The second line is an OpenAI record: under data.format sharegpt it is malformed.
  CHECK_THROWS_WITH(source.tokenize_whole(1),
                    Catch::StartsWith(dir + "/tools.jsonl:2: sharegpt record: missing "
                                            "\"conversations\""));
}
