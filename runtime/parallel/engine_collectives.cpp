// Engine: the small collectives of a step (scalars, the global norm, all-gathered values) and the
// export of whole tensors to rank 0 (parallel/engine.h).
#include <fmt/format.h>

#include "parallel/engine.h"
#include "parallel/engine_parts.h"

namespace ft::parallel {

using namespace engine_detail;

// ---- small collectives ----

double Engine::scalar_collective(double v, bool max) {
  if (world_size_ == 1) return v;
  // On the engine's device: NCCL reduces only GPU tensors (the .item() below waits for it).
  std::vector<at::Tensor> t{
      at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(options_.device))};
  c10d::AllreduceOptions o;
  o.reduceOp = max ? c10d::ReduceOp::MAX : c10d::ReduceOp::SUM;
  auto w = backend(groups_.world).allreduce(t, o);
  wait(*w);
  acc_.scalar_collectives++;
  return t[0].item<double>();
}

double Engine::sum_over_ranks(double v) { return scalar_collective(v, false); }

std::vector<double> Engine::sum_over_ranks(const std::vector<double>& v) {
  if (world_size_ == 1 || v.empty()) return v;
  std::vector<at::Tensor> t{at::tensor(v, at::kDouble).to(options_.device)};
  auto w = backend(groups_.world).allreduce(t);
  wait(*w);
  acc_.scalar_collectives++;
  const at::Tensor host = t[0].to(at::kCPU);
  return std::vector<double>(host.data_ptr<double>(), host.data_ptr<double>() + host.numel());
}
double Engine::max_over_ranks(double v) { return scalar_collective(v, true); }

double Engine::global_sq_norm(double sharded_sq, double replicated_sq, double expert_sq,
                              double sharded_expert_sq) {
  auto sum_over = [&](comm::ProcessGroup* g, double v) {
    std::vector<at::Tensor> t{
        at::full({1}, v, at::TensorOptions().dtype(at::kDouble).device(options_.device))};
    auto w = backend(g).allreduce(t);
    wait(*w);
    acc_.scalar_collectives++;
    return t[0].item<double>();
  };
  if (options_.shard_size > 1 && !options_.buckets)
    sharded_sq = sum_over(groups_.shard, sharded_sq);
  // Each EP rank holds other experts: their squares add over the EP group.
  if (groups_.ep) expert_sq = sum_over(groups_.ep, expert_sq);
  // Split experts: every element is on one rank of the world.
  if (experts_sharded_) sharded_expert_sq = sum_over(groups_.world, sharded_expert_sq);
  return sharded_sq + replicated_sq + expert_sq + sharded_expert_sq;
}

std::vector<double> Engine::all_gather_values(const std::vector<double>& values) {
  if (world_size_ == 1) return values;
  const auto opts = at::TensorOptions().dtype(at::kDouble);
  const auto n = static_cast<int64_t>(values.size());
  at::Tensor mine = at::from_blob(const_cast<double*>(values.data()), {n}, opts)
                        .to(options_.device, /*non_blocking=*/false, /*copy=*/true);
  std::vector<at::Tensor> outs;
  for (int r = 0; r < world_size_; ++r)
    outs.push_back(at::empty({n}, opts.device(options_.device)));
  std::vector<std::vector<at::Tensor>> out_lists{outs};
  std::vector<at::Tensor> in{mine};
  auto w = backend(groups_.world).allgather(out_lists, in);
  wait(*w);
  acc_.scalar_collectives++;
  std::vector<double> all;
  for (const auto& t : out_lists[0]) {
    const at::Tensor h = t.cpu();
    all.insert(all.end(), h.data_ptr<double>(), h.data_ptr<double>() + n);
  }
  return all;
}

std::vector<std::pair<std::string, std::vector<int64_t>>> Engine::parameter_shapes() const {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& u : units_)
    for (const auto& g : u->groups)
      for (const auto& m : g.members) out.emplace_back(m.name, m.full_shape);
  return out;
}

at::Tensor Engine::full_on_rank0(const std::string& name) {
  at::NoGradGuard no_grad;
  // Tags for this call's sends and receives: every rank counts every call, whether it takes part
  // or not, so that the tags of later calls agree (HYBRID_SHARD's other nodes take part in split
  // experts' calls only).
  const int tag = p2p_tag_;
  p2p_tag_ += 2;
  for (auto& u : units_)
    for (auto& g : u->groups)
      for (const auto& m : g.members) {
        if (m.name != name) continue;
        const at::Tensor& src = g.trained ? g.master : g.shard;
        if (g.expert) {
          // This rank's experts on the first of the ranks holding them (world ranks 0 .. EP-1),
          // then every EP rank's side by side on rank 0.
          const at::Tensor mine =
              g.layout.shards == 1 ? src.narrow(0, m.offset, m.numel) : on_shard0(g, m, src, tag);
          if (groups_.ep) return experts_on_rank0(mine, m, tag + 1);
          return rank_ == 0 ? mine.view(m.shape) : at::Tensor();
        }
        if (g.layout.shards == 1)
          return rank_ == 0 ? src.narrow(0, m.offset, m.numel).view(m.shape) : at::Tensor();
        // HYBRID_SHARD: the other nodes' replicas hold the same values and take no part.
        if (groups_.replica && groups_.replica->rank() != 0) return at::Tensor();
        const at::Tensor out = on_shard0(g, m, src, tag);
        return out.defined() ? out.view(m.shape) : out;
      }
  FT_ASSERT(false, "full_on_rank0: no parameter named ", name);
  return at::Tensor();
}

// Member `m` of sharded group `g` (its values in `src`, this rank's shard) whole on shard rank 0 of
// the group's ranks (flat, on the engine's device), undefined on the others: each sends its piece.
at::Tensor Engine::on_shard0(const Group& g, const Member& m, const at::Tensor& src, int tag) {
  c10d::Backend& pg = backend(g.over);
  // Shard rank s holds a piece of the member (possibly none).
  auto piece = [&](int s) { return intersect(g.layout, s, m.offset, m.numel); };
  // This rank's piece, on the device: NCCL moves device memory only (offloaded state comes over).
  auto slice = [&](const ShardPiece& p) {
    at::Tensor t = src.narrow(0, p.shard_offset, p.numel());
    return t.device() == options_.device ? t : t.to(options_.device);
  };
  if (g.shard_rank != 0) {
    const ShardPiece p = piece(g.shard_rank);
    if (!p.empty()) {
      std::vector<at::Tensor> v{slice(p)};
      wait(*pg.send(v, 0, tag));
    }
    return at::Tensor();
  }
  at::Tensor out = at::empty({m.numel}, src.options().device(options_.device));
  std::vector<std::vector<at::Tensor>> bufs;
  bufs.reserve(g.layout.shards);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int s = 0; s < g.layout.shards; ++s) {
    const ShardPiece p = piece(s);
    if (p.empty()) continue;
    if (s == 0) {
      out.narrow(0, p.begin, p.numel()).copy_(slice(p));
    } else {
      bufs.push_back({out.narrow(0, p.begin, p.numel())});
      works.push_back(pg.recv(bufs.back(), s, tag));
    }
  }
  for (auto& w : works) wait(*w);
  return out;
}

// An expert parameter from the EP group holding world rank 0 (EP groups are contiguous ranks, so
// its EP rank p is world rank p): each sends its experts, rank 0 lays them side by side.
at::Tensor Engine::experts_on_rank0(const at::Tensor& mine, const Member& m, int tag) {
  if (rank_ >= groups_.ep->size()) return at::Tensor();
  c10d::Backend& pg = backend(groups_.ep);
  at::Tensor local = mine.device() == options_.device ? mine : mine.to(options_.device);
  if (rank_ != 0) {
    std::vector<at::Tensor> v{local.contiguous()};
    wait(*pg.send(v, 0, tag));
    return at::Tensor();
  }
  const int64_t n = m.numel, ranks = groups_.ep->size();
  at::Tensor out = at::empty({n * ranks}, local.options());
  out.narrow(0, 0, n).copy_(local);
  std::vector<std::vector<at::Tensor>> bufs;
  bufs.reserve(ranks);
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  for (int p = 1; p < ranks; ++p) {
    bufs.push_back({out.narrow(0, p * n, n)});
    works.push_back(pg.recv(bufs.back(), p, tag));
  }
  for (auto& w : works) wait(*w);
  return out.view(m.full_shape);
}

}  // namespace ft::parallel
