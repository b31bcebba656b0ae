// The values a Jinja template computes with, as Python and jinja2 see them: undefined, none,
// booleans, integers, floats, strings, lists (and tuples), dicts (ordered, string keys, and the
// namespaces of `namespace()`), and callables (filters' helpers, macros, bound methods). Lists and
// dicts are shared by reference, as in Python. Conversions from and to JSON, Python's str() and
// repr(), truthiness, equality and ordering. Not thread-safe: a value belongs to one render.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace ft::jinja {

class Value;

// jinja2's default Undefined: renders empty, is falsy, iterates as empty; anything more (an
// attribute of it, arithmetic) is an error that says what was undefined.
struct Undefined {
  std::string hint;  // "'foo' is undefined", "'dict object' has no attribute 'a'"
};
struct None {};

struct ListObject {
  std::vector<Value> items;
  bool tuple = false;  // renders as (a, b) instead of [a, b]
};
struct DictObject {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python dicts
  bool is_namespace = false;                         // namespace(): attributes may be assigned
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
};

// Arguments of a call: positional, then keyword.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};
struct Function {
  std::string name;
  std::function<Value(CallArgs&)> call;
};

using List = std::shared_ptr<ListObject>;
using Dict = std::shared_ptr<DictObject>;
using Callable = std::shared_ptr<Function>;

class Value {
 public:
  using Storage =
      std::variant<Undefined, None, bool, int64_t, double, std::string, List, Dict, Callable>;

  Value() : v_(Undefined{}) {}
  Value(None n) : v_(n) {}
  Value(Undefined u) : v_(std::move(u)) {}
  Value(bool b) : v_(b) {}
  Value(int i) : v_(static_cast<int64_t>(i)) {}
  Value(int64_t i) : v_(i) {}
  Value(double d) : v_(d) {}
  Value(std::string s) : v_(std::move(s)) {}
  Value(const char* s) : v_(std::string(s)) {}
  Value(List l) : v_(std::move(l)) {}
  Value(Dict d) : v_(std::move(d)) {}
  Value(Callable c) : v_(std::move(c)) {}

  static Value list(std::vector<Value> items = {}, bool tuple = false);
  static Value dict();
  static Value undefined(std::string hint) { return Value(Undefined{std::move(hint)}); }

  bool is_undefined() const { return std::holds_alternative<Undefined>(v_); }
  bool is_none() const { return std::holds_alternative<None>(v_); }
  bool is_bool() const { return std::holds_alternative<bool>(v_); }
  bool is_int() const { return std::holds_alternative<int64_t>(v_); }
  bool is_float() const { return std::holds_alternative<double>(v_); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return std::holds_alternative<std::string>(v_); }
  bool is_list() const { return std::holds_alternative<List>(v_); }
  bool is_dict() const { return std::holds_alternative<Dict>(v_); }
  bool is_callable() const { return std::holds_alternative<Callable>(v_); }

  bool as_bool() const { return std::get<bool>(v_); }
  int64_t as_int() const { return std::get<int64_t>(v_); }
  double as_float() const { return std::get<double>(v_); }
  // A number as a double (bools are 0 and 1, as in Python).
  double as_number() const;
  const std::string& as_string() const { return std::get<std::string>(v_); }
  const List& as_list() const { return std::get<List>(v_); }
  const Dict& as_dict() const { return std::get<Dict>(v_); }
  const Callable& as_callable() const { return std::get<Callable>(v_); }
  const Undefined& as_undefined() const { return std::get<Undefined>(v_); }

  // Python's type name, as error messages print it: "int", "str", "list", "dict", "NoneType".
  const char* type_name() const;
  // Python's bool(value); undefined is false.
  bool truthy() const;
  // Python's str(value); undefined renders empty.
  std::string str() const;
  // Python's repr(value).
  std::string repr() const;

 private:
  Storage v_;
};

// Python's ==. Ints, floats and bools compare as numbers; lists and dicts element-wise.
bool equal(const Value& a, const Value& b);
// Python's <: numbers, strings (code point order), lists lexicographically. Other pairs are not
// ordered: returns false and sets *comparable to false.
bool less(const Value& a, const Value& b, bool* comparable);

// JSON (a chat record, the template's variables) to values. Objects become dicts: ordered_json
// keeps the document's key order, as Python's json does (nlohmann::json sorts keys).
Value from_json(const nlohmann::ordered_json& j);
Value from_json(const nlohmann::json& j);

// Python's json.dumps(value, ensure_ascii, indent, separators, sort_keys) as transformers' tojson
// filter calls it. indent < 0 means None. Throws std::invalid_argument for what JSON cannot hold
// (undefined, callables).
struct JsonStyle {
  int indent = -1;
  bool ensure_ascii = false;
  bool sort_keys = false;
  std::string item_separator;  // empty: Python's default ", " (or "," with an indent)
  std::string key_separator = ": ";
  bool custom_item_separator = false;
};
std::string to_json(const Value& v, const JsonStyle& style);

// Python's repr of a float ("1.0", "0.30000000000000004", "1e+20", "inf", "nan").
std::string float_repr(double d);

// UTF-8 as Python sees a str: code points. Bytes that are not UTF-8 count as one each.
std::vector<std::string> code_points(std::string_view s);
size_t code_point_count(std::string_view s);
// Python's str.isspace for one code point given as UTF-8.
bool is_python_space(std::string_view cp);

}  // namespace ft::jinja
