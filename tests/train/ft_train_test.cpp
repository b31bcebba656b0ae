// `ft train` as a user runs it: real processes, real output directories.
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
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
// All 17 significant digits: equal strings are equal doubles.
std::string fmt_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
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

  // An earlier run is never written over: a shorter one has nothing to do, a longer one has no
  // checkpoint to continue from.
  std::string before = read_file(out + "/metrics.jsonl");
  CHECK(run({"train", "--preset", "tiny-demo", "--output", out, "--set", "train.max_steps=1",
             "--set", "train.log_every=2"},
            dir + "/3.log") == 0);
  CHECK_THAT(read_file(dir + "/3.log"), Catch::Contains("already finished at step 6"));
  CHECK(run({"train", "--preset", "tiny-demo", "--output", out, "--set", "train.max_steps=9",
             "--set", "train.log_every=2"},
            dir + "/3b.log") == 2);
  CHECK_THAT(read_file(dir + "/3b.log"),
             Catch::Contains("holds a run finished at step 6 and no checkpoint to continue it"));
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
             Catch::Contains("already finished at step 6") && Catch::Contains("nothing to do"));
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
  // Its advice works (issue 51): the preset's shape takes --set model.vocab_size.
  CHECK_THAT(read_file(dir + "/small.log"),
             Catch::Contains("vocabulary is 320 (the preset's model.vocab_size); use the "
                             "tokenizer the model was made for, or give the preset's model room "
                             "for every token with --set model.vocab_size=1150"));
  args = tiny("followed", {"data.format=chat", "train.max_steps=1", "data.seq_len=64",
                           "model.vocab_size=1150"});
  CHECK(run(args, dir + "/followed.log") == 0);
  // A --model's shape does not take it, and the advice says what does: the model's own tokenizer.
  REQUIRE(run({"train", "--preset", "tiny-demo", "--output", dir + "/base", "--set",
               "train.max_steps=1"},
              dir + "/base.log") == 0);
  args = tiny("model", {"data.format=chat", "train.max_steps=1", "data.seq_len=64"});
  args.insert(args.end(), {"--model", dir + "/base/final"});
  CHECK(run(args, dir + "/model.log") == 2);
  CHECK_THAT(read_file(dir + "/model.log"),
             Catch::Contains("has 1150 tokens but the model's vocabulary is 320 (" + dir +
                             "/base/final/config.json); use the model's own tokenizer") &&
                 !Catch::Contains("--set model.vocab_size"));
  CHECK_FALSE(exists(dir + "/model"));

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
  // A line to read first, the JSON line last (what scripts take).
  CHECK_THAT(e1, Catch::Contains("ft eval: loss ") && Catch::Contains(" tokens of 16 records in "));
  CHECK(e1.rfind("{\"") > e1.find("ft eval: loss "));
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

  // Where it ran: hardware.device as ft train takes it (auto: a GPU when one is visible). Asked
  // for a GPU where none is visible (CUDA_VISIBLE_DEVICES empty), it says so and exits 2
  // (tests/cuda/gpu_check.cpp runs it on a GPU against the CPU's loss).
  CHECK_THAT(e1, Catch::Contains(" on cpu\n") && Catch::Contains("\"device\":\"cpu\""));
  const char* before = std::getenv("CUDA_VISIBLE_DEVICES");
  const std::string saved = before ? before : "";
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);
  auto [rc4, e4] =
      eval({"--model", dir + "/short/final", "--set", "hardware.device=cuda"}, "e4.log");
  if (before)
    ::setenv("CUDA_VISIBLE_DEVICES", saved.c_str(), 1);
  else
    ::unsetenv("CUDA_VISIBLE_DEVICES");
  CHECK(rc4 == 2);
  CHECK_THAT(e4, Catch::Contains("hardware.device=cuda"));
}

TEST_CASE(
    "ft eval: no padding to seq_len, long records scored in windows (each token once) or "
    "refused, and pre-tokenized data needs no tokenizer",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  REQUIRE(run({"train", "--preset", "tiny-demo", "--output", dir + "/m", "--set",
               "train.max_steps=1", "--set", "model.vocab_size=1152"},
              dir + "/train.log") == 0);
  // Pre-tokenized records of mixed lengths; and the windows seq_len 32 cuts the long ones into
  // (32 tokens, each starting one before the previous one's end), as records of their own.
  std::vector<std::vector<int>> records;
  for (const int len : {5, 40, 17, 100, 3, 64}) {
    std::vector<int> ids;
    for (int i = 0; i < len; ++i) ids.push_back((len * 31 + i * 7) % 1100 + 1);
    records.push_back(ids);
  }
  auto write = [&](const std::string& path, const std::vector<std::vector<int>>& rs) {
    std::ofstream f(path);
    for (const auto& ids : rs) f << nlohmann::json{{"input_ids", ids}}.dump() << "\n";
  };
  std::vector<std::vector<int>> windows;
  for (const auto& ids : records) {
    for (size_t begin = 0;; begin += 31) {
      const size_t end = std::min(ids.size(), begin + 32);
      windows.emplace_back(ids.begin() + begin, ids.begin() + end);
      if (end == ids.size()) break;
    }
  }
  write(dir + "/tokens.jsonl", records);
  write(dir + "/windows.jsonl", windows);
  auto eval = [&](const std::string& data, const std::vector<std::string>& sets,
                  const std::string& log) {
    std::vector<std::string> a = {"eval", "--model", dir + "/m/final",       "--data",
                                  data,   "--set",   "data.format=tokenized"};
    for (const auto& s : sets) a.insert(a.end(), {"--set", s});
    const int rc = run(a, dir + "/" + log);
    const std::string out = read_file(dir + "/" + log);
    INFO(output_tail(out));
    REQUIRE(rc == 0);
    return nlohmann::json::parse(out.substr(out.rfind('{')));
  };
  // One forward for all six, padded to the longest (100), not to seq_len; the same with one
  // record per forward and no padding at all.
  const auto whole = eval(dir + "/tokens.jsonl", {"data.seq_len=512"}, "whole.log");
  CHECK(whole["records"] == 6);
  CHECK(whole["tokens"] == 5 + 40 + 17 + 100 + 3 + 64 - 6);  // the first of each has no loss
  CHECK(whole["forwards"] == 1);
  CHECK(whole["padding_tokens"] == 6 * 100 - (5 + 40 + 17 + 100 + 3 + 64));
  CHECK(whole["windowed_records"] == 0);
  const auto single =
      eval(dir + "/tokens.jsonl", {"data.seq_len=512", "eval.batch_tokens=8"}, "single.log");
  CHECK(single["forwards"] == 6);
  CHECK(single["padding_tokens"] == 0);
  CHECK(single["tokens"] == whole["tokens"]);
  CHECK(single["loss"].get<double>() == Approx(whole["loss"].get<double>()).epsilon(1e-6));
  // seq_len 32: the records of 40, 100 and 64 tokens in 2 + 4 + 3 windows; every token still
  // scored once, and the loss is that of the windows as records.
  const auto windowed = eval(dir + "/tokens.jsonl", {"data.seq_len=32"}, "windowed.log");
  CHECK(windowed["windowed_records"] == 3);
  CHECK(windowed["windows"] == 9);
  CHECK(windowed["tokens"] == whole["tokens"]);
  const auto as_records = eval(dir + "/windows.jsonl", {"data.seq_len=512"}, "as_records.log");
  CHECK(as_records["records"] == 12);
  CHECK(as_records["tokens"] == windowed["tokens"]);
  CHECK(windowed["loss"].get<double>() == Approx(as_records["loss"].get<double>()).epsilon(1e-6));
  // The model directory has no tokenizer files (a run on the synthetic task): pre-tokenized data
  // needs none, for ft eval above and for ft train; text does.
  REQUIRE_FALSE(std::ifstream(dir + "/m/final/tokenizer.json").good());
  CHECK(run({"train", "--preset", "tiny-demo", "--model", dir + "/m/final", "--data",
             dir + "/tokens.jsonl", "--output", dir + "/ft", "--set", "data.format=auto", "--set",
             "data.seq_len=64", "--set", "train.max_steps=2"},
            dir + "/ft.log") == 0);
  std::ofstream(dir + "/text.jsonl") << R"({"text": "hello"})"
                                     << "\n";
  CHECK(run({"train", "--preset", "tiny-demo", "--model", dir + "/m/final", "--data",
             dir + "/text.jsonl", "--output", dir + "/ft-text", "--set", "data.format=auto"},
            dir + "/ft-text.log") == 2);
  CHECK_THAT(read_file(dir + "/ft-text.log"),
             Catch::Contains("holds text records, which need a tokenizer"));
  // eval.long_records=refuse: exit 2 naming the first long record's line.
  std::vector<std::string> refuse = {"eval",
                                     "--model",
                                     dir + "/m/final",
                                     "--data",
                                     dir + "/tokens.jsonl",
                                     "--set",
                                     "data.format=tokenized",
                                     "--set",
                                     "data.seq_len=32",
                                     "--set",
                                     "eval.long_records=refuse"};
  CHECK(run(refuse, dir + "/refuse.log") == 2);
  CHECK_THAT(read_file(dir + "/refuse.log"),
             Catch::Contains(dir + "/tokens.jsonl:2: the record has 40 tokens, more than "
                                   "data.seq_len=32 (eval.long_records=refuse)"));
}

TEST_CASE("ft data show prints records as the trainer sees them, and the file's statistics",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string tok = test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json";
  {
    std::ofstream f(dir + "/chat.jsonl");
    for (int i = 1; i <= 5; ++i)
      f << R"({"messages": [{"role": "user", "content": "Say )" << i << R"("},)"
        << R"({"role": "assistant", "content": "Number )" << i << R"(."}]})"
        << "\n";
    f << R"({"bad": 1})"
      << "\n";
  }
  auto show = [&](const std::vector<std::string>& more, const std::string& log) {
    std::vector<std::string> a = {"data",        "show", "--data", dir + "/chat.jsonl",
                                  "--tokenizer", tok,    "--set",  "model.vocab_size=1152"};
    a.insert(a.end(), more.begin(), more.end());
    const int rc = run(a, dir + "/" + log);
    return std::make_pair(rc, read_file(dir + "/" + log));
  };
  auto [rc, out] = show({"-n", "2", "--set", "data.on_bad_record=skip"}, "show.log");
  INFO(output_tail(out));
  REQUIRE(rc == 0);
  // The llama3 template's rendering, only the answer and its end of turn carrying the loss.
  CHECK_THAT(out, Catch::Contains("chat.jsonl:1 (chat): 25 tokens, 5 carry the loss") &&
                      Catch::Contains("<|begin_of_text|><|start_header_id|>user<|end_header_id|>"
                                      "\n\nSay 1<|eot_id|>") &&
                      Catch::Contains("⟦Number 1.<|eot_id|>⟧") &&
                      Catch::Contains("chat.jsonl:2 (chat)") && !Catch::Contains("chat.jsonl:3 ("));
  CHECK_THAT(out, Catch::Contains("records     6 (5 usable, 1 malformed and skipped, 0 empty)") &&
                      Catch::Contains("tokens      125 (25.0 per record") &&
                      Catch::Contains("trained     25 tokens carry the loss (20.0%)") &&
                      Catch::Contains("packing     1 rows of 2048 tokens per epoch") &&
                      Catch::Contains("16 - 31               5  ####"));
  // Without --preset the statistics are at the defaults, and say so (issue 28).
  CHECK_THAT(out, Catch::Contains("settings    data.seq_len 2048, train.micro_batch 1, "
                                  "train.grad_accum 1 (no --preset: the defaults and --set; give "
                                  "the --preset you train with)") &&
                      Catch::Contains("steps       one epoch is 1 optimizer step of 1 row"));
  // seq_len 16 cuts every record: said per record and in the statistics.
  auto [rc2, cut] = show({"-n", "1", "--set", "data.on_bad_record=skip", "--set", "data.seq_len=16",
                          "--set", "data.pack=false", "--set", "train.grad_accum=2"},
                         "cut.log");
  INFO(cut);
  REQUIRE(rc2 == 0);
  CHECK_THAT(cut, Catch::Contains("cut to data.seq_len=16 for training, the last 9 tokens are "
                                  "not trained") &&
                      Catch::Contains("[cut: ") &&
                      Catch::Contains("truncated   5 records longer than data.seq_len=16 (45 "
                                      "tokens cut off") &&
                      Catch::Contains("packing     5 rows of 16 tokens per epoch, 100.0% tokens") &&
                      Catch::Contains("steps       one epoch is 3 optimizer steps of 2 rows"));
  // The default policy stops at the bad line, naming it, with the statistics of the records before
  // it and the setting that skips such lines (issue 28).
  auto [rc3, bad] = show({"-n", "0", "--preset", "tiny-demo"}, "bad.log");
  INFO(bad);
  CHECK(rc3 == 2);
  CHECK_THAT(bad, Catch::Contains("records     5 before the malformed record ") &&
                      Catch::Contains("chat.jsonl:6 (5 usable, 0 empty); the statistics stop "
                                      "there, the file has 6") &&
                      Catch::Contains("tokens      125 (25.0 per record") &&
                      Catch::Contains("settings    data.seq_len 128, train.micro_batch 8, "
                                      "train.grad_accum 1 (preset tiny-demo and --set)") &&
                      Catch::Contains("ft: error: ") &&
                      Catch::Contains("the statistics above cover the 5 records before it") &&
                      Catch::Contains("--set data.on_bad_record=skip"));
  // Only a tokenizer, no model or preset: the records are read with the tokenizer's vocabulary,
  // not the defaults' 32000 (issue 51), here a tokenizer of 33000 ids as large ones are (Hugging
  // Face numbers added tokens on from the vocabulary, so the extra ones are contiguous).
  nlohmann::json big = nlohmann::json::parse(read_file(tok));
  for (int id = static_cast<int>(big["added_tokens"].size()) + 1130; id < 33000; ++id)
    big["added_tokens"].push_back({{"id", id},
                                   {"content", "<|extra_" + std::to_string(id) + "|>"},
                                   {"single_word", false},
                                   {"lstrip", false},
                                   {"rstrip", false},
                                   {"normalized", false},
                                   {"special", true}});
  std::ofstream(dir + "/big.json") << big.dump();
  REQUIRE(run({"data", "show", "--data", dir + "/chat.jsonl", "--tokenizer", dir + "/big.json",
               "-n", "1", "--set", "data.on_bad_record=skip"},
              dir + "/tok-only.log") == 0);
  CHECK_THAT(read_file(dir + "/tok-only.log"),
             Catch::Contains("chat.jsonl:1 (chat): 25 tokens, 5 carry the loss"));
  // With a preset, its vocabulary is what ft train would check, and the refusal says so.
  CHECK(run({"data", "show", "--data", dir + "/chat.jsonl", "--tokenizer", dir + "/big.json",
             "--preset", "tiny-demo"},
            dir + "/tok-preset.log") == 2);
  CHECK_THAT(read_file(dir + "/tok-preset.log"),
             Catch::Contains("has 33000 tokens but the model's vocabulary is 320 (the preset's "
                             "model.vocab_size)") &&
                 Catch::Contains("--set model.vocab_size=33000"));
  // Pre-tokenized data without a tokenizer: the ids only.
  std::ofstream(dir + "/ids.jsonl") << R"({"input_ids": [5, 6, 7]})"
                                    << "\n";
  REQUIRE(run({"data", "show", "--data", dir + "/ids.jsonl"}, dir + "/ids.log") == 0);
  CHECK_THAT(read_file(dir + "/ids.log"),
             Catch::Contains("(no tokenizer: pre-tokenized ids only)") &&
                 Catch::Contains("ids:  5 ⟦6 7⟧"));
}

TEST_CASE(
    "ft data prepare: ft train reads the tokenized cache and trains exactly as without it, and "
    "other "
    "settings do not use it and say why",
    "[multiproc]") {
  const std::string dir = make_temp_dir();
  const std::string tok = test_dir() + "/tokenizer/fixtures/llama3/tokenizer.json";
  {
    std::ofstream f(dir + "/chat.jsonl");
    for (int i = 0; i < 40; ++i)
      f << R"({"messages": [{"role": "user", "content": "Say )" << i << R"("},)"
        << R"({"role": "assistant", "content": "Number )" << i << R"(."}]})"
        << "\n";
  }
  const std::vector<std::string> data = {"--preset",    "tiny-demo",
                                         "--data",      dir + "/chat.jsonl",
                                         "--tokenizer", tok,
                                         "--set",       "model.vocab_size=1152",
                                         "--set",       "data.format=chat",
                                         "--set",       "data.template=llama3",
                                         "--set",       "data.seq_len=64"};
  auto ft = [&](std::vector<std::string> a, const std::vector<std::string>& more,
                const std::string& log) {
    a.insert(a.end(), data.begin(), data.end());
    a.insert(a.end(), more.begin(), more.end());
    const int rc = run(a, dir + "/" + log);
    return std::make_pair(rc, read_file(dir + "/" + log));
  };
  auto [rc, prepared] = ft({"data", "prepare"}, {}, "prepare.log");
  INFO(prepared);
  REQUIRE(rc == 0);
  CHECK_THAT(prepared, Catch::Contains(dir + "/chat.jsonl.ftcache/") &&
                           Catch::Contains("40 records (0 malformed"));
  auto [rc1, cached] =
      ft({"train", "--output", dir + "/cached"}, {"--set", "train.max_steps=3"}, "cached.log");
  INFO(cached);
  REQUIRE(rc1 == 0);
  CHECK_THAT(cached, Catch::Contains("records read from the tokenized cache " + dir +
                                     "/chat.jsonl.ftcache/"));
  // The same run with no cache (another, empty cache directory) ends with the same model.
  auto [rc2, plain] = ft({"train", "--output", dir + "/plain", "--data-cache", dir + "/none"},
                         {"--set", "train.max_steps=3"}, "plain.log");
  INFO(plain);
  REQUIRE(rc2 == 0);
  CHECK_THAT(plain, Catch::Contains("no tokenized cache") &&
                        Catch::Contains("every record is tokenized as it is read"));
  CHECK(read_file(dir + "/cached/final/model.safetensors") ==
        read_file(dir + "/plain/final/model.safetensors"));
  // Other data settings: not this cache, and the note says what differs.
  auto [rc3, other] =
      ft({"train", "--output", dir + "/other"},
         {"--set", "train.max_steps=1", "--set", "data.train_on_prompt=true"}, "other.log");
  INFO(other);
  REQUIRE(rc3 == 0);
  CHECK_THAT(other, Catch::Contains("is one for other inputs (train_on_prompt false, not true)"));
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

TEST_CASE(
    "fresh processes of one job compute bit-identical steps: MKL's vector math is primed before "
    "any parallel work (model/cpu_math.h)",
    "[multiproc]") {
  // Without the priming, about 1 process in 13 (2 threads) computed the first logsumexp of the
  // loss a last bit apart: 16 processes catch that 3 times in 4. The grad norm shows any
  // difference in any gradient.
  const std::string dir = make_temp_dir();
  std::vector<std::string> first;
  for (int i = 0; i < 16; ++i) {
    const std::string out = dir + "/run" + std::to_string(i);
    REQUIRE(run({"train", "--preset", "tiny-demo", "--output", out, "--set", "train.max_steps=2",
                 "--set", "output.save_every=0", "--set", "data.seq_len=64", "--set",
                 "model.hidden_size=64", "--set", "model.intermediate_size=176"},
                out + ".log") == 0);
    const std::string metrics = read_file(out + "/metrics.jsonl");
    std::vector<std::string> got;
    for (const char* key : {"loss", "grad_norm"})
      for (const double v : values(metrics, key)) got.push_back(fmt_double(v));
    REQUIRE(got.size() == 4);
    if (i == 0) first = got;
    INFO("process " << i);
    CHECK(got == first);
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
  INFO(output_tail(out));
  REQUIRE(code == 0);
  CHECK(out.find("ft train: profiled steps 4-5") != std::string::npos);
  CHECK(out.find("aten::mm") != std::string::npos);  // the table names operators
  CHECK(out.find("ERROR") == std::string::npos);     // Kineto's no-GPU noise is silenced
  const std::string trace = read_file(dir + "/run/profile.json");
  CHECK(trace.find("\"traceEvents\"") != std::string::npos);
  // The CPU table: operators by self time, the largest first, each at most its inclusive time,
  // and the self times of the rows shown at most the operators' busy time in the heading.
  const std::string table = read_file(dir + "/run/profile.txt");
  CHECK(table.find("by self time") != std::string::npos);
  const size_t busy_at = table.find("operators busy ");
  REQUIRE(busy_at != std::string::npos);
  const double busy = std::stod(table.substr(busy_at + 15));
  std::istringstream lines(table);
  std::string line;
  std::getline(lines, line);  // heading
  std::getline(lines, line);  // column names
  double previous = 1e300, shown = 0;
  int rows = 0;
  while (std::getline(lines, line)) {
    std::istringstream cols(line);
    double self_ms = 0, incl_ms = 0;
    std::string share;
    int64_t calls = 0;
    REQUIRE(static_cast<bool>(cols >> self_ms >> share >> incl_ms >> calls));
    CHECK(self_ms <= incl_ms + 1e-3);
    CHECK(self_ms <= previous);
    previous = self_ms;
    shown += self_ms;
    ++rows;
  }
  CHECK(rows >= 5);
  CHECK(shown <= busy + 0.01 * rows);
  // A run too short to profile says so and trains all the same.
  const int short_code = run({"train", "--preset", "tiny-demo", "--output", dir + "/short", "--set",
                              "train.max_steps=2", "--set", "output.profile_steps=2"},
                             dir + "/short.txt");
  CHECK(short_code == 0);
  CHECK(read_file(dir + "/short.txt").find("nothing to profile") != std::string::npos);
  CHECK_FALSE(exists(dir + "/short/profile.json"));
}
