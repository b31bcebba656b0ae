#include "train/run.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <thread>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpointer.h"
#include "comm/dist_env.h"
#include "comm/process_group.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/strings.h"
#include "cuda/device.h"
#include "cuda/loader.h"
#include "data/jsonl_source.h"
#include "data/mixture.h"
#include "data/synthetic.h"
#include "model/cpu_math.h"
#include "model/decoder.h"
#include "model/lora.h"
#include "parallel/expert_exchange.h"
#include "parallel/strategy.h"
#include "train/evaluate.h"
#include "train/expert_load.h"
#include "train/faults.h"
#include "train/final_save.h"
#include "train/launcher_link.h"
#include "train/metrics.h"
#include "train/profile.h"
#include "train/run_dir.h"
#include "train/run_events.h"
#include "train/saved_model.h"
#include "train/step_meter.h"
#include "train/stragglers.h"
#include "train/tensorboard.h"
#include "train/train_state.h"
#include "train/trainer.h"
#include "train/weights.h"

namespace ft::train {

using nlohmann::json;
namespace fs = std::filesystem;

int64_t steps_for_epochs(double epochs, int64_t rows_per_epoch, int64_t micro_batch,
                         int64_t grad_accum, int64_t world_size) {
  FT_CHECK(epochs > 0, "train.epochs must be > 0 when train.max_steps is 0, got ", epochs);
  FT_ASSERT(rows_per_epoch > 0 && micro_batch > 0 && grad_accum > 0 && world_size > 0, "rows ",
            rows_per_epoch, " micro_batch ", micro_batch, " grad_accum ", grad_accum,
            " world_size ", world_size);
  const double rows_per_step = static_cast<double>(micro_batch * grad_accum * world_size);
  const double steps = epochs * static_cast<double>(rows_per_epoch) / rows_per_step;
  // epochs is a decimal fraction (0.1 * 30 is 3.0000000000000004): a count within rounding of a
  // whole number is that number, not one step more.
  const double nearest = std::round(steps);
  const double exact =
      std::abs(steps - nearest) <= 1e-9 * std::max(1.0, steps) ? nearest : std::ceil(steps);
  FT_CHECK(exact < 1e15, "train.epochs=", epochs, " gives ", exact, " optimizer steps; too many");
  return std::max<int64_t>(1, static_cast<int64_t>(exact));
}

namespace {

// The rows of one epoch of --data (`rows_per_epoch`: a source's or a mixture's), with a progress
// line when counting takes a while (each record is tokenized once, or read from the tokenized
// cache); a malformed record is its FormatError under data.on_bad_record=error.
int64_t count_epoch_rows(
    const std::function<int64_t(const std::function<void(int64_t, int64_t)>&)>& rows_per_epoch,
    const std::string& path) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto last = start;
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  bool shown = false;
  const int64_t rows = rows_per_epoch([&](int64_t done, int64_t total) {
    const auto now = clock::now();
    const double since_start = std::chrono::duration<double>(now - start).count();
    const double since_last = std::chrono::duration<double>(now - last).count();
    if (since_start < 2 || (!tty && since_last < 10 && done < total)) return;
    fmt::print("{}ft train: checking every record of {} and counting an epoch: {}/{} ({:.0f} s)",
               tty ? "\r" : "", path, done, total, since_start);
    if (!tty) fmt::print("\n");
    std::fflush(stdout);
    last = now;
    shown = true;
  });
  if (shown && tty) fmt::print("\n");
  return rows;
}

// The refusals that need only the settings and the command line.
void check_data_and_length(const RunOptions& o) {
  const config::Settings& s = o.settings;
  const bool synthetic = s.data.synthetic();
  FT_CHECK(synthetic == (o.data_paths.empty() && s.data.sources.empty()),
           synthetic ? "data.format is synthetic (the built-in task), which generates its data: "
                       "to train on --data FILE, add --set data.format=auto (it detects text, "
                       "alpaca, chat and pre-tokenized records); or drop --data"
                     : "data.format '",
           synthetic ? "" : s.data.format,
           synthetic ? ""
                     : "' reads JSONL: give the file with --data PATH (several: --data "
                       "PATH:WEIGHT each, or data.sources), or use the built-in task: --set "
                       "data.format=synthetic");
  FT_CHECK(s.eval.split == 0 || !synthetic,
           "eval.split holds records of the training data out, but the synthetic task has no "
           "records: give --data, or eval.data for a held-out file");
  // train.max_steps wins; 0 asks for train.epochs passes over the data, counted once the data
  // source is open.
  FT_CHECK(s.train.max_steps > 0 || !synthetic,
           "train.max_steps is 0, which asks for train.epochs passes over the data, but the "
           "synthetic task has no epochs (its stream has no end): set --set train.max_steps=N");
  FT_CHECK(s.train.max_steps > 0 || s.train.epochs > 0,
           "train.max_steps and train.epochs are both 0: set ",
           "train.max_steps (optimizer steps) or train.epochs (passes over --data)");
}

// This process's command line as a shell would take it back (arguments with spaces or quotes
// single-quoted), from /proc/self/cmdline; "" where that cannot be read.
std::string command_line() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::string out, arg;
  while (std::getline(f, arg, '\0')) {
    const bool plain =
        !arg.empty() && arg.find_first_of(" \t\n'\"\\$`*?;&|<>()") == std::string::npos;
    std::string quoted = "'";
    for (char c : arg) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += (out.empty() ? "" : " ") + (plain ? arg : quoted + "'");
  }
  return out;
}

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One run of `ft train` on this rank (torchtitan's trainer: build the components, then train).
// The constructor builds in the order the inputs are checked, and nothing is written before every
// input has been; train() is the loop; save_final() writes final/. Collectives run in the same
// order on every rank: the checkpoint agreement in load_weights(), the barrier in
// write_run_files(), one scalar per step in the checkpointer, the final gathers.
class TrainingRun {
 public:
  TrainingRun(const RunOptions& o, const comm::DistEnv& env, OutputPlan out)
      : o_(o), s_(o.settings), env_(env), out_(std::move(out)), rank0_(env.rank == 0) {
    model::prime_cpu_math();  // before any parallel work: see model/cpu_math.h
    check_data_and_length(o_);
    choose_device();
    build_model();
    open_data();
    open_eval_data();
    form_groups();
    load_weights();
    write_run_files();
    build_trainer();
  }

  RunSummary train();
  void save_final();
  // events.jsonl (rank 0; "" on the others): starts, preemptions, the end (train/run_events.h).
  std::string events_path() const;

 private:
  void choose_device();
  void build_model();
  model::ModelConfig expert_placement();
  void form_expert_groups();
  void take_exchange_stats(StepRecord& r);
  void open_data();
  void open_eval_data();
  void form_groups();
  void load_weights();
  void write_run_files();
  void build_trainer();
  ckpt::CheckpointerOptions checkpointer_options();
  void print_start() const;
  std::string epochs_text() const;
  StepRecord step(ckpt::Checkpointer& checkpointer);
  void compare_ranks(StepRecord& r, StragglerWatch& watch);
  void open_sources();
  std::vector<SourceCount> placed_by_source() const;
  void add_sources_over_ranks(StepRecord& r);
  bool eval_due(const StepRecord& r) const;
  void evaluate_step(StepRecord& r);
  void publish_stop_estimate(const ckpt::Checkpointer& checkpointer, double iteration_s);
  struct StepLogs;
  StepLogs open_step_logs();
  void record_start();
  bool checkpoint_after_step(ckpt::Checkpointer& checkpointer, const RunRecord& record,
                             StepRecord& r, Clock::time_point t0, StepLogs& logs);
  void complete_record(StepRecord& r, Clock::time_point t0, StragglerWatch& watch);
  RunSummary stopped(const ckpt::Checkpointer& checkpointer, RunSummary sum);
  parallel::ParamSource with_progress(parallel::ParamSource inner, size_t tensors) const;

  const RunOptions& o_;
  const config::Settings& s_;
  const comm::DistEnv env_;
  OutputPlan out_;
  const bool rank0_;

  cuda::DeviceChoice device_choice_;
  at::Device device_{at::kCPU};
  at::ScalarType dtype_ = at::kFloat;  // compute dtype (precision.mode)
  model::ModelConfig mc_;
  std::unique_ptr<BaseWeights> base_;
  parallel::StrategyPlan
      strategy_plan_;  // the strategy's layout and groups (not the preflight's plan)
  std::unique_ptr<model::DecoderModel> model_;  // shapes only: the engine holds the storage
  model::LoraConfig lora_config_;
  std::unique_ptr<data::BatchSource> source_;
  std::unique_ptr<EvalSet> eval_set_;  // eval.data or eval.split, batched once; null without
  std::string eval_name_;              // what eval_set_ holds, for messages
  // --data's sources (owned by source_), and the mixture when there are several.
  std::vector<data::JsonlSource*> jsonl_;
  data::MixtureSource* mixture_ = nullptr;
  std::string data_text_;       // the data as given, for the start record and messages
  int64_t rows_per_epoch_ = 0;  // --data counted for train.epochs; 0 otherwise
  std::string chat_template_;   // the records' chat template (Jinja), "" when none is rendered
  int64_t total_steps_ = 0;
  std::unique_ptr<comm::ProcessGroup> world_, shard_group_, replica_group_, ep_group_,
      expert_dp_group_;
  parallel::ExpertParallelLayout ep_;                        // strategy.expert_parallel
  std::unique_ptr<parallel::ModelExpertExchange> exchange_;  // EP > 1 only
  // World size 1 under a launcher: its store, for progress and stop estimates (no group forms).
  c10::intrusive_ptr<c10d::Store> launcher_store_;
  parallel::Groups groups_;
  std::unique_ptr<parallel::Engine> engine_;
  std::vector<parallel::Engine::Piece> held_;  // this rank's pieces of the trained tensors
  std::unique_ptr<ckpt::Checkpoint> ck_;       // resumed from; null for a fresh start
  LoadRecord load_;
  std::unique_ptr<Trainer> trainer_;
  std::unique_ptr<StepMeter> meter_;  // MFU: the step's FLOPs and the device's peak
  double fault_delay_s_ = 0;          // FT_FAULT_STEP_DELAY: a test's straggler (fault_delay())
  std::unique_ptr<LauncherLink> launcher_;  // progress and stop estimates for ft launch
};

// The device, before LibTorch is asked anything about CUDA: a GPU run opens libft_cuda.so now.
void TrainingRun::choose_device() {
  device_choice_ = cuda::choose_device(s_.hardware.device, env_.local_rank);
  device_ = device_choice_.device;
  if (device_.is_cuda()) cuda::use_device(device_.index());
}

// The model's shape (config.json, or the preset's model section) with LoRA attached, the weight
// source checked against it, and the strategy's plan; the model holds no storage yet.
void TrainingRun::build_model() {
  mc_ = o_.model_dir.empty() ? model_config_from_preset(s_.model)
                             : model::load_model_config(o_.model_dir + "/config.json");
  apply_base_quant(s_.lora, s_.precision.mode, o_.model_dir, mc_);
  base_ = std::make_unique<BaseWeights>(o_.model_dir, mc_, model_param_shapes(mc_),
                                        static_cast<uint64_t>(s_.train.seed));
  dtype_ = parse_dtype(s_.precision.mode);
  model::check_grouped_mm(model::parse_grouped_mm(s_.moe.grouped_mm), dtype_, mc_);
  FT_CHECK(s_.data.seq_len <= mc_.max_position_embeddings, "data.seq_len ", s_.data.seq_len,
           " exceeds the model's max_position_embeddings ", mc_.max_position_embeddings,
           ": --set data.seq_len=", mc_.max_position_embeddings, " or less");
  const auto checkpointing =
      model::parse_activation_checkpointing(s_.train.activation_checkpointing);
  strategy_plan_ = parallel::plan_strategy(s_.strategy, s_.precision.mode, env_, device_);
  model_ = std::make_unique<model::DecoderModel>(expert_placement(),
                                                 at::TensorOptions().dtype(dtype_).device(device_),
                                                 /*materialize=*/false);
  model_->set_activation_checkpointing(checkpointing, s_.train.checkpoint_every_n_layers);
  model_->set_fused_ops(fused_ops(s_.train));
  model_->set_moe_grouped_mm(model::parse_grouped_mm(s_.moe.grouped_mm));
  if (s_.lora.enabled) {
    lora_config_ = lora_config_from_preset(s_.lora, o_.model_dir, &mc_);
    model::attach_lora(*model_, lora_config_, s_.train.seed + 1);
  }
}

// The model's config with this rank's experts (strategy.expert_parallel), checked against the
// model and the world; mc_ itself keeps describing the whole model (files, shapes, saving).
model::ModelConfig TrainingRun::expert_placement() {
  const int64_t n = s_.strategy.expert_parallel;
  const model::ModelConfig placed = parallel::place_experts(mc_, n, env_, &ep_);
  if (n > 1 && env_.rank == 0 && !ep_.within_node)
    fmt::print(stderr,
               "ft train: warning: strategy.expert_parallel={} spans nodes ({} ranks per node): "
               "every MoE layer's tokens cross the network twice per forward and backward; a "
               "divisor of the ranks per node keeps the exchange inside a node\n",
               n, env_.local_world_size);
  return placed;
}

// The step's token exchange (expert parallelism), then counted afresh for the next step.
void TrainingRun::take_exchange_stats(StepRecord& r) {
  const parallel::ExchangeStats& x = exchange_->exchange().stats();
  r.exchanged = true;
  r.dispatch_s = x.dispatch_s;
  r.combine_s = x.combine_s;
  r.exchange_counts_s = x.counts_s;
  r.exchange_bytes_sent = x.bytes_sent;
  r.exchange_bytes_received = x.bytes_received;
  exchange_->reset_stats();
}

// This rank's batches: the synthetic task, or --data read with the model's tokenizer (counted
// once when train.epochs sets the length).
void TrainingRun::open_data() {
  total_steps_ = s_.train.max_steps;
  if (s_.data.synthetic()) {
    data::SyntheticOptions so;
    so.vocab_size = mc_.vocab_size;
    so.seq_len = s_.data.seq_len;
    so.micro_batch = s_.train.micro_batch;
    so.train_on_prompt = s_.data.train_on_prompt;
    so.pack = s_.data.pack;
    so.seed = s_.train.seed;
    so.rank = env_.rank;
    so.world_size = env_.world_size;
    source_ = std::make_unique<data::SyntheticSource>(so);
    return;
  }
  open_sources();
  if (total_steps_ == 0)
    total_steps_ = steps_for_epochs(s_.train.epochs, rows_per_epoch_, s_.train.micro_batch,
                                    s_.train.grad_accum, env_.world_size);
}

// --data (or data.sources): one file read as a JsonlSource, several as a MixtureSource of them;
// eval.split's records set aside first. Every record is read now, before the weights load and
// anything is written: a malformed line stops the run here, and the rows of an epoch give the
// run's length in epochs.
void TrainingRun::open_sources() {
  data::JsonlOptions jo = data::jsonl_options(s_.data);
  // The --tokenizer given, else the model's when it has one; pre-tokenized data needs none.
  jo.tokenizer_path = data::tokenizer_path_of(o_.tokenizer_path, o_.model_dir);
  if (!jo.tokenizer_path.empty())
    jo.tokenizer = data::open_tokenizer(jo.tokenizer_path, mc_.vocab_size, o_.model_dir);
  jo.vocab_size = mc_.vocab_size;
  jo.use_cache = true;
  jo.prepare_cache = true;  // compressed or large columnar data: tokenized once, then cached
  jo.cache_dir = o_.data_cache_dir;
  jo.micro_batch = s_.train.micro_batch;
  jo.seed = s_.train.seed;
  jo.rank = env_.rank;
  jo.world_size = env_.world_size;
  jo.model_dir = o_.model_dir;
  const std::vector<data::SourceSpec> specs = data::training_sources(s_.data, o_.data_paths);
  std::vector<std::unique_ptr<data::JsonlSource>> sources = data::open_sources(specs, jo);
  data::hold_out_split(specs, sources, s_.eval.split);
  data::MixtureSource::Options mo;
  for (size_t k = 0; k < sources.size(); ++k) {
    const data::JsonlSource& src = *sources[k];
    const std::string& path = specs[k].settings.path;
    data_text_ += (k ? " " : "") + path;
    if (rank0_) fmt::print("ft train: data {}: template {}\n", path, src.template_used());
    // The saved model's template: the first source's that renders conversations.
    if (chat_template_.empty()) chat_template_ = src.chat_template_source();
    if (rank0_)
      fmt::print(
          stderr, "ft train: data: {}\n",
          src.cache_path().empty()
              ? src.cache_note() + "; every record is tokenized as it is read"
              : "records read from the tokenized cache " + src.cache_path() + " (ft data prepare)");
    jsonl_.push_back(sources[k].get());
    mo.names.push_back(specs[k].settings.name);
    mo.weights.push_back(specs[k].settings.weight);
  }
  if (sources.size() == 1) {
    data::JsonlSource& one = *sources.front();
    rows_per_epoch_ =
        count_epoch_rows([&](const auto& p) { return one.rows_per_epoch(p); }, data_text_);
    source_ = std::move(sources.front());
    return;
  }
  mo.pack = {s_.train.micro_batch, s_.data.seq_len, s_.data.pack};
  mo.seed = static_cast<uint64_t>(s_.train.seed);
  mo.rank = env_.rank;
  mo.world_size = env_.world_size;
  auto mixture = std::make_unique<data::MixtureSource>(std::move(sources), mo);
  rows_per_epoch_ =
      count_epoch_rows([&](const auto& p) { return mixture->rows_per_epoch(p); }, data_text_);
  if (rank0_) {
    std::string shares;
    for (size_t k = 0; k < mixture->size(); ++k)
      shares += fmt::format("{}{} {:.1f}% of {} records", k ? ", " : "", mixture->name(k),
                            100 * mixture->share(k), mixture->source(k).train_records());
    fmt::print("ft train: data: a mixture of {} sources ({}); an epoch is {} records drawn\n",
               mixture->size(), shares, mixture->epoch_records());
  }
  mixture_ = mixture.get();
  source_ = std::move(mixture);
}

// eval.data: the held-out file read, tokenized and batched once, as ft eval does
// (train/evaluate.h), so that its loss during training is ft eval's of the same weights; or
// eval.split: the records open_sources() set aside, batched the same way.
void TrainingRun::open_eval_data() {
  const bool split = s_.eval.split > 0;
  FT_CHECK(s_.eval.every == 0 || !s_.eval.data.empty() || split, "eval.every=", s_.eval.every,
           " needs eval.data, a held-out JSONL file (--set eval.data=PATH), or eval.split, a "
           "share of the training data held out (--set eval.split=0.02); or eval.every=0");
  FT_CHECK(s_.eval.data.empty() || !split, "eval.data (", s_.eval.data, ") and eval.split (",
           s_.eval.split,
           ") are both set: evaluate a held-out file or a split of the training "
           "data, not both");
  if (split) {
    std::vector<EvalRecord> held;
    for (const data::JsonlSource* src : jsonl_)
      for (const int64_t r : src->held_out()) held.push_back({src, r});
    eval_set_ = std::make_unique<EvalSet>(
        make_eval_set(held, s_.eval, s_.data.seq_len, jsonl_.front()->skips_bad_records()));
    eval_name_ = fmt::format("eval.split ({} records held out of {})", held.size(), data_text_);
  } else if (!s_.eval.data.empty()) {
    config::DataSettings data = s_.data;
    if (data.synthetic()) data.format = "auto";  // the task is generated; the file has a format
    const auto source = open_eval_source(data, s_.eval.data,
                                         data::tokenizer_path_of(o_.tokenizer_path, o_.model_dir),
                                         o_.model_dir, mc_.vocab_size);
    eval_set_ = std::make_unique<EvalSet>(make_eval_set(*source, s_.eval, s_.data.seq_len));
    eval_name_ = s_.eval.data;
  } else {
    return;
  }
  bool any_label = false;  // refused now, not after the first steps are trained
  for (const auto& b : eval_set_->batches)
    any_label = any_label || b.labels.ne(-100).any().item<bool>();
  FT_CHECK(any_label, eval_name_,
           ": no token carries a loss (every record is prompt only?); give held-out records with "
           "trained tokens");
  if (rank0_)
    fmt::print("ft train: eval {}: {} records in {} batches, {}\n", eval_name_, eval_set_->records,
               eval_set_->batches.size(),
               s_.eval.every > 0 ? fmt::format("every {} steps and at the end", s_.eval.every)
                                 : std::string("at the end"));
}

// Every rank has validated its inputs; forming the process group waits for all of them, so no
// rank writes into the output directory while another still checks that it is empty.
void TrainingRun::form_groups() {
  if (env_.world_size == 1) {
    if (env_.launched() && env_.agent_store)
      launcher_store_ =
          comm::connect_launcher_store(env_, comm::ProcessGroupOptions::kDefaultTimeout);
    return;
  }
  comm::ProcessGroupOptions pgo;
  pgo.device = device_;  // Gloo on CPU, NCCL on the rank's GPU
  world_ = std::make_unique<comm::ProcessGroup>(env_, pgo);
  groups_.world = world_.get();
  const int S = strategy_plan_.engine.shard_size;
  if (S > 1 && S == env_.world_size) groups_.shard = world_.get();
  if (S > 1 && S < env_.world_size) {
    shard_group_ =
        world_->subgroup(fmt::format("shard{}", env_.rank / S), strategy_plan_.shard_ranks);
    groups_.shard = shard_group_.get();
  }
  if (strategy_plan_.replicas > 1) {
    replica_group_ =
        world_->subgroup(fmt::format("replica{}", env_.rank % S), strategy_plan_.replica_ranks);
    groups_.replica = replica_group_.get();
  }
  form_expert_groups();
}

// Expert parallelism: the EP group (the ranks splitting the experts), the expert-data-parallel
// group (the ranks holding the same ones) and the model's token exchange over the first.
void TrainingRun::form_expert_groups() {
  if (ep_.ep_size == 1) return;
  if (ep_.ep_size == env_.world_size) {
    groups_.ep = world_.get();
  } else {
    ep_group_ = world_->subgroup(fmt::format("ep{}", ep_.ep_group), ep_.ep_ranks);
    groups_.ep = ep_group_.get();
  }
  if (ep_.expert_dp_ranks.size() > 1) {
    expert_dp_group_ =
        world_->subgroup(fmt::format("expert_dp{}", ep_.ep_rank), ep_.expert_dp_ranks);
    groups_.expert_dp = expert_dp_group_.get();
  }
  exchange_ = std::make_unique<parallel::ModelExpertExchange>(
      parallel::ExpertExchange(groups_.ep, mc_.moe.num_experts));
  model_->set_expert_exchange(exchange_.get());
}

// The engine's storage for this rank's shards, filled from the checkpoint the ranks agree on, the
// model files (only this rank's slices are read) or the seeded init; the load measured.
void TrainingRun::load_weights() {
  const bool lora = s_.lora.enabled;
  auto specs = parallel::param_specs(*model_, lora);
  engine_ = std::make_unique<parallel::Engine>(*model_, specs, strategy_plan_.engine, groups_);
  held_ = engine_->pieces(false);
  std::vector<std::pair<std::string, std::string>> unusable;
  ck_ = choose_checkpoint(out_.candidates, held_, *engine_, o_.resume, &unusable);
  for (const auto& [dir, why] : unusable) out_.damage.push_back(damaged_checkpoint(dir, why));
  load_.source = base_->from_files() ? "files" : "random init";
  // The first zeros, copy and read run libtorch code never run before in this process, whose
  // pages then fault in (several MiB, the same for any model): warm them so the peak measured
  // below is the loading's data.
  base_->warm_up(dtype_);
  load_.peak_reset = reset_peak_rss();
  load_.rss_before_bytes = rss_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  engine_->load(with_progress(run_param_source(*base_, ck_.get(), specs), specs.size()));
  load_.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  load_.peak_rss_bytes = peak_rss_bytes();
  core::reset_step_pool_peak();
  load_.param_bytes = engine_->take_accounting().param_bytes;
  load_.bytes_read = base_->bytes_read();
  // fp32 masters exactly as saved (the compute copies above are their rounding).
  if (ck_)
    for (const auto& pc : held_)
      ck_->read_range("param/" + pc.name, pc.begin, pc.end,
                      engine_->masters()[pc.master].tensor.narrow(0, pc.offset, pc.end - pc.begin));
}

// Start-up is never silent: rank 0 says what loading does, and how far it has got at least every
// 10 s, against the plan's expected time.
parallel::ParamSource TrainingRun::with_progress(parallel::ParamSource inner,
                                                 size_t tensors) const {
  if (!rank0_) return inner;
  const std::string what = ck_ ? "the checkpoint " + ck_->dir() + " and the base weights"
                           : base_->from_files() ? o_.model_dir
                                                 : std::string("the seeded random init");
  fmt::print(
      "ft train: loading {} tensors from {}{}\n", tensors, what,
      o_.expected_start_s >= 1
          ? fmt::format(" (the plan expects about {:.0f} s to the first step)", o_.expected_start_s)
          : "");
  std::fflush(stdout);
  struct State {
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now(), last = start;
    size_t done = 0;
    int64_t bytes = 0;
  };
  auto st = std::make_shared<State>();
  const double expected = o_.expected_start_s;
  return [inner = std::move(inner), st, tensors, expected](const std::string& name, int64_t b,
                                                           int64_t e, const at::Tensor& dst) {
    inner(name, b, e, dst);
    st->done++;
    st->bytes += dst.nbytes();
    const auto now = std::chrono::steady_clock::now();
    if (now - st->last < std::chrono::seconds(10) || st->done == tensors) return;
    st->last = now;
    const double elapsed = std::chrono::duration<double>(now - st->start).count();
    fmt::print("ft train: loading: {}/{} tensors, {} of this rank's parameters, {:.0f} s{}\n",
               st->done, tensors, human_bytes(st->bytes), elapsed,
               expected >= 1 ? fmt::format(" (expected about {:.0f} s)", expected) : "");
    std::fflush(stdout);
  };
}

// Everything the run needs is loaded and checked: only now is anything written.
void TrainingRun::write_run_files() {
  std::error_code ec;
  if (rank0_) {
    fs::create_directories(o_.output_dir, ec);
    FT_CHECK(!ec, "cannot create --output ", o_.output_dir, ": ", ec.message());
    write_text_atomic((fs::path(o_.output_dir) / "preset.json").string(),
                      s_.resolved.dump(2) + "\n");
    write_text_atomic((fs::path(o_.output_dir) / kRunInputsFile).string(),
                      to_json(out_.inputs).dump(2) + "\n");
    if (eval_set_ && s_.eval.split > 0)  // which records eval.split held out, as FILE:LINE
      write_text_atomic(
          (fs::path(o_.output_dir) / "eval_split.json").string(),
          json{{"split", s_.eval.split}, {"records", eval_set_->origins}}.dump(1) + "\n");
    if (!o_.plan.is_null())  // what the report draws measured memory against
      write_text_atomic((fs::path(o_.output_dir) / "plan.json").string(), o_.plan.dump(2) + "\n");
  }
  engine_->barrier();  // the directory exists before any rank writes into it
  fs::create_directories(o_.output_dir, ec);
  FT_CHECK(!ec, "cannot create --output ", o_.output_dir, ": ", ec.message());
  write_load_record((fs::path(o_.output_dir) / fmt::format("load.rank{}.json", env_.rank)).string(),
                    load_, env_.rank, env_.world_size);
  if (!rank0_) return;
  fmt::print(
      "ft train: loaded {} of parameters on rank 0 from {} in {:.1f} s (host memory "
      "peak +{})\n",
      human_bytes(load_.param_bytes), load_.source, load_.seconds,
      human_bytes(std::max<int64_t>(0, load_.peak_rss_bytes - load_.rss_before_bytes)));
  std::fflush(stdout);
}

void TrainingRun::build_trainer() {
  TrainOptions options = train_options(s_.train, s_.precision, total_steps_);
  options.router_aux_coef = router_aux_coef(s_.moe, model_->config());
  options.router_aux_global = s_.moe.aux_loss_scope == "global";
  if (s_.strategy.kind == "zero3" && s_.strategy.zero3.delayed_update)
    options.delayed_update_after = s_.strategy.zero3.delayed_update_after;
  options.overlap_host_step = s_.strategy.overlap_host_step;
  options.fail_host_update_step = fault_host_update_step();
  trainer_ = std::make_unique<Trainer>(*model_, options, *engine_);
  StepMeter::Options mo;
  mo.model = mc_;
  if (s_.lora.enabled) mo.lora_targets = lora_config_.target_modules;
  mo.lora_r = lora_config_.r;
  mo.device = device_;
  mo.dtype = dtype_;
  mo.rank0 = rank0_;
  if (env_.world_size > 1) mo.barrier = [this] { engine_->barrier(); };
  meter_ = std::make_unique<StepMeter>(std::move(mo));
  launcher_ = std::make_unique<LauncherLink>(
      world_ ? &world_->store() : launcher_store_.get(), env_.rank, [this] {
        int64_t elements = 0;
        for (const auto& p : engine_->pieces(/*to_write=*/true)) elements += p.end - p.begin;
        return elements;
      });
  fault_delay_s_ = fault_delay(env_.rank);
  // LoRA dropout draws from LibTorch's default generators, which start from a random seed in each
  // process: seeding them makes a run with dropout repeat exactly.
  at::manual_seed(s_.train.seed);
  if (device_.is_cuda()) cuda::api().manual_seed(s_.train.seed);
  if (ck_) restore_state(*ck_, held_, *trainer_, *source_, env_.rank, env_.world_size, device_);
}

ckpt::CheckpointerOptions TrainingRun::checkpointer_options() {
  ckpt::CheckpointerOptions co;
  co.saver.root = out_.ckpt_root;
  co.saver.rank = env_.rank;
  co.saver.world_size = env_.world_size;
  co.saver.keep_last = static_cast<int>(s_.output.keep_last);
  if (world_) {
    c10d::Store* store = &world_->store();
    // A rank's outcome as a store value: '1', then its error ("" when its files are durable).
    co.saver.signal = [store](const std::string& key, const std::string& error) {
      const std::string value = "1" + error;
      store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    };
    co.saver.wait_all = [store](const std::vector<std::string>& keys) {
      store->wait(keys, std::chrono::minutes(30));
      std::vector<std::string> errors;
      for (const auto& key : keys) {
        const std::vector<uint8_t> value = store->get(key);
        errors.emplace_back(value.begin() + (value.empty() ? 0 : 1), value.end());
      }
      return errors;
    };
  }
  co.save_every = s_.output.save_every;
  co.save_every_minutes = s_.output.save_every_minutes;
  co.async_save = s_.output.async_save;
  co.on_save_error = s_.output.on_save_error == "continue" ? ckpt::OnSaveError::kContinue
                                                           : ckpt::OnSaveError::kStop;
  co.log_path = (fs::path(o_.output_dir) / "checkpoints.jsonl").string();
  co.max_over_ranks = [this](double v) { return engine_->max_over_ranks(v); };
  co.sum_over_ranks = [this](double v) { return engine_->sum_over_ranks(v); };
  co.announce = rank0_;
  co.second_signal_stops = !env_.launched();
  return co;
}

// The run's length in passes over --data: train.epochs, or what train.max_steps comes to.
std::string TrainingRun::epochs_text() const {
  if (s_.train.max_steps == 0) return fmt::format("{:g} epochs", s_.train.epochs);
  const double rows = static_cast<double>(total_steps_ * s_.train.micro_batch *
                                          s_.train.grad_accum * env_.world_size);
  return fmt::format("about {:.3g} epochs", rows / static_cast<double>(rows_per_epoch_));
}

void TrainingRun::print_start() const {
  if (!rank0_) return;
  fmt::print(
      "ft train: {} parameters ({}), {} layers, hidden {}, {} precision, {} x {} "
      "sequences of {} tokens per step{}, {} steps{} -> {}\n",
      mc_.num_parameters(),
      !s_.lora.enabled ? "all trained"
      : mc_.quant.nf4  ? (mc_.quant.in_files ? "LoRA adapters trained, on the base as saved in NF4"
                                             : "LoRA adapters trained, on the base quantized to NF4")
                       : "LoRA adapters trained",
      mc_.num_hidden_layers, mc_.hidden_size, s_.precision.mode, s_.train.grad_accum,
      s_.train.micro_batch, s_.data.seq_len,
      env_.world_size > 1 ? fmt::format(" on each of {} ranks", env_.world_size) : "", total_steps_,
      rows_per_epoch_ > 0 ? fmt::format(" ({} of {} sequences)", epochs_text(), rows_per_epoch_)
                          : "",
      o_.output_dir);
  if (const std::string w = warmup_warning(s_.train, total_steps_); !w.empty()) {
    std::fflush(stdout);  // after the start line it is about
    fmt::print(stderr, "ft train: warning: {}\n", w);
  }
  fmt::print("ft train: strategy {}\n", strategy_plan_.label);
  fmt::print("ft train: device {} ({}){}\n", device_.str(), device_choice_.reason,
             env_.world_size > 1 ? fmt::format(", {} between ranks", world_->backend_name()) : "");
  if (env_.rank0_hosts_store())  // no launcher: say which tasks formed the job, and where
    fmt::print(
        "ft train: {} tasks started by {} joined one job on {} node(s); store {}:{} ({}), "
        "hosted by rank 0\n",
        env_.world_size, env_.started_by, env_.nnodes, env_.master_addr, env_.master_port,
        env_.master_source);
  if (ck_)
    fmt::print("ft train: resuming from {} (step {}, saved by {} rank{})\n", ck_->dir(),
               ck_->step(), ck_->world_size(), ck_->world_size() > 1 ? "s" : "");
  std::fflush(stdout);
}

// One optimizer step: grad_accum micro-batches forward and backward, the update, and what it
// cost, part by part (the checkpointer's turn after the update is timed by train()).
StepRecord TrainingRun::step(ckpt::Checkpointer& checkpointer) {
  const core::StepPoolScope keep_blocks;  // the step's blocks stay for the next step's
  StepRecord r;
  const auto t0 = Clock::now();
  const double comm0 = engine_->comm_wait_s();
  std::vector<data::Batch> mbs;
  const std::vector<SourceCount> placed0 = placed_by_source();
  for (int64_t i = 0; i < s_.train.grad_accum; ++i) mbs.push_back(source_->next().to(device_));
  r.sources = placed_by_source();
  for (size_t k = 0; k < r.sources.size(); ++k) {
    r.sources[k].records -= placed0[k].records;
    r.sources[k].tokens -= placed0[k].tokens;
  }
  if (fault_delay_s_ > 0)
    std::this_thread::sleep_for(std::chrono::duration<double>(fault_delay_s_));
  r.times.data_s = seconds_since(t0);
  const auto t1 = Clock::now();
  r.stats = trainer_->compute_gradients(mbs);
  const double comm1 = engine_->comm_wait_s();
  r.times.compute_s = seconds_since(t1) - (comm1 - comm0);
  // An async checkpoint copies the state while forward and backward ran; the update waits for it.
  const auto t2 = Clock::now();
  checkpointer.before_update();
  r.times.checkpoint_s = seconds_since(t2);
  const auto t3 = Clock::now();
  const double comm2 = engine_->comm_wait_s();
  r.stats = trainer_->apply_update(r.stats);
  // The optimizer's kernels are still queued on a GPU: the step ends when they have run.
  if (device_.is_cuda()) cuda::api().synchronize(device_.index());
  const double comm3 = engine_->comm_wait_s();
  r.times.optimizer_s = seconds_since(t3) - (comm3 - comm2);
  r.times.comm_s = (comm1 - comm0) + (comm3 - comm2);
  r.step_time_s = seconds_since(t0);
  if (exchange_) take_exchange_stats(r);
  for (const auto& b : mbs) r.input_tokens += b.input_tokens();
  r.flops = meter_->flops(mbs);
  r.peak_flops_s = meter_->peak_flops_s();
  r.memory = trainer_->memory();
  if (device_.is_cuda()) {
    const cuda::DeviceMemory m = cuda::api().memory(device_.index(), /*reset_peak=*/true);
    r.memory.on_gpu = true;
    r.memory.gpu_allocated_bytes = m.allocated_bytes;
    r.memory.gpu_reserved_bytes = m.reserved_bytes;
    r.memory.gpu_peak_allocated_bytes = m.peak_allocated_bytes;
  }
  r.peak_rss_bytes = peak_rss_bytes();
  const core::StepPoolStats pool = core::step_pool_stats();
  r.memory.host_pool_bytes = static_cast<int64_t>(pool.live_bytes + pool.idle_bytes);
  r.memory.host_pool_peak_bytes = static_cast<int64_t>(pool.peak_bytes);
  r.samples_consumed = source_->samples_consumed();
  return r;
}

// Every rank's busy time of the step so far (r.step_time_s less its exposed communication),
// shared (one small all-gather), for the straggler watch and rank 0's record; the all-gather's wait
// counts as communication.
void TrainingRun::compare_ranks(StepRecord& r, StragglerWatch& watch) {
  if (env_.world_size == 1) return;
  const double comm0 = engine_->comm_wait_s();
  const double busy = r.step_time_s - r.times.comm_s;
  const std::vector<double> all = engine_->all_gather_values(
      {busy, static_cast<double>(env_.node_rank), device_.is_cuda() ? double(device_.index()) : -1,
       static_cast<double>(r.input_tokens)});
  r.times.comm_s += engine_->comm_wait_s() - comm0;
  if (!rank0_) return;
  std::vector<double> busy_s;
  std::vector<RankPlace> places;
  for (int k = 0; k < env_.world_size; ++k) {
    busy_s.push_back(all[4 * k]);
    const int dev = static_cast<int>(all[4 * k + 2]);
    places.push_back(
        {k, static_cast<int>(all[4 * k + 1]), dev < 0 ? "cpu" : fmt::format("cuda:{}", dev)});
    r.ranks.input_tokens += static_cast<int64_t>(all[4 * k + 3]);
  }
  r.ranks.known = true;
  r.ranks.busy_median_s = lower_median(busy_s);
  const auto slowest = std::max_element(busy_s.begin(), busy_s.end());
  r.ranks.busy_max_s = *slowest;
  r.ranks.slowest_rank = static_cast<int>(slowest - busy_s.begin());
  for (const auto& w : watch.observe(r.stats.step, busy_s, places))
    fmt::print(stderr, "ft train: warning: {}\n", w);
}

// A mixture's records and tokens placed in batches so far on this rank, by source; none without
// a mixture.
std::vector<SourceCount> TrainingRun::placed_by_source() const {
  std::vector<SourceCount> out;
  for (size_t k = 0; mixture_ && k < mixture_->size(); ++k)
    out.push_back({mixture_->name(k), mixture_->records_placed()[k], mixture_->tokens_placed()[k]});
  return out;
}

// A mixture's records and tokens of the step by source, added over the ranks (one all-gather, on
// every rank, after compare_ranks'); its wait counts as communication.
void TrainingRun::add_sources_over_ranks(StepRecord& r) {
  if (r.sources.empty() || env_.world_size == 1) return;
  const double comm0 = engine_->comm_wait_s();
  std::vector<double> mine;
  for (const auto& c : r.sources)
    mine.insert(mine.end(), {static_cast<double>(c.records), static_cast<double>(c.tokens)});
  const std::vector<double> all = engine_->all_gather_values(mine);
  r.times.comm_s += engine_->comm_wait_s() - comm0;
  for (size_t k = 0; k < r.sources.size(); ++k) {
    r.sources[k].records = r.sources[k].tokens = 0;
    for (size_t at = 2 * k; at < all.size(); at += mine.size()) {
      r.sources[k].records += static_cast<int64_t>(all[at]);
      r.sources[k].tokens += static_cast<int64_t>(all[at + 1]);
    }
  }
}

bool TrainingRun::eval_due(const StepRecord& r) const {
  if (!eval_set_ || r.stats.skipped) return false;
  const int64_t step = r.stats.step;
  return (s_.eval.every > 0 && step % s_.eval.every == 0) || step == total_steps_;
}

// eval.data over all ranks: rank k scores batches k, k + W, ... Every rank runs the same number of
// forwards (one short of a batch scores batch 0 again and drops it), because a sharded strategy's
// forward gathers each unit from every rank; then the loss sums and token counts are added over
// the ranks (two scalar collectives, on every rank in this order).
void TrainingRun::evaluate_step(StepRecord& r) {
  const auto t0 = Clock::now();
  const auto n = static_cast<int64_t>(eval_set_->batches.size());
  const int64_t world = env_.world_size;
  double sum = 0, tokens = 0;
  // ft eval's forward (eval.fused_kernels), so that eval_loss is what ft eval would print.
  const model::FusedOps training_ops = model_->fused_ops();
  model_->set_fused_ops(eval_fused_ops(s_.train, s_.eval));
  for (int64_t k = 0; k < (n + world - 1) / world; ++k) {
    const int64_t i = k * world + env_.rank;
    const BatchLoss l = score_batch(*model_, eval_set_->batches[i < n ? i : 0].to(device_));
    if (i >= n) continue;
    sum += l.sum;
    tokens += static_cast<double>(l.tokens);
  }
  model_->set_fused_ops(training_ops);
  if (world > 1) {
    sum = engine_->sum_over_ranks(sum);
    tokens = engine_->sum_over_ranks(tokens);
  }
  FT_CHECK(tokens > 0, eval_name_, ": no token carries a loss (every record is prompt only?)");
  r.eval_loss = sum / tokens;
  r.eval_tokens = static_cast<int64_t>(tokens);
  r.eval_s = seconds_since(t0);
  if (rank0_)
    fmt::print("ft train: step {}: eval loss {:.4f} over {} tokens of {} ({:.1f} s)\n",
               r.stats.step, r.eval_loss, r.eval_tokens, eval_name_, r.eval_s);
}

// What stopping this rank costs, for the launcher (LauncherLink).
void TrainingRun::publish_stop_estimate(const ckpt::Checkpointer& checkpointer,
                                        double iteration_s) {
  launcher_->publish_stop_estimate(trainer_->steps(), checkpointer.committed_step(),
                                   checkpointer.last_save_s(), iteration_s);
}

// The run's records of its steps: metrics.jsonl (rank 0), metrics.rank<k>.jsonl (every rank of
// several), TensorBoard's events (output.tensorboard) and the console (rank 0).
struct TrainingRun::StepLogs {
  MetricsLog log, rank_log;
  Progress progress;
  std::unique_ptr<EventWriter> tensorboard;

  void write_metrics(const StepRecord& r) {
    log.write(r);
    rank_log.write(r);
  }
  void show(const StepRecord& r, bool rank0) {
    if (tensorboard && !r.stats.skipped) tensorboard->write(r.stats.step, tensorboard_scalars(r));
    if (rank0) progress.update(r);
  }
};

TrainingRun::StepLogs TrainingRun::open_step_logs() {
  // A resumed run keeps the records of the steps it does not redo.
  const int64_t keep_through = ck_ ? ck_->step() : -1;
  const fs::path out(o_.output_dir);
  StepLogs logs{MetricsLog(rank0_ ? (out / "metrics.jsonl").string() : "", keep_through),
                MetricsLog(env_.world_size > 1
                               ? (out / fmt::format("metrics.rank{}.jsonl", env_.rank)).string()
                               : "",
                           keep_through),
                Progress(rank0_ ? total_steps_ : 0, s_.train.log_every, trainer_->steps()),
                nullptr};
  if (rank0_ && s_.output.tensorboard)
    logs.tensorboard =
        std::make_unique<EventWriter>((out / "tensorboard").string(), trainer_->steps() + 1);
  return logs;
}

// events.jsonl at the start: damaged checkpoints passed over, the settings changed since the
// run's last start, and the start itself with what the run was given (the report's environment
// table shows it).
void TrainingRun::record_start() {
  for (const auto& d : out_.damage) append_event(events_path(), d);
  if (!out_.changes.empty()) {
    json changes = json::array();
    for (const auto& c : out_.changes) changes.push_back(change_json(c));
    append_event(events_path(), {{"event", "settings_changed"},
                                 {"step", ck_ ? ck_->step() : 0},
                                 {"resume_changed", out_.resume_changed},
                                 {"changes", changes}});
  }
  nlohmann::json start =
      start_event(env_, ck_ ? ck_->step() : 0, device_.str(),
                  env_.world_size > 1 ? world_->backend_name() : "", strategy_plan_.label);
  start.update({{"model", o_.model_dir},
                {"data", data_text_},
                {"tokenizer", o_.tokenizer_path},
                {"command", command_line()},
                {"started_over", out_.started_over}});
  append_event(events_path(), start);
}

// The whole iteration since `t0` is the step; what its parts do not cover is "other".
void set_step_time(StepRecord& r, Clock::time_point t0) {
  r.step_time_s = seconds_since(t0);
  r.times.other_s = r.step_time_s - r.times.data_s - r.times.compute_s - r.times.comm_s -
                    r.times.optimizer_s - r.times.checkpoint_s;
}

// The checkpointer's turn after the update (a save when due, the ranks' agreement to stop),
// timed as the step's checkpoint part. A save that failed stops the run: the step it followed is
// recorded first. Returns whether the run stops here (a signal).
bool TrainingRun::checkpoint_after_step(ckpt::Checkpointer& checkpointer, const RunRecord& record,
                                        StepRecord& r, Clock::time_point t0, StepLogs& logs) {
  const auto t1 = Clock::now();
  const double comm0 = engine_->comm_wait_s();
  const auto checkpoint_done = [&] {
    const double ckpt_comm = engine_->comm_wait_s() - comm0;
    r.times.checkpoint_s += seconds_since(t1) - ckpt_comm;
    r.times.comm_s += ckpt_comm;
    set_step_time(r, t0);
  };
  bool stop = false;
  try {
    stop = checkpointer.after_step(trainer_->steps(), total_steps_, [&] {
      trainer_->settle();
      trainer_->release_host_blocks();
      return make_snapshot(*engine_, *trainer_, *source_, record, env_.rank);
    });
  } catch (...) {
    checkpoint_done();
    logs.write_metrics(r);
    throw;
  }
  checkpoint_done();
  return stop;
}

// What the step's record holds besides its own parts: the ranks compared, a mixture's sources
// added over the ranks, the whole iteration's time and rate, the MFU kept at most 1, and the
// evaluation when one is due. Collectives, in this order on every rank.
void TrainingRun::complete_record(StepRecord& r, Clock::time_point t0, StragglerWatch& watch) {
  compare_ranks(r, watch);  // (on the step time so far)
  add_sources_over_ranks(r);
  set_step_time(r, t0);
  r.tokens_per_s = static_cast<double>(r.input_tokens) / std::max(r.step_time_s, 1e-9);
  meter_->keep_mfu_at_most_one(r);
  if (eval_due(r)) {
    trainer_->settle();
    trainer_->release_host_blocks();
    evaluate_step(r);
  }
}

// The summary's figures after each step that was not skipped.
void tally(RunSummary& sum, const StepRecord& r) {
  if (!r.stats.skipped) {
    if (sum.ran++ == 0) {
      sum.first_loss = r.stats.loss;
      sum.first_step = r.stats.step;
    }
    sum.last_loss = r.stats.loss;
    sum.steps = r.stats.step;
  }
  sum.skipped_steps = r.stats.skipped_total;
}

// A signal stopped the run after a checkpoint: said, recorded, and the summary marked.
RunSummary TrainingRun::stopped(const ckpt::Checkpointer& checkpointer, RunSummary sum) {
  if (rank0_)
    fmt::print(stderr,
               "ft train: stopped after step {} on {}; checkpoint written to {}; run the same "
               "command again to continue (exit {})\n",
               trainer_->steps(), ckpt::Checkpointer::stop_signal(), checkpointer.root(),
               kExitPreempted);
  append_event(events_path(), {{"event", "preempted"},
                               {"step", trainer_->steps()},
                               {"signal", ckpt::Checkpointer::stop_signal()}});
  sum.preempted = true;
  return sum;
}

RunSummary TrainingRun::train() {
  ckpt::Checkpointer checkpointer(checkpointer_options());
  print_start();
  StepLogs logs = open_step_logs();
  record_start();
  const RunRecord record{s_.resolved,          s_.lora.enabled,
                         o_.model_dir,         s_.data.synthetic() ? "" : o_.tokenizer_path,
                         strategy_plan_.label, chat_template_};
  if (ck_) checkpointer.resumed_from(ck_->step());
  publish_stop_estimate(checkpointer, 0);
  StepProfiler profiler(trainer_->steps() + 4, rank0_ ? s_.output.profile_steps : 0, total_steps_,
                        device_.is_cuda(), o_.output_dir);
  meter_->measure();
  RunSummary sum;
  int64_t steps_here = 0;  // steps this process ran (a resumed run starts past 0)
  StragglerWatch stragglers;
  ExpertWatch experts(s_.moe.collapse_steps);
  const double aux_coef = router_aux_coef(s_.moe, model_->config());
  while (trainer_->steps() < total_steps_) {
    const auto t0 = Clock::now();
    profiler.before_step(trainer_->steps() + 1);
    checkpointer.running(trainer_->steps() + 1);
    StepRecord r = step(checkpointer);
    profiler.after_step(trainer_->steps());
    launcher_->report_progress();
    const bool stop = checkpoint_after_step(checkpointer, record, r, t0, logs);
    complete_record(r, t0, stragglers);
    logs.write_metrics(r);
    logs.show(r, rank0_);
    if (const std::string w =
            experts.observe(r.stats.step, r.stats.expert_tokens, r.stats.moe_layers, aux_coef);
        rank0_ && !w.empty())
      fmt::print(stderr, "ft train: {}\n", w);
    publish_stop_estimate(checkpointer, seconds_since(t0) - r.times.checkpoint_s);
    if (++steps_here == StepMeter::kRemeasureStep) meter_->remeasure();
    tally(sum, r);
    if (stop) return stopped(checkpointer, sum);
  }
  trainer_->settle();
  trainer_->release_host_blocks();
  checkpointer.finish(trainer_->steps());
  if (rank0_) logs.progress.finish();
  return sum;
}

void TrainingRun::save_final() {
  FinalSaveOptions fo;
  fo.output_dir = o_.output_dir;
  fo.config = mc_;
  fo.lora = s_.lora.enabled ? &lora_config_ : nullptr;
  fo.dtype = dtype_;
  fo.tokenizer_files = tokenizer_files_of(o_.model_dir);
  if (!s_.data.synthetic() && !o_.tokenizer_path.empty())
    fo.tokenizer_files.push_back(o_.tokenizer_path);
  fo.chat_template = chat_template_;
  fo.steps = trainer_->steps();
  if (rank0_) {
    const std::vector<std::string> committed = ckpt::list_committed(out_.ckpt_root);
    if (!committed.empty()) {
      fo.last_checkpoint = committed.front();
      // list_committed gives step-<N> directories only.
      fo.last_checkpoint_step = ckpt::step_of_dir(committed.front());
    }
  }
  train::save_final(*engine_, fo);
  append_event(events_path(), {{"event", "finished"}, {"step", trainer_->steps()}});
}

std::string TrainingRun::events_path() const {
  return rank0_ ? (fs::path(o_.output_dir) / "events.jsonl").string() : "";
}

}  // namespace

RunSummary run_training(const RunOptions& o, OutputPlan out) {
  const comm::DistEnv env = comm::read_dist_env();
  FT_ASSERT(!out.finished, "a finished run is not trained again (ft train returns first)");
  TrainingRun run(o, env, std::move(out));
  RunSummary sum = run.train();
  if (!sum.preempted) run.save_final();
  return sum;
}

}  // namespace ft::train
