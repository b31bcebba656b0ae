// Test support: the model directories of tests/model/fixtures (transformers' save_pretrained of
// tiny random-init configs, one or more per family; FAMILIES.md says what each exercises) as a
// test loads them. Header-only: the tests that include it link ft_model and ft_io. Not
// thread-safe (one test thread).
#pragma once

#include <string>

#include "io/safetensors_index.h"
#include "model/config.h"
#include "model/decoder.h"

namespace ft::test {

// The directory of fixture `name` (e.g. "gemma3_local_global").
inline std::string model_fixture(const std::string& name) {
  return std::string(FT_TEST_DIR) + "/model/fixtures/" + name;
}

// The model of `dir` (config.json + model.safetensors) with its weights, in `dtype` (converted
// from the files' fp32 as a load does).
inline model::DecoderModel load_model_dir(const std::string& dir, at::ScalarType dtype) {
  model::DecoderModel m(model::load_model_config(dir + "/config.json"),
                        at::TensorOptions().dtype(dtype));
  const auto files = io::SafetensorsIndex::open(dir);
  m.load([&](const std::string& name, at::Tensor& dst) { files.copy_to(name, dst); });
  return m;
}

}  // namespace ft::test
