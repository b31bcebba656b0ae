// Where a model's parameter values come from, for `ft train`, `ft eval` and `ft export` alike: the
// base weights (a Hugging Face directory's safetensors files, or the random init a run draws from
// train.seed), a PEFT adapter directory, and for a training run the checkpoint it resumes and the
// fresh adapters. The model files are checked once, when they are opened: every parameter the
// model has is there with its shape. Not thread-safe (the random init is one generator).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"
#include "model/config.h"
#include "model/decoder.h"
#include "parallel/engine.h"

namespace ft::ckpt {
class Checkpoint;
}

namespace ft::train {

// Parameter names with their shapes, in file order.
using ParamShapes = std::vector<std::pair<std::string, std::vector<int64_t>>>;

// Every parameter `config` gives the model, in file order (a tied head is the embedding); an NF4
// projection with its own shape [rows, cols], not its blob's.
ParamShapes model_param_shapes(const model::ModelConfig& config);

class BaseWeights {
 public:
  // `model_dir`: its safetensors files, FormatError naming the file and the weight unless every
  // parameter of `params` is there with its shape. "": transformers' random init of `config`
  // drawn from `seed`, in parameter order, one tensor at a time. With an NF4 base
  // (config.quant) a quantized projection's values are its blob (model/nf4.h), in the elements
  // of the dtype it is read into: quantized from the weight as read (a slice from the blocks it
  // covers; with double quantization, which needs every block, from the whole weight, one at a
  // time), or assembled from bitsandbytes' tensors (quant.in_files).
  BaseWeights(const std::string& model_dir, const model::ModelConfig& config,
              const ParamShapes& params, uint64_t seed);

  bool from_files() const { return files_ != nullptr; }
  // Elements [begin, end) of parameter `name` flattened, into `dst` (converted to its dtype).
  void read_range(const std::string& name, int64_t begin, int64_t end, const at::Tensor& dst);
  // The whole parameter into `dst` (its shape), converted to its dtype.
  void copy_to(const std::string& name, const at::Tensor& dst);
  // The whole parameter in fp32, as a run computing in `compute` held it (a random init rounded
  // to that dtype; file weights as stored; an NF4 projection dequantized, [rows, cols]).
  at::Tensor fp32(const std::string& name, at::ScalarType compute);
  // Bytes read from the model files so far.
  int64_t bytes_read() const { return bytes_read_; }
  // Runs one small read of `dtype` so that the code pages of the first read are resident before
  // a load's memory is measured.
  void warm_up(at::ScalarType dtype);

 private:
  // Random init: the value of params_[index], drawn from the generator state before it (the
  // stream runs forward as needed; the state before each parameter is kept, so any parameter
  // can be drawn again in any order).
  at::Tensor draw(size_t index);
  size_t index_of(const std::string& name) const;
  // Checks that `name` (of `shape`) is in the files, under its own name or, for a MoE layer's
  // fused expert tensors, as the per-expert tensors of the checkpoint's other layout.
  void check_in_files(const std::string& name, const std::vector<int64_t>& shape);
  // The per-expert pieces `name` is read from (empty: read under its own name).
  const std::vector<model::ExpertFilePiece>& pieces_of(const std::string& name) const;
  // NF4 projections: the shape of `name`'s blob (null: not quantized), the checks of a quantized
  // checkpoint's tensors, and the blob itself (uint8; the last one made is kept, as a sharded
  // load reads each weight's slices one after another).
  const model::Nf4Shape* nf4_of(const std::string& name) const;
  void check_nf4_in_files(const std::string& name, const model::Nf4Shape& shape);
  const at::Tensor& nf4_blob(const std::string& name, const model::Nf4Shape& shape);
  at::Tensor nf4_blob_range(const std::string& name, const model::Nf4Shape& shape, int64_t begin,
                            int64_t end);
  model::Nf4Weight nf4_from_files(const std::string& name, const model::Nf4Shape& shape);
  // The quant_state and quant_map checked; the nested offset (0 without double quantization).
  float nf4_state(const std::string& name, const model::Nf4Shape& shape);

  std::unique_ptr<io::SafetensorsIndex> files_;
  ParamShapes params_;
  std::map<std::string, size_t> index_;
  std::unique_ptr<model::DecoderModel> shapes_;  // meta model: init_value
  // Parameters the files hold in the per-expert layout, with their pieces.
  std::map<std::string, std::vector<model::ExpertFilePiece>> pieces_;
  model::BaseQuant quant_;
  std::map<std::string, model::Nf4Shape> nf4_;
  std::map<std::string, float> nf4_offsets_;  // quant.in_files: each quant_state's nested_offset
  std::string blob_name_;
  at::Tensor blob_;
  at::Generator gen_;
  size_t next_ = 0;                 // the parameter gen_ draws next
  std::vector<at::Tensor> states_;  // generator state before parameter i, for i < next_
  int64_t bytes_read_ = 0;
};

// Loads a PEFT adapter directory (adapter_model.safetensors) into the LoRA tensors attached to
// `model`; FormatError naming the file and the tensor when one is missing.
void load_adapter(model::DecoderModel& model, const std::string& adapter_dir);

// What a training run's engine loads each rank's slices from: trained parameters from the
// checkpoint it resumes (`ck`, may be null), LoRA adapters from their fresh init (the values
// `specs` hold now), every other parameter from `base`.
parallel::ParamSource run_param_source(BaseWeights& base, const ckpt::Checkpoint* ck,
                                       const std::vector<parallel::ParamSpec>& specs);

}  // namespace ft::train
