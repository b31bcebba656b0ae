#include "tokenizer/json_fields.h"

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace ft::tokenizer {

void JsonFields::fail(const std::string& key, const std::string& msg) const {
  throw ft::FormatError(file_ + ": " + key + ": " + msg);
}

std::string JsonFields::join(const std::string& key, const char* name) {
  return key.empty() ? std::string(name) : key + "." + name;
}

std::string JsonFields::index(const std::string& key, size_t i) {
  return key + "[" + std::to_string(i) + "]";
}

const Json& JsonFields::required(const Json& obj, const std::string& key, const char* name) const {
  if (!obj.is_object()) fail(key, std::string("expected an object, got ") + obj.type_name());
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) fail(join(key, name), "missing");
  return *it;
}

const Json* JsonFields::optional(const Json& obj, const char* name) const {
  if (!obj.is_object()) return nullptr;
  const auto it = obj.find(name);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

std::string JsonFields::string(const Json& obj, const std::string& key, const char* name) const {
  const Json& v = required(obj, key, name);
  if (!v.is_string()) fail(join(key, name), std::string("expected a string, got ") + v.type_name());
  return v.get<std::string>();
}

bool JsonFields::boolean(const Json& obj, const std::string& key, const char* name,
                         bool fallback) const {
  const Json* v = optional(obj, name);
  if (v == nullptr) return fallback;
  if (!v->is_boolean()) {
    fail(join(key, name), std::string("expected true or false, got ") + v->type_name());
  }
  return v->get<bool>();
}

int64_t JsonFields::integer(const Json& obj, const std::string& key, const char* name) const {
  const Json& v = required(obj, key, name);
  if (!v.is_number_integer()) {
    fail(join(key, name), std::string("expected an integer, got ") + v.type_name());
  }
  return v.get<int64_t>();
}

const Json& JsonFields::array(const Json& obj, const std::string& key, const char* name) const {
  const Json& v = required(obj, key, name);
  if (!v.is_array()) fail(join(key, name), std::string("expected an array, got ") + v.type_name());
  return v;
}

const Json& JsonFields::object(const Json& obj, const std::string& key, const char* name) const {
  const Json& v = required(obj, key, name);
  if (!v.is_object())
    fail(join(key, name), std::string("expected an object, got ") + v.type_name());
  return v;
}

std::string JsonFields::character(const Json& obj, const std::string& key, const char* name) const {
  std::string s = string(obj, key, name);
  if (s.empty() || find_invalid_utf8(s) != std::string::npos ||
      utf8_len(static_cast<unsigned char>(s[0])) != s.size()) {
    fail(join(key, name), "expected exactly one character, got \"" + s + "\"");
  }
  return s;
}

std::string JsonFields::type_of(const Json& obj, const std::string& key) const {
  return string(obj, key, "type");
}

void JsonFields::unsupported(const std::string& key, const std::string& what,
                             const std::string& type, const char* supported) const {
  fail(join(key, "type"), "unsupported " + what + " type \"" + type + "\" (ft implements " +
                              supported +
                              "; refusing rather than tokenizing differently from "
                              "Hugging Face)");
}

}  // namespace ft::tokenizer
