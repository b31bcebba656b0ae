// What a template can call and look up, with jinja2's and Python's semantics: the filters
// (`| trim`, `| tojson`, ...), the tests (`is defined`, ...), attribute and item access, slicing,
// the methods of strings and dicts, and the globals transformers gives chat templates (range,
// namespace, dict, raise_exception, strftime_now). Errors are thrown as EvalError without a
// position; the renderer adds the template's origin, line and column. Stateless; thread-safe.
#pragma once

#include <ctime>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "template/value.h"

namespace ft::jinja {

// A failure while evaluating, to be placed by the renderer at the node being evaluated.
class EvalError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// raise_exception(message) from the template itself.
class RaisedError : public EvalError {
 public:
  using EvalError::EvalError;
};

// The sandbox's limit on range() (jinja2's MAX_RANGE) and on any list or string a filter builds.
inline constexpr int64_t kMaxRange = 100000;
inline constexpr size_t kMaxStringBytes = size_t{64} << 20;

// Calls `fn` for every element of an iterable value (list items, dict keys, a string's code
// points, nothing for undefined); throws EvalError for anything else.
std::vector<Value> iterate(const Value& v);

// jinja2's getattr (obj.name: Python attribute first, then item) and getitem (obj[key]: item
// first, then attribute). Missing gives an undefined that says what was missing; an undefined
// object throws.
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
// obj[start:stop:step] on lists and strings (code points); absent parts are undefined values.
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// Calls a callable value.
Value call(const Value& fn, CallArgs& args);

// Applies a filter or test by name; throws EvalError for an unknown name or bad arguments.
Value apply_filter(const std::string& name, const Value& target, CallArgs& args);
bool apply_test(const std::string& name, const Value& target, CallArgs& args);
bool has_filter(const std::string& name);
bool has_test(const std::string& name);

// Binary operators with Python's semantics (+ - * / // % ** ~); throws EvalError for operand
// types Python refuses ("unsupported operand type(s) for +: 'int' and 'str'").
Value binary_op(const std::string& op, const Value& a, const Value& b);
// `a in b`.
bool contains(const Value& container, const Value& item);

// The globals of transformers' chat-template environment. `now` (seconds since the epoch) fixes
// strftime_now's clock for reproducible renders; unset, the time of the call (local time).
Dict make_globals(std::optional<std::time_t> now);

}  // namespace ft::jinja
