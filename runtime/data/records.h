// Dataset record formats (text, alpaca, chat, pre-tokenized), the chat templates that render a
// record into text segments marked trained or not, and their tokenization into ids and labels.
// Pure functions over values; thread-safe (the Tokenizer's encode is const and thread-safe).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ft::tokenizer {
class Tokenizer;
}

namespace ft::data {

enum class RecordFormat {
  kAuto,    // detected from the first record
  kText,    // {"text": "..."}
  kAlpaca,  // {"instruction": "...", "input": "..." (optional), "output": "..."}
  kChat,    // {"messages": [{"role": "system|user|assistant", "content": "..."}, ...]}
  kTokens,  // {"input_ids": [...], "labels": [...] (optional, -100 = no loss)}
};

// kAuto: the model's own template when it has one, else its tokenizer family's built-in (resolved
// by JsonlSource to kModel or a built-in). kModel: the model's Jinja template (JinjaChatTemplate).
enum class ChatTemplate { kNone, kLlama3, kLlama2, kChatml, kMistral, kAuto, kModel };

class JinjaChatTemplate;

// Names as presets write them ("auto", "text", "alpaca", "chat", "tokenized" or "tokens"; "auto",
// "none", "llama3", "llama2", "chatml", "mistral"). Parsing throws ft::ConfigError listing the
// accepted names.
RecordFormat parse_record_format(std::string_view name);
ChatTemplate parse_chat_template(std::string_view name);
const char* name_of(RecordFormat format);
const char* name_of(ChatTemplate chat_template);

struct Message {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// One parsed record; which fields are set depends on `format`.
struct Record {
  RecordFormat format = RecordFormat::kText;
  std::string text;                        // kText
  std::string instruction, input, output;  // kAlpaca (input may be empty)
  std::vector<Message> messages;           // kChat
  std::vector<int64_t> input_ids, labels;  // kTokens (labels empty: every token trained)
};

// The format of a record by its keys: "messages" chat, "input_ids" tokens, "instruction" alpaca,
// "text" text. `origin` ("train.jsonl:1") names it in the ft::FormatError thrown for bad JSON or a
// record of no known format.
RecordFormat detect_format(std::string_view line, const std::string& origin);

// Parses and validates one JSONL line as `format` (kAuto: detected per line). A malformed record
// (bad JSON, missing key, wrong type, unknown role, empty conversation) throws ft::FormatError
// "<origin>: <format> record: <what>", e.g. "train.jsonl:17: chat record: messages[2].role 'bot'
// is not system/user/assistant".
Record parse_record(std::string_view line, RecordFormat format, const std::string& origin);

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
// assistant turns alternating, starting with user, after an optional system message), and for a
// chat record under kNone (no chat markup at all: the fix is data.template=auto). kModel renders
// with `model` (required then): the model's own template, masked as JinjaChatTemplate::render says.
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
