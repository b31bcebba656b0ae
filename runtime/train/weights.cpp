#include "train/weights.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "model/lora.h"
#include "parallel/strategy.h"

namespace ft::train {

ParamShapes model_param_shapes(const model::ModelConfig& config) {
  model::DecoderModel shapes(config, at::TensorOptions().dtype(at::kFloat), /*materialize=*/false);
  ParamShapes out;
  for (const auto& p : shapes.parameters()) out.emplace_back(p.name, p.tensor->sizes().vec());
  return out;
}

BaseWeights::BaseWeights(const std::string& model_dir, const model::ModelConfig& config,
                         const ParamShapes& params, uint64_t seed)
    : params_(params), gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {
  for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].first] = i;
  if (model_dir.empty()) {
    shapes_ = std::make_unique<model::DecoderModel>(config, at::TensorOptions().dtype(at::kFloat),
                                                    /*materialize=*/false);
    return;
  }
  files_ = std::make_unique<io::SafetensorsIndex>(io::SafetensorsIndex::open(model_dir));
  for (const auto& [name, shape] : params_) {
    if (!files_->has(name)) {
      auto pieces = model::expert_file_pieces(config, name);
      if (!pieces.empty() && files_->has(pieces.front().file_name)) pieces_[name] = pieces;
    }
    check_in_files(name, shape);
  }
}

void BaseWeights::check_in_files(const std::string& name, const std::vector<int64_t>& shape) {
  auto check_shape = [&](const std::string& file_name, const std::vector<int64_t>& want) {
    const io::TensorInfo& info = files_->info(file_name);
    FT_CHECK_T(FormatError, info.shape == want, files_->file_of(file_name).path(), ": ", file_name,
               " has shape ", at::IntArrayRef(info.shape), " but config.json makes it ",
               at::IntArrayRef(want));
  };
  const auto& pieces = pieces_of(name);
  if (pieces.empty()) {
    FT_CHECK_T(FormatError, files_->has(name), files_->dir(), ": weight \"", name,
               "\" is missing from the model files");
    return check_shape(name, shape);
  }
  for (const auto& p : pieces) {
    FT_CHECK_T(FormatError, files_->has(p.file_name), files_->dir(), ": weight \"", p.file_name,
               "\" is missing from the model files (the other experts of its layer are there, ",
               "per expert; a fused checkpoint would hold \"", name, "\")");
    check_shape(p.file_name, p.shape);
  }
}

const std::vector<model::ExpertFilePiece>& BaseWeights::pieces_of(const std::string& name) const {
  static const std::vector<model::ExpertFilePiece> kNone;
  const auto it = pieces_.find(name);
  return it == pieces_.end() ? kNone : it->second;
}

size_t BaseWeights::index_of(const std::string& name) const {
  auto it = index_.find(name);
  FT_ASSERT(it != index_.end(), "not a parameter of the model: ", name);
  return it->second;
}

at::Tensor BaseWeights::draw(size_t index) {
  auto state_of = [](at::Generator& g) {
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  };
  while (next_ <= index) {
    states_.push_back(state_of(gen_));
    const auto& [name, shape] = params_[next_++];
    at::Tensor value = shapes_->init_value(name, shape, gen_);
    if (next_ > index) return value;
  }
  at::Generator again = at::make_generator<at::CPUGeneratorImpl>(0);
  {
    std::lock_guard<std::mutex> lock(again.mutex());
    again.set_state(states_[index]);
  }
  return shapes_->init_value(params_[index].first, params_[index].second, again);
}

void BaseWeights::read_range(const std::string& name, int64_t begin, int64_t end,
                             const at::Tensor& dst) {
  if (!files_) {
    dst.copy_(draw(index_of(name)).reshape({-1}).slice(0, begin, end));
    return;
  }
  const auto& pieces = pieces_of(name);
  if (pieces.empty()) {
    files_->read_range(name, begin, end, dst);
    bytes_read_ += (end - begin) * static_cast<int64_t>(c10::elementSize(files_->info(name).dtype));
    return;
  }
  // The range crosses the per-expert tensors it overlaps, each read where it lands in dst.
  const at::Tensor flat = dst.view({-1});
  for (const auto& p : pieces) {
    const int64_t b = std::max(begin, p.offset), e = std::min(end, p.offset + p.numel());
    if (b >= e) continue;
    files_->read_range(p.file_name, b - p.offset, e - p.offset, flat.narrow(0, b - begin, e - b));
    bytes_read_ +=
        (e - b) * static_cast<int64_t>(c10::elementSize(files_->info(p.file_name).dtype));
  }
}

void BaseWeights::copy_to(const std::string& name, const at::Tensor& dst) {
  if (!files_) {
    dst.copy_(draw(index_of(name)));
    return;
  }
  if (!pieces_of(name).empty()) return read_range(name, 0, dst.numel(), dst);
  files_->copy_to(name, dst);
  bytes_read_ += static_cast<int64_t>(files_->info(name).nbytes());
}

at::Tensor BaseWeights::fp32(const std::string& name, at::ScalarType compute) {
  if (files_ && !pieces_of(name).empty()) {
    const at::Tensor out = at::empty(params_[index_of(name)].second, at::kFloat);
    read_range(name, 0, out.numel(), out);
    return out;
  }
  if (files_) return files_->tensor(name).to(at::kFloat);
  return draw(index_of(name)).to(compute).to(at::kFloat);
}

void BaseWeights::warm_up(at::ScalarType dtype) {
  if (!files_ || params_.empty()) return;
  const std::string& first = params_.front().first;
  const int64_t n = std::min<int64_t>(files_->info(first).numel(), 4096);
  files_->read_range(first, 0, n, at::zeros({n}, at::TensorOptions().dtype(dtype)));
}

void load_adapter(model::DecoderModel& model, const std::string& adapter_dir) {
  auto adapter = io::SafetensorsFile::open(adapter_dir + "/adapter_model.safetensors");
  for (auto& t : model::lora_parameters(model)) {
    FT_CHECK_T(FormatError, adapter.has(t.name), adapter_dir, "/adapter_model.safetensors: \"",
               t.name, "\" is missing (adapter for another model or other target modules?)");
    adapter.copy_to(t.name, *t.tensor);
  }
}

parallel::ParamSource run_param_source(BaseWeights& base, const ckpt::Checkpoint* ck,
                                       const std::vector<parallel::ParamSpec>& specs) {
  std::set<std::string> trained;
  for (const auto& s : specs)
    if (s.trained) trained.insert(s.name);
  parallel::ParamSource adapters = parallel::current_values(specs);
  return [&base, ck, trained, adapters](const std::string& name, int64_t b, int64_t e,
                                        const at::Tensor& dst) {
    if (ck && trained.count(name)) return ck->read_range("param/" + name, b, e, dst);
    // A base tensor a LoRA run trains in full (a router, lora.train_router) goes by its PEFT
    // name, "base_model.model." before the base's: it starts as the base's value.
    static const std::string kPeft = "base_model.model.";
    if (name.rfind(kPeft, 0) == 0 && name.find(".lora_") == std::string::npos)
      return base.read_range(name.substr(kPeft.size()), b, e, dst);
    if (name.rfind("base_model.", 0) == 0) return adapters(name, b, e, dst);
    base.read_range(name, b, e, dst);
  };
}

}  // namespace ft::train
