#include "data/inspect.h"

#include <fmt/format.h>

#include <algorithm>

#include "tokenizer/tokenizer.h"

namespace ft::data {
namespace {

constexpr const char* kTrainedOn = "\033[1;32m";  // bold green
constexpr const char* kDim = "\033[2m";
constexpr const char* kReset = "\033[0m";

// Maximal runs of tokens with the same trained-ness, as [begin, end) with that flag.
struct Run {
  size_t begin, end;
  bool trained;
};
std::vector<Run> runs_of(const std::vector<bool>& trained) {
  std::vector<Run> out;
  for (size_t i = 0; i < trained.size(); ++i) {
    if (out.empty() || out.back().trained != trained[i]) out.push_back({i, i, trained[i]});
    out.back().end = i + 1;
  }
  return out;
}

std::string mark(const std::string& text, bool trained, bool color) {
  if (color) return fmt::format("{}{}{}", trained ? kTrainedOn : kDim, text, kReset);
  return trained ? "⟦" + text + "⟧" : text;
}

// "3 optimizer steps of 2 rows", singular where it is one.
std::string steps_of(int64_t steps, int64_t rows) {
  return fmt::format("{} optimizer step{} of {} row{}", steps, steps == 1 ? "" : "s", rows,
                     rows == 1 ? "" : "s");
}

}  // namespace

DataStats data_stats(JsonlSource& source, const std::function<void(int64_t, int64_t)>& progress) {
  const JsonlSource::EpochScan scan = source.scan_epoch(progress, JsonlSource::AtMalformed::kStop);
  DataStats s;
  s.records = source.num_records();
  s.covered = static_cast<int64_t>(scan.tokens.size());
  s.stopped_origin = scan.stopped_origin;
  s.stopped_error = scan.stopped_error;
  s.seq_len = source.seq_len();
  s.rows = scan.rows;
  s.row_tokens = scan.row_tokens;
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < scan.tokens.size(); ++i) {
    const int64_t len = scan.tokens[i];
    if (len == JsonlSource::EpochScan::kMalformed) {
      ++s.malformed;
      continue;
    }
    if (len == JsonlSource::EpochScan::kEmpty) {
      ++s.empty;
      continue;
    }
    lengths.push_back(len);
    s.tokens += len;
    s.trained += scan.trained[i];
    if (len > s.seq_len) {
      ++s.truncated;
      s.cut_tokens += len - s.seq_len;
    }
    int64_t bucket = 1;
    while (bucket * 2 <= len) bucket *= 2;
    auto it = std::find_if(s.histogram.begin(), s.histogram.end(),
                           [&](const auto& b) { return b.first == bucket; });
    if (it == s.histogram.end()) {
      s.histogram.emplace_back(bucket, 1);
    } else {
      ++it->second;
    }
  }
  std::sort(s.histogram.begin(), s.histogram.end());
  if (!lengths.empty()) {
    std::sort(lengths.begin(), lengths.end());
    s.shortest = lengths.front();
    s.longest = lengths.back();
    s.median = lengths[lengths.size() / 2];
  }
  return s;
}

std::string format_stats(const DataStats& s) {
  const int64_t usable = s.covered - s.malformed - s.empty;
  const std::string records =
      s.stopped_origin.empty()
          ? fmt::format("{} ({} usable, {} malformed and skipped, {} empty)", s.records, usable,
                        s.malformed, s.empty)
          : fmt::format(
                "{} before the malformed record {} ({} usable, {} empty); the statistics "
                "stop there, the file has {}",
                s.covered, s.stopped_origin, usable, s.empty, s.records);
  const int64_t per_step = s.micro_batch * s.grad_accum;
  std::string out = fmt::format(
      "settings    data.seq_len {}, train.micro_batch {}, train.grad_accum {}{}\n"
      "records     {}\n"
      "tokens      {} ({:.1f} per record; shortest {}, median {}, longest {})\n"
      "trained     {} tokens carry the loss ({:.1f}%)\n"
      "truncated   {} records longer than data.seq_len={} ({} tokens cut off and not trained)\n"
      "packing     {} rows of {} tokens per epoch, {:.1f}% tokens, {:.1f}% padding\n"
      "steps       one epoch is {} on one rank (train.micro_batch x train.grad_accum); N ranks "
      "take 1/N as many\n"
      "lengths     tokens per record:\n",
      s.seq_len, s.micro_batch, s.grad_accum,
      s.settings_from.empty() ? "" : " (" + s.settings_from + ")", records, s.tokens,
      usable > 0 ? static_cast<double>(s.tokens) / static_cast<double>(usable) : 0.0, s.shortest,
      s.median, s.longest, s.trained,
      s.tokens > 0 ? 100.0 * static_cast<double>(s.trained) / static_cast<double>(s.tokens) : 0.0,
      s.truncated, s.seq_len, s.cut_tokens, s.rows, s.seq_len, 100.0 * s.packing_efficiency(),
      100.0 * (1 - s.packing_efficiency()), steps_of((s.rows + per_step - 1) / per_step, per_step));
  int64_t most = 1;
  for (const auto& [lo, n] : s.histogram) most = std::max(most, n);
  for (const auto& [lo, n] : s.histogram) {
    const int bar = static_cast<int>((40 * n + most - 1) / most);
    out += fmt::format("  {:>8} - {:<8} {:>9}  {}\n", lo, 2 * lo - 1, n, std::string(bar, '#'));
  }
  return out;
}

std::string show_record(const JsonlSource& source, int64_t record, bool color) {
  const tokenizer::Tokenizer* tokenizer = source.tokenizer();
  const int64_t seq_len = source.seq_len();
  std::string origin;
  const TokenizedRecord r = source.tokenize_whole(record, &origin);
  const size_t n = r.ids.size(), kept = std::min<size_t>(n, static_cast<size_t>(seq_len));
  std::vector<bool> trained(kept);
  int64_t count = 0;
  for (size_t i = 1; i < kept; ++i) count += trained[i] = r.labels[i] != -100;
  std::string out = fmt::format("--- {} ({}): {} tokens, {} carry the loss{}\n", origin,
                                name_of(source.format()), n, count,
                                n > kept ? fmt::format("; cut to data.seq_len={} for training, "
                                                       "the last {} tokens are not trained",
                                                       seq_len, n - kept)
                                         : "");
  const std::vector<Run> runs = runs_of(trained);
  if (tokenizer) {
    std::string text;
    for (const Run& run : runs) {
      const std::vector<int32_t> ids(r.ids.begin() + run.begin, r.ids.begin() + run.end);
      text += mark(tokenizer->decode(ids, false), run.trained, color);
    }
    if (n > kept) {
      const std::vector<int32_t> rest(r.ids.begin() + kept, r.ids.end());
      const std::string cut = "[cut: " + tokenizer->decode(rest, false) + "]";
      text += color ? kDim + cut + kReset : cut;
    }
    out += "text: " + text + "\n";
  } else {
    out += "text: (no tokenizer: pre-tokenized ids only)\n";
  }
  std::string ids;
  for (const Run& run : runs) {
    std::string part;
    for (size_t i = run.begin; i < run.end; ++i)
      part += fmt::format("{}{}", i == run.begin ? "" : " ", r.ids[i]);
    ids += (ids.empty() ? "" : " ") + mark(part, run.trained, color);
  }
  if (n > kept) ids += fmt::format(" [cut: {} ids]", n - kept);
  out += "ids:  " + ids + "\n";
  return out;
}

}  // namespace ft::data
