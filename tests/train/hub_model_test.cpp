// `--model ORG/NAME` as a user types it: ft train, ft plan, ft launch and ft data find a hub id in
// the Hugging Face hub cache (a real layout: blobs, symlinked snapshots, refs/main) through the
// environment variables huggingface_hub reads, and refuse one the cache lacks.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;

namespace {
const char* const kUnset = "\x01";  // start(): removes the variable
// tiny-demo's 128 tokens exceed the fixture's max_position_embeddings (64).
const char* const kSeqLen = "data.seq_len=32";

// The tiny Llama 3 fixture with its tokenizer, as `hf download acme/tiny-llama` would leave it.
std::string put_tiny_llama(const std::string& cache) {
  const std::string m = test_dir() + "/model/fixtures/llama3_gqa_tied/";
  return put_in_hub_cache(cache, "acme/tiny-llama", "5d3c1e0f9a",
                          {m + "config.json", m + "model.safetensors", m + "generation_config.json",
                           test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json"});
}

// The environment of a user whose hub cache is placed by `set` alone: the other variables that
// place it, and the launcher's, removed.
std::map<std::string, std::string> hub_env(std::map<std::string, std::string> set) {
  for (const char* name :
       {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "WORLD_SIZE", "RANK"})
    set.emplace(name, kUnset);
  return set;
}

Finished run_ft_with(const std::vector<std::string>& args,
                     const std::map<std::string, std::string>& env, const std::string& log) {
  std::vector<std::string> argv = {ft_bin()};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_to_end(argv, env, log, 240);
}
}  // namespace

TEST_CASE("ft train --model ORG/NAME trains from the hub cache and records the directory",
          "[multiproc]") {
  const std::string dir = make_temp_dir(), cache = dir + "/hub", out = dir + "/run";
  const std::string snapshot = put_tiny_llama(cache);
  const Finished r = run_ft_with({"train", "--preset", "tiny-demo", "--model", "acme/tiny-llama",
                                  "--output", out, "--set", "train.max_steps=1", "--set", kSeqLen},
                                 hub_env({{"HF_HUB_CACHE", cache}}), dir + "/train.log");
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  CHECK(lines_with(r.output, "ft train: --model acme/tiny-llama: " + snapshot + " (").size() == 1);
  CHECK_THAT(r.output, Catch::Contains("ft train: loading") && Catch::Contains(snapshot));
  // The run's records hold the directory, not the id: a resume or an export does not depend on
  // the cache variables of a later shell.
  nlohmann::json start;
  for (const auto& e : read_jsonl(out + "/events.jsonl"))
    if (e.value("event", "") == "start") start = e;
  CHECK(start.value("model", "") == snapshot);
}

TEST_CASE("ft plan, ft launch and ft data take a hub id from HF_HOME or the home directory",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string hf_home = dir + "/hf", home = dir + "/home";
  const std::string in_hf_home = put_tiny_llama(hf_home + "/hub");
  const std::string in_home = put_tiny_llama(home + "/.cache/huggingface/hub");

  const Finished plan =
      run_ft_with({"plan", "--preset", "tiny-demo", "--model", "acme/tiny-llama", "--set", kSeqLen},
                  hub_env({{"HF_HOME", hf_home}}), dir + "/plan.log");
  INFO(output_tail(plan.output));
  CHECK(plan.code == 0);
  CHECK(lines_with(plan.output, "ft plan: --model acme/tiny-llama: " + in_hf_home).size() == 1);
  CHECK_THAT(plan.output, Catch::Contains(in_hf_home + "/config.json"));

  // The launcher finds it once per node and hands its workers the directory.
  const Finished launch =
      run_ft_with({"launch", "--nproc-per-node", "1", "--dry-run", "--preset", "tiny-demo",
                   "--model", "acme/tiny-llama", "--output", dir + "/run", "--set", kSeqLen},
                  hub_env({{"HOME", home}}), dir + "/launch.log");
  INFO(output_tail(launch.output));
  CHECK(launch.code == 0);
  CHECK(lines_with(launch.output, "ft launch: --model acme/tiny-llama: " + in_home).size() == 1);
  CHECK_THAT(launch.output, Catch::Contains("--model " + in_home));

  // ft data reads the model's tokenizer.json and vocabulary (a config whose vocabulary holds the
  // tokenizer's).
  const std::string cfg = dir + "/config.json", data = dir + "/text.jsonl";
  std::ofstream(cfg) << R"({"model_type": "llama", "vocab_size": 2048, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
    "num_key_value_heads": 4, "max_position_embeddings": 64})";
  std::ofstream(data) << R"({"text": "hello hub cache"})"
                      << "\n";
  const std::string tok =
      put_in_hub_cache(hf_home + "/hub", "acme/tok", "77",
                       {cfg, test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json"});
  const Finished show =
      run_ft_with({"data", "show", "--data", data, "--model", "acme/tok", "-n", "1"},
                  hub_env({{"HF_HOME", hf_home}}), dir + "/show.log");
  INFO(output_tail(show.output));
  CHECK(show.code == 0);
  CHECK(lines_with(show.output, "ft data: --model acme/tok: " + tok).size() == 1);
  CHECK_THAT(show.output, Catch::Contains("hello hub cache"));
}

TEST_CASE("a hub id the cache lacks is refused naming the paths tried, and a directory wins",
          "[multiproc]") {
  const std::string dir = make_temp_dir(), cache = dir + "/hub";
  put_tiny_llama(cache);
  const Finished absent = run_ft_with({"plan", "--preset", "tiny-demo", "--model", "acme/absent"},
                                      hub_env({{"HF_HUB_CACHE", cache}}), dir + "/absent.log");
  INFO(output_tail(absent.output));
  CHECK(absent.code == 2);
  CHECK_THAT(absent.output, Catch::Contains("--model acme/absent: not a directory here") &&
                                Catch::Contains(cache + "/models--acme--absent/refs/main") &&
                                Catch::Contains("hf download acme/absent"));

  // A directory of that name beside the command wins over the cache (as transformers does).
  const std::string local = dir + "/acme/tiny-llama";
  std::filesystem::create_directories(local);
  std::filesystem::copy(test_dir() + "/model/fixtures/llama3_gqa_tied", local);
  const Finished here =
      run_to_end({"/bin/sh", "-c",
                  "cd " + dir + " && exec " + ft_bin() +
                      " plan --preset tiny-demo --model acme/tiny-llama --set " + kSeqLen},
                 hub_env({{"HF_HUB_CACHE", cache}}), dir + "/local.log", 120);
  INFO(output_tail(here.output));
  CHECK(here.code == 0);
  CHECK(lines_with(here.output, "ft plan: --model").empty());
  CHECK_THAT(here.output, Catch::Contains("from acme/tiny-llama/config.json"));
  CHECK_THAT(here.output, !Catch::Contains(cache));
}
