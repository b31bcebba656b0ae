// Fuzzes reading a checkpoint. The input is one JSON file of a step directory whose other files
// are real (saved once at start-up by ckpt::Saver, two ranks). An object with a "rank" key is
// rank 1's per-rank record (rank-00001.json): rank 0's Saver commits the step with it, and the
// committed checkpoint is read. Anything else is the commit record, meta.json, of a committed
// step; a "meta_crc32c" of 0 is replaced by the record's true checksum, so the fuzzer gets past
// the check to what it guards. Reading is Checkpoint::open, then every rank state and every
// tensor's chunks verified and read whole and in part.
#include <ATen/ATen.h>

#include "ckpt/checkpoint.h"
#include "core/json.h"
#include "fuzz_support.h"

namespace {

using namespace ft;
namespace fs = std::filesystem;
using nlohmann::json;

constexpr int64_t kStep = 7;

ckpt::Snapshot snapshot(int rank) {
  ckpt::Snapshot s;
  s.step = kStep;
  s.state = {{"step", kStep}, {"lr", 0.001}};
  s.rank_state = {{"data", {rank * 10, 3}}, {"samples_consumed", 12}};
  s.shapes = {{"param/w", {2, 3}}, {"rng/cpu.rank" + std::to_string(rank), {4}}};
  const at::Tensor w = at::arange(6, at::kFloat);
  s.pieces.push_back({"param/w", rank * 3, rank * 3 + 3, w.slice(0, rank * 3, rank * 3 + 3)});
  s.pieces.push_back({"rng/cpu.rank" + std::to_string(rank), 0, 4, at::full({4}, rank, at::kByte)});
  return s;
}

struct Dirs {
  std::string root;       // where rank 0 commits
  std::string step;       // its committed step directory
  std::string rank1;      // rank 1's pristine files (its step's temporary directory)
  std::string meta_text;  // the committed meta.json
};

ckpt::SaverOptions options(const std::string& root, int rank,
                           std::function<void(const std::vector<std::string>&)> wait_all) {
  ckpt::SaverOptions o;
  o.root = root;
  o.rank = rank;
  o.world_size = 2;
  o.keep_last = 1;
  o.signal = [](const std::string&, const std::string&) {};
  // Every rank's files are durable (an empty error each), once `wait_all` has put rank 1's there.
  o.wait_all = [wait_all = std::move(wait_all)](const std::vector<std::string>& keys) {
    if (wait_all) wait_all(keys);
    return std::vector<std::string>(keys.size());
  };
  return o;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// Rank 0 commits the step with rank 1's files taken from `rank1_json` and the pristine shard.
void commit_with(const Dirs& d, std::string_view rank1_json) {
  auto wait_all = [&](const std::vector<std::string>&) {
    const fs::path tmp = fs::path(d.root) / (".tmp-" + ckpt::step_dir_name(kStep));
    fs::copy_file(fs::path(d.rank1) / "rank-00001.safetensors", tmp / "rank-00001.safetensors",
                  fs::copy_options::overwrite_existing);
    fuzz::write_file((tmp / "rank-00001.json").string(), rank1_json);
  };
  ckpt::Saver saver(options(d.root, 0, wait_all));
  saver.save(snapshot(0), /*async=*/false);
}

const Dirs& dirs() {
  static const Dirs d = [] {
    Dirs d;
    d.root = fuzz::scratch_dir() + "/ckpt";
    const std::string other = fuzz::scratch_dir() + "/rank1";
    {
      ckpt::Saver rank1(options(other, 1, nullptr));
      rank1.save(snapshot(1), /*async=*/false);
    }
    d.rank1 = other + "/.tmp-" + ckpt::step_dir_name(kStep);
    d.step = d.root + "/" + ckpt::step_dir_name(kStep);
    commit_with(d, read_text(d.rank1 + "/rank-00001.json"));
    d.meta_text = read_text(d.step + "/" + ckpt::kMetaFile);
    return d;
  }();
  return d;
}

void read_checkpoint(const std::string& dir) {
  const ckpt::Checkpoint c = ckpt::Checkpoint::open(dir);
  (void)c.step();
  (void)c.state();
  for (int r = 0; r < std::min(c.world_size(), 64); ++r) (void)c.rank_state(r);
  for (const std::string& t : c.tensors()) {
    fuzz::expect_ft_errors([&] { c.read_range(t, 0, 1, at::empty({1})); });
    int64_t numel = 1;
    for (const int64_t d : c.shape(t)) {
      if (d < 0 || (d > 0 && numel > (int64_t{1} << 20) / d)) return;  // not ours to allocate
      numel *= d;
    }
    c.verify_range(t, 0, numel);
    c.read_range(t, 0, numel, at::empty({numel}));
    if (numel >= 2) c.read_range(t, 1, numel - 1, at::empty({numel - 2}, at::kDouble));
  }
}

// The input as JSON for the harness's own decisions; discarded when it is not JSON or too deep for
// nlohmann's recursive parser.
json harness_view(std::string_view text) {
  if (json_too_deep_at(text) != std::string_view::npos) return json(json::value_t::discarded);
  return json::parse(text, nullptr, /*allow_exceptions=*/false);
}

void fuzz_meta(std::string_view text) {
  const Dirs& d = dirs();
  std::string meta(text);
  json j = harness_view(text);
  if (j.is_object() && j.contains("meta_crc32c") && j["meta_crc32c"] == 0) {
    j["meta_crc32c"] = ckpt::meta_checksum(j);
    meta = j.dump(1);
  }
  fs::create_directories(d.step);
  fuzz::write_file(d.step + "/" + ckpt::kMetaFile, meta);
  fuzz::expect_ft_errors([&] { read_checkpoint(d.step); });
}

void fuzz_rank_record(std::string_view text) {
  const Dirs& d = dirs();
  fuzz::expect_ft_errors([&] {
    commit_with(d, text);
    read_checkpoint(d.step);
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)dirs();  // saved before the first input
  const std::string_view text = fuzz::as_text(data, size);
  const json j = harness_view(text);
  if (j.is_object() && j.contains("rank")) {
    fuzz_rank_record(text);
  } else {
    fuzz_meta(text);
  }
  return 0;
}
