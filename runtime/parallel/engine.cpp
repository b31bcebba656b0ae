#include "parallel/engine.h"

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include "comm/process_group.h"
#include "core/error.h"
#include "parallel/host_add.h"
#include "parallel/layout.h"
#include "parallel/units.h"

namespace ft::parallel {

struct Engine::Member {
  std::string name;
  at::Tensor* slot;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in the group's flat buffer
  int64_t numel = 0;
  // Expert parallelism: this rank's experts are elements [source_offset, source_offset + numel)
  // of the parameter of `full_shape` (the slot's shape otherwise, offset 0).
  std::vector<int64_t> full_shape;
  int64_t source_offset = 0;
};

struct Engine::Group {
  std::vector<Member> members;
  bool trained = false, decay = true;
  // This rank's experts: split over, or replicated on, the ranks holding the same experts.
  bool expert = false;
  // The members side by side, split over layout.shards ranks (set once every member is in):
  // `over`, the shard group (S ranks) or, for experts, the expert-data-parallel group; this rank
  // holds shard `shard_rank` (0 when replicated).
  FlatLayout layout;
  comm::ProcessGroup* over = nullptr;
  int shard_rank = 0;
  bool shard_host = false;   // `shard` is in host memory (offload_params, S > 1)
  bool master_host = false;  // `master` and `grad_acc` are in host memory (offload_optimizer)
  at::Tensor full;           // [padded] compute dtype; its storage is freed while released (S > 1)
  at::Tensor shard;          // [shard_numel] compute dtype; the same tensor as `full` when S == 1
  at::Tensor master;        // [shard_numel] master dtype (trained); aliases `shard` if dtypes agree
  at::Tensor grad_acc;      // [shard_numel] master dtype: the step's gradient (trained)
  at::Tensor grad_full;     // [padded] reduce dtype: this micro-batch's local gradient (S > 1)
  at::Tensor copy_out;      // Master::copy_out: `shard` or undefined
  at::Tensor grad_spare;    // a delayed update's second gradient buffer (hand_over_grads)
  int master_index = -1;    // in masters_ (trained)
  int64_t host_ticket = 0;  // master_host: the host thread's last job into grad_acc (HostAdds)
  int64_t full_bytes() const { return layout.padded * full.element_size(); }
};

struct Engine::Unit {
  std::string name;
  int model_unit = -1;  // the model unit it is (-1: a ddp bucket or the persistent group)
  bool sharded = false;
  std::vector<Group> groups;
  enum class State { kReleased, kGathering, kGathered } state = State::kGathered;
  std::vector<c10::intrusive_ptr<c10d::Work>> gathers;
  std::vector<at::Tensor> gather_inputs;  // offloaded shards' device copies while gathers run
  int trained_members = 0;
  int pending = 0;          // trained members whose gradient this micro-batch has not arrived
  bool input_done = false;  // the gradient of the unit's input exists: its backward is over
  bool ready = false;       // gradients complete for this micro-batch
  bool launched = false;    // its reduction has been issued
  int64_t elements() const {
    int64_t n = 0;
    for (const auto& g : groups) n += g.layout.padded;
    return n;
  }
};

// A reduction in flight: when it completes, `out` (slices) is added into (or, for all-reduces of a
// converted copy, copied back to) the groups' accumulators.
struct Engine::Pending {
  c10::intrusive_ptr<c10d::Work> work;
  at::Tensor out;
  std::vector<at::Tensor> keep;  // inputs that must live until the work completes
  struct Part {
    Group* group;  // into its grad_acc
    int64_t offset, numel;
    bool copy;  // copy (all-reduce of a converted copy) rather than add (reduce-scatter)
    int final_master = -1;  // the group's final write this step: then its master's host norm
  };
  std::vector<Part> parts;
};

// Gradients added into offloaded (host) accumulators on a thread of their own, in the order they
// come. From a GPU each comes down by an asynchronous copy into page-locked memory, on a side
// stream once the stream that produced it got there (Engine::host_add), and the thread waits for
// that copy's event: the backward's kernels run on beside the copies, and the host adds (before,
// the hook waited for each gradient's copy and then added it, the GPU idle meanwhile: issue 32). A
// reduction's output comes as soon as the reduction is issued (Engine::hand_down): the thread waits
// for it (a Gloo work: `after`; from a GPU: its copy's event). Whoever reads an accumulator drains
// first, up to the last job into it (tickets).
class Engine::HostAdds {
 public:
  // on_final(master, sq, error): a job's master's gradient is final, of squared norm sq (with
  // the error that stopped it instead). wait_work(work): waits for a collective (Engine::wait's
  // errors).
  HostAdds(std::function<void(int, double, std::exception_ptr)> on_final,
           std::function<void(c10d::Work&)> wait_work)
      : on_final_(std::move(on_final)),
        wait_work_(std::move(wait_work)),
        thread_([this] { run(); }) {}
  ~HostAdds() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  HostAdds(const HostAdds&) = delete;
  HostAdds& operator=(const HostAdds&) = delete;

  struct Job {
    at::Tensor dst, src;
    bool copy = false;
    std::unique_ptr<c10::Event> ready;     // the copy down from the GPU (null: on the host already)
    c10::intrusive_ptr<c10d::Work> after;  // a host collective that writes `src` (null: none)
    std::shared_ptr<const void> keep;      // what must live until the job is done (its reduction)
    int final_master = -1;
    at::Tensor device_src;  // the GPU tensor `src` was copied down from, kept until it is done
  };
  // dst += src (or dst = src with `copy`; nothing without `src`), then, with a `final_master`
  // (>= 0), dst's squared norm (host_sq_norm) reported to on_final. Returns the job's ticket.
  int64_t push(Job job) {
    int64_t ticket;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
      ticket = ++queued_;
    }
    cv_.notify_all();
    return ticket;
  }
  // Waits until every job pushed so far (or up to `ticket`) is done; rethrows the first error.
  void drain(int64_t ticket = -1) {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t upto = ticket < 0 ? queued_ : ticket;
    done_cv_.wait(lock, [&] { return done_ >= upto; });
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void run() {
    at::NoGradGuard no_grad;
    for (;;) {
      Job j;
      bool failed = false;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        j = std::move(jobs_.front());
        jobs_.pop_front();
        failed = error_ != nullptr;
      }
      std::exception_ptr error, first;
      double sq = std::nan("");
      try {
        if (j.after) wait_work_(*j.after);
        if (j.ready) j.ready->synchronize();
        if (!failed && j.src.defined())
          j.copy ? void(j.dst.copy_(j.src)) : add_into_host(j.dst, j.src);
        if (!failed && j.final_master >= 0) sq = host_sq_norm(j.dst);
      } catch (...) {
        error = std::current_exception();
      }
      const int master = j.final_master;
      j = Job();  // (the page-locked block goes back to its cache here, not under the lock)
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (error && !error_) error_ = error;
        first = error_;
      }
      if (master >= 0) on_final_(master, sq, first);
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++done_;
      }
      done_cv_.notify_all();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Job> jobs_;
  int64_t queued_ = 0, done_ = 0;
  bool stop_ = false;
  std::exception_ptr error_;
  std::function<void(int, double, std::exception_ptr)> on_final_;
  std::function<void(c10d::Work&)> wait_work_;
  std::thread thread_;  // last: it starts once the rest exists
};

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

at::Tensor alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i)
    strides[i] = strides[i + 1] * shape[i + 1];
  // A tensor of its own (own version counter, own autograd meta) over the flat buffer's storage:
  // writing the buffer (a gather) never trips autograd's checks on the saved parameter.
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, shape, strides);
  return t;
}

void free_storage(const at::Tensor& t) {
  c10::Storage s = t.storage();
  s.set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s.set_nbytes(0);
}

void alloc_storage(const at::Tensor& t, size_t nbytes) {
  c10::Storage s = t.storage();
  s.set_data_ptr_noswap(s.allocator()->allocate(nbytes));
  s.set_nbytes(nbytes);
}

c10d::Backend& backend(comm::ProcessGroup* g) { return g->backend(); }

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

// ---- gathering ----

void Engine::gather(int ui) {
  Unit& u = *units_[ui];
  if (!u.sharded || u.state != Unit::State::kReleased) return;
  await_update(u.model_unit);  // (its shard is what the gather reads)
  for (auto& g : u.groups) {
    alloc_storage(g.full, g.full_bytes());
    at::Tensor src = g.shard;
    std::optional<c10::StreamGuard> on_up;
    if (g.shard_host && g.full.is_cuda()) {
      // Up on a stream of its own, the collective after it there: shard_up.
      src = shard_up(g);
      on_up.emplace(*up_stream_);
      src.copy_(g.shard, /*non_blocking=*/true);
      u.gather_inputs.push_back(src);
    } else if (g.shard_host) {
      src = g.shard.to(g.full.device(), /*non_blocking=*/true, /*copy=*/true);
      u.gather_inputs.push_back(src);
    }
    u.gathers.push_back(backend(g.over)._allgather_base(g.full, src));
    acc_.all_gathers++;
    acc_.all_gather_bytes += g.full_bytes();
    acc_.gathered_bytes += g.full_bytes();
  }
  acc_.gathered_peak_bytes = std::max(acc_.gathered_peak_bytes, acc_.gathered_bytes);
  u.state = Unit::State::kGathering;
  if (!options_.overlap_comm) ensure_gathered(ui);
}

// An offloaded (page-locked) shard's device buffer for its gather. The copy into it and the
// gather run on up_stream_, so that the copy runs beside the compute stream's kernels instead of
// between them (before, a prefetched unit's copy up delayed the running unit's kernels by its
// transfer time; issue 32). NCCL's collective waits for the stream it is issued on, which holds
// the copy; ensure_gathered makes the compute stream wait for the collective. The buffer, and the
// gathered `full` the collective writes, come from the compute stream's pool, so up_stream_
// first waits for the compute stream's work queued so far (whoever used those blocks before).
at::Tensor Engine::shard_up(const Group& g) {
  const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  const c10::Device device = g.full.device();
  FT_ASSERT(up_stream_, "offloaded GPU shard without the engine's side stream");
  at::Tensor dst = at::empty(g.shard.sizes(), g.shard.options().device(device));
  c10::Event compute_so_far(c10::DeviceType::CUDA);
  compute_so_far.record(cuda.getStream(device));
  compute_so_far.block(*up_stream_);
  return dst;
}

void Engine::ensure_gathered(int ui) {
  Unit& u = *units_[ui];
  if (!u.sharded) return;
  gather(ui);
  if (u.state == Unit::State::kGathering) {
    for (auto& w : u.gathers) wait(*w);
    u.gathers.clear();
    u.gather_inputs.clear();
    u.state = Unit::State::kGathered;
  }
}

void Engine::release(int ui) {
  Unit& u = *units_[ui];
  if (!u.sharded || u.state == Unit::State::kReleased) return;
  for (auto& w : u.gathers) wait(*w);
  u.gathers.clear();
  u.gather_inputs.clear();
  for (auto& g : u.groups) {
    free_storage(g.full);
    acc_.gathered_bytes -= g.full_bytes();
  }
  u.state = Unit::State::kReleased;
}

// Gathers the units after model unit `from` in direction `step` (+1 forward, -1 backward) as the
// strategy's prefetch policy allows.
void Engine::prefetch(int from, int step) {
  const int n = model_.num_units();
  if (options_.prefetch_elements >= 0) {  // zero3: by elements
    int64_t ahead = 0;
    for (int mu = from + step; mu >= 1 && mu < n; mu += step) {
      ahead += units_[unit_of_model_[mu]]->elements();
      if (ahead > options_.prefetch_elements) break;
      gather(unit_of_model_[mu]);
    }
    return;
  }
  const int next = from + step;
  if (next < 1 || next >= n) return;
  if (step > 0 && options_.forward_prefetch) gather(unit_of_model_[next]);
  if (step < 0 && options_.backward_prefetch == BackwardPrefetch::kPre)
    gather(unit_of_model_[next]);
}

void Engine::before_unit(int mu) {
  await_update(mu);
  if (!gather_hooks_) return;
  const int ui = unit_of_model_.at(mu);
  if (ui < 0) return;
  ensure_gathered(ui);
  if (mu >= 1) prefetch(mu, +1);
}

void Engine::after_unit(int mu, const at::Tensor& output) {
  if (!gather_hooks_) return;
  const int ui = unit_of_model_.at(mu);
  if (ui < 0) return;
  if (at::GradMode::is_enabled() && output.requires_grad())
    output.register_hook([this, mu](const at::TensorBase&) { on_output_grad(mu); });
  // The root stays gathered: the head needs it at the end of forward and first in backward.
  if (mu >= 1 && options_.reshard_after_forward) release(ui);
}

// The gradient of model unit `mu`'s output exists: unit mu+1's backward is over, mu's begins.
void Engine::on_output_grad(int mu) {
  const int n = model_.num_units();
  if (mu + 1 < n) {
    Unit& next = *units_[unit_of_model_[mu + 1]];
    next.input_done = true;
    if (next.pending == 0) mark_ready(unit_of_model_[mu + 1]);
  }
  if (mu >= 1) {
    ensure_gathered(unit_of_model_[mu]);
    prefetch(mu, -1);
  }
}

// ---- gradients ----

void Engine::on_param_grad(int ui, int gi, int mi, const at::Tensor& param) {
  at::NoGradGuard no_grad;
  Unit& u = *units_[ui];
  Group& g = u.groups[gi];
  const Member& m = g.members[mi];
  at::Tensor& grad = param.mutable_grad();
  // A weight whose backward added its gradient itself (grad_sink) still reaches its hook, without
  // a gradient: grad_sunk has counted it.
  if (!grad.defined() && sink_of_.count(param.unsafeGetTensorImpl())) return;
  FT_ASSERT(grad.defined(), "gradient hook without a gradient for ", m.name);
  // A sparse gradient (the embedding's rows, DecoderModel::set_sparse_embedding_grad on the CPU)
  // adds its rows, in token order, where a dense one adds the whole [vocab, hidden] tensor.
  auto add_into = [&](at::Tensor dst) {
    if (!grad.is_sparse()) {
      // An offloaded accumulator: added on the host's own thread (host_add).
      if (g.layout.shards == 1 && g.master_host)
        g.host_ticket = host_add(dst, grad.reshape({-1}));
      else
        dst.add_(grad.reshape({-1}));
      return;
    }
    const at::Tensor rows = grad._indices().select(0, 0);
    const at::Tensor values = grad._values().reshape({rows.size(0), -1});
    dst.view({grad.size(0), -1}).index_add_(0, rows, values.to(dst.scalar_type()));
  };
  if (g.layout.shards == 1) {
    add_into(g.grad_acc.narrow(0, m.offset, m.numel));
  } else {
    if (!g.grad_full.defined())
      g.grad_full = at::zeros({g.layout.padded}, g.full.options().dtype(options_.reduce_dtype));
    add_into(g.grad_full.narrow(0, m.offset, m.numel));
  }
  grad = at::Tensor();
  member_done(ui);
}

void Engine::member_done(int ui) {
  Unit& u = *units_[ui];
  FT_ASSERT(u.pending > 0, "unit ", u.name, ": more gradients than trained parameters");
  if (--u.pending == 0 && (!u.sharded || u.input_done)) mark_ready(ui);
}

model::UnitHooks::GradSink Engine::grad_sink(const at::Tensor& weight) {
  if (!grads_) return {};
  const auto it = sink_of_.find(weight.unsafeGetTensorImpl());
  if (it == sink_of_.end()) return {};
  const Sink& s = sinks_[static_cast<size_t>(it->second)];
  const Group& g = units_[s.unit]->groups[s.group];
  const Member& m = g.members[s.member];
  return {g.grad_acc.narrow(0, m.offset, m.numel).view(m.shape), it->second};
}

void Engine::grad_sunk(int64_t id) {
  FT_ASSERT(id >= 0 && id < static_cast<int64_t>(sinks_.size()), "unknown gradient sink ", id);
  member_done(sinks_[static_cast<size_t>(id)].unit);
}

void Engine::mark_ready(int ui) {
  Unit& u = *units_[ui];
  if (u.ready) return;
  u.ready = true;
  // Its backward is over: a sharded unit's gathered parameters can go (not the root's, which the
  // embedding's backward still reads; end_backward releases it).
  if (u.sharded && u.model_unit >= 1) {
    if (options_.backward_prefetch == BackwardPrefetch::kPost && options_.prefetch_elements < 0 &&
        u.model_unit >= 2)
      gather(unit_of_model_[u.model_unit - 1]);
    release(ui);
  }
  launch_ready();
}

void Engine::launch_ready() {
  while (launch_cursor_ < launch_order_.size() && units_[launch_order_[launch_cursor_]]->ready) {
    finalize(launch_order_[launch_cursor_]);
    ++launch_cursor_;
  }
}

// Issues the unit's gradient reduction: sharded units every micro-batch (reduce-scatter, through
// the bucket queue), replicated units once per optimizer step (all-reduce on the last micro-batch).
void Engine::finalize(int ui) {
  Unit& u = *units_[ui];
  if (u.launched) return;
  u.launched = true;
  for (size_t gi = 0; gi < u.groups.size(); ++gi) {
    Group& g = u.groups[gi];
    if (!g.trained) continue;
    if (g.layout.shards > 1) {
      if (!g.grad_full.defined())  // no gradient reached it (unused): reduce zeros all the same
        g.grad_full = at::zeros({g.layout.padded}, g.full.options().dtype(options_.reduce_dtype));
      // A bucket is reduce-scattered over one group: experts go over another one.
      if (!reduce_queue_.empty() &&
          units_[reduce_queue_[0].first]->groups[reduce_queue_[0].second].over != g.over)
        flush_reduce_queue();
      reduce_queue_.emplace_back(ui, static_cast<int>(gi));
      reduce_queue_elements_ += g.layout.padded;
    } else if (g.expert && last_micro_ && groups_.expert_dp) {
      // Each expert's gradient already holds its EP group's tokens (they came to it); the other
      // EP groups' copies add theirs.
      all_reduce_grad(g, groups_.expert_dp, final_master(u, g, false));
    } else if (!g.expert && last_micro_ && world_size_ > 1) {
      all_reduce_grad(g, groups_.world, final_master(u, g, false));
    } else if (const int m = final_master(u, g, false); m >= 0) {
      host_add(g.grad_acc, at::Tensor(), false, m);  // (its norm, after its additions)
    }
  }
  if (reduce_queue_elements_ > 0 && reduce_queue_elements_ >= options_.reduce_bucket_elements)
    flush_reduce_queue();
}

// Sums a group's step gradient over `pg`, in place or through a copy in the reduce dtype.
void Engine::all_reduce_grad(Group& g, comm::ProcessGroup* pg, int final_master) {
  auto p = std::make_unique<Pending>();
  // In place, or through a copy on the device in the reduce dtype (offloaded: the accumulator is
  // in host memory, which NCCL cannot reduce).
  if (g.master_host && host_adds_) host_adds_->drain(g.host_ticket);
  at::Tensor buf = options_.reduce_dtype == g.grad_acc.scalar_type() && !g.master_host
                       ? g.grad_acc
                       : g.grad_acc.to(options_.device, options_.reduce_dtype, false, true);
  std::vector<at::Tensor> v{buf};
  p->work = backend(pg).allreduce(v);
  p->out = buf;
  if (!buf.is_same(g.grad_acc))
    p->parts.push_back({&g, 0, g.layout.shard_numel, true, final_master});
  acc_.all_reduces++;
  acc_.all_reduce_bytes += buf.nbytes();
  issued(*p->work);
  settle_later(std::move(p));
}

void Engine::flush_reduce_queue() {
  if (reduce_queue_.empty()) return;
  comm::ProcessGroup* over = units_[reduce_queue_[0].first]->groups[reduce_queue_[0].second].over;
  const int S = over->size();
  auto p = std::make_unique<Pending>();
  at::Tensor in;
  if (reduce_queue_.size() == 1) {
    in = units_[reduce_queue_[0].first]->groups[reduce_queue_[0].second].grad_full;
  } else {
    // Rank k's slice of the bucket is every group's k-th shard, side by side.
    std::vector<at::Tensor> rows;
    for (auto [ui, gi] : reduce_queue_)
      rows.push_back(units_[ui]->groups[gi].grad_full.view({S, -1}));
    in = at::cat(rows, 1).reshape({-1});
  }
  p->out = at::empty({in.numel() / S}, in.options());
  int64_t off = 0;
  for (auto [ui, gi] : reduce_queue_) {
    Group& g = units_[ui]->groups[gi];
    p->parts.push_back({&g, off, g.layout.shard_numel, false, final_master(*units_[ui], g, false)});
    off += g.layout.shard_numel;
    p->keep.push_back(g.grad_full);
    g.grad_full = at::Tensor();
  }
  p->keep.push_back(in);
  p->work = backend(over)._reduce_scatter_base(p->out, in);
  acc_.reduce_scatters++;
  acc_.reduce_scatter_bytes += in.nbytes();
  issued(*p->work);
  settle_later(std::move(p));
  reduce_queue_.clear();
  reduce_queue_elements_ = 0;
}

// A reduction just issued: drain() folds its output into the accumulators, or, where they are in
// host memory (offload_optimizer), the host thread does as soon as the reduction completes.
void Engine::settle_later(std::unique_ptr<Pending> p) {
  if (options_.offload_optimizer)
    hand_down(std::move(p));
  else
    pending_.push_back(std::move(p));
}

// An offloaded reduction's output goes to the host thread now, while the backward goes on: a unit's
// gradient reaches its master, and its update can begin (update_can_begin_in_backward), as soon
// as its reduction is done, at any number of ranks (issue 32; before, at drain()). From a GPU it
// comes down by a copy on a side stream that waits for the reduction (NCCL's wait makes the
// current stream wait; the backward's stream does not); on the host the thread waits for the
// work itself. The jobs keep the reduction's tensors until they are done.
void Engine::hand_down(std::unique_ptr<Pending> p) {
  std::shared_ptr<Pending> keep(std::move(p));
  c10::intrusive_ptr<c10d::Work> after;
  std::optional<c10::StreamGuard> on_side;
  if (keep->out.is_cuda()) {
    on_side.emplace(*down_stream_);
    wait(*keep->work);  // (the side stream waits)
  } else {
    after = keep->work;
  }
  for (const auto& part : keep->parts) {
    Group& g = *part.group;
    g.host_ticket = host_add(g.grad_acc, keep->out.narrow(0, part.offset, part.numel), part.copy,
                             part.final_master, after, keep);
  }
}

void Engine::drain() {
  at::NoGradGuard no_grad;
  for (auto& p : pending_) {
    wait(*p->work);
    for (const auto& part : p->parts) {
      at::Tensor src = p->out.narrow(0, part.offset, part.numel);
      at::Tensor& dst = part.group->grad_acc;
      part.copy ? void(dst.copy_(src)) : void(dst.add_(src));
    }
  }
  pending_.clear();
}

namespace {
// Waits for a collective, its failure an ft error: PeerLostError when a peer is gone, else
// BackendError (the message without LibTorch's backtrace).
void wait_work(c10d::Work& work, int rank, const std::string& kind) {
  try {
    work.wait();
  } catch (const std::exception& e) {
    if (auto lost = comm::peer_failure(e))
      throw PeerLostError(fmt::format("rank {}: {} collective failed: {}", rank, kind, *lost));
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    if (!c10_error) throw;
    throw BackendError(fmt::format("rank {}: {} collective failed: {}", rank, kind,
                                   c10_error->what_without_backtrace()));
  }
}
}  // namespace

void Engine::wait(c10d::Work& work) {
  const auto t0 = std::chrono::steady_clock::now();
  wait_work(work, rank_, options_.kind);
  acc_.comm_wait_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Engine::ensure_grads() {
  if (grads_) return;
  for (auto& u : units_)
    for (auto& g : u->groups)
      if (g.trained) {
        g.grad_acc = at::zeros({g.layout.shard_numel}, master_options(g));
        g.master.mutable_grad() = g.grad_acc;
      }
  grads_ = true;
}

void Engine::hand_over_grads() {
  for (auto& u : units_)
    for (auto& g : u->groups) {
      if (!g.trained || !g.grad_acc.defined()) continue;
      if (!g.grad_spare.defined()) g.grad_spare = at::zeros_like(g.grad_acc);
      g.master.mutable_grad() = g.grad_acc;
      std::swap(g.grad_acc, g.grad_spare);
    }
}

// Without overlap a collective is waited for here, right after it was issued; drain() and
// release() then find it complete.
void Engine::issued(c10d::Work& work) {
  if (!options_.overlap_comm) wait(work);
}

void Engine::begin_micro_batch(bool last) {
  FT_ASSERT(loaded_, "Engine used before load()");
  ensure_grads();
  if (last_micro_) {  // a new step: no gradient is final yet (the host thread is idle: drained)
    drain_host_adds();
    std::fill(grad_sq_.begin(), grad_sq_.end(), std::nan(""));
    finals_in_backward_ = 0;
  }
  last_micro_ = last;
  in_last_backward_ = last;
  for (auto& u : units_) {
    u->pending = u->trained_members;
    u->input_done = false;
    u->ready = false;
    u->launched = false;
  }
  launch_cursor_ = 0;
}

void Engine::end_backward() {
  in_last_backward_ = false;
  // Whatever did not report (units whose input needs no gradient, the root, the persistent
  // group), in the fixed order.
  for (int ui : launch_order_) {
    Unit& u = *units_[ui];
    u.ready = true;
    if (u.sharded) release(ui);
  }
  launch_ready();
  flush_reduce_queue();
  // Sharded gradients must be folded in before the next micro-batch's hooks refill grad_full;
  // replicated all-reduces (last micro-batch only) are waited for in finish_gradients.
  drain();
}

int64_t Engine::host_add(at::Tensor dst, at::Tensor src, bool copy, int final_master,
                         c10::intrusive_ptr<c10d::Work> after, std::shared_ptr<const void> keep) {
  if (!host_adds_)
    host_adds_ = std::make_unique<HostAdds>(
        [this](int master, double sq, std::exception_ptr e) {
          grad_final(master, sq, std::move(e));
        },
        [rank = rank_, kind = options_.kind](c10d::Work& w) { wait_work(w, rank, kind); });
  HostAdds::Job job{std::move(dst),   std::move(src),  copy,         nullptr,
                    std::move(after), std::move(keep), final_master, at::Tensor()};
  if (job.src.defined() && job.src.is_cuda()) {
    // Down on down_stream_, beside the backward's kernels, once the work queued so far on the
    // current stream (what made src) is done; the job keeps src (a block of that stream's pool)
    // until the copy has run. (hand_down calls from down_stream_, which needs no event.)
    FT_ASSERT(down_stream_, "offloaded GPU gradient without the engine's side stream");
    const c10::Stream current =
        c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(job.src.device());
    if (current != *down_stream_) {
      c10::Event made(c10::DeviceType::CUDA);
      made.record(current);
      made.block(*down_stream_);
    }
    const c10::StreamGuard on_down(*down_stream_);
    at::Tensor down =
        at::empty(job.src.sizes(), job.src.options().device(at::kCPU).pinned_memory(true));
    down.copy_(job.src, /*non_blocking=*/true);
    job.ready = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    job.ready->record(*down_stream_);
    job.device_src = std::exchange(job.src, down);
  }
  // (Added even on the step's first micro-batch, into zeros: a copy would keep a gradient's -0,
  // which 0 + x makes +0, and the first moment can carry that sign.)
  return host_adds_->push(std::move(job));
}

// Group g's master when this write makes its accumulator final (the host thread then takes its
// norm: grad_final), else -1: an offloaded fp32 / fp64 accumulator on the step's last
// micro-batch, with no reduction after this one (HYBRID_SHARD's replicas add theirs later:
// `replica_pass` is that one). Not for fp16, whose gradients the trainer unscales before their
// norm.
int Engine::final_master(const Unit& u, const Group& g, bool replica_pass) {
  if (!last_micro_ || !g.trained || !g.master_host || options_.compute_dtype == at::kHalf ||
      (g.grad_acc.scalar_type() != at::kFloat && g.grad_acc.scalar_type() != at::kDouble))
    return -1;
  const bool replica_follows =
      groups_.replica && groups_.replica->size() > 1 && u.sharded && !g.expert;
  if (replica_follows && !replica_pass) return -1;
  return g.master_index;
}

double Engine::grad_sq_beside_backward(size_t master) const { return grad_sq_.at(master); }

void Engine::drain_host_adds() {
  if (host_adds_) host_adds_->drain();
}

void Engine::finish_gradients() {
  drain();
  if (groups_.replica && groups_.replica->size() > 1) {
    // HYBRID_SHARD: the shards are reduced inside the node; replicas add theirs across nodes.
    // (Sharded experts were reduced over all the ranks holding them.)
    for (auto& u : units_) {
      if (!u->sharded) continue;
      for (auto& g : u->groups) {
        if (!g.trained || g.expert) continue;
        all_reduce_grad(g, groups_.replica, final_master(*u, g, true));
      }
    }
    drain();
  }
  drain_host_adds();
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

// ---- the overlapped host update ----

bool update_can_begin_in_backward(const EngineOptions& o, double grad_clip) {
  return o.offload_optimizer && grad_clip <= 0 && o.compute_dtype != at::kHalf &&
         (o.master_dtype == at::kFloat || o.master_dtype == at::kDouble);
}

void Engine::reset_updates(bool during_backward) {
  std::lock_guard<std::mutex> lock(update_mu_);
  collect_final_ = during_backward;
  update_next_ = 0;
  is_updated_.assign(masters_.size(), 0);
  final_masters_.clear();
  update_error_ = nullptr;
  updates_cancelled_ = false;
}

// The first model unit a master not yet updated is read by, less one (INT_MAX: all updated).
int Engine::updated_through_locked() const {
  return update_next_ < update_order_.size() ? update_order_[update_next_].model_unit - 1
                                             : std::numeric_limits<int>::max();
}

void Engine::close_updates() {
  std::lock_guard<std::mutex> lock(update_mu_);
  updates_closed_ = true;
  updated_through_ = updated_through_locked();
}

at::Tensor Engine::update_staging(size_t i) const {
  const auto [ui, gi] = group_of_master_.at(i);
  const Group& g = units_[static_cast<size_t>(ui)]->groups[static_cast<size_t>(gi)];
  if (g.master.is_same(g.shard) || g.copy_out.defined() || !g.shard.is_cuda() ||
      !g.master.is_cpu() || g.master.scalar_type() != at::kFloat ||
      g.shard.scalar_type() == at::kFloat)
    return at::Tensor();
  return at::empty(g.master.sizes(),
                   g.master.options().dtype(g.shard.scalar_type()).pinned_memory(true));
}

void Engine::updated(size_t i, const at::Tensor& staged) {
  at::NoGradGuard no_grad;
  const auto [ui, gi] = group_of_master_.at(i);
  Group& g = units_[static_cast<size_t>(ui)]->groups[static_cast<size_t>(gi)];
  if (!g.copy_out.defined()) refresh_shard(g, staged);
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    FT_ASSERT(!is_updated_.at(i), "Engine::updated: master ", i, " updated twice");
    is_updated_[i] = 1;
    while (update_next_ < update_order_.size() && is_updated_[update_order_[update_next_].master])
      ++update_next_;
    if (updates_closed_) updated_through_ = updated_through_locked();
  }
  update_cv_.notify_all();
}

void Engine::open_updates(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    updates_closed_ = false;
    collect_final_ = false;
    updated_through_ = std::numeric_limits<int>::max();
    if (error) update_error_ = std::move(error);
  }
  update_cv_.notify_all();
}

void Engine::grad_final(int master, double sq, std::exception_ptr error) {
  // (Read after drain_host_adds, which returns after this.)
  grad_sq_[static_cast<size_t>(master)] = sq;
  if (in_last_backward_.load()) ++finals_in_backward_;
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    if (!collect_final_) return;
    final_masters_.push_back({master, std::move(error)});
  }
  update_cv_.notify_all();
}

size_t Engine::next_final_master() {
  std::unique_lock<std::mutex> lock(update_mu_);
  update_cv_.wait(lock, [&] { return !final_masters_.empty() || updates_cancelled_; });
  if (final_masters_.empty()) throw Error("the host update was cancelled: the step did not finish");
  auto [i, error] = std::move(final_masters_.front());
  final_masters_.pop_front();
  if (error) std::rethrow_exception(error);
  return static_cast<size_t>(i);
}

void Engine::cancel_updates() {
  {
    std::lock_guard<std::mutex> lock(update_mu_);
    updates_cancelled_ = true;
  }
  update_cv_.notify_all();
}

void Engine::await_update(int model_unit) {
  std::unique_lock<std::mutex> lock(update_mu_);
  // (A failed update may have been closed after it failed: its error ends the wait.)
  if (updated_through_ < model_unit && !update_error_) {
    const auto t0 = std::chrono::steady_clock::now();
    update_cv_.wait(lock, [&] { return updated_through_ >= model_unit || update_error_; });
    update_wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  if (update_error_) std::rethrow_exception(update_error_);
}

double Engine::take_update_wait_s() {
  std::lock_guard<std::mutex> lock(update_mu_);
  return std::exchange(update_wait_s_, 0.0);
}

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
