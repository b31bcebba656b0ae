// `ft presets` shows, after the shipped presets, one complete LoRA and one complete full fine-tune
// command for every model family ft trains; the commands are ones ft takes, and docs/training.md
// quotes each of them. Real processes: the built ft.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "config/family_commands.h"
#include "support/subprocess.h"

using namespace ft::test;

namespace {

// The ten model_types of issue 29, written out here rather than taken from the table under test.
const std::vector<std::string> kModelTypes = {"llama", "mistral", "ministral",   "qwen2",
                                              "qwen3", "gemma2",  "gemma3_text", "phi3",
                                              "olmo2", "granite"};

// The command lines of `text` under the block headed by `model_type`, up to the next blank line.
std::vector<std::string> block_of(const std::string& text, const std::string& model_type) {
  std::istringstream in(text);
  std::vector<std::string> out;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(model_type + " ", 0) == 0) {
      inside = true;
    } else if (inside && line.empty()) {
      break;
    } else if (inside) {
      out.push_back(line.substr(line.find_first_not_of(' ')));
    }
  }
  return out;
}

std::vector<std::string> words(const std::string& command) {
  std::istringstream in(command);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// The value after `flag` in a command's words ("" when absent).
std::string value_of(const std::vector<std::string>& w, const std::string& flag) {
  for (size_t i = 0; i + 1 < w.size(); ++i)
    if (w[i] == flag) return w[i + 1];
  return "";
}

}  // namespace

TEST_CASE("ft presets prints a LoRA and a full command for every model family", "[multiproc]") {
  const std::string dir = make_temp_dir();
  REQUIRE(run_ft({"presets"}, dir + "/presets.log", 60) == 0);
  const std::string out = read_file(dir + "/presets.log");
  INFO(output_tail(out));
  // The preset list is still there, and the family commands come after it.
  const size_t heading = out.find("Commands per model family");
  REQUIRE(heading != std::string::npos);
  CHECK(out.find("tiny-demo ") < heading);
  CHECK(out.find("\nfull ") < heading);
  for (const auto& type : kModelTypes) {
    INFO(type);
    const std::vector<std::string> lines = block_of(out.substr(heading), type);
    REQUIRE(lines.size() == 2);
    const auto lora = words(lines[0]), full = words(lines[1]);
    // ft train, one process, the lora preset; ft launch on 8 workers, the full preset.
    CHECK(std::vector<std::string>(lora.begin(), lora.begin() + 2) ==
          std::vector<std::string>{"ft", "train"});
    CHECK(value_of(lora, "--preset") == "lora");
    CHECK(std::vector<std::string>(full.begin(), full.begin() + 2) ==
          std::vector<std::string>{"ft", "launch"});
    CHECK(value_of(full, "--preset") == "full");
    CHECK(value_of(full, "--nproc-per-node") == "8");
    // Complete: a hub name as the model (the same in both), data and an output directory.
    const std::string model = value_of(lora, "--model");
    CHECK(std::regex_match(model, std::regex(R"([A-Za-z0-9-]+/[A-Za-z0-9._-]+)")));
    CHECK(value_of(full, "--model") == model);
    CHECK(value_of(lora, "--data") == "train.jsonl");
    CHECK(value_of(full, "--data") == "train.jsonl");
    CHECK_FALSE(value_of(lora, "--output").empty());
    CHECK_FALSE(value_of(full, "--output").empty());
    CHECK(value_of(lora, "--output") != value_of(full, "--output"));
  }
  CHECK(ft::config::family_commands().size() == kModelTypes.size());
}

TEST_CASE("the family commands are ones ft takes", "[multiproc]") {
  const std::string dir = make_temp_dir();
  // ft train: every option the LoRA commands give is one of ft train's.
  REQUIRE(run_ft({"train", "--help"}, dir + "/train-help.log", 60) == 0);
  const std::string help = read_file(dir + "/train-help.log");
  for (const auto& c : ft::config::family_commands()) {
    INFO(c.lora);
    for (const auto& w : words(c.lora))
      if (w.rfind("--", 0) == 0) CHECK(help.find(w + " ") != std::string::npos);
  }
  // ft launch: the full commands parse, find the model in the hub cache (here a snapshot made for
  // the test: --dry-run reads no weights), resolve the preset and lay out 1 node x 8 workers
  // running ft train with the same options on the snapshot (--dry-run starts no worker).
  const std::string hub = dir + "/hub";
  for (const auto& c : ft::config::family_commands()) {
    INFO(c.full);
    const std::string repo = hub + "/models--" + std::regex_replace(c.model, std::regex("/"), "--");
    const std::string snapshot = repo + "/snapshots/0123abcd";
    REQUIRE(std::filesystem::create_directories(snapshot));
    std::filesystem::create_directories(repo + "/refs");
    std::ofstream(repo + "/refs/main") << "0123abcd";
    std::vector<std::string> argv = words(c.full);
    argv[0] = ft_bin();
    argv.insert(argv.begin() + 2, "--dry-run");
    const Finished run =
        run_to_end(argv, {{"HF_HUB_CACHE", hub}, {"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}},
                   dir + "/" + c.model_type + ".log", 60);
    INFO(output_tail(run.output));
    CHECK(run.code == 0);
    CHECK_THAT(run.output, Catch::Contains("layout: 1 node(s) x 8 worker(s) = world size 8"));
    std::string worker = c.full.substr(c.full.find("--preset"));
    worker.replace(worker.find(c.model), c.model.size(), snapshot);
    CHECK_THAT(run.output, Catch::Contains("train " + worker + "\n"));
  }
}

TEST_CASE("docs/training.md shows the commands ft presets prints", "[unit]") {
  std::ifstream in(test_dir() + "/../docs/training.md");
  REQUIRE(in.good());
  std::stringstream doc;
  doc << in.rdbuf();
  for (const auto& c : ft::config::family_commands()) {
    INFO("docs/training.md (\"Commands per model family\") lacks a command of " << c.model_type);
    CHECK_THAT(doc.str(), Catch::Contains(c.lora + "\n") && Catch::Contains(c.full + "\n"));
    CHECK_THAT(doc.str(), Catch::Contains("| `" + c.model_type + "` |"));
  }
}
