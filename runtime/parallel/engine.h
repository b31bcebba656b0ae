// The sharding engine behind every strategy (ddp, zero3, fsdp, and world size 1): it owns the
// storage of the model's parameters, their gradients and fp32 masters, laid out as flat groups that
// are either replicated (shard size 1: ddp, NO_SHARD, zero3's persistent small parameters) or split
// 1/S over a shard group (zero3, FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD inside a node). The model
// reads its parameters through aliases into those flat buffers; the engine gathers a unit's buffer
// before use, releases it after, and reduces gradients from autograd hooks while backward runs.
//
// Ordering rules (every rank must issue the same collectives in the same order on each group):
// gathers are issued from the forward's unit hooks and from gradient hooks on the units' outputs;
// reductions are launched in a fixed order (reverse unit order; ddp buckets in bucket order) as
// their units become ready, the rest at end_backward(). Calls come from one thread at a time: the
// training thread, or autograd's worker thread for a CUDA device (its hooks run there while the
// training thread waits for backward); not thread-safe. On CUDA every collective is issued on the
// current stream's order: NCCL waits for the stream before it starts, and Work::wait() makes the
// stream wait for NCCL, so kernels after a wait see the result without blocking the CPU.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/decoder.h"

namespace c10d {
class Work;
}
namespace ft::comm {
class ProcessGroup;
}

namespace ft::parallel {

enum class BackwardPrefetch { kNone, kPre, kPost };

struct EngineOptions {
  std::string kind = "ddp";  // ddp | zero3 | fsdp: for messages
  // Ranks one sharded group is split over (1: everything replicated).
  int shard_size = 1;
  // ddp: trained parameters go into gradient buckets of this many bytes (reverse model order)
  // instead of model units; nothing is gathered.
  bool buckets = false;
  int64_t bucket_bytes = 25 << 20;
  bool reshard_after_forward = true;  // FULL_SHARD, zero3; SHARD_GRAD_OP keeps units until backward
  bool forward_prefetch = false;      // fsdp
  BackwardPrefetch backward_prefetch = BackwardPrefetch::kPre;  // fsdp
  // zero3: gather the next units ahead while their elements stay within this (-1: fsdp flags).
  int64_t prefetch_elements = -1;
  // zero3: parameters with fewer elements stay whole on every rank (all-reduced gradients).
  int64_t persistence_threshold = 0;
  // zero3: sharded gradients are reduce-scattered in buckets of this many elements (0: per unit).
  int64_t reduce_bucket_elements = 0;
  at::ScalarType compute_dtype = at::kFloat;  // the model's parameters while gathered
  at::ScalarType master_dtype = at::kFloat;   // masters, gradients, optimizer state
  at::ScalarType reduce_dtype = at::kFloat;   // gradient communication
  at::Device device = at::kCPU;
  // false: every collective is waited for right after it is issued, so comm_wait_s is the whole
  // communication time rather than the part overlap did not hide (a measurement mode; the same
  // collectives in the same order, the same results).
  bool overlap_comm = true;
  // zero3 offload_param, fsdp cpu_offload: the shards of sharded groups (compute dtype) live in
  // host memory and are copied to the device just before their gather; the gathered units, and
  // parameters kept whole (S = 1), stay on the device.
  bool offload_params = false;
  // zero3 offload_optimizer, fsdp cpu_offload: masters, the step's gradient accumulators and so
  // the optimizer state (AdamW is built over the masters) live in host memory; reductions land
  // there, the optimizer step runs on the CPU and after_update() copies the new values to the
  // device. On a CPU job both offloads only change which copies exist and where the accounting
  // puts them (the strategy refuses them there unless FT_ALLOW_CPU_OFFLOAD=1, for tests).
  bool offload_optimizer = false;
};

// Whether an overlapped host update (offload_optimizer) can begin during the backward: no clip
// factor (grad_clip 0) and no fp16 loss scale to wait for, and masters of a dtype whose final
// gradients the engine reports (Engine::next_final_master). The trainer and the planner ask.
bool update_can_begin_in_backward(const EngineOptions& o, double grad_clip);

struct ParamSpec {
  std::string name;            // HF (or PEFT) name
  at::Tensor* slot = nullptr;  // the model's tensor, replaced by an alias into the engine's storage
  bool trained = false;
  bool decay = true;  // AdamW weight decay applies
  // Expert parallelism: the slot holds this rank's experts, elements [source_offset,
  // source_offset + slot->numel()) of the parameter `full_shape` flattened; replicated over the
  // ranks holding the same experts (Groups::expert_dp), its gradient reduced over them.
  bool expert = false;
  int64_t source_offset = 0;
  std::vector<int64_t> full_shape;  // empty: the slot's shape
};

// The process groups a strategy communicates over. `shard` splits sharded groups (S ranks);
// `replica` joins the ranks holding the same shard (HYBRID_SHARD: one per node). Null when the
// group would have one rank.
// Expert parallelism adds `ep` (the ranks that split one MoE layer's experts; the world when
// they are all of it) and `expert_dp` (the ranks holding the same experts: null when one).
struct Groups {
  comm::ProcessGroup* world = nullptr;
  comm::ProcessGroup* shard = nullptr;
  comm::ProcessGroup* replica = nullptr;
  comm::ProcessGroup* ep = nullptr;
  comm::ProcessGroup* expert_dp = nullptr;
};

// Fills `dst` (end - begin elements, the engine's dtype and device) with elements [begin, end) of
// a parameter flattened in C order. Called once for every parameter in the order the specs were
// given, also with begin == end (a random init still draws that tensor).
using ParamSource =
    std::function<void(const std::string& name, int64_t begin, int64_t end, const at::Tensor& dst)>;

// Per-rank figures since the previous take_accounting() (counters) and now (bytes).
struct Accounting {
  int64_t param_bytes = 0;          // resident: shards (compute dtype) + separate masters
  int64_t grad_bytes = 0;           // resident: the step's gradient accumulators
  int64_t gathered_bytes = 0;       // gathered unit buffers held right now
  int64_t gathered_peak_bytes = 0;  // most gathered bytes held at once during the period
  int64_t largest_unit_bytes = 0;   // the biggest gathered unit (compute dtype)
  int64_t all_gathers = 0, all_gather_bytes = 0;          // parameter gathers (bytes received)
  int64_t reduce_scatters = 0, reduce_scatter_bytes = 0;  // gradient reduce-scatters (bytes sent)
  int64_t all_reduces = 0, all_reduce_bytes = 0;          // gradient all-reduces
  int64_t scalar_collectives = 0;                         // token counts, norms, overflow flags
  // Time blocked waiting for communication: what overlap did not hide (all of it without overlap).
  double comm_wait_s = 0;
  // Of param_bytes and grad_bytes, the bytes kept in host memory by the offload options.
  int64_t host_param_bytes = 0, host_grad_bytes = 0;
};

class Engine : public model::UnitHooks {
 public:
  // Lays the specs out (nothing is allocated until load). `specs` must list every parameter of
  // the model that the forward reads, in the order a ParamSource is read.
  Engine(model::DecoderModel& model, std::vector<ParamSpec> specs, EngineOptions options,
         Groups groups);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Allocates this rank's shards, fills them from `source` (only this rank's slices are read),
  // makes the fp32 masters and points the model's tensors at the engine's storage. Gradient
  // buffers come with the first micro-batch, so loading holds parameters only.
  void load(const ParamSource& source);

  // One optimizer step: begin_micro_batch(last) + forward + backward + end_backward() per
  // micro-batch, then finish_gradients(); masters() then hold the step's global gradient sums.
  void begin_micro_batch(bool last);
  void end_backward();
  void finish_gradients();

  struct Master {
    at::Tensor tensor;  // [n] master dtype, .grad() the reduced gradient
    bool decay = true;
    bool sharded = false;  // a 1/S slice (its norm is summed over the shard group)
    bool expert = false;   // this rank's experts (sharded: their norm sums over the world; else
                           // over the EP group)
    // fp32 masters in host memory with a bf16 / fp16 compute shard also in host memory (a CPU
    // job, offloaded shards): that shard, which the optimizer may write with the rounded new
    // values in its own pass (AdamW::Param::copy_out). Undefined otherwise.
    at::Tensor copy_out;
  };
  const std::vector<Master>& masters() const { return masters_; }
  // After finish_gradients: master i's squared gradient norm (host_sq_norm) where the host thread
  // took it as soon as the offloaded gradient was final, beside the backward; NaN where it did
  // not (not offloaded, fp16, ...): the caller computes it.
  double grad_sq_beside_backward(size_t master) const;
  // After finish_gradients: of the masters whose gradient the host thread made final (and took
  // the norm of) this step, how many were done before the step's last backward ended
  // (end_backward): at any number of ranks, a reduction's output is added as soon as it is there.
  int finals_before_backward_end() const { return finals_in_backward_.load(); }

  // Elements [begin, end) of trained parameter `name` (flattened in C order) held by this rank
  // at masters()[master] starting at element `offset`.
  struct Piece {
    std::string name;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;
    size_t master = 0;
    int64_t offset = 0;
  };
  // Every piece of every trained parameter this rank holds (all of a replicated one). With
  // `to_write`, the share this rank writes to a checkpoint: the ranks holding copies of the same
  // elements (ddp replicas, HYBRID_SHARD nodes) split them, so that over all ranks every element
  // is written exactly once and the writing is spread evenly.
  std::vector<Piece> pieces(bool to_write) const;
  // After the optimizer updated the masters: refresh the compute copies (copied_out: the
  // optimizer wrote every Master::copy_out, which are then left alone); zero the
  // gradients unless the optimizer already did (grads_zeroed).
  void after_update(bool grads_zeroed = false, bool copied_out = false);

  // The host step unit by unit (offload_optimizer; trainer.h's overlapped update): the masters in
  // the order the next forward needs them, each with the first model unit that reads it (0 for
  // the persistent group and anything read before the first layer).
  struct UpdateOrder {
    size_t master = 0;
    int model_unit = 0;
  };
  const std::vector<UpdateOrder>& update_order() const { return update_order_; }
  // Training thread, before the update's thread starts: every master counts as not yet updated
  // (no unit is closed by this alone); `during_backward`: the masters whose gradients become final
  // from now on are queued for next_final_master() (until open_updates).
  void reset_updates(bool during_backward = false);
  // Training thread: the forward waits at each unit (before_unit, and a sharded unit's gather)
  // until the masters it reads are updated; those updated already are open.
  void close_updates();
  // The update's thread, after AdamW updated master `i` (with its compute copy rounded into
  // `staged`, from update_staging, when defined): the compute copy is refreshed (on a GPU one
  // DMA copy up from `staged`, queued on the stream the forward runs on) and, once closed, the
  // units whose masters are all updated are opened. Masters may come in any order; each once.
  void updated(size_t i, const at::Tensor& staged);
  // The update during the backward (trainer.h, clipping off): blocks until the next master's
  // gradient is final on the host (the host thread's norm of it taken: grad_sq_beside_backward),
  // and returns it; rethrows what stopped its additions, or throws once cancel_updates() was
  // called. Every master comes once per step where they all come (offloaded, no fp16).
  size_t next_final_master();
  // Wakes next_final_master() for good (a step that ended early: its thread can be joined).
  void cancel_updates();
  // Page-locked staging for master i's compute copy on the GPU, which AdamW's pass writes
  // (AdamW::update's copy_out); undefined where the pass writes the compute copy itself or none
  // is needed (fp32 copies are staged by updated()).
  at::Tensor update_staging(size_t i) const;
  // Opens every unit: the update is over (settle), or failed with `error` (each unit's wait then
  // throws it rather than run on half-updated parameters).
  void open_updates(std::exception_ptr error = nullptr);
  // Seconds the forward waited for the update since the last call.
  double take_update_wait_s();

  // A delayed update (trainer.h): the masters' .grad() become the gradients accumulated so far and
  // the engine accumulates the next ones into a second set of buffers (zero: allocated here the
  // first time, afterwards the ones the optimizer zeroed as it consumed them).
  void hand_over_grads();

  // Collectives over all ranks (counted as scalar collectives).
  double sum_over_ranks(double v);
  // Every rank has got here (a sum of zeros: one scalar collective).
  void barrier() { sum_over_ranks(0); }
  // Element by element over every rank (one all-reduce).
  std::vector<double> sum_over_ranks(const std::vector<double>& v);
  double max_over_ranks(double v);
  // Global squared gradient norm from this rank's sharded, replicated, whole experts' and split
  // experts' parts.
  double global_sq_norm(double sharded_sq, double replicated_sq, double expert_sq = 0,
                        double sharded_expert_sq = 0);
  // Every rank's `values` (each rank passes as many), in rank order: one all-gather over all
  // ranks (counted as a scalar collective, its wait as communication).
  std::vector<double> all_gather_values(const std::vector<double>& values);

  // Every parameter's name and shape (an expert parameter's whole shape) in the engine's order
  // (units, groups, members).
  std::vector<std::pair<std::string, std::vector<int64_t>>> parameter_shapes() const;
  // The full value of parameter `name` on world rank 0 (on the engine's device: the fp32 master
  // if trained, else its compute value), an undefined tensor on every other rank. Collective over
  // the ranks holding its pieces (world rank 0's shard group, or for an expert parameter the
  // ranks holding the same experts and then its EP group; nothing for a replicated one): all
  // ranks call it with the same names in the same order. Each piece travels once, point to point
  // to rank 0, which holds this one tensor and nothing else of the model beyond its own shards.
  at::Tensor full_on_rank0(const std::string& name);

  Accounting take_accounting();
  // Seconds blocked on communication since the last take_accounting(), without taking it.
  double comm_wait_s() const { return acc_.comm_wait_s; }
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  const EngineOptions& options() const { return options_; }
  // Where the masters, their gradients and the optimizer state live (the host when offloaded).
  at::Device master_device() const {
    return options_.offload_optimizer ? at::Device(at::kCPU) : options_.device;
  }
  // Units as laid out, for messages and tests: name, shard size, elements.
  std::string describe() const;

  // model::UnitHooks
  void before_unit(int unit) override;
  void after_unit(int unit, const at::Tensor& output) override;
  // 2-D weights of replicated groups (ddp, world size 1, zero3's persistent parameters) whose
  // accumulator is on their device in the compute dtype (not the embedding): the linear layers and
  // the LM head add their weight gradients straight into it.
  GradSink grad_sink(const at::Tensor& weight) override;
  void grad_sunk(int64_t id) override;

  // Called by the gradient hooks; not for other users.
  void on_param_grad(int unit, int group, int member, const at::Tensor& param);

 private:
  struct Member;
  struct Group;
  struct Unit;
  struct Pending;
  void gather(int u);
  at::Tensor shard_up(const Group& g);
  void ensure_gathered(int u);
  void release(int u);
  void prefetch(int from, int step);
  void on_output_grad(int model_unit);
  void mark_ready(int u);
  void member_done(int u);
  void finalize(int u);
  void launch_ready();
  void all_reduce_grad(Group& g, comm::ProcessGroup* pg, int final_master = -1);
  int final_master(const Unit& u, const Group& g, bool replica_pass);
  void flush_reduce_queue();
  void settle_later(std::unique_ptr<Pending> p);
  void hand_down(std::unique_ptr<Pending> p);
  void drain();
  void ensure_grads();
  at::TensorOptions master_options(const Group& g) const;
  // This rank's shard of group `g`: its shard rank, or 0 for a replicated group.
  int my_shard(const Group& g) const;
  void wait(c10d::Work& work);
  void issued(c10d::Work& work);
  double scalar_collective(double v, bool max);
  at::Tensor experts_on_rank0(const at::Tensor& mine, const Member& m, int tag);
  at::Tensor on_shard0(const Group& g, const Member& m, const at::Tensor& src, int tag);

  model::DecoderModel& model_;
  std::vector<ParamSpec> specs_;
  EngineOptions options_;
  Groups groups_;
  int rank_ = 0, world_size_ = 1;
  bool experts_sharded_ = false;  // some experts are split over the ranks holding them
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<int> unit_of_model_;  // model unit -> engine unit (-1: nothing to gather)
  std::vector<int> launch_order_;   // engine units in the order their reductions are issued
  size_t launch_cursor_ = 0;
  std::vector<Master> masters_;
  std::vector<std::unique_ptr<Pending>> pending_;
  std::vector<std::pair<int, int>> reduce_queue_;  // (unit, group) awaiting reduce-scatter
  int64_t reduce_queue_elements_ = 0;
  bool last_micro_ = true;
  bool loaded_ = false;
  bool grads_ = false;         // gradient accumulators allocated
  bool gather_hooks_ = false;  // before_unit / after_unit gather and release (sharded units)
  // Weights whose gradient may be sunk (grad_sink): the alias's TensorImpl -> index into sinks_.
  std::unordered_map<const c10::TensorImpl*, int64_t> sink_of_;
  struct Sink {
    int unit, group, member;
  };
  std::vector<Sink> sinks_;
  Accounting acc_;
  int p2p_tag_ = 0;  // full_on_rank0's sends and receives, in call order
  // The overlapped host update: the group (unit, group) of each master, the masters in
  // update_order(), and up to which model unit everything is updated (INT_MAX: all; guarded by
  // update_mu_, as the error and the wait time).
  std::vector<std::pair<int, int>> group_of_master_;
  std::vector<UpdateOrder> update_order_;
  size_t update_next_ = 0;  // the first master in update_order_ not yet updated
  std::mutex update_mu_;
  std::condition_variable update_cv_;
  int updated_through_ = std::numeric_limits<int>::max();
  std::exception_ptr update_error_;
  double update_wait_s_ = 0;
  std::vector<char> is_updated_;  // by master, this update
  bool updates_closed_ = false;   // updated_through_ follows the updates (else INT_MAX)
  bool updates_cancelled_ = false;
  bool collect_final_ = false;  // grad_final queues masters (reset_updates(true))
  // Masters whose gradient became final (host thread's order), with what stopped it if anything.
  std::deque<std::pair<int, std::exception_ptr>> final_masters_;
  int updated_through_locked() const;
  // The host thread: master's gradient is final, of squared norm sq (or `error` stopped it).
  void grad_final(int master, double sq, std::exception_ptr error);
  void await_update(int model_unit);
  std::vector<double> grad_sq_;  // grad_sq_beside_backward, by master (written by host_adds_)
  // finals_before_backward_end(): set from begin_micro_batch(last) to that micro-batch's
  // end_backward; the host thread counts the finals meanwhile.
  std::atomic<bool> in_last_backward_{false};
  std::atomic<int> finals_in_backward_{0};
  // Offloaded accumulators (offload_optimizer): gradients are added on a thread of their own.
  class HostAdds;
  std::unique_ptr<HostAdds> host_adds_;
  std::optional<c10::Stream> down_stream_;  // a GPU's reductions' outputs come down on (hand_down)
  std::optional<c10::Stream> up_stream_;    // offloaded shards go up and are gathered on (shard_up)
  // `dst` (an offloaded accumulator) += `src`, or = `src` (copy), in the order of the calls, on
  // host_adds_'s thread; a GPU tensor comes down first by an asynchronous copy on down_stream_
  // after the current stream's work so far; `after`, a host collective that writes `src`, is
  // waited for there first; `keep` lives until the job is done. drain_host_adds() waits for them
  // (host_adds_->drain(ticket): up to the job whose ticket this returns).
  // With a `final_master` (>= 0), the host thread then takes dst's squared norm and reports the
  // master final (grad_final; src may be undefined).
  int64_t host_add(at::Tensor dst, at::Tensor src, bool copy = false, int final_master = -1,
                   c10::intrusive_ptr<c10d::Work> after = {},
                   std::shared_ptr<const void> keep = {});
  void drain_host_adds();
  void refresh_shard(Group& g, const at::Tensor& staged);
};

}  // namespace ft::parallel
