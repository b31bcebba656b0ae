#include "template/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "core/error.h"

namespace ft::jinja {
namespace {

[[noreturn]] void fail(const std::string& msg) { throw EvalError(msg); }

[[noreturn]] void fail_undefined(const Value& v) {
  const std::string& hint = v.as_undefined().hint;
  fail(hint.empty() ? "a value is undefined" : hint);
}

// Binds a call's arguments to named parameters, as Python does for a builtin with defaults.
class Params {
 public:
  Params(const char* fname, CallArgs& args, std::vector<const char*> names)
      : names_(std::move(names)), slots_(names_.size(), nullptr) {
    if (args.positional.size() > names_.size()) {
      fail(detail::cat(fname, "() takes at most ", names_.size(), " argument(s), got ",
                       args.positional.size()));
    }
    for (size_t i = 0; i < args.positional.size(); ++i) slots_[i] = &args.positional[i];
    for (auto& kv : args.keyword) {
      const std::string& k = kv.first;
      auto it = std::find_if(names_.begin(), names_.end(), [&](const char* n) { return k == n; });
      if (it == names_.end())
        fail(detail::cat(fname, "() got an unexpected keyword argument '", k, "'"));
      slots_[static_cast<size_t>(it - names_.begin())] = &kv.second;
    }
  }
  const Value* get(size_t i) const {
    return slots_[i] && !slots_[i]->is_undefined() ? slots_[i] : nullptr;
  }
  Value value(size_t i, Value dflt) const { return get(i) ? *get(i) : std::move(dflt); }
  bool flag(size_t i, bool dflt) const { return get(i) ? get(i)->truthy() : dflt; }
  int64_t integer(size_t i, int64_t dflt, const char* fname) const {
    const Value* v = get(i);
    if (!v) return dflt;
    if (v->is_int()) return v->as_int();
    if (v->is_bool()) return v->as_bool();
    fail(detail::cat(fname, "(): ", names_[i], " must be an integer, got ", v->type_name()));
  }
  std::optional<std::string> string(size_t i) const {
    const Value* v = get(i);
    if (!v || v->is_none()) return std::nullopt;
    return v->str();
  }

 private:
  std::vector<const char*> names_;
  std::vector<Value*> slots_;
};

std::string need_string(const Value& v, const char* what) {
  if (v.is_undefined()) return "";
  if (!v.is_string()) fail(detail::cat(what, " needs a string, got ", v.type_name()));
  return v.as_string();
}

// --- strings as code points

bool in_chars(const std::string& cp, const std::vector<std::string>& chars) {
  return std::find(chars.begin(), chars.end(), cp) != chars.end();
}

std::string strip(const std::string& s, const std::optional<std::string>& chars, bool left,
                  bool right) {
  const std::vector<std::string> cps = code_points(s);
  const std::vector<std::string> set = chars ? code_points(*chars) : std::vector<std::string>{};
  auto drop = [&](const std::string& cp) {
    return chars ? in_chars(cp, set) : is_python_space(cp);
  };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && drop(cps[b])) ++b;
  }
  if (right) {
    while (e > b && drop(cps[e - 1])) --e;
  }
  std::string out;
  for (size_t i = b; i < e; ++i) out += cps[i];
  return out;
}

// Case mapping of ASCII, Latin-1, Greek and Cyrillic letters (the scripts of the fixtures);
// other letters pass through unchanged.
std::string change_case(const std::string& cp, bool upper) {
  if (cp.size() == 1) {
    char c = cp[0];
    if (upper && c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
    if (!upper && c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
    return std::string(1, c);
  }
  if (cp.size() != 2) return cp;
  uint32_t u = ((static_cast<unsigned char>(cp[0]) & 0x1F) << 6) |
               (static_cast<unsigned char>(cp[1]) & 0x3F);
  auto enc = [](uint32_t x) {
    std::string o;
    o += static_cast<char>(0xC0 | (x >> 6));
    o += static_cast<char>(0x80 | (x & 0x3F));
    return o;
  };
  if (upper) {
    if ((u >= 0xE0 && u <= 0xFE && u != 0xF7) || (u >= 0x3B1 && u <= 0x3C9 && u != 0x3C2) ||
        (u >= 0x430 && u <= 0x44F))
      return enc(u - 32);
    if (u >= 0x450 && u <= 0x45F) return enc(u - 80);
  } else {
    if ((u >= 0xC0 && u <= 0xDE && u != 0xD7) || (u >= 0x391 && u <= 0x3A9 && u != 0x3A2) ||
        (u >= 0x410 && u <= 0x42F))
      return enc(u + 32);
    if (u >= 0x400 && u <= 0x40F) return enc(u + 80);
  }
  return cp;
}

bool is_cased(const std::string& cp) {
  return change_case(cp, true) != cp || change_case(cp, false) != cp;
}

std::string map_case(const std::string& s, bool upper) {
  std::string out;
  for (const std::string& cp : code_points(s)) out += change_case(cp, upper);
  return out;
}

// Python's str.title(): a cased letter after an uncased one is upper, others lower.
std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (const std::string& cp : code_points(s)) {
    out += change_case(cp, !prev_cased);
    prev_cased = is_cased(cp);
  }
  return out;
}

// jinja2's title filter: words start after spaces, '-', and opening brackets.
std::string jinja_title(const std::string& s) {
  std::string out;
  bool start = true;
  for (const std::string& cp : code_points(s)) {
    const bool boundary =
        is_python_space(cp) || cp == "-" || cp == "(" || cp == "{" || cp == "[" || cp == "<";
    out += boundary ? cp : change_case(cp, start);
    start = boundary;
  }
  return out;
}

std::string capitalize(const std::string& s) {
  std::string out;
  bool first = true;
  for (const std::string& cp : code_points(s)) {
    out += change_case(cp, first);
    first = false;
  }
  return out;
}

std::string replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  std::string out;
  if (from.empty()) {
    const std::vector<std::string> cps = code_points(s);
    int64_t n = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (i < cps.size()) out += cps[i];
    }
    return out;
  }
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t at = s.find(from, pos);
    if (at == std::string::npos) break;
    out.append(s, pos, at - pos);
    out += to;
    if (out.size() > kMaxStringBytes) fail("replace() result exceeds the size limit");
    pos = at + from.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

Value split(const std::string& s, const std::optional<std::string>& sep, int64_t maxsplit,
            bool from_right) {
  std::vector<std::string> parts;
  if (!sep) {
    // Runs of whitespace separate; empty strings are dropped.
    std::vector<std::string> cps = code_points(s);
    if (from_right) std::reverse(cps.begin(), cps.end());
    std::string word;
    bool in_word = false;
    int64_t splits = 0;
    size_t i = 0;
    for (; i < cps.size(); ++i) {
      if (is_python_space(cps[i])) {
        if (in_word) {
          parts.push_back(word);
          word.clear();
          in_word = false;
          if (maxsplit >= 0 && ++splits >= maxsplit) {
            ++i;
            break;
          }
        }
      } else {
        word += cps[i];  // reversed code points when from_right; fixed below
        in_word = true;
      }
    }
    if (in_word) parts.push_back(word);
    if (i < cps.size() && !in_word) {
      // The rest after maxsplit splits, with leading whitespace dropped.
      size_t k = i;
      while (k < cps.size() && is_python_space(cps[k])) ++k;
      std::string rest;
      for (; k < cps.size(); ++k) rest += cps[k];
      if (!rest.empty()) parts.push_back(rest);
    }
    if (from_right) {
      // Each part was built from reversed code points: reverse them back.
      for (std::string& p : parts) {
        std::vector<std::string> pc = code_points(p);
        std::string fixed;
        for (auto it = pc.rbegin(); it != pc.rend(); ++it) fixed += *it;
        p = fixed;
      }
      std::reverse(parts.begin(), parts.end());
    }
  } else {
    if (sep->empty()) fail("split(): empty separator");
    if (!from_right) {
      size_t pos = 0;
      int64_t n = 0;
      while (maxsplit < 0 || n < maxsplit) {
        const size_t at = s.find(*sep, pos);
        if (at == std::string::npos) break;
        parts.push_back(s.substr(pos, at - pos));
        pos = at + sep->size();
        ++n;
      }
      parts.push_back(s.substr(pos));
    } else {
      size_t end = s.size();
      int64_t n = 0;
      while ((maxsplit < 0 || n < maxsplit) && end >= sep->size()) {
        const size_t at = s.rfind(*sep, end - sep->size());
        if (at == std::string::npos) break;
        parts.push_back(s.substr(at + sep->size(), end - at - sep->size()));
        end = at;
        ++n;
      }
      parts.push_back(s.substr(0, end));
      std::reverse(parts.begin(), parts.end());
    }
  }
  std::vector<Value> out;
  out.reserve(parts.size());
  for (auto& p : parts) out.emplace_back(std::move(p));
  return Value::list(std::move(out));
}

bool affix_match(const std::string& s, const Value& affix, bool prefix, const char* fname) {
  auto one = [&](const Value& a) {
    if (!a.is_string()) fail(detail::cat(fname, "() needs a string or a tuple of strings"));
    const std::string& x = a.as_string();
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0
                  : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.is_list()) {
    for (const Value& a : affix.as_list()->items) {
      if (one(a)) return true;
    }
    return false;
  }
  return one(affix);
}

Callable make_function(std::string name, std::function<Value(CallArgs&)> fn) {
  auto f = std::make_shared<Function>();
  f->name = std::move(name);
  f->call = std::move(fn);
  return f;
}

const std::vector<std::string>& string_methods() {
  static const std::vector<std::string> kNames = {
      "strip",   "lstrip",  "rstrip",  "split",   "rsplit",     "startswith", "endswith",
      "upper",   "lower",   "replace", "title",   "capitalize", "find",       "count",
      "isdigit", "isspace", "isalpha", "isupper", "islower"};
  return kNames;
}

Value string_method(const std::string& s, const std::string& name, CallArgs& a) {
  const std::string f = "str." + name;
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    Params p(f.c_str(), a, {"chars"});
    return Value(strip(s, p.string(0), name != "rstrip", name != "lstrip"));
  }
  if (name == "split" || name == "rsplit") {
    Params p(f.c_str(), a, {"sep", "maxsplit"});
    return split(s, p.string(0), p.integer(1, -1, f.c_str()), name == "rsplit");
  }
  if (name == "startswith" || name == "endswith") {
    Params p(f.c_str(), a, {"prefix"});
    if (!p.get(0)) fail(f + "() takes one argument");
    return Value(affix_match(s, *p.get(0), name == "startswith", f.c_str()));
  }
  if (name == "upper" || name == "lower") {
    Params p(f.c_str(), a, {});
    return Value(map_case(s, name == "upper"));
  }
  if (name == "title") {
    Params p(f.c_str(), a, {});
    return Value(py_title(s));
  }
  if (name == "capitalize") {
    Params p(f.c_str(), a, {});
    return Value(capitalize(s));
  }
  if (name == "replace") {
    Params p(f.c_str(), a, {"old", "new", "count"});
    if (!p.get(0) || !p.get(1)) fail("str.replace() takes at least two arguments");
    return Value(replace(s, need_string(*p.get(0), "str.replace()"),
                         need_string(*p.get(1), "str.replace()"), p.integer(2, -1, f.c_str())));
  }
  if (name == "find" || name == "count") {
    Params p(f.c_str(), a, {"sub"});
    if (!p.get(0)) fail(f + "() takes one argument");
    const std::string sub = need_string(*p.get(0), f.c_str());
    if (name == "find") {
      const size_t at = s.find(sub);
      return Value(at == std::string::npos
                       ? int64_t{-1}
                       : static_cast<int64_t>(code_point_count(s.substr(0, at))));
    }
    if (sub.empty()) return Value(static_cast<int64_t>(code_point_count(s) + 1));
    int64_t n = 0;
    for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + sub.size())) ++n;
    return Value(n);
  }
  Params p(f.c_str(), a, {});
  const std::vector<std::string> cps = code_points(s);
  if (cps.empty()) return Value(false);
  bool all = true, any_cased = false;
  for (const std::string& cp : cps) {
    if (name == "isdigit") all = all && cp.size() == 1 && cp[0] >= '0' && cp[0] <= '9';
    if (name == "isspace") all = all && is_python_space(cp);
    if (name == "isalpha") all = all && is_cased(cp);
    if (name == "isupper" || name == "islower") {
      if (is_cased(cp)) {
        any_cased = true;
        all = all && change_case(cp, name == "isupper") == cp;
      }
    }
  }
  if (name == "isupper" || name == "islower") return Value(all && any_cased);
  return Value(all);
}

bool is_dict_method(const std::string& name) {
  return name == "items" || name == "keys" || name == "values" || name == "get";
}

Value dict_method(const Dict& d, const std::string& name, CallArgs& a) {
  const std::string f = "dict." + name;
  if (name == "get") {
    Params p(f.c_str(), a, {"key", "default"});
    if (!p.get(0)) fail("dict.get() takes at least one argument");
    if (p.get(0)->is_string()) {
      if (const Value* v = d->find(p.get(0)->as_string())) return *v;
    }
    return p.value(1, Value(None{}));
  }
  Params p(f.c_str(), a, {});
  std::vector<Value> out;
  for (const auto& [k, v] : d->items) {
    if (name == "items") {
      out.push_back(Value::list({Value(k), v}, true));
    } else {
      out.push_back(name == "keys" ? Value(k) : v);
    }
  }
  return Value::list(std::move(out));
}

std::string object_name(const Value& v) {
  if (v.is_none()) return "'None'";
  return detail::cat("'", v.type_name(), " object'");
}

int64_t normalize_index(int64_t i, int64_t n) { return i < 0 ? i + n : i; }

std::vector<Value> sequence_items(const Value& v, bool* is_string) {
  *is_string = v.is_string();
  if (v.is_string()) {
    std::vector<Value> out;
    for (auto& cp : code_points(v.as_string())) out.emplace_back(std::move(cp));
    return out;
  }
  if (v.is_list()) return v.as_list()->items;
  fail(detail::cat("'", v.type_name(), "' object is not subscriptable"));
}

int64_t to_int(const Value& v, const char* what) {
  if (v.is_int()) return v.as_int();
  if (v.is_bool()) return v.as_bool();
  fail(detail::cat(what, " must be an integer or None, got ", v.type_name()));
}

// --- arithmetic

int64_t as_i(const Value& v) { return v.is_int() ? v.as_int() : (v.as_bool() ? 1 : 0); }

Value repeat(const Value& seq, int64_t n) {
  if (n <= 0) return seq.is_string() ? Value(std::string()) : Value::list();
  if (seq.is_string()) {
    const std::string& s = seq.as_string();
    if (s.size() * static_cast<size_t>(n) > kMaxStringBytes ||
        static_cast<size_t>(n) > kMaxStringBytes)
      fail("string repetition exceeds the size limit");
    std::string out;
    for (int64_t i = 0; i < n; ++i) out += s;
    return Value(out);
  }
  const auto& items = seq.as_list()->items;
  if (items.size() * static_cast<size_t>(n) > static_cast<size_t>(kMaxRange) ||
      static_cast<size_t>(n) > static_cast<size_t>(kMaxRange))
    fail("list repetition exceeds the size limit");
  std::vector<Value> out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), items.begin(), items.end());
  return Value::list(std::move(out), seq.as_list()->tuple);
}

// --- filters

using FilterFn = Value (*)(const Value&, CallArgs&);

Value f_trim(const Value& v, CallArgs& a) {
  Params p("trim", a, {"chars"});
  return Value(strip(v.str(), p.string(0), true, true));
}

Value f_tojson(const Value& v, CallArgs& a) {
  Params p("tojson", a, {"ensure_ascii", "indent", "separators", "sort_keys"});
  JsonStyle st;
  st.ensure_ascii = p.flag(0, false);
  if (const Value* ind = p.get(1); ind && !ind->is_none())
    st.indent = static_cast<int>(to_int(*ind, "tojson indent"));
  if (const Value* sep = p.get(2); sep && !sep->is_none()) {
    if (!sep->is_list() || sep->as_list()->items.size() != 2)
      fail("tojson(): separators must be a pair of strings");
    st.item_separator = sep->as_list()->items[0].str();
    st.key_separator = sep->as_list()->items[1].str();
    st.custom_item_separator = true;
  }
  st.sort_keys = p.flag(3, false);
  if (v.is_undefined()) fail_undefined(v);
  try {
    return Value(to_json(v, st));
  } catch (const std::invalid_argument& e) {
    fail(e.what());
  }
}

int64_t length_of(const Value& v) {
  if (v.is_undefined()) return 0;
  if (v.is_string()) return static_cast<int64_t>(code_point_count(v.as_string()));
  if (v.is_list()) return static_cast<int64_t>(v.as_list()->items.size());
  if (v.is_dict()) return static_cast<int64_t>(v.as_dict()->items.size());
  fail(detail::cat("object of type '", v.type_name(), "' has no len()"));
}

Value f_length(const Value& v, CallArgs& a) {
  Params p("length", a, {});
  return Value(length_of(v));
}
Value f_upper(const Value& v, CallArgs& a) {
  Params p("upper", a, {});
  return Value(map_case(v.str(), true));
}
Value f_lower(const Value& v, CallArgs& a) {
  Params p("lower", a, {});
  return Value(map_case(v.str(), false));
}
Value f_title(const Value& v, CallArgs& a) {
  Params p("title", a, {});
  return Value(jinja_title(v.str()));
}
Value f_capitalize(const Value& v, CallArgs& a) {
  Params p("capitalize", a, {});
  return Value(capitalize(v.str()));
}
Value f_default(const Value& v, CallArgs& a) {
  Params p("default", a, {"default_value", "boolean"});
  const bool use_default = v.is_undefined() || (p.flag(1, false) && !v.truthy());
  if (!use_default) return v;
  return p.get(0) ? *p.get(0) : Value(std::string());
}
Value f_first(const Value& v, CallArgs& a) {
  Params p("first", a, {});
  std::vector<Value> items = iterate(v);
  return items.empty() ? Value::undefined("first() of an empty sequence") : items.front();
}
Value f_last(const Value& v, CallArgs& a) {
  Params p("last", a, {});
  std::vector<Value> items = iterate(v);
  return items.empty() ? Value::undefined("last() of an empty sequence") : items.back();
}

Value attribute_path(const Value& item, const std::string& path) {
  Value cur = item;
  size_t pos = 0;
  while (true) {
    const size_t dot = path.find('.', pos);
    const std::string part =
        path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                               [](char c) { return c >= '0' && c <= '9'; });
    cur = digits ? get_item(cur, Value(static_cast<int64_t>(std::stoll(part))))
                 : get_item(cur, Value(part));
    if (dot == std::string::npos) return cur;
    pos = dot + 1;
  }
}

Value f_join(const Value& v, CallArgs& a) {
  Params p("join", a, {"d", "attribute"});
  const std::string sep = p.get(0) ? p.get(0)->str() : "";
  const std::optional<std::string> attr = p.string(1);
  std::string out;
  bool first = true;
  for (const Value& item : iterate(v)) {
    if (!first) out += sep;
    first = false;
    out += attr ? attribute_path(item, *attr).str() : item.str();
    if (out.size() > kMaxStringBytes) fail("join() result exceeds the size limit");
  }
  return Value(out);
}
Value f_string(const Value& v, CallArgs& a) {
  Params p("string", a, {});
  return Value(v.str());
}
Value f_int(const Value& v, CallArgs& a) {
  Params p("int", a, {"default", "base"});
  const Value dflt = p.value(0, Value(int64_t{0}));
  if (v.is_int()) return v;
  if (v.is_bool()) return Value(static_cast<int64_t>(v.as_bool()));
  if (v.is_float()) {
    const double d = v.as_float();
    if (!std::isfinite(d) || std::fabs(d) > 9.2e18) return dflt;
    return Value(static_cast<int64_t>(d));
  }
  if (v.is_string()) {
    const std::string s = strip(v.as_string(), std::nullopt, true, true);
    const int base = static_cast<int>(p.integer(1, 10, "int"));
    char* end = nullptr;
    errno = 0;
    const long long r = std::strtoll(s.c_str(), &end, base);
    if (!s.empty() && end && *end == '\0' && errno == 0) return Value(static_cast<int64_t>(r));
    char* fend = nullptr;
    const double d = std::strtod(s.c_str(), &fend);  // jinja2 tries float(value) next
    if (!s.empty() && fend && *fend == '\0' && std::isfinite(d) && std::fabs(d) < 9.2e18)
      return Value(static_cast<int64_t>(d));
  }
  return dflt;
}
Value f_float(const Value& v, CallArgs& a) {
  Params p("float", a, {"default"});
  const Value dflt = p.value(0, Value(0.0));
  if (v.is_float()) return v;
  if (v.is_int() || v.is_bool()) return Value(v.as_number());
  if (v.is_string()) {
    const std::string s = strip(v.as_string(), std::nullopt, true, true);
    char* end = nullptr;
    const double d = std::strtod(s.c_str(), &end);
    if (!s.empty() && end && *end == '\0') return Value(d);
  }
  return dflt;
}
Value f_list(const Value& v, CallArgs& a) {
  Params p("list", a, {});
  return Value::list(iterate(v));
}
Value f_items(const Value& v, CallArgs& a) {
  Params p("items", a, {});
  if (v.is_undefined()) return Value::list();
  if (!v.is_dict())
    fail(detail::cat("items filter: can only get item pairs from a mapping, got ", v.type_name()));
  CallArgs none;
  return dict_method(v.as_dict(), "items", none);
}

// select / reject / selectattr / rejectattr: test the item (or its attribute) with a named test
// (truthiness when none is named).
Value select_items(const Value& v, CallArgs& a, bool attr_mode, bool keep, const char* fname) {
  std::vector<Value> rest = a.positional;
  std::string attr;
  if (attr_mode) {
    if (rest.empty()) fail(detail::cat(fname, "() needs an attribute name"));
    attr = rest.front().str();
    rest.erase(rest.begin());
  }
  std::string test;
  if (!rest.empty()) {
    test = rest.front().str();
    rest.erase(rest.begin());
  }
  if (!test.empty() && !has_test(test)) fail(detail::cat(fname, "(): no test named '", test, "'"));
  std::vector<Value> out;
  for (const Value& item : iterate(v)) {
    const Value x = attr_mode ? attribute_path(item, attr) : item;
    bool ok;
    if (test.empty()) {
      ok = x.truthy();
    } else {
      CallArgs targs;
      targs.positional = rest;
      targs.keyword = a.keyword;
      ok = apply_test(test, x, targs);
    }
    if (ok == keep) out.push_back(item);
  }
  return Value::list(std::move(out));
}
Value f_select(const Value& v, CallArgs& a) { return select_items(v, a, false, true, "select"); }
Value f_reject(const Value& v, CallArgs& a) { return select_items(v, a, false, false, "reject"); }
Value f_selectattr(const Value& v, CallArgs& a) {
  return select_items(v, a, true, true, "selectattr");
}
Value f_rejectattr(const Value& v, CallArgs& a) {
  return select_items(v, a, true, false, "rejectattr");
}

Value f_map(const Value& v, CallArgs& a) {
  std::vector<Value> out;
  const Value* attribute = nullptr;
  const Value* dflt = nullptr;
  for (auto& [k, val] : a.keyword) {
    if (k == "attribute")
      attribute = &val;
    else if (k == "default")
      dflt = &val;
  }
  if (attribute) {
    for (const Value& item : iterate(v)) {
      Value x = attribute_path(item, attribute->str());
      if (x.is_undefined() && dflt) x = *dflt;
      out.push_back(x);
    }
    return Value::list(std::move(out));
  }
  if (a.positional.empty()) fail("map() needs a filter name or attribute=");
  const std::string name = a.positional.front().str();
  CallArgs rest;
  rest.positional.assign(a.positional.begin() + 1, a.positional.end());
  rest.keyword = a.keyword;
  for (const Value& item : iterate(v)) {
    CallArgs copy = rest;
    out.push_back(apply_filter(name, item, copy));
  }
  return Value::list(std::move(out));
}

Value f_replace(const Value& v, CallArgs& a) {
  Params p("replace", a, {"old", "new", "count"});
  if (!p.get(0) || !p.get(1)) fail("replace() takes at least two arguments");
  return Value(replace(v.str(), p.get(0)->str(), p.get(1)->str(), p.integer(2, -1, "replace")));
}
Value f_safe(const Value& v, CallArgs& a) {
  Params p("safe", a, {});
  return v;
}

Value f_unique(const Value& v, CallArgs& a) {
  Params p("unique", a, {"case_sensitive", "attribute"});
  const bool cs = p.flag(0, false);
  const std::optional<std::string> attr = p.string(1);
  std::vector<Value> out;
  std::vector<Value> seen;
  for (const Value& item : iterate(v)) {
    Value key = attr ? attribute_path(item, *attr) : item;
    if (!cs && key.is_string()) key = Value(map_case(key.as_string(), false));
    bool dup = false;
    for (const Value& s : seen) {
      if (equal(s, key)) {
        dup = true;
        break;
      }
    }
    if (!dup) {
      seen.push_back(key);
      out.push_back(item);
    }
  }
  return Value::list(std::move(out));
}
Value f_abs(const Value& v, CallArgs& a) {
  Params p("abs", a, {});
  if (v.is_int()) {
    if (v.as_int() == INT64_MIN) fail("integer overflow in abs()");
    return Value(static_cast<int64_t>(std::llabs(v.as_int())));
  }
  if (v.is_bool()) return Value(static_cast<int64_t>(v.as_bool()));
  if (v.is_float()) return Value(std::fabs(v.as_float()));
  fail(detail::cat("bad operand type for abs(): '", v.type_name(), "'"));
}
Value f_round(const Value& v, CallArgs& a) {
  Params p("round", a, {"precision", "method"});
  const int64_t precision = p.integer(0, 0, "round");
  const std::string method = p.get(1) ? p.get(1)->str() : "common";
  if (!v.is_number()) fail(detail::cat("round() needs a number, got ", v.type_name()));
  const double d = v.as_number();
  if (method == "common") {
    if (precision < 0 || precision > 300) fail("round(): precision out of range");
    // Python's round: the exact binary value rounded half to even, as printf does.
    char buf[400];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(precision), d);
    return Value(std::strtod(buf, nullptr));
  }
  const double scale = std::pow(10.0, static_cast<double>(precision));
  if (method == "floor") return Value(std::floor(d * scale) / scale);
  if (method == "ceil") return Value(std::ceil(d * scale) / scale);
  fail("round(): method must be 'common', 'ceil' or 'floor'");
}

// Python's str.splitlines (the separators chat templates meet).
std::vector<std::string> split_lines(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\n' || s[i] == '\r') {
      out.push_back(cur);
      cur.clear();
      if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') ++i;
    } else {
      cur += s[i];
    }
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

Value f_indent(const Value& v, CallArgs& a) {
  Params p("indent", a, {"width", "first", "blank"});
  std::string ind;
  if (const Value* w = p.get(0); w && w->is_string()) {
    ind = w->as_string();
  } else {
    const int64_t n = p.integer(0, 4, "indent");
    if (n < 0 || n > 1000) fail("indent(): width out of range");
    ind.assign(static_cast<size_t>(n), ' ');
  }
  const bool first = p.flag(1, false), blank = p.flag(2, false);
  const std::vector<std::string> lines = split_lines(v.str() + "\n");
  std::string rv;
  if (blank) {
    for (size_t i = 0; i < lines.size(); ++i) rv += (i ? "\n" + ind : "") + lines[i];
  } else if (!lines.empty()) {
    rv = lines[0];
    for (size_t i = 1; i < lines.size(); ++i) rv += "\n" + (lines[i].empty() ? "" : ind + lines[i]);
  }
  if (first) rv = ind + rv;
  return Value(rv);
}

void sort_values(std::vector<Value>& items, const std::function<Value(const Value&)>& key,
                 bool case_sensitive, bool reverse) {
  auto k = [&](const Value& x) {
    Value kv = key(x);
    if (!case_sensitive && kv.is_string()) kv = Value(map_case(kv.as_string(), false));
    return kv;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& x, const Value& y) {
    bool ok = true;
    const bool r = reverse ? less(k(y), k(x), &ok) : less(k(x), k(y), &ok);
    if (!ok) {
      fail(detail::cat("'<' not supported between instances of '", k(x).type_name(), "' and '",
                       k(y).type_name(), "'"));
    }
    return r;
  });
}

Value f_dictsort(const Value& v, CallArgs& a) {
  Params p("dictsort", a, {"case_sensitive", "by", "reverse"});
  if (!v.is_dict()) fail(detail::cat("dictsort needs a mapping, got ", v.type_name()));
  CallArgs none;
  std::vector<Value> items = dict_method(v.as_dict(), "items", none).as_list()->items;
  const std::string by = p.get(1) ? p.get(1)->str() : "key";
  if (by != "key" && by != "value") fail("dictsort(): by must be 'key' or 'value'");
  const size_t idx = by == "key" ? 0 : 1;
  sort_values(
      items, [&](const Value& x) { return x.as_list()->items[idx]; }, p.flag(0, false),
      p.flag(2, false));
  return Value::list(std::move(items));
}
Value f_sort(const Value& v, CallArgs& a) {
  Params p("sort", a, {"reverse", "case_sensitive", "attribute"});
  std::vector<Value> items = iterate(v);
  const std::optional<std::string> attr = p.string(2);
  sort_values(
      items, [&](const Value& x) { return attr ? attribute_path(x, *attr) : x; }, p.flag(1, false),
      p.flag(0, false));
  return Value::list(std::move(items));
}
Value f_reverse(const Value& v, CallArgs& a) {
  Params p("reverse", a, {});
  if (v.is_string()) {
    std::vector<std::string> cps = code_points(v.as_string());
    std::string out;
    for (auto it = cps.rbegin(); it != cps.rend(); ++it) out += *it;
    return Value(out);
  }
  std::vector<Value> items = iterate(v);
  std::reverse(items.begin(), items.end());
  return Value::list(std::move(items));
}
Value f_batch(const Value& v, CallArgs& a) {
  Params p("batch", a, {"linecount", "fill_with"});
  const int64_t n = p.integer(0, 0, "batch");
  if (n <= 0) fail("batch(): linecount must be positive");
  std::vector<Value> out, cur;
  for (const Value& item : iterate(v)) {
    cur.push_back(item);
    if (static_cast<int64_t>(cur.size()) == n) {
      out.push_back(Value::list(std::move(cur)));
      cur.clear();
    }
  }
  if (!cur.empty()) {
    if (const Value* fill = p.get(1)) {
      while (static_cast<int64_t>(cur.size()) < n) cur.push_back(*fill);
    }
    out.push_back(Value::list(std::move(cur)));
  }
  return Value::list(std::move(out));
}
Value f_sum(const Value& v, CallArgs& a) {
  Params p("sum", a, {"attribute", "start"});
  Value total = p.value(1, Value(int64_t{0}));
  const std::optional<std::string> attr = p.string(0);
  for (const Value& item : iterate(v))
    total = binary_op("+", total, attr ? attribute_path(item, *attr) : item);
  return total;
}
Value min_max(const Value& v, CallArgs& a, bool want_max, const char* fname) {
  Params p(fname, a, {"case_sensitive", "attribute"});
  std::vector<Value> items = iterate(v);
  if (items.empty()) return Value::undefined(detail::cat(fname, "() of an empty sequence"));
  const std::optional<std::string> attr = p.string(1);
  sort_values(
      items, [&](const Value& x) { return attr ? attribute_path(x, *attr) : x; }, p.flag(0, false),
      false);
  return want_max ? items.back() : items.front();
}
Value f_min(const Value& v, CallArgs& a) { return min_max(v, a, false, "min"); }
Value f_max(const Value& v, CallArgs& a) { return min_max(v, a, true, "max"); }
Value f_wordcount(const Value& v, CallArgs& a) {
  Params p("wordcount", a, {});
  return Value(
      static_cast<int64_t>(split(v.str(), std::nullopt, -1, false).as_list()->items.size()));
}

const std::map<std::string, FilterFn>& filters() {
  static const std::map<std::string, FilterFn> kFilters = {{"trim", f_trim},
                                                           {"tojson", f_tojson},
                                                           {"length", f_length},
                                                           {"count", f_length},
                                                           {"upper", f_upper},
                                                           {"lower", f_lower},
                                                           {"title", f_title},
                                                           {"capitalize", f_capitalize},
                                                           {"default", f_default},
                                                           {"d", f_default},
                                                           {"first", f_first},
                                                           {"last", f_last},
                                                           {"join", f_join},
                                                           {"string", f_string},
                                                           {"int", f_int},
                                                           {"float", f_float},
                                                           {"list", f_list},
                                                           {"items", f_items},
                                                           {"select", f_select},
                                                           {"reject", f_reject},
                                                           {"selectattr", f_selectattr},
                                                           {"rejectattr", f_rejectattr},
                                                           {"map", f_map},
                                                           {"replace", f_replace},
                                                           {"safe", f_safe},
                                                           {"unique", f_unique},
                                                           {"abs", f_abs},
                                                           {"round", f_round},
                                                           {"indent", f_indent},
                                                           {"dictsort", f_dictsort},
                                                           {"sort", f_sort},
                                                           {"reverse", f_reverse},
                                                           {"batch", f_batch},
                                                           {"sum", f_sum},
                                                           {"min", f_min},
                                                           {"max", f_max},
                                                           {"wordcount", f_wordcount}};
  return kFilters;
}

// --- tests

using TestFn = bool (*)(const Value&, CallArgs&);

const Value& test_arg(CallArgs& a, const char* name) {
  Params p(name, a, {"other"});
  static const Value kUndef;
  return p.get(0) ? *p.get(0) : (a.positional.empty() ? kUndef : a.positional[0]);
}

bool t_defined(const Value& v, CallArgs&) { return !v.is_undefined(); }
bool t_undefined(const Value& v, CallArgs&) { return v.is_undefined(); }
bool t_none(const Value& v, CallArgs&) { return v.is_none(); }
bool t_string(const Value& v, CallArgs&) { return v.is_string(); }
bool t_mapping(const Value& v, CallArgs&) { return v.is_dict() && !v.as_dict()->is_namespace; }
bool t_iterable(const Value& v, CallArgs&) {
  return v.is_string() || v.is_list() || (v.is_dict() && !v.as_dict()->is_namespace) ||
         v.is_undefined();
}
bool t_sequence(const Value& v, CallArgs&) {
  return v.is_string() || v.is_list() || (v.is_dict() && !v.as_dict()->is_namespace);
}
bool t_number(const Value& v, CallArgs&) { return v.is_number(); }
bool t_integer(const Value& v, CallArgs&) { return v.is_int(); }
bool t_float(const Value& v, CallArgs&) { return v.is_float(); }
bool t_boolean(const Value& v, CallArgs&) { return v.is_bool(); }
bool t_true(const Value& v, CallArgs&) { return v.is_bool() && v.as_bool(); }
bool t_false(const Value& v, CallArgs&) { return v.is_bool() && !v.as_bool(); }
bool t_callable(const Value& v, CallArgs&) { return v.is_callable(); }
int64_t int_operand(const Value& v, const char* test) {
  if (v.is_int() || v.is_bool()) return as_i(v);
  if (v.is_undefined()) fail_undefined(v);
  fail(detail::cat("the '", test, "' test needs an integer, got ", v.type_name()));
}
bool t_odd(const Value& v, CallArgs&) { return int_operand(v, "odd") % 2 != 0; }
bool t_even(const Value& v, CallArgs&) { return int_operand(v, "even") % 2 == 0; }
bool t_divisibleby(const Value& v, CallArgs& a) {
  const int64_t d = int_operand(test_arg(a, "divisibleby"), "divisibleby");
  if (d == 0) fail("divisibleby 0");
  return int_operand(v, "divisibleby") % d == 0;
}
bool t_eq(const Value& v, CallArgs& a) { return equal(v, test_arg(a, "eq")); }
bool t_ne(const Value& v, CallArgs& a) { return !equal(v, test_arg(a, "ne")); }
bool ordered(const Value& x, const Value& y, const char* op) {
  bool ok = true;
  const bool r = less(x, y, &ok);
  if (!ok) {
    fail(detail::cat("'", op, "' not supported between instances of '", x.type_name(), "' and '",
                     y.type_name(), "'"));
  }
  return r;
}
bool t_lt(const Value& v, CallArgs& a) { return ordered(v, test_arg(a, "lt"), "<"); }
bool t_gt(const Value& v, CallArgs& a) { return ordered(test_arg(a, "gt"), v, ">"); }
bool t_le(const Value& v, CallArgs& a) { return !ordered(test_arg(a, "le"), v, "<="); }
bool t_ge(const Value& v, CallArgs& a) { return !ordered(v, test_arg(a, "ge"), ">="); }
bool t_in(const Value& v, CallArgs& a) { return contains(test_arg(a, "in"), v); }
bool t_sameas(const Value& v, CallArgs& a) {
  const Value& o = test_arg(a, "sameas");
  if (v.is_list() && o.is_list()) return v.as_list() == o.as_list();
  if (v.is_dict() && o.is_dict()) return v.as_dict() == o.as_dict();
  if ((v.is_none() && o.is_none()) || (v.is_bool() && o.is_bool())) return equal(v, o);
  return false;
}
bool t_lower(const Value& v, CallArgs&) {
  return v.is_string() && map_case(v.as_string(), false) == v.as_string();
}
bool t_upper(const Value& v, CallArgs&) {
  return v.is_string() && map_case(v.as_string(), true) == v.as_string();
}

const std::map<std::string, TestFn>& tests() {
  static const std::map<std::string, TestFn> kTests = {{"defined", t_defined},
                                                       {"undefined", t_undefined},
                                                       {"none", t_none},
                                                       {"string", t_string},
                                                       {"mapping", t_mapping},
                                                       {"iterable", t_iterable},
                                                       {"sequence", t_sequence},
                                                       {"number", t_number},
                                                       {"integer", t_integer},
                                                       {"float", t_float},
                                                       {"boolean", t_boolean},
                                                       {"true", t_true},
                                                       {"false", t_false},
                                                       {"callable", t_callable},
                                                       {"odd", t_odd},
                                                       {"even", t_even},
                                                       {"divisibleby", t_divisibleby},
                                                       {"equalto", t_eq},
                                                       {"eq", t_eq},
                                                       {"==", t_eq},
                                                       {"ne", t_ne},
                                                       {"!=", t_ne},
                                                       {"lt", t_lt},
                                                       {"<", t_lt},
                                                       {"lessthan", t_lt},
                                                       {"gt", t_gt},
                                                       {">", t_gt},
                                                       {"greaterthan", t_gt},
                                                       {"le", t_le},
                                                       {"<=", t_le},
                                                       {"ge", t_ge},
                                                       {">=", t_ge},
                                                       {"in", t_in},
                                                       {"sameas", t_sameas},
                                                       {"lower", t_lower},
                                                       {"upper", t_upper}};
  return kTests;
}

// strftime with Python's behaviour for the formats chat templates use.
std::string format_time(const std::string& fmt, std::optional<std::time_t> now) {
  // Local time, as transformers' datetime.now().strftime(format).
  const std::time_t t = now ? *now : std::time(nullptr);
  std::tm tm{};
  localtime_r(&t, &tm);
  if (fmt.size() > 1024) fail("strftime_now(): format too long");
  std::string buf(fmt.size() * 16 + 64, '\0');
  const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
  buf.resize(n);
  return buf;
}

}  // namespace

std::vector<Value> iterate(const Value& v) {
  if (v.is_undefined()) return {};
  if (v.is_list()) return v.as_list()->items;
  if (v.is_dict() && !v.as_dict()->is_namespace) {
    std::vector<Value> keys;
    for (const auto& kv : v.as_dict()->items) keys.emplace_back(kv.first);
    return keys;
  }
  if (v.is_string()) {
    std::vector<Value> out;
    for (auto& cp : code_points(v.as_string())) out.emplace_back(std::move(cp));
    return out;
  }
  fail(detail::cat("'", v.type_name(), "' object is not iterable"));
}

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_dict()) {
    const Dict& d = obj.as_dict();
    if (!d->is_namespace && is_dict_method(name)) {
      return Value(make_function("dict." + name,
                                 [d, name](CallArgs& a) { return dict_method(d, name, a); }));
    }
    if (const Value* v = d->find(name)) return *v;
  } else if (obj.is_string()) {
    const auto& m = string_methods();
    if (std::find(m.begin(), m.end(), name) != m.end()) {
      const std::string s = obj.as_string();
      return Value(make_function("str." + name,
                                 [s, name](CallArgs& a) { return string_method(s, name, a); }));
    }
  }
  return Value::undefined(detail::cat(object_name(obj), " has no attribute '", name, "'"));
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined()) fail_undefined(obj);
  if (obj.is_dict() && key.is_string()) {
    if (const Value* v = obj.as_dict()->find(key.as_string())) return *v;
    return get_attr(obj, key.as_string());
  }
  if ((obj.is_list() || obj.is_string()) && (key.is_int() || key.is_bool())) {
    if (obj.is_list()) {
      const auto& items = obj.as_list()->items;
      const int64_t i = normalize_index(as_i(key), static_cast<int64_t>(items.size()));
      if (i >= 0 && i < static_cast<int64_t>(items.size())) return items[static_cast<size_t>(i)];
    } else {
      const std::vector<std::string> cps = code_points(obj.as_string());
      const int64_t i = normalize_index(as_i(key), static_cast<int64_t>(cps.size()));
      if (i >= 0 && i < static_cast<int64_t>(cps.size())) return Value(cps[static_cast<size_t>(i)]);
    }
    return Value::undefined(detail::cat(object_name(obj), " has no element ", key.repr()));
  }
  if (key.is_string()) return get_attr(obj, key.as_string());
  return Value::undefined(detail::cat(object_name(obj), " has no element ", key.repr()));
}

Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step) {
  if (obj.is_undefined()) fail_undefined(obj);
  bool is_string = false;
  const std::vector<Value> items = sequence_items(obj, &is_string);
  const int64_t n = static_cast<int64_t>(items.size());
  auto opt = [](const Value& v, const char* what) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    return to_int(v, what);
  };
  const int64_t st = opt(step, "slice step").value_or(1);
  if (st == 0) fail("slice step cannot be zero");
  // Python's PySlice_AdjustIndices.
  auto adjust = [&](std::optional<int64_t> x, int64_t dflt) {
    if (!x) return dflt;
    int64_t i = *x;
    if (i < 0) {
      i += n;
      if (i < 0) i = st < 0 ? -1 : 0;
    } else if (i >= n) {
      i = st < 0 ? n - 1 : n;
    }
    return i;
  };
  const int64_t b = adjust(opt(start, "slice start"), st < 0 ? n - 1 : 0);
  const int64_t e = adjust(opt(stop, "slice stop"), st < 0 ? -1 : n);
  std::vector<Value> out;
  for (int64_t i = b; st > 0 ? i < e : i > e; i += st) out.push_back(items[static_cast<size_t>(i)]);
  if (is_string) {
    std::string s;
    for (const Value& cp : out) s += cp.as_string();
    return Value(s);
  }
  return Value::list(std::move(out), obj.as_list()->tuple);
}

Value call(const Value& fn, CallArgs& args) {
  if (fn.is_undefined()) fail_undefined(fn);
  if (!fn.is_callable()) fail(detail::cat("'", fn.type_name(), "' object is not callable"));
  return fn.as_callable()->call(args);
}

bool has_filter(const std::string& name) { return filters().count(name) > 0; }
bool has_test(const std::string& name) { return tests().count(name) > 0; }

Value apply_filter(const std::string& name, const Value& target, CallArgs& args) {
  auto it = filters().find(name);
  if (it == filters().end()) fail(detail::cat("no filter named '", name, "'"));
  return it->second(target, args);
}

bool apply_test(const std::string& name, const Value& target, CallArgs& args) {
  auto it = tests().find(name);
  if (it == tests().end()) fail(detail::cat("no test named '", name, "'"));
  return it->second(target, args);
}

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value(a.str() + b.str());
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  const bool nums = a.is_number() && b.is_number();
  const bool ints = nums && !a.is_float() && !b.is_float();
  auto unsupported = [&]() -> Value {
    fail(detail::cat("unsupported operand type(s) for ", op, ": '", a.type_name(), "' and '",
                     b.type_name(), "'"));
  };
  if (op == "+") {
    if (ints) {
      int64_t r;
      if (__builtin_add_overflow(as_i(a), as_i(b), &r)) fail("integer overflow in '+'");
      return Value(r);
    }
    if (nums) return Value(a.as_number() + b.as_number());
    if (a.is_string() && b.is_string()) {
      if (a.as_string().size() + b.as_string().size() > kMaxStringBytes)
        fail("string exceeds the size limit");
      return Value(a.as_string() + b.as_string());
    }
    if (a.is_list() && b.is_list()) {
      std::vector<Value> items = a.as_list()->items;
      items.insert(items.end(), b.as_list()->items.begin(), b.as_list()->items.end());
      return Value::list(std::move(items), a.as_list()->tuple);
    }
    if (a.is_string())
      fail(detail::cat("can only concatenate str (not \"", b.type_name(), "\") to str"));
    if (a.is_list())
      fail(detail::cat("can only concatenate list (not \"", b.type_name(), "\") to list"));
    return unsupported();
  }
  if (op == "-") {
    if (ints) {
      int64_t r;
      if (__builtin_sub_overflow(as_i(a), as_i(b), &r)) fail("integer overflow in '-'");
      return Value(r);
    }
    if (nums) return Value(a.as_number() - b.as_number());
    return unsupported();
  }
  if (op == "*") {
    if (ints) {
      int64_t r;
      if (__builtin_mul_overflow(as_i(a), as_i(b), &r)) fail("integer overflow in '*'");
      return Value(r);
    }
    if (nums) return Value(a.as_number() * b.as_number());
    if ((a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) return repeat(a, as_i(b));
    if ((b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) return repeat(b, as_i(a));
    return unsupported();
  }
  if (op == "/") {
    if (!nums) return unsupported();
    if (b.as_number() == 0) fail("division by zero");
    return Value(a.as_number() / b.as_number());
  }
  if (op == "//" || op == "%") {
    if (!nums) {
      if (op == "%" && a.is_string()) fail("printf-style string formatting ('%') is not supported");
      return unsupported();
    }
    if (b.as_number() == 0)
      fail(op == "//" ? "integer division or modulo by zero" : "modulo by zero");
    if (ints) {
      const int64_t x = as_i(a), y = as_i(b);
      if (x == INT64_MIN && y == -1) fail("integer overflow");
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) {
        --q;
        r += y;
      }
      return Value(op == "//" ? q : r);
    }
    const double x = a.as_number(), y = b.as_number();
    double r = std::fmod(x, y);
    if (r != 0 && ((r < 0) != (y < 0))) r += y;
    if (op == "%") return Value(r);
    return Value(std::floor((x - r) / y + 0.5));  // (x - r) / y is integral up to rounding
  }
  if (op == "**") {
    if (!nums) return unsupported();
    if (ints && as_i(b) >= 0) {
      int64_t r = 1, base = as_i(a);
      for (int64_t e = as_i(b); e > 0; --e) {
        if (__builtin_mul_overflow(r, base, &r)) fail("integer overflow in '**'");
        if (r == 0 || r == 1) break;
      }
      return Value(r);
    }
    return Value(std::pow(a.as_number(), b.as_number()));
  }
  fail(detail::cat("unknown operator '", op, "'"));
}

bool contains(const Value& container, const Value& item) {
  if (container.is_undefined()) return false;
  if (container.is_string()) {
    if (!item.is_string()) {
      fail(detail::cat("'in <string>' requires string as left operand, not ", item.type_name()));
    }
    return container.as_string().find(item.as_string()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const Value& x : container.as_list()->items) {
      if (equal(x, item)) return true;
    }
    return false;
  }
  if (container.is_dict()) {
    return item.is_string() && container.as_dict()->find(item.as_string()) != nullptr;
  }
  fail(detail::cat("argument of type '", container.type_name(), "' is not iterable"));
}

Dict make_globals(std::optional<std::time_t> now) {
  auto g = std::make_shared<DictObject>();
  g->set("range", Value(make_function("range", [](CallArgs& a) {
           if (!a.keyword.empty()) fail("range() takes no keyword arguments");
           std::vector<int64_t> n;
           for (const Value& v : a.positional) n.push_back(to_int(v, "range() argument"));
           if (n.empty() || n.size() > 3) fail("range() takes 1 to 3 arguments");
           const int64_t start = n.size() == 1 ? 0 : n[0];
           const int64_t stop = n.size() == 1 ? n[0] : n[1];
           const int64_t step = n.size() == 3 ? n[2] : 1;
           if (step == 0) fail("range() arg 3 must not be zero");
           const double count = std::ceil((static_cast<double>(stop) - static_cast<double>(start)) /
                                          static_cast<double>(step));
           if (count > static_cast<double>(kMaxRange)) {
             fail(detail::cat("Range too big. The sandbox blocks ranges larger than MAX_RANGE (",
                              kMaxRange, ")."));
           }
           std::vector<Value> out;
           for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) out.emplace_back(i);
           return Value::list(std::move(out));
         })));
  auto kw_dict = [](CallArgs& a, bool ns) {
    Value d = Value::dict();
    d.as_dict()->is_namespace = ns;
    for (const Value& p : a.positional) {
      if (!p.is_dict()) fail(ns ? "namespace() takes a mapping" : "dict() takes a mapping");
      for (const auto& [k, v] : p.as_dict()->items) d.as_dict()->set(k, v);
    }
    for (const auto& [k, v] : a.keyword) {
      if (ns && !k.empty() && k[0] == '_') {
        fail(
            detail::cat("Chat templates cannot store underscore-prefixed attributes on a "
                        "namespace, but got '",
                        k, "'"));
      }
      d.as_dict()->set(k, v);
    }
    return d;
  };
  g->set("namespace",
         Value(make_function("namespace", [kw_dict](CallArgs& a) { return kw_dict(a, true); })));
  g->set("dict",
         Value(make_function("dict", [kw_dict](CallArgs& a) { return kw_dict(a, false); })));
  g->set("raise_exception", Value(make_function("raise_exception", [](CallArgs& a) -> Value {
           throw RaisedError(a.positional.empty() ? std::string() : a.positional[0].str());
         })));
  g->set("strftime_now", Value(make_function("strftime_now", [now](CallArgs& a) {
           Params p("strftime_now", a, {"format"});
           if (!p.get(0)) fail("strftime_now() takes a format");
           return Value(format_time(p.get(0)->str(), now));
         })));
  return g;
}

}  // namespace ft::jinja
