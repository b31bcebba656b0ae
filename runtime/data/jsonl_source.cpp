#include "data/jsonl_source.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <numeric>

#include "core/error.h"
#include "data/token_cache.h"
#include "tokenizer/tokenizer.h"

namespace ft::data {
namespace {

constexpr int64_t kPad = 0, kIgnore = -100;
// What a malformed record's error adds under data.on_bad_record=error.
constexpr const char* kSkipHint =
    "; fix that line, or train without such lines (skipped and counted) with --set "
    "data.on_bad_record=skip";

// splitmix64, as the synthetic task uses: the order of an epoch depends on (seed, epoch) only.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

std::shared_ptr<const tokenizer::Tokenizer> load_tokenizer(const JsonlOptions& o) {
  if (o.tokenizer || o.tokenizer_path.empty()) return o.tokenizer;
  return std::make_shared<const tokenizer::Tokenizer>(
      tokenizer::Tokenizer::from_file(o.tokenizer_path));
}

}  // namespace

BadRecordPolicy parse_bad_record_policy(std::string_view name) {
  if (name == "error") return BadRecordPolicy::kError;
  if (name == "skip") return BadRecordPolicy::kSkip;
  throw ConfigError(detail::cat("data.on_bad_record '", name, "' is not one of error, skip"));
}

std::string tokenizer_path_of(const std::string& given, const std::string& model_dir) {
  if (!given.empty()) return given;
  if (model_dir.empty()) return "";
  const std::string path = model_dir + "/tokenizer.json";
  return std::filesystem::exists(path) ? path : "";
}

std::shared_ptr<const tokenizer::Tokenizer> open_tokenizer(const std::string& path,
                                                           int64_t model_vocab_size,
                                                           const std::string& hint) {
  auto t = std::make_shared<const tokenizer::Tokenizer>(tokenizer::Tokenizer::from_file(path));
  FT_CHECK(static_cast<int64_t>(t->vocab_size()) <= model_vocab_size, "the tokenizer ", path,
           " has ", t->vocab_size(), " tokens but the model's vocabulary is ", model_vocab_size,
           hint);
  return t;
}

JsonlOptions jsonl_options(const config::DataSettings& data) {
  JsonlOptions o;
  o.format = parse_record_format(data.format);
  o.chat_template = parse_chat_template(data.chat_template);
  o.seq_len = data.seq_len;
  o.pack = data.pack;
  o.train_on_prompt = data.train_on_prompt;
  o.on_bad_record = parse_bad_record_policy(data.on_bad_record);
  return o;
}

JsonlSource::JsonlSource(JsonlOptions options, int64_t start_sample)
    : options_(std::move(options)),
      tokenizer_(load_tokenizer(options_)),
      file_(open_record_file(options_.path)),
      format_(options_.format) {
  const JsonlOptions& o = options_;
  FT_CHECK(o.seq_len >= 2, "data.seq_len must be >= 2, got ", o.seq_len);
  FT_CHECK(o.micro_batch >= 1, "train.micro_batch must be >= 1, got ", o.micro_batch);
  FT_CHECK(o.world_size >= 1 && o.rank >= 0 && o.rank < o.world_size, "data: rank ", o.rank,
           " is not in [0, world_size ", o.world_size, ")");
  FT_CHECK(start_sample >= 0, "data: start sample must be >= 0, got ", start_sample);
  FT_CHECK_T(FormatError, file_->size() > 0, o.path, ": no records (",
             std::string(file_->kind()).find("JSONL") != std::string::npos
                 ? "the file has no non-empty lines"
                 : std::string("the ") + file_->kind() + " data has no rows",
             ")");
  if (format_ == RecordFormat::kAuto) format_ = detect_format(file_->read(0), file_->origin(0));
  FT_CHECK(tokenizer_ || format_ == RecordFormat::kTokens, "--data ", o.path, " holds ",
           name_of(format_),
           " records, which need a tokenizer to become token ids: give --tokenizer "
           "PATH/tokenizer.json, or a --model directory that holds tokenizer.json (pre-tokenized "
           "records, {\"input_ids\": [...]}, need none)");
  resolve_template();
  // The template's own tokens, where records are rendered with it.
  if (format_ == RecordFormat::kChat || format_ == RecordFormat::kAlpaca) {
    for (const std::string& t : template_special_tokens(o.chat_template)) {
      FT_CHECK(tokenizer_->token_to_id(t).has_value(), "data.template '", name_of(o.chat_template),
               "' writes ", t, ", which is not a token of the tokenizer",
               o.tokenizer_path.empty() ? "" : " " + o.tokenizer_path,
               ": choose the template of the model's family");
    }
  }
  FT_CHECK(!(template_from_auto_ && o.chat_template == ChatTemplate::kNone &&
             format_ == RecordFormat::kChat),
           "data.template auto found no chat template for the chat records of ", o.path, ": ",
           o.model_dir.empty() ? std::string("no --model directory was given")
                               : "the model directory " + o.model_dir +
                                     " has no chat_template in tokenizer_config.json and no "
                                     "chat_template.jinja",
           ", and the tokenizer has the special tokens of none of the built-in templates; set "
           "--set data.template=llama3|llama2|chatml|mistral");
  (void)tokenize_whole(0);  // a bad first record stops here, whatever the policy
  if (o.use_cache) open_cache();
  const int64_t W = o.world_size;
  next_global_ = start_sample + (((o.rank - start_sample) % W) + W) % W;
}

JsonlSource::~JsonlSource() = default;

void JsonlSource::open_cache() {
  const nlohmann::json key = cache_key();
  const std::string path = token_cache_path(options_, key);
  const auto fits = [&] {
    if (cache_ && cache_->records() != file_->size()) {
      cache_note_ = detail::cat("the tokenized cache ", path, " holds ", cache_->records(),
                                " records, the file ", file_->size(), ": not used");
      cache_.reset();
    }
    return cache_ != nullptr;
  };
  cache_ = TokenCache::open(path, key, &cache_note_);
  if (!fits() && options_.prepare_cache && !file_->random_access()) {
    cache_ = prepare_token_cache(*this, path, key);
    (void)fits();
  }
  if (cache_) cache_path_ = path;
}

nlohmann::json JsonlSource::cache_key() const {
  nlohmann::json key = token_cache_key(options_);
  if (model_template_) {
    // The model's template is part of what the tokens are; a template that writes today's date
    // makes a cache that is good for that day only.
    const ModelChatTemplate& m = model_template_->model();
    key["template_text"] = m.text;
    key["template_tokens"] = {m.bos_token, m.eos_token};
    if (m.text.find("strftime_now") != std::string::npos && m.now) {
      char day[16];
      std::tm tm{};
      localtime_r(&*m.now, &tm);
      std::strftime(day, sizeof day, "%Y-%m-%d", &tm);
      key["template_date"] = day;
    }
  }
  return key;
}

void JsonlSource::resolve_template() {
  if (options_.chat_template != ChatTemplate::kAuto) return;
  template_from_auto_ = true;
  // Only records rendered as a conversation read the model's template: text and pre-tokenized
  // data train from a model directory whatever its template holds.
  const bool conversation = format_ == RecordFormat::kChat || format_ == RecordFormat::kAlpaca;
  std::optional<ModelChatTemplate> model;
  if (conversation && !options_.model_dir.empty()) {
    model = read_model_chat_template(options_.model_dir);
  }
  if (model) {
    model->now = std::time(nullptr);
    model_template_ = std::make_shared<const JinjaChatTemplate>(std::move(*model));
    options_.chat_template = ChatTemplate::kModel;
  } else {
    // Pre-tokenized data may come without a tokenizer: it is not rendered.
    options_.chat_template = tokenizer_ ? builtin_template_for(*tokenizer_) : ChatTemplate::kNone;
  }
}

std::string JsonlSource::template_used() const {
  if (model_template_) {
    return "the model's own chat template (" + model_template_->model().origin + ")";
  }
  std::string name = name_of(options_.chat_template);
  if (options_.chat_template != ChatTemplate::kNone) name += " (built-in)";
  if (template_from_auto_) {
    name += options_.model_dir.empty() ? ", chosen by data.template auto from the tokenizer's "
                                         "special tokens (no model directory)"
                                       : ", chosen by data.template auto from the tokenizer's "
                                         "special tokens (the model has no chat template)";
  }
  return name;
}

std::string JsonlSource::chat_template_source() const {
  if (model_template_) return model_template_->model().text;
  const bool conversation = format_ == RecordFormat::kChat || format_ == RecordFormat::kAlpaca;
  return conversation ? builtin_template_jinja(options_.chat_template) : "";
}

void JsonlSource::seek(const std::vector<int64_t>& position) {
  FT_CHECK(position.size() == 1 && position[0] >= 0,
           "JSONL data: a position is one record count >= 0; the checkpoint holds another kind");
  const int64_t s = position[0], W = options_.world_size;
  next_global_ = s + (((options_.rank - s) % W) + W) % W;
  has_pending_ = false;
}

const std::vector<int64_t>& JsonlSource::order_of(int64_t epoch) {
  if (epoch == order_epoch_) return order_;
  const int64_t n = file_->size();
  order_.resize(static_cast<size_t>(n));
  std::iota(order_.begin(), order_.end(), 0);
  uint64_t state = mix(options_.seed ^ mix(static_cast<uint64_t>(epoch) + 1));
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates
    state = mix(state);
    std::swap(order_[i], order_[state % static_cast<uint64_t>(i + 1)]);
  }
  order_epoch_ = epoch;
  return order_;
}

int64_t JsonlSource::record_at(int64_t epoch, int64_t position) {
  FT_ASSERT(position >= 0 && position < file_->size(), "position ", position);
  return order_of(epoch)[static_cast<size_t>(position)];
}

TokenizedRecord JsonlSource::tokenize_whole(int64_t record, std::string* origin_out) const {
  const std::string origin = file_->origin(record);
  if (origin_out) *origin_out = origin;
  // From the cache, unless the record is malformed there: its error comes from the file, unless
  // reading it there would decompress the file up to it (ft data show names the error).
  if (cache_ && !cache_->malformed(record)) return cache_->record(record);
  FT_CHECK_T(FormatError, !cache_ || file_->random_access(), origin,
             ": a malformed record (so marked in the tokenized cache; ft data show --data ",
             options_.path, " says what is wrong with it)");
  const Record parsed = parse_record(file_->read(record), format_, origin);
  if (parsed.format == RecordFormat::kTokens) {
    const int64_t vocab = options_.vocab_size > 0 ? options_.vocab_size
                                                  : static_cast<int64_t>(tokenizer_->vocab_size());
    return tokens_record(parsed, vocab, origin);
  }
  return tokenize_record(parsed, options_.chat_template, options_.train_on_prompt, *tokenizer_,
                         origin, model_template_.get());
}

TokenizedRecord JsonlSource::tokenize_at(int64_t record, bool* truncated) const {
  TokenizedRecord r = tokenize_whole(record);
  *truncated = static_cast<int64_t>(r.ids.size()) > options_.seq_len;
  if (*truncated) {
    r.ids.resize(static_cast<size_t>(options_.seq_len));  // keep the start
    r.labels.resize(static_cast<size_t>(options_.seq_len));
  }
  return r;
}

TokenizedRecord JsonlSource::next_record() {
  const int64_t n = file_->size();
  // A whole epoch of unusable records would loop forever: stop after one full pass of them.
  for (int64_t failures = 0;; ++failures) {
    FT_CHECK_T(FormatError, failures <= n, options_.path, ": no usable record in a whole epoch (",
               skipped_, " malformed records skipped)");
    const int64_t g = next_global_;
    next_global_ += options_.world_size;
    TokenizedRecord r;
    bool truncated = false;
    try {
      r = tokenize_at(record_at(g / n, g % n), &truncated);
    } catch (const FormatError& e) {
      if (options_.on_bad_record == BadRecordPolicy::kError)
        throw FormatError(detail::cat(e.what(), kSkipHint));
      ++skipped_;
      continue;
    }
    if (r.ids.empty()) continue;  // nothing to train on (an empty text with no BOS/EOS)
    if (truncated) ++truncated_;
    r.labels[0] = kIgnore;  // nothing before a record's first token predicts it
    pending_global_ = g;
    return r;
  }
}

JsonlSource::EpochScan JsonlSource::scan_epoch(
    const std::function<void(int64_t, int64_t)>& progress, AtMalformed at_malformed) {
  const int64_t n = file_->size(), T = options_.seq_len;
  EpochScan scan;
  scan.tokens.assign(static_cast<size_t>(n), 0);
  scan.trained.assign(static_cast<size_t>(n), 0);
  constexpr int64_t kChunk = 4096;  // file order: reads stay sequential
  int64_t covered = n;
  for (int64_t begin = 0; begin < n && covered == n; begin += kChunk) {
    const int64_t end = std::min(n, begin + kChunk);
    at::parallel_for(begin, end, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const size_t k = static_cast<size_t>(i);
        try {
          const TokenizedRecord r = tokenize_whole(i);
          const int64_t len = static_cast<int64_t>(r.ids.size());
          scan.tokens[k] = len == 0 ? EpochScan::kEmpty
                                    : static_cast<int32_t>(std::min<int64_t>(len, INT32_MAX));
          // The first token carries no loss (nothing before it predicts it).
          for (int64_t t = 1; t < std::min(len, T); ++t)
            scan.trained[k] += r.labels[static_cast<size_t>(t)] != kIgnore;
        } catch (const FormatError&) {
          scan.tokens[k] = EpochScan::kMalformed;
        }
      }
    });
    for (int64_t i = begin; i < end && options_.on_bad_record == BadRecordPolicy::kError; ++i) {
      if (scan.tokens[static_cast<size_t>(i)] != EpochScan::kMalformed) continue;
      // Again on this thread, so the error is the first bad record's, as next() throws it.
      if (at_malformed == AtMalformed::kThrow) throw_bad_record(i);
      covered = i;
      scan.stopped_at = i;
      try {
        (void)tokenize_whole(i, &scan.stopped_origin);
      } catch (const FormatError& e) {
        scan.stopped_error = e.what();
      }
      break;
    }
    if (progress) progress(covered == n ? end : covered, n);
  }
  scan.tokens.resize(static_cast<size_t>(covered));
  scan.trained.resize(static_cast<size_t>(covered));
  place_rows(scan, covered);
  FT_CHECK_T(FormatError, scan.rows > 0 || scan.stopped_at >= 0, options_.path,
             ": no usable record in the file (",
             std::count(scan.tokens.begin(), scan.tokens.end(), EpochScan::kMalformed),
             " malformed records skipped)");
  return scan;
}

void JsonlSource::place_rows(EpochScan& scan, int64_t records) {
  // As next() does: a record that does not fit the current row starts the next one.
  const int64_t T = options_.seq_len;
  int64_t filled = 0;
  bool open = false;
  for (const int64_t record : order_of(0)) {
    if (record >= records) continue;
    const int64_t len = std::min<int64_t>(scan.tokens[static_cast<size_t>(record)], T);
    if (len <= 0) continue;
    if (open && (!options_.pack || filled + len > T)) {
      ++scan.rows;
      filled = 0;
    }
    filled += len;
    scan.row_tokens += len;
    open = true;
  }
  if (open) ++scan.rows;
}

void JsonlSource::throw_bad_record(int64_t record) const {
  try {
    (void)tokenize_whole(record);
  } catch (const FormatError& e) {
    throw FormatError(detail::cat(e.what(), kSkipHint));
  }
  FT_ASSERT(false, "record ", record, " was malformed and then was not");
}

Batch JsonlSource::next() {
  const int64_t B = options_.micro_batch, T = options_.seq_len;
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor ids = at::full({B, T}, kPad, opts), labels = at::full({B, T}, kIgnore, opts);
  at::Tensor pos = at::zeros({B, T}, opts), seg = at::zeros({B, T}, opts);
  auto I = ids.accessor<int64_t, 2>();
  auto L = labels.accessor<int64_t, 2>();
  auto P = pos.accessor<int64_t, 2>();
  auto S = seg.accessor<int64_t, 2>();
  bool single = true;
  for (int64_t b = 0; b < B; ++b) {
    int64_t t = 0, segment = 0;
    for (;;) {
      if (!has_pending_) {
        pending_ = next_record();
        has_pending_ = true;
      }
      const int64_t len = static_cast<int64_t>(pending_.ids.size());
      if (t + len > T) break;  // starts the next row instead (len <= T after truncation)
      for (int64_t i = 0; i < len; ++i, ++t) {
        I[b][t] = pending_.ids[i];
        L[b][t] = pending_.labels[i];
        P[b][t] = i;
        S[b][t] = segment;
      }
      ++segment;
      has_pending_ = false;
      if (!options_.pack) break;
    }
    for (; t < T; ++t) S[b][t] = segment;  // padding: its own segment, no loss
    single = single && segment <= 1;
  }
  Batch batch{ids, labels, pos, seg};
  batch.single_segment_rows = single;
  return batch;
}

}  // namespace ft::data
