// A Jinja template as transformers renders chat templates (jinja2's ImmutableSandboxedEnvironment
// with trim_blocks, lstrip_blocks, loop controls, and the globals raise_exception, strftime_now,
// namespace, dict; tojson as json.dumps with ensure_ascii=False). Parse once, render many times.
// A Template is immutable after construction; render() is const and thread-safe (each render has
// its own state).
#pragma once

#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "template/ast.h"
#include "template/source.h"

namespace ft::jinja {

struct RenderOptions {
  // Fixes strftime_now's clock (seconds since the epoch); unset, the time of each call. Formatted
  // in local time either way, as transformers does.
  std::optional<std::time_t> now;
  // Work limits: statements executed and loop iterations together, and bytes of output.
  size_t max_steps = 5'000'000;  // a real template renders a conversation in thousands
  size_t max_output_bytes = size_t{256} << 20;
};

class Template {
 public:
  // Parses `text`; `origin` names it in every error ("DIR/tokenizer_config.json chat_template").
  // Throws TemplateError with origin:line:col on a syntax error.
  Template(std::string text, std::string origin);

  // Renders with the keys of `variables` (a JSON object) as the template's variables. Throws
  // TemplateError with origin:line:col for a runtime error, including raise_exception's message.
  // ordered_json keeps the key order of the variables' objects, which `tojson` and loops over a
  // dict show; nlohmann::json sorts keys.
  std::string render(const nlohmann::ordered_json& variables,
                     const RenderOptions& options = {}) const;
  std::string render(const nlohmann::json& variables, const RenderOptions& options = {}) const;

  const std::string& origin() const { return source_->origin(); }

 private:
  std::shared_ptr<const Source> source_;
  std::shared_ptr<const Body> body_;
};

}  // namespace ft::jinja
