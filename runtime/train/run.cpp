#include "train/run.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/strings.h"
#include "cuda/device.h"
#include "cuda/loader.h"
#include "data/jsonl_source.h"
#include "data/synthetic.h"
#include "dist/dist_env.h"
#include "dist/process_group.h"
#include "io/safetensors.h"
#include "model/llama.h"
#include "model/lora.h"
#include "parallel/strategy.h"
#include "tokenizer/tokenizer.h"
#include "train/metrics.h"
#include "train/trainer.h"

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

// The rows of one epoch of --data, with a progress line when counting takes a while (each record
// is tokenized once).
int64_t count_epoch_rows(data::JsonlSource& source, const std::string& path) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  auto last = start;
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  bool shown = false;
  const int64_t rows = source.rows_per_epoch([&](int64_t done, int64_t total) {
    const auto now = clock::now();
    const double since_start = std::chrono::duration<double>(now - start).count();
    const double since_last = std::chrono::duration<double>(now - last).count();
    if (since_start < 2 || (!tty && since_last < 10 && done < total)) return;
    fmt::print("{}ft train: counting the sequences of one epoch of {}: {}/{} records ({:.0f} s)",
               tty ? "\r" : "", path, done, total, since_start);
    if (!tty) fmt::print("\n");
    std::fflush(stdout);
    last = now;
    shown = true;
  });
  if (shown && tty) fmt::print("\n");
  return rows;
}

const char* const kStateKinds[] = {"param/", "exp_avg/", "exp_avg_sq/"};

// Set by SIGTERM while the training loop runs; the loop checkpoints and stops at the next step.
volatile std::sig_atomic_t g_terminate = 0;
void on_terminate(int) { g_terminate = 1; }

class TermHandler {
 public:
  TermHandler() {
    g_terminate = 0;
    struct sigaction sa {};
    sa.sa_handler = on_terminate;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, &old_);
  }
  ~TermHandler() { ::sigaction(SIGTERM, &old_, nullptr); }
  TermHandler(const TermHandler&) = delete;
  TermHandler& operator=(const TermHandler&) = delete;

 private:
  struct sigaction old_ {};
};

// The generator state this rank continues from: its own at the same world size, else that of
// rank % (the saving run's world size).
// `kind` is cpu, or cuda for the GPU's generator (saved by GPU runs only).
std::string rng_tensor(const ckpt::Checkpoint& ck, int rank, int world_size,
                       const char* kind = "cpu") {
  return fmt::format("rng/{}.rank{}", kind,
                     ck.world_size() == world_size ? rank : rank % ck.world_size());
}

// The newest of `candidates` whose every chunk this rank needs reads back whole, on every rank
// (ranks agree through a collective; a damaged one is named, and auto falls back past it).
std::unique_ptr<ckpt::Checkpoint> choose_checkpoint(
    const std::vector<std::string>& candidates, const std::vector<parallel::Engine::Piece>& held,
    parallel::Engine& engine, const std::string& resume) {
  for (size_t i = 0; i < candidates.size(); ++i) {
    std::unique_ptr<ckpt::Checkpoint> c;
    std::string why;
    try {
      c = std::make_unique<ckpt::Checkpoint>(ckpt::Checkpoint::open(candidates[i]));
      for (const auto& pc : held)
        for (const char* kind : kStateKinds) {
          const std::string t = kind + pc.name;
          FT_CHECK_T(FormatError, c->shape(t) == pc.shape, c->dir(), ": ", t, " has shape ",
                     at::IntArrayRef(c->shape(t)), " but this run's model makes it ",
                     at::IntArrayRef(pc.shape), " (a checkpoint of another model)");
          c->verify_range(t, pc.begin, pc.end);
        }
      for (const char* kind : {"cpu", "cuda"}) {
        const std::string rng = rng_tensor(*c, engine.rank(), engine.world_size(), kind);
        if (c->has(rng)) c->verify_range(rng, 0, c->shape(rng)[0]);
      }
    } catch (const FormatError& e) {
      why = e.what();
    }
    if (engine.max_over_ranks(why.empty() ? 0 : 1) == 0) return c;
    if (!why.empty())
      fmt::print(stderr, "ft train: rank {}: checkpoint {} is unusable: {}\n", engine.rank(),
                 candidates[i], why);
    FT_CHECK_T(FormatError, resume == "auto", "--resume ", resume,
               ": the checkpoint is unusable (see above); pass an earlier one, or --resume auto");
    if (engine.rank() == 0)
      fmt::print(stderr, "ft train: {}\n",
                 i + 1 < candidates.size()
                     ? "falling back to the previous checkpoint, " + candidates[i + 1]
                     : std::string("no usable checkpoint left: starting from the beginning"));
  }
  return nullptr;
}

// Optimizer state, loop counters, RNG and data position from `ck` (after the parameters).
void restore_state(const ckpt::Checkpoint& ck, const std::vector<parallel::Engine::Piece>& held,
                   Trainer& trainer, data::BatchSource& source, const dist::DistEnv& env,
                   at::Device device) {
  for (const auto& pc : held) {
    const int64_t n = pc.end - pc.begin;
    ck.read_range("exp_avg/" + pc.name, pc.begin, pc.end,
                  trainer.optimizer().exp_avg(pc.master).narrow(0, pc.offset, n));
    ck.read_range("exp_avg_sq/" + pc.name, pc.begin, pc.end,
                  trainer.optimizer().exp_avg_sq(pc.master).narrow(0, pc.offset, n));
  }
  const json& t = ck.state().at("trainer");
  Trainer::State st;
  st.step = t.at("step");
  st.skipped = t.at("skipped");
  st.optimizer_steps = t.at("optimizer_steps");
  st.loss_scale = t.at("loss_scale");
  st.growth_tracker = t.at("growth_tracker");
  trainer.restore(st);
  // At the same world size every rank continues its own stream and dropout; at another, the
  // global stream continues from where the saving run's last rank stood.
  const bool same = ck.world_size() == env.world_size;
  const int from = same ? env.rank : ck.world_size() - 1;
  source.seek(ck.rank_state(from).at("data").get<std::vector<int64_t>>());
  const std::string rng = rng_tensor(ck, env.rank, env.world_size);
  if (ck.has(rng)) {
    at::Tensor state = at::empty(ck.shape(rng), at::kByte);
    ck.read_range(rng, 0, state.numel(), state);
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  // A GPU run's dropout draws from its device's generator. (From a CPU checkpoint it keeps the
  // seeded state: masks drawn on another kind of device differ anyway.)
  const std::string cuda_rng = rng_tensor(ck, env.rank, env.world_size, "cuda");
  if (device.is_cuda() && ck.has(cuda_rng)) {
    at::Tensor state = at::empty(ck.shape(cuda_rng), at::kByte);
    ck.read_range(cuda_rng, 0, state.numel(), state);
    const auto* b = state.data_ptr<uint8_t>();
    cuda::api().set_generator_state(device.index(), std::vector<uint8_t>(b, b + state.numel()));
  }
}

// This rank's share of the training state at the current step; copies when `own` (an async save
// must not see the next steps' updates).
ckpt::Snapshot make_snapshot(parallel::Engine& engine, Trainer& trainer,
                             const data::BatchSource& source, const json& preset,
                             const RunOptions& o, const std::string& strategy, bool lora,
                             const dist::DistEnv& env, bool own) {
  at::NoGradGuard no_grad;
  // Host tensors are handed over as views (an async saver copies them on its own thread, see
  // ckpt::Saver::save); device tensors are copied to the host here.
  (void)own;
  auto take = [](const at::Tensor& t) { return t.to(at::kCPU).contiguous(); };
  ckpt::Snapshot s;
  s.step = trainer.steps();
  for (const auto& pc : engine.pieces(true)) {
    const int64_t n = pc.end - pc.begin;
    const at::Tensor* src[] = {&engine.masters()[pc.master].tensor,
                               &trainer.optimizer().exp_avg(pc.master),
                               &trainer.optimizer().exp_avg_sq(pc.master)};
    for (int k = 0; k < 3; ++k) {
      const std::string t = kStateKinds[k] + pc.name;
      s.shapes[t] = pc.shape;
      s.pieces.push_back({t, pc.begin, pc.end, take(src[k]->narrow(0, pc.offset, n))});
    }
  }
  at::Tensor rng;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  const std::string rng_name = fmt::format("rng/cpu.rank{}", env.rank);
  s.shapes[rng_name] = {rng.numel()};
  s.pieces.push_back({rng_name, 0, rng.numel(), rng.contiguous()});
  if (const at::Device d = engine.options().device; d.is_cuda()) {
    const std::vector<uint8_t> bytes = cuda::api().generator_state(d.index());
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::copy(bytes.begin(), bytes.end(), t.data_ptr<uint8_t>());
    const std::string name = fmt::format("rng/cuda.rank{}", env.rank);
    s.shapes[name] = {t.numel()};
    s.pieces.push_back({name, 0, t.numel(), t});
  }
  const Trainer::State ts = trainer.state();
  s.state = {{"trainer",
              {{"step", ts.step},
               {"skipped", ts.skipped},
               {"optimizer_steps", ts.optimizer_steps},
               {"loss_scale", ts.loss_scale},
               {"growth_tracker", ts.growth_tracker}}},
             {"samples_consumed", source.samples_consumed()},
             {"preset", preset},
             {"lora", lora},
             {"base_model", o.model_dir},
             // The --tokenizer file, which `ft export` copies beside the model as final/ has it.
             {"tokenizer", preset["data"]["format"] == "synthetic" ? "" : o.tokenizer_path},
             {"strategy", strategy}};
  s.rank_state = {{"data", source.position()}, {"samples_consumed", source.samples_consumed()}};
  return s;
}

}  // namespace

RunSummary run_training(const RunOptions& o) {
  const json& p = o.preset;
  // --- validate everything before touching the output directory ---
  FT_CHECK(!o.output_dir.empty(), "--output is required");
  const dist::DistEnv env = dist::read_dist_env();
  // Checkpoints to resume from, newest first; which one is used is agreed once the strategy knows
  // what this rank reads.
  const std::string ckpt_root = (fs::path(o.output_dir) / "checkpoints").string();
  std::vector<std::string> candidates;
  if (o.resume == "auto") {
    candidates = ckpt::list_committed(ckpt_root);
  } else if (o.resume != "none") {
    FT_CHECK(fs::is_regular_file(fs::path(o.resume) / ckpt::kMetaFile), "--resume ", o.resume,
             ": not a committed checkpoint (no ", ckpt::kMetaFile,
             "); give a step-N directory under OUTPUT/checkpoints, auto or none");
    candidates = {o.resume};
  }
  // A later launcher round (a node admitted, a restart) that finds the run finished — final/ is
  // complete and no checkpoint is left to continue from — has nothing to do: the round may have
  // begun just as the job ended, and training again would write over the result.
  const fs::path final_path = fs::path(o.output_dir) / "final";
  if (o.resume == "auto" && candidates.empty() && env.restart_count > 0 &&
      (fs::exists(final_path / "config.json") || fs::exists(final_path / "adapter_config.json"))) {
    RunSummary done;
    done.already_finished = true;
    return done;
  }
  // A launcher restart without a checkpoint starts the run over in its own directory.
  // So does `--resume auto` in the directory of an ft run that was interrupted before its first
  // checkpoint was committed (it has preset.json but no final model): nothing there can be resumed.
  const bool interrupted_run = o.resume == "auto" && candidates.empty() &&
                               fs::exists(fs::path(o.output_dir) / "preset.json") &&
                               !fs::exists(fs::path(o.output_dir) / "final");
  if (interrupted_run && env.rank == 0)
    fmt::print(stderr,
               "ft train: {} holds an interrupted run without a committed checkpoint: starting it "
               "over\n",
               o.output_dir);
  FT_CHECK(!candidates.empty() || !fs::exists(o.output_dir) || fs::is_empty(o.output_dir) ||
               (o.resume == "auto" && env.restart_count > 0) || interrupted_run,
           "--output ", o.output_dir,
           " already holds a run (it is not empty) and no checkpoint to resume; choose another "
           "directory so nothing is written over");
  const std::string format = p["data"]["format"];
  const bool synthetic = format == "synthetic";
  FT_CHECK(synthetic == o.data_path.empty(),
           synthetic ? "data.format is synthetic, which generates its data: drop --data "
                     : "data.format '",
           synthetic ? "" : format,
           synthetic ? ""
                     : "' reads JSONL: give the file with --data PATH (or use the built-in task: "
                       "--set data.format=synthetic)");
  // train.max_steps wins; 0 asks for train.epochs passes over the data, counted below once the
  // data source is open.
  int64_t total_steps = p["train"]["max_steps"];
  const double epochs = p["train"]["epochs"];
  FT_CHECK(total_steps > 0 || !synthetic,
           "train.max_steps is 0, which asks for train.epochs passes over the data, but the "
           "synthetic task has no epochs (its stream has no end): set --set train.max_steps=N");
  FT_CHECK(total_steps > 0 || epochs > 0, "train.max_steps and train.epochs are both 0: set ",
           "train.max_steps (optimizer steps) or train.epochs (passes over --data)");
  // The device, before LibTorch is asked anything about CUDA: a GPU run opens libft_cuda.so now.
  const cuda::DeviceChoice device_choice =
      cuda::choose_device(p["hardware"]["device"].get<std::string>(), env.local_rank);
  const at::Device device = device_choice.device;
  if (device.is_cuda()) cuda::use_device(device.index());
  model::LlamaConfig mc = o.model_dir.empty()
                              ? model_config_from_preset(p)
                              : model::load_llama_config(o.model_dir + "/config.json");
  // Open (and validate) the weight files before anything is written.
  std::unique_ptr<io::SafetensorsIndex> weights;
  if (!o.model_dir.empty())
    weights = std::make_unique<io::SafetensorsIndex>(io::SafetensorsIndex::open(o.model_dir));
  const std::string precision = p["precision"]["mode"];
  const at::ScalarType dtype = precision_dtype(precision);
  const uint64_t seed = p["train"]["seed"];
  const int64_t seq_len = p["data"]["seq_len"];
  FT_CHECK(seq_len <= mc.max_position_embeddings, "data.seq_len ", seq_len,
           " exceeds the model's max_position_embeddings ", mc.max_position_embeddings);
  const int64_t grad_accum = p["train"]["grad_accum"];
  const auto checkpointing = model::parse_activation_checkpointing(
      p["train"]["activation_checkpointing"].get<std::string>());
  const int64_t checkpoint_every_n = p["train"]["checkpoint_every_n_layers"];

  parallel::StrategyPlan plan = parallel::plan_strategy(p, o.user_settings, env, device);
  const bool lora = p["lora"]["enabled"];
  // Shapes only: the strategy allocates this rank's part and reads only that from the files.
  model::LlamaModel model(mc, at::TensorOptions().dtype(dtype).device(device),
                          /*materialize=*/false);
  model.set_activation_checkpointing(checkpointing, checkpoint_every_n);
  model::LoraConfig lora_config;
  if (lora) {
    lora_config = lora_config_from_preset(p, o.model_dir);
    model::attach_lora(model, lora_config, seed + 1);
  }
  std::unique_ptr<data::JsonlSource> jsonl;
  int64_t rows_per_epoch = 0;
  if (!synthetic) {
    data::JsonlOptions jo;
    jo.path = o.data_path;
    jo.tokenizer_path = !o.tokenizer_path.empty() ? o.tokenizer_path
                        : !o.model_dir.empty()    ? o.model_dir + "/tokenizer.json"
                                                  : "";
    FT_CHECK(!jo.tokenizer_path.empty(),
             "--data needs a tokenizer: give --tokenizer "
             "PATH/tokenizer.json, or a --model directory that holds tokenizer.json");
    jo.tokenizer = std::make_shared<const tokenizer::Tokenizer>(
        tokenizer::Tokenizer::from_file(jo.tokenizer_path));
    FT_CHECK(static_cast<int64_t>(jo.tokenizer->vocab_size()) <= mc.vocab_size, "the tokenizer ",
             jo.tokenizer_path, " has ", jo.tokenizer->vocab_size(),
             " tokens but the model's vocabulary is ", mc.vocab_size,
             "; use the model's own tokenizer (or --set model.vocab_size)");
    jo.format = data::parse_record_format(format == "tokenized" ? "tokens" : format);
    jo.chat_template = data::parse_chat_template(p["data"]["template"].get<std::string>());
    jo.seq_len = seq_len;
    jo.micro_batch = p["train"]["micro_batch"];
    jo.pack = p["data"]["pack"];
    jo.train_on_prompt = p["data"]["train_on_prompt"];
    jo.on_bad_record = data::parse_bad_record_policy(p["data"]["on_bad_record"].get<std::string>());
    jo.seed = seed;
    jo.rank = env.rank;
    jo.world_size = env.world_size;
    jsonl = std::make_unique<data::JsonlSource>(jo);
    if (total_steps == 0) {
      rows_per_epoch = count_epoch_rows(*jsonl, o.data_path);
      total_steps =
          steps_for_epochs(epochs, rows_per_epoch, jo.micro_batch, grad_accum, env.world_size);
    }
  }

  // Every rank has validated its inputs; forming the process group waits for all of them, so no
  // rank writes into the output directory while another still checks that it is empty.
  std::unique_ptr<dist::ProcessGroup> world, shard_group, replica_group;
  parallel::Groups groups;
  if (env.world_size > 1) {
    dist::ProcessGroupOptions pgo;
    pgo.device = device;  // Gloo on CPU, NCCL on the rank's GPU
    world = std::make_unique<dist::ProcessGroup>(env, pgo);
    groups.world = world.get();
    const int S = plan.engine.shard_size;
    if (S > 1 && S == env.world_size) groups.shard = world.get();
    if (S > 1 && S < env.world_size) {
      shard_group = world->subgroup(fmt::format("shard{}", env.rank / S), plan.shard_ranks);
      groups.shard = shard_group.get();
    }
    if (plan.replicas > 1) {
      replica_group = world->subgroup(fmt::format("replica{}", env.rank % S), plan.replica_ranks);
      groups.replica = replica_group.get();
    }
  }
  const bool rank0 = env.rank == 0;
  LoadRecord load;
  load.source = weights ? "files" : "random init";
  auto specs = parallel::param_specs(model, lora);
  parallel::Engine engine(model, specs, plan.engine, groups);
  const std::vector<parallel::Engine::Piece> held = engine.pieces(false);
  std::unique_ptr<ckpt::Checkpoint> ck = choose_checkpoint(candidates, held, engine, o.resume);
  std::set<std::string> trained;
  for (const auto& s : specs)
    if (s.trained) trained.insert(s.name);
  {
    // This rank's slices: from the files (mapped; only the pages of the slice are read), or the
    // random init streamed one tensor at a time in the order world size 1 draws it.
    parallel::ParamSource adapters = parallel::current_values(specs);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    // The first zeros, copy and read run libtorch code never run before in this process, whose
    // pages then fault in (several MiB, the same for any model): warm them so the peak measured
    // below is the loading's data.
    if (weights) {
      const std::string first = weights->names().front();
      const int64_t n = std::min<int64_t>(weights->info(first).numel(), 4096);
      weights->read_range(first, 0, n, at::zeros({n}, at::TensorOptions().dtype(dtype)));
    }
    load.peak_reset = reset_peak_rss();
    load.rss_before_bytes = rss_bytes();
    const auto t0 = std::chrono::steady_clock::now();
    engine.load([&](const std::string& name, int64_t b, int64_t e, const at::Tensor& dst) {
      if (ck && trained.count(name)) return ck->read_range("param/" + name, b, e, dst);
      if (name.rfind("base_model.", 0) == 0) return adapters(name, b, e, dst);
      const auto& slot = *std::find_if(specs.begin(), specs.end(), [&](const auto& s) {
                            return s.name == name;
                          })->slot;
      if (!weights) {
        dst.copy_(model.init_value(name, slot.sizes(), gen).reshape({-1}).slice(0, b, e));
        return;
      }
      FT_CHECK_T(FormatError, weights->has(name), o.model_dir, ": weight \"", name,
                 "\" is missing from the model files");
      const io::TensorInfo& info = weights->info(name);
      FT_CHECK_T(FormatError, at::IntArrayRef(info.shape) == slot.sizes(),
                 weights->file_of(name).path(), ": ", name, " has shape ",
                 at::IntArrayRef(info.shape), " but config.json makes it ", slot.sizes());
      weights->read_range(name, b, e, dst);
      load.bytes_read += (e - b) * static_cast<int64_t>(c10::elementSize(info.dtype));
    });
    load.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    load.peak_rss_bytes = peak_rss_bytes();
    load.param_bytes = engine.take_accounting().param_bytes;
    // fp32 masters exactly as saved (the compute copies above are their rounding).
    if (ck)
      for (const auto& pc : held)
        ck->read_range("param/" + pc.name, pc.begin, pc.end,
                       engine.masters()[pc.master].tensor.narrow(0, pc.offset, pc.end - pc.begin));
  }

  // Everything the run needs is loaded and checked: only now is anything written.
  std::error_code ec;
  if (rank0) {
    fs::create_directories(o.output_dir, ec);
    FT_CHECK(!ec, "cannot create --output ", o.output_dir, ": ", ec.message());
    write_text_atomic((fs::path(o.output_dir) / "preset.json").string(), p.dump(2) + "\n");
  }
  engine.sum_over_ranks(0);  // the directory exists before any rank writes into it
  fs::create_directories(o.output_dir, ec);
  FT_CHECK(!ec, "cannot create --output ", o.output_dir, ": ", ec.message());
  write_load_record((fs::path(o.output_dir) / fmt::format("load.rank{}.json", env.rank)).string(),
                    load, env.rank, env.world_size);
  if (rank0) {
    fmt::print(
        "ft train: loaded {} of parameters on rank 0 from {} in {:.1f} s (host memory "
        "peak +{})\n",
        human_bytes(load.param_bytes), load.source, load.seconds,
        human_bytes(std::max<int64_t>(0, load.peak_rss_bytes - load.rss_before_bytes)));
    std::fflush(stdout);
  }

  std::unique_ptr<data::BatchSource> source_ptr;
  if (synthetic) {
    data::SyntheticOptions so;
    so.vocab_size = mc.vocab_size;
    so.seq_len = seq_len;
    so.micro_batch = p["train"]["micro_batch"];
    so.train_on_prompt = p["data"]["train_on_prompt"];
    so.pack = p["data"]["pack"];
    so.seed = seed;
    so.rank = env.rank;
    so.world_size = env.world_size;
    source_ptr = std::make_unique<data::SyntheticSource>(so);
  } else {
    source_ptr = std::move(jsonl);
  }
  data::BatchSource& source = *source_ptr;

  TrainOptions to;
  to.precision = precision;
  to.schedule = {p["train"]["lr"], p["train"]["warmup_steps"], total_steps,
                 p["train"]["min_lr_ratio"], p["train"]["schedule"]};
  to.adamw = {p["train"]["beta1"], p["train"]["beta2"], p["train"]["eps"],
              p["train"]["weight_decay"]};
  to.grad_clip = p["train"]["grad_clip"];
  to.loss_scale_init = p["precision"]["loss_scale_init"];
  to.loss_scale_window = p["precision"]["loss_scale_window"];
  Trainer trainer(model, to, engine);
  // LoRA dropout draws from LibTorch's default generators, which start from a random seed in each
  // process: seeding them makes a run with dropout repeat exactly.
  at::manual_seed(seed);
  if (device.is_cuda()) cuda::api().manual_seed(seed);
  if (ck) restore_state(*ck, held, trainer, source, env, device);

  ckpt::SaverOptions so;
  so.root = ckpt_root;
  so.rank = env.rank;
  so.world_size = env.world_size;
  so.keep_last = p["output"]["keep_last"];
  if (world) {
    c10d::Store* store = &world->store();
    so.signal = [store](const std::string& key) { store->set(key, std::vector<uint8_t>{1}); };
    so.wait_all = [store](const std::vector<std::string>& keys) {
      store->wait(keys, std::chrono::minutes(30));
    };
  }
  ckpt::Saver saver(so);
  const int64_t save_every = p["output"]["save_every"];
  const double save_minutes = p["output"]["save_every_minutes"];
  const bool async_save = p["output"]["async_save"];
  auto last_save = std::chrono::steady_clock::now();
  auto next_progress = std::chrono::steady_clock::now();
  std::ofstream ckpt_log;
  std::optional<json> pending_save;  // an async save's record, completed at the next update
  if (rank0 && (save_every > 0 || save_minutes > 0))
    ckpt_log.open((fs::path(o.output_dir) / "checkpoints.jsonl").string(), std::ios::app);

  if (rank0) {
    fmt::print(
        "ft train: {} parameters ({} trained), {} layers, hidden {}, {} precision, {} x {} "
        "sequences of {} tokens per step{}, {} steps{} -> {}\n",
        mc.num_parameters(), lora ? "LoRA adapters" : "all", mc.num_hidden_layers, mc.hidden_size,
        precision, grad_accum, p["train"]["micro_batch"].get<int64_t>(), seq_len,
        env.world_size > 1 ? fmt::format(" on each of {} ranks", env.world_size) : "", total_steps,
        rows_per_epoch > 0 ? fmt::format(" ({:g} epochs of {} sequences)", epochs, rows_per_epoch)
                           : "",
        o.output_dir);
    fmt::print("ft train: strategy {}\n", plan.label);
    fmt::print("ft train: device {} ({}){}\n", device.str(), device_choice.reason,
               env.world_size > 1 ? fmt::format(", {} between ranks", world->backend_name()) : "");
    if (ck)
      fmt::print("ft train: resuming from {} (step {}, saved by {} rank{})\n", ck->dir(),
                 ck->step(), ck->world_size(), ck->world_size() > 1 ? "s" : "");
    std::fflush(stdout);
  }
  // A resumed run keeps the records of the steps it does not redo.
  const int64_t keep_through = ck ? ck->step() : -1;
  MetricsLog log(rank0 ? (fs::path(o.output_dir) / "metrics.jsonl").string() : "", keep_through);
  MetricsLog rank_log(
      env.world_size > 1
          ? (fs::path(o.output_dir) / fmt::format("metrics.rank{}.jsonl", env.rank)).string()
          : "",
      keep_through);
  Progress progress(rank0 ? total_steps : 0, p["train"]["log_every"]);
  RunSummary sum;
  TermHandler term;
  while (trainer.steps() < total_steps) {
    auto t0 = std::chrono::steady_clock::now();
    std::vector<data::Batch> mbs;
    for (int64_t i = 0; i < grad_accum; ++i) mbs.push_back(source.next().to(device));
    StepRecord r;
    r.stats = trainer.compute_gradients(mbs);
    // An async checkpoint copies the state while forward and backward ran; the update waits for it.
    const double fence_s = saver.wait_captured();
    if (pending_save && rank0) {
      (*pending_save)["stall_s"] = (*pending_save)["stall_s"].get<double>() + fence_s;
      ckpt_log << pending_save->dump() << "\n";
      ckpt_log.flush();
    }
    pending_save.reset();
    r.stats = trainer.apply_update(r.stats);
    // The optimizer's kernels are still queued on a GPU: the step ends when they have run.
    if (device.is_cuda()) cuda::api().synchronize(device.index());
    r.step_time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (const auto& b : mbs) r.input_tokens += b.input_tokens();
    r.tokens_per_s = static_cast<double>(r.input_tokens) / std::max(r.step_time_s, 1e-9);
    r.memory = trainer.memory();
    if (device.is_cuda()) {
      const cuda::DeviceMemory m = cuda::api().memory(device.index(), /*reset_peak=*/true);
      r.memory.on_gpu = true;
      r.memory.gpu_allocated_bytes = m.allocated_bytes;
      r.memory.gpu_reserved_bytes = m.reserved_bytes;
      r.memory.gpu_peak_allocated_bytes = m.peak_allocated_bytes;
    }
    r.peak_rss_bytes = peak_rss_bytes();
    r.samples_consumed = source.samples_consumed();
    log.write(r);
    rank_log.write(r);
    if (rank0) progress.update(r);
    if (!r.stats.skipped) {
      if (sum.steps == 0) sum.first_loss = r.stats.loss;
      sum.last_loss = r.stats.loss;
      sum.steps = r.stats.step;
    }
    sum.skipped_steps = r.stats.skipped_total;
    // Progress for the launcher's hang detection (--hang-timeout): at most once a second.
    if (world && std::chrono::steady_clock::now() >= next_progress) {
      world->store().add(fmt::format("ft_progress/{}", env.rank), 1);
      next_progress = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    }

    // Checkpoint: every save_every steps, every save_every_minutes (rank 0's clock decides, so
    // all ranks agree), and at the last step of a run that checkpoints at all.
    // SIGTERM (preemption) on any rank: all ranks save now and stop. One scalar collective per
    // step carries both that and rank 0's clock: 2 = a rank was told to stop, 1 = time to save.
    bool due = save_every > 0 && trainer.steps() % save_every == 0;
    const double since =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - last_save).count();
    const double flags =
        (g_terminate ? 2 : 0) + (rank0 && save_minutes > 0 && since >= save_minutes * 60 ? 1 : 0);
    const double agreed = env.world_size > 1 ? engine.max_over_ranks(flags) : flags;
    const bool stop = agreed >= 2 && trainer.steps() < total_steps;
    due = due || agreed >= 1;
    if ((save_every > 0 || save_minutes > 0) && trainer.steps() == total_steps) due = true;
    if (due) {
      const bool async = async_save && !stop;
      const auto s0 = std::chrono::steady_clock::now();
      saver.save(make_snapshot(engine, trainer, source, p, o, plan.label, lora, env, async), async);
      last_save = std::chrono::steady_clock::now();
      // checkpoints.jsonl (rank 0): what each save cost the training loop, and each write took.
      // The stall of an async save is this call plus the wait before the next update.
      const double stall = std::chrono::duration<double>(last_save - s0).count();
      pending_save = json{{"step", trainer.steps()},
                          {"async", async},
                          {"stall_s", stall},
                          {"previous_write_s", saver.last_write_s()}};
      if (!async && rank0) {
        ckpt_log << pending_save->dump() << "\n";
        ckpt_log.flush();
        pending_save.reset();
      }
      if (rank0 && ::isatty(STDOUT_FILENO) != 1)
        fmt::print("ft train: checkpoint of step {} {} (training paused {:.3f} s)\n",
                   trainer.steps(), async ? "being written" : "written", saver.last_stall_s());
      std::fflush(stdout);
    }
    if (stop) {
      saver.wait();
      if (rank0)
        fmt::print(stderr,
                   "ft train: stopped after step {} on SIGTERM; checkpoint written to {}; run the "
                   "same command again to continue (exit {})\n",
                   trainer.steps(), ckpt_root, kExitPreempted);
      sum.preempted = true;
      return sum;
    }
  }
  saver.wait();  // the last checkpoint is durable (rank 0: committed) before the run reports done
  if (rank0 && pending_save) ckpt_log << pending_save->dump() << "\n";
  if (rank0 && ckpt_log.is_open()) {
    ckpt_log << json{{"step", trainer.steps()}, {"last_write_s", saver.last_write_s()}}.dump()
             << "\n";
    ckpt_log.flush();
  }
  if (rank0) progress.finish();
  // The final model (for LoRA the adapters), one tensor at a time: rank 0 writes each as it
  // receives its pieces from the ranks holding them, and the other ranks walk the writer's order
  // (io::write_order) to send theirs in step. No rank holds more of the model than its own shards
  // and the one tensor being written.
  const std::string final_dir = (fs::path(o.output_dir) / "final").string();
  const at::ScalarType final_dtype = lora ? at::kFloat : dtype;
  io::DeferredTensors final_tensors;
  for (const auto& [name, shape] : engine.parameter_shapes()) {
    if (lora != (name.rfind("base_model.", 0) == 0)) continue;
    // A copy in host memory, whatever device trained (the writer reads host memory).
    final_tensors.push_back({name, shape, final_dtype, [&engine, name = name, final_dtype] {
                               return engine.full_on_rank0(name).to(at::kCPU, final_dtype,
                                                                    false, /*copy=*/true);
                             }});
  }
  FinalSaveRecord fr;
  if (rank0) {
    fr.peak_reset = reset_peak_rss();
    fr.rss_before_bytes = rss_bytes();
  }
  const auto f0 = std::chrono::steady_clock::now();
  if (lora) {
    io::NamedTensors adapters;  // small: made all at once
    for (const auto& d : final_tensors) {
      at::Tensor t = engine.full_on_rank0(d.name);
      if (rank0) adapters.emplace_back(d.name, t.to(at::kCPU, final_dtype, false, true));
    }
    if (rank0) save_final_model(mc, &lora_config, adapters, final_dir);
  } else if (rank0) {
    save_hf_model(mc, final_tensors, final_dir);
  } else {
    for (size_t i : io::write_order(final_tensors)) engine.full_on_rank0(final_tensors[i].name);
  }
  if (!rank0) return sum;
  fr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - f0).count();
  fr.peak_rss_bytes = peak_rss_bytes();
  for (const auto& d : final_tensors) {
    int64_t n = 1;
    for (int64_t x : d.shape) n *= x;
    fr.bytes += n * static_cast<int64_t>(c10::elementSize(final_dtype));
  }
  write_final_save_record((fs::path(o.output_dir) / "final_save.json").string(), fr);
  // The saved model is usable on its own: the tokenizer it was trained with goes beside it.
  std::vector<std::string> tokenizer_files = tokenizer_files_of(o.model_dir);
  if (!synthetic && !o.tokenizer_path.empty()) tokenizer_files.push_back(o.tokenizer_path);
  copy_files_into(tokenizer_files, final_dir);
  return sum;
}

}  // namespace ft::train
