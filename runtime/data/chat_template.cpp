#include "data/chat_template.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json.h"
#include "tokenizer/tokenizer.h"

namespace ft::data {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::string read_text(const fs::path& path) { return read_text_file<FormatError>(path.string()); }

// A special token as tokenizer_config.json writes it: a string or an AddedToken object.
std::string token_string(const Json& cfg, const char* key, const std::string& file) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    FT_CHECK_T(FormatError, c != it->end() && c->is_string(), file, ": \"", key,
               "\" is an object without a string \"content\"");
    return c->get<std::string>();
  }
  throw FormatError(detail::cat(
      file, ": \"", key, "\" must be a string or an AddedToken object, got ", it->type_name()));
}

}  // namespace

std::optional<ModelChatTemplate> read_model_chat_template(const std::string& dir) {
  ModelChatTemplate m;
  const fs::path config = fs::path(dir) / "tokenizer_config.json";
  const fs::path jinja_file = fs::path(dir) / "chat_template.jinja";
  Json cfg = Json::object();
  if (fs::is_regular_file(config)) {
    cfg = parse_json<FormatError>(read_text(config), config.string());
    FT_CHECK_T(FormatError, cfg.is_object(), config.string(), ": must be a JSON object");
    m.bos_token = token_string(cfg, "bos_token", config.string());
    m.eos_token = token_string(cfg, "eos_token", config.string());
  }
  // transformers (5.x) reads chat_template.jinja first: it takes priority over the config's entry.
  if (fs::is_regular_file(jinja_file)) {
    m.text = read_text(jinja_file);
    m.origin = jinja_file.string();
    return m;
  }
  auto it = cfg.find("chat_template");
  if (it != cfg.end() && !it->is_null()) {
    m.origin = config.string() + " chat_template";
    if (it->is_string()) {
      m.text = it->get<std::string>();
    } else if (it->is_array()) {
      std::string names;
      for (const Json& e : *it) {
        FT_CHECK_T(FormatError,
                   e.is_object() && e.contains("name") && e["name"].is_string() &&
                       e.contains("template") && e["template"].is_string(),
                   config.string(),
                   ": chat_template is a list whose entries must be "
                   "{\"name\": string, \"template\": string}");
        names += (names.empty() ? "" : ", ") + e["name"].get<std::string>();
        if (e["name"] == "default") {
          m.text = e["template"].get<std::string>();
          m.origin = config.string() + " chat_template[default]";
        }
      }
      FT_CHECK_T(FormatError, !m.text.empty(), config.string(),
                 ": chat_template lists no template named \"default\" (it has: ", names, ")");
    } else {
      throw FormatError(detail::cat(
          config.string(), ": chat_template must be a string or a list, got ", it->type_name()));
    }
    return m;
  }
  return std::nullopt;
}

// Llama 2 and Mistral's refusal of a conversation that does not alternate (check_alternating in
// records.cpp), inside their loop over the messages after the system one.
constexpr const char* kAlternating =
    R"({%- if (loop.index0 % 2 == 0 and message['role'] != 'user') or (loop.index0 % 2 == 1 and message['role'] != 'assistant') -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/... after an optional system message') -}}
{%- endif -%}
)";

std::string builtin_template_jinja(ChatTemplate t) {
  // Each mirrors its case in records.cpp's render(); data_test renders both over the same
  // conversations, and the newcomer check has transformers render the file ft writes.
  switch (t) {
    case ChatTemplate::kLlama3:
      return R"({{- '<|begin_of_text|>' -}}
{%- for message in messages -%}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}
)";
    case ChatTemplate::kChatml:
      return R"({%- for message in messages -%}
{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- endif -%}
)";
    case ChatTemplate::kLlama2:
      return R"({%- if messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] | trim -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
)" + std::string(kAlternating) +
             R"({%- if message['role'] == 'user' -%}
{%- if loop.first and system != '' -%}
{{- '<s>[INST] <<SYS>>\n' + system + '\n<</SYS>>\n\n' + message['content'] | trim + ' [/INST]' -}}
{%- else -%}
{{- '<s>[INST] ' + message['content'] | trim + ' [/INST]' -}}
{%- endif -%}
{%- else -%}
{{- ' ' + message['content'] | trim + ' </s>' -}}
{%- endif -%}
{%- endfor -%}
)";
    case ChatTemplate::kMistral:
      return R"({%- if messages[0]['role'] == 'system' -%}
{%- set system = messages[0]['content'] -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{{- '<s>' -}}
{%- for message in loop_messages -%}
)" + std::string(kAlternating) +
             R"({%- if message['role'] == 'user' -%}
{%- if loop.first and system != '' -%}
{{- '[INST] ' + system + '\n\n' + message['content'] + ' [/INST]' -}}
{%- else -%}
{{- '[INST] ' + message['content'] + ' [/INST]' -}}
{%- endif -%}
{%- else -%}
{{- message['content'] + '</s>' -}}
{%- endif -%}
{%- endfor -%}
)";
    case ChatTemplate::kNone:
    case ChatTemplate::kAuto:
    case ChatTemplate::kModel:
      return "";
  }
  return "";
}

ChatTemplate builtin_template_for(const tokenizer::Tokenizer& tok) {
  for (ChatTemplate t : {ChatTemplate::kLlama3, ChatTemplate::kChatml}) {
    bool all = true;
    for (const std::string& s : template_special_tokens(t)) all = all && tok.token_to_id(s);
    if (all) return t;
  }
  if (tok.token_to_id("<s>") && tok.token_to_id("</s>")) {
    return tok.token_to_id("[INST]") ? ChatTemplate::kMistral : ChatTemplate::kLlama2;
  }
  return ChatTemplate::kNone;
}

JinjaChatTemplate::JinjaChatTemplate(ModelChatTemplate model)
    : model_(std::move(model)), template_(model_.text, model_.origin) {}

namespace {

// A message as transformers hands it to the template: the keys the record gave, less those whose
// value is null (transformers 5 drops them: `_normalize_chat_messages`).
nlohmann::ordered_json message_json(const Message& m) {
  nlohmann::ordered_json j = {{"role", m.role}};
  if (!m.null_content) j["content"] = m.content;
  if (!m.tool_calls.is_null()) j["tool_calls"] = m.tool_calls;
  if (!m.tool_call_id.empty()) j["tool_call_id"] = m.tool_call_id;
  if (!m.name.empty()) j["name"] = m.name;
  return j;
}

// The longest k with a[from, from + k) == b[b_end - k, b_end): how much of `a` after `from`
// repeats the end of b[0, b_end).
size_t tail_overlap(const std::string& a, size_t from, const std::string& b, size_t b_end) {
  for (size_t k = std::min(a.size() - from, b_end); k > 0; --k) {
    if (a.compare(from, k, b, b_end - k, k) == 0) return k;
  }
  return 0;
}

}  // namespace

std::string JinjaChatTemplate::render_prefix(const std::vector<Message>& messages, size_t n,
                                             bool add_generation_prompt, const std::string& origin,
                                             const OrderedJson& tools) const {
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < n; ++i) list.push_back(message_json(messages[i]));
  vars["messages"] = std::move(list);
  vars["add_generation_prompt"] = add_generation_prompt;
  vars["tools"] = tools;
  vars["documents"] = nullptr;
  if (!model_.bos_token.empty()) vars["bos_token"] = model_.bos_token;
  if (!model_.eos_token.empty()) vars["eos_token"] = model_.eos_token;
  try {
    jinja::RenderOptions options;
    options.now = model_.now;
    return template_.render(vars, options);
  } catch (const jinja::TemplateError& e) {
    throw FormatError(
        detail::cat(origin, ": chat record: the model's chat template failed: ", e.what()));
  }
}

std::pair<size_t, size_t> JinjaChatTemplate::turn_span(const std::vector<Message>& messages,
                                                       size_t i, const std::string& full,
                                                       const std::string& origin,
                                                       const OrderedJson& tools) const {
  std::string before;
  try {
    before = render_prefix(messages, i, true, origin, tools);
  } catch (const FormatError& e) {
    if (i > 0) throw;
    // Many templates cannot render an empty conversation (they read messages[0]).
    throw FormatError(detail::cat(
        origin,
        ": chat record: messages[0] is an assistant turn and the model's chat template "
        "cannot render the empty conversation before it, so its tokens cannot be found; start "
        "with a user or system message, or set data.train_on_prompt=true (",
        e.what(), ")"));
  }
  const std::string with = render_prefix(messages, i + 1, false, origin, tools);
  const bool prefix_ok =
      with.compare(0, before.size(), before) == 0 && full.compare(0, before.size(), before) == 0;
  FT_CHECK_T(FormatError, prefix_ok, origin, ": chat record: the model's chat template (",
             model_.origin, ") renders the conversation before messages[", i,
             "] so that it is not a prefix of the whole rendering (the template rewrites earlier "
             "turns as the conversation grows, e.g. moves the system message or the tools into "
             "the last user turn), so the assistant tokens cannot be masked; use a built-in "
             "template (--set data.template=llama3|llama2|chatml|mistral) or "
             "data.train_on_prompt=true");
  // The turn ends where the rendering that stops after it leaves the whole one (a template may
  // close a conversation with more, e.g. Phi-3's eos_token), less trailing whitespace.
  size_t end = before.size();
  while (end < with.size() && end < full.size() && with[end] == full[end]) ++end;
  size_t with_end = with.size();
  while (with_end > end && (with[with_end - 1] == '\n' || with[with_end - 1] == ' ')) --with_end;
  if (end < with_end) {
    // A template may write a conversation's last turn differently (Qwen3 gives it an empty
    // think block): the turn reaches as far as the whole rendering repeats that turn's end.
    if (const size_t k = tail_overlap(full, end, with, with_end); k > 0) {
      end += k;
    } else {
      // Where the two part inside a marker both open ("<|end|>\n<|endoftext|>" against
      // "<|end|>\n<|user|>"), the shared opening belongs to what follows.
      while (end > before.size() && std::strchr("<|[{", with[end - 1]) != nullptr) --end;
    }
  }
  while (end > before.size() && (full[end - 1] == '\n' || full[end - 1] == ' ')) --end;
  // A turn with something to say that renders to nothing here would train nothing, silently.
  const Message& m = messages[i];
  const bool says_something = !m.content.empty() || !m.tool_calls.empty();
  FT_CHECK_T(FormatError, end > before.size() || !says_something, origin,
             ": chat record: the model's chat template (", model_.origin, ") writes messages[", i,
             "] in the whole conversation unlike when it is the last message, and its text cannot "
             "be found, so it cannot be trained; use a built-in template (--set "
             "data.template=llama3|llama2|chatml|mistral) or data.train_on_prompt=true");
  return {before.size(), end};
}

std::vector<Segment> JinjaChatTemplate::render(const std::vector<Message>& messages,
                                               bool train_on_prompt, const std::string& origin,
                                               const OrderedJson& tools) const {
  const std::string full = render_prefix(messages, messages.size(), false, origin, tools);
  if (train_on_prompt) {  // everything trained: no turn needs finding
    if (full.empty()) return {};
    return {{full, true}};
  }
  // [begin, end) of each assistant turn in `full`: answers and tool calls; tool results are not.
  std::vector<std::pair<size_t, size_t>> spans;
  for (size_t i = 0; i < messages.size(); ++i) {
    if (messages[i].role == "assistant")
      spans.push_back(turn_span(messages, i, full, origin, tools));
  }
  std::vector<Segment> out;
  auto add = [&](size_t b, size_t e, bool trained) {
    if (e <= b) return;
    if (!out.empty() && out.back().trained == trained) {
      out.back().text += full.substr(b, e - b);
    } else {
      out.push_back({full.substr(b, e - b), trained});
    }
  };
  size_t pos = 0;
  for (const auto& [b, e] : spans) {
    add(pos, b, false);
    add(b, e, true);
    pos = e;
  }
  add(pos, full.size(), false);
  return out;
}

}  // namespace ft::data
