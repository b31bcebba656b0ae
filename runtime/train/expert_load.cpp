#include "train/expert_load.h"

#include <fmt/format.h>

#include <algorithm>

namespace ft::train {

std::vector<LayerLoad> layer_loads(const std::vector<int64_t>& tokens,
                                   const std::vector<int64_t>& layers) {
  std::vector<LayerLoad> out;
  if (layers.empty() || tokens.empty()) return out;
  const size_t E = tokens.size() / layers.size();
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto first = tokens.begin() + static_cast<std::ptrdiff_t>(l * E);
    const auto last = first + static_cast<std::ptrdiff_t>(E);
    LayerLoad ll;
    ll.layer = layers[l];
    const auto most = std::max_element(first, last), least = std::min_element(first, last);
    ll.max = *most;
    ll.min = *least;
    ll.most = most - first;
    ll.least = least - first;
    int64_t sum = 0;
    for (auto it = first; it != last; ++it) sum += *it;
    ll.mean = static_cast<double>(sum) / static_cast<double>(E);
    out.push_back(ll);
  }
  return out;
}

nlohmann::json moe_record(double aux_loss, const std::vector<int64_t>& tokens,
                          const std::vector<int64_t>& layers) {
  nlohmann::json per_layer = nlohmann::json::array(), picks = nlohmann::json::array();
  const size_t E = layers.empty() ? 0 : tokens.size() / layers.size();
  for (const LayerLoad& l : layer_loads(tokens, layers)) {
    per_layer.push_back({{"layer", l.layer},
                         {"max", l.max},
                         {"mean", l.mean},
                         {"min", l.min},
                         {"most", l.most},
                         {"least", l.least},
                         {"imbalance", l.imbalance()}});
    const auto first = tokens.begin() + static_cast<std::ptrdiff_t>(picks.size() * E);
    picks.push_back(std::vector<int64_t>(first, first + static_cast<std::ptrdiff_t>(E)));
  }
  return {{"aux_loss", aux_loss}, {"layers", per_layer}, {"expert_tokens", picks}};
}

std::string ExpertWatch::observe(int64_t step, const std::vector<int64_t>& tokens,
                                 const std::vector<int64_t>& layers, double aux_coef) {
  if (tokens.empty() || layers.empty()) return "";
  idle_.resize(tokens.size(), 0);
  const size_t E = tokens.size() / layers.size();
  for (size_t i = 0; i < tokens.size(); ++i) {
    idle_[i] = tokens[i] == 0 ? idle_[i] + 1 : 0;
    if (warned_ || idle_[i] < steps_) continue;
    warned_ = true;
    const std::string fix = aux_coef > 0
                                ? fmt::format("raise moe.aux_loss_coef (now {:g})", aux_coef)
                                : "turn the load-balancing loss on (--set moe.aux_loss=on)";
    return fmt::format(
        "warning: step {}: expert {} of layer {} has received no token for {} steps in a row "
        "(moe.collapse_steps): its router has collapsed, and that layer computes with fewer "
        "experts than it has; {}, or lower train.lr. Said once per run; metrics.jsonl's moe "
        "records every expert's tokens per step",
        step, i % E, layers[i / E], idle_[i], fix);
  }
  return "";
}

}  // namespace ft::train
