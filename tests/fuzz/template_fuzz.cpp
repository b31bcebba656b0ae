// Fuzzes chat templates, which come from model directories: the input, up to its first NUL byte,
// is a Jinja template; after it, a JSON document of variables (when it parses; else a fixed
// conversation). The template is parsed and rendered with small limits on steps and output, and,
// as a model's template, rendered into masked segments (data/chat_template.h) of a fixed
// conversation with and without train_on_prompt. Every answer to bad input must be ft's typed
// error (jinja::TemplateError, or the FormatError naming the record); the segments of a rendering
// are non-empty and alternate between trained and not, and all are trained with train_on_prompt.
#include <nlohmann/json.hpp>

#include "data/chat_template.h"
#include "fuzz_support.h"
#include "template/template.h"

namespace {

using namespace ft;

const std::vector<data::Message>& conversation() {
  static const std::vector<data::Message> kMessages = {{"system", "Be brief."},
                                                       {"user", "Hi 😀"},
                                                       {"assistant", "Hello."},
                                                       {"user", "More?"},
                                                       {"assistant", "  Yes  "}};
  return kMessages;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split(fuzz::as_text(data, size), std::string_view("\0", 1), 2);
  const std::string source(parts[0]);
  nlohmann::ordered_json vars = nlohmann::ordered_json::object();
  if (parts.size() > 1) {
    vars = nlohmann::ordered_json::parse(parts[1], nullptr, /*allow_exceptions=*/false);
    if (vars.is_discarded() || !vars.is_object()) vars = nlohmann::ordered_json::object();
  }
  jinja::RenderOptions limits;
  limits.now = 0;
  limits.max_steps = 20000;
  limits.max_output_bytes = 1 << 20;
  fuzz::expect_ft_errors([&] {
    const jinja::Template t(source, "fuzz.jinja");
    (void)t.render(vars, limits);
  });
  fuzz::expect_ft_errors([&] {
    const data::JinjaChatTemplate t({source, "fuzz.jinja", "<s>", "</s>", 0});
    for (const bool on_prompt : {false, true}) {
      const std::vector<data::Segment> segs = t.render(conversation(), on_prompt, "fuzz.jsonl:1");
      for (size_t i = 0; i < segs.size(); ++i) {
        fuzz::require(!segs[i].text.empty(), "no empty segment");
        fuzz::require(i == 0 || segs[i].trained != segs[i - 1].trained, "segments alternate");
        fuzz::require(!on_prompt || segs[i].trained, "train_on_prompt trains everything");
      }
    }
  });
  return 0;
}
