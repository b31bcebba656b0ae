#include "config/settings.h"

#include <algorithm>

#include "config/preset.h"
#include "config/schema.h"
#include "core/error.h"
#include "core/json.h"

namespace ft::config {

using nlohmann::json;

Settings settings_from_json(const json& resolved, const std::string& where) {
  FT_CHECK(resolved.is_object(), where, ": a preset must be a JSON object");
  Settings s;
  for (const Setting& row : preset_schema()) {
    std::string pointer = "/" + row.key;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    const json::json_pointer ptr(pointer);
    // A key added to the schema after a checkpoint recorded its preset takes its default.
    const json& v = resolved.contains(ptr) ? resolved.at(ptr) : row.default_value;
    try {
      row.bind(s, v);
    } catch (const json::exception&) {
      throw ConfigError(where + ": \"" + row.key + "\" has the wrong type, got " + excerpt_json(v));
    }
  }
  const json name = resolved.value("name", json(""));
  FT_CHECK(name.is_string(), where, ": \"name\" must be a string, got ", excerpt_json(name));
  s.name = name.get<std::string>();
  s.resolved = resolved;
  return s;
}

Settings resolve_settings(const std::string& name_or_file, const std::vector<std::string>& sets) {
  Settings s = settings_from_json(resolve_preset(name_or_file, sets), "resolved preset");
  s.strategy.user_keys = user_settings(name_or_file, sets);
  return s;
}

}  // namespace ft::config
