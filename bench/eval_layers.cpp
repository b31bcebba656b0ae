// What ft's forward computes, layer by layer, for comparison with transformers'
// (bench/eval_fidelity.py --layers-bin): each record of a pre-tokenized JSONL alone ([1, T], as
// transformers scores it), through ft eval's model code.
//   ft_bench_eval_layers --model DIR --data records.jsonl --out layers.safetensors
//       [--dtype fp32|fp64] [--fused-rms-norm|--fused-swiglu|--fused-rope 0|1] [--flash 0|1]
// Writes, per record r: "r.hidden.<i>" for i = 0 (the embeddings) to L (after the last layer),
// "r.norm" (after the final norm) and "r.loss_sum" for each loss path: "fused" (the chunked LM head
// and loss ft eval uses), "aten" (the logits whole, then ATen's cross-entropy, as before issue 16).
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/json.h"
#include "io/safetensors_writer.h"
#include "model/config.h"
#include "model/cpu_math.h"
#include "model/decoder.h"
#include "model/fused_loss.h"
#include "train/weights.h"

using namespace ft;

namespace {

// Keeps every unit's output of one forward.
class Recorder : public model::UnitHooks {
 public:
  std::vector<at::Tensor> outputs;
  void before_unit(int) override {}
  void after_unit(int, const at::Tensor& output) override { outputs.push_back(output.clone()); }
};

std::vector<std::vector<int64_t>> read_records(const std::string& path) {
  std::ifstream in(path);
  FT_CHECK(in, "cannot open ", path);
  std::vector<std::vector<int64_t>> out;
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) out.push_back(parse_json<Error>(line, path)["input_ids"]);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ft's forward, layer by layer"};
  std::string model_dir, data, out, dtype = "fp32";
  bool fused_norm = true, fused_swiglu = true, fused_rope = true, flash = true;
  app.add_option("--model", model_dir)->required();
  app.add_option("--data", data)->required();
  app.add_option("--out", out)->required();
  app.add_option("--dtype", dtype);
  app.add_option("--fused-rms-norm", fused_norm, "train.fused_rms_norm");
  app.add_option("--fused-swiglu", fused_swiglu, "train.fused_swiglu");
  app.add_option("--fused-rope", fused_rope, "train.fused_rope");
  app.add_option("--flash", flash, "0: SDPA's math kernel instead of flash attention for the CPU");
  CLI11_PARSE(app, argc, argv);
  model::prime_cpu_math();
  at::globalContext().setSDPUseFlash(flash);
  const model::ModelConfig mc = model::load_model_config(model_dir + "/config.json");
  train::BaseWeights weights(model_dir, mc, train::model_param_shapes(mc), 0);
  model::DecoderModel model(mc, at::TensorOptions().dtype(parse_dtype(dtype)));
  model.load([&](const std::string& name, at::Tensor& dst) { weights.copy_to(name, dst); });
  model.set_fused_ops({fused_norm, fused_swiglu, fused_rope});
  Recorder rec;
  model.set_unit_hooks(&rec);
  at::NoGradGuard no_grad;
  io::NamedTensors tensors;
  const auto records = read_records(data);
  for (size_t r = 0; r < records.size(); ++r) {
    const at::Tensor ids = at::tensor(records[r], at::kLong).unsqueeze(0);
    rec.outputs.clear();
    const at::Tensor h = model.hidden_states(ids, at::Tensor(), false, at::Tensor());
    for (size_t i = 0; i < rec.outputs.size(); ++i)
      tensors.emplace_back(fmt::format("{}.hidden.{}", r, i), rec.outputs[i]);
    tensors.emplace_back(fmt::format("{}.norm", r), h);
    const auto fused =
        model::chunked_lm_loss_sum(h, model.lm_head(), ids, true, model::kLossChunkElements,
                                   nullptr, nullptr, model.logit_map());
    tensors.emplace_back(fmt::format("{}.loss_sum.fused", r), fused.sum.to(at::kDouble));
    const auto aten = model::causal_lm_loss_sum(at::linear(h, model.lm_head()), ids);
    tensors.emplace_back(fmt::format("{}.loss_sum.aten", r), aten.sum.to(at::kDouble));
  }
  io::write_safetensors(out, tensors);
  return 0;
}
