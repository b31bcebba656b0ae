#include "parallel/units.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "model/decoder.h"

namespace ft::parallel {

int64_t UnitPlan::padded_elements() const {
  int64_t n = 0;
  for (const auto& g : groups) n += g.layout.padded;
  return n;
}

UnitsPlan plan_units(const std::vector<UnitParam>& params, const UnitsOptions& o,
                     int n_model_units) {
  const int S = o.shard_size;
  FT_ASSERT(S >= 1, "shard size ", S);
  UnitsPlan plan;
  plan.unit_of_model.assign(n_model_units, -1);
  auto add_member = [&](GroupPlan& g, size_t index) {
    g.members.push_back(index);
    g.offsets.push_back(g.layout.numel);
    g.layout.numel += params[index].numel;
  };
  auto group_in = [](UnitPlan& u, bool trained, bool decay, bool expert) -> GroupPlan& {
    for (auto& g : u.groups)
      if (g.expert == expert && g.trained == trained && (!trained || g.decay == decay)) return g;
    u.groups.emplace_back();
    u.groups.back().trained = trained;
    u.groups.back().decay = decay;
    u.groups.back().expert = expert;
    return u.groups.back();
  };
  const bool model_units = !o.buckets && S > 1;
  // Experts sharded in their layer's unit (over the ranks holding the same experts), or whole.
  auto sharded_expert = [&](const UnitParam& p) {
    return p.expert && model_units && o.expert_shard_size > 1 && p.numel >= o.persistence_threshold;
  };

  // Expert parallelism's experts kept whole: a unit of their own, never bucketed (their gradients
  // are reduced over another group), reduced last.
  UnitPlan experts;
  experts.name = "experts";
  for (size_t i = 0; i < params.size(); ++i)
    if (params[i].expert && !sharded_expert(params[i]))
      add_member(group_in(experts, params[i].trained, params[i].decay, true), i);

  if (o.buckets || S == 1) {
    // Everything replicated. Frozen parameters: one group, no communication. Trained ones: ddp
    // buckets in reverse model order (the order backward produces their gradients).
    UnitPlan frozen;
    frozen.name = "frozen";
    for (size_t i = 0; i < params.size(); ++i)
      if (!params[i].trained && !params[i].expert)
        add_member(group_in(frozen, false, true, false), i);
    const int64_t bucket_elems = std::max<int64_t>(1, o.bucket_bytes / o.master_element_size);
    bool open = false;
    UnitPlan bucket;
    int64_t in_bucket = 0;
    for (size_t k = params.size(); k-- > 0;) {
      const UnitParam& p = params[k];
      if (!p.trained || p.expert) continue;
      if (!open || (in_bucket > 0 && in_bucket + p.numel > bucket_elems)) {
        if (open) plan.units.push_back(std::move(bucket));
        bucket = UnitPlan();
        bucket.name = fmt::format("bucket{}", plan.units.size());
        in_bucket = 0;
        open = true;
      }
      add_member(group_in(bucket, true, p.decay, false), k);
      in_bucket += p.numel;
    }
    if (open) plan.units.push_back(std::move(bucket));
    for (size_t i = 0; i < plan.units.size(); ++i) plan.launch_order.push_back(static_cast<int>(i));
    if (!frozen.groups.empty()) plan.units.push_back(std::move(frozen));
  } else {
    // Model units (root, layers), split 1/S (their experts over the ranks holding them); zero3's
    // small parameters in one replicated unit.
    for (int mu = 0; mu < n_model_units; ++mu) {
      UnitPlan u;
      u.name = mu == 0 ? "root" : fmt::format("layer{}", mu - 1);
      u.model_unit = mu;
      u.sharded = true;
      plan.unit_of_model[mu] = static_cast<int>(plan.units.size());
      plan.units.push_back(std::move(u));
    }
    UnitPlan persistent;
    persistent.name = "persistent";
    for (size_t i = 0; i < params.size(); ++i) {
      const UnitParam& p = params[i];
      if (p.expert && !sharded_expert(p)) continue;
      if (!p.expert && p.numel < o.persistence_threshold) {
        add_member(group_in(persistent, p.trained, p.decay, false), i);
        continue;
      }
      const int mu = model::DecoderModel::unit_of(p.name);
      FT_ASSERT(mu >= 0 && mu < n_model_units, "parameter ", p.name, " has no unit");
      add_member(group_in(plan.units[plan.unit_of_model[mu]], p.trained, p.decay, p.expert), i);
    }
    for (int u = n_model_units - 1; u >= 1; --u) plan.launch_order.push_back(plan.unit_of_model[u]);
    plan.launch_order.push_back(plan.unit_of_model[0]);
    if (!persistent.groups.empty()) {
      plan.launch_order.push_back(static_cast<int>(plan.units.size()));
      plan.units.push_back(std::move(persistent));
    }
  }
  if (!experts.groups.empty()) {
    plan.launch_order.push_back(static_cast<int>(plan.units.size()));
    plan.units.push_back(std::move(experts));
  }
  for (auto& u : plan.units)
    for (auto& g : u.groups)
      g.layout = FlatLayout::of(g.layout.numel, !u.sharded ? 1
                                                : g.expert ? o.expert_shard_size
                                                           : S);
  return plan;
}

}  // namespace ft::parallel
