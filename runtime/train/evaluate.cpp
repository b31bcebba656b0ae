#include "train/evaluate.h"

#include <fmt/format.h>

#include <cmath>
#include <memory>

#include "core/error.h"
#include "data/jsonl_source.h"
#include "model/llama.h"
#include "model/lora.h"
#include "train/weights.h"

namespace ft::train {

nlohmann::json EvalResult::to_json() const {
  return {{"loss", loss},
          {"tokens", tokens},
          {"perplexity", perplexity},
          {"records", records},
          {"truncated", truncated}};
}

EvalResult evaluate(const EvalOptions& o) {
  FT_CHECK(!o.model_dir.empty(), "ft eval needs --model DIR");
  FT_CHECK(!o.data_path.empty(), "ft eval needs --data PATH (JSONL)");
  FT_CHECK(!o.data.synthetic(),
           "data.format synthetic cannot be evaluated from a file; set "
           "data.format to auto, text, alpaca, chat or tokenized");

  model::LlamaConfig mc = model::load_llama_config(o.model_dir + "/config.json");
  BaseWeights weights(o.model_dir, mc, model_param_shapes(mc), /*seed=*/0);
  model::LlamaModel model(mc, at::TensorOptions().dtype(at::kFloat));
  model.load([&](const std::string& name, at::Tensor& dst) { weights.copy_to(name, dst); });
  if (!o.adapter_dir.empty()) {
    model::LoraConfig lc = model::load_lora_config(o.adapter_dir + "/adapter_config.json");
    lc.dropout = 0;  // evaluation
    model::attach_lora(model, lc, 0);
    load_adapter(model, o.adapter_dir);
  }

  data::JsonlOptions jo = data::jsonl_options(o.data);
  jo.path = o.data_path;
  jo.tokenizer_path = o.tokenizer_path.empty() ? o.model_dir + "/tokenizer.json" : o.tokenizer_path;
  jo.tokenizer = data::open_tokenizer(jo.tokenizer_path, mc.vocab_size, "");
  // One record per row and one row per batch: every record is read exactly once, none twice.
  jo.micro_batch = 1;
  jo.pack = false;
  jo.on_bad_record = data::BadRecordPolicy::kError;
  jo.model_dir = o.model_dir;
  data::JsonlSource source(jo);

  at::NoGradGuard no_grad;
  double loss_sum = 0;
  EvalResult r;
  r.records = source.num_records();
  for (int64_t i = 0; i < r.records; ++i) {
    data::Batch b = source.next();
    model::LossSum ls = model::causal_lm_loss_sum(
        model.forward(b.input_ids, b.position_ids, false, b.attention_segments()), b.labels);
    loss_sum += ls.sum.item<double>();
    r.tokens += ls.tokens;
  }
  FT_CHECK(r.tokens > 0, o.data_path, ": no token carries a loss (every record is prompt only?)");
  r.loss = loss_sum / static_cast<double>(r.tokens);
  r.perplexity = std::exp(r.loss);
  r.truncated = source.truncated();
  return r;
}

}  // namespace ft::train
