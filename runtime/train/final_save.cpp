#include "train/final_save.h"

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
  const auto t0 = std::chrono::steady_clock::now();
  if (lora) {
    io::NamedTensors adapters;  // small: made all at once
    for (const auto& d : final_tensors) {
      at::Tensor t = engine.full_on_rank0(d.name);
      if (rank0) adapters.emplace_back(d.name, t.to(at::kCPU, final_dtype, false, true));
    }
    if (rank0) save_final_model(o.config, o.lora, adapters, final_dir);
  } else if (rank0) {
    save_hf_model(o.config, final_tensors, final_dir);
  } else {
    for (size_t i : io::write_order(final_tensors)) engine.full_on_rank0(final_tensors[i].name);
  }
  if (!rank0) return;
  record.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  record.peak_rss_bytes = peak_rss_bytes();
  for (const auto& d : final_tensors) {
    int64_t n = 1;
    for (int64_t x : d.shape) n *= x;
    record.bytes += n * static_cast<int64_t>(c10::elementSize(final_dtype));
  }
  write_final_save_record((fs::path(o.output_dir) / "final_save.json").string(), record);
  // The saved model is usable on its own: the tokenizer it was trained with goes beside it.
  copy_files_into(o.tokenizer_files, final_dir);
}

}  // namespace ft::train
