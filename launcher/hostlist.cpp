#include "hostlist.h"

#include "core/error.h"

namespace ft::launcher {
namespace {

constexpr size_t kMaxHosts = 100000;  // the most --nnodes allows

// Splits on commas that are not inside brackets.
std::vector<std::string> split_top_level(const std::string& s, const std::string& whole) {
  std::vector<std::string> out;
  std::string cur;
  int depth = 0;
  for (char c : s) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    FT_CHECK(depth >= 0 && depth <= 1, "malformed SLURM host list '", whole,
             "': unbalanced or nested brackets");
    if (c == ',' && depth == 0) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  FT_CHECK(depth == 0, "malformed SLURM host list '", whole, "': missing ']'");
  out.push_back(cur);
  return out;
}

bool all_digits(const std::string& s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// "01-04,07" -> {"01","02","03","04","07"}, keeping the zero padding of the lower bound.
std::vector<std::string> expand_range_set(const std::string& body, const std::string& whole) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    std::string item =
        body.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    size_t dash = item.find('-');
    if (dash == std::string::npos) {
      FT_CHECK(all_digits(item), "malformed SLURM host list '", whole, "': '", item,
               "' is not a number");
      FT_CHECK(out.size() < kMaxHosts, "SLURM host list '", whole, "' names more than ", kMaxHosts,
               " hosts");
      out.push_back(item);
    } else {
      std::string lo = item.substr(0, dash), hi = item.substr(dash + 1);
      // 18 digits: std::stol cannot overflow.
      FT_CHECK(all_digits(lo) && all_digits(hi) && lo.size() <= 18 && hi.size() <= 18,
               "malformed SLURM host list '", whole, "': range '", item, "'");
      long a = std::stol(lo), b = std::stol(hi);
      FT_CHECK(a <= b && b - a < 100000, "malformed SLURM host list '", whole, "': range '", item,
               "' is empty or too large");
      // Each value names at least one host: a set of many large ranges ("[0-99999,0-99999,...]")
      // is refused before it is built (it took seconds and gigabytes).
      FT_CHECK(out.size() + static_cast<size_t>(b - a) < kMaxHosts, "SLURM host list '", whole,
               "' names more than ", kMaxHosts, " hosts");
      for (long v = a; v <= b; ++v) {
        std::string num = std::to_string(v);
        if (num.size() < lo.size()) num.insert(0, lo.size() - num.size(), '0');
        out.push_back(num);
      }
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

void expand_name(const std::string& name, const std::string& whole, std::vector<std::string>& out) {
  size_t open = name.find('[');
  if (open == std::string::npos) {
    // Bracket groups multiply: "a[0-99999]b[0-99999]" would be 10^10 names.
    FT_CHECK(out.size() < kMaxHosts, "SLURM host list '", whole, "' names more than ", kMaxHosts,
             " hosts");
    out.push_back(name);
    return;
  }
  size_t close = name.find(']', open);
  FT_CHECK(close != std::string::npos, "malformed SLURM host list '", whole, "': missing ']'");
  std::string prefix = name.substr(0, open);
  std::string rest = name.substr(close + 1);
  for (const auto& v : expand_range_set(name.substr(open + 1, close - open - 1), whole)) {
    expand_name(prefix + v + rest, whole, out);
  }
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list) {
  std::vector<std::string> out;
  for (const auto& part : split_top_level(list, list)) {
    if (part.empty()) continue;
    expand_name(part, list, out);
  }
  FT_CHECK(!out.empty(), "SLURM host list '", list, "' names no host");
  return out;
}

}  // namespace ft::launcher
