#include "data/records.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>

#include "core/error.h"
#include "core/json.h"
#include "data/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace ft::data {
namespace {

using Json = OrderedJson;

constexpr int64_t kIgnore = -100;

Json parse_json(std::string_view line, const std::string& origin) {
  Json j = ft::parse_json<FormatError, Json>(line, origin);
  FT_CHECK_T(FormatError, j.is_object(), origin, ": a record must be a JSON object, got ",
             j.type_name());
  return j;
}

// Field access whose errors read "<origin>: <format> record: <key> ...".
class Fields {
 public:
  Fields(const std::string& origin, const char* format) : origin_(origin), format_(format) {}

  [[noreturn]] void fail(const std::string& msg) const {
    throw FormatError(detail::cat(origin_, ": ", format_, " record: ", msg));
  }
  const Json* optional(const Json& obj, const std::string& key) const {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }
  const Json& required(const Json& obj, const std::string& key, const std::string& path) const {
    const Json* v = optional(obj, key);
    if (v == nullptr) fail(detail::cat("missing \"", path, "\""));
    return *v;
  }
  std::string string(const Json& obj, const std::string& key, const std::string& path) const {
    return string_value(required(obj, key, path), path);
  }
  std::string string_value(const Json& v, const std::string& path) const {
    if (!v.is_string()) fail(detail::cat(path, " must be a string, got ", v.type_name()));
    return v.get<std::string>();
  }
  std::vector<int64_t> ints(const Json& obj, const char* key, const std::string& path) const {
    const Json& v = required(obj, key, path);
    if (!v.is_array()) fail(detail::cat(path, " must be a list of integers, got ", v.type_name()));
    std::vector<int64_t> out;
    out.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number_integer())
        fail(detail::cat(path, "[", i, "] must be an integer, got ", v[i].type_name(), " ",
                         v[i].dump()));
      out.push_back(v[i].get<int64_t>());
    }
    return out;
  }
  // A list of turns under `key`: present, a non-empty list.
  const Json& turns(const Json& obj, const std::string& key) const {
    const Json& m = required(obj, key, key);
    if (!m.is_array()) fail(detail::cat(key, " must be a list, got ", m.type_name()));
    if (m.empty()) fail(key + " is empty: a conversation needs at least one message");
    return m;
  }
  // JSON written inside a string (a tool call's arguments, a tools column), under the same
  // nesting limit as the line itself.
  Json json_text(const Json& v, const std::string& path) const {
    const std::string text = string_value(v, path);
    if (json_too_deep_at(text) != std::string_view::npos)
      fail(detail::cat(path, " holds JSON nested deeper than ", kMaxJsonDepth, " levels"));
    try {
      return Json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail(detail::cat(path, " is not valid JSON (", excerpt(text), "): ", excerpt(e.what(), 120)));
    }
  }

 private:
  const std::string& origin_;
  const char* format_;
};

RecordFormat format_of(const Json& j, const RecordShape& shape) {
  if (!shape.messages.empty() && j.contains(shape.messages)) {
    // A renamed turns key: the turns' own keys tell the two conversation shapes apart.
    const Json& m = j[shape.messages];
    const bool sharegpt = m.is_array() && !m.empty() && m[0].is_object() &&
                          m[0].contains(shape.role) && !m[0].contains("role");
    return sharegpt ? RecordFormat::kSharegpt : RecordFormat::kChat;
  }
  if (j.contains("messages")) return RecordFormat::kChat;
  if (j.contains("conversations")) return RecordFormat::kSharegpt;
  if (j.contains("input_ids")) return RecordFormat::kTokens;
  if (j.contains("instruction")) return RecordFormat::kAlpaca;
  if (j.contains("text")) return RecordFormat::kText;
  return RecordFormat::kAuto;
}

bool contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

std::string joined(const std::vector<std::string>& v) {
  std::string out;
  for (const std::string& s : v) out += (out.empty() ? "" : ", ") + s;
  return out;
}

// A tool call's arguments: an object, or a string holding one (kept as given: templates render
// either, as transformers passes them).
void check_arguments(const Fields& f, const Json& call, const std::string& path) {
  const Json& a = f.required(call, "arguments", path + ".arguments");
  if (a.is_object()) return;
  if (!a.is_string())
    f.fail(detail::cat(path, ".arguments must be an object or a JSON string of one, got ",
                       a.type_name()));
  const Json parsed = f.json_text(a, path + ".arguments");
  if (!parsed.is_object())
    f.fail(detail::cat(path, ".arguments must hold a JSON object, got ", parsed.type_name()));
}

// An OpenAI tool call {"id"?, "type": "function", "function": {"name", "arguments"}}.
void check_tool_call(const Fields& f, const Json& call, const std::string& path) {
  if (!call.is_object()) f.fail(detail::cat(path, " must be an object, got ", call.type_name()));
  if (const Json* type = f.optional(call, "type");
      type && (!type->is_string() || *type != "function"))
    f.fail(detail::cat(path, ".type must be \"function\", got ", excerpt_json(*type)));
  if (const Json* id = f.optional(call, "id")) (void)f.string_value(*id, path + ".id");
  const Json& fn = f.required(call, "function", path + ".function");
  if (!fn.is_object())
    f.fail(detail::cat(path, ".function must be an object {\"name\", \"arguments\"}, got ",
                       fn.type_name()));
  (void)f.string(fn, "name", path + ".function.name");
  check_arguments(f, fn, path + ".function");
}

// A record's tools: a list of tool schemas (objects), or LLaMA-Factory's JSON string of one ("":
// none); absent: the shape's default list.
Json tools_of(const Fields& f, const Json& j, const RecordShape& shape) {
  const Json* v = f.optional(j, shape.tools);
  if (v == nullptr) return shape.default_tools;
  Json tools = *v;
  if (v->is_string()) {
    if (v->get<std::string>().empty()) return shape.default_tools;
    tools = f.json_text(*v, shape.tools);
  }
  if (!tools.is_array())
    f.fail(detail::cat(shape.tools, " must be a list of tools, got ", tools.type_name()));
  for (size_t i = 0; i < tools.size(); ++i) {
    if (!tools[i].is_object())
      f.fail(detail::cat(shape.tools, "[", i, "] must be an object (a tool schema), got ",
                         tools[i].type_name()));
  }
  return tools.empty() ? shape.default_tools : tools;
}

Message chat_message(const Fields& f, const Json& m, size_t i) {
  const std::string key = detail::cat("messages[", i, "]");
  if (!m.is_object())
    f.fail(detail::cat(key, " must be an object {\"role\", \"content\"}, got ", m.type_name()));
  Message msg;
  msg.role = f.string(m, "role", key + ".role");
  if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" && msg.role != "tool")
    f.fail(detail::cat(key, ".role '", msg.role, "' is not system/user/assistant/tool"));
  if (msg.role == "system" && i != 0)
    f.fail(detail::cat(key, ".role is 'system': only the first message may be"));
  if (const Json* calls = f.optional(m, "tool_calls")) {
    if (msg.role != "assistant")
      f.fail(detail::cat(key, ".tool_calls: only an assistant turn calls tools, this is '",
                         msg.role, "'"));
    if (!calls->is_array())
      f.fail(detail::cat(key, ".tool_calls must be a list, got ", calls->type_name()));
    for (size_t c = 0; c < calls->size(); ++c)
      check_tool_call(f, (*calls)[c], detail::cat(key, ".tool_calls[", c, "]"));
    msg.tool_calls = *calls;
  }
  if (msg.role == "assistant" && !msg.tool_calls.empty() && f.optional(m, "content") == nullptr) {
    msg.null_content = true;  // OpenAI's {"content": null, "tool_calls": [...]}
  } else {
    msg.content = f.string(m, "content", key + ".content");
  }
  if (msg.role == "tool") {
    if (const Json* id = f.optional(m, "tool_call_id"))
      msg.tool_call_id = f.string_value(*id, key + ".tool_call_id");
    if (const Json* name = f.optional(m, "name")) msg.name = f.string_value(*name, key + ".name");
  }
  return msg;
}

void parse_chat(const Fields& f, const Json& j, const RecordShape& shape, Record& r) {
  const std::string key = shape.messages_key(RecordFormat::kChat);
  const Json& m = f.turns(j, key);
  for (size_t i = 0; i < m.size(); ++i) r.messages.push_back(chat_message(f, m[i], i));
  r.tools = tools_of(f, j, shape);
}

// A ShareGPT function_call turn's value: a JSON tool call {"name", "arguments"} or a list of
// them, as OpenAI tool calls.
Json sharegpt_tool_calls(const Fields& f, const Json& value, const std::string& path) {
  const Json parsed = f.json_text(value, path);
  const Json list = parsed.is_array() ? parsed : Json::array({parsed});
  if (list.empty()) f.fail(path + " is an empty list of tool calls");
  Json calls = Json::array();
  for (size_t c = 0; c < list.size(); ++c) {
    const std::string p = parsed.is_array() ? detail::cat(path, "[", c, "]") : path;
    if (!list[c].is_object())
      f.fail(detail::cat(p, " must be a tool call {\"name\", \"arguments\"}, got ",
                         list[c].type_name()));
    const std::string name = f.string(list[c], "name", p + ".name");
    check_arguments(f, list[c], p);
    calls.push_back(Json{{"type", "function"},
                         {"function", Json{{"name", name}, {"arguments", list[c]["arguments"]}}}});
  }
  return calls;
}

void parse_sharegpt(const Fields& f, const Json& j, const RecordShape& shape, Record& r) {
  const std::string key = shape.messages_key(RecordFormat::kSharegpt);
  const Json& turns = f.turns(j, key);
  auto turn_path = [&](size_t i) { return detail::cat(key, "[", i, "]"); };
  auto role_of = [&](size_t i) {
    if (!turns[i].is_object())
      f.fail(detail::cat(turn_path(i), " must be an object {\"", shape.role, "\", \"",
                         shape.content, "\"}, got ", turns[i].type_name()));
    return f.string(turns[i], shape.role, turn_path(i) + "." + shape.role);
  };
  size_t first = 0;
  std::string system;
  if (contains(shape.system_tag, role_of(0))) {
    system = f.string(turns[0], shape.content, turn_path(0) + "." + shape.content);
    first = 1;
  } else if (const Json* s = f.optional(j, shape.system)) {
    system = f.string_value(*s, shape.system);
  }
  if (!system.empty()) r.messages.push_back({"system", system});
  const std::string odd = joined(shape.user) + ", " + joined(shape.observation);
  const std::string even = joined(shape.assistant) + ", " + joined(shape.function_call);
  for (size_t i = first; i < turns.size(); ++i) {
    const std::string role = role_of(i), path = turn_path(i) + "." + shape.content;
    const bool prompt_turn = (i - first) % 2 == 0;
    const bool known = contains(shape.user, role) || contains(shape.assistant, role) ||
                       contains(shape.function_call, role) || contains(shape.observation, role);
    if (!known)
      f.fail(detail::cat(turn_path(i), ".", shape.role, " '", role, "' is not one of ", odd, ", ",
                         even,
                         (contains(shape.system_tag, role) ? " (a system turn only first)" : ""),
                         " (data.tags.* name them)"));
    const bool ok = prompt_turn
                        ? contains(shape.user, role) || contains(shape.observation, role)
                        : contains(shape.assistant, role) || contains(shape.function_call, role);
    if (!ok)
      f.fail(detail::cat(turn_path(i), ".", shape.role, " is '", role, "' where one of ",
                         prompt_turn ? odd : even,
                         " must come: turns alternate user or observation with assistant or "
                         "function_call, as LLaMA-Factory requires"));
    const Json& value = f.required(turns[i], shape.content, path);
    if (contains(shape.function_call, role)) {
      Message m{"assistant", ""};
      m.tool_calls = sharegpt_tool_calls(f, value, path);
      r.messages.push_back(std::move(m));
    } else {
      const char* as = contains(shape.user, role)          ? "user"
                       : contains(shape.observation, role) ? "tool"
                                                           : "assistant";
      r.messages.push_back({as, f.string_value(value, path)});
    }
  }
  if ((turns.size() - first) % 2 != 0)
    f.fail(detail::cat(key, " ends with a ", role_of(turns.size() - 1),
                       " turn: a conversation ends with an assistant or function_call turn (one "
                       "of ",
                       even, "), as LLaMA-Factory requires"));
  r.tools = tools_of(f, j, shape);
  r.format = RecordFormat::kChat;
}

// Llama 2 and Llama 3's Jinja templates strip each content; ChatML and Mistral keep it as is.
std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

std::vector<Message> conversation_of(const Record& r) {
  if (r.format == RecordFormat::kChat) return r.messages;
  std::string user = r.instruction;
  if (!r.input.empty()) user += "\n\n" + r.input;
  return {{"user", user}, {"assistant", r.output}};
}

// Appends text to the last segment when the flag matches, so segments alternate.
void add(std::vector<Segment>& out, std::string text, bool trained) {
  if (text.empty()) return;
  if (!out.empty() && out.back().trained == trained) {
    out.back().text += text;
  } else {
    out.push_back({std::move(text), trained});
  }
}

// Llama 2 and Mistral templates: [system,] user, assistant, user, ... (HF raises otherwise).
void check_alternating(const std::vector<Message>& m, ChatTemplate t, const std::string& origin) {
  size_t i = (!m.empty() && m[0].role == "system") ? 1 : 0;
  for (size_t k = 0; i < m.size(); ++i, ++k) {
    const char* want = (k % 2 == 0) ? "user" : "assistant";
    FT_CHECK_T(FormatError, m[i].role == want, origin, ": chat record: the ", name_of(t),
               " template needs user and assistant turns alternating after an optional system "
               "message, but messages[",
               i, "].role is '", m[i].role, "' (expected '", want, "')");
  }
}

}  // namespace

RecordFormat parse_record_format(std::string_view name) {
  if (name == "auto") return RecordFormat::kAuto;
  if (name == "text") return RecordFormat::kText;
  if (name == "alpaca") return RecordFormat::kAlpaca;
  if (name == "chat") return RecordFormat::kChat;
  if (name == "sharegpt") return RecordFormat::kSharegpt;
  if (name == "tokenized" || name == "tokens") return RecordFormat::kTokens;
  throw ConfigError(detail::cat("data.format '", name,
                                "' is not one of auto, text, alpaca, chat, sharegpt, tokenized"));
}

bool is_conversation(RecordFormat format) {
  return format == RecordFormat::kChat || format == RecordFormat::kSharegpt ||
         format == RecordFormat::kAlpaca;
}

std::string RecordShape::messages_key(RecordFormat format) const {
  if (!messages.empty()) return messages;
  return format == RecordFormat::kSharegpt ? "conversations" : "messages";
}

nlohmann::json RecordShape::key() const {
  return {{"messages", messages},
          {"system", system},
          {"tools", tools},
          {"role", role},
          {"content", content},
          {"user", user},
          {"assistant", assistant},
          {"system_tag", system_tag},
          {"function_call", function_call},
          {"observation", observation},
          {"default_tools", default_tools.dump()}};
}

namespace {

// data.tools: a JSON list of tool schemas.
OrderedJson read_tools_file(const std::string& path) {
  const std::string what = "data.tools " + path;
  OrderedJson tools =
      ft::parse_json<ConfigError, OrderedJson>(read_text_file<ConfigError>(path), what);
  FT_CHECK(tools.is_array() && !tools.empty(), what,
           " must hold a non-empty JSON list of tools, got ", excerpt(tools.dump()));
  for (const OrderedJson& t : tools)
    FT_CHECK(t.is_object(), what, ": every tool must be an object (a function schema), got ",
             t.type_name());
  return tools;
}

}  // namespace

RecordShape record_shape(const config::RecordShapeSettings& s) {
  RecordShape shape;
  shape.messages = s.messages;
  const std::pair<const std::string*, const char*> keys[] = {{&s.system, "data.columns.system"},
                                                             {&s.tools, "data.columns.tools"},
                                                             {&s.role, "data.tags.role"},
                                                             {&s.content, "data.tags.content"}};
  for (const auto& [value, name] : keys)
    FT_CHECK(!value->empty(), name, " is empty: a record's key needs a name");
  shape.system = s.system;
  shape.tools = s.tools;
  shape.role = s.role;
  shape.content = s.content;
  const std::pair<const std::vector<std::string>*, const char*> tags[] = {
      {&s.user, "data.tags.user"},
      {&s.assistant, "data.tags.assistant"},
      {&s.system_tag, "data.tags.system"},
      {&s.function_call, "data.tags.function_call"},
      {&s.observation, "data.tags.observation"}};
  for (const auto& [value, name] : tags)
    FT_CHECK(!value->empty(), name, " is an empty list: name at least one speaker");
  shape.user = s.user;
  shape.assistant = s.assistant;
  shape.system_tag = s.system_tag;
  shape.function_call = s.function_call;
  shape.observation = s.observation;
  if (!s.tools_file.empty()) shape.default_tools = read_tools_file(s.tools_file);
  return shape;
}

bool Record::uses_tools() const {
  if (!tools.is_null()) return true;
  for (const Message& m : messages)
    if (m.role == "tool" || !m.tool_calls.is_null()) return true;
  return false;
}

ChatTemplate parse_chat_template(std::string_view name) {
  if (name == "auto") return ChatTemplate::kAuto;
  if (name == "none") return ChatTemplate::kNone;
  if (name == "llama3") return ChatTemplate::kLlama3;
  if (name == "llama2") return ChatTemplate::kLlama2;
  if (name == "chatml") return ChatTemplate::kChatml;
  if (name == "mistral") return ChatTemplate::kMistral;
  throw ConfigError(detail::cat("data.template '", name,
                                "' is not one of auto, none, llama3, llama2, chatml, mistral"));
}

const char* name_of(RecordFormat format) {
  switch (format) {
    case RecordFormat::kAuto:
      return "auto";
    case RecordFormat::kText:
      return "text";
    case RecordFormat::kAlpaca:
      return "alpaca";
    case RecordFormat::kChat:
      return "chat";
    case RecordFormat::kSharegpt:
      return "sharegpt";
    case RecordFormat::kTokens:
      return "tokens";
  }
  return "?";
}

const char* name_of(ChatTemplate chat_template) {
  switch (chat_template) {
    case ChatTemplate::kNone:
      return "none";
    case ChatTemplate::kLlama3:
      return "llama3";
    case ChatTemplate::kLlama2:
      return "llama2";
    case ChatTemplate::kChatml:
      return "chatml";
    case ChatTemplate::kMistral:
      return "mistral";
    case ChatTemplate::kAuto:
      return "auto";
    case ChatTemplate::kModel:
      return "model";
  }
  return "?";
}

namespace {

// A record of no format ft trains: what it looks like, and what to do. Preference data
// (TRL's DPO datasets, LLaMA-Factory's ranking ones) is named as such: it is another objective,
// not a format ft could be told with data.format.
[[noreturn]] void unknown_format(const Json& j, const std::string& origin) {
  std::string keys;
  for (const auto& [key, value] : j.items()) keys += (keys.empty() ? "\"" : ", \"") + key + "\"";
  if (j.contains("chosen") && j.contains("rejected"))
    throw FormatError(detail::cat(
        origin, ": cannot tell the record format: a preference record (keys ", keys,
        "), as DPO-style preference training reads: that is an objective of its own, which ft "
        "does not train (ft trains one target per record). To fine-tune on the preferred "
        "answers, write each record's prompt and \"chosen\" answer as a chat record "
        "{\"messages\": [{\"role\": \"user\", ...}, {\"role\": \"assistant\", ...}]} or an "
        "alpaca one {\"instruction\", \"output\"}"));
  throw FormatError(detail::cat(
      origin,
      ": cannot tell the record format: expected a key \"text\", \"instruction\" "
      "(alpaca), \"messages\" (chat), \"conversations\" (sharegpt) or \"input_ids\" "
      "(pre-tokenized), got ",
      keys.empty() ? std::string("an empty object") : "keys " + keys,
      "; set data.format to say (and data.columns.messages for conversations under another key)"));
}

}  // namespace

RecordFormat detect_format(std::string_view line, const std::string& origin,
                           const RecordShape& shape) {
  const Json j = parse_json(line, origin);
  const RecordFormat f = format_of(j, shape);
  if (f == RecordFormat::kAuto) unknown_format(j, origin);
  return f;
}

Record parse_record(std::string_view line, RecordFormat format, const std::string& origin,
                    const RecordShape& shape) {
  const Json j = parse_json(line, origin);
  if (format == RecordFormat::kAuto) {
    format = format_of(j, shape);
    if (format == RecordFormat::kAuto) unknown_format(j, origin);
  }
  Record r;
  r.format = format;
  Fields f(origin, name_of(format));
  switch (format) {
    case RecordFormat::kText:
      r.text = f.string(j, "text", "text");
      break;
    case RecordFormat::kAlpaca:
      r.instruction = f.string(j, "instruction", "instruction");
      if (f.optional(j, "input")) r.input = f.string(j, "input", "input");
      r.output = f.string(j, "output", "output");
      break;
    case RecordFormat::kChat:
      parse_chat(f, j, shape, r);
      break;
    case RecordFormat::kSharegpt:
      parse_sharegpt(f, j, shape, r);
      break;
    case RecordFormat::kTokens:
      r.input_ids = f.ints(j, "input_ids", "input_ids");
      if (r.input_ids.empty()) f.fail("input_ids is empty");
      if (f.optional(j, "labels")) {
        r.labels = f.ints(j, "labels", "labels");
        if (r.labels.size() != r.input_ids.size())
          f.fail(detail::cat("labels has ", r.labels.size(), " entries but input_ids has ",
                             r.input_ids.size()));
      }
      break;
    case RecordFormat::kAuto:
      break;
  }
  return r;
}

std::vector<Segment> render(const Record& record, ChatTemplate t, bool train_on_prompt,
                            const std::string& origin, const JinjaChatTemplate* model) {
  FT_CHECK_T(FormatError, record.format != RecordFormat::kTokens, origin,
             ": a pre-tokenized record has no text to render");
  std::vector<Segment> out;
  if (record.format == RecordFormat::kText) {
    add(out, record.text, true);
    return out;
  }
  FT_CHECK_T(FormatError, !(t == ChatTemplate::kNone && record.format == RecordFormat::kChat),
             origin,
             ": a chat record under data.template 'none' would be trained without any chat "
             "markup; use the model's own template: --set data.template=auto (or a built-in: "
             "llama3, llama2, chatml, mistral)");
  FT_ASSERT(t != ChatTemplate::kAuto, "data.template auto must be resolved before rendering");
  const std::vector<Message> m = conversation_of(record);
  if (t == ChatTemplate::kModel) {
    FT_ASSERT(model != nullptr, "data.template model needs the model's template");
    return model->render(m, train_on_prompt, origin, record.tools);
  }
  // The built-ins have no markup for tools: rendering the turns without them would train a
  // conversation the record does not hold.
  FT_CHECK_T(FormatError, !record.uses_tools(), origin,
             ": chat record: it has tools, tool calls or tool turns, which the built-in template '",
             name_of(t),
             "' cannot render; use --set data.template=auto with a --model directory whose own "
             "chat template renders tools (Llama 3.1, Qwen2.5, Qwen3 and Mistral's do)");
  const bool p = train_on_prompt;
  auto is_assistant = [](const Message& msg) { return msg.role == "assistant"; };
  switch (t) {
    case ChatTemplate::kNone:
      for (size_t i = 0; i < m.size(); ++i) {
        add(out, i == 0 ? "" : "\n", p);
        add(out, m[i].content, is_assistant(m[i]) || p);
      }
      break;
    case ChatTemplate::kLlama3:
      add(out, "<|begin_of_text|>", p);
      for (const Message& msg : m) {
        add(out, "<|start_header_id|>" + msg.role + "<|end_header_id|>\n\n", p);
        add(out, trim(msg.content) + "<|eot_id|>", is_assistant(msg) || p);
      }
      break;
    case ChatTemplate::kChatml:
      for (const Message& msg : m) {
        add(out, "<|im_start|>" + msg.role + "\n", p);
        add(out, msg.content + "<|im_end|>", is_assistant(msg) || p);
        add(out, "\n", p);
      }
      break;
    case ChatTemplate::kLlama2:
    case ChatTemplate::kMistral: {
      check_alternating(m, t, origin);
      const bool llama2 = t == ChatTemplate::kLlama2;
      size_t i = 0;
      std::string system;
      if (m[0].role == "system") {
        system = llama2 ? trim(m[0].content) : m[0].content;
        i = 1;
      }
      if (!llama2) add(out, "<s>", p);
      for (; i < m.size(); ++i) {
        const Message& msg = m[i];
        if (msg.role == "user") {
          std::string user = llama2 ? trim(msg.content) : msg.content;
          if (!system.empty()) {
            // Llama 2 wraps the system prompt into the first user turn; Mistral's templates
            // (which have no system role) prepend it to the first user message.
            user = llama2 ? "<<SYS>>\n" + system + "\n<</SYS>>\n\n" + user : system + "\n\n" + user;
            system.clear();
          }
          add(out, std::string(llama2 ? "<s>" : "") + "[INST] " + user + " [/INST]", p);
        } else if (llama2) {
          add(out, " " + trim(msg.content) + " </s>", true);
        } else {
          add(out, msg.content + "</s>", true);
        }
      }
      break;
    }
    case ChatTemplate::kAuto:
    case ChatTemplate::kModel:
      break;
  }
  return out;
}

std::vector<std::string> template_special_tokens(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::kNone:
    case ChatTemplate::kAuto:
    case ChatTemplate::kModel:
      return {};
    case ChatTemplate::kLlama3:
      return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    case ChatTemplate::kLlama2:
    case ChatTemplate::kMistral:
      return {"<s>", "</s>"};
    case ChatTemplate::kChatml:
      return {"<|im_start|>", "<|im_end|>"};
  }
  return {};
}

TokenizedRecord tokens_record(const Record& record, int64_t vocab, const std::string& origin) {
  FT_ASSERT(record.format == RecordFormat::kTokens, "tokens_record of another format");
  TokenizedRecord out;
  out.ids = record.input_ids;
  out.labels = record.labels.empty() ? record.input_ids : record.labels;
  for (size_t i = 0; i < out.ids.size(); ++i) {
    FT_CHECK_T(FormatError, out.ids[i] >= 0 && out.ids[i] < vocab, origin,
               ": tokens record: input_ids[", i, "] = ", out.ids[i],
               " is outside the vocabulary of ", vocab);
    FT_CHECK_T(FormatError,
               out.labels[i] == kIgnore || (out.labels[i] >= 0 && out.labels[i] < vocab), origin,
               ": tokens record: labels[", i, "] = ", out.labels[i],
               " is neither -100 nor inside the vocabulary of ", vocab);
  }
  return out;
}

TokenizedRecord tokenize_record(const Record& record, ChatTemplate t, bool train_on_prompt,
                                const tokenizer::Tokenizer& tok, const std::string& origin,
                                const JinjaChatTemplate* model) {
  if (record.format == RecordFormat::kTokens)
    return tokens_record(record, static_cast<int64_t>(tok.vocab_size()), origin);
  TokenizedRecord out;
  const std::vector<Segment> segments = render(record, t, train_on_prompt, origin, model);
  // Plain text (and kNone) gets the tokenizer's own BOS; templates write theirs in the text.
  const bool plain = t == ChatTemplate::kNone || record.format == RecordFormat::kText;
  auto encode = [&](const std::string& text) {
    try {
      return tok.encode(text, plain);
    } catch (const FormatError& e) {
      throw FormatError(detail::cat(origin, ": ", e.what()));
    }
  };
  std::string full;
  for (const Segment& s : segments) full += s.text;
  const std::vector<int32_t> ids = encode(full);
  out.ids.assign(ids.begin(), ids.end());
  out.labels.assign(ids.size(), kIgnore);
  // Token ownership: the tokens of the whole text that a prefix's encoding reproduces belong to
  // that prefix; a token merged across a boundary belongs to the segment it ends in.
  size_t prefix_len = 0, begin = 0;
  for (size_t k = 0; k < segments.size(); ++k) {
    prefix_len += segments[k].text.size();
    size_t end = ids.size();
    if (k + 1 < segments.size()) {
      const std::vector<int32_t> p = encode(full.substr(0, prefix_len));
      end = 0;
      while (end < p.size() && end < ids.size() && p[end] == ids[end]) ++end;
      end = std::max(end, begin);
    }
    if (segments[k].trained) {
      for (size_t i = begin; i < end; ++i) out.labels[i] = out.ids[i];
    }
    begin = end;
  }
  if (plain) {
    const std::optional<int32_t> eos = tok.eos_id();
    if (eos) {
      out.ids.push_back(*eos);
      const bool last_trained = segments.empty() || segments.back().trained;
      out.labels.push_back(last_trained ? *eos : kIgnore);
    }
  }
  return out;
}

}  // namespace ft::data
