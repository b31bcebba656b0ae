#include "data/jsonl_source.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <filesystem>
#include <numeric>

#include "core/error.h"
#include "data/packer.h"
#include "data/token_cache.h"
#include "tokenizer/tokenizer.h"

namespace ft::data {
namespace {

constexpr int64_t kIgnore = -100;
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

uint64_t splitmix64(uint64_t x) { return mix(x); }

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
                                                           const std::string& model_dir) {
  auto t = std::make_shared<const tokenizer::Tokenizer>(tokenizer::Tokenizer::from_file(path));
  const auto tokens = static_cast<int64_t>(t->vocab_size());
  if (tokens <= model_vocab_size) return t;
  // What to do depends on where the vocabulary came from: a --model's shape is its config.json,
  // which --set model.vocab_size may not change; a preset's shape is the preset's to change.
  const std::string own = model_dir.empty() ? "" : tokenizer_path_of("", model_dir);
  std::string what;
  if (model_dir.empty())
    what = fmt::format(
        "the preset's model.vocab_size); use the tokenizer the model was made for, or give the "
        "preset's model room for every token with --set model.vocab_size={}",
        tokens);
  else if (std::error_code ec; !own.empty() && std::filesystem::equivalent(own, path, ec))
    what = fmt::format(
        "{}/config.json); the model directory's tokenizer.json and config.json disagree: "
        "replace one with the file the model was published with",
        model_dir);
  else
    what = fmt::format("{}/config.json); use the model's own tokenizer{}", model_dir,
                       own.empty() ? " (the one it was trained with)"
                                   : fmt::format(": drop --tokenizer and ft reads {}", own));
  throw ConfigError(
      fmt::format("the tokenizer {} has {} tokens but the model's vocabulary is {} ({}", path,
                  tokens, model_vocab_size, what));
}

JsonlOptions jsonl_options(const config::DataSettings& data) {
  JsonlOptions o;
  o.format = parse_record_format(data.format);
  o.shape = record_shape(data.shape);
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
  FT_CHECK(o.max_records >= 0, "data: max_records must be >= 0, got ", o.max_records);
  FT_CHECK_T(FormatError, file_->size() > 0, o.path, ": no records (",
             std::string(file_->kind()).find("JSONL") != std::string::npos
                 ? "the file has no non-empty lines"
                 : std::string("the ") + file_->kind() + " data has no rows",
             ")");
  used_ = o.max_records > 0 ? std::min(o.max_records, file_->size()) : file_->size();
  if (format_ == RecordFormat::kAuto)
    format_ = detect_format(file_->read(0), file_->origin(0), o.shape);
  FT_CHECK(tokenizer_ || format_ == RecordFormat::kTokens, "--data ", o.path, " holds ",
           name_of(format_),
           " records, which need a tokenizer to become token ids: give --tokenizer "
           "PATH/tokenizer.json, or a --model directory that holds tokenizer.json (pre-tokenized "
           "records, {\"input_ids\": [...]}, need none)");
  resolve_template();
  // The template's own tokens, where records are rendered with it.
  if (is_conversation(format_)) {
    for (const std::string& t : template_special_tokens(o.chat_template)) {
      FT_CHECK(tokenizer_->token_to_id(t).has_value(), "data.template '", name_of(o.chat_template),
               "' writes ", t, ", which is not a token of the tokenizer",
               o.tokenizer_path.empty() ? "" : " " + o.tokenizer_path,
               ": choose the template of the model's family");
    }
  }
  FT_CHECK(!(template_from_auto_ && o.chat_template == ChatTemplate::kNone &&
             format_ != RecordFormat::kAlpaca && is_conversation(format_)),
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
  const bool conversation = is_conversation(format_);
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
  const bool conversation = is_conversation(format_);
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
  const int64_t n = train_records();
  order_.resize(static_cast<size_t>(n));
  std::iota(order_.begin(), order_.end(), 0);
  uint64_t state = mix(options_.seed ^ mix(static_cast<uint64_t>(epoch) + 1));
  for (int64_t i = n - 1; i > 0; --i) {  // Fisher-Yates
    state = mix(state);
    std::swap(order_[i], order_[state % static_cast<uint64_t>(i + 1)]);
  }
  // Positions among the trained records become file indices (the same order as before any
  // record was held out when none is).
  if (!trained_.empty())
    for (int64_t& r : order_) r = trained_[static_cast<size_t>(r)];
  order_epoch_ = epoch;
  return order_;
}

void JsonlSource::hold_out(int64_t count, uint64_t salt) {
  FT_CHECK(count >= 0 && count < used_, "eval.split holds out ", count, " of the ", used_,
           " records of ", options_.path,
           ", which leaves none to train on: hold out fewer (a smaller eval.split)");
  // A partial Fisher-Yates of its own stream (salted apart from every epoch's order).
  std::vector<int64_t> all(static_cast<size_t>(used_));
  std::iota(all.begin(), all.end(), 0);
  uint64_t state = mix(options_.seed ^ mix(salt ^ 0x686f6c646f7574ull));  // "holdout"
  for (int64_t i = 0; i < count; ++i) {
    state = mix(state);
    const uint64_t span = static_cast<uint64_t>(used_ - i);
    std::swap(all[static_cast<size_t>(i)], all[static_cast<size_t>(i + state % span)]);
  }
  held_out_.assign(all.begin(), all.begin() + count);
  std::sort(held_out_.begin(), held_out_.end());
  trained_.clear();
  if (count > 0) {
    std::vector<bool> out(static_cast<size_t>(used_), false);
    for (int64_t r : held_out_) out[static_cast<size_t>(r)] = true;
    for (int64_t r = 0; r < used_; ++r)
      if (!out[static_cast<size_t>(r)]) trained_.push_back(r);
  }
  order_epoch_ = -1;
}

int64_t JsonlSource::record_at(int64_t epoch, int64_t position) {
  FT_ASSERT(position >= 0 && position < train_records(), "position ", position);
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
  const Record parsed = parse_record(file_->read(record), format_, origin, options_.shape);
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

std::optional<TokenizedRecord> JsonlSource::take(int64_t record) {
  TokenizedRecord r;
  bool truncated = false;
  try {
    r = tokenize_at(record, &truncated);
  } catch (const FormatError& e) {
    if (options_.on_bad_record == BadRecordPolicy::kError)
      throw FormatError(detail::cat(e.what(), kSkipHint));
    ++skipped_;
    return std::nullopt;
  }
  if (r.ids.empty()) return std::nullopt;  // nothing to train on (an empty text, no BOS/EOS)
  if (truncated) ++truncated_;
  r.labels[0] = kIgnore;  // nothing before a record's first token predicts it
  return r;
}

TokenizedRecord JsonlSource::next_record() {
  const int64_t n = train_records();
  // A whole epoch of unusable records would loop forever: stop after one full pass of them.
  for (int64_t failures = 0;; ++failures) {
    FT_CHECK_T(FormatError, failures <= n, options_.path, ": no usable record in a whole epoch (",
               skipped_, " malformed records skipped)");
    const int64_t g = next_global_;
    next_global_ += options_.world_size;
    std::optional<TokenizedRecord> r = take(record_at(g / n, g % n));
    if (!r) continue;
    pending_global_ = g;
    return std::move(*r);
  }
}

JsonlSource::EpochScan JsonlSource::scan_epoch(
    const std::function<void(int64_t, int64_t)>& progress, AtMalformed at_malformed) {
  const int64_t n = used_, T = options_.seq_len;
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
  RowCount rows({options_.micro_batch, options_.seq_len, options_.pack});
  for (const int64_t record : order_of(0))
    if (record < records)
      rows.add(std::min<int64_t>(scan.tokens[static_cast<size_t>(record)], options_.seq_len));
  scan.rows = rows.rows();
  scan.row_tokens = rows.tokens();
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
  return pack_rows(
      {options_.micro_batch, options_.seq_len, options_.pack},
      [this]() -> const TokenizedRecord& {
        if (!has_pending_) {
          pending_ = next_record();
          has_pending_ = true;
        }
        return pending_;
      },
      [this] { has_pending_ = false; });
}

}  // namespace ft::data
