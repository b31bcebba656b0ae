#include "train/optimizer.h"

namespace ft::train {

bool AdamW::no_decay(const std::string& name) {
  auto ends_with = [&](const char* s) {
    std::string suf = s;
    return name.size() >= suf.size() &&
           name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  return name.find("norm") != std::string::npos || ends_with(".bias");
}

namespace {
std::vector<AdamW::Param> by_name(const std::vector<std::pair<std::string, at::Tensor>>& params) {
  std::vector<AdamW::Param> out;
  for (const auto& [name, t] : params) out.push_back({t, !AdamW::no_decay(name)});
  return out;
}
}  // namespace

AdamW::AdamW(const std::vector<std::pair<std::string, at::Tensor>>& params, AdamWOptions options)
    : AdamW(by_name(params), options) {}

AdamW::AdamW(const std::vector<Param>& params, AdamWOptions options) : options_(options) {
  groups_.push_back({options.weight_decay, {}, {}, {}, {}});
  groups_.push_back({0.0, {}, {}, {}, {}});
  for (const auto& [p, decay] : params) {
    Group& g = groups_[decay ? 0 : 1];
    where_.emplace_back(decay ? 0 : 1, g.params.size());
    g.params.push_back(p);
    g.exp_avg.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    g.exp_avg_sq.push_back(at::zeros_like(p, at::MemoryFormat::Contiguous));
    g.steps.push_back(at::zeros({}, p.options().dtype(at::kFloat)));
  }
}

void AdamW::step(double lr) {
  at::NoGradGuard no_grad;
  ++steps_;
  for (auto& g : groups_) {
    if (g.params.empty()) continue;
    std::vector<at::Tensor> grads;
    grads.reserve(g.params.size());
    for (auto& p : g.params) grads.push_back(p.grad());
    at::_foreach_add_(g.steps, 1);
    at::_fused_adamw_(g.params, grads, g.exp_avg, g.exp_avg_sq, /*max_exp_avg_sqs=*/{}, g.steps, lr,
                      options_.beta1, options_.beta2, g.weight_decay, options_.eps,
                      /*amsgrad=*/false, /*maximize=*/false);
  }
}

void AdamW::set_steps(int64_t steps) {
  steps_ = steps;
  for (auto& g : groups_)
    for (auto& t : g.steps) t.fill_(static_cast<double>(steps));
}

int64_t AdamW::state_bytes() const {
  int64_t b = 0;
  for (const auto& g : groups_)
    for (size_t i = 0; i < g.params.size(); ++i)
      b += g.exp_avg[i].nbytes() + g.exp_avg_sq[i].nbytes() + g.steps[i].nbytes();
  return b;
}

}  // namespace ft::train
