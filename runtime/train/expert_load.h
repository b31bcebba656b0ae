// How evenly a mixture-of-experts model's routers spread a step's tokens: per MoE layer the most,
// mean and least picks an expert received (all ranks) and which experts those were, for
// metrics.jsonl, the console and the report; and `ExpertWatch`, which names once per run an
// expert that has received no token for moe.collapse_steps steps in a row (its router has
// collapsed: the layer computes with fewer experts than it has). Pure logic over the step's
// counts (StepStats::expert_tokens). Not thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ft::train {

struct LayerLoad {
  int64_t layer = 0;  // the model's layer index
  int64_t max = 0, min = 0;
  double mean = 0;
  int64_t most = 0, least = 0;  // expert ids (the lowest id on a tie)
  double imbalance() const { return mean > 0 ? static_cast<double>(max) / mean : 0; }
};

// `tokens`: [layers.size()][E] flattened picks; `layers`: each MoE layer's model index.
std::vector<LayerLoad> layer_loads(const std::vector<int64_t>& tokens,
                                   const std::vector<int64_t>& layers);

// metrics.jsonl's "moe" object: aux_loss, per layer {layer, max, mean, min, most, least,
// imbalance}, and every expert's picks per layer.
nlohmann::json moe_record(double aux_loss, const std::vector<int64_t>& tokens,
                          const std::vector<int64_t>& layers);

class ExpertWatch {
 public:
  explicit ExpertWatch(int64_t steps) : steps_(steps) {}
  // One step's picks; the warning to print now ("" when none), at most one per run.
  std::string observe(int64_t step, const std::vector<int64_t>& tokens,
                      const std::vector<int64_t>& layers, double aux_coef);

 private:
  int64_t steps_;
  std::vector<int64_t> idle_;  // consecutive steps without a token, per (layer, expert)
  bool warned_ = false;
};

}  // namespace ft::train
