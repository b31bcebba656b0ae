// The engine's own parts (parallel/engine.h's Engine), shared by the files that implement it:
// a flat group's members, a unit, a reduction in flight, the host-addition thread, and the storage
// helpers. Only engine*.cpp include this; nothing here is an interface. Not thread-safe except
// HostAdds, whose queue is guarded by its mutex.
#pragma once

#include <c10/core/Event.h>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "comm/process_group.h"
#include "core/error.h"
#include "parallel/engine.h"
#include "parallel/host_add.h"
#include "parallel/layout.h"

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

// Storage helpers of the engine's files.
namespace engine_detail {

inline at::Tensor alias(const at::Tensor& flat, int64_t offset, at::IntArrayRef shape) {
  std::vector<int64_t> strides(shape.size(), 1);
  for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i)
    strides[i] = strides[i + 1] * shape[i + 1];
  // A tensor of its own (own version counter, own autograd meta) over the flat buffer's storage:
  // writing the buffer (a gather) never trips autograd's checks on the saved parameter.
  at::Tensor t = at::empty({0}, flat.options());
  t.set_(flat.storage(), flat.storage_offset() + offset, shape, strides);
  return t;
}

inline void free_storage(const at::Tensor& t) {
  c10::Storage s = t.storage();
  s.set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  s.set_nbytes(0);
}

inline void alloc_storage(const at::Tensor& t, size_t nbytes) {
  c10::Storage s = t.storage();
  s.set_data_ptr_noswap(s.allocator()->allocate(nbytes));
  s.set_nbytes(nbytes);
}

inline c10d::Backend& backend(comm::ProcessGroup* g) { return g->backend(); }

}  // namespace engine_detail

}  // namespace ft::parallel
