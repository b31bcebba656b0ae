#include "io/safetensors_index.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "core/json.h"

namespace ft::io {

namespace fs = std::filesystem;

namespace {

// Reads a small text file whole (an index), refusing one larger than `cap` bytes.
std::string read_text(const std::string& path, uint64_t cap) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_errno("open '" + path + "'", __FILE__, __LINE__);
  std::error_code ec;
  uint64_t size = fs::file_size(path, ec);
  FT_CHECK_T(FormatError, !ec && size <= cap, "'", path, "' is ", size, " bytes, larger than the ",
             cap, "-byte limit for an index");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

SafetensorsIndex SafetensorsIndex::open(const std::string& dir) {
  SafetensorsIndex idx;
  idx.dir_ = dir;
  std::error_code ec;
  FT_CHECK_T(FormatError, fs::is_directory(dir, ec), "model directory '", dir,
             "' does not exist or is not a directory");
  const std::string single = (fs::path(dir) / kSingleFileName).string();
  const std::string index = (fs::path(dir) / kIndexFileName).string();

  if (fs::exists(single, ec)) {
    idx.files_.push_back(SafetensorsFile::open(single));
    for (const auto& name : idx.files_[0].names()) idx.shard_of_.emplace(name, 0);
    return idx;
  }
  FT_CHECK_T(FormatError, fs::exists(index, ec), "model directory '", dir, "' has neither ",
             kSingleFileName, " nor ", kIndexFileName);

  const nlohmann::json doc =
      parse_json<FormatError>(read_text(index, kMaxHeaderBytes), "index '" + index + "'");
  FT_CHECK_T(FormatError, doc.is_object() && doc.contains("weight_map"), "index '", index,
             "' lacks \"weight_map\"");
  const auto& weight_map = doc["weight_map"];
  FT_CHECK_T(FormatError, weight_map.is_object(), "index '", index,
             "': \"weight_map\" must be an object of tensor name -> shard file");

  std::map<std::string, size_t> file_slot;  // shard file name -> index into files_
  for (const auto& [name, file] : weight_map.items()) {
    FT_CHECK_T(FormatError, file.is_string(), "index '", index, "': tensor '", name, "' maps to ",
               file.dump(), ", not a file name");
    const std::string shard = file.get<std::string>();
    auto it = file_slot.find(shard);
    if (it == file_slot.end()) {
      // Shards live beside the index; a path elsewhere is a corrupt or hostile index.
      FT_CHECK_T(
          FormatError,
          !shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
          "index '", index, "': tensor '", name, "' maps to '", shard,
          "', which is not a file name in the model directory");
      const std::string shard_path = (fs::path(dir) / shard).string();
      FT_CHECK_T(FormatError, fs::exists(shard_path, ec), "index '", index, "' places tensor '",
                 name, "' in '", shard_path, "', which does not exist");
      idx.files_.push_back(SafetensorsFile::open(shard_path));
      it = file_slot.emplace(shard, idx.files_.size() - 1).first;
    }
    const SafetensorsFile& f = idx.files_[it->second];
    FT_CHECK_T(FormatError, f.has(name), "index '", index, "' places tensor '", name, "' in '",
               f.path(), "', which has no such tensor");
    idx.shard_of_.emplace(name, it->second);
  }
  return idx;
}

std::vector<std::string> SafetensorsIndex::names() const {
  std::vector<std::string> out;
  out.reserve(shard_of_.size());
  for (const auto& [name, slot] : shard_of_) out.push_back(name);
  return out;
}

const SafetensorsFile& SafetensorsIndex::file_of(const std::string& name) const {
  auto it = shard_of_.find(name);
  FT_CHECK_T(FormatError, it != shard_of_.end(), "model directory '", dir_, "': no tensor '", name,
             "' in its safetensors files");
  return files_[it->second];
}

}  // namespace ft::io
