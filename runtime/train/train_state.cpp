#include "train/train_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <mutex>

#include "core/error.h"
#include "cuda/loader.h"

namespace ft::train {

using nlohmann::json;

namespace {

const char* const kStateKinds[] = {"param/", "exp_avg/", "exp_avg_sq/"};
// The generator state this rank continues from: its own at the same world size, else that of
// rank % (the saving run's world size).
// `kind` is cpu, or cuda for the GPU's generator (saved by GPU runs only).
std::string rng_tensor(const ckpt::Checkpoint& ck, int rank, int world_size,
                       const char* kind = "cpu") {
  return fmt::format("rng/{}.rank{}", kind,
                     ck.world_size() == world_size ? rank : rank % ck.world_size());
}

// Why checkpoint `c` holds the state of another model than the one whose pieces are `held` (a
// tensor it lacks, or of another shape); "" when it fits.
std::string other_model(const ckpt::Checkpoint& c,
                        const std::vector<parallel::Engine::Piece>& held) {
  for (const auto& pc : held)
    for (const char* kind : kStateKinds) {
      const std::string t = kind + pc.name;
      if (!c.has(t))
        return fmt::format(
            "{} has no {}, which this run's model trains (a checkpoint of another "
            "model or LoRA targets)",
            c.dir(), t);
      if (c.shape(t) != pc.shape)
        return fmt::format(
            "{}: {} has shape [{}] but this run's model makes it [{}] (a checkpoint of "
            "another model or LoRA shape)",
            c.dir(), t, fmt::join(c.shape(t), ", "), fmt::join(pc.shape, ", "));
    }
  return "";
}

}  // namespace

std::unique_ptr<ckpt::Checkpoint> choose_checkpoint(
    const std::vector<std::string>& candidates, const std::vector<parallel::Engine::Piece>& held,
    parallel::Engine& engine, const std::string& resume,
    std::vector<std::pair<std::string, std::string>>* unusable) {
  for (size_t i = 0; i < candidates.size(); ++i) {
    std::unique_ptr<ckpt::Checkpoint> c;
    std::string why, other;  // damage; the state of another model (not damage)
    try {
      c = std::make_unique<ckpt::Checkpoint>(ckpt::Checkpoint::open(candidates[i]));
      other = other_model(*c, held);
      for (const auto& pc : held)
        for (const char* kind : kStateKinds)
          if (other.empty()) c->verify_range(kind + pc.name, pc.begin, pc.end);
      for (const char* kind : {"cpu", "cuda"}) {
        const std::string rng = rng_tensor(*c, engine.rank(), engine.world_size(), kind);
        if (c->has(rng)) c->verify_range(rng, 0, c->shape(rng)[0]);
      }
    } catch (const FormatError& e) {
      why = e.what();
    }
    // A checkpoint of another model or LoRA shape is refused on every rank, never passed over as
    // damage: falling back would start the run over and write over the other run's files.
    const int64_t verdict = engine.max_over_ranks(!other.empty() ? 2 : why.empty() ? 0 : 1);
    if (verdict == 0) return c;
    if (verdict == 2)
      throw ConfigError(
          (other.empty() ? candidates[i] + " holds the state of another model (another rank "
                                           "says which tensor)"
                         : other) +
          "; it is not damaged, and nothing was written: give the settings and --model it was "
          "saved with, or another --output");
    if (!why.empty())
      fmt::print(stderr, "ft train: rank {}: checkpoint {} is unusable: {}\n", engine.rank(),
                 candidates[i], why);
    FT_CHECK_T(FormatError, resume == "auto", "--resume ", resume,
               ": the checkpoint is unusable (see above); pass an earlier one, or --resume auto");
    if (unusable)
      unusable->emplace_back(candidates[i],
                             why.empty() ? "another rank found its chunks damaged (its output "
                                           "says which)"
                                         : why);
    if (engine.rank() == 0)
      fmt::print(stderr, "ft train: {}\n",
                 i + 1 < candidates.size()
                     ? "falling back to the previous checkpoint, " + candidates[i + 1]
                     : std::string("no usable checkpoint left: starting from the beginning"));
  }
  return nullptr;
}

void restore_state(const ckpt::Checkpoint& ck, const std::vector<parallel::Engine::Piece>& held,
                   Trainer& trainer, data::BatchSource& source, int rank, int world_size,
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
  const bool same = ck.world_size() == world_size;
  const int from = same ? rank : ck.world_size() - 1;
  source.seek(ck.rank_state(from).at("data").get<std::vector<int64_t>>());
  const std::string rng = rng_tensor(ck, rank, world_size);
  if (ck.has(rng)) {
    at::Tensor state = at::empty(ck.shape(rng), at::kByte);
    ck.read_range(rng, 0, state.numel(), state);
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  }
  // A GPU run's dropout draws from its device's generator. (From a CPU checkpoint it keeps the
  // seeded state: masks drawn on another kind of device differ anyway.)
  const std::string cuda_rng = rng_tensor(ck, rank, world_size, "cuda");
  if (device.is_cuda() && ck.has(cuda_rng)) {
    at::Tensor state = at::empty(ck.shape(cuda_rng), at::kByte);
    ck.read_range(cuda_rng, 0, state.numel(), state);
    const auto* b = state.data_ptr<uint8_t>();
    cuda::api().set_generator_state(device.index(), std::vector<uint8_t>(b, b + state.numel()));
  }
}

ckpt::Snapshot make_snapshot(parallel::Engine& engine, Trainer& trainer,
                             const data::BatchSource& source, const RunRecord& record, int rank) {
  at::NoGradGuard no_grad;
  // Host tensors are handed over as views (an async saver copies them on its own thread, see
  // ckpt::Saver::save); device tensors are copied to the host here.
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
  const std::string rng_name = fmt::format("rng/cpu.rank{}", rank);
  s.shapes[rng_name] = {rng.numel()};
  s.pieces.push_back({rng_name, 0, rng.numel(), rng.contiguous()});
  if (const at::Device d = engine.options().device; d.is_cuda()) {
    const std::vector<uint8_t> bytes = cuda::api().generator_state(d.index());
    at::Tensor t = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::copy(bytes.begin(), bytes.end(), t.data_ptr<uint8_t>());
    const std::string name = fmt::format("rng/cuda.rank{}", rank);
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
             {"preset", record.preset},
             {"lora", record.lora},
             {"base_model", record.base_model},
             {"tokenizer", record.tokenizer},
             {"strategy", record.strategy},
             {"chat_template", record.chat_template}};
  s.rank_state = {{"data", source.position()}, {"samples_consumed", source.samples_consumed()}};
  return s;
}

}  // namespace ft::train
