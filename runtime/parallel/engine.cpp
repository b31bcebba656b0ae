#include "parallel/engine.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <map>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/process_group.h"
#include "core/error.h"
#include "parallel/engine_parts.h"
#include "parallel/host_add.h"
#include "parallel/layout.h"
#include "parallel/units.h"

namespace ft::parallel {

using namespace engine_detail;

namespace {

class GradHook : public torch::autograd::PostAccumulateGradHook {
 public:
  GradHook(Engine* e, int u, int g, int m) : engine_(e), u_(u), g_(g), m_(m) {}
  void operator()(const torch::autograd::Variable& param) override {
    engine_->on_param_grad(u_, g_, m_, param);
  }

 private:
  Engine* engine_;
  int u_, g_, m_;
};

}  // namespace

Engine::Engine(model::DecoderModel& model, std::vector<ParamSpec> specs, EngineOptions options,
               Groups groups)
    : model_(model), specs_(std::move(specs)), options_(std::move(options)), groups_(groups) {
  rank_ = groups_.world ? groups_.world->rank() : 0;
  world_size_ = groups_.world ? groups_.world->size() : 1;
  const int S = options_.shard_size;
  FT_ASSERT(S >= 1 && world_size_ % S == 0, "shard size ", S, " does not divide world size ",
            world_size_);
  FT_ASSERT(S == 1 || (groups_.shard && groups_.shard->size() == S), "shard group of ", S,
            " ranks missing");
  // Which unit and group each spec goes to: units.h, shared with the planner.
  std::vector<UnitParam> params;
  for (const auto& p : specs_)
    params.push_back({p.name, p.slot->numel(), p.trained, p.decay, p.expert});
  UnitsOptions uo;
  uo.shard_size = S;
  uo.buckets = options_.buckets;
  uo.bucket_bytes = options_.bucket_bytes;
  uo.master_element_size = static_cast<int64_t>(c10::elementSize(options_.master_dtype));
  uo.persistence_threshold = options_.persistence_threshold;
  uo.expert_shard_size = groups_.expert_dp ? groups_.expert_dp->size() : 1;
  UnitsPlan plan = plan_units(params, uo, model_.num_units());
  unit_of_model_ = std::move(plan.unit_of_model);
  launch_order_ = std::move(plan.launch_order);
  for (auto& up : plan.units) {
    auto u = std::make_unique<Unit>();
    u->name = std::move(up.name);
    u->model_unit = up.model_unit;
    u->sharded = up.sharded;
    for (auto& gp : up.groups) {
      Group g;
      g.trained = gp.trained;
      g.decay = gp.decay;
      g.expert = gp.expert;
      g.layout = gp.layout;
      if (g.layout.shards > 1) {
        g.over = g.expert ? groups_.expert_dp : groups_.shard;
        FT_ASSERT(g.over && g.over->size() == g.layout.shards, "no group of ", g.layout.shards,
                  " ranks for unit ", u->name);
        g.shard_rank = g.over->rank();
        experts_sharded_ = experts_sharded_ || g.expert;
      }
      for (size_t k = 0; k < gp.members.size(); ++k) {
        const ParamSpec& p = specs_[gp.members[k]];
        Member m;
        m.name = p.name;
        m.slot = p.slot;
        m.shape = p.slot->sizes().vec();
        m.numel = p.slot->numel();
        m.offset = gp.offsets[k];
        m.full_shape = p.full_shape.empty() ? m.shape : p.full_shape;
        m.source_offset = p.source_offset;
        g.members.push_back(std::move(m));
      }
      if (g.trained) u->trained_members += static_cast<int>(g.members.size());
      u->groups.push_back(std::move(g));
    }
    u->pending = u->trained_members;
    units_.push_back(std::move(u));
  }
  // On the CPU the embedding's gradient comes as its rows (on_param_grad adds them): a dense one
  // is a zero-filled [vocab, hidden] tensor each step (131 MB at 32k x 1024, above glibc's mmap
  // threshold, so also faulted in page by page), then added whole. (GPUs: not yet run that way.)
  model_.set_sparse_embedding_grad(options_.device.is_cpu());
}

Engine::~Engine() {
  model_.set_unit_hooks(nullptr);
  model_.set_sparse_embedding_grad(false);
  // Outstanding work holds tensors of ours; let it finish before they go. It fails when a peer is
  // gone, and this runs while that error unwinds: a second exception here would end the process
  // with std::terminate instead of the first one's message.
  for (auto& p : pending_) {
    try {
      if (p->work) p->work->wait();
    } catch (const std::exception&) {
    }
  }
}

at::TensorOptions Engine::master_options(const Group& g) const {
  const auto o = at::TensorOptions().dtype(options_.master_dtype);
  return g.master_host ? o.device(at::kCPU).pinned_memory(options_.device.is_cuda())
                       : o.device(options_.device);
}

int Engine::my_shard(const Group& g) const { return g.shard_rank; }

void Engine::load(const ParamSource& source) {
  FT_ASSERT(!loaded_, "Engine::load called twice");
  at::NoGradGuard no_grad;
  const auto copt = at::TensorOptions().dtype(options_.compute_dtype).device(options_.device);
  // Offloaded state: host memory, page-locked for a GPU job (its copies then run at full speed).
  const auto host = at::TensorOptions().device(at::kCPU).pinned_memory(options_.device.is_cuda());
  // Storage first: this rank's shards.
  std::map<std::string, std::tuple<int, int, int>> where;  // name -> (unit, group, member)
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    auto& u = *units_[ui];
    for (size_t gi = 0; gi < u.groups.size(); ++gi) {
      Group& g = u.groups[gi];
      // Only this rank's part is allocated here: a sharded group's full buffer exists (untouched)
      // just long enough to alias the model's tensors into it, below.
      g.shard_host = g.layout.shards > 1 && options_.offload_params;
      g.master_host = g.trained && options_.offload_optimizer;
      // Uninitialised: every member element is written as it is read below, so a large model's
      // pages are touched then, under the loading progress lines, not all at once before the
      // first line. Only the group's padding (never read) is zeroed here.
      g.shard = at::empty({g.layout.shards == 1 ? g.layout.padded : g.layout.shard_numel},
                          g.shard_host ? host.dtype(options_.compute_dtype) : copt);
      const ShardPiece pad =
          intersect(g.layout, my_shard(g), g.layout.numel, g.layout.padded - g.layout.numel);
      if (!pad.empty()) g.shard.narrow(0, pad.shard_offset, pad.numel()).zero_();
      for (size_t mi = 0; mi < g.members.size(); ++mi)
        where[g.members[mi].name] = {static_cast<int>(ui), static_cast<int>(gi),
                                     static_cast<int>(mi)};
    }
  }
  // Values: only this rank's slice of each parameter is read.
  for (const auto& p : specs_) {
    auto [ui, gi, mi] = where.at(p.name);
    Group& g = units_[ui]->groups[gi];
    const Member& m = g.members[mi];
    const ShardPiece mine = intersect(g.layout, my_shard(g), m.offset, m.numel);
    source(p.name, m.source_offset + mine.begin, m.source_offset + mine.end,
           g.shard.narrow(0, mine.shard_offset, mine.numel()));
  }
  // Aliases into the full buffers; masters; hooks.
  sink_of_.clear();
  sinks_.clear();
  for (size_t ui = 0; ui < units_.size(); ++ui) {
    auto& u = *units_[ui];
    for (size_t gi = 0; gi < u.groups.size(); ++gi) {
      Group& g = u.groups[gi];
      g.full = g.layout.shards == 1 ? g.shard : at::empty({g.layout.padded}, copt);
      for (size_t mi = 0; mi < g.members.size(); ++mi) {
        Member& m = g.members[mi];
        at::Tensor a = alias(g.full, m.offset, m.shape);
        if (g.trained) {
          a.requires_grad_(true);
          torch::autograd::impl::set_post_acc_grad_hooks(
              a, std::make_unique<GradHook>(this, static_cast<int>(ui), static_cast<int>(gi),
                                            static_cast<int>(mi)));
          // Replicated, accumulated in the weight's own dtype on its device: a linear layer's
          // backward (or an MoE layer's expert group, for its [E, out, in] weights) may add into
          // the accumulator itself (grad_sink).
          // (Not the embedding: its gradient comes as rows, and with tied embeddings the LM
          // head is the same tensor, one hook for both.)
          // On a GPU not when offloaded (the accumulator is in host memory); on the CPU the host
          // accumulator is the same memory, and without the sink an offloaded run would add a
          // later micro-batch's product where the plain run's addmm accumulates it: other bits.
          if (g.layout.shards == 1 && (!g.master_host || options_.device.is_cpu()) &&
              (m.shape.size() == 2 || m.shape.size() == 3) &&
              options_.master_dtype == options_.compute_dtype &&
              m.name != "model.embed_tokens.weight") {
            sink_of_[a.unsafeGetTensorImpl()] = static_cast<int64_t>(sinks_.size());
            sinks_.push_back({static_cast<int>(ui), static_cast<int>(gi), static_cast<int>(mi)});
          }
        }
        *m.slot = a;
      }
      if (g.trained) {
        if (options_.master_dtype == options_.compute_dtype && g.master_host == g.shard_host) {
          g.master = g.shard;
        } else {
          g.master = at::empty({g.layout.shard_numel}, master_options(g));
          g.master.copy_(g.shard);
        }
        // The optimizer's pass writes the compute copy where it lives in host memory (a CPU job,
        // or offloaded shards). A shard on the GPU is still rounded into per-step page-locked
        // staging by after_update: a persistent staging buffer would cost 2 B per parameter of
        // host memory (65.7 GiB per node for full-70b on 2 x 8); a bounded ring of them comes
        // with the per-unit host step (issue 32).
        if (!g.master.is_same(g.shard) && g.master.is_cpu() && g.shard.is_cpu() &&
            g.master.scalar_type() == at::kFloat &&
            (options_.compute_dtype == at::kBFloat16 || options_.compute_dtype == at::kHalf))
          g.copy_out = g.shard;
        g.master_index = static_cast<int>(masters_.size());
        masters_.push_back({g.master, g.decay, g.layout.shards > 1, g.expert, g.copy_out});
        group_of_master_.emplace_back(static_cast<int>(ui), static_cast<int>(gi));
        // The first model unit that reads it (0 for names of no unit).
        int first = std::numeric_limits<int>::max();
        for (const Member& m : g.members)
          first = std::min(first, std::max(0, model::DecoderModel::unit_of(m.name)));
        update_order_.push_back(
            {masters_.size() - 1, first == std::numeric_limits<int>::max() ? 0 : first});
      }
    }
    if (u.sharded) {
      for (auto& g : u.groups) free_storage(g.full);
      u.state = Unit::State::kReleased;
    }
  }
  for (auto& u : units_)
    if (u->sharded)
      acc_.largest_unit_bytes = std::max(acc_.largest_unit_bytes, [&] {
        int64_t b = 0;
        for (auto& g : u->groups) b += g.full_bytes();
        return b;
      }());
  // Gathering around units (sharded strategies); gradient sinks (any strategy with them).
  gather_hooks_ = options_.shard_size > 1 && !options_.buckets;
  // (An offloaded optimizer's overlapped update: the forward waits at its units.)
  if (gather_hooks_ || !sinks_.empty() || options_.offload_optimizer) model_.set_unit_hooks(this);
  grad_sq_.assign(masters_.size(), std::nan(""));
  std::stable_sort(
      update_order_.begin(), update_order_.end(),
      [](const UpdateOrder& a, const UpdateOrder& b) { return a.model_unit < b.model_unit; });
  // The GPU's side streams: offloaded gradients down (host_add), offloaded shards up (shard_up).
  if (options_.device.is_cuda()) {
    const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
    if (options_.offload_optimizer) down_stream_ = cuda.getStreamFromGlobalPool(options_.device);
    if (options_.offload_params) up_stream_ = cuda.getStreamFromGlobalPool(options_.device);
  }
  loaded_ = true;
}

std::vector<Engine::Piece> Engine::pieces(bool to_write) const {
  std::vector<Piece> out;
  size_t master = 0;
  for (const auto& u : units_)
    for (const auto& g : u->groups) {
      if (!g.trained) continue;
      // This rank's shard of the flat group, then (to write) its share among the copies.
      const Range shard = g.layout.shard(my_shard(g));
      Range held = shard;
      if (to_write) {
        int copies = g.layout.shards == 1 ? world_size_ : world_size_ / g.layout.shards;
        int copy = g.layout.shards == 1 ? rank_ : (groups_.replica ? groups_.replica->rank() : 0);
        if (g.expert) {  // the ranks holding the same experts, whole or split among them
          const int holders = groups_.expert_dp ? groups_.expert_dp->size() : 1;
          copies = holders / g.layout.shards;
          copy = g.layout.shards == 1 && groups_.expert_dp ? groups_.expert_dp->rank() : 0;
        }
        held = share_of(shard, copies, copy);
      }
      for (const auto& m : g.members) {
        const ShardPiece p = intersect(m.offset, m.numel, held, shard.begin);
        if (p.empty()) continue;
        out.push_back({m.name, m.full_shape, m.source_offset + p.begin, m.source_offset + p.end,
                       master, p.shard_offset});
      }
      ++master;
    }
  return out;
}

void Engine::after_update(bool grads_zeroed, bool copied_out) {
  at::NoGradGuard no_grad;
  for (auto& u : units_)
    for (auto& g : u->groups) {
      if (!g.trained) continue;
      // (Rounded into the shard by the optimizer's pass when copied_out.)
      if (!(copied_out && g.copy_out.defined())) refresh_shard(g, at::Tensor());
      if (g.grad_acc.defined() && !grads_zeroed) g.grad_acc.zero_();
    }
}

// The compute copy from the updated master: nothing for fp32 training (the masters are the model's
// tensors), a rounding copy on one device, or from host masters to a GPU shard one DMA copy from
// page-locked memory (`staged` when the optimizer's pass rounded into it; else rounded here: a
// plain copy_ would round into pageable memory and copy from there, several times slower). The
// caching host allocator keeps the staging until the copy has run.
void Engine::refresh_shard(Group& g, const at::Tensor& staged) {
  if (g.master.is_same(g.shard)) return;
  if (g.master.device() == g.shard.device()) {
    g.shard.copy_(g.master);
    return;
  }
  at::Tensor up = staged;
  if (!up.defined()) {
    up =
        at::empty(g.master.sizes(),
                  g.master.options().dtype(g.shard.scalar_type()).pinned_memory(g.shard.is_cuda()));
    up.copy_(g.master);
  }
  g.shard.copy_(up, /*non_blocking=*/true);
}

Accounting Engine::take_accounting() {
  Accounting a = acc_;
  a.param_bytes = a.grad_bytes = 0;
  for (auto& u : units_)
    for (auto& g : u->groups) {
      a.param_bytes += g.layout.shards > 1 ? g.shard.nbytes() : g.full.nbytes();
      if (g.shard_host) a.host_param_bytes += g.shard.nbytes();
      if (g.trained) {
        if (!g.master.is_same(g.shard)) {
          a.param_bytes += g.master.nbytes();
          if (g.master_host) a.host_param_bytes += g.master.nbytes();
        }
        for (const at::Tensor* t : {&g.grad_acc, &g.grad_spare})
          if (t->defined()) {
            a.grad_bytes += t->nbytes();
            if (g.master_host) a.host_grad_bytes += t->nbytes();
          }
      }
    }
  // Counters restart; the gauges carry on.
  const Accounting keep = acc_;
  acc_ = Accounting();
  acc_.gathered_bytes = keep.gathered_bytes;
  acc_.gathered_peak_bytes = keep.gathered_bytes;
  acc_.largest_unit_bytes = keep.largest_unit_bytes;
  return a;
}

std::string Engine::describe() const {
  std::string s;
  for (const auto& u : units_) {
    int64_t n = 0, experts = 0;
    int expert_shards = 1;
    for (const auto& g : u->groups) {
      n += g.layout.numel;
      if (g.expert) {
        experts += g.layout.numel;
        expert_shards = g.layout.shards;
      }
    }
    s += fmt::format("{}{}: {} groups, {} elements, shard {}", u->name,
                     u->sharded ? "" : " (replicated)", u->groups.size(), n,
                     u->sharded ? options_.shard_size : 1);
    if (experts > 0 && u->sharded)
      s += fmt::format(" (of them {} expert elements, shard {})", experts, expert_shards);
    s += "\n";
  }
  return s;
}

}  // namespace ft::parallel
