// `ft train` as a user runs it: real processes, real output directories.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <sstream>

#include "support/subprocess.h"

using namespace ft::test;

namespace {
int run(const std::vector<std::string>& args, const std::string& out) { return run_ft(args, out); }
bool exists(const std::string& p) { return ::access(p.c_str(), F_OK) == 0; }
// The numbers under `key` in each line of metrics.jsonl.
std::vector<double> values(const std::string& jsonl, const std::string& key) {
  std::vector<double> out;
  const std::string tag = "\"" + key + "\":";
  std::istringstream in(jsonl);
  for (std::string l; std::getline(in, l);) {
    auto at = l.find(tag);
    REQUIRE(at != std::string::npos);
    out.push_back(std::stod(l.substr(at + tag.size())));
  }
  return out;
}
std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}
}  // namespace

TEST_CASE("ft train writes metrics, the preset and a model that ft train loads again",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  std::string out = dir + "/run";
  REQUIRE(run({"train", "--preset", "tiny-demo", "--output", out, "--set", "train.max_steps=6",
               "--set", "train.log_every=2"},
              dir + "/1.log") == 0);
  auto metrics = lines(read_file(out + "/metrics.jsonl"));
  REQUIRE(metrics.size() == 6);
  for (const char* key :
       {"\"step\":", "\"loss\":", "\"lr\":", "\"grad_norm\":", "\"tokens\":", "\"tokens_per_s\":",
        "\"step_time_s\":", "\"memory\":", "\"peak_rss_bytes\":"})
    CHECK_THAT(metrics.back(), Catch::Contains(key));
  CHECK_THAT(metrics.back(), Catch::Contains("\"step\":6"));
  CHECK_THAT(read_file(out + "/preset.json"), Catch::Contains("\"max_steps\": 6"));
  CHECK(exists(out + "/final/model.safetensors"));
  CHECK(exists(out + "/final/config.json"));
  CHECK(lines(read_file(dir + "/1.log")).size() >= 3);  // a line every 2 steps (not a terminal)

  // The saved model is a Hugging Face directory ft can start from.
  REQUIRE(run({"train", "--preset", "tiny-demo", "--model", out + "/final", "--output",
               dir + "/run2", "--set", "train.max_steps=1"},
              dir + "/2.log") == 0);
  CHECK(exists(dir + "/run2/metrics.jsonl"));

  // An earlier run is never written over.
  std::string before = read_file(out + "/metrics.jsonl");
  CHECK(run({"train", "--preset", "tiny-demo", "--output", out, "--set", "train.max_steps=1"},
            dir + "/3.log") == 2);
  CHECK_THAT(read_file(dir + "/3.log"), Catch::Contains("already holds a run"));
  CHECK(read_file(out + "/metrics.jsonl") == before);
  // A later launcher round (TORCHELASTIC_RESTART_COUNT > 0) that finds the run finished, with no
  // checkpoint to continue from, has nothing to do: exit 0, nothing trained or written over.
  const std::string final_before = read_file(out + "/final/model.safetensors");
  Child again =
      start({ft_bin(), "train", "--preset", "tiny-demo", "--output", out},
            {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}, {"TORCHELASTIC_RESTART_COUNT", "1"}},
            dir + "/4.log");
  CHECK(wait_for(again, 60) == 0);
  CHECK_THAT(again.output(),
             Catch::Contains("holds a finished run") && Catch::Contains("nothing to do"));
  CHECK(read_file(out + "/metrics.jsonl") == before);
  CHECK(read_file(out + "/final/model.safetensors") == final_before);
}

TEST_CASE("ft train with LoRA writes a PEFT adapter", "[multiproc]") {
  std::string dir = make_temp_dir();
  REQUIRE(run({"train", "--preset", "tiny-lora", "--output", dir + "/lora", "--set",
               "train.max_steps=3"},
              dir + "/l.log") == 0);
  CHECK(exists(dir + "/lora/final/adapter_model.safetensors"));
  std::string cfg = read_file(dir + "/lora/final/adapter_config.json");
  CHECK_THAT(cfg, Catch::Contains("\"peft_type\": \"LORA\""));
  CHECK_THAT(cfg, Catch::Contains("\"r\": 8"));
  std::string st = read_file(dir + "/lora/final/adapter_model.safetensors");
  CHECK_THAT(st, Catch::Contains("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
}

TEST_CASE("ft train refuses bad input before writing anything", "[multiproc]") {
  std::string dir = make_temp_dir();
  {
    std::ofstream f(dir + "/bad.json");
    f << R"({"base": "tiny-demo", "train": {"micro_batch": "eight"}})";
  }
  CHECK(run({"train", "--preset", dir + "/bad.json", "--output", dir + "/o1"}, dir + "/b.log") ==
        2);
  CHECK_THAT(read_file(dir + "/b.log"),
             Catch::Contains("bad.json: \"train.micro_batch\" must be an integer"));
  CHECK_FALSE(exists(dir + "/o1"));
  CHECK(run({"train", "--preset", "tiny-demo", "--output", dir + "/o2", "--set", "train.lr=fast"},
            dir + "/c.log") == 2);
  CHECK_FALSE(exists(dir + "/o2"));
  CHECK(
      run({"train", "--preset", "tiny-demo", "--model", dir + "/nothing", "--output", dir + "/o3"},
          dir + "/d.log") == 2);
  CHECK_THAT(read_file(dir + "/d.log"), Catch::Contains("config.json"));
  CHECK_FALSE(exists(dir + "/o3"));
  // A setting this build cannot honour is refused, not ignored.
  CHECK(run({"train", "--preset", "tiny-demo", "--output", dir + "/o4", "--set",
             "strategy.kind=zero3", "--set", "strategy.zero3.offload_optimizer=true"},
            dir + "/e.log") == 2);
  CHECK_THAT(read_file(dir + "/e.log"),
             Catch::Contains("strategy.zero3.offload_optimizer: this run is on CPU"));
  CHECK_FALSE(exists(dir + "/o4"));
  // Integers past INT64_MAX used to wrap to -1 and fail after the output directory was made.
  for (const char* key : {"train.micro_batch", "train.grad_accum", "train.warmup_steps"}) {
    INFO(key);
    CHECK(run({"train", "--preset", "tiny-demo", "--output", dir + "/o5", "--set",
               std::string(key) + "=18446744073709551615"},
              dir + "/f.log") == 2);
    CHECK_THAT(read_file(dir + "/f.log"), Catch::Contains("got 18446744073709551615"));
    CHECK_FALSE(exists(dir + "/o5"));
  }
  // A preset nested 100,000 deep crashed `ft train` (SIGSEGV): now exit 2 naming the file.
  {
    std::ofstream f(dir + "/deep.json");
    f << R"({"base": "tiny-demo", "train": {"lr": )" << std::string(100000, '[')
      << std::string(100000, ']') << "}}";
  }
  CHECK(run({"train", "--preset", dir + "/deep.json", "--output", dir + "/o6"}, dir + "/g.log") ==
        2);
  CHECK_THAT(read_file(dir + "/g.log"), Catch::Contains("deep.json: JSON nested deeper than 256"));
  CHECK_FALSE(exists(dir + "/o6"));
}

TEST_CASE("ft train on JSONL chat data with a tokenizer and a bad line names file and line",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  {
    std::ofstream f(dir + "/chat.jsonl");
    for (int i = 0; i < 24; ++i)
      f << R"({"messages": [{"role": "user", "content": "What is )" << i << R"( plus one?"},)"
        << R"({"role": "assistant", "content": "It is )" << i + 1 << R"(."}]})"
        << "\n";
  }
  std::string tok = test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json";
  std::vector<std::string> common = {"--tokenizer", tok,
                                     "--set",       "data.format=chat",
                                     "--set",       "data.template=llama3",
                                     "--set",       "model.vocab_size=1152",
                                     "--set",       "data.seq_len=64",
                                     "--set",       "train.max_steps=3"};
  std::vector<std::string> args = {
      "train", "--preset", "tiny-demo", "--data", dir + "/chat.jsonl", "--output", dir + "/run"};
  args.insert(args.end(), common.begin(), common.end());
  REQUIRE(run(args, dir + "/ok.log") == 0);
  CHECK(lines(read_file(dir + "/run/metrics.jsonl")).size() == 3);
  // The tokenizer it was trained with is saved beside the model.
  CHECK(read_file(dir + "/run/final/tokenizer.json") == read_file(tok));

  {
    std::ofstream f(dir + "/bad.jsonl");
    f << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
      << "\n";
    f << R"({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]})"
      << "\n";
  }
  args = {"train", "--preset", "tiny-demo", "--data", dir + "/bad.jsonl", "--output", dir + "/bad"};
  args.insert(args.end(), common.begin(), common.end());
  CHECK(run(args, dir + "/bad.log") != 0);
  CHECK_THAT(read_file(dir + "/bad.log"), Catch::Contains("bad.jsonl:2:"));
  // `ft train --preset tiny-demo --data chat.jsonl --tokenizer TOK --set k=v ...` into dir/out.
  auto tiny = [&](const std::string& out, const std::vector<std::string>& sets) {
    std::vector<std::string> a = {"train",         "--preset",          "tiny-demo",
                                  "--data",        dir + "/chat.jsonl", "--output",
                                  dir + "/" + out, "--tokenizer",       tok};
    for (const std::string& kv : sets) a.insert(a.end(), {"--set", kv});
    return a;
  };
  // A vocabulary smaller than the tokenizer's is refused before anything is written.
  args = tiny("small", {"data.format=chat", "train.max_steps=1"});
  CHECK(run(args, dir + "/small.log") == 2);
  CHECK_THAT(read_file(dir + "/small.log"),
             Catch::Contains("has 1150 tokens but the model's vocabulary is 320"));
  CHECK_FALSE(exists(dir + "/small"));

  // A tiny preset (format synthetic) given chat --data: the refusal names its fix, and then
  // data.template auto takes the tokenizer family's built-in (there is no --model) and says so.
  // Template none, which would train chat records without chat markup, is refused with its fix.
  const std::vector<std::string> sizes = {"model.vocab_size=1152", "data.seq_len=64",
                                          "train.max_steps=1"};
  args = tiny("tiny", sizes);
  CHECK(run(args, dir + "/tiny-synthetic.log") == 2);
  CHECK_THAT(read_file(dir + "/tiny-synthetic.log"), Catch::Contains("--set data.format=auto"));
  args.insert(args.end(), {"--set", "data.format=auto"});
  REQUIRE(run(args, dir + "/tiny-auto.log") == 0);
  CHECK_THAT(read_file(dir + "/tiny-auto.log"),
             Catch::Contains("template llama3 (built-in), chosen by data.template auto"));
  args = tiny("tiny-none", sizes);
  args.insert(args.end(), {"--set", "data.format=auto", "--set", "data.template=none"});
  CHECK(run(args, dir + "/tiny-none.log") == 2);
  CHECK_THAT(read_file(dir + "/tiny-none.log"),
             Catch::Contains("chat.jsonl:1: a chat record under data.template 'none'") &&
                 Catch::Contains("--set data.template=auto"));
  CHECK_FALSE(exists(dir + "/tiny-none"));
}

TEST_CASE("ft eval reports loss, tokens and perplexity of a trained model and of a LoRA adapter",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  {
    std::ofstream f(dir + "/chat.jsonl");
    for (int i = 0; i < 16; ++i)
      f << R"({"messages": [{"role": "user", "content": "Say )" << i << R"("},)"
        << R"({"role": "assistant", "content": "Number )" << i << R"(."}]})"
        << "\n";
  }
  std::string tok = test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json";
  std::vector<std::string> data = {
      "--data", dir + "/chat.jsonl", "--tokenizer", tok,
      "--set",  "data.format=chat",  "--set",       "data.template=llama3",
      "--set",  "data.seq_len=64"};
  auto train = [&](const std::string& out, const std::string& preset, int steps,
                   const std::string& model) {
    std::vector<std::string> a = {"train",
                                  "--preset",
                                  preset,
                                  "--output",
                                  dir + "/" + out,
                                  "--set",
                                  "train.max_steps=" + std::to_string(steps),
                                  "--set",
                                  "model.vocab_size=1152"};
    if (!model.empty()) a.insert(a.end(), {"--model", model});
    a.insert(a.end(), data.begin(), data.end());
    return run(a, dir + "/" + out + ".log");
  };
  auto eval = [&](const std::vector<std::string>& extra, const std::string& log) {
    std::vector<std::string> a = {"eval"};
    a.insert(a.end(), extra.begin(), extra.end());
    a.insert(a.end(), data.begin(), data.end());
    int rc = run(a, dir + "/" + log);
    return std::make_pair(rc, read_file(dir + "/" + log));
  };
  REQUIRE(train("short", "tiny-demo", 1, "") == 0);
  REQUIRE(train("long", "tiny-demo", 40, "") == 0);
  auto [rc1, e1] = eval({"--model", dir + "/short/final"}, "e1.log");
  auto [rc2, e2] = eval({"--model", dir + "/long/final"}, "e2.log");
  REQUIRE(rc1 == 0);
  REQUIRE(rc2 == 0);
  auto num = [](const std::string& json, const std::string& key) {
    auto at = json.find("\"" + key + "\":");
    REQUIRE(at != std::string::npos);
    return std::stod(json.substr(at + key.size() + 3));
  };
  CHECK(num(e1, "records") == 16);
  CHECK(num(e1, "tokens") > 16);
  CHECK(num(e1, "tokens") == num(e2, "tokens"));   // the same records and masks
  CHECK(num(e2, "loss") < num(e1, "loss") - 0.5);  // training on the data lowered its loss
  CHECK(num(e2, "perplexity") == Approx(std::exp(num(e2, "loss"))).epsilon(1e-9));

  // A LoRA adapter trained on top of the short model changes the evaluated loss.
  REQUIRE(train("lora", "tiny-lora", 20, dir + "/short/final") == 0);
  auto [rc3, e3] =
      eval({"--model", dir + "/short/final", "--adapter", dir + "/lora/final"}, "e3.log");
  REQUIRE(rc3 == 0);
  CHECK(num(e3, "loss") < num(e1, "loss"));
}

TEST_CASE("ft train with activation checkpointing logs the losses of a run without",
          "[multiproc]") {
  std::string dir = make_temp_dir();
  // tiny-lora with dropout: the recompute must replay the dropout masks of the forward.
  for (auto preset : {"tiny-demo", "tiny-lora"}) {
    DYNAMIC_SECTION(preset) {
      std::vector<std::string> common = {
          "train", "--preset", preset, "--set", "train.max_steps=3", "--set", "lora.dropout=0.1"};
      auto train = [&](const std::string& name, std::vector<std::string> sets) {
        std::vector<std::string> args = common;
        args.insert(args.end(), {"--output", dir + "/" + preset + name});
        for (auto& s : sets) args.insert(args.end(), {"--set", s});
        REQUIRE(run(args, dir + "/" + preset + name + ".log") == 0);
        return read_file(dir + "/" + preset + name + "/metrics.jsonl");
      };
      const std::string none = train("none", {});
      const std::string full = train("full", {"train.activation_checkpointing=full"});
      const std::string every = train("every_n", {"train.activation_checkpointing=every_n",
                                                  "train.checkpoint_every_n_layers=2"});
      for (const char* key : {"loss", "grad_norm"}) {
        INFO(key);
        auto ref = values(none, key);
        REQUIRE(ref.size() == 3);
        for (const auto* other : {&full, &every}) {
          auto got = values(*other, key);
          REQUIRE(got.size() == ref.size());
          for (size_t i = 0; i < ref.size(); ++i)
            CHECK(std::abs(got[i] - ref[i]) <= 1e-6 * std::abs(ref[i]));
        }
      }
    }
  }
}

TEST_CASE("ft train with train.max_steps=0 runs train.epochs passes over --data", "[multiproc]") {
  std::string dir = make_temp_dir();
  const int records = 20;
  {
    std::ofstream f(dir + "/text.jsonl");
    for (int i = 0; i < records; ++i)
      f << R"({"text": "Record number )" << i << std::string(i % 5, '!') << "\"}\n";
  }
  std::string tok = test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json";
  auto args = [&](const std::string& out, std::vector<std::string> sets) {
    std::vector<std::string> a = {"train",
                                  "--preset",
                                  "tiny-demo",
                                  "--data",
                                  dir + "/text.jsonl",
                                  "--tokenizer",
                                  tok,
                                  "--output",
                                  dir + "/" + out,
                                  "--set",
                                  "model.vocab_size=1152",
                                  "--set",
                                  "data.format=text",
                                  "--set",
                                  "data.seq_len=64",
                                  "--set",
                                  "train.max_steps=0",
                                  "--set",
                                  "train.warmup_steps=1"};
    for (auto& s : sets) a.insert(a.end(), {"--set", s});
    return a;
  };
  // One record per row: 2 epochs of 20 rows at 3 x 2 rows a step is ceil(40 / 6) = 7 steps.
  REQUIRE(run(args("single", {"data.pack=false", "train.epochs=2", "train.micro_batch=3",
                              "train.grad_accum=2"}),
              dir + "/single.log") == 0);
  CHECK_THAT(read_file(dir + "/single.log"), Catch::Contains("7 steps (2 epochs of 20 sequences)"));
  auto metrics = lines(read_file(dir + "/single/metrics.jsonl"));
  REQUIRE(metrics.size() == 7);
  CHECK_THAT(metrics.back(), Catch::Contains("\"samples\":42"));
  // The schedule spans the computed total: the last cosine step runs at the floor.
  CHECK_THAT(metrics.back(), Catch::Contains("\"lr\":0.0003"));

  // Packed: the start-up line names the counted sequences, and the steps follow from them.
  REQUIRE(run(args("packed", {"train.epochs=1.5", "train.micro_batch=2"}), dir + "/packed.log") ==
          0);
  const std::string log = read_file(dir + "/packed.log");
  const auto at = log.find("(1.5 epochs of ");
  REQUIRE(at != std::string::npos);
  const int64_t rows = std::stoll(log.substr(at + 15));
  CHECK(rows >= 2);
  CHECK(rows < records);  // several records to a row
  const auto steps = static_cast<size_t>(std::ceil(1.5 * rows / 2));
  CHECK(lines(read_file(dir + "/packed/metrics.jsonl")).size() == steps);

  // The synthetic task has no epochs: a clear refusal, nothing written.
  CHECK(run({"train", "--preset", "tiny-demo", "--output", dir + "/syn", "--set",
             "train.max_steps=0"},
            dir + "/syn.log") == 2);
  CHECK_THAT(read_file(dir + "/syn.log"), Catch::Contains("synthetic task has no epochs"));
  CHECK_THAT(read_file(dir + "/syn.log"), Catch::Contains("train.max_steps=N"));
  CHECK_FALSE(exists(dir + "/syn"));
  // Neither steps nor epochs.
  CHECK(run(args("none", {"train.epochs=0"}), dir + "/none.log") == 2);
  CHECK_THAT(read_file(dir + "/none.log"), Catch::Contains("both 0"));
  CHECK_FALSE(exists(dir + "/none"));
}

TEST_CASE("output.profile_steps writes a Chrome trace and prints where the step time went",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const int code = run({"train", "--preset", "tiny-demo", "--output", dir + "/run", "--set",
                        "train.max_steps=6", "--set", "output.profile_steps=2"},
                       dir + "/out.txt");
  const std::string out = read_file(dir + "/out.txt");
  INFO(out);
  REQUIRE(code == 0);
  CHECK(out.find("ft train: profiled steps 4-5") != std::string::npos);
  CHECK(out.find("aten::mm") != std::string::npos);  // the table names operators
  CHECK(out.find("ERROR") == std::string::npos);     // Kineto's no-GPU noise is silenced
  const std::string trace = read_file(dir + "/run/profile.json");
  CHECK(trace.find("\"traceEvents\"") != std::string::npos);
  CHECK(read_file(dir + "/run/profile.txt").find("ms/step") != std::string::npos);
  // A run too short to profile says so and trains all the same.
  const int short_code = run({"train", "--preset", "tiny-demo", "--output", dir + "/short", "--set",
                              "train.max_steps=2", "--set", "output.profile_steps=2"},
                             dir + "/short.txt");
  CHECK(short_code == 0);
  CHECK(read_file(dir + "/short.txt").find("nothing to profile") != std::string::npos);
  CHECK_FALSE(exists(dir + "/short/profile.json"));
}
