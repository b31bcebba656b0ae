// Typed access to tokenizer.json fields: every failure is an ft::FormatError naming the file and
// the JSON key path ("model.merges[12]"), so a user can find what to fix. Stateless apart from
// the file name it carries; thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

namespace ft::tokenizer {

using Json = nlohmann::json;

class JsonFields {
 public:
  explicit JsonFields(std::string file) : file_(std::move(file)) {}

  const std::string& file() const { return file_; }

  // Throws FormatError "<file>: <key>: <msg>".
  [[noreturn]] void fail(const std::string& key, const std::string& msg) const;

  // `obj[name]`, which must exist and not be null.
  const Json& required(const Json& obj, const std::string& key, const char* name) const;
  // `obj[name]` or nullptr when it is absent or null.
  const Json* optional(const Json& obj, const char* name) const;

  std::string string(const Json& obj, const std::string& key, const char* name) const;
  // Absent or null gives `fallback`.
  bool boolean(const Json& obj, const std::string& key, const char* name, bool fallback) const;
  int64_t integer(const Json& obj, const std::string& key, const char* name) const;
  // `obj[name]` as an array / object (checked).
  const Json& array(const Json& obj, const std::string& key, const char* name) const;
  const Json& object(const Json& obj, const std::string& key, const char* name) const;

  // The one character of a string field (Metaspace replacement, Strip content).
  std::string character(const Json& obj, const std::string& key, const char* name) const;

  // "a.b" from "a" and "b"; "a[3]" from "a" and 3.
  static std::string join(const std::string& key, const char* name);
  static std::string index(const std::string& key, size_t i);

  // The "type" field of a component, required to be a string.
  std::string type_of(const Json& obj, const std::string& key) const;

  // Refuses a component type ft does not implement, listing the ones it does.
  [[noreturn]] void unsupported(const std::string& key, const std::string& what,
                                const std::string& type, const char* supported) const;

 private:
  std::string file_;
};

}  // namespace ft::tokenizer
