// Fuzzes reading a JSONL dataset: the input is the file, indexed by JsonlIndex, and again as a
// JSON array of records, indexed by JsonArrayIndex. Each record (the first 16 of each reading) is
// parsed as every format (auto, text, alpaca, chat, tokens) and detected; a record a format accepts
// is rendered with every chat template, with and without train_on_prompt. The first reading that
// succeeds is tokenized (tokenize_record) with one template, flag and fixture tokenizer (Llama 3's
// byte-level BPE or Llama 2's byte fallback), chosen by the record's line number so that a run
// covers every pairing.
#include <optional>

#include "data/json_array.h"
#include "data/jsonl.h"
#include "data/records.h"
#include "fuzz_support.h"
#include "tokenizer/tokenizer.h"

namespace {

using namespace ft;

constexpr data::RecordFormat kFormats[] = {
    data::RecordFormat::kAuto, data::RecordFormat::kText,     data::RecordFormat::kAlpaca,
    data::RecordFormat::kChat, data::RecordFormat::kSharegpt, data::RecordFormat::kTokens};
constexpr data::ChatTemplate kTemplates[] = {
    data::ChatTemplate::kNone, data::ChatTemplate::kLlama3, data::ChatTemplate::kLlama2,
    data::ChatTemplate::kChatml, data::ChatTemplate::kMistral};

const tokenizer::Tokenizer& fixture_tokenizer(int64_t which) {
  static const tokenizer::Tokenizer tokenizers[] = {
      tokenizer::Tokenizer::from_file(FT_SOURCE_DIR
                                      "/tests/tokenizer/fixtures/llama3/tokenizer.json"),
      tokenizer::Tokenizer::from_file(FT_SOURCE_DIR
                                      "/tests/tokenizer/fixtures/llama2/tokenizer.json")};
  return tokenizers[which % 2];
}

void fuzz_record(const data::JsonlLine& line, const std::string& origin) {
  std::optional<data::Record> first;  // the first format's reading that succeeds: tokenized
  for (const data::RecordFormat format : kFormats) {
    fuzz::expect_ft_errors([&] {
      data::Record r = data::parse_record(line.text, format, origin);
      if (r.format != data::RecordFormat::kTokens) {
        for (const data::ChatTemplate t : kTemplates) {
          fuzz::expect_ft_errors([&] { (void)data::render(r, t, false, origin); });
          fuzz::expect_ft_errors([&] { (void)data::render(r, t, true, origin); });
        }
      }
      if (!first) first = std::move(r);
    });
  }
  fuzz::expect_ft_errors([&] { (void)data::detect_format(line.text, origin); });
  if (!first) return;
  fuzz::expect_ft_errors([&] {
    const int64_t n = line.line;
    const data::TokenizedRecord out = data::tokenize_record(
        *first, kTemplates[n % 5], (n / 5) % 2 == 1, fixture_tokenizer(n / 10), origin);
    fuzz::require(out.ids.size() == out.labels.size(), "a tokenized record has a label per id");
    for (size_t i = 0; i < out.ids.size(); ++i)
      fuzz::require(out.labels[i] == -100 || out.labels[i] == out.ids[i] ||
                        first->format == data::RecordFormat::kTokens,
                    "a label is the id or -100");
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)fixture_tokenizer(0);  // loaded before the first input, not inside one
  const std::string path = fuzz::scratch_dir() + "/train.jsonl";
  fuzz::write_file(path, fuzz::as_text(data, size));
  fuzz::expect_ft_errors([&] {
    const data::JsonlIndex index(path);
    for (int64_t i = 0; i < std::min<int64_t>(index.size(), 16); ++i) {
      const data::JsonlLine line = index.read(i);
      fuzz_record(line, "train.jsonl:" + std::to_string(line.line));
    }
  });
  fuzz::expect_ft_errors([&] {
    const data::JsonArrayIndex index(path);
    for (int64_t i = 0; i < std::min<int64_t>(index.size(), 16); ++i)
      fuzz_record({index.read(i), i + 1}, index.origin(i));
  });
  return 0;
}
