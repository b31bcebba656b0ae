#include "train/evaluate.h"

#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>

#include "core/error.h"
#include "core/host_alloc.h"
#include "cuda/device.h"
#include "cuda/loader.h"
#include "data/jsonl_source.h"
#include "model/cpu_math.h"
#include "model/decoder.h"
#include "model/fused_loss.h"
#include "model/lora.h"
#include "train/saved_model.h"
#include "train/trainer.h"
#include "train/weights.h"

namespace ft::train {

nlohmann::json EvalResult::to_json() const {
  return {{"loss", loss},
          {"tokens", tokens},
          {"perplexity", perplexity},
          {"records", records},
          {"windowed_records", windowed},
          {"windows", windows},
          {"forwards", forwards},
          {"padding_tokens", padding},
          {"device", device}};
}

std::unique_ptr<data::JsonlSource> open_eval_source(const config::DataSettings& data,
                                                    const std::string& path,
                                                    const std::string& tokenizer_path,
                                                    const std::string& model_dir,
                                                    int64_t vocab_size) {
  data::JsonlOptions jo = data::jsonl_options(data);
  jo.path = path;
  jo.tokenizer_path = tokenizer_path;
  if (!jo.tokenizer_path.empty())
    jo.tokenizer = data::open_tokenizer(jo.tokenizer_path, vocab_size, model_dir);
  jo.vocab_size = vocab_size;
  jo.on_bad_record = data::BadRecordPolicy::kError;
  jo.model_dir = model_dir;
  return std::make_unique<data::JsonlSource>(jo);
}

EvalSet make_eval_set(const data::JsonlSource& source, const config::EvalSettings& eval,
                      int64_t seq_len) {
  std::vector<EvalRecord> all;
  for (int64_t i = 0; i < source.num_records(); ++i) all.push_back({&source, i});
  return make_eval_set(all, eval, seq_len);
}

EvalSet make_eval_set(const std::vector<EvalRecord>& chosen, const config::EvalSettings& eval,
                      int64_t seq_len, bool skip_malformed) {
  const int64_t T = seq_len;
  // Every record, whole, in the given order; then its windows of at most T tokens. Window k of a
  // record starts at token k (T - 1): it overlaps the previous one by one token, whose label the
  // loss's shift ignores there, so every token carries its loss in exactly one window.
  EvalSet set;
  set.records = static_cast<int64_t>(chosen.size());
  std::vector<data::TokenizedRecord> records(chosen.size());
  std::vector<std::string> origins(records.size());
  std::vector<char> malformed(records.size(), 0);
  // Chunk by chunk in file order: a compressed file is read forward, never from its start again.
  constexpr int64_t kChunk = 4096;
  for (int64_t begin = 0; begin < set.records; begin += kChunk) {
    at::parallel_for(begin, std::min(set.records, begin + kChunk), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        try {
          records[i] = chosen[i].source->tokenize_whole(chosen[i].record, &origins[i]);
        } catch (const FormatError&) {
          if (!skip_malformed) throw;
          malformed[i] = 1;  // no tokens: no piece, no loss
        }
      }
    });
  }
  set.records -= std::count(malformed.begin(), malformed.end(), 1);
  for (size_t i = 0; i < origins.size(); ++i)
    if (!malformed[i]) set.origins.push_back(origins[i]);
  struct Piece {
    const data::TokenizedRecord* record;
    int64_t begin, length;
  };
  std::vector<Piece> pieces;
  for (size_t i = 0; i < records.size(); ++i) {
    if (malformed[i]) continue;
    const int64_t n = static_cast<int64_t>(records[i].ids.size());
    if (n <= T) {
      pieces.push_back({&records[i], 0, n});
      continue;
    }
    FT_CHECK_T(FormatError, eval.long_records == "window", origins[i], ": the record has ", n,
               " tokens, more than data.seq_len=", T,
               " (eval.long_records=refuse); set a larger data.seq_len or "
               "eval.long_records=window to score it in windows of seq_len tokens");
    ++set.windowed;
    for (int64_t begin = 0;; begin += T - 1) {
      pieces.push_back({&records[i], begin, std::min(T, n - begin)});
      ++set.windows;
      if (begin + T >= n) break;
    }
  }
  // Longest first: each batch pads only to its first piece's length.
  std::stable_sort(pieces.begin(), pieces.end(),
                   [](const Piece& a, const Piece& b) { return a.length > b.length; });
  const auto opts = at::TensorOptions().dtype(at::kLong);
  for (size_t first = 0; first < pieces.size();) {
    const int64_t len = std::max<int64_t>(pieces[first].length, 1);
    const int64_t rows = std::clamp<int64_t>(eval.batch_tokens / len, 1,
                                             static_cast<int64_t>(pieces.size() - first));
    at::Tensor ids = at::zeros({rows, len}, opts), labels = at::full({rows, len}, -100, opts);
    at::Tensor pos = at::zeros({rows, len}, opts), seg = at::zeros({rows, len}, opts);
    auto I = ids.accessor<int64_t, 2>();
    auto L = labels.accessor<int64_t, 2>();
    auto P = pos.accessor<int64_t, 2>();
    auto S = seg.accessor<int64_t, 2>();
    int64_t tokens = 0;
    for (int64_t row = 0; row < rows; ++row) {
      const Piece& p = pieces[first + static_cast<size_t>(row)];
      for (int64_t t = 0; t < p.length; ++t) {
        I[row][t] = p.record->ids[static_cast<size_t>(p.begin + t)];
        L[row][t] = p.record->labels[static_cast<size_t>(p.begin + t)];
        P[row][t] = t;
      }
      for (int64_t t = p.length; t < len; ++t) S[row][t] = 1;  // padding: after, never attended
      set.padding += len - p.length;
      tokens += p.length;
    }
    data::Batch b{ids, labels, pos, seg};
    b.single_segment_rows = true;  // one piece per row, padding after it: causal is exact
    set.batches.push_back(std::move(b));
    set.tokens.push_back(tokens);
    first += static_cast<size_t>(rows);
  }
  return set;
}

BatchLoss score_batch(const model::DecoderModel& model, const data::Batch& b) {
  at::NoGradGuard no_grad;
  // The head and the loss chunk by chunk: a batch of eval.batch_tokens never holds its logits.
  model::LossSum ls = model::chunked_lm_loss_sum(
      model.hidden_states(b.input_ids, b.position_ids, /*training=*/false, b.attention_segments()),
      model.lm_head(), b.labels, /*count_tokens=*/true, model::kLossChunkElements,
      /*blocks=*/nullptr, /*hooks=*/nullptr, model.logit_map());
  return {ls.sum.item<double>(), ls.tokens};
}

model::FusedOps eval_fused_ops(const config::TrainSettings& train,
                               const config::EvalSettings& eval) {
  return eval.fused_kernels ? fused_ops(train) : model::FusedOps{false, false, false, false};
}

namespace {

// The model of --model (with the NF4 base asked for, and the --adapter) in fp32 on `device`.
std::unique_ptr<model::DecoderModel> load_eval_model(const EvalOptions& o, model::ModelConfig& mc,
                                                     const at::Device& device) {
  mc = model::load_model_config(o.model_dir + "/config.json");
  ask_base_quant(o.lora, o.model_dir + "/config.json", mc);
  BaseWeights weights(o.model_dir, mc, model_param_shapes(mc), /*seed=*/0);
  auto model = std::make_unique<model::DecoderModel>(
      mc, at::TensorOptions().dtype(at::kFloat).device(device));
  model->set_fused_ops(o.fused);
  model->set_moe_grouped_mm(o.moe_grouped_mm);
  // (The weights are read into the device's tensors through a host buffer.)
  model->load([&](const std::string& name, at::Tensor& dst) { weights.copy_to(name, dst); });
  if (!o.adapter_dir.empty()) {
    model::LoraConfig lc = model::load_lora_config(o.adapter_dir + "/adapter_config.json");
    lc.dropout = 0;  // evaluation
    model::attach_lora(*model, lc, 0);
    load_adapter(*model, o.adapter_dir);
  }
  return model;
}

}  // namespace

EvalResult evaluate(const EvalOptions& o) {
  model::prime_cpu_math();  // see model/cpu_math.h
  FT_CHECK(!o.model_dir.empty(), "ft eval needs --model DIR");
  FT_CHECK(!o.data_path.empty(), "ft eval needs --data PATH (JSONL)");
  FT_CHECK(!o.data.synthetic(),
           "data.format synthetic cannot be evaluated from a file; set "
           "data.format to auto, text, alpaca, chat or tokenized");
  const cuda::DeviceChoice where = cuda::choose_device(o.device, 0);
  if (where.device.is_cuda()) cuda::use_device(where.device.index());
  model::ModelConfig mc;
  const std::unique_ptr<model::DecoderModel> loaded = load_eval_model(o, mc, where.device);
  const model::DecoderModel& model = *loaded;

  const auto source =
      open_eval_source(o.data, o.data_path, data::tokenizer_path_of(o.tokenizer_path, o.model_dir),
                       o.model_dir, mc.vocab_size);
  const EvalSet set = make_eval_set(*source, o.eval, o.data.seq_len);
  EvalResult r;
  r.device = where.device.str();
  r.records = set.records;
  r.windowed = set.windowed;
  r.windows = set.windows;
  r.padding = set.padding;
  double loss_sum = 0;
  int64_t total = 0, done = 0;  // tokens of the pieces, for the progress line
  for (int64_t t : set.tokens) total += t;
  const auto start = std::chrono::steady_clock::now();
  auto last_told = start;
  for (size_t i = 0; i < set.batches.size(); ++i) {
    BatchLoss l;
    {
      // A forward's layers allocate the same sizes one after another: the step pool hands the
      // blocks on (core/host_alloc.h); they are unmapped before a batch of another shape.
      const core::StepPoolScope keep_blocks;
      l = score_batch(model, set.batches[i].to(where.device));
    }
    if (i + 1 == set.batches.size() ||
        set.batches[i + 1].input_ids.sizes() != set.batches[i].input_ids.sizes())
      core::release_step_pool();
    loss_sum += l.sum;
    r.tokens += l.tokens;
    ++r.forwards;
    done += set.tokens[i];
    const auto now = std::chrono::steady_clock::now();
    if (now - last_told >= std::chrono::seconds(10) && i + 1 < set.batches.size()) {
      const double secs = std::chrono::duration<double>(now - start).count();
      fmt::print(
          stderr,
          "ft eval: {} of {} tokens scored ({:.0f}%), {:.0f} tokens/s, about {:.0f} s left\n", done,
          total, 100.0 * done / total, done / secs, (total - done) * secs / done);
      last_told = now;
    }
  }
  FT_CHECK(r.tokens > 0, o.data_path, ": no token carries a loss (every record is prompt only?)");
  r.loss = loss_sum / static_cast<double>(r.tokens);
  r.perplexity = std::exp(r.loss);
  return r;
}

}  // namespace ft::train
