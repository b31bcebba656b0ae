// Optimizer-step rate of ft's training loop on random tokens (no data pipeline in the timing), for
// comparison with bench/train_step_ref.py, the same model and loop in plain PyTorch.
//   ft_bench_train_step --hidden 256 --layers 2 --heads 4 --inter 688 --vocab 32000 --batch 8
//                       --seq 128 --steps 20 --warmup 3 --precision fp32
//   ft_bench_train_step --config DIR/config.json --batch 1 --seq 64   (another family's model,
//                       read as `ft train` reads it; the shape flags are then not used)
// Prints one JSON line: {"steps_per_s": ..., "step_time_s": {"median": ..., "min": ...}, ...}.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>

#include <sys/resource.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>

#include "core/host_alloc.h"
#include "model/config.h"
#include "model/decoder.h"
#include "parallel/strategy.h"
#include "train/trainer.h"

using namespace ft;

namespace {
// The process's peak resident memory (VmHWM), MiB.
double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}
}  // namespace

int main(int argc, char** argv) {
  // As `ft train` does (core::configure_host_malloc), the step pool after the flags.
  ft::core::limit_malloc_arenas();
  ft::core::keep_freed_heap();
  CLI::App app{"ft training-step benchmark"};
  int64_t hidden = 256, layers = 2, heads = 4, kv_heads = 0, inter = 688, vocab = 32000, batch = 8,
          seq = 128, steps = 20, warmup = 3, threads = 0;
  std::string precision = "fp32", config_path;
  bool fused_loss = true;
  app.add_option("--hidden", hidden);
  app.add_option("--layers", layers);
  app.add_option("--heads", heads);
  app.add_option("--kv-heads", kv_heads);
  app.add_option("--inter", inter);
  app.add_option("--vocab", vocab);
  app.add_option("--batch", batch);
  app.add_option("--seq", seq);
  app.add_option("--steps", steps);
  app.add_option("--warmup", warmup);
  app.add_option("--threads", threads);
  app.add_option("--precision", precision);
  app.add_option("--config", config_path,
                 "a config.json of any family ft trains (model/family.h), in place of the shape "
                 "flags, which build a Llama");
  app.add_option("--fused-loss", fused_loss, "train.fused_loss (the LM head and loss in chunks)");
  bool fused_kernels = true;
  app.add_option("--fused-kernels", fused_kernels,
                 "train.fused_rms_norm, fused_swiglu and fused_rope together");
  bool step_pool = true;
  app.add_option("--step-pool", step_pool,
                 "LibTorch's CPU allocator is ft's step pool (core/host_alloc.h); 0: glibc's");
  CLI11_PARSE(app, argc, argv);
  if (step_pool) ft::core::install_step_pool();
  if (threads > 0) at::set_num_threads(static_cast<int>(threads));

  model::ModelConfig c;
  if (!config_path.empty()) {
    try {
      c = model::load_model_config(config_path);
    } catch (const std::exception& e) {  // a bad file: its message names the file and key
      fmt::print(stderr, "ft_bench_train_step: {}\n", e.what());
      return 2;
    }
  } else {
    c.vocab_size = vocab;
    c.hidden_size = hidden;
    c.intermediate_size = inter;
    c.num_hidden_layers = layers;
    c.num_attention_heads = heads;
    c.num_key_value_heads = kv_heads > 0 ? kv_heads : heads;
    c.head_dim = hidden / heads;
    c.max_position_embeddings = seq;
  }
  model::DecoderModel m(c, at::TensorOptions().dtype(ft::parse_dtype(precision)));
  m.init_random(0);
  m.set_fused_ops({fused_kernels, fused_kernels, fused_kernels});
  train::TrainOptions to;
  to.precision = precision;
  to.schedule = {1e-4, 0, 1000000, 1.0, "constant"};
  to.grad_clip = 1.0;
  to.fused_loss = fused_loss;
  auto engine = parallel::single_process_engine(m, false, ft::parse_dtype(precision));
  train::Trainer tr(m, to, *engine);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  std::vector<double> times;
  double grad_s = 0, update_s = 0;  // forward+backward vs reduce/clip/AdamW, summed
  for (int64_t i = 0; i < warmup + steps; ++i) {
    at::Tensor ids = at::randint(c.vocab_size, {batch, seq}, gen, at::kLong);
    data::Batch b{ids, ids, at::Tensor(), at::Tensor()};
    const ft::core::StepPoolScope keep_blocks;  // as TrainingRun::step
    auto t0 = std::chrono::steady_clock::now();
    auto st = tr.compute_gradients({b});
    auto t1 = std::chrono::steady_clock::now();
    tr.apply_update(st);
    auto t2 = std::chrono::steady_clock::now();
    double dt = std::chrono::duration<double>(t2 - t0).count();
    if (i >= warmup) {
      times.push_back(dt);
      grad_s += std::chrono::duration<double>(t1 - t0).count();
      update_s += std::chrono::duration<double>(t2 - t1).count();
    }
  }
  std::sort(times.begin(), times.end());
  double median = times[times.size() / 2];
  fmt::print(
      "{{\"impl\": \"ft\", \"steps_per_s\": {:.4f}, \"step_time_s\": {{\"median\": {:.5f}, "
      "\"min\": {:.5f}}}, \"forward_backward_share\": {:.3f}, \"threads\": {}, "
      "\"params\": {}, \"peak_rss_mib\": {:.1f}}}\n",
      1.0 / median, median, times.front(), grad_s / (grad_s + update_s), at::get_num_threads(),
      c.num_parameters(), peak_rss_mib());
  return 0;
}
