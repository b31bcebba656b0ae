// The model's own chat template: read from its directory (tokenizer_config.json's
// `chat_template`, a string or a list of named templates, or chat_template.jinja; bos_token and
// eos_token from tokenizer_config.json) and rendered into trained / untrained segments exactly as
// transformers' apply_chat_template renders the conversation. Which built-in template a
// tokenizer's family uses when the model has no template of its own. Immutable after
// construction; render() is const and thread-safe.
#pragma once

#include <ctime>
#include <optional>
#include <string>
#include <vector>

#include "data/records.h"
#include "template/template.h"

namespace ft::tokenizer {
class Tokenizer;
}

namespace ft::data {

struct ModelChatTemplate {
  std::string text;    // the Jinja source
  std::string origin;  // "DIR/tokenizer_config.json chat_template" or "DIR/chat_template.jinja"
  std::string bos_token, eos_token;  // empty where the model names none
  // strftime_now's clock: JsonlSource fixes it when it opens the data, so every record of a run
  // writes the same date (Llama 3.2 writes today's); unset: the time of each rendering.
  std::optional<std::time_t> now;
};

// The chat template in model directory `dir`, or nullopt when it has none. tokenizer_config.json
// wins over chat_template.jinja; from a list of named templates the one named "default" is used.
// Throws ft::FormatError naming the file and key for a malformed file (not JSON, chat_template of
// the wrong type, a list without "default", a bos_token that is neither a string nor an
// AddedToken object).
std::optional<ModelChatTemplate> read_model_chat_template(const std::string& dir);

// The built-in template whose special tokens the tokenizer has (llama3, then chatml, then
// mistral where "[INST]" is a token, then llama2), or kNone.
ChatTemplate builtin_template_for(const tokenizer::Tokenizer& tok);

// The built-in template `t` as Jinja source that transformers' apply_chat_template renders exactly
// as ft's built-in does (records.h render(): the same text, the same refusals, the generation
// prompt a served model needs): what a model trained with a built-in carries as
// chat_template.jinja. "" for kNone, kAuto and kModel.
std::string builtin_template_jinja(ChatTemplate t);

class JinjaChatTemplate {
 public:
  // Parses the template; throws jinja::TemplateError naming its origin, line and column.
  explicit JinjaChatTemplate(ModelChatTemplate model);

  // Renders `messages` as transformers' apply_chat_template(messages, tools=tools) does
  // (add_generation_prompt false, bos_token, eos_token; `tools` null: None). Assistant turn i
  // (tool calls included) starts where messages[:i] rendered with add_generation_prompt ends, and
  // ends where messages[:i+1] rendered without it parts from the whole rendering (less trailing
  // whitespace) or, where the template writes a last turn differently (Qwen3's empty think block),
  // where the whole rendering stops matching that rendering's end; it is trained, the rest (system,
  // user, tool results) only when `train_on_prompt` (then the whole text is one trained segment,
  // and no turn is looked for). Throws ft::FormatError
  // naming `origin` when the template raises (roles it refuses) or when the rendering before a turn
  // is not a prefix of the whole rendering (the template rewrites earlier turns, e.g. Mistral's
  // system message placed in the last user turn), where no mask can follow the text.
  std::vector<Segment> render(const std::vector<Message>& messages, bool train_on_prompt,
                              const std::string& origin,
                              const OrderedJson& tools = OrderedJson()) const;

  const ModelChatTemplate& model() const { return model_; }

 private:
  std::string render_prefix(const std::vector<Message>& messages, size_t n,
                            bool add_generation_prompt, const std::string& origin,
                            const OrderedJson& tools) const;
  // [begin, end) of assistant turn i in `full`.
  std::pair<size_t, size_t> turn_span(const std::vector<Message>& messages, size_t i,
                                      const std::string& full, const std::string& origin,
                                      const OrderedJson& tools) const;

  ModelChatTemplate model_;
  jinja::Template template_;
};

}  // namespace ft::data
