// Dataset record formats (text, alpaca, chat with tool calls, ShareGPT, pre-tokenized), where a
// conversation record keeps its parts (RecordShape), the chat templates that render a record into
// text segments marked trained or not, and their tokenization into ids and labels.
// Pure functions over values; thread-safe (the Tokenizer's encode is const and thread-safe).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "config/settings.h"

namespace ft::tokenizer {
class Tokenizer;
}

namespace ft::data {

enum class RecordFormat {
  kAuto,      // detected from the first record
  kText,      // {"text": "..."}
  kAlpaca,    // {"instruction": "...", "input": "..." (optional), "output": "..."}
  kChat,      // {"messages": [{"role": "system|user|assistant|tool", "content": "...",
              //   "tool_calls": [...]}, ...], "tools": [...]}: OpenAI's message shape
  kSharegpt,  // {"conversations": [{"from": "human|gpt|function_call|observation|system",
              //   "value": "..."}], "system": "...", "tools": "..."}: LLaMA-Factory's
  kTokens,    // {"input_ids": [...], "labels": [...] (optional, -100 = no loss)}
};

// kAuto: the model's own template when it has one, else its tokenizer family's built-in (resolved
// by JsonlSource to kModel or a built-in). kModel: the model's Jinja template (JinjaChatTemplate).
enum class ChatTemplate { kNone, kLlama3, kLlama2, kChatml, kMistral, kAuto, kModel };

class JinjaChatTemplate;

// Names as presets write them ("auto", "text", "alpaca", "chat", "sharegpt", "tokenized" or
// "tokens"; "auto", "none", "llama3", "llama2", "chatml", "mistral"). Parsing throws
// ft::ConfigError listing the accepted names.
RecordFormat parse_record_format(std::string_view name);
ChatTemplate parse_chat_template(std::string_view name);
const char* name_of(RecordFormat format);
const char* name_of(ChatTemplate chat_template);
// Records rendered as a conversation through a chat template (alpaca, chat, sharegpt).
bool is_conversation(RecordFormat format);

using OrderedJson = nlohmann::ordered_json;  // key order kept: templates' tojson writes it

// Where a conversation record keeps its parts: config::RecordShapeSettings resolved (the tools
// file read). Defaults are LLaMA-Factory's for sharegpt (conversations, from/value, human/gpt,
// function_call, observation, system), with OpenAI's role names accepted as speakers too.
struct RecordShape {
  std::string messages;  // "": "messages" for chat, "conversations" for sharegpt
  std::string system = "system", tools = "tools";
  std::string role = "from", content = "value";
  std::vector<std::string> user{"human", "user"}, assistant{"gpt", "assistant"},
      system_tag{"system"}, function_call{"function_call"}, observation{"observation"};
  OrderedJson default_tools;  // data.tools' list, for records without their own; null: none

  std::string messages_key(RecordFormat format) const;
  // Everything that changes what a record renders to (the tokenized cache's key).
  nlohmann::json key() const;
};

// The settings resolved; reads data.tools' file (ConfigError naming it when it is not a JSON list
// of objects, or a tag or key is empty).
RecordShape record_shape(const config::RecordShapeSettings& settings);

struct Message {
  Message() = default;
  Message(std::string role_, std::string content_)
      : role(std::move(role_)), content(std::move(content_)) {}

  std::string role;  // "system", "user", "assistant" or "tool"
  std::string content;
  // An assistant turn that only calls tools ("content": null or absent): the template sees no
  // content key, as transformers 5 drops a message's null values.
  bool null_content = false;
  // An assistant turn's OpenAI tool calls as the record gives them
  // ([{"id"?, "type": "function", "function": {"name", "arguments"}}]; arguments an object or
  // its JSON text, passed to the template unchanged as transformers passes them); null: none.
  OrderedJson tool_calls;
  std::string tool_call_id, name;  // a tool turn's (optional): the call it answers
};

// One parsed record; which fields are set depends on `format`.
struct Record {
  RecordFormat format = RecordFormat::kText;  // kSharegpt records are parsed into kChat
  std::string text;                           // kText
  std::string instruction, input, output;     // kAlpaca (input may be empty)
  std::vector<Message> messages;              // kChat
  OrderedJson tools;                          // kChat: the tools list for the template; null: none
  std::vector<int64_t> input_ids, labels;     // kTokens (labels empty: every token trained)

  // Tools, tool calls or tool turns: what only a template that renders tools can express.
  bool uses_tools() const;
};

// The format of a record by its keys: "messages" (or `shape.messages`) chat, "conversations"
// sharegpt, "input_ids" tokens, "instruction" alpaca, "text" text. `origin` ("train.jsonl:1")
// names it in the ft::FormatError thrown for bad JSON or a record of no known format.
RecordFormat detect_format(std::string_view line, const std::string& origin,
                           const RecordShape& shape = {});

// Parses and validates one JSONL line as `format` (kAuto: detected per line). A malformed record
// (bad JSON, missing key, wrong type, unknown role, empty conversation, a tool call without a
// name or with arguments that are not a JSON object) throws ft::FormatError
// "<origin>: <format> record: <what>", e.g. "train.jsonl:17: chat record: messages[2].role 'bot'
// is not system/user/assistant/tool". A ShareGPT record becomes OpenAI messages as LLaMA-Factory
// aligns it: the first turn or the system column a system message, user and assistant turns as
// they are, a function_call turn (a JSON call {"name", "arguments"} or a list of them) an
// assistant turn with "content": "" and those tool_calls, an observation a tool turn; its turns
// alternate user/observation with assistant/function_call and end with the latter.
Record parse_record(std::string_view line, RecordFormat format, const std::string& origin,
                    const RecordShape& shape = {});

// A piece of rendered text and whether its tokens carry a loss.
struct Segment {
  std::string text;
  bool trained = false;
};

// Renders a text, alpaca or chat record (alpaca as one user turn, instruction + "\n\n" + input,
// and one assistant turn) with a chat template, as the models' own Jinja templates do, e.g.
// llama3 "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>...".
// Assistant turns (content and end-of-turn marker) are trained; the rest only if
// `train_on_prompt`. A text record is one trained segment under every template; kNone joins the
// contents with "\n" (the tokenizer adds BOS, tokenize_record adds EOS). Throws ft::FormatError
// (naming `origin`) for a conversation a template cannot express (llama2/mistral need user and
// assistant turns alternating, starting with user, after an optional system message; no built-in
// renders tools, tool calls or tool turns), and for a chat record under kNone (no chat markup at
// all: the fix is data.template=auto). kModel renders with `model` (required then): the model's
// own template with the record's tools, masked as JinjaChatTemplate::render says (assistant turns,
// tool calls included, trained; tool results not).
std::vector<Segment> render(const Record& record, ChatTemplate chat_template, bool train_on_prompt,
                            const std::string& origin, const JinjaChatTemplate* model = nullptr);

// The special-token strings a template writes; each must be one token of the tokenizer used.
std::vector<std::string> template_special_tokens(ChatTemplate chat_template);

struct TokenizedRecord {
  std::vector<int64_t> ids;
  std::vector<int64_t> labels;  // same length: the id where trained, -100 where not
};

// Renders and tokenizes a record. The whole rendered text is encoded at once (so ids equal
// tokenizing the output of the model's chat template); a token belongs to the segment in which
// it ends. kNone and text records get the tokenizer's BOS (add_special_tokens) and a trained EOS.
// Pre-tokenized records pass through. Throws ft::FormatError naming `origin` for text that is
// not UTF-8 or ids outside the vocabulary.
// A pre-tokenized record's ids and labels, each id checked against `vocab_size` (the model's
// embedding, or the tokenizer's vocabulary); needs no tokenizer.
TokenizedRecord tokens_record(const Record& record, int64_t vocab_size, const std::string& origin);

TokenizedRecord tokenize_record(const Record& record, ChatTemplate chat_template,
                                bool train_on_prompt, const tokenizer::Tokenizer& tokenizer,
                                const std::string& origin,
                                const JinjaChatTemplate* model = nullptr);

}  // namespace ft::data
