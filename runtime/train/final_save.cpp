#include "train/final_save.h"

#include <fmt/format.h>

#include <chrono>
#include <filesystem>

#include "train/metrics.h"
#include "train/saved_model.h"

namespace ft::train {

namespace fs = std::filesystem;

void save_final(parallel::Engine& engine, const FinalSaveOptions& o) {
  const bool rank0 = engine.rank() == 0;
  const bool lora = o.lora != nullptr;
  const std::string final_dir = (fs::path(o.output_dir) / "final").string();
  const at::ScalarType final_dtype = lora ? at::kFloat : o.dtype;
  io::DeferredTensors final_tensors;
  for (const auto& [name, shape] : engine.parameter_shapes()) {
    if (lora != (name.rfind("base_model.", 0) == 0)) continue;
    // A copy in host memory, whatever device trained (the writer reads host memory).
    final_tensors.push_back({name, shape, final_dtype, [&engine, name = name, final_dtype] {
                               return engine.full_on_rank0(name).to(at::kCPU, final_dtype, false,
                                                                    /*copy=*/true);
                             }});
  }
  FinalSaveRecord record;
  if (rank0) {
    record.peak_reset = reset_peak_rss();
    record.rss_before_bytes = rss_bytes();
  }
  // Which tensors rank 0's writer has gathered: after a failed write it gathers the rest anyway.
  std::vector<char> gathered(final_tensors.size(), 0);
  for (size_t i = 0; i < final_tensors.size(); ++i)
    final_tensors[i].make = [make = std::move(final_tensors[i].make), flag = &gathered[i]] {
      *flag = 1;
      return make();
    };
  const auto t0 = std::chrono::steady_clock::now();
  std::string error;  // rank 0's, when final/ could not be written
  if (lora) {
    io::NamedTensors adapters;  // small: made all at once
    for (const auto& d : final_tensors) {
      at::Tensor t = engine.full_on_rank0(d.name);
      if (rank0) adapters.emplace_back(d.name, t.to(at::kCPU, final_dtype, false, true));
    }
    if (rank0) {
      try {
        save_final_model(o.config, o.lora, adapters, final_dir);
      } catch (const Error& e) {
        error = e.what();
      }
    }
  } else if (rank0) {
    try {
      save_hf_model(o.config, final_tensors, final_dir);
    } catch (const Error& e) {
      error = e.what();
      for (size_t i : hf_make_order(o.config, final_tensors))
        if (!gathered[i]) engine.full_on_rank0(final_tensors[i].name);
    }
  } else {
    // In the order rank 0's writer makes them (a MoE model's experts as their first piece is
    // written): gathering an expert parallel tensor is a collective too.
    for (size_t i : hf_make_order(o.config, final_tensors))
      engine.full_on_rank0(final_tensors[i].name);
  }
  if (rank0 && error.empty()) {
    try {
      // The saved model is usable on its own: the tokenizer it was trained with goes beside it.
      write_tokenizer_files(o.tokenizer_files, o.chat_template, final_dir);
    } catch (const Error& e) {
      error = e.what();
    }
  }
  const bool failed = engine.world_size() > 1 ? engine.max_over_ranks(error.empty() ? 0.0 : 1.0) > 0
                                              : !error.empty();
  if (failed) {
    if (!rank0)
      throw FinalSaveError(
          fmt::format("final/ not saved: rank 0 could not write it (its error is "
                      "in rank 0's output); exit {}",
                      contract::kExitSaveFailed));
    std::error_code ec;
    fs::remove_all(final_dir, ec);
    const std::string removed = ec ? fmt::format(
                                         "the incomplete {} could not be removed ({}): "
                                         "it has no config.json, so nothing takes it "
                                         "for a model",
                                         final_dir, ec.message())
                                   : fmt::format("the incomplete {} was removed", final_dir);
    const std::string resume =
        o.last_checkpoint.empty()
            ? fmt::format(
                  "no checkpoint was committed, so the {} steps are lost unless {} is "
                  "written: make room first",
                  o.steps, final_dir)
            : fmt::format(
                  "the newest committed checkpoint, {} (step {} of {}), is intact: once "
                  "the storage is fixed, run the same command again (--resume auto "
                  "continues from it and writes final/), or ft export it",
                  o.last_checkpoint, o.last_checkpoint_step, o.steps);
    throw FinalSaveError(fmt::format("final/ not saved: {}; {}; {} (exit {})", error, removed,
                                     resume, contract::kExitSaveFailed));
  }
  if (!rank0) return;
  record.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  record.step = o.steps;
  record.peak_rss_bytes = peak_rss_bytes();
  for (const auto& d : final_tensors) {
    int64_t n = 1;
    for (int64_t x : d.shape) n *= x;
    record.bytes += n * static_cast<int64_t>(c10::elementSize(final_dtype));
  }
  try {  // a record of the save, not part of the model: a failure to write it is only told
    write_final_save_record((fs::path(o.output_dir) / "final_save.json").string(), record);
  } catch (const Error& e) {
    fmt::print(stderr, "ft train: warning: final/ is saved, but not final_save.json: {}\n",
               e.what());
  }
}

}  // namespace ft::train
