// Which engine unit and flat group every parameter goes to, from names, sizes and flags alone: the
// engine lays its storage out from this, and the planner (plan/) counts bytes from the same
// answer, so the plan's model-state figures are the engine's by construction. Pure; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "parallel/layout.h"

namespace ft::parallel {

// A parameter as the layout sees it.
struct UnitParam {
  std::string name;  // HF (or PEFT) name: decides the model unit (DecoderModel::unit_of)
  int64_t numel = 0;
  bool trained = false;
  bool decay = true;
  // This rank's experts (expert parallelism): split over the ranks holding the same experts in
  // their layer's unit when the strategy shards (UnitsOptions::expert_shard_size), else whole in
  // the "experts" unit.
  bool expert = false;
};

struct GroupPlan {
  bool trained = false, decay = true;
  // Experts: split over UnitsOptions::expert_shard_size ranks (the expert-data-parallel group) in
  // a sharded unit, else replicated; gradients reduced over that group either way.
  bool expert = false;
  std::vector<size_t> members;   // indices into the params given to plan_units, in order
  std::vector<int64_t> offsets;  // each member's first element in the group's flat buffer
  FlatLayout layout;             // the members side by side, split over `shards`
};

struct UnitPlan {
  std::string name;     // "root", "layer3", "bucket0", "frozen", "persistent", "experts"
  int model_unit = -1;  // the model unit it is (-1: a ddp bucket, the frozen or persistent group)
  bool sharded = false;
  std::vector<GroupPlan> groups;
  int64_t padded_elements() const;  // all groups' padded elements (what a gather brings in)
};

struct UnitsOptions {
  int shard_size = 1;               // S (1: everything replicated)
  bool buckets = false;             // ddp buckets instead of model units
  int64_t bucket_bytes = 25 << 20;  // ddp bucket size
  int64_t master_element_size = 4;  // bytes of one master element (the bucket's unit)
  int64_t persistence_threshold = 0;
  // The ranks holding the same experts (expert parallelism's expert-data-parallel group): with
  // sharded model units and more than one, each layer's experts (those not under the persistence
  // threshold) go into that layer's unit split over them, gathered and released with the layer.
  int expert_shard_size = 1;
};

struct UnitsPlan {
  std::vector<UnitPlan> units;
  std::vector<int> unit_of_model;  // model unit -> index in units (-1: nothing to gather)
  std::vector<int> launch_order;   // units in the order their reductions are issued
};

// The engine's layout of `params` (every parameter the forward reads, in file order) over a model
// of `n_model_units` units (the root, then one per layer).
UnitsPlan plan_units(const std::vector<UnitParam>& params, const UnitsOptions& options,
                     int n_model_units);

}  // namespace ft::parallel
