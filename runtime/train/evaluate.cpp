#include "train/evaluate.h"

#include <fmt/format.h>

#include <cmath>
#include <memory>

#include "core/error.h"
#include "data/jsonl_source.h"
#include "io/safetensors.h"
#include "model/llama.h"
#include "model/lora.h"
#include "tokenizer/tokenizer.h"

namespace ft::train {

nlohmann::json EvalResult::to_json() const {
  return {{"loss", loss},
          {"tokens", tokens},
          {"perplexity", perplexity},
          {"records", records},
          {"truncated", truncated}};
}

EvalResult evaluate(const EvalOptions& o) {
  const auto& p = o.preset;
  FT_CHECK(!o.model_dir.empty(), "ft eval needs --model DIR");
  FT_CHECK(!o.data_path.empty(), "ft eval needs --data PATH (JSONL)");
  const std::string format = p["data"]["format"];
  FT_CHECK(format != "synthetic",
           "data.format synthetic cannot be evaluated from a file; set "
           "data.format to auto, text, alpaca, chat or tokenized");

  model::LlamaConfig mc = model::load_llama_config(o.model_dir + "/config.json");
  auto weights = io::SafetensorsIndex::open(o.model_dir);
  model::LlamaModel model(mc, at::TensorOptions().dtype(at::kFloat));
  model.load([&](const std::string& name, at::Tensor& dst) {
    FT_CHECK_T(FormatError, weights.has(name), o.model_dir, ": weight \"", name,
               "\" is missing from the model files");
    weights.copy_to(name, dst);
  });
  if (!o.adapter_dir.empty()) {
    model::LoraConfig lc = model::load_lora_config(o.adapter_dir + "/adapter_config.json");
    lc.dropout = 0;  // evaluation
    model::attach_lora(model, lc, 0);
    auto adapter = io::SafetensorsFile::open(o.adapter_dir + "/adapter_model.safetensors");
    for (auto& t : model::lora_parameters(model)) {
      FT_CHECK_T(FormatError, adapter.has(t.name), o.adapter_dir, "/adapter_model.safetensors: \"",
                 t.name, "\" is missing (adapter for another model or other target modules?)");
      adapter.copy_to(t.name, *t.tensor);
    }
  }

  data::JsonlOptions jo;
  jo.path = o.data_path;
  jo.tokenizer_path = o.tokenizer_path.empty() ? o.model_dir + "/tokenizer.json" : o.tokenizer_path;
  jo.tokenizer = std::make_shared<const tokenizer::Tokenizer>(
      tokenizer::Tokenizer::from_file(jo.tokenizer_path));
  FT_CHECK(static_cast<int64_t>(jo.tokenizer->vocab_size()) <= mc.vocab_size, "the tokenizer ",
           jo.tokenizer_path, " has ", jo.tokenizer->vocab_size(),
           " tokens but the model's vocabulary is ", mc.vocab_size);
  jo.format = data::parse_record_format(format == "tokenized" ? "tokens" : format);
  jo.chat_template = data::parse_chat_template(p["data"]["template"].get<std::string>());
  jo.seq_len = p["data"]["seq_len"];
  jo.train_on_prompt = p["data"]["train_on_prompt"];
  // One record per row and one row per batch: every record is read exactly once, none twice.
  jo.micro_batch = 1;
  jo.pack = false;
  jo.on_bad_record = data::BadRecordPolicy::kError;
  data::JsonlSource source(jo);

  at::NoGradGuard no_grad;
  double loss_sum = 0;
  EvalResult r;
  r.records = source.num_records();
  for (int64_t i = 0; i < r.records; ++i) {
    data::Batch b = source.next();
    model::LossSum ls = model::causal_lm_loss_sum(
        model.forward(b.input_ids, b.position_ids, false, b.segment_ids), b.labels);
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
