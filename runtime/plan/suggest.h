// What would make a job that does not fit fit: each change ft knows (activation checkpointing,
// smaller micro-batches, sharding, offload, bf16, LoRA, QLoRA) re-planned on the same job; when
// none fits alone, the fewest of them that fit together; and the fewest nodes. Used by
// make_plan; pure (it only re-plans), thread-safe.
#pragma once

#include "plan/plan.h"

namespace ft::plan {

// Appends to `p` (the plan of `in`, which does not fit) its suggestions, each re-planned without
// suggestions of its own, in the order docs/planning.md gives: the single changes, then (when
// none of them fits) the smallest combination of them that fits, then the fewest nodes.
void add_suggestions(const PlanInputs& in, Plan& p);

}  // namespace ft::plan
