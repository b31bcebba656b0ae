// Unit tests of ft's safetensors reader and writer: round trips, agreement with the reference
// implementation's files (tests/io/fixtures), sharded directories, and fault injection on real
// files (truncated, corrupt, inconsistent), each of which must be a FormatError naming the file.
#include "io/safetensors.h"

#include <ATen/ATen.h>
#include <signal.h>
#include <sys/resource.h>

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "support/subprocess.h"

using namespace ft::io;
namespace fs = std::filesystem;

namespace {

// A scratch directory removed with everything in it when the test ends.
struct TempDir {
  std::string path = ft::test::make_temp_dir();
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string operator/(const std::string& name) const { return path + "/" + name; }
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::string le64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A safetensors file put together by hand: length prefix, header text, `data_bytes` zero bytes.
std::string craft(const std::string& header, size_t data_bytes) {
  return le64(header.size()) + header + std::string(data_bytes, '\0');
}

// Runs `fn`, requires a FormatError, and returns its message.
template <typename Fn>
std::string format_error_of(Fn&& fn) {
  try {
    fn();
  } catch (const ft::FormatError& e) {
    return e.what();
  }
  FAIL("no ft::FormatError was thrown");
  return {};
}

// The tensors of tests/io/fixtures/make_fixture.py, built in C++.
NamedTensors fixture_tensors() {
  return {
      {"model.embed_tokens.weight", at::arange(6, at::kFloat).reshape({2, 3}) * 0.5 - 1.0},
      {"model.norm.weight", at::tensor({1.0, -2.0, 0.25, 65504.0}).to(at::kHalf)},
      {"lm_head.weight", at::tensor({0.5, -3.0, 1024.0, 1.0 / 256}).to(at::kBFloat16).view({2, 2})},
      {"positions", at::tensor({int64_t{0}, int64_t{-1}, int64_t{1} << 40}, at::kLong)},
      {"mask", at::tensor({1, 0, 1}).to(at::kBool)},
      {"scalar", at::scalar_tensor(7.0, at::kFloat)},
      {"empty", at::zeros({0, 3}, at::kFloat)},
  };
}

std::string fixture_path() { return ft::test::test_dir() + "/io/fixtures/reference.safetensors"; }

}  // namespace

TEST_CASE("round trip of F32, F16, BF16 and raw dtypes with metadata", "[unit]") {
  TempDir dir;
  at::manual_seed(0);
  NamedTensors tensors = {
      {"w.f32", at::randn({3, 5})},
      {"w.f16", at::randn({4, 2}).to(at::kHalf)},
      {"w.bf16", at::randn({7}).to(at::kBFloat16)},
      {"transposed", at::randn({4, 6}).t()},  // non-contiguous: stored in C order
      {"ids", at::arange(5, at::kLong)},
      {"ints", at::arange(-3, 3, at::kInt)},
      {"bytes", at::arange(9, at::kByte)},
      {"flags", at::tensor({1, 0}).to(at::kBool)},
      {"f64", at::randn({2, 2}, at::kDouble)},
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "ünïcode"}};
  const std::string path = dir / "m.safetensors";
  write_safetensors(path, tensors, metadata);
  CHECK_FALSE(fs::exists(path + ".tmp"));

  std::string bytes = ft::test::read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK(n % 8 == 0);  // data starts 8-aligned, as the reference pads

  SafetensorsFile f = SafetensorsFile::open(path);
  CHECK(f.metadata() == metadata);
  CHECK(f.size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    REQUIRE(f.has(name));
    at::Tensor got = f.tensor(name);
    CHECK(got.scalar_type() == t.scalar_type());
    CHECK(got.sizes() == t.sizes());
    CHECK(got.equal(t));
    CHECK(f.info(name).dtype == t.scalar_type());
    CHECK(f.info(name).nbytes() == t.nbytes());
  }
  CHECK(f.info("w.bf16").dtype_name == "BF16");
  CHECK(f.info("flags").dtype_name == "BOOL");
  // Storage order is the reference's: by dtype (U64, I64, F64, ..., BOOL), then by name.
  CHECK(f.names().front() == "ids");
  CHECK(f.names()[1] == "f64");
  CHECK(f.names().back() == "flags");
}

TEST_CASE("reads a file written by the reference implementation", "[unit]") {
  SafetensorsFile f = SafetensorsFile::open(fixture_path());
  CHECK(f.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
  CHECK(f.names() == std::vector<std::string>{"positions", "empty", "model.embed_tokens.weight",
                                              "scalar", "lm_head.weight", "model.norm.weight",
                                              "mask"});
  for (const auto& [name, expected] : fixture_tensors()) {
    INFO(name);
    at::Tensor got = f.tensor(name);
    CHECK(got.scalar_type() == expected.scalar_type());
    CHECK(got.sizes() == expected.sizes());
    CHECK(got.equal(expected));
  }
  const TensorInfo& info = f.info("lm_head.weight");
  CHECK(info.shape == std::vector<int64_t>{2, 2});
  CHECK(info.begin == 52);
  CHECK(info.end == 60);
  CHECK(f.tensor("lm_head.weight")[1][1].item<float>() == 1.0f / 256);
  CHECK(f.tensor("model.norm.weight")[3].item<float>() == 65504.0f);
  CHECK(f.tensor("positions")[2].item<int64_t>() == (int64_t{1} << 40));
}

TEST_CASE("writes the reference implementation's bytes", "[unit]") {
  TempDir dir;
  const std::string path = dir / "ft.safetensors";
  write_safetensors(path, fixture_tensors(), {{"format", "pt"}});
  std::string ours = ft::test::read_file(path);
  std::string reference = ft::test::read_file(fixture_path());
  REQUIRE(!reference.empty());
  CHECK(ours.size() == reference.size());
  CHECK(ours == reference);
}

TEST_CASE("tensor() views the mapped bytes without copying", "[unit]") {
  TempDir dir;
  const std::string path = dir / "v.safetensors";
  at::Tensor w = at::randn({16, 8});
  write_safetensors(path, {{"w", w}, {"b", at::randn({8})}});

  at::Tensor view;
  {
    SafetensorsFile f = SafetensorsFile::open(path);
    view = f.tensor("w");
    // Two reads share the same bytes: both point into the mapping, neither is a copy.
    CHECK(f.tensor("w").data_ptr() == view.data_ptr());
    CHECK(view.device().is_cpu());
    CHECK(view.is_contiguous());
  }
  // The file object is gone and the file unlinked; the view keeps the mapping alive.
  fs::remove(path);
  CHECK(view.equal(w));
  CHECK(view.sum().item<float>() == Approx(w.sum().item<float>()));
}

TEST_CASE("tensor_slice returns rows of dim 0 as a view", "[unit]") {
  TempDir dir;
  const std::string path = dir / "s.safetensors";
  at::Tensor w = at::randn({10, 4, 3}).to(at::kBFloat16);
  write_safetensors(path, {{"w", w}, {"s", at::scalar_tensor(1.0)}});
  SafetensorsFile f = SafetensorsFile::open(path);

  at::Tensor rows = f.tensor_slice("w", 3, 7);
  CHECK(rows.sizes() == at::IntArrayRef({4, 4, 3}));
  CHECK(rows.equal(w.slice(0, 3, 7)));
  const auto* base = static_cast<const char*>(f.tensor("w").data_ptr());
  CHECK(static_cast<const char*>(rows.data_ptr()) == base + 3 * 4 * 3 * 2);  // no copy
  CHECK(f.tensor_slice("w", 5, 5).numel() == 0);
  CHECK(f.tensor_slice("w", 0, 10).equal(w));

  std::string msg = format_error_of([&] { f.tensor_slice("w", 4, 11); });
  CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("'w'") && Catch::Contains("[4, 11)"));
  CHECK_THROWS_AS(f.tensor_slice("w", -1, 2), ft::FormatError);
  CHECK_THROWS_AS(f.tensor_slice("w", 6, 5), ft::FormatError);
  CHECK_THAT(format_error_of([&] { f.tensor_slice("s", 0, 1); }), Catch::Contains("scalar"));
}

TEST_CASE("read_range copies a flat range, converts, and drops the pages it read", "[unit]") {
  TempDir dir;
  const std::string path = dir / "r.safetensors";
  // 8 MiB of bf16 so the dropped pages show in the resident set.
  at::Tensor w = at::randn({1024, 4096}).to(at::kBFloat16);
  write_safetensors(path, {{"w", w}, {"b", at::arange(10, at::kFloat)}});
  SafetensorsFile f = SafetensorsFile::open(path);

  at::Tensor dst = at::empty({5}, at::kFloat);
  f.read_range("b", 3, 8, dst);
  CHECK(dst.equal(at::arange(3, 8, at::kFloat)));
  // A range of a 2-D tensor, flattened in C order, into a dtype of another width.
  const int64_t begin = 1000, end = 3 * 4096 + 17;
  at::Tensor part = at::empty({end - begin}, at::kFloat);
  f.read_range("w", begin, end, part);
  CHECK(part.equal(w.reshape({-1}).slice(0, begin, end).to(at::kFloat)));
  at::Tensor none = at::empty({0});
  f.read_range("w", 7, 7, none);

  // Reading all of it through read_range leaves none of it resident; reading it through a view
  // keeps it mapped.
  auto rss_kib = [] {
    std::ifstream in("/proc/self/status");
    std::string line;
    while (std::getline(in, line))
      if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6));
    return 0LL;
  };
  at::Tensor all = at::empty({1024 * 4096}, at::kBFloat16);
  all.fill_(0);  // resident before measuring
  const long long before = rss_kib();
  f.read_range("w", 0, 1024 * 4096, all);
  const long long after_read = rss_kib();
  CHECK(all.equal(w.reshape({-1})));
  CHECK(after_read - before < 1024);  // KiB: the 8 MiB of file pages are gone again
  {
    at::Tensor view = f.tensor("w");
    CHECK(view.max().item<float>() == w.max().item<float>());  // reads every page, no copy
    CHECK(rss_kib() - before > 6 * 1024);                      // a view's pages stay mapped
  }

  std::string msg = format_error_of([&] { f.read_range("b", 4, 11, dst); });
  CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("'b'") && Catch::Contains("[4, 11)"));
  CHECK_THROWS_AS(f.read_range("b", -1, 4, dst), ft::FormatError);
  CHECK_THAT(format_error_of([&] { f.read_range("b", 0, 4, dst); }),
             Catch::Contains("destination of 5"));
}

TEST_CASE("copy_to converts dtypes and refuses a wrong shape", "[unit]") {
  TempDir dir;
  const std::string path = dir / "c.safetensors";
  at::Tensor w = at::randn({4, 8}).to(at::kBFloat16);
  write_safetensors(path, {{"model.layers.0.mlp.up_proj.weight", w}});
  SafetensorsFile f = SafetensorsFile::open(path);

  // A parameter that requires grad is a valid target (the copy runs outside autograd).
  at::Tensor param = at::zeros({4, 8}, at::kFloat).requires_grad_(true);
  f.copy_to("model.layers.0.mlp.up_proj.weight", param);
  CHECK(param.detach().equal(w.to(at::kFloat)));
  CHECK(param.requires_grad());

  at::Tensor half = at::zeros({4, 8}, at::kHalf);
  f.copy_to("model.layers.0.mlp.up_proj.weight", half);
  CHECK(half.to(at::kFloat).allclose(w.to(at::kFloat), 1e-2, 1e-2));

  at::Tensor wrong = at::zeros({8, 4});
  std::string msg = format_error_of([&] { f.copy_to("model.layers.0.mlp.up_proj.weight", wrong); });
  CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("model.layers.0.mlp.up_proj.weight") &&
                      Catch::Contains("[4, 8]") && Catch::Contains("[8, 4]"));
  CHECK(wrong.count_nonzero().item<int64_t>() == 0);  // nothing written on refusal

  msg = format_error_of([&] { f.copy_to("lm_head.weight", wrong); });
  CHECK_THAT(msg, Catch::Contains(path) && Catch::Contains("lm_head.weight"));
}

TEST_CASE("write_sharded splits like transformers and reads back through the index", "[unit]") {
  TempDir dir;
  at::manual_seed(1);
  NamedTensors tensors = {
      {"a", at::randn({10})},                   // 40 bytes
      {"b", at::randn({10})},                   // 40
      {"big", at::randn({40})},                 // 160: over the limit, a shard of its own
      {"c", at::randn({5}).to(at::kBFloat16)},  // 10
      {"d", at::randn({20})},                   // 80
  };
  std::vector<std::string> files = write_sharded(dir.path, tensors, 100, {{"format", "pt"}});
  // As huggingface_hub splits: `big` is emitted as its own shard when seen, then [a, b, c] (90
  // bytes), then [d] since 90 + 80 > 100.
  CHECK(files == std::vector<std::string>{
                     "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"});
  auto index = nlohmann::json::parse(ft::test::read_file(dir / kIndexFileName));
  CHECK(index["metadata"]["total_size"] == 40 + 40 + 160 + 10 + 80);
  CHECK(index["weight_map"]["big"] == "model-00001-of-00003.safetensors");
  CHECK(index["weight_map"]["a"] == "model-00002-of-00003.safetensors");
  CHECK(index["weight_map"]["c"] == "model-00002-of-00003.safetensors");
  CHECK(index["weight_map"]["d"] == "model-00003-of-00003.safetensors");
  CHECK_FALSE(fs::exists(dir / kSingleFileName));

  SafetensorsIndex idx = SafetensorsIndex::open(dir.path);
  CHECK(idx.names() == std::vector<std::string>{"a", "b", "big", "c", "d"});
  CHECK(idx.files().size() == 3);
  for (const auto& [name, t] : tensors) {
    INFO(name);
    CHECK(idx.has(name));
    CHECK(idx.tensor(name).equal(t));
    CHECK(idx.info(name).shape == t.sizes().vec());
  }
  CHECK(idx.file_of("d").metadata().at("format") == "pt");
  CHECK(idx.tensor_slice("big", 2, 4).equal(tensors[2].second.slice(0, 2, 4)));
  at::Tensor dst = at::empty({10});
  idx.copy_to("b", dst);
  CHECK(dst.equal(tensors[1].second));
  CHECK_FALSE(idx.has("e"));
  CHECK_THAT(format_error_of([&] { idx.tensor("e"); }),
             Catch::Contains(dir.path) && Catch::Contains("'e'"));

  // Saving again unsharded leaves one file: the old shards and index are removed.
  files = write_sharded(dir.path, tensors, kDefaultMaxShardBytes);
  CHECK(files == std::vector<std::string>{kSingleFileName});
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.path)) left.push_back(e.path().filename());
  CHECK(left == std::vector<std::string>{kSingleFileName});
  SafetensorsIndex single = SafetensorsIndex::open(dir.path);
  CHECK(single.files().size() == 1);
  CHECK(single.tensor("big").equal(tensors[2].second));

  // And sharded again over the single file: the single file goes, or readers would prefer it.
  write_sharded(dir.path, tensors, 200);  // [a, b], [big, c], [d]
  CHECK_FALSE(fs::exists(dir / kSingleFileName));
  CHECK(SafetensorsIndex::open(dir.path).files().size() == 3);
}

TEST_CASE("write_sharded_deferred writes the same files, making one tensor at a time", "[unit]") {
  TempDir eager, deferred;
  at::manual_seed(2);
  NamedTensors tensors = {{"a", at::randn({10})},
                          {"big", at::randn({40})},
                          {"c", at::randn({5}).to(at::kBFloat16)},
                          {"d", at::randn({3, 4})},
                          {"e", at::randn({20})}};
  const auto eager_files = write_sharded(eager.path, tensors, 100, {{"format", "pt"}});
  // Each make hands out a fresh copy and records how many copies are alive: the writer releases
  // one before it asks for the next.
  auto alive = std::make_shared<int>(0);
  int peak = 0, made = 0;
  DeferredTensors lazy;
  for (const auto& [name, t] : tensors) {
    lazy.push_back({name, t.sizes().vec(), t.scalar_type(), [&, t = t] {
                      ++made;
                      peak = std::max(peak, ++*alive);
                      at::Tensor c = t.clone();
                      // A deleter on a storage of our own counts the copy's release.
                      void* data = c.data_ptr();
                      auto keep = std::make_shared<at::Tensor>(c);
                      return at::from_blob(
                          data, c.sizes(), [keep, alive](void*) { --*alive; }, c.options());
                    }});
  }
  std::vector<std::tuple<std::string, size_t, size_t, uint64_t>> told;
  const auto files =
      write_sharded_deferred(deferred.path, lazy, 100, {{"format", "pt"}},
                             [&](const std::string& f, size_t n, size_t count, uint64_t bytes) {
                               told.emplace_back(f, n, count, bytes);
                             });
  CHECK(files == eager_files);
  for (const auto& f : files) {
    INFO(f);
    CHECK(ft::test::read_file(deferred / f) == ft::test::read_file(eager / f));
  }
  CHECK(made == 5);
  CHECK(peak == 1);
  CHECK(*alive == 0);
  // [big], [a, c, d] (10 * 4 + 10 + 48 = 98 bytes), [e]: one report per shard, in order.
  REQUIRE(told.size() == 3);
  CHECK(told[0] == std::make_tuple(std::string("model-00001-of-00003.safetensors"), size_t{1},
                                   size_t{3}, uint64_t{160}));
  CHECK(std::get<3>(told[1]) == 98);
  CHECK(std::get<1>(told[2]) == 3);

  // write_order names the order of the makes (by shard, then dtype width and name in each):
  // what ranks that only take part in collective makes walk.
  std::vector<std::string> asked;
  DeferredTensors recorded = lazy;
  for (auto& d : recorded)
    d.make = [&asked, &d, t = d.make] {
      asked.push_back(d.name);
      return t();
    };
  TempDir again;
  write_sharded_deferred(again.path, recorded, 100);
  std::vector<std::string> planned;
  for (size_t i : write_order(recorded, 100)) planned.push_back(recorded[i].name);
  CHECK(planned == asked);
  // In the second shard the 4-byte a and d before the bf16 c (wider dtypes first).
  CHECK(planned == std::vector<std::string>{"big", "a", "d", "c", "e"});

  // A make that throws stops the save with its error.
  TempDir failing;
  lazy[3].make = []() -> at::Tensor { throw ft::FormatError("chunk damaged"); };
  CHECK_THROWS_WITH(write_sharded_deferred(failing.path, lazy, 100), "chunk damaged");
}

TEST_CASE("a model directory's files are checked when it is opened", "[unit]") {
  TempDir dir;
  auto index_with = [&](const nlohmann::json& weight_map) {
    write_bytes(
        dir / kIndexFileName,
        nlohmann::json{{"metadata", {{"total_size", 8}}}, {"weight_map", weight_map}}.dump());
  };

  std::string msg = format_error_of([&] { SafetensorsIndex::open(dir.path); });
  CHECK_THAT(msg, Catch::Contains(dir.path) && Catch::Contains(kSingleFileName) &&
                      Catch::Contains(kIndexFileName));
  CHECK_THAT(format_error_of([&] { SafetensorsIndex::open(dir / "absent"); }),
             Catch::Contains(dir / "absent"));

  write_safetensors(dir / "model-00001-of-00002.safetensors", {{"x", at::ones({2})}});
  index_with(
      {{"x", "model-00001-of-00002.safetensors"}, {"y", "model-00002-of-00002.safetensors"}});
  msg = format_error_of([&] { SafetensorsIndex::open(dir.path); });
  CHECK_THAT(msg, Catch::Contains(dir / "model-00002-of-00002.safetensors") &&
                      Catch::Contains("'y'") && Catch::Contains("does not exist"));

  index_with(
      {{"x", "model-00001-of-00002.safetensors"}, {"z", "model-00001-of-00002.safetensors"}});
  msg = format_error_of([&] { SafetensorsIndex::open(dir.path); });
  CHECK_THAT(msg, Catch::Contains(dir / "model-00001-of-00002.safetensors") &&
                      Catch::Contains("'z'") && Catch::Contains("no such tensor"));

  index_with({{"x", "../model-00001-of-00002.safetensors"}});
  CHECK_THAT(format_error_of([&] { SafetensorsIndex::open(dir.path); }),
             Catch::Contains(kIndexFileName) && Catch::Contains("not a file name"));

  index_with({{"x", 3}});
  CHECK_THAT(format_error_of([&] { SafetensorsIndex::open(dir.path); }),
             Catch::Contains(kIndexFileName) && Catch::Contains("'x'"));

  write_bytes(dir / kIndexFileName, "{\"weight_map\": {\"x\": ");
  CHECK_THAT(format_error_of([&] { SafetensorsIndex::open(dir.path); }),
             Catch::Contains(dir / kIndexFileName) && Catch::Contains("not valid JSON"));

  write_bytes(dir / kIndexFileName, "{\"metadata\": {}}");
  CHECK_THAT(format_error_of([&] { SafetensorsIndex::open(dir.path); }),
             Catch::Contains("weight_map"));

  // A malformed shard reports the shard's own path.
  write_bytes(dir / "model-00001-of-00002.safetensors", "garbage");
  index_with({{"x", "model-00001-of-00002.safetensors"}});
  CHECK_THAT(format_error_of([&] { SafetensorsIndex::open(dir.path); }),
             Catch::Contains(dir / "model-00001-of-00002.safetensors"));
}

TEST_CASE("truncated and corrupt files are FormatErrors naming the file and tensor", "[unit]") {
  TempDir dir;
  // A valid file to cut: two tensors, 24 + 16 data bytes.
  const std::string good = dir / "good.safetensors";
  write_safetensors(good, {{"w", at::ones({2, 3})}, {"b", at::ones({4}, at::kBFloat16).repeat(2)}});
  const std::string bytes = ft::test::read_file(good);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  REQUIRE(SafetensorsFile::open(good).size() == 2);

  auto expect_error = [&](const std::string& label, const std::string& content,
                          std::vector<std::string> needles) {
    INFO(label);
    const std::string path = dir / (label + ".safetensors");
    write_bytes(path, content);
    std::string msg = format_error_of([&] { SafetensorsFile::open(path); });
    INFO(msg);
    CHECK_THAT(msg, Catch::Contains(path));
    for (const auto& needle : needles) CHECK_THAT(msg, Catch::Contains(needle));
  };

  const std::string one = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  write_bytes(dir / "one.safetensors", craft(one, 8));
  REQUIRE_NOTHROW(SafetensorsFile::open(dir / "one.safetensors"));

  // Cuts.
  expect_error("empty", "", {"too short"});
  expect_error("short", bytes.substr(0, 5), {"too short"});
  expect_error("cut_in_header", bytes.substr(0, 8 + n / 2), {"runs past the end"});
  expect_error("cut_in_data", bytes.substr(0, bytes.size() - 3), {"tensor 'b'", "truncated"});
  expect_error("trailing", bytes + "xyz", {"after the last tensor"});
  // Header lengths that must be refused before anything of that size is read or allocated.
  expect_error("len_past_file", le64(1000) + "{}", {"1000", "runs past the end"});
  expect_error("len_2_63", le64(uint64_t{1} << 63) + "{}", {"exceeds"});
  expect_error("len_max", le64(~uint64_t{0}) + "{}", {"exceeds"});
  // Not JSON, or JSON of the wrong shape.
  expect_error("bad_json", craft(R"({"t":{"dtype":"F32",)", 0), {"not valid JSON"});
  expect_error("not_utf8", craft("{\"\xff\xfe\":{}}", 0), {"not valid JSON"});
  expect_error("not_object", craft("[1,2]", 0), {"must be a JSON object"});
  expect_error("entry_not_object", craft(R"({"t":[0,8]})", 8), {"tensor 't'", "object"});
  expect_error("missing_dtype", craft(R"({"t":{"shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "lacks 'dtype'"});
  expect_error("missing_shape", craft(R"({"t":{"dtype":"F32","data_offsets":[0,8]}})", 8),
               {"tensor 't'", "lacks 'shape'"});
  expect_error("missing_offsets", craft(R"({"t":{"dtype":"F32","shape":[2]}})", 8),
               {"tensor 't'", "lacks 'data_offsets'"});
  expect_error("twice_shape",
               craft(R"({"t":{"dtype":"F32","shape":[2],"shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "'shape' appears twice"});
  expect_error("unknown_dtype",
               craft(R"({"t":{"dtype":"F128","shape":[2],"data_offsets":[0,32]}})", 32),
               {"tensor 't'", "unknown dtype 'F128'"});
  expect_error("dtype_not_string",
               craft(R"({"t":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "dtype must be a string"});
  expect_error("negative_dim",
               craft(R"({"t":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "negative dimension -2"});
  expect_error("fractional_dim",
               craft(R"({"t":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "non-negative integers"});
  expect_error(
      "numel_overflow",
      craft(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
      {"tensor 't'", "64 bits"});
  expect_error(
      "bytes_overflow",
      craft(R"({"t":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", 8),
      {"tensor 't'", "2^63 bytes"});
  std::string ones = "1";
  for (int i = 0; i < 64; ++i) ones += ",1";
  expect_error("too_many_dims",
               craft(R"({"t":{"dtype":"F32","shape":[)" + ones + R"(],"data_offsets":[0,4]}})", 4),
               {"tensor 't'", "more than 64 dims"});
  // Offsets inconsistent with the shape, the buffer, or each other.
  expect_error("offsets_out_of_range",
               craft(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 8),
               {"tensor 't'", "[8, 16]", "run past the end"});
  expect_error("begin_after_end",
               craft(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8),
               {"tensor 't'", "begin > end"});
  expect_error("size_mismatch",
               craft(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8),
               {"tensor 't'", "[3]", "needs 12"});
  expect_error("three_offsets",
               craft(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", 8),
               {"tensor 't'", "exactly two"});
  expect_error("overlap",
               craft(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("u":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                     12),
               {"tensor 'u'", "overlap tensor 't'"});
  expect_error("gap", craft(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12),
               {"tensor 't'", "gap of 4 bytes"});
  expect_error("duplicate",
               craft(R"({"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                     R"("t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                     8),
               {"tensor 't'", "twice"});
  expect_error("metadata_not_strings", craft(R"({"__metadata__":{"step":3}})", 0),
               {"__metadata__", "'step'"});
}

TEST_CASE("headers the reference accepts are accepted", "[unit]") {
  TempDir dir;
  // Padding spaces, unknown entry fields (ignored), null metadata, an empty file of tensors.
  const std::string header = R"({"__metadata__":null,"t":{"dtype":"I32","shape":[2],)"
                             R"("data_offsets":[0,8],"extra":{"nested":[1,{"a":null}]}}}    )";
  const std::string path = dir / "ok.safetensors";
  write_bytes(path, le64(header.size()) + header + le64(0x0000000200000001ull));
  SafetensorsFile f = SafetensorsFile::open(path);
  CHECK(f.metadata().empty());
  CHECK(f.tensor("t").equal(at::tensor({1, 2}, at::kInt)));

  write_bytes(path, craft("{}", 0));
  CHECK(SafetensorsFile::open(path).size() == 0);

  // A misaligned entry (another writer's layout) still reads, as a copy.
  const std::string odd = R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[1,5]}})";
  std::string data(5, '\0');
  float one = 1.0f;
  std::memcpy(&data[1], &one, 4);
  write_bytes(path, le64(odd.size() + (8 - odd.size() % 8) % 8) + odd +
                        std::string((8 - odd.size() % 8) % 8, ' ') + data);
  CHECK(SafetensorsFile::open(path).tensor("b").item<float>() == 1.0f);
}

TEST_CASE("a failed write leaves the existing file untouched", "[unit]") {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  at::Tensor old = at::arange(4, at::kFloat);
  write_safetensors(path, {{"w", old}});
  const std::string before = ft::test::read_file(path);

  // The disk "fills" mid-write: a file-size limit makes write() fail with EFBIG.
  struct rlimit saved {};
  REQUIRE(getrlimit(RLIMIT_FSIZE, &saved) == 0);
  auto old_handler = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = saved;
  small.rlim_cur = 4096;
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  bool threw = false;
  try {
    write_safetensors(path, {{"w", at::randn({64, 64})}});
  } catch (const ft::SystemError& e) {
    threw = true;
    CHECK_THAT(e.what(), Catch::Contains(path + ".tmp"));
  }
  setrlimit(RLIMIT_FSIZE, &saved);
  signal(SIGXFSZ, old_handler);
  CHECK(threw);
  CHECK(ft::test::read_file(path) == before);
  CHECK_FALSE(fs::exists(path + ".tmp"));
  CHECK(SafetensorsFile::open(path).tensor("w").equal(old));

  // A crash's leftover temporary is neither read nor in the way of the next write.
  write_bytes(path + ".tmp", "half a file");
  CHECK(SafetensorsFile::open(path).tensor("w").equal(old));
  write_safetensors(path, {{"w", old * 2}});
  CHECK(SafetensorsFile::open(path).tensor("w").equal(old * 2));
  CHECK_FALSE(fs::exists(path + ".tmp"));

  // Refused arguments write nothing at all.
  CHECK_THROWS_AS(write_safetensors(path, {{"w", old}, {"w", old}}), ft::Error);
  CHECK_THROWS_AS(write_safetensors(path, {{"__metadata__", old}}), ft::Error);
  CHECK_THROWS_AS(write_safetensors(path, {{"c", at::zeros({2}, at::kComplexDouble)}}), ft::Error);
  CHECK_THROWS_AS(write_safetensors(path, {{"u", at::Tensor()}}), ft::Error);
  CHECK(SafetensorsFile::open(path).tensor("w").equal(old * 2));
}

TEST_CASE("a header nested 100,000 deep is refused, not a crash", "[unit]") {
  TempDir dir;
  const std::string path = dir / "deep.safetensors";
  write_bytes(path, craft(std::string(100000, '[') + std::string(100000, ']'), 0));
  CHECK_THROWS_WITH(SafetensorsFile::open(path), Catch::Contains("deep.safetensors") &&
                                                     Catch::Contains("nested deeper than 256"));
}
