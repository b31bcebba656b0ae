#include "data/mixture.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <optional>

#include "core/error.h"

namespace ft::data {
namespace {

namespace fs = std::filesystem;

// Salts the mixture's draws apart from the sources' shuffles, which use the same seed.
constexpr uint64_t kDrawSalt = 0x6d6978747572ull;  // "mixture"

// A source's salt for its held-out records: from its name, so that listing the sources in
// another order keeps each one's held-out set.
uint64_t name_salt(const std::string& name) {
  uint64_t h = 0;
  for (const unsigned char c : name) h = splitmix64(h ^ c);
  return h;
}

// `text` as a whole number, or nullopt when it is not one (strtod must take every character).
std::optional<double> number_of(const std::string& text) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size()) return std::nullopt;
  return v;
}

// `x` rounded up, except that a product within rounding of a whole number is that number (0.02 x
// 50 records is 1 record, not 2).
int64_t ceil_whole(double x) {
  const double nearest = std::round(x);
  return static_cast<int64_t>(std::abs(x - nearest) <= 1e-9 * std::max(1.0, x) ? nearest
                                                                               : std::ceil(x));
}

// eval.split as a count of held-out records per source (hold_out_split's rule).
std::vector<int64_t> held_out_counts(double split, const std::vector<int64_t>& used) {
  std::vector<int64_t> counts(used.size(), 0);
  if (split < 1) {
    for (size_t k = 0; k < used.size(); ++k)
      counts[k] = ceil_whole(split * static_cast<double>(used[k]));
    return counts;
  }
  FT_CHECK(split == std::floor(split), "eval.split=", split,
           " is neither a fraction below 1 nor a whole count of records: give e.g. 0.02 (2% of "
           "each source) or 500 (records)");
  const int64_t total = std::accumulate(used.begin(), used.end(), int64_t{0});
  const auto c = static_cast<int64_t>(split);
  FT_CHECK(c < total, "eval.split=", c, " holds out at least every one of the ", total,
           " records of the training data: nothing is left to train on; hold out fewer");
  // In proportion to the sources' sizes, the records left over to the largest remainders.
  std::vector<std::pair<double, size_t>> remainders;
  int64_t given = 0;
  for (size_t k = 0; k < used.size(); ++k) {
    const long double exact = static_cast<long double>(c) * used[k] / total;
    counts[k] = static_cast<int64_t>(std::floor(exact));
    given += counts[k];
    remainders.emplace_back(static_cast<double>(exact - counts[k]), k);
  }
  std::stable_sort(remainders.begin(), remainders.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  for (int64_t i = 0; i < c - given; ++i) ++counts[remainders[static_cast<size_t>(i)].second];
  return counts;
}

}  // namespace

SourceSpec parse_data_arg(const std::string& arg) {
  SourceSpec s;
  s.origin = "--data '" + arg + "'";
  s.settings.path = arg;
  const size_t colon = arg.rfind(':');
  // A file (or folder) of that name is a path, whatever it ends with.
  if (colon == std::string::npos || colon == 0 || fs::exists(arg)) return s;
  const std::string tail = arg.substr(colon + 1);
  const std::optional<double> weight = number_of(tail);
  if (!weight) {
    // Not a number: part of the path, unless the text before the ':' is the file.
    FT_CHECK(!fs::exists(arg.substr(0, colon)), s.origin, ": '", tail,
             "' is not a weight: give PATH:WEIGHT with a number > 0 (--data a.jsonl:0.7)");
    return s;
  }
  FT_CHECK(std::isfinite(*weight) && *weight > 0, s.origin, ": the weight ", tail,
           " must be a number > 0 (the source's share is its weight over the sum of the weights)");
  s.settings.path = arg.substr(0, colon);
  s.settings.weight = *weight;
  return s;
}

std::vector<SourceSpec> training_sources(const config::DataSettings& data,
                                         const std::vector<std::string>& data_args) {
  FT_CHECK(data_args.empty() || data.sources.empty(), "the data is given twice: --data ",
           data_args.front(), " and the preset's data.sources (", data.sources.size(),
           " entries); give one: --data PATH[:WEIGHT] per source, or data.sources");
  std::vector<SourceSpec> specs;
  for (const std::string& arg : data_args) specs.push_back(parse_data_arg(arg));
  for (size_t i = 0; i < data.sources.size(); ++i)
    specs.push_back({data.sources[i], "data.sources[" + std::to_string(i) + "]", {}});
  for (SourceSpec& spec : specs) spec.shape = data.shape;
  for (size_t i = 0; i < specs.size(); ++i) {
    config::DataSourceSettings& s = specs[i].settings;
    if (s.name.empty()) s.name = fs::path(s.path).filename().string();
    for (size_t j = 0; j < i; ++j)
      FT_CHECK(specs[j].settings.name != s.name, specs[j].origin, " and ", specs[i].origin,
               " are both named '", s.name,
               "' (metrics.jsonl and the report count tokens by name): give each data.sources "
               "entry a distinct \"name\"");
  }
  return specs;
}

std::vector<std::unique_ptr<JsonlSource>> open_sources(const std::vector<SourceSpec>& specs,
                                                       const JsonlOptions& base) {
  std::vector<std::unique_ptr<JsonlSource>> out;
  for (const SourceSpec& spec : specs) {
    const config::DataSourceSettings& s = spec.settings;
    // A file or a folder (save_to_disk, shards): open_record_file says which it reads.
    FT_CHECK(fs::exists(s.path), spec.origin, ": ", s.path, " does not exist",
             " (paths are relative to the working directory, ", fs::current_path().string(), ")");
    JsonlOptions o = base;
    o.path = s.path;
    if (!s.format.empty()) o.format = parse_record_format(s.format);
    if (!s.chat_template.empty()) o.chat_template = parse_chat_template(s.chat_template);
    o.max_records = s.max_records;
    o.shape = record_shape(s.shape.over(spec.shape));
    out.push_back(std::make_unique<JsonlSource>(o));
  }
  return out;
}

void hold_out_split(const std::vector<SourceSpec>& specs,
                    const std::vector<std::unique_ptr<JsonlSource>>& sources, double split) {
  FT_ASSERT(specs.size() == sources.size(), specs.size(), " specs, ", sources.size(), " sources");
  if (split <= 0) return;
  std::vector<int64_t> used;
  for (const auto& s : sources) used.push_back(s->used_records());
  const std::vector<int64_t> counts = held_out_counts(split, used);
  for (size_t k = 0; k < sources.size(); ++k) {
    FT_CHECK(counts[k] < used[k], specs[k].origin, " (", specs[k].settings.path,
             "): eval.split=", split, " holds out ", counts[k], " of its ", used[k],
             " records, which leaves none to train on: hold out fewer");
    sources[k]->hold_out(counts[k], name_salt(specs[k].settings.name));
  }
}

MixtureSource::MixtureSource(std::vector<std::unique_ptr<JsonlSource>> sources, Options options)
    : sources_(std::move(sources)), options_(std::move(options)) {
  const size_t K = sources_.size();
  FT_ASSERT(K > 0 && options_.names.size() == K && options_.weights.size() == K, K, " sources, ",
            options_.names.size(), " names, ", options_.weights.size(), " weights");
  FT_CHECK(options_.world_size >= 1 && options_.rank >= 0 && options_.rank < options_.world_size,
           "data: rank ", options_.rank, " is not in [0, world_size ", options_.world_size, ")");
  double sum = 0;
  for (size_t k = 0; k < K; ++k) {
    FT_CHECK(std::isfinite(options_.weights[k]) && options_.weights[k] > 0, "the weight of ",
             options_.names[k], " must be a number > 0, got ", options_.weights[k]);
    sum += options_.weights[k];
  }
  for (size_t k = 0; k < K; ++k) {
    cumulative_.push_back((k ? cumulative_.back() : 0.0) + options_.weights[k] / sum);
    epoch_records_ += sources_[k]->train_records();
  }
  cumulative_.back() = 1;  // whatever the rounding of the sum
  records_placed_.assign(K, 0);
  tokens_placed_.assign(K, 0);
  std::vector<int64_t> start(K + 1, 0);
  seek(start);
}

double MixtureSource::share(size_t k) const {
  return cumulative_[k] - (k ? cumulative_[k - 1] : 0.0);
}

size_t MixtureSource::source_of(int64_t g) const {
  const uint64_t h = splitmix64(options_.seed ^ splitmix64(static_cast<uint64_t>(g) ^ kDrawSalt));
  const double u = static_cast<double>(h >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  const auto it = std::upper_bound(cumulative_.begin(), cumulative_.end(), u);
  return std::min(static_cast<size_t>(it - cumulative_.begin()), sources_.size() - 1);
}

void MixtureSource::advance_to(int64_t end) {
  for (; next_global_ < end; ++next_global_) ++counts_[source_of(next_global_)];
}

int64_t MixtureSource::samples_consumed() const { return cursor() - options_.rank; }

std::vector<int64_t> MixtureSource::position() const {
  const int64_t c = cursor(), g0 = c - options_.rank;
  std::vector<int64_t> counts = has_pending_ ? pending_counts_ : counts_;
  for (int64_t g = g0; g < c; ++g) --counts[source_of(g)];  // the other ranks' draws before ours
  std::vector<int64_t> out = {g0};
  out.insert(out.end(), counts.begin(), counts.end());
  return out;
}

void MixtureSource::seek(const std::vector<int64_t>& position) {
  const size_t K = sources_.size();
  FT_CHECK(position.size() == K + 1, "data: the checkpoint's data position holds ", position.size(),
           " numbers, a mixture of ", K, " sources takes ", K + 1,
           ": resume with the data the run was started with");
  const int64_t g0 = position[0];
  int64_t drawn = 0;
  for (size_t k = 1; k <= K; ++k) {
    FT_CHECK(position[k] >= 0, "data: a mixture position counts draws >= 0, got ", position[k]);
    drawn += position[k];
  }
  FT_CHECK(g0 >= 0 && drawn == g0, "data: the checkpoint's mixture position is inconsistent (",
           drawn, " draws by source, ", g0, " in all)");
  next_global_ = g0;
  counts_.assign(position.begin() + 1, position.end());
  const int64_t W = options_.world_size;
  advance_to(g0 + (((options_.rank - g0) % W) + W) % W);
  has_pending_ = false;
}

TokenizedRecord MixtureSource::next_record() {
  int64_t skipped = 0;
  // A whole epoch of unusable records would loop forever: stop after one full pass of them.
  for (int64_t failures = 0;; ++failures) {
    FT_CHECK_T(FormatError, failures <= epoch_records_,
               "data: no usable record in a whole epoch of the mixture (", skipped,
               " records skipped)");
    const int64_t g = next_global_;
    const size_t k = source_of(g);
    std::vector<int64_t> before = counts_;
    const int64_t n = counts_[k];
    advance_to(g + options_.world_size);
    JsonlSource& s = *sources_[k];
    const int64_t N = s.train_records();
    std::optional<TokenizedRecord> r = s.take(s.record_at(n / N, n % N));
    if (!r) {
      ++skipped;
      continue;
    }
    pending_global_ = g;
    pending_source_ = k;
    pending_counts_ = std::move(before);
    return std::move(*r);
  }
}

Batch MixtureSource::next() {
  return pack_rows(
      options_.pack,
      [this]() -> const TokenizedRecord& {
        if (!has_pending_) {
          pending_ = next_record();
          has_pending_ = true;
        }
        return pending_;
      },
      [this] {
        ++records_placed_[pending_source_];
        tokens_placed_[pending_source_] += static_cast<int64_t>(pending_.ids.size());
        has_pending_ = false;
      });
}

int64_t MixtureSource::rows_per_epoch(const std::function<void(int64_t, int64_t)>& progress) {
  int64_t total = 0, before = 0;
  for (const auto& s : sources_) total += s->used_records();
  std::vector<std::vector<int32_t>> lengths;
  for (const auto& s : sources_) {
    lengths.push_back(s->scan_epoch([&](int64_t done, int64_t) {
                         if (progress) progress(before + done, total);
                       }).tokens);
    before += s->used_records();
  }
  RowCount rows(options_.pack);
  std::vector<int64_t> drawn(sources_.size(), 0);
  for (int64_t g = 0; g < epoch_records_; ++g) {
    const size_t k = source_of(g);
    JsonlSource& s = *sources_[k];
    const int64_t n = drawn[k]++, N = s.train_records();
    const int64_t len = lengths[k][static_cast<size_t>(s.record_at(n / N, n % N))];
    rows.add(std::min<int64_t>(len, options_.pack.seq_len));
  }
  return rows.rows();
}

}  // namespace ft::data
