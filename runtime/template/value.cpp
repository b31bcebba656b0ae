#include "template/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <stdexcept>

namespace ft::jinja {

const Value* DictObject::find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void DictObject::set(const std::string& key, Value v) {
  for (auto& [k, old] : items) {
    if (k == key) {
      old = std::move(v);
      return;
    }
  }
  items.emplace_back(key, std::move(v));
}

Value Value::list(std::vector<Value> items, bool tuple) {
  auto l = std::make_shared<ListObject>();
  l->items = std::move(items);
  l->tuple = tuple;
  return Value(std::move(l));
}

Value Value::dict() { return Value(std::make_shared<DictObject>()); }

double Value::as_number() const {
  if (is_int()) return static_cast<double>(as_int());
  if (is_bool()) return as_bool() ? 1.0 : 0.0;
  return as_float();
}

const char* Value::type_name() const {
  switch (v_.index()) {
    case 0:
      return "Undefined";
    case 1:
      return "NoneType";
    case 2:
      return "bool";
    case 3:
      return "int";
    case 4:
      return "float";
    case 5:
      return "str";
    case 6:
      return as_list()->tuple ? "tuple" : "list";
    case 7:
      return as_dict()->is_namespace ? "Namespace" : "dict";
    default:
      return "function";
  }
}

bool Value::truthy() const {
  switch (v_.index()) {
    case 0:
    case 1:
      return false;
    case 2:
      return as_bool();
    case 3:
      return as_int() != 0;
    case 4:
      return as_float() != 0.0;
    case 5:
      return !as_string().empty();
    case 6:
      return !as_list()->items.empty();
    case 7:
      return as_dict()->is_namespace || !as_dict()->items.empty();
    default:
      return true;
  }
}

std::string float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  if (d == 0) return std::signbit(d) ? "-0.0" : "0.0";
  // The shortest digits that read back as d, placed as Python's repr places them: positional
  // for exponents in [-4, 16), scientific otherwise.
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  bool neg = sci[0] == '-';
  if (neg) sci.erase(0, 1);
  const size_t e = sci.find('e');
  std::string digits = sci.substr(0, e);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out;
  if (exp >= -4 && exp < 16) {
    if (exp < 0) {
      out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    } else if (static_cast<size_t>(exp) + 1 >= digits.size()) {
      out = digits + std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, static_cast<size_t>(exp) + 1) + "." +
            digits.substr(static_cast<size_t>(exp) + 1);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  }
  return neg ? "-" + out : out;
}

namespace {

// Python's repr of a str: single quotes unless the text has one and no double quote.
std::string string_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == static_cast<unsigned char>(q) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += q;
  return out;
}

}  // namespace

std::string Value::str() const {
  switch (v_.index()) {
    case 0:
      return "";
    case 5:
      return as_string();
    default:
      return repr();
  }
}

std::string Value::repr() const {
  switch (v_.index()) {
    case 0:
      return "";
    case 1:
      return "None";
    case 2:
      return as_bool() ? "True" : "False";
    case 3:
      return std::to_string(as_int());
    case 4:
      return float_repr(as_float());
    case 5:
      return string_repr(as_string());
    case 6: {
      const ListObject& l = *as_list();
      std::string out = l.tuple ? "(" : "[";
      for (size_t i = 0; i < l.items.size(); ++i) {
        if (i) out += ", ";
        out += l.items[i].repr();
      }
      if (l.tuple && l.items.size() == 1) out += ",";
      return out + (l.tuple ? ")" : "]");
    }
    case 7: {
      const DictObject& d = *as_dict();
      std::string out = d.is_namespace ? "<Namespace {" : "{";
      for (size_t i = 0; i < d.items.size(); ++i) {
        if (i) out += ", ";
        out += string_repr(d.items[i].first) + ": " + d.items[i].second.repr();
      }
      return out + (d.is_namespace ? "}>" : "}");
    }
    default:
      return "<function " + as_callable()->name + ">";
  }
}

bool equal(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_number() == b.as_number();
    auto as_i = [](const Value& v) { return v.is_int() ? v.as_int() : (v.as_bool() ? 1 : 0); };
    return as_i(a) == as_i(b);
  }
  if (a.is_undefined() || b.is_undefined()) return a.is_undefined() && b.is_undefined();
  if (a.is_none() || b.is_none()) return a.is_none() && b.is_none();
  if (a.is_string() && b.is_string()) return a.as_string() == b.as_string();
  if (a.is_list() && b.is_list()) {
    const auto& x = a.as_list()->items;
    const auto& y = b.as_list()->items;
    if (a.as_list()->tuple != b.as_list()->tuple || x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i) {
      if (!equal(x[i], y[i])) return false;
    }
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    if (a.as_dict() == b.as_dict()) return true;
    const auto& x = *a.as_dict();
    const auto& y = *b.as_dict();
    if (x.is_namespace || y.is_namespace || x.items.size() != y.items.size()) return false;
    for (const auto& [k, v] : x.items) {
      const Value* o = y.find(k);
      if (!o || !equal(v, *o)) return false;
    }
    return true;
  }
  if (a.is_callable() && b.is_callable()) return a.as_callable() == b.as_callable();
  return false;
}

bool less(const Value& a, const Value& b, bool* comparable) {
  *comparable = true;
  if (a.is_number() && b.is_number()) return a.as_number() < b.as_number();
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();  // UTF-8 order
  if (a.is_list() && b.is_list()) {
    const auto& x = a.as_list()->items;
    const auto& y = b.as_list()->items;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equal(x[i], y[i])) continue;
      return less(x[i], y[i], comparable);
    }
    return x.size() < y.size();
  }
  *comparable = false;
  return false;
}

namespace {

template <class J>
Value json_to_value(const J& j) {
  switch (j.type()) {
    case J::value_t::null:
      return Value(None{});
    case J::value_t::boolean:
      return Value(j.template get<bool>());
    case J::value_t::number_integer:
      return Value(j.template get<int64_t>());
    case J::value_t::number_unsigned: {
      const uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value(static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case J::value_t::number_float:
      return Value(j.template get<double>());
    case J::value_t::string:
      return Value(j.template get<std::string>());
    case J::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(json_to_value(e));
      return Value::list(std::move(items));
    }
    case J::value_t::object: {
      Value d = Value::dict();
      for (const auto& [k, v] : j.items()) d.as_dict()->items.emplace_back(k, json_to_value(v));
      return d;
    }
    default:
      return Value(None{});
  }
}

}  // namespace

Value from_json(const nlohmann::ordered_json& j) { return json_to_value(j); }
Value from_json(const nlohmann::json& j) { return json_to_value(j); }

namespace {

void json_string(const std::string& s, bool ensure_ascii, std::string& out) {
  out += '"';
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    char b[16];
    if (c < 0x20 || (ensure_ascii && c == 0x7f)) {
      std::snprintf(b, sizeof(b), "\\u%04x", c);
      out += b;
    } else if (c >= 0x80 && ensure_ascii) {
      // Decode one code point; Python writes \uXXXX (surrogate pairs above the BMP).
      int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
      if (i + static_cast<size_t>(len) > s.size()) len = 1;
      uint32_t cp = len == 1 ? c : (c & (0xFF >> (len + 1)));
      for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
      if (cp >= 0x10000) {
        cp -= 0x10000;
        std::snprintf(b, sizeof(b), "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
      } else {
        std::snprintf(b, sizeof(b), "\\u%04x", cp);
      }
      out += b;
      i += static_cast<size_t>(len) - 1;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += '"';
}

void json_value(const Value& v, const JsonStyle& st, int level, std::string& out) {
  const std::string item_sep =
      st.custom_item_separator ? st.item_separator : (st.indent >= 0 ? "," : ", ");
  auto newline = [&](int lvl) {
    out += '\n';
    out.append(static_cast<size_t>(st.indent) * static_cast<size_t>(lvl), ' ');
  };
  if (v.is_none()) {
    out += "null";
  } else if (v.is_bool()) {
    out += v.as_bool() ? "true" : "false";
  } else if (v.is_int()) {
    out += std::to_string(v.as_int());
  } else if (v.is_float()) {
    const double d = v.as_float();
    out += std::isnan(d)   ? "NaN"
           : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity")
                           : float_repr(d);
  } else if (v.is_string()) {
    json_string(v.as_string(), st.ensure_ascii, out);
  } else if (v.is_list()) {
    const auto& items = v.as_list()->items;
    if (items.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += item_sep;
      if (st.indent >= 0) newline(level + 1);
      json_value(items[i], st, level + 1, out);
    }
    if (st.indent >= 0) newline(level);
    out += ']';
  } else if (v.is_dict() && !v.as_dict()->is_namespace) {
    std::vector<const std::pair<std::string, Value>*> items;
    for (const auto& kv : v.as_dict()->items) items.push_back(&kv);
    if (st.sort_keys) {
      std::stable_sort(items.begin(), items.end(),
                       [](const auto* a, const auto* b) { return a->first < b->first; });
    }
    if (items.empty()) {
      out += "{}";
      return;
    }
    out += '{';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += item_sep;
      if (st.indent >= 0) newline(level + 1);
      json_string(items[i]->first, st.ensure_ascii, out);
      out += st.key_separator;
      json_value(items[i]->second, st, level + 1, out);
    }
    if (st.indent >= 0) newline(level);
    out += '}';
  } else {
    throw std::invalid_argument(std::string("Object of type ") + v.type_name() +
                                " is not JSON serializable");
  }
}

}  // namespace

std::string to_json(const Value& v, const JsonStyle& style) {
  std::string out;
  json_value(v, style, 0, out);
  return out;
}

std::vector<std::string> code_points(std::string_view s) {
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    size_t len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    if (i + len > s.size()) len = 1;
    for (size_t k = 1; k < len; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) {
        len = 1;
        break;
      }
    }
    out.emplace_back(s.substr(i, len));
    i += len;
  }
  return out;
}

size_t code_point_count(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool is_python_space(std::string_view cp) {
  if (cp.size() == 1) {
    const unsigned char c = static_cast<unsigned char>(cp[0]);
    return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20);
  }
  static const char* const kSpaces[] = {"\u0085", "\u00a0", "\u1680", "\u2000", "\u2001",
                                        "\u2002", "\u2003", "\u2004", "\u2005", "\u2006",
                                        "\u2007", "\u2008", "\u2009", "\u200a", "\u2028",
                                        "\u2029", "\u202f", "\u205f", "\u3000"};
  for (const char* s : kSpaces) {
    if (cp == s) return true;
  }
  return false;
}

}  // namespace ft::jinja
