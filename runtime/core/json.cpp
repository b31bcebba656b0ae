#include "core/json.h"

namespace ft {

size_t json_too_deep_at(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return i;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return std::string_view::npos;
}

std::string excerpt(std::string_view s, size_t max) {
  if (s.size() <= max) return std::string(s);
  return fmt::format("{}... ({} characters)", s.substr(0, max), s.size());
}

std::string excerpt_json(const nlohmann::json& value, size_t max) {
  return excerpt(value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace), max);
}

}  // namespace ft
