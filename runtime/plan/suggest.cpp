#include "plan/suggest.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace ft::plan {

namespace {

// Combinations of at most this many changes are tried, and at most kMaxCombinedPlans of them
// re-planned (each is a whole plan: a few ms for a 70B model), so a refusal stays quick.
constexpr size_t kMaxCombined = 3;
constexpr int kMaxCombinedPlans = 200;

// One change to the settings: what it is, the --set arguments that make it, and the edit itself.
struct Change {
  std::string what;
  std::vector<std::string> sets;
  std::function<void(config::Settings&)> apply;
};

// The suggestions of one plan, in the order they are tried. Every change is planned on a copy of
// the job's inputs; the single changes that were planned and do not fit are kept for combining.
class Suggester {
 public:
  Suggester(const PlanInputs& in, Plan& p) : in_(in), p_(p) {}

  void activations();
  void sharding();
  void precision_and_lora();
  void combinations();
  void nodes();

 private:
  bool try_change(Change c);
  bool try_combination(const std::vector<size_t>& picked, int& plans);

  const PlanInputs& in_;
  Plan& p_;
  std::vector<Change> unfit_;  // single changes that were planned and do not fit alone
};

// `in` with the change, re-planned, as a suggestion of `p`; whether it fits (false, and no
// suggestion, when the change is one this job cannot take: a knob the layout refuses).
bool Suggester::try_change(Change c) {
  PlanInputs v = in_;
  c.apply(v.settings);
  v.settings.strategy.user_keys.clear();
  try {
    const Plan q = make_plan(v, false);
    p_.suggestions.push_back({c.what, c.sets, 0, q.device_peak, q.host_peak, q.fits()});
  } catch (const Error&) {
    return false;  // not a suggestion: the change is one this job cannot take
  }
  if (p_.suggestions.back().fits) return true;
  unfit_.push_back(std::move(c));
  return false;
}

// Less activation memory: checkpointing every layer, then smaller micro-batches with more
// accumulation (the same global batch) until one fits.
void Suggester::activations() {
  const config::Settings& s = in_.settings;
  if (s.train.activation_checkpointing != "full")
    try_change({"activation checkpointing of every layer",
                {"train.activation_checkpointing=full"},
                [](config::Settings& v) { v.train.activation_checkpointing = "full"; }});
  for (int64_t mb = s.train.micro_batch / 2; mb >= 1; mb /= 2) {
    if (s.train.micro_batch % mb != 0) continue;
    const int64_t ga = s.train.grad_accum * (s.train.micro_batch / mb);
    const bool fits = try_change(
        {fmt::format("micro-batch {} with {} accumulation steps (same global batch)", mb, ga),
         {fmt::format("train.micro_batch={}", mb), fmt::format("train.grad_accum={}", ga)},
         [=](config::Settings& v) {
           v.train.micro_batch = mb;
           v.train.grad_accum = ga;
         }});
    if (fits) break;
  }
}

// Less model state per rank: sharding everything, then offloading it to host memory (GPUs).
void Suggester::sharding() {
  const config::StrategySettings& st = in_.settings.strategy;
  const bool many = in_.layout.world() > 1;
  if (many &&
      (st.kind == "ddp" || (st.kind == "fsdp" && st.fsdp.sharding_strategy != "FULL_SHARD")))
    try_change({"fsdp FULL_SHARD instead of " + st.kind,
                {"strategy.kind=fsdp", "strategy.fsdp.sharding_strategy=FULL_SHARD"},
                [](config::Settings& v) {
                  v.strategy.kind = "fsdp";
                  v.strategy.fsdp.sharding_strategy = "FULL_SHARD";
                }});
  if (!in_.layout.gpu || !many) return;
  if (st.kind == "fsdp" && !st.fsdp.cpu_offload)
    try_change(
        {"fsdp cpu_offload (parameter shards, masters, gradients and optimizer state in "
         "host memory)",
         {"strategy.fsdp.cpu_offload=true"},
         [](config::Settings& v) { v.strategy.fsdp.cpu_offload = true; }});
  if (st.kind != "fsdp" && !st.zero3.offload_optimizer)
    try_change({"zero3 with the optimizer offloaded to host memory",
                {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true"},
                [](config::Settings& v) {
                  v.strategy.kind = "zero3";
                  v.strategy.zero3.offload_optimizer = true;
                }});
  if (st.kind != "fsdp" && !st.zero3.offload_param)
    try_change({"zero3 with the optimizer and the parameter shards offloaded to host memory",
                {"strategy.kind=zero3", "strategy.zero3.offload_optimizer=true",
                 "strategy.zero3.offload_param=true"},
                [](config::Settings& v) {
                  v.strategy.kind = "zero3";
                  v.strategy.zero3.offload_optimizer = true;
                  v.strategy.zero3.offload_param = true;
                }});
}

// Fewer bytes per parameter, or far fewer trained parameters.
void Suggester::precision_and_lora() {
  const config::Settings& s = in_.settings;
  if (s.precision.mode == "fp32" || s.precision.mode == "fp64")
    try_change({"bf16 compute with fp32 masters", {"precision.mode=bf16"}, [](config::Settings& v) {
                  v.precision.mode = "bf16";
                }});
  if (!s.lora.enabled)
    try_change(
        {"LoRA (r=16) instead of a full fine-tune", {"lora.enabled=true"}, [](config::Settings& v) {
           v.lora.enabled = true;
           if (v.lora.r <= 0) v.lora.r = 16;
         }});
  // QLoRA: the frozen base's projections in NF4 (a quarter of bf16's bytes); where that alone
  // does not fit a sharded GPU job, with fsdp's parameter shards in host memory as well.
  if (s.lora.quantize_base == "nf4" || p_.nf4_parameters > 0 || s.precision.mode == "fp64") return;
  std::vector<std::string> sets = {"lora.quantize_base=nf4"};
  if (!s.lora.enabled) sets.insert(sets.begin(), "lora.enabled=true");
  const std::string what = std::string(s.lora.enabled ? "" : "LoRA (r=16) with ") +
                           "QLoRA's NF4 base (the frozen projections in 4 bits)";
  auto qlora = [](config::Settings& v) {
    v.lora.enabled = true;
    if (v.lora.r <= 0) v.lora.r = 16;
    v.lora.quantize_base = "nf4";
  };
  if (try_change({what, sets, qlora}) || !in_.layout.gpu || in_.layout.world() == 1 ||
      s.strategy.kind != "fsdp" || s.strategy.fsdp.cpu_offload)
    return;
  sets.push_back("strategy.fsdp.cpu_offload=true");
  try_change({what + " and fsdp cpu_offload (the shards in host memory)", sets,
              [qlora](config::Settings& v) {
                qlora(v);
                v.strategy.fsdp.cpu_offload = true;
              }});
}

// The changes `picked` together, re-planned, as one suggestion when they fit. Changes that set one
// key to two values (two micro-batch sizes; fsdp and zero3) do not combine, nor a change whose
// --set arguments another's already hold (zero3's two offloads, LoRA and QLoRA).
bool Suggester::try_combination(const std::vector<size_t>& picked, int& plans) {
  std::map<std::string, std::string> values;
  std::vector<std::string> sets;
  for (const size_t i : picked) {
    for (const size_t j : picked) {
      const auto& a = unfit_[i].sets;
      const auto& b = unfit_[j].sets;
      if (i != j && std::all_of(a.begin(), a.end(), [&](const std::string& x) {
            return std::find(b.begin(), b.end(), x) != b.end();
          }))
        return false;
    }
    for (const std::string& set : unfit_[i].sets) {
      const size_t eq = set.find('=');
      const std::string key = set.substr(0, eq), value = set.substr(eq + 1);
      const auto [at, added] = values.emplace(key, value);
      if (!added && at->second != value) return false;
      if (added) sets.push_back(set);
    }
  }
  if (++plans > kMaxCombinedPlans) return false;
  PlanInputs v = in_;
  std::string what;
  for (const size_t i : picked) {
    unfit_[i].apply(v.settings);
    what += (what.empty() ? "" : " + ") + unfit_[i].what;
  }
  v.settings.strategy.user_keys.clear();
  try {
    const Plan q = make_plan(v, false);
    if (!q.fits()) return false;
    p_.suggestions.push_back(
        {what, sets, 0, q.device_peak, q.host_peak, true, static_cast<int>(picked.size())});
    return true;
  } catch (const Error&) {
    return false;  // together they make a job the layout refuses
  }
}

// When no single change fits: the fewest changes that fit together (two, then three), the first
// such set in the order the changes were tried (cheapest first: checkpointing and smaller
// micro-batches before sharding, offload, precision and LoRA).
void Suggester::combinations() {
  for (const auto& g : p_.suggestions)
    if (g.fits) return;
  int plans = 0;
  std::vector<size_t> picked;
  // Every k-subset of unfit_ in lexicographic order; true once one fits.
  std::function<bool(size_t, size_t)> pick = [&](size_t from, size_t k) {
    if (picked.size() == k) return try_combination(picked, plans);
    for (size_t i = from; i < unfit_.size(); ++i) {
      picked.push_back(i);
      const bool found = pick(i + 1, k);
      picked.pop_back();
      if (found) return true;
    }
    return false;
  };
  for (size_t k = 2; k <= std::min(kMaxCombined, unfit_.size()); ++k)
    if (pick(0, k)) return;
}

// The fewest nodes that fit: double until one fits, then halve the gap.
void Suggester::nodes() {
  auto fits_on = [&](int n) {
    PlanInputs v = in_;
    v.layout.nnodes = n;
    try {
      return make_plan(v, false);
    } catch (const Error&) {
      return Plan();
    }
  };
  int lo = in_.layout.nnodes, hi = 0;
  for (int n = std::max(2, 2 * in_.layout.nnodes); n <= 4096; n *= 2) {
    const Plan q = fits_on(n);
    if (q.fits() && !q.checks.empty()) {
      hi = n;
      break;
    }
    lo = n;
  }
  if (hi == 0) return;
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    const Plan q = fits_on(mid);
    if (!q.checks.empty() && q.fits())
      hi = mid;
    else
      lo = mid;
  }
  const Plan q = fits_on(hi);
  p_.suggestions.push_back(
      {fmt::format("{} nodes of {} rank(s) (the fewest that fit)", hi, in_.layout.nproc_per_node),
       {},
       hi,
       q.device_peak,
       q.host_peak,
       true,
       0});
}

}  // namespace

void add_suggestions(const PlanInputs& in, Plan& p) {
  Suggester s(in, p);
  s.activations();
  s.sharding();
  s.precision_and_lora();
  s.combinations();
  s.nodes();
}

}  // namespace ft::plan
