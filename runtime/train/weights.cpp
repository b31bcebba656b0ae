#include "train/weights.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <mutex>
#include <set>

#include "ckpt/checkpoint.h"
#include "core/error.h"
#include "core/json.h"
#include "model/lora.h"
#include "model/quantized_linear.h"
#include "parallel/strategy.h"

namespace ft::train {

ParamShapes model_param_shapes(const model::ModelConfig& config) {
  model::DecoderModel shapes(config, at::TensorOptions().dtype(at::kFloat), /*materialize=*/false);
  ParamShapes out;
  for (const auto& p : shapes.parameters())
    out.emplace_back(
        p.name, p.nf4 ? std::vector<int64_t>{p.nf4->rows, p.nf4->cols} : p.tensor->sizes().vec());
  return out;
}

BaseWeights::BaseWeights(const std::string& model_dir, const model::ModelConfig& config,
                         const ParamShapes& params, uint64_t seed)
    : params_(params), quant_(config.quant), gen_(at::make_generator<at::CPUGeneratorImpl>(seed)) {
  for (size_t i = 0; i < params_.size(); ++i) index_[params_[i].first] = i;
  shapes_ = std::make_unique<model::DecoderModel>(config, at::TensorOptions().dtype(at::kFloat),
                                                  /*materialize=*/false);
  for (const auto& p : shapes_->parameters())
    if (p.nf4) nf4_[p.name] = *p.nf4;
  if (model_dir.empty()) return;
  files_ = std::make_unique<io::SafetensorsIndex>(io::SafetensorsIndex::open(model_dir));
  for (const auto& [name, shape] : params_) {
    if (const model::Nf4Shape* q = nf4_of(name)) {
      if (quant_.in_files) {
        check_nf4_in_files(name, *q);
        continue;
      }
      check_in_files(name, {q->rows, q->cols});
      continue;
    }
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

const model::Nf4Shape* BaseWeights::nf4_of(const std::string& name) const {
  const auto it = nf4_.find(name);
  return it == nf4_.end() ? nullptr : &it->second;
}

// bitsandbytes' serialization of a Linear4bit weight (Params4bit /
// QuantState.as_dict(packed=True)):
// "<name>" the packed codes (uint8 [bytes, 1], or the bytes as bnb_4bit_quant_storage's dtype),
// "<name>.absmax" (fp32, or uint8 with double quantization), "<name>.quant_map" (the 16 codes),
// "<name>.nested_absmax" and "<name>.nested_quant_map" (double quantization), and
// "<name>.quant_state.bitsandbytes__nf4", a JSON object in uint8 with quant_type, blocksize,
// shape, dtype and nested_offset.
void BaseWeights::check_nf4_in_files(const std::string& name, const model::Nf4Shape& q) {
  const std::string state = name + ".quant_state.bitsandbytes__nf4";
  for (const std::string& part : {name, name + ".absmax", name + ".quant_map", state})
    FT_CHECK_T(FormatError, files_->has(part), files_->dir(), ": \"", part,
               "\" is missing from the model files (config.json's quantization_config says "
               "bitsandbytes 4-bit NF4: every decoder projection needs its packed weight, "
               "absmax, quant_map and quant_state)");
  const io::TensorInfo& packed = files_->info(name);
  FT_CHECK_T(FormatError, packed.nbytes() == static_cast<size_t>(q.packed_bytes()),
             files_->file_of(name).path(), ": ", name, " holds ", packed.nbytes(),
             " bytes, but NF4 codes of a [", q.rows, ", ", q.cols, "] weight take ",
             q.packed_bytes());
  for (const std::string& part : {name + ".nested_absmax", name + ".nested_quant_map"})
    FT_CHECK_T(FormatError, files_->has(part) == quant_.double_quant, files_->dir(), ": \"", part,
               quant_.double_quant ? "\" is missing" : "\" is there",
               ", but config.json's quantization_config has bnb_4bit_use_double_quant ",
               quant_.double_quant ? "true" : "false");
  // Sizes: one absmax per block of 64 (a uint8 index with double quantization, else fp32), one
  // nested absmax per 256 of them, maps of 16 and 256 codes.
  auto check_size = [&](const std::string& part, int64_t want) {
    const int64_t have = files_->info(part).numel();
    FT_CHECK_T(FormatError, have == want, files_->file_of(part).path(), ": ", part, " holds ", have,
               " values, but a [", q.rows, ", ", q.cols, "] weight in NF4 blocks of ", q.blocksize,
               " needs ", want);
  };
  nf4_offsets_[name] = nf4_state(name, q);
  check_size(name + ".absmax", q.blocks());
  check_size(name + ".quant_map", 16);
  if (quant_.double_quant) {
    check_size(name + ".nested_absmax", (q.blocks() + 255) / 256);
    check_size(name + ".nested_quant_map", 256);
  }
}

// The checked quant_state and quant_map of a bitsandbytes NF4 weight; returns the double
// quantization's offset (0 without it).
float BaseWeights::nf4_state(const std::string& name, const model::Nf4Shape& q) {
  const std::string state_key = name + ".quant_state.bitsandbytes__nf4";
  const std::string where = files_->file_of(state_key).path() + ": " + state_key;
  const at::Tensor state_bytes = files_->tensor(state_key).contiguous().view(at::kByte);
  const std::string text(reinterpret_cast<const char*>(state_bytes.data_ptr<uint8_t>()),
                         static_cast<size_t>(state_bytes.numel()));
  const nlohmann::json state = parse_json<FormatError>(text, where);
  auto field = [&](const char* key) -> const nlohmann::json& {
    FT_CHECK_T(FormatError, state.contains(key), where, ": no \"", key, "\"");
    return state.at(key);
  };
  FT_CHECK_T(FormatError, field("quant_type") == "nf4", where, ": quant_type ",
             field("quant_type").dump(), " is not nf4");
  FT_CHECK_T(FormatError, field("blocksize") == q.blocksize, where, ": blocksize ",
             field("blocksize").dump(), " (ft reads NF4 in blocks of ", q.blocksize, ")");
  FT_CHECK_T(FormatError, field("shape") == nlohmann::json::array({q.rows, q.cols}), where,
             ": shape ", field("shape").dump(), " but config.json makes it [", q.rows, ", ", q.cols,
             "]");
  const at::Tensor code = files_->tensor(name + ".quant_map").to(at::kFloat);
  const auto& nf4 = model::nf4_code();
  FT_CHECK_T(
      FormatError,
      code.numel() == 16 && at::equal(code, at::tensor(std::vector<float>(nf4.begin(), nf4.end()))),
      files_->file_of(name).path(), ": ", name,
      ".quant_map is not the NF4 code table (another 4-bit type?)");
  if (!quant_.double_quant) return 0.0f;
  FT_CHECK_T(FormatError, field("nested_offset").is_number(), where, ": nested_offset ",
             field("nested_offset").dump(), " is not a number");
  return static_cast<float>(field("nested_offset").get<double>());
}

model::Nf4Weight BaseWeights::nf4_from_files(const std::string& name, const model::Nf4Shape& q) {
  const float offset = nf4_offsets_.at(name);  // read and checked when the files were opened
  model::Nf4Weight w;
  w.shape = {q.rows, q.cols};
  w.blocksize = q.blocksize;
  w.packed = files_->tensor(name).contiguous().view({-1}).view(at::kByte);
  w.absmax = files_->tensor(name + ".absmax");
  if (quant_.double_quant) {
    w.nested_absmax = files_->tensor(name + ".nested_absmax").to(at::kFloat);
    w.nested_code = files_->tensor(name + ".nested_quant_map").to(at::kFloat);
    w.offset = offset;
  } else {
    w.absmax = w.absmax.to(at::kFloat);
  }
  return w;
}

const at::Tensor& BaseWeights::nf4_blob(const std::string& name, const model::Nf4Shape& q) {
  if (blob_name_ == name) return blob_;
  blob_ = at::Tensor();
  if (files_ && quant_.in_files) {
    blob_ = model::nf4_blob(nf4_from_files(name, q));
    for (const char* part : {"", ".absmax", ".nested_absmax"})
      if (files_->has(name + part))
        bytes_read_ += static_cast<int64_t>(files_->info(name + part).nbytes());
  } else {
    at::Tensor w = files_ ? files_->tensor(name) : draw(index_of(name));
    if (files_) bytes_read_ += static_cast<int64_t>(files_->info(name).nbytes());
    blob_ = model::nf4_blob(model::quantize_nf4(w, quant_.double_quant, q.blocksize));
  }
  blob_name_ = name;
  return blob_;
}

// Bytes [b, e) of the blob of `name`, quantized from the values of the blocks they hold only: the
// packed codes' blocks and the absmax values' blocks the range overlaps, each quantized alone (a
// block's codes and absmax depend on its own values; the short last block stays the last).
at::Tensor BaseWeights::nf4_blob_range(const std::string& name, const model::Nf4Shape& q, int64_t b,
                                       int64_t e) {
  at::Tensor out = at::zeros({e - b}, at::kByte);  // the padding before the absmax stays 0
  const int64_t n = q.numel(), bs = q.blocksize, ao = q.absmax_offset();
  // The blocks the range's codes cover and those its absmax values belong to.
  const int64_t p0 = std::max<int64_t>(b, 0), p1 = std::min(e, q.packed_bytes());
  const int64_t a0 = std::max(b, ao), a1 = std::min(e, q.bytes());
  const bool codes = p0 < p1, scales = a0 < a1;
  const int64_t ck0 = codes ? 2 * p0 / bs : 0,
                ck1 = codes ? (std::min(2 * p1, n) + bs - 1) / bs : 0;
  const int64_t sk0 = scales ? (a0 - ao) / 4 : 0, sk1 = scales ? (a1 - ao + 3) / 4 : 0;
  // Blocks [k0, k1) quantized from their values, as one weight; the codes' and the absmax
  // values' blocks at once when they overlap (a whole-tensor read), else each alone.
  auto quantize = [&](int64_t k0, int64_t k1) {
    const int64_t v0 = k0 * bs, v1 = std::min(n, k1 * bs);
    at::Tensor values = at::empty({v1 - v0}, at::kFloat);
    files_->read_range(name, v0, v1, values);
    bytes_read_ += (v1 - v0) * static_cast<int64_t>(c10::elementSize(files_->info(name).dtype));
    return model::quantize_nf4(values, false, bs);
  };
  auto put_codes = [&](const model::Nf4Weight& w, int64_t k0) {
    out.narrow(0, p0 - b, p1 - p0).copy_(w.packed.narrow(0, p0 - k0 * bs / 2, p1 - p0));
  };
  auto put_scales = [&](const model::Nf4Weight& w, int64_t k0) {
    out.narrow(0, a0 - b, a1 - a0)
        .copy_(w.absmax.view(at::kByte).narrow(0, a0 - ao - 4 * k0, a1 - a0));
  };
  if (codes && scales && ck0 < sk1 && sk0 < ck1) {
    const int64_t k0 = std::min(ck0, sk0), k1 = std::max(ck1, sk1);
    const model::Nf4Weight w = quantize(k0, k1);
    put_codes(w, k0);
    put_scales(w, k0);
    return out;
  }
  if (codes) put_codes(quantize(ck0, ck1), ck0);
  if (scales) put_scales(quantize(sk0, sk1), sk0);
  return out;
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
  if (const model::Nf4Shape* q = nf4_of(name)) {
    if (begin == end) return;  // (a rank that holds none of it quantizes none of it)
    const auto size = static_cast<int64_t>(c10::elementSize(dst.scalar_type()));
    // Without double quantization a block's bytes depend on its values alone: a slice is made
    // from the weight's values it covers. (Double quantization needs every block's absmax.)
    const at::Tensor bytes = files_ && !quant_.in_files && !quant_.double_quant
                                 ? nf4_blob_range(name, *q, begin * size, end * size)
                                 : nf4_blob(name, *q).slice(0, begin * size, end * size);
    dst.view({-1}).copy_(bytes.view(dst.scalar_type()));
    return;
  }
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
  if (nf4_of(name)) return read_range(name, 0, dst.numel(), dst);
  if (!files_) {
    dst.copy_(draw(index_of(name)));
    return;
  }
  if (!pieces_of(name).empty()) return read_range(name, 0, dst.numel(), dst);
  files_->copy_to(name, dst);
  bytes_read_ += static_cast<int64_t>(files_->info(name).nbytes());
}

at::Tensor BaseWeights::fp32(const std::string& name, at::ScalarType compute) {
  if (const model::Nf4Shape* q = nf4_of(name))
    return model::dequantize_blob(nf4_blob(name, *q), *q, at::kFloat);
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
