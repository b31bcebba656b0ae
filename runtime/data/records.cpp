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

using Json = nlohmann::json;

constexpr int64_t kIgnore = -100;

Json parse_json(std::string_view line, const std::string& origin) {
  Json j = ft::parse_json<FormatError>(line, origin);
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
  const Json& required(const Json& obj, const char* key, const std::string& path) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) fail(detail::cat("missing \"", path, "\""));
    return *it;
  }
  std::string string(const Json& obj, const char* key, const std::string& path) const {
    const Json& v = required(obj, key, path);
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

 private:
  const std::string& origin_;
  const char* format_;
};

RecordFormat format_of(const Json& j) {
  if (j.contains("messages")) return RecordFormat::kChat;
  if (j.contains("input_ids")) return RecordFormat::kTokens;
  if (j.contains("instruction")) return RecordFormat::kAlpaca;
  if (j.contains("text")) return RecordFormat::kText;
  return RecordFormat::kAuto;
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
  if (name == "tokenized" || name == "tokens") return RecordFormat::kTokens;
  throw ConfigError(
      detail::cat("data.format '", name, "' is not one of auto, text, alpaca, chat, tokenized"));
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

RecordFormat detect_format(std::string_view line, const std::string& origin) {
  const RecordFormat f = format_of(parse_json(line, origin));
  FT_CHECK_T(FormatError, f != RecordFormat::kAuto, origin,
             ": cannot tell the record format: expected a key \"text\", \"instruction\" (alpaca), "
             "\"messages\" (chat) or \"input_ids\" (pre-tokenized); set data.format to say");
  return f;
}

Record parse_record(std::string_view line, RecordFormat format, const std::string& origin) {
  const Json j = parse_json(line, origin);
  if (format == RecordFormat::kAuto) {
    format = format_of(j);
    FT_CHECK_T(FormatError, format != RecordFormat::kAuto, origin,
               ": cannot tell the record format: expected a key \"text\", \"instruction\", "
               "\"messages\" or \"input_ids\"");
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
      if (auto it = j.find("input"); it != j.end() && !it->is_null()) {
        r.input = f.string(j, "input", "input");
      }
      r.output = f.string(j, "output", "output");
      break;
    case RecordFormat::kChat: {
      const Json& m = f.required(j, "messages", "messages");
      if (!m.is_array()) f.fail(detail::cat("messages must be a list, got ", m.type_name()));
      if (m.empty()) f.fail("messages is empty: a conversation needs at least one message");
      for (size_t i = 0; i < m.size(); ++i) {
        const std::string key = detail::cat("messages[", i, "]");
        if (!m[i].is_object())
          f.fail(detail::cat(key, " must be an object {\"role\", \"content\"}, got ",
                             m[i].type_name()));
        Message msg{f.string(m[i], "role", key + ".role"),
                    f.string(m[i], "content", key + ".content")};
        if (msg.role != "system" && msg.role != "user" && msg.role != "assistant")
          f.fail(detail::cat(key, ".role '", msg.role, "' is not system/user/assistant"));
        if (msg.role == "system" && i != 0)
          f.fail(detail::cat(key, ".role is 'system': only the first message may be"));
        r.messages.push_back(std::move(msg));
      }
      break;
    }
    case RecordFormat::kTokens:
      r.input_ids = f.ints(j, "input_ids", "input_ids");
      if (r.input_ids.empty()) f.fail("input_ids is empty");
      if (auto it = j.find("labels"); it != j.end() && !it->is_null()) {
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
    return model->render(m, train_on_prompt, origin);
  }
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
