#include "core/hostlist.h"

#include <algorithm>

#include "core/error.h"
#include "core/json.h"

namespace ft {
namespace {

constexpr size_t kMaxHosts = 100000;  // the most --nnodes allows
// The most bytes of host names a list may expand to: 100,000 names of 80 characters. (One name
// is never longer than the text it comes from, so hosts x the part's length bounds it before
// anything is built; 100,000 names of 380 characters took seconds and gigabytes under the fuzzer.)
constexpr size_t kMaxNameBytes = size_t{8} << 20;

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

// One item of a bracket's range set: "07" (single: `lo` as written) or "01-04" (a to b, with the
// zero padding of `lo`).
struct RangeItem {
  std::string lo;
  long a = 0, b = 0;
  bool single = false;
  size_t size() const { return single ? 1 : static_cast<size_t>(b - a) + 1; }
};

std::vector<RangeItem> parse_range_set(const std::string& body, const std::string& whole) {
  std::vector<RangeItem> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    std::string item =
        body.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    size_t dash = item.find('-');
    if (dash == std::string::npos) {
      FT_CHECK(all_digits(item), "malformed SLURM host list '", whole, "': '", item,
               "' is not a number");
      out.push_back({item, 0, 0, true});
    } else {
      std::string lo = item.substr(0, dash), hi = item.substr(dash + 1);
      // 18 digits: std::stol cannot overflow.
      FT_CHECK(all_digits(lo) && all_digits(hi) && lo.size() <= 18 && hi.size() <= 18,
               "malformed SLURM host list '", whole, "': range '", item, "'");
      long a = std::stol(lo), b = std::stol(hi);
      FT_CHECK(a <= b && b - a < 100000, "malformed SLURM host list '", whole, "': range '", item,
               "' is empty or too large");
      out.push_back({lo, a, b, false});
    }
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// Hosts a name with bracket groups expands to (they multiply), capped at kMaxHosts + 1.
size_t count_name(const std::string& name, const std::string& whole) {
  size_t count = 1, open = name.find('[');
  while (open != std::string::npos) {
    const size_t close = name.find(']', open);
    FT_CHECK(close != std::string::npos, "malformed SLURM host list '", whole, "': missing ']'");
    size_t values = 0;
    for (const RangeItem& r : parse_range_set(name.substr(open + 1, close - open - 1), whole))
      values = std::min(values + r.size(), kMaxHosts + 1);
    count = std::min(count * values, kMaxHosts + 1);  // both <= kMaxHosts + 1: no overflow
    open = name.find('[', close);
  }
  return count;
}

void expand_name(const std::string& name, const std::string& whole, std::vector<std::string>& out) {
  size_t open = name.find('[');
  if (open == std::string::npos) {
    out.push_back(name);
    return;
  }
  size_t close = name.find(']', open);
  FT_CHECK(close != std::string::npos, "malformed SLURM host list '", whole, "': missing ']'");
  std::string prefix = name.substr(0, open);
  std::string rest = name.substr(close + 1);
  for (const RangeItem& r : parse_range_set(name.substr(open + 1, close - open - 1), whole)) {
    if (r.single) {
      expand_name(prefix + r.lo + rest, whole, out);
      continue;
    }
    for (long v = r.a; v <= r.b; ++v) {
      std::string num = std::to_string(v);
      if (num.size() < r.lo.size()) num.insert(0, r.lo.size() - num.size(), '0');
      expand_name(prefix + num + rest, whole, out);
    }
  }
}

}  // namespace

std::vector<std::string> expand_hostlist(const std::string& list) {
  std::vector<std::string> out;
  // Counted before anything is built: bracket groups multiply ("a[0-99999]b[0-99999]" is 10^10
  // names, and 10 groups of [0-9] took seconds and gigabytes).
  size_t count = 0, bytes = 0;
  const std::vector<std::string> parts = split_top_level(list, list);
  for (const auto& part : parts) {
    if (part.empty()) continue;
    const size_t n = count_name(part, list);
    count = std::min(count + n, kMaxHosts + 1);
    bytes = std::min(bytes + n * part.size(), kMaxNameBytes + 1);  // n <= kMaxHosts + 1
  }
  FT_CHECK(count <= kMaxHosts, "SLURM host list '", excerpt(list), "' names more than ", kMaxHosts,
           " hosts");
  FT_CHECK(bytes <= kMaxNameBytes, "SLURM host list '", excerpt(list),
           "' may expand to more than 8 MiB of host names (", count,
           " hosts of names this long); shorten the names or the list");
  for (const auto& part : parts) {
    if (part.empty()) continue;
    expand_name(part, list, out);
  }
  FT_CHECK(!out.empty(), "SLURM host list '", list, "' names no host");
  return out;
}

}  // namespace ft
