// Training batches from a dataset file (JSONL, compressed JSONL, Parquet, Arrow: record_file.h):
// records in a deterministic per-epoch shuffle, rendered with a chat template, tokenized,
// truncated to seq_len and packed into [B, T] rows as the synthetic source packs them. Owns its
// record file and shares the tokenizer; not thread-safe (a source is read by one loop).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "config/settings.h"
#include "data/batch.h"
#include "data/chat_template.h"
#include "data/record_file.h"
#include "data/records.h"

namespace ft::tokenizer {
class Tokenizer;
}

namespace ft::data {

class TokenCache;

enum class BadRecordPolicy { kError, kSkip };
// "error" / "skip"; anything else throws ft::ConfigError.
BadRecordPolicy parse_bad_record_policy(std::string_view name);

struct JsonlOptions {
  static constexpr int64_t kDefaultSeqLen = 2048;
  static constexpr uint64_t kDefaultSeed = 42;

  std::string path;
  // The tokenizer: `tokenizer`, else the file at `tokenizer_path`, else none. Pre-tokenized
  // records need none (their ids are checked against `vocab_size`); other formats refuse to
  // start without one.
  std::string tokenizer_path;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer;
  int64_t vocab_size = 0;  // the model's; 0: the tokenizer's
  RecordFormat format = RecordFormat::kAuto;
  RecordShape shape;  // where conversation records keep their turns, system prompt and tools
  ChatTemplate chat_template = ChatTemplate::kNone;
  // Where data.template auto looks for the model's own chat template (tokenizer_config.json,
  // chat_template.jinja); empty: the tokenizer family's built-in.
  std::string model_dir;
  int64_t seq_len = kDefaultSeqLen;
  int64_t micro_batch = 1;
  bool pack = true;  // several records per row; false: one record per row, padded
  bool train_on_prompt = false;
  BadRecordPolicy on_bad_record = BadRecordPolicy::kError;
  // Read records from the tokenized cache `ft data prepare` made (token_cache.h) when there is
  // one for these inputs; data.cache_dir, "" = PATH.ftcache.
  bool use_cache = false;
  std::string cache_dir;
  // With use_cache, for a file without cheap random access (RecordFile::random_access: compressed
  // JSONL, a large Parquet file): make the cache first when there is none, one process at a time
  // (a lock file beside it; the others wait and then read it), with progress on stderr. ft train
  // sets it: its shuffled reads would otherwise decompress or decode the file again and again.
  bool prepare_cache = false;
  uint64_t seed = kDefaultSeed;  // shuffle seed; the order of epoch e is a function of (seed, e)
  int rank = 0, world_size = 1;
  int64_t max_records = 0;  // train on the file's first max_records records only; 0 = all
};

// splitmix64: the counter-based mixing the shuffles and the mixtures' draws are made of (the
// same input gives the same output on every rank and restart).
uint64_t splitmix64(uint64_t x);

// The options the preset's data section sets (format, record shape, template, seq_len, packing,
// prompt masking, bad-record policy); the caller sets the path, tokenizer, micro_batch, seed and
// rank.
JsonlOptions jsonl_options(const config::DataSettings& data);

// The tokenizer a job reads its data with: `given` (--tokenizer) when set, else
// `model_dir`/tokenizer.json when that exists, else "" (none: only pre-tokenized data is readable).
std::string tokenizer_path_of(const std::string& given, const std::string& model_dir);

// The tokenizer.json at `path`, checked against a model of `model_vocab_size` token ids (a larger
// tokenizer would index past the embedding): ConfigError naming both sizes and what to do, which
// depends on where the vocabulary came from: `model_dir`'s config.json (its own tokenizer), or
// with "" the preset's shape (also --set model.vocab_size, which a model directory's refuses).
std::shared_ptr<const tokenizer::Tokenizer> open_tokenizer(const std::string& path,
                                                           int64_t model_vocab_size,
                                                           const std::string& model_dir);

// Rank r of W reads the global record stream g = r, r+W, r+2W, ... where g indexes epoch g / N,
// position g % N of that epoch's shuffle (N = train_records(): the used records less those held
// out). Padding is id 0 in its own segment, with
// no loss; the first token of every record carries no loss (nothing before it predicts it).
class JsonlSource : public BatchSource {
 public:
  // Indexes the file and validates the first record (a bad first record is always an error: it
  // fixes the format when format is auto). `start_sample`: global records already consumed (a
  // checkpoint's samples_consumed()). Throws ConfigError for bad options, FormatError for a bad
  // file, tokenizer or first record.
  explicit JsonlSource(JsonlOptions options, int64_t start_sample = 0);
  ~JsonlSource() override;

  Batch next() override;
  // Global records consumed (skipped ones included): this rank's next global index rounded
  // down to a multiple of world_size; independent of world size for the same position.
  int64_t samples_consumed() const override { return cursor() - options_.rank; }
  std::vector<int64_t> position() const override { return {samples_consumed()}; }
  void seek(const std::vector<int64_t>& position) override;

  int64_t num_records() const { return file_->size(); }
  // The records training may use: the file's first max_records (all when 0).
  int64_t used_records() const { return used_; }
  // The records an epoch holds: the used ones less those hold_out() set aside.
  int64_t train_records() const { return used_ - static_cast<int64_t>(held_out_.size()); }
  // Sets `count` of the used records aside for evaluation (eval.split), chosen by a shuffle of
  // (seed, salt) that no epoch order shares: the same on every rank and restart. Call before
  // next(). ConfigError when no record would be left to train on.
  void hold_out(int64_t count, uint64_t salt);
  const std::vector<int64_t>& held_out() const { return held_out_; }  // file indices, ascending
  const RecordFile& file() const { return *file_; }
  // The epoch of the next record a batch will take.
  int64_t epoch() const { return cursor() / train_records(); }
  int64_t skipped() const { return skipped_; }      // malformed records skipped (this rank)
  int64_t truncated() const { return truncated_; }  // records cut to seq_len (this rank)
  RecordFormat format() const { return format_; }
  int64_t seq_len() const { return options_.seq_len; }
  bool skips_bad_records() const { return options_.on_bad_record == BadRecordPolicy::kSkip; }
  // What a tokenized cache of this source must have been made for (token_cache_key of the
  // options, with the model's template when data.template auto found one).
  nlohmann::json cache_key() const;
  // With use_cache: the cache read ("" when none), and why none is used otherwise.
  const std::string& cache_path() const { return cache_path_; }
  const std::string& cache_note() const { return cache_note_; }
  // Null when there is none (pre-tokenized data read without one).
  const tokenizer::Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // The template records are rendered with, for the start-up log: "the model's own chat template
  // (DIR/tokenizer_config.json chat_template)", "llama3 (built-in)", "none".
  std::string template_used() const;
  // The Jinja source of the chat template records are rendered with (the model's own, or the
  // built-in's equivalent, builtin_template_jinja), for the saved model's chat_template.jinja; ""
  // when no record is rendered as a conversation (text and pre-tokenized data, template none).
  std::string chat_template_source() const;

  // The record index at position `position` of epoch `epoch`'s order.
  int64_t record_at(int64_t epoch, int64_t position);
  // Record `record` as a batch takes it: tokenized, cut to seq_len, its first token without a
  // loss; nullopt (counted) when it is skipped: malformed under data.on_bad_record=skip, or empty.
  // A malformed one under error is a FormatError saying how to skip such records.
  std::optional<TokenizedRecord> take(int64_t record);

  // Record `record` (a file index, in file order) parsed and tokenized whole, not cut to seq_len;
  // `origin` gets its file:line (RecordFile::origin). FormatError naming file:line for a malformed
  // one. Thread-safe (ft eval tokenizes every record this way, in parallel: in file order, chunk
  // by chunk, as a file without random access wants).
  TokenizedRecord tokenize_whole(int64_t record, std::string* origin = nullptr) const;

  // One epoch as next() lays it out: every record tokenized once (in parallel, calling
  // `progress(records_done, num_records())` between chunks) and placed in epoch 0's order into
  // rows of [seq_len] tokens. Counts as one rank reading every record, whatever this source's
  // rank. A malformed record is counted under BadRecordPolicy::kSkip; under kError the first one
  // in file order is next()'s FormatError (kThrow), or ends the scan (kStop: it then covers the
  // records before that one and names it). Leaves the source's position unchanged.
  enum class AtMalformed { kThrow, kStop };
  struct EpochScan {
    static constexpr int32_t kEmpty = -1, kMalformed = -2;
    // Per record, in file order: its tokens whole (or kEmpty / kMalformed), and the tokens that
    // carry a loss once cut to seq_len.
    std::vector<int32_t> tokens, trained;
    int64_t rows = 0;        // rows of epoch 0 (what train.epochs counts in)
    int64_t row_tokens = 0;  // tokens placed in them (after truncation): the rest is padding
    // kStop: the malformed record the scan stopped at (tokens/trained then hold the records before
    // it), "FILE:LINE", and its error; -1 and "" when the scan covered the file.
    int64_t stopped_at = -1;
    std::string stopped_origin, stopped_error;
  };
  EpochScan scan_epoch(const std::function<void(int64_t, int64_t)>& progress = {},
                       AtMalformed at_malformed = AtMalformed::kThrow);
  // Rows of [seq_len] tokens that one epoch gives (scan_epoch's rows). Later epochs pack another
  // order and may give a row or so more or fewer.
  int64_t rows_per_epoch(const std::function<void(int64_t, int64_t)>& progress = {}) {
    return scan_epoch(progress).rows;
  }

 private:
  // data.template auto: the model's own template (options_.model_dir) or the tokenizer family's
  // built-in.
  void resolve_template();
  // The next usable record on this rank, tokenized and truncated (skips bad ones if allowed).
  TokenizedRecord next_record();
  // Under BadRecordPolicy::kError: the FormatError of malformed record `record`, saying how to
  // skip such records instead.
  [[noreturn]] void throw_bad_record(int64_t record) const;
  // Places the records [0, records) (file indices; malformed and empty ones take no room; held-out
  // ones are in no epoch) in epoch 0's order into `scan`'s rows, as next() packs them.
  void place_rows(EpochScan& scan, int64_t records);
  // Record `record` (a file index) parsed, tokenized and truncated to seq_len; throws FormatError
  // naming file:line for a malformed one. Thread-safe.
  TokenizedRecord tokenize_at(int64_t record, bool* truncated) const;
  const std::vector<int64_t>& order_of(int64_t epoch);
  // The global index of the next record a batch will take (the pending one, if any).
  int64_t cursor() const { return has_pending_ ? pending_global_ : next_global_; }

  JsonlOptions options_;
  std::shared_ptr<const tokenizer::Tokenizer> tokenizer_;
  std::shared_ptr<const JinjaChatTemplate> model_template_;  // data.template auto, when it has one
  bool template_from_auto_ = false;
  // With use_cache: the cache when it exists for these inputs, or is made now (prepare_cache).
  void open_cache();
  std::unique_ptr<RecordFile> file_;
  int64_t used_ = 0;               // min(file_->size(), max_records)
  std::vector<int64_t> held_out_;  // hold_out()'s records, ascending
  std::vector<int64_t> trained_;   // the used records less held_out_ (empty when none is held out)
  RecordFormat format_;
  int64_t next_global_;
  int64_t order_epoch_ = -1;
  std::vector<int64_t> order_;  // record indices in the order of epoch `order_epoch_`
  bool has_pending_ = false;    // a record that did not fit the previous row
  TokenizedRecord pending_;
  int64_t pending_global_ = 0;
  int64_t skipped_ = 0, truncated_ = 0;
  std::unique_ptr<TokenCache> cache_;
  std::string cache_path_, cache_note_;
};

}  // namespace ft::data
