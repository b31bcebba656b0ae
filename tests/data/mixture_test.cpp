// Weighted mixtures of JSONL sources and the held-out split: the draws follow the weights within
// sampling error, each source runs through its own epochs, ranks share the global stream as one
// file's ranks do, a position resumes the stream exactly (at another world size too), held-out
// records never reach a batch, and bad --data / sources are ConfigErrors naming the entry.
#include "support/catch_torch.h"
// (catch_torch.h first: it drops c10's CHECK before Catch defines its own)
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "config/preset.h"
#include "core/error.h"
#include "data/mixture.h"

namespace fs = std::filesystem;
using namespace ft::data;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    static int n = 0;
    path = fs::temp_directory_path() /
           ("ft_mixture_test_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

// `n` pre-tokenized records: record i of source `tag` is [tag * 1000 + i + 1, 7, 7 ...] (2 + i % 5
// tokens), so a batch row names its source and record.
std::string write_tokens(const TempDir& dir, const std::string& name, int tag, int n) {
  const std::string path = (dir.path / name).string();
  std::ofstream f(path);
  for (int i = 0; i < n; ++i) {
    std::vector<int> ids = {tag * 1000 + i + 1};
    ids.resize(static_cast<size_t>(2 + i % 5), 7);
    f << nlohmann::json{{"input_ids", ids}}.dump() << "\n";
  }
  return path;
}

JsonlOptions base_options(int rank = 0, int world_size = 1) {
  JsonlOptions o;
  o.format = RecordFormat::kTokens;
  o.vocab_size = 4000;
  o.seq_len = 16;
  o.micro_batch = 1;
  o.pack = false;
  o.rank = rank;
  o.world_size = world_size;
  return o;
}

// The data.columns.* / data.tags.* every source starts from: the schema's defaults.
const ft::config::RecordShapeSettings& default_shape() {
  static const ft::config::RecordShapeSettings shape =
      ft::config::settings_from_json(ft::config::resolve_preset("tiny-demo", {}), "test")
          .data.shape;
  return shape;
}

SourceSpec spec(const std::string& path, double weight, const std::string& name) {
  SourceSpec s;
  s.shape = default_shape();
  s.settings.path = path;
  s.settings.weight = weight;
  s.settings.name = name;
  s.origin = "data.sources[" + name + "]";
  return s;
}

std::unique_ptr<MixtureSource> mixture(const std::vector<SourceSpec>& specs, int rank = 0,
                                       int world_size = 1, int64_t micro_batch = 1,
                                       bool pack = false, double split = 0) {
  JsonlOptions base = base_options(rank, world_size);
  base.micro_batch = micro_batch;
  base.pack = pack;
  auto sources = open_sources(specs, base);
  hold_out_split(specs, sources, split);
  MixtureSource::Options o;
  for (const auto& s : specs) {
    o.names.push_back(s.settings.name);
    o.weights.push_back(s.settings.weight);
  }
  o.pack = {micro_batch, base.seq_len, pack};
  o.rank = rank;
  o.world_size = world_size;
  return std::make_unique<MixtureSource>(std::move(sources), o);
}

// The first token of every record in a batch (its source * 1000 + record + 1), row by row.
std::vector<int64_t> record_ids(const ft::data::Batch& b) {
  std::vector<int64_t> out;
  auto I = b.input_ids.accessor<int64_t, 2>();
  auto P = b.position_ids.accessor<int64_t, 2>();
  for (int64_t r = 0; r < b.input_ids.size(0); ++r)
    for (int64_t t = 0; t < b.input_ids.size(1); ++t)
      if (P[r][t] == 0 && I[r][t] != 0) out.push_back(I[r][t]);
  return out;
}

}  // namespace

TEST_CASE("a 70/30 mixture draws its sources in proportion: 4 sigma over 10,000 records") {
  TempDir dir;
  const auto specs = std::vector<SourceSpec>{spec(write_tokens(dir, "a.jsonl", 1, 300), 0.7, "a"),
                                             spec(write_tokens(dir, "b.jsonl", 2, 200), 0.3, "b")};
  auto mix = mixture(specs, 0, 1, /*micro_batch=*/100);
  std::map<int64_t, int64_t> seen;  // record id -> times drawn
  int64_t from_a = 0;
  for (int step = 0; step < 100; ++step)
    for (const int64_t id : record_ids(mix->next())) {
      ++seen[id];
      from_a += id < 2000;
    }
  REQUIRE(mix->records_placed()[0] + mix->records_placed()[1] == 10000);
  CHECK(mix->records_placed()[0] == from_a);
  // Binomial(10000, 0.7): sigma = sqrt(10000 * 0.7 * 0.3) = 45.8; 4 sigma = 183.
  INFO("records from a: " << from_a);
  CHECK(std::abs(static_cast<double>(from_a) - 7000) <= 4 * std::sqrt(10000 * 0.7 * 0.3));
  // Each source runs through its own epochs: a record is drawn floor or ceil of draws / records.
  for (const auto& [tag, n, drawn] : {std::tuple{1, 300, from_a}, {2, 200, 10000 - from_a}}) {
    for (int i = 0; i < n; ++i) {
      const int64_t times = seen[tag * 1000 + i + 1];
      CHECK((times == drawn / n || times == drawn / n + 1));
    }
  }
  CHECK(mix->epoch_records() == 500);
  // Reproducible: the draws are a function of (seed, g).
  auto again = mixture(specs, 0, 1, 100);
  auto first = mixture(specs, 0, 1, 100);
  CHECK(record_ids(again->next()) == record_ids(first->next()));
}

TEST_CASE("mixture ranks split the global stream as one file's ranks do, and resume exactly") {
  TempDir dir;
  const auto specs =
      std::vector<SourceSpec>{spec(write_tokens(dir, "a.jsonl", 1, 37), 2, "a"),
                              spec(write_tokens(dir, "b.jsonl", 2, 23), 1, "b"),
                              spec(write_tokens(dir, "c:colon.jsonl", 3, 11), 1, "c")};
  // World size 1: the global stream, one record per batch.
  auto one = mixture(specs);
  std::vector<int64_t> global;
  for (int i = 0; i < 300; ++i) global.push_back(record_ids(one->next()).at(0));
  // World size 2: rank r takes g = r, r + 2, ...
  auto r0 = mixture(specs, 0, 2), r1 = mixture(specs, 1, 2);
  for (int i = 0; i < 150; ++i) {
    CHECK(record_ids(r0->next()).at(0) == global[2 * i]);
    CHECK(record_ids(r1->next()).at(0) == global[2 * i + 1]);
  }
  // The last rank's position, taken to world size 1 and 3, continues the global stream.
  const std::vector<int64_t> pos = r1->position();
  REQUIRE(pos.size() == 4);
  CHECK(pos[0] == 300);
  CHECK(pos[1] + pos[2] + pos[3] == 300);
  auto w1 = mixture(specs);
  w1->seek(pos);
  CHECK(w1->samples_consumed() == 300);
  auto w3 = mixture(specs, 2, 3);
  w3->seek(pos);
  auto ref = mixture(specs);
  for (int i = 0; i < 300; ++i) ref->next();
  std::vector<int64_t> rest;
  for (int i = 0; i < 30; ++i) rest.push_back(record_ids(ref->next()).at(0));
  for (int i = 0; i < 30; ++i) CHECK(record_ids(w1->next()).at(0) == rest[i]);
  for (int i = 0; i < 10; ++i) CHECK(record_ids(w3->next()).at(0) == rest[3 * i + 2]);

  // Packed rows with a record pending across batches: a seek to position() gives the same batches.
  auto a = mixture(specs, 0, 1, /*micro_batch=*/3, /*pack=*/true);
  for (int i = 0; i < 7; ++i) a->next();
  auto b = mixture(specs, 0, 1, 3, true);
  b->seek(a->position());
  for (int i = 0; i < 5; ++i) {
    const auto x = a->next(), y = b->next();
    CHECK(at::equal(x.input_ids, y.input_ids));
    CHECK(at::equal(x.segment_ids, y.segment_ids));
  }
  // A position of another kind is refused, naming what it holds.
  CHECK_THROWS_AS(b->seek({12}), ft::ConfigError);
  CHECK_THROWS_WITH(b->seek({12, 1, 2, 3}), Catch::Contains("inconsistent"));
}

TEST_CASE("mixture rows_per_epoch counts the rows next() packs its epoch into") {
  TempDir dir;
  const auto specs = std::vector<SourceSpec>{spec(write_tokens(dir, "a.jsonl", 1, 40), 3, "a"),
                                             spec(write_tokens(dir, "b.jsonl", 2, 25), 1, "b")};
  auto mix = mixture(specs, 0, 1, /*micro_batch=*/1, /*pack=*/true);
  const int64_t rows = mix->rows_per_epoch();
  int64_t batches = 0;
  while (mix->samples_consumed() < mix->epoch_records()) {
    mix->next();
    ++batches;
  }
  // (The last row may hold the next epoch's first records too: the same row.)
  CHECK(batches == rows);
  CHECK(mix->position()[0] >= 65);
}

TEST_CASE("eval.split: held-out records never reach a batch, the same on every rank") {
  TempDir dir;
  const auto specs = std::vector<SourceSpec>{spec(write_tokens(dir, "a.jsonl", 1, 300), 0.7, "a"),
                                             spec(write_tokens(dir, "b.jsonl", 2, 200), 0.3, "b")};
  auto mix = mixture(specs, 0, 1, 100, false, /*split=*/0.05);
  // A fraction of each source, rounded up.
  REQUIRE(mix->source(0).held_out().size() == 15);
  REQUIRE(mix->source(1).held_out().size() == 10);
  CHECK(mix->epoch_records() == 475);
  std::set<int64_t> held;
  for (size_t k = 0; k < 2; ++k)
    for (const int64_t r : mix->source(k).held_out()) held.insert((k + 1) * 1000 + r + 1);
  for (int step = 0; step < 50; ++step)  // 5,000 records: 10 epochs of the mixture
    for (const int64_t id : record_ids(mix->next())) CHECK(held.count(id) == 0);
  // Every rank of any world size holds out the same records; so does another listing order.
  for (const auto& [rank, world] : {std::pair{1, 2}, {2, 3}}) {
    auto other = mixture(specs, rank, world, 1, false, 0.05);
    CHECK(other->source(0).held_out() == mix->source(0).held_out());
    CHECK(other->source(1).held_out() == mix->source(1).held_out());
  }
  auto reversed = mixture({specs[1], specs[0]}, 0, 1, 1, false, 0.05);
  CHECK(reversed->source(1).held_out() == mix->source(0).held_out());
  // A count is spread over the sources by their sizes.
  auto counted = mixture(specs, 0, 1, 1, false, /*split=*/50);
  CHECK(counted->source(0).held_out().size() == 30);
  CHECK(counted->source(1).held_out().size() == 20);
  // Not a whole count, or nothing left to train on: refused.
  CHECK_THROWS_WITH(mixture(specs, 0, 1, 1, false, 2.5),
                    Catch::Contains("eval.split=2.5 is neither a fraction"));
  CHECK_THROWS_WITH(mixture(specs, 0, 1, 1, false, 500),
                    Catch::Contains("nothing is left to train on"));
  auto tiny = std::vector<SourceSpec>{spec(write_tokens(dir, "t.jsonl", 3, 1), 1, "t"), specs[0]};
  CHECK_THROWS_WITH(mixture(tiny, 0, 1, 1, false, 0.5),
                    Catch::Contains("data.sources[t]") && Catch::Contains("leaves none"));
}

TEST_CASE("a --data PATH:WEIGHT, and bad weights, files and sources are ConfigErrors") {
  TempDir dir;
  const std::string a = write_tokens(dir, "a.jsonl", 1, 5);
  const std::string colon = write_tokens(dir, "x:y.jsonl", 2, 5);
  CHECK(parse_data_arg(a).settings.path == a);
  CHECK(parse_data_arg(a).settings.weight == 1);
  const SourceSpec w = parse_data_arg(a + ":0.7");
  CHECK(w.settings.path == a);
  CHECK(w.settings.weight == 0.7);
  // A path holding ':' is a path; with a weight after it too.
  CHECK(parse_data_arg(colon).settings.path == colon);
  CHECK(parse_data_arg(colon + ":2").settings.path == colon);
  CHECK(parse_data_arg(colon + ":2").settings.weight == 2);
  for (const std::string bad : {":0", ":-1", ":inf", ":nan"})
    CHECK_THROWS_WITH(parse_data_arg(a + bad),
                      Catch::Contains("--data '" + a + bad + "'") && Catch::Contains("> 0"));
  CHECK_THROWS_AS(parse_data_arg(a + ":0"), ft::ConfigError);
  CHECK_THROWS_WITH(parse_data_arg(a + ":heavy"), Catch::Contains("'heavy' is not a weight"));

  ft::config::DataSettings data;
  data.shape = default_shape();
  data.sources.push_back(spec(a, 1, "").settings);
  CHECK_THROWS_WITH(training_sources(data, {a}), Catch::Contains("the data is given twice"));
  data.sources.push_back(spec((dir.path / "sub" / "a.jsonl").string(), 1, "").settings);
  CHECK_THROWS_WITH(
      training_sources(data, {}),
      Catch::Contains("data.sources[0] and data.sources[1] are both named 'a.jsonl'"));
  data.sources[1].name = "other";
  const auto specs = training_sources(data, {});
  CHECK(specs[0].settings.name == "a.jsonl");
  CHECK_THROWS_AS(open_sources(specs, base_options()), ft::ConfigError);
  CHECK_THROWS_WITH(open_sources(specs, base_options()),
                    Catch::Contains("data.sources[1]: ") && Catch::Contains("does not exist"));
}

TEST_CASE("max_records: a source trains on its file's first records only") {
  TempDir dir;
  SourceSpec capped = spec(write_tokens(dir, "a.jsonl", 1, 50), 1, "a");
  capped.settings.max_records = 20;
  const auto specs =
      std::vector<SourceSpec>{capped, spec(write_tokens(dir, "b.jsonl", 2, 10), 1, "b")};
  auto mix = mixture(specs, 0, 1, /*micro_batch=*/10);
  CHECK(mix->source(0).num_records() == 50);
  CHECK(mix->source(0).train_records() == 20);
  CHECK(mix->epoch_records() == 30);
  std::set<int64_t> seen;
  for (int step = 0; step < 30; ++step)
    for (const int64_t id : record_ids(mix->next())) seen.insert(id);
  for (const int64_t id : seen)
    if (id < 2000) CHECK(id <= 1020);  // records 0..19 of a.jsonl
  CHECK(seen.count(1020) == 1);
  // eval.split holds out of those 20 only.
  auto split = mixture(specs, 0, 1, 1, false, 0.1);
  CHECK(split->source(0).held_out().size() == 2);
  for (const int64_t r : split->source(0).held_out()) CHECK(r < 20);
}

// Each data.sources entry reads its records through its own columns and tags (the others are
// data.columns.* / data.tags.*): a ShareGPT file keyed "dialog" with speakers "q"/"a" beside one in
// LLaMA-Factory's default shape.
TEST_CASE("each source's own columns and tags read its records") {
  TempDir dir;
  const std::string plain = (dir.path / "plain.jsonl").string();
  const std::string custom = (dir.path / "custom.jsonl").string();
  std::ofstream(plain)
      << R"({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})"
      << "\n";
  std::ofstream(custom) << R"({"dialog": [{"who": "q", "text": "hi"}, {"who": "a", "text": "yo"}]})"
                        << "\n";
  JsonlOptions base = base_options();
  base.format = RecordFormat::kSharegpt;
  base.chat_template = ChatTemplate::kLlama3;
  base.tokenizer_path = std::string(FT_TEST_DIR) + "/tokenizer/fixtures/llama3/tokenizer.json";
  base.seq_len = 64;
  base.vocab_size = 0;
  SourceSpec a = spec(plain, 1, "plain"), b = spec(custom, 1, "custom");
  b.settings.shape.messages = "dialog";
  b.settings.shape.role = "who";
  b.settings.shape.content = "text";
  b.settings.shape.user = std::vector<std::string>{"q"};
  b.settings.shape.assistant = std::vector<std::string>{"a"};
  auto sources = open_sources({a, b}, base);
  // Both render to the same conversation, so to the same tokens.
  const TokenizedRecord ra = sources[0]->tokenize_whole(0), rb = sources[1]->tokenize_whole(0);
  CHECK(ra.ids == rb.ids);
  CHECK(ra.labels == rb.labels);
  // Without its own shape the second file is not a ShareGPT record.
  b.settings.shape = {};
  CHECK_THROWS_AS(open_sources({a, b}, base), ft::FormatError);
}
