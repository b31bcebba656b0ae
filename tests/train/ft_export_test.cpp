// `ft export` as a user runs it: real `ft train` runs with checkpoints, exported, and the exports
// evaluated with `ft eval` against the models `ft train` wrote itself.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.h"
#include "support/subprocess.h"

using namespace ft::test;
namespace fs = std::filesystem;

namespace {

// A scratch directory with the chat records every model here is evaluated on, and the commands.
struct Bench {
  std::string dir = make_temp_dir();
  std::string tok = test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json";
  std::vector<std::string> data;

  Bench() {
    std::ofstream f(dir + "/chat.jsonl");
    for (int i = 0; i < 12; ++i)
      f << R"({"messages": [{"role": "user", "content": "Say )" << i << R"("},)"
        << R"({"role": "assistant", "content": "Number )" << i << R"(."}]})"
        << "\n";
    data = {"--data", dir + "/chat.jsonl", "--tokenizer", tok,
            "--set",  "data.format=chat",  "--set",       "data.template=llama3",
            "--set",  "data.seq_len=64"};
  }
  ~Bench() {
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  Bench(const Bench&) = delete;
  Bench& operator=(const Bench&) = delete;
  std::string operator/(const std::string& name) const { return dir + "/" + name; }

  // ft train on the synthetic task, with the fixture tokenizer's vocabulary so ft eval can read
  // the chat records.
  void train(const std::string& out, const std::string& preset, std::vector<std::string> sets,
             const std::string& model = "") {
    std::vector<std::string> a = {
        "train", "--preset", preset, "--output", *this / out, "--set", "model.vocab_size=1152"};
    if (!model.empty()) a.insert(a.end(), {"--model", model});
    for (auto& s : sets) a.insert(a.end(), {"--set", s});
    REQUIRE(run_ft(a, *this / (out + ".log")) == 0);
  }
  // ft export's exit code; its output is in <log>.
  int export_(std::vector<std::string> args, const std::string& log) {
    args.insert(args.begin(), "export");
    return run_ft(args, *this / log);
  }
  std::string log(const std::string& name) const { return read_file(*this / name); }
  // ft eval's mean token loss of a model (and adapter), with `sets` after the data's.
  double loss(const std::string& model, const std::string& adapter = "",
              const std::vector<std::string>& sets = {}) {
    std::vector<std::string> a = {"eval", "--model", model};
    if (!adapter.empty()) a.insert(a.end(), {"--adapter", adapter});
    a.insert(a.end(), data.begin(), data.end());
    for (const auto& s : sets) a.insert(a.end(), {"--set", s});
    const std::string log = *this / ("eval" + std::to_string(evals++) + ".log");
    REQUIRE(run_ft(a, log) == 0);
    const std::string text = read_file(log);
    const auto at = text.find("\"loss\":");
    REQUIRE(at != std::string::npos);
    return std::stod(text.substr(at + 7));
  }
  int evals = 0;
};

bool exists(const std::string& p) { return fs::exists(p); }

// Nothing of an export to `out` is on disk: neither the directory nor a temporary beside it.
void require_nothing_written(const std::string& out) {
  CHECK_FALSE(exists(out));
  for (const auto& e : fs::directory_iterator(fs::path(out).parent_path()))
    CHECK(e.path().filename().string().find(".export-tmp-") == std::string::npos);
}

}  // namespace

TEST_CASE("ft export of a full fine-tune checkpoint is the model ft train wrote", "[multiproc]") {
  Bench b;
  b.train("run", "tiny-demo", {"train.max_steps=6", "output.save_every=3"});
  const std::string step6 = b / "run/checkpoints/step-000000006";
  REQUIRE(b.export_({"--checkpoint", step6, "--output", b / "e6"}, "e6.log") == 0);
  CHECK_THAT(b.log("e6.log"), Catch::Contains("ft export: wrote model.safetensors (1/1"));
  CHECK_THAT(b.log("e6.log"), Catch::Contains("step 6 of " + step6));
  // The same bytes as final/: the fp32 masters are what final/ holds in an fp32 run.
  CHECK(read_file(b / "e6/model.safetensors") == read_file(b / "run/final/model.safetensors"));
  CHECK(read_file(b / "e6/config.json") == read_file(b / "run/final/config.json"));
  const double final_loss = b.loss(b / "run/final");
  CHECK(b.loss(b / "e6") == final_loss);

  // The output directory names its newest state: final/ of the finished run (step 6, as new as
  // the newest checkpoint); step 3 is another model.
  REQUIRE(b.export_({"--checkpoint", b / "run", "--output", b / "newest"}, "newest.log") == 0);
  CHECK_THAT(b.log("newest.log"), Catch::Contains("final/ of the finished run (step 6)") &&
                                      Catch::Contains("step 6 of " + b / "run/final"));
  CHECK(read_file(b / "newest/model.safetensors") == read_file(b / "e6/model.safetensors"));
  REQUIRE(b.export_({"--checkpoint", b / "run/checkpoints/step-000000003", "--output", b / "e3"},
                    "e3.log") == 0);
  CHECK(std::abs(b.loss(b / "e3") - final_loss) > 1e-4);

  // Sharded (at most 150 KB a shard; the embedding gets one of its own) and bf16: what
  // transformers' save_pretrained writes.
  REQUIRE(
      b.export_({"--checkpoint", step6, "--output", b / "sharded", "--max-shard-size", "150000"},
                "sharded.log") == 0);
  CHECK(exists(b / "sharded/model.safetensors.index.json"));
  CHECK_FALSE(exists(b / "sharded/model.safetensors"));
  CHECK_THAT(b.log("sharded.log"), Catch::Contains("wrote model-00001-of-"));
  CHECK(b.loss(b / "sharded") == final_loss);
  REQUIRE(b.export_({"--checkpoint", step6, "--output", b / "bf16", "--dtype", "bf16"},
                    "bf16.log") == 0);
  const auto cfg = nlohmann::json::parse(read_file(b / "bf16/config.json"));
  CHECK(cfg["torch_dtype"] == "bfloat16");
  CHECK(cfg["dtype"] == "bfloat16");  // what transformers 5 reads
  CHECK(fs::file_size(b / "bf16/model.safetensors") <
        fs::file_size(b / "e6/model.safetensors") * 6 / 10);
  const double bf16_loss = b.loss(b / "bf16");
  CHECK(bf16_loss != final_loss);
  CHECK(std::abs(bf16_loss - final_loss) < 0.02 * final_loss);
}

TEST_CASE("ft export of a LoRA checkpoint: the PEFT adapter, and the merged model", "[multiproc]") {
  Bench b;
  b.train("base", "tiny-demo", {"train.max_steps=2"});
  const std::string base = b / "base/final";
  b.train("lora", "tiny-lora",
          {"train.max_steps=6", "output.save_every=3", "train.lr=1e-2", "lora.dropout=0"}, base);
  const std::string step6 = b / "lora/checkpoints/step-000000006";

  REQUIRE(b.export_({"--checkpoint", step6, "--output", b / "adapter"}, "adapter.log") == 0);
  CHECK(read_file(b / "adapter/adapter_model.safetensors") ==
        read_file(b / "lora/final/adapter_model.safetensors"));
  CHECK(read_file(b / "adapter/adapter_config.json") ==
        read_file(b / "lora/final/adapter_config.json"));
  CHECK_THAT(read_file(b / "adapter/adapter_config.json"), Catch::Contains(base));
  const double base_loss = b.loss(base);
  const double adapted = b.loss(base, b / "lora/final");
  CHECK(b.loss(base, b / "adapter") == adapted);
  CHECK(std::abs(adapted - base_loss) > 1e-3);  // the adapters matter

  REQUIRE(b.export_({"--checkpoint", step6, "--output", b / "merged", "--merge-lora"},
                    "merged.log") == 0);
  CHECK_THAT(b.log("merged.log"), Catch::Contains("merged model"));
  CHECK_FALSE(exists(b / "merged/adapter_config.json"));
  CHECK(std::abs(b.loss(b / "merged") - adapted) <= 1e-5);

  // An adapter is fp32 in one file: other dtypes and shard sizes are for models, not adapters.
  CHECK(b.export_({"--checkpoint", step6, "--output", b / "a16", "--dtype", "bf16"}, "a16.log") ==
        2);
  CHECK_THAT(b.log("a16.log"), Catch::Contains("--merge-lora"));
  require_nothing_written(b / "a16");

  // The base moved: the merge names the path it looked for and the option that points to it.
  fs::rename(b / "base", b / "moved");
  CHECK(b.export_({"--checkpoint", step6, "--output", b / "m2", "--merge-lora"}, "m2.log") == 2);
  CHECK_THAT(b.log("m2.log"),
             Catch::Contains(base + "/config.json") && Catch::Contains("--base-model"));
  require_nothing_written(b / "m2");
  REQUIRE(b.export_({"--checkpoint", step6, "--output", b / "m3", "--merge-lora", "--base-model",
                     b / "moved/final"},
                    "m3.log") == 0);
  CHECK(read_file(b / "m3/model.safetensors") == read_file(b / "merged/model.safetensors"));
}

TEST_CASE("ft export --merge-lora of a LoRA run on a random base draws the base the run used",
          "[multiproc]") {
  Bench b;
  // With lr 0 a full fine-tune's final/ is the random init itself: the base as a model directory.
  b.train("init", "tiny-demo", {"train.max_steps=1", "train.lr=0"});
  b.train("lora", "tiny-lora",
          {"train.max_steps=4", "output.save_every=4", "train.lr=1e-2", "lora.dropout=0"});
  REQUIRE(b.export_({"--checkpoint", b / "lora", "--output", b / "merged", "--merge-lora"},
                    "merged.log") == 0);
  const double adapted = b.loss(b / "init/final", b / "lora/final");
  CHECK(std::abs(adapted - b.loss(b / "init/final")) > 1e-3);
  CHECK(std::abs(b.loss(b / "merged") - adapted) <= 1e-5);
}

// QLoRA (issue 33): adapters trained on the base quantized to NF4 as it was read. ft eval with
// lora.quantize_base=nf4 holds the base as the run did; the merge folds the adapters into the
// dequantized base, and the merged model (plain weights, no quantization_config) scores the same.
TEST_CASE("ft export of a QLoRA run: the adapter on the NF4 base, merged into the dequantized base",
          "[multiproc]") {
  Bench b;
  b.train("base", "tiny-demo", {"train.max_steps=2"});
  const std::string base = b / "base/final";
  b.train("qlora", "tiny-lora",
          {"train.max_steps=4", "output.save_every=4", "train.lr=1e-2", "lora.dropout=0",
           "lora.quantize_base=nf4"},
          base);
  CHECK_THAT(b.log("qlora.log"), Catch::Contains("on the base quantized to NF4"));
  const double plain = b.loss(base), nf4 = b.loss(base, "", {"lora.quantize_base=nf4"});
  CHECK(nf4 != plain);                          // 4 bits change the model a little
  CHECK(std::abs(nf4 - plain) < 0.05 * plain);  // and only a little
  const double adapted = b.loss(base, b / "qlora/final", {"lora.quantize_base=nf4"});
  CHECK(std::abs(adapted - nf4) > 1e-3);  // the adapters matter

  REQUIRE(b.export_({"--checkpoint", b / "qlora", "--output", b / "merged", "--merge-lora"},
                    "merged.log") == 0);
  const auto cfg = nlohmann::json::parse(read_file(b / "merged/config.json"));
  CHECK_FALSE(cfg.contains("quantization_config"));
  CHECK(std::abs(b.loss(b / "merged") - adapted) <= 1e-5);
  // The adapter alone: the same file the run wrote.
  REQUIRE(
      b.export_({"--checkpoint", b / "qlora/checkpoints/step-000000004", "--output", b / "adapter"},
                "adapter.log") == 0);
  CHECK(read_file(b / "adapter/adapter_model.safetensors") ==
        read_file(b / "qlora/final/adapter_model.safetensors"));
}

TEST_CASE("ft export reads checkpoints that several ranks saved in pieces", "[multiproc]") {
  Bench b;
  // fsdp over 3 ranks splits tensors at uneven points; zero3 over 2 splits the adapters.
  for (auto [preset, strategy, nproc] :
       {std::tuple{"tiny-demo", "fsdp", "3"}, std::tuple{"tiny-lora", "zero3", "2"}}) {
    DYNAMIC_SECTION(preset << " " << strategy << " x" << nproc) {
      const std::string out = b / preset;
      std::vector<std::string> a = {
          "launch", "--nproc-per-node", nproc,  "--master-port", std::to_string(free_port()),
          "--",     ft_bin(),           "train"};
      for (const std::string& arg :
           {std::string("--preset"), std::string(preset), std::string("--output"), out})
        a.push_back(arg);
      for (const std::string& set :
           {std::string("strategy.kind=") + strategy, std::string("train.max_steps=3"),
            std::string("output.save_every=3")})
        a.insert(a.end(), {"--set", set});
      REQUIRE(run_ft(a, out + ".log") == 0);
      // --step: the checkpoint's pieces, not final/ (the run's newest state).
      REQUIRE(b.export_({"--checkpoint", out, "--step", "3", "--output", out + "-export"},
                        std::string(preset) + "-export.log") == 0);
      CHECK_THAT(b.log(std::string(preset) + "-export.log"),
                 Catch::Contains("checkpoint step 3 (asked for with --step)"));
      const std::string file =
          std::string(preset) == "tiny-lora" ? "adapter_model.safetensors" : "model.safetensors";
      CHECK(read_file(out + "-export/" + file) == read_file(out + "/final/" + file));
    }
  }
}

TEST_CASE("ft export refuses bad input with exit 2 and writes nothing", "[multiproc]") {
  Bench b;
  b.train("run", "tiny-demo", {"train.max_steps=2", "output.save_every=2"});
  b.train("plain", "tiny-demo", {"train.max_steps=1"});
  const std::string step = b / "run/checkpoints/step-000000002";
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  // A step directory without meta.json: a save that never committed.
  fs::copy(step, b / "run/checkpoints/step-000000009");
  fs::remove(b / "run/checkpoints/step-000000009/meta.json");
  // Damage: a flipped byte in a weight's piece; and a meta.json without one weight.
  fs::copy(b / "run", b / "damaged", fs::copy_options::recursive);
  const std::string damaged = b / "damaged/checkpoints/step-000000002/rank-00000.safetensors";
  {
    const std::string bytes = read_file(damaged);
    uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = header << 8 | static_cast<uint8_t>(bytes[i]);
    const auto h = nlohmann::json::parse(bytes.substr(8, header));
    const uint64_t at =
        8 + header + h["param/model.norm.weight@0"]["data_offsets"][0].get<uint64_t>();
    std::fstream f(damaged, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(at + 1));
    f.put(static_cast<char>(bytes[at + 1] ^ 0x10));
  }
  fs::copy(b / "run", b / "partial", fs::copy_options::recursive);
  const std::string meta = b / "partial/checkpoints/step-000000002/meta.json";
  auto m = nlohmann::json::parse(read_file(meta));
  REQUIRE(m["tensors"].erase("param/model.norm.weight") == 1);
  // Edited without its checksum: refused for that; with the checksum recomputed (a checkpoint
  // written that way): refused for the missing tensor.
  fs::copy(b / "partial", b / "edited", fs::copy_options::recursive);
  std::ofstream(b / "edited/checkpoints/step-000000002/meta.json", std::ios::trunc) << m.dump(1);
  m["meta_crc32c"] = ft::ckpt::meta_checksum(m);
  std::ofstream(meta, std::ios::trunc) << m.dump(1);
  fs::create_directories(b / "full");
  std::ofstream(b / "full/keep.txt") << "mine";
  fs::create_directories(b / "notes");
  std::ofstream(b / "notes/todo.txt") << "not a run";

  const std::vector<Case> cases = {
      {{"--checkpoint", b / "nowhere"}, b / "nowhere: no such directory"},
      {{"--checkpoint", b / "notes"}, "nothing to export"},
      {{"--checkpoint", b / "plain", "--step", "1"},
       "holds no committed checkpoint of step 1 (committed: none; final/ holds step 1)"},
      {{"--checkpoint", b / "run/checkpoints/step-000000009"}, "not a committed checkpoint"},
      {{"--checkpoint", step, "--merge-lora"}, "is a full fine-tune"},
      {{"--checkpoint", b / "run/final", "--merge-lora"}, "is a full fine-tune"},
      {{"--checkpoint", step, "--step", "2"}, "is one saved state already"},
      {{"--checkpoint", b / "damaged", "--step", "2"}, damaged},
      {{"--checkpoint", b / "edited", "--step", "2"}, "meta.json: checksum mismatch"},
      {{"--checkpoint", b / "partial", "--step", "2"}, "holds no model.norm.weight"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    INFO(cases[i].says);
    const std::string out = b / ("out" + std::to_string(i));
    std::vector<std::string> args = cases[i].args;
    args.insert(args.end(), {"--output", out});
    const std::string log = "bad" + std::to_string(i) + ".log";
    CHECK(b.export_(args, log) == 2);
    CHECK_THAT(b.log(log), Catch::Contains(cases[i].says));
    require_nothing_written(out);
  }
  // An --output that holds something is never written into.
  CHECK(b.export_({"--checkpoint", step, "--output", b / "full"}, "full.log") == 2);
  CHECK_THAT(b.log("full.log"), Catch::Contains("not an empty directory"));
  CHECK(fs::directory_iterator(b / "full")->path().filename() == "keep.txt");
  CHECK(std::distance(fs::directory_iterator(b / "full"), fs::directory_iterator()) == 1);
  // An empty one is.
  fs::create_directories(b / "empty");
  CHECK(b.export_({"--checkpoint", step, "--output", b / "empty"}, "empty.log") == 0);
  CHECK(exists(b / "empty/model.safetensors"));
}

TEST_CASE("ft export of a finished run takes final/: the model, in another dtype, sharded",
          "[multiproc]") {
  Bench b;
  // No output.save_every: a finished run without a single checkpoint.
  b.train("run", "tiny-demo", {"train.max_steps=3"});
  REQUIRE(b.export_({"--checkpoint", b / "run", "--output", b / "e"}, "e.log") == 0);
  CHECK_THAT(b.log("e.log"), Catch::Contains("final/ of the finished run (step 3)"));
  CHECK(read_file(b / "e/model.safetensors") == read_file(b / "run/final/model.safetensors"));
  CHECK(read_file(b / "e/config.json") == read_file(b / "run/final/config.json"));
  REQUIRE(b.export_({"--checkpoint", b / "run/final", "--output", b / "bf16", "--dtype", "bf16",
                     "--max-shard-size", "150000"},
                    "bf16.log") == 0);
  CHECK(nlohmann::json::parse(read_file(b / "bf16/config.json"))["torch_dtype"] == "bfloat16");
  CHECK(exists(b / "bf16/model.safetensors.index.json"));
  // A final/ copied away from its run still exports: its own config.json says what it is.
  fs::create_directories(b / "elsewhere");
  fs::copy(b / "run/final", b / "elsewhere/model", fs::copy_options::recursive);
  REQUIRE(b.export_({"--checkpoint", b / "elsewhere/model", "--output", b / "e2"}, "e2.log") == 0);
  CHECK_THAT(b.log("e2.log"), Catch::Contains("step unknown"));
  CHECK(read_file(b / "e2/model.safetensors") == read_file(b / "run/final/model.safetensors"));
}
