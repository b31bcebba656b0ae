// Data files (JSONL plain, gzip and zstd; Parquet and Arrow in files_check.py), the line index,
// each record format and its auto-detection, the chat templates'
// exact text, prompt masking, packing invariants, the deterministic shuffle, and malformed
// records (each a FormatError naming file:line, or skipped and counted).
#include "support/catch_torch.h"
// (catch_torch.h first: it drops c10's CHECK before Catch defines its own)
#include <unistd.h>
#include <zlib.h>
#include <zstd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/chat_template.h"
#include "data/jsonl.h"
#include "data/jsonl_source.h"
#include "data/record_file.h"
#include "data/records.h"
#include "data/token_cache.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using namespace ft::data;
using ft::tokenizer::Tokenizer;

namespace {

const std::string kTokenizers = std::string(FT_TEST_DIR) + "/tokenizer/fixtures";

// A temp directory removed at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("ft_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter()++));
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
  std::string write(const std::string& name, const std::string& content) const {
    const fs::path p = path / name;
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }
};

std::shared_ptr<const Tokenizer> llama3() {
  static auto t = std::make_shared<const Tokenizer>(
      Tokenizer::from_file(kTokenizers + "/llama3/tokenizer.json"));
  return t;
}
std::shared_ptr<const Tokenizer> llama2() {
  static auto t = std::make_shared<const Tokenizer>(
      Tokenizer::from_file(kTokenizers + "/llama2/tokenizer.json"));
  return t;
}

std::string rendered(const Record& r, ChatTemplate t, bool train_on_prompt = false) {
  std::string out;
  for (const Segment& s : render(r, t, train_on_prompt, "test")) out += s.text;
  return out;
}
std::string trained_text(const Record& r, ChatTemplate t) {
  std::string out;
  for (const Segment& s : render(r, t, false, "test"))
    if (s.trained) out += s.text;
  return out;
}

Record chat(std::vector<Message> m) {
  Record r;
  r.format = RecordFormat::kChat;
  r.messages = std::move(m);
  return r;
}

// The FormatError message of parsing `line` as `format`, or "" when it parses.
std::string parse_error(const std::string& line, RecordFormat format) {
  try {
    parse_record(line, format, "train.jsonl:17");
  } catch (const ft::FormatError& e) {
    return e.what();
  }
  return "";
}

// N text records "record <i>".
std::string text_records(int n) {
  std::string s;
  for (int i = 0; i < n; ++i) s += "{\"text\": \"record " + std::to_string(i) + "\"}\n";
  return s;
}

// N text records of varied lengths: record i is one letter repeated i * step % modulo + 1 times.
std::string varied_text_records(int n, int step, int modulo) {
  std::string s;
  for (int i = 0; i < n; ++i)
    s += "{\"text\": \"" + std::string(static_cast<size_t>(i * step % modulo + 1), 'a' + i % 26) +
         "\"}\n";
  return s;
}

}  // namespace

TEST_CASE("JsonlIndex records the offsets of non-empty lines and reads them back") {
  TempDir dir;
  const std::string path = dir.write(
      "a.jsonl", "\n{\"text\": \"one\"}\n   \n\r\n{\"text\": \"two\"}\r\n\n{\"text\": \"three\"}");
  JsonlIndex index(path);
  REQUIRE(index.size() == 3);
  CHECK(index.read(0).text == "{\"text\": \"one\"}");
  CHECK(index.read(0).line == 2);
  CHECK(index.read(1).text == "{\"text\": \"two\"}");  // '\r' dropped
  CHECK(index.read(1).line == 5);
  CHECK(index.read(2).text == "{\"text\": \"three\"}");  // no final newline
  CHECK(index.read(2).line == 7);
  CHECK(JsonlIndex(dir.write("empty.jsonl", "\n \n")).size() == 0);
  CHECK_THROWS_AS(JsonlIndex((dir.path / "missing.jsonl").string()), ft::FormatError);
  CHECK_THROWS_WITH(JsonlIndex((dir.path / "missing.jsonl").string()),
                    Catch::Contains("missing.jsonl"));
}

TEST_CASE("JsonlIndex streams a file larger than its read buffer") {
  TempDir dir;
  std::string big;
  const std::string filler(1000, 'x');
  for (int i = 0; i < 3000; ++i) big += "{\"text\": \"" + std::to_string(i) + filler + "\"}\n";
  JsonlIndex index(dir.write("big.jsonl", big));  // ~3 MB: several 1 MiB chunks
  REQUIRE(index.size() == 3000);
  for (int i : {0, 1047, 1048, 2999})
    CHECK(index.read(i).text == "{\"text\": \"" + std::to_string(i) + filler + "\"}");
  CHECK(index.read(2999).line == 3000);
}

TEST_CASE("each record format parses and auto-detection finds it") {
  Record t = parse_record(R"({"text": "hello"})", RecordFormat::kAuto, "f:1");
  CHECK(t.format == RecordFormat::kText);
  CHECK(t.text == "hello");

  Record a = parse_record(R"({"instruction": "Add", "input": "1 2", "output": "3"})",
                          RecordFormat::kAlpaca, "f:1");
  CHECK(a.instruction == "Add");
  CHECK(a.input == "1 2");
  CHECK(a.output == "3");
  CHECK(parse_record(R"({"instruction": "Hi", "output": "Yo"})", RecordFormat::kAlpaca, "f:1")
            .input.empty());

  Record c = parse_record(
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},)"
      R"( {"role": "assistant", "content": "A"}]})",
      RecordFormat::kChat, "f:1");
  REQUIRE(c.messages.size() == 3);
  CHECK(c.messages[1].role == "user");
  CHECK(c.messages[2].content == "A");

  Record k = parse_record(R"({"input_ids": [1, 2, 3], "labels": [-100, 2, 3]})",
                          RecordFormat::kTokens, "f:1");
  CHECK(k.input_ids == std::vector<int64_t>{1, 2, 3});
  CHECK(k.labels == std::vector<int64_t>{-100, 2, 3});

  CHECK(detect_format(R"({"text": "x"})", "f:1") == RecordFormat::kText);
  CHECK(detect_format(R"({"instruction": "x", "output": "y"})", "f:1") == RecordFormat::kAlpaca);
  CHECK(detect_format(R"({"messages": []})", "f:1") == RecordFormat::kChat);
  CHECK(detect_format(R"({"input_ids": [1]})", "f:1") == RecordFormat::kTokens);
  CHECK(detect_format(R"({"conversations": []})", "f:1") == RecordFormat::kSharegpt);
  CHECK_THROWS_WITH(detect_format(R"({"prompt": "x"})", "f:3"), Catch::Contains("f:3"));
  CHECK(parse_record_format("alpaca") == RecordFormat::kAlpaca);
  CHECK(parse_record_format("sharegpt") == RecordFormat::kSharegpt);
  CHECK_THROWS_AS(parse_record_format("openai"), ft::ConfigError);
  CHECK(parse_chat_template("chatml") == ChatTemplate::kChatml);
  CHECK_THROWS_AS(parse_chat_template("gemma"), ft::ConfigError);
}

TEST_CASE("malformed records are FormatErrors naming the line and the problem") {
  CHECK_THAT(parse_error("{\"text\": ", RecordFormat::kText),
             Catch::StartsWith("train.jsonl:17: not valid JSON"));
  CHECK_THAT(parse_error(R"({"instruction": "x"})", RecordFormat::kAlpaca),
             Catch::StartsWith("train.jsonl:17: alpaca record: missing \"output\""));
  CHECK_THAT(parse_error(R"({"text": 3})", RecordFormat::kText),
             Catch::Contains("text must be a string"));
  CHECK_THAT(parse_error(R"({"messages": {"role": "user"}})", RecordFormat::kChat),
             Catch::Contains("chat record: messages must be a list"));
  CHECK_THAT(parse_error(R"({"messages": []})", RecordFormat::kChat),
             Catch::Contains("messages is empty"));
  CHECK(parse_error(R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant",)"
                    R"( "content": "b"}, {"role": "bot", "content": "c"}]})",
                    RecordFormat::kChat) ==
        "train.jsonl:17: chat record: messages[2].role 'bot' is not system/user/assistant/tool");
  CHECK_THAT(parse_error(R"({"messages": [{"role": "user"}]})", RecordFormat::kChat),
             Catch::Contains("missing \"messages[0].content\""));
  CHECK_THAT(parse_error(R"({"input_ids": [1, "2"]})", RecordFormat::kTokens),
             Catch::Contains("tokens record: input_ids[1] must be an integer"));
  CHECK_THAT(parse_error(R"({"input_ids": [1, 2.5]})", RecordFormat::kTokens),
             Catch::Contains("input_ids[1] must be an integer"));
  CHECK_THAT(parse_error(R"({"input_ids": [1, 2], "labels": [1]})", RecordFormat::kTokens),
             Catch::Contains("labels has 1 entries but input_ids has 2"));
  CHECK_THAT(parse_error(R"([1, 2])", RecordFormat::kAuto), Catch::Contains("JSON object"));
  // Hostile lines: nested past the limit (100,000 deep crashed nlohmann's parser), and a 1 MB bad
  // line, quoted short.
  const std::string deep =
      "{\"text\": " + std::string(100000, '[') + std::string(100000, ']') + "}";
  CHECK_THAT(parse_error(deep, RecordFormat::kText),
             Catch::StartsWith("train.jsonl:17: JSON nested deeper than 256 levels"));
  CHECK(parse_error("{\"text\": \"" + std::string(1000000, 'z'), RecordFormat::kText).size() <
        1000);
}

TEST_CASE("templates render the models' chat formats exactly") {
  const Record c = chat({{"system", "Be brief."},
                         {"user", "Hi"},
                         {"assistant", "Hello!"},
                         {"user", "Bye"},
                         {"assistant", "Bye."}});
  CHECK(rendered(c, ChatTemplate::kLlama3) ==
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>");
  CHECK(trained_text(c, ChatTemplate::kLlama3) == "Hello!<|eot_id|>Bye.<|eot_id|>");

  CHECK(rendered(c, ChatTemplate::kLlama2) ==
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
        "<s>[INST] Bye [/INST] Bye. </s>");
  CHECK(trained_text(c, ChatTemplate::kLlama2) == " Hello! </s> Bye. </s>");

  CHECK(rendered(c, ChatTemplate::kChatml) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\nBye.<|im_end|>\n");
  CHECK(trained_text(c, ChatTemplate::kChatml) == "Hello!<|im_end|>Bye.<|im_end|>");

  const Record no_system =
      chat({{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}, {"assistant", "Bye."}});
  CHECK(rendered(no_system, ChatTemplate::kMistral) ==
        "<s>[INST] Hi [/INST]Hello!</s>[INST] Bye [/INST]Bye.</s>");
  CHECK(trained_text(no_system, ChatTemplate::kMistral) == "Hello!</s>Bye.</s>");
  CHECK(rendered(c, ChatTemplate::kMistral).rfind("<s>[INST] Be brief.\n\nHi [/INST]", 0) == 0);
  CHECK(rendered(no_system, ChatTemplate::kLlama2) ==
        "<s>[INST] Hi [/INST] Hello! </s><s>[INST] Bye [/INST] Bye. </s>");

  Record alpaca;
  alpaca.format = RecordFormat::kAlpaca;
  alpaca.instruction = "Add";
  alpaca.input = "1 2";
  alpaca.output = "3";
  CHECK(rendered(alpaca, ChatTemplate::kLlama3) ==
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nAdd\n\n1 2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n3<|eot_id|>");
  CHECK(rendered(alpaca, ChatTemplate::kNone) == "Add\n\n1 2\n3");
  CHECK(trained_text(alpaca, ChatTemplate::kNone) == "3");

  // train_on_prompt: everything trained.
  for (const Segment& s : render(c, ChatTemplate::kLlama3, true, "t")) CHECK(s.trained);

  // Llama 2 and Mistral need alternating turns.
  CHECK_THROWS_WITH(
      render(chat({{"user", "a"}, {"user", "b"}}), ChatTemplate::kLlama2, false, "train.jsonl:4"),
      Catch::StartsWith("train.jsonl:4: chat record:") &&
          Catch::Contains("messages[1].role is 'user'"));
}

TEST_CASE("tokenization masks prompt tokens and trains assistant tokens") {
  const Tokenizer& tok = *llama3();
  const Record c = chat({{"user", "What is two plus two?"}, {"assistant", "Four."}});
  const TokenizedRecord r = tokenize_record(c, ChatTemplate::kLlama3, false, tok, "t:1");
  // The ids equal tokenizing the whole rendered conversation.
  const std::vector<int32_t> whole = tok.encode(rendered(c, ChatTemplate::kLlama3), false);
  REQUIRE(r.ids == std::vector<int64_t>(whole.begin(), whole.end()));
  REQUIRE(r.labels.size() == r.ids.size());
  CHECK(r.ids.front() == *tok.token_to_id("<|begin_of_text|>"));
  CHECK(r.ids.back() == *tok.token_to_id("<|eot_id|>"));
  // Trained tokens are exactly the answer and its <|eot_id|>.
  std::vector<int32_t> trained;
  for (size_t i = 0; i < r.ids.size(); ++i) {
    if (r.labels[i] != -100) {
      CHECK(r.labels[i] == r.ids[i]);
      trained.push_back(static_cast<int32_t>(r.ids[i]));
    }
  }
  CHECK(tok.decode(trained, false) == "Four.<|eot_id|>");

  const TokenizedRecord all = tokenize_record(c, ChatTemplate::kLlama3, true, tok, "t:1");
  CHECK(all.ids == r.ids);
  CHECK(all.labels == all.ids);

  // Llama 2 (SentencePiece-style normalizer): still the whole text's ids, answer trained.
  const Tokenizer& tok2 = *llama2();
  const TokenizedRecord r2 = tokenize_record(c, ChatTemplate::kLlama2, false, tok2, "t:1");
  const std::vector<int32_t> whole2 = tok2.encode(rendered(c, ChatTemplate::kLlama2), false);
  REQUIRE(r2.ids == std::vector<int64_t>(whole2.begin(), whole2.end()));
  std::vector<int32_t> trained2;
  for (size_t i = 0; i < r2.ids.size(); ++i)
    if (r2.labels[i] != -100) trained2.push_back(static_cast<int32_t>(r2.ids[i]));
  CHECK(r2.ids.front() == 1);   // <s>
  CHECK(trained2.back() == 2);  // </s> trained
  CHECK(tok2.decode(trained2, true).find("Four.") != std::string::npos);
  CHECK(tok2.decode(trained2, true).find("What") == std::string::npos);

  // Text records: BOS from the tokenizer, text and EOS trained.
  Record t;
  t.text = "Just text.";
  const TokenizedRecord rt = tokenize_record(t, ChatTemplate::kLlama3, false, tok, "t:1");
  CHECK(rt.ids.front() == *tok.bos_id());
  CHECK(rt.ids.back() == *tok.eos_id());
  CHECK(rt.labels == rt.ids);

  // Pre-tokenized records pass through; ids outside the vocabulary are refused.
  Record k;
  k.format = RecordFormat::kTokens;
  k.input_ids = {5, 6, 7};
  k.labels = {-100, 6, 7};
  const TokenizedRecord rk = tokenize_record(k, ChatTemplate::kNone, false, tok, "t:1");
  CHECK(rk.ids == k.input_ids);
  CHECK(rk.labels == k.labels);
  k.input_ids = {5, 6, 1000000};
  CHECK_THROWS_WITH(tokenize_record(k, ChatTemplate::kNone, false, tok, "t:9"),
                    Catch::Contains("t:9") && Catch::Contains("input_ids[2]"));
}

namespace {

JsonlOptions options_for(const std::string& path) {
  JsonlOptions o;
  o.path = path;
  o.tokenizer = llama3();
  o.chat_template = ChatTemplate::kLlama3;
  o.seq_len = 64;
  o.micro_batch = 4;
  return o;
}

// Checks the packing invariants of one batch; returns the number of segments holding a record.
// Records start with BOS (never id 0); padding is the row's last segment: ids 0, positions 0, no
// loss.
int64_t check_packing(const Batch& b, int64_t T) {
  REQUIRE(b.input_ids.size(1) == T);
  auto I = b.input_ids.accessor<int64_t, 2>();
  auto L = b.labels.accessor<int64_t, 2>();
  auto P = b.position_ids.accessor<int64_t, 2>();
  auto S = b.segment_ids.accessor<int64_t, 2>();
  int64_t records = 0;
  for (int64_t r = 0; r < b.input_ids.size(0); ++r) {
    bool padding = false;
    for (int64_t t = 0; t < T; ++t) {
      const bool starts = t == 0 || S[r][t] != S[r][t - 1];
      if (starts) {
        CHECK_FALSE(padding);                              // nothing after the padding
        CHECK(S[r][t] == (t == 0 ? 0 : S[r][t - 1] + 1));  // segments count up
        CHECK(P[r][t] == 0);                               // positions restart
        CHECK(L[r][t] == -100);                            // first token never trained
        padding = I[r][t] == 0;
        if (!padding) ++records;
      } else if (padding) {
        CHECK(I[r][t] == 0);
        CHECK(P[r][t] == 0);
        CHECK(L[r][t] == -100);
      } else {
        CHECK(P[r][t] == P[r][t - 1] + 1);
      }
      if (L[r][t] != -100) CHECK(L[r][t] == I[r][t]);
    }
  }
  return records;
}

}  // namespace

TEST_CASE("JsonlSource packs records with segment and position ids") {
  TempDir dir;
  std::string lines;
  for (int i = 0; i < 30; ++i) {
    lines += R"({"messages": [{"role": "user", "content": "question )" + std::to_string(i) +
             R"("}, {"role": "assistant", "content": ")" + std::string(i % 7 + 1, 'a') + R"("}]})" +
             "\n";
  }
  lines += R"({"messages": [{"role": "user", "content": ")" + std::string(400, 'q') +
           R"( and more"}, {"role": "assistant", "content": "x"}]})" + "\n";
  const std::string path = dir.write("chat.jsonl", lines);
  JsonlOptions o = options_for(path);
  JsonlSource src(o);
  CHECK(src.format() == RecordFormat::kChat);
  CHECK(src.num_records() == 31);
  int64_t packed = 0;
  int64_t trained = 0;
  while (src.epoch() == 0) {
    const Batch b = src.next();
    packed += check_packing(b, o.seq_len);
    trained += (b.labels != -100).sum().item<int64_t>();
  }
  CHECK(packed >= 31);  // every record placed (some of epoch 1 may follow in the last batch)
  CHECK(trained > 0);
  CHECK(src.truncated() >= 1);  // the 400-character question
  CHECK(src.samples_consumed() == 31);

  // pack=false: one record per row.
  o.pack = false;
  JsonlSource single(o);
  const Batch b = single.next();
  check_packing(b, o.seq_len);
  CHECK(single.samples_consumed() == o.micro_batch);
  auto S = b.segment_ids.accessor<int64_t, 2>();
  for (int64_t r = 0; r < o.micro_batch; ++r) CHECK(S[r][o.seq_len - 1] <= 1);
  // One record per row: attention may be plain causal (the flash kernel on a GPU).
  CHECK(b.single_segment_rows);
  CHECK_FALSE(b.attention_segments().defined());
  // Packed rows hold several records: the segment mask stays.
  JsonlSource again(options_for(path));
  const Batch p = again.next();
  CHECK(p.segment_ids.max().item<int64_t>() >= 2);
  CHECK_FALSE(p.single_segment_rows);
  CHECK(p.attention_segments().defined());
}

TEST_CASE("JsonlSource shuffles deterministically from seed and epoch") {
  TempDir dir;
  const int n = 50;
  const std::string path = dir.write("text.jsonl", text_records(n));
  JsonlOptions o = options_for(path);
  JsonlSource a(o), b(o);
  o.seed = 7;
  JsonlSource other_seed(o);
  std::vector<int64_t> e0, e1, e0b, e0s;
  for (int i = 0; i < n; ++i) {
    e0.push_back(a.record_at(0, i));
    e1.push_back(a.record_at(1, i));
    e0b.push_back(b.record_at(0, i));
    e0s.push_back(other_seed.record_at(0, i));
  }
  CHECK(e0 == e0b);
  CHECK(e0 != e1);
  CHECK(e0 != e0s);
  for (const auto* order : {&e0, &e1}) {
    std::set<int64_t> seen(order->begin(), order->end());
    CHECK(seen.size() == static_cast<size_t>(n));  // every record exactly once
  }

  // The batches follow that order: decode the first record of the first batch.
  o.seed = JsonlOptions::kDefaultSeed;
  o.pack = false;
  o.micro_batch = 1;
  JsonlSource c(o);
  const Batch first = c.next();
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < o.seq_len && first.segment_ids[0][t].item<int64_t>() == 0; ++t)
    ids.push_back(static_cast<int32_t>(first.input_ids[0][t].item<int64_t>()));
  CHECK(llama3()->decode(ids, true) == "record " + std::to_string(e0[0]));

  // Every record exactly once per epoch through next(), and world-size independent counting.
  o.micro_batch = 5;
  JsonlSource d(o);
  std::multiset<std::string> texts;
  for (int step = 0; step < n / 5; ++step) {
    const Batch bt = d.next();
    for (int64_t r = 0; r < 5; ++r) {
      std::vector<int32_t> row;
      for (int64_t t = 0; t < o.seq_len && bt.segment_ids[r][t].item<int64_t>() == 0; ++t)
        row.push_back(static_cast<int32_t>(bt.input_ids[r][t].item<int64_t>()));
      texts.insert(llama3()->decode(row, true));
    }
  }
  CHECK(texts.size() == static_cast<size_t>(n));
  CHECK(std::set<std::string>(texts.begin(), texts.end()).size() == static_cast<size_t>(n));
  CHECK(d.samples_consumed() == n);
  CHECK(d.epoch() == 1);

  o.world_size = 2;
  o.rank = 1;
  JsonlSource r1(o);
  r1.next();
  CHECK(r1.samples_consumed() == 10);  // 5 records on this rank = 10 globally
  o.rank = 0;
  JsonlSource resumed(o, 10);
  CHECK(resumed.samples_consumed() == 10);
}

TEST_CASE("JsonlSource: malformed lines are errors naming file:line, or skipped and counted") {
  TempDir dir;
  const std::string good = R"({"instruction": "Add", "input": "1 2", "output": "3"})";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{\"instruction\": ", "not valid JSON"},
      {R"({"instruction": "Add"})", "alpaca record: missing \"output\""},
      {R"({"instruction": "Add", "output": 3})", "output must be a string"},
  };
  for (const auto& [line, what] : bad) {
    const std::string path = dir.write("alpaca.jsonl", good + "\n\n" + good + "\n" + line + "\n");
    JsonlOptions o = options_for(path);
    o.micro_batch = 8;
    JsonlSource src(o);
    CHECK_THROWS_AS(src.next(), ft::FormatError);
    JsonlSource src2(o);
    CHECK_THROWS_WITH(src2.next(), Catch::StartsWith(path + ":4: ") && Catch::Contains(what));
  }

  const std::vector<std::pair<std::string, std::string>> bad_chat = {
      {R"({"messages": "hi"})", "messages must be a list"},
      {R"({"messages": [{"role": "bot", "content": "hi"}]})", "messages[0].role 'bot'"},
  };
  for (const auto& [line, what] : bad_chat) {
    const std::string first = R"({"messages": [{"role": "user", "content": "hi"}]})";
    const std::string path = dir.write("chat.jsonl", first + "\n" + first + "\n" + line + "\n");
    JsonlOptions o = options_for(path);
    o.micro_batch = 8;
    JsonlSource src(o);
    CHECK_THROWS_WITH(src.next(),
                      Catch::StartsWith(path + ":3: chat record: ") && Catch::Contains(what));
  }

  {
    const std::string path =
        dir.write("tok.jsonl", "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, \"x\"]}\n");
    JsonlOptions o = options_for(path);
    o.micro_batch = 8;
    JsonlSource src(o);
    CHECK(src.format() == RecordFormat::kTokens);
    CHECK_THROWS_WITH(src.next(), Catch::StartsWith(path + ":2: tokens record: input_ids[1]"));
  }

  // A bad first record is refused at construction, whatever the policy.
  {
    const std::string path = dir.write("first.jsonl", "{\"messages\": []}\n" + good + "\n");
    JsonlOptions o = options_for(path);
    o.on_bad_record = BadRecordPolicy::kSkip;
    CHECK_THROWS_WITH(JsonlSource(o),
                      Catch::StartsWith(path + ":1: chat record: messages is empty"));
  }

  // skip: every bad line skipped and counted; the good ones all arrive.
  std::string mixed = good + "\n";
  for (const auto& [line, what] : bad) mixed += line + "\n" + good + "\n";
  const std::string path = dir.write("mixed.jsonl", mixed);
  JsonlOptions o = options_for(path);
  o.on_bad_record = BadRecordPolicy::kSkip;
  o.pack = false;
  o.micro_batch = 4;
  JsonlSource src(o);
  src.next();  // 4 good records of one epoch: the 3 bad ones skipped on the way
  CHECK(src.skipped() == 3);
  CHECK(src.samples_consumed() == 7);
  CHECK(src.epoch() == 1);

  CHECK(parse_bad_record_policy("skip") == BadRecordPolicy::kSkip);
  CHECK_THROWS_AS(parse_bad_record_policy("ignore"), ft::ConfigError);
}

TEST_CASE("JsonlSource refuses a template whose tokens the tokenizer lacks, and empty files") {
  TempDir dir;
  const std::string chat =
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})"
      "\n";
  JsonlOptions o = options_for(dir.write("c.jsonl", chat));
  o.chat_template = ChatTemplate::kChatml;  // <|im_start|> is not a Llama 3 token
  CHECK_THROWS_WITH(JsonlSource(o), Catch::Contains("<|im_start|>"));
  // Plain text is not rendered with the template: the template's tokens do not matter there.
  o.path = dir.write("t.jsonl", text_records(3));
  CHECK_NOTHROW(JsonlSource(o));
  o.chat_template = ChatTemplate::kLlama3;
  o.path = dir.write("empty.jsonl", "\n\n");
  CHECK_THROWS_WITH(JsonlSource(o), Catch::Contains("empty.jsonl: no records"));
  o.path = dir.write("t.jsonl", text_records(3));
  o.seq_len = 1;
  CHECK_THROWS_AS(JsonlSource(o), ft::ConfigError);
}

TEST_CASE("JsonlSource reads pre-tokenized records without a tokenizer, and nothing else") {
  TempDir dir;
  JsonlOptions o;
  o.path = dir.write("ids.jsonl", "{\"input_ids\": [5, 6, 7, 8]}\n{\"input_ids\": [9, 10]}\n");
  o.seq_len = 8;
  o.pack = false;
  o.vocab_size = 11;  // the model's
  JsonlSource src(o);
  CHECK(src.format() == RecordFormat::kTokens);
  const Batch b = src.next();
  CHECK(b.input_ids[0][0].item<int64_t>() == 5);
  CHECK(b.input_ids[0][3].item<int64_t>() == 8);
  // Ids are checked against the model's vocabulary.
  o.vocab_size = 10;
  CHECK_THROWS_WITH(JsonlSource(o).tokenize_whole(1),
                    Catch::Contains("ids.jsonl:2: tokens record: input_ids[1] = 10 is outside the "
                                    "vocabulary of 10"));
  // Text needs a tokenizer, and the error says how to give one.
  o.path = dir.write("t.jsonl", text_records(2));
  CHECK_THROWS_WITH(JsonlSource(o), Catch::Contains("t.jsonl holds text records, which need a "
                                                    "tokenizer") &&
                                        Catch::Contains("--tokenizer") &&
                                        Catch::Contains("pre-tokenized"));
}

TEST_CASE("JsonlSource resumed at samples_consumed() continues with the same batches") {
  TempDir dir;
  JsonlOptions o = options_for(dir.write("resume.jsonl", varied_text_records(23, 5, 40)));
  o.seq_len = 32;
  o.micro_batch = 2;
  JsonlSource a(o);
  for (int step = 0; step < 7; ++step) a.next();  // into the second epoch, a record pending
  JsonlSource b(o, a.samples_consumed());
  for (int step = 0; step < 5; ++step) {
    const Batch x = a.next(), y = b.next();
    CHECK(at::equal(x.input_ids, y.input_ids));
    CHECK(at::equal(x.labels, y.labels));
    CHECK(at::equal(x.segment_ids, y.segment_ids));
  }
  CHECK(a.samples_consumed() == b.samples_consumed());
}

// nlohmann's parser rejects lone surrogates and invalid UTF-8 bytes, so such text never reaches the
// tokenizer.
TEST_CASE("a string that is not valid Unicode is a FormatError naming file:line") {
  TempDir dir;
  const std::string path =
      dir.write("utf8.jsonl", "{\"text\": \"fine\"}\n{\"text\": \"bad \\udc80 byte\"}\n");
  JsonlOptions o = options_for(path);
  o.micro_batch = 4;
  JsonlSource src(o);
  CHECK_THROWS_WITH(src.next(), Catch::StartsWith(path + ":2: not valid JSON"));
}

TEST_CASE("rows_per_epoch counts the rows next() packs one epoch into") {
  TempDir dir;
  const std::string path = dir.write("rows.jsonl", varied_text_records(41, 7, 90));
  for (const bool pack : {true, false}) {
    DYNAMIC_SECTION("pack=" << pack) {
      JsonlOptions o = options_for(path);
      o.seq_len = 32;  // some records are truncated
      o.micro_batch = 1;
      o.pack = pack;
      JsonlSource counter(o);
      std::vector<std::pair<int64_t, int64_t>> calls;
      const int64_t rows = counter.rows_per_epoch([&](int64_t done, int64_t total) {
        calls.push_back({done, total});
      });
      REQUIRE(!calls.empty());
      CHECK(calls.back() == std::make_pair<int64_t, int64_t>(41, 41));
      CHECK(counter.samples_consumed() == 0);  // counting does not move the source
      CHECK(counter.truncated() == 0);
      // The row that places the epoch's last record is row number `rows`.
      JsonlSource src(o);
      int64_t produced = 0;
      while (src.samples_consumed() < 41) {
        src.next();
        ++produced;
      }
      CHECK(produced == rows);
      if (pack) {
        CHECK(rows < 41);
      } else {
        CHECK(rows == 41);
      }
      // The counting source then produces the same batches as a fresh one.
      JsonlSource fresh(o);
      for (int i = 0; i < 3; ++i)
        CHECK(at::equal(counter.next().input_ids, fresh.next().input_ids));
    }
  }
}

TEST_CASE("rows_per_epoch: a malformed record is next()'s error, or not counted with skip") {
  TempDir dir;
  const std::string good = R"({"text": "fine"})";
  const std::string path = dir.write(
      "bad.jsonl", good + "\n" + good + "\n{\"text\": 3}\n" + good + "\n{\"text\": [1]}\n");
  JsonlOptions o = options_for(path);
  o.pack = false;
  JsonlSource strict(o);
  CHECK_THROWS_WITH(strict.rows_per_epoch(), Catch::StartsWith(path + ":3: ") &&
                                                 Catch::EndsWith("--set data.on_bad_record=skip"));
  // kStop: the scan covers the records before the first bad one, and names it (ft data show).
  const JsonlSource::EpochScan before = strict.scan_epoch({}, JsonlSource::AtMalformed::kStop);
  CHECK(before.tokens.size() == 2);
  CHECK(before.rows == 2);
  CHECK(before.stopped_at == 2);
  CHECK(before.stopped_origin == path + ":3");
  CHECK_THAT(before.stopped_error, Catch::StartsWith(path + ":3: "));
  // next() says the same when it meets a bad line (a batch of 5 rows takes the whole epoch).
  o.micro_batch = 5;
  JsonlSource reader(o);
  CHECK_THROWS_WITH(reader.next(), Catch::StartsWith(path + ":") &&
                                       Catch::EndsWith("--set data.on_bad_record=skip"));
  o.on_bad_record = BadRecordPolicy::kSkip;
  JsonlSource lenient(o);
  CHECK(lenient.rows_per_epoch() == 3);
  const JsonlSource::EpochScan all = lenient.scan_epoch({}, JsonlSource::AtMalformed::kStop);
  CHECK(all.stopped_at == -1);
  CHECK(all.tokens.size() == 5);
}

TEST_CASE("the tokenized cache holds every record as tokenizing gives it, for these inputs only") {
  TempDir dir;
  std::string text = varied_text_records(40, 7, 90);
  text += "{\"text\": 5}\n";  // malformed: skipped and marked
  JsonlOptions o = options_for(dir.write("c.jsonl", text));
  o.on_bad_record = BadRecordPolicy::kSkip;
  o.tokenizer_path = kTokenizers + "/llama3/tokenizer.json";  // part of the key
  const JsonlSource plain(o);
  const nlohmann::json key = token_cache_key(o);
  const std::string path = token_cache_path(o, key);
  CHECK(path.rfind(dir.path.string() + "/c.jsonl.ftcache/", 0) == 0);
  const PrepareResult r = write_token_cache(plain, path, key, {});
  CHECK(r.records == 41);
  CHECK(r.malformed == 1);
  std::string why;
  auto cache = TokenCache::open(path, key, &why);
  REQUIRE(cache);
  CHECK(cache->records() == 41);
  CHECK(cache->malformed(40));
  for (int64_t i = 0; i < 40; ++i) {
    const TokenizedRecord a = plain.tokenize_whole(i), b = cache->record(i);
    CHECK(a.ids == b.ids);
    CHECK(a.labels == b.labels);
  }
  // A source with use_cache reads it, and gives the same batches.
  o.use_cache = true;
  JsonlSource cached(o);
  CHECK(cached.cache_path() == path);
  JsonlOptions again = o;
  again.use_cache = false;
  JsonlSource fresh(again);
  for (int step = 0; step < 5; ++step)
    CHECK(at::equal(cached.next().input_ids, fresh.next().input_ids));
  // Other settings: another key, so not this cache, and the note names what differs.
  JsonlOptions other = o;
  other.train_on_prompt = true;
  const nlohmann::json other_key = token_cache_key(other);
  CHECK(token_cache_path(other, other_key) != path);
  CHECK_FALSE(TokenCache::open(token_cache_path(other, other_key), other_key, &why));
  CHECK_THAT(why, Catch::Contains("train_on_prompt false, not true"));
  // A damaged file is ignored, with the reason.
  fs::resize_file(path, fs::file_size(path) - 8);
  CHECK_FALSE(TokenCache::open(path, key, &why));
  CHECK_THAT(why, Catch::Contains("is damaged"));
  JsonlSource damaged(o);
  CHECK(damaged.cache_path().empty());
  CHECK_THAT(damaged.cache_note(), Catch::Contains("is damaged"));
}

// --- the model's own chat template (data/chat_template.h)

namespace {

const std::string kTemplates = std::string(FT_TEST_DIR) + "/template/fixtures";

std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

ModelChatTemplate fixture_template(const std::string& name, const std::string& bos,
                                   const std::string& eos) {
  return {read_all(kTemplates + "/templates/" + name + ".jinja"), name + ".jinja", bos, eos, {}};
}

// transformers' rendering of (template, conversation) from the template fixtures.
std::string transformers_output(const std::string& tmpl, const std::string& conversation) {
  const nlohmann::json doc = nlohmann::json::parse(read_all(kTemplates + "/conversations.json"));
  for (const auto& c : doc["cases"]) {
    if (c["template"] == tmpl && c["conversation"] == conversation) return c["output"];
  }
  FAIL("no fixture case " << tmpl << " / " << conversation);
  return "";
}

std::vector<Message> messages_of(const std::string& tmpl, const std::string& conversation) {
  const nlohmann::json doc = nlohmann::json::parse(read_all(kTemplates + "/conversations.json"));
  for (const auto& c : doc["cases"]) {
    if (c["template"] != tmpl || c["conversation"] != conversation) continue;
    std::vector<Message> out;
    for (const auto& m : c["variables"]["messages"]) out.push_back({m["role"], m["content"]});
    return out;
  }
  FAIL("no fixture case " << tmpl << " / " << conversation);
  return {};
}

}  // namespace

TEST_CASE("the model's chat template is read from tokenizer_config.json or chat_template.jinja") {
  TempDir dir;
  const std::string d = dir.path.string();
  CHECK_FALSE(read_model_chat_template(d).has_value());
  // tokenizer_config.json's entry; bos / eos as strings or AddedToken objects.
  dir.write("tokenizer_config.json",
            R"({"chat_template": "T", "bos_token": {"content": "<s>", "lstrip": false},
                "eos_token": "</s>"})");
  auto m = read_model_chat_template(d);
  REQUIRE(m.has_value());
  CHECK(m->text == "T");
  CHECK(m->origin == d + "/tokenizer_config.json chat_template");
  CHECK(m->bos_token == "<s>");
  CHECK(m->eos_token == "</s>");
  // chat_template.jinja wins over the config's entry, as in transformers 5 (its from_pretrained:
  // "independent chat template file(s) ... take priority"); bos / eos still come from the config.
  dir.write("chat_template.jinja", "{{ messages[0].content }}\n");
  m = read_model_chat_template(d);
  REQUIRE(m.has_value());
  CHECK(m->text == "{{ messages[0].content }}\n");
  CHECK(m->origin == d + "/chat_template.jinja");
  CHECK(m->bos_token == "<s>");
  fs::remove(dir.path / "chat_template.jinja");
  dir.write("tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "A"},
                                  {"name": "default", "template": "B"}]})");
  m = read_model_chat_template(d);
  REQUIRE(m.has_value());
  CHECK(m->text == "B");
  dir.write("tokenizer_config.json",
            R"({"chat_template": [{"name": "tool_use", "template": "A"}]})");
  CHECK_THROWS_WITH(read_model_chat_template(d),
                    Catch::Contains("no template named \"default\" (it has: tool_use)"));
  dir.write("tokenizer_config.json", R"({"chat_template": 3})");
  CHECK_THROWS_WITH(read_model_chat_template(d),
                    Catch::Contains("chat_template must be a string or a list, got number"));
  dir.write("tokenizer_config.json", "{not json");
  CHECK_THROWS_WITH(read_model_chat_template(d), Catch::Contains("tokenizer_config.json"));
}

TEST_CASE("each built-in template's Jinja source renders and masks as the built-in does") {
  // What a model trained with a built-in carries as chat_template.jinja must render what training
  // rendered: the same text, the same trained turns, the same refusals.
  auto chat = [](std::vector<Message> m) {
    Record r;
    r.format = RecordFormat::kChat;
    r.messages = std::move(m);
    return r;
  };
  Record alpaca;
  alpaca.format = RecordFormat::kAlpaca;
  alpaca.instruction = "Add the numbers.";
  alpaca.input = " 2 and 3 ";
  alpaca.output = "5";
  const std::vector<Record> records = {
      chat({{"user", "Hi"}, {"assistant", "Hello."}}),
      chat({{"system", "  Be brief.\n"},
            {"user", " What is 2+2? "},
            {"assistant", "4.\n"},
            {"user", "And 3+3?"},
            {"assistant", "  6."}}),
      chat({{"system", "   "}, {"user", "x"}, {"assistant", "y"}}),
      chat({{"user", "tab\tand\nnewline"}, {"assistant", "ok"}, {"user", "bye"}}), alpaca};
  auto joined = [](const std::vector<Segment>& segs) {
    std::string text, trained;
    for (const Segment& s : segs) {
      text += s.text;
      if (s.trained) trained += s.text;
    }
    return std::pair{text, trained};
  };
  for (ChatTemplate t : {ChatTemplate::kLlama3, ChatTemplate::kChatml, ChatTemplate::kLlama2,
                         ChatTemplate::kMistral}) {
    const JinjaChatTemplate jinja({builtin_template_jinja(t), "built-in", "", "", std::nullopt});
    for (size_t i = 0; i < records.size(); ++i) {
      INFO(name_of(t) << " record " << i);
      const std::vector<Message> m =
          records[i].format == RecordFormat::kChat
              ? records[i].messages
              : std::vector<Message>{{"user", "Add the numbers.\n\n 2 and 3 "}, {"assistant", "5"}};
      for (bool prompt : {false, true}) {
        const auto builtin = joined(render(records[i], t, prompt, "r"));
        const auto from_jinja = joined(jinja.render(m, prompt, "r"));
        CHECK(from_jinja.first == builtin.first);
        CHECK(from_jinja.second == builtin.second);
      }
    }
    // A conversation the built-in refuses, the Jinja form refuses too (Llama 2 and Mistral).
    const Record bad = chat({{"assistant", "first"}, {"user", "then"}});
    const bool builtin_refuses = [&] {
      try {
        render(bad, t, false, "r");
        return false;
      } catch (const ft::FormatError&) {
        return true;
      }
    }();
    const bool jinja_refuses = [&] {
      try {
        jinja.render(bad.messages, false, "r");
        return false;
      } catch (const ft::Error&) {
        return true;
      }
    }();
    CHECK(jinja_refuses == builtin_refuses);
  }
  CHECK(builtin_template_jinja(ChatTemplate::kNone).empty());
}

TEST_CASE("the model's template renders as transformers and trains only the assistant turns") {
  struct Case {
    const char* tmpl;
    const char* bos;
    const char* eos;
    const char* conversation;
    const char* trained;
  };
  const Case cases[] = {
      {"llama-3.1-instruct", "<|begin_of_text|>", "<|eot_id|>", "system_multi_turn",
       "4.<|eot_id|>6.<|eot_id|>"},
      {"qwen2.5-instruct", "", "<|im_end|>", "system_multi_turn", "4.<|im_end|>6.<|im_end|>"},
      // Qwen3 gives only the conversation's last answer an empty think block (and every answer,
      // rendered last in a prefix, one): each turn is trained as the whole rendering writes it.
      {"qwen3", "", "<|im_end|>", "system_multi_turn",
       "4.<|im_end|><think>\n\n</think>\n\n6.<|im_end|>"},
      {"gemma-2-it", "<bos>", "<eos>", "single_turn_no_system", "7<end_of_turn>"},
      {"mistral-v3-instruct", "<s>", "</s>", "single_turn_no_system", " 7</s>"},
      // Phi-3.5 closes a conversation without a generation prompt with eos_token: the last turn
      // keeps it.
      {"phi-3.5-mini-instruct", "<s>", "<|endoftext|>", "system_multi_turn",
       "4.<|end|>6.<|end|>\n<|endoftext|>"},
  };
  for (const Case& c : cases) {
    INFO(c.tmpl);
    const JinjaChatTemplate t(fixture_template(c.tmpl, c.bos, c.eos));
    const auto msgs = messages_of(c.tmpl, c.conversation);
    const std::vector<Segment> segs = t.render(msgs, false, "train.jsonl:3");
    std::string full, trained;
    for (const Segment& s : segs) {
      full += s.text;
      if (s.trained) trained += s.text;
    }
    CHECK(full == transformers_output(c.tmpl, c.conversation));
    CHECK(trained == c.trained);
    // train_on_prompt: the same text, all of it trained.
    const std::vector<Segment> all = t.render(msgs, true, "t");
    REQUIRE(all.size() == 1);
    CHECK(all[0].trained);
    CHECK(all[0].text == full);
  }
}

TEST_CASE("the model's template: errors name the record, and rewriting templates are refused") {
  const JinjaChatTemplate gemma(fixture_template("gemma-2-it", "<bos>", "<eos>"));
  CHECK_THROWS_WITH(gemma.render({{"system", "s"}, {"user", "u"}}, false, "train.jsonl:9"),
                    Catch::StartsWith("train.jsonl:9: chat record: the model's chat template "
                                      "failed: gemma-2-it.jinja:1:") &&
                        Catch::Contains("System role not supported"));
  // Mistral's templates put the system message into the last user turn: the rendering before the
  // first answer is not a prefix of the whole one, so no mask follows it.
  const JinjaChatTemplate mistral(fixture_template("mistral-v3-instruct", "<s>", "</s>"));
  CHECK_THROWS_WITH(
      mistral.render(messages_of("mistral-v3-instruct", "system_multi_turn"), false, "t.jsonl:1"),
      Catch::Contains("renders the conversation before messages[2] so that it is not a prefix"));
  // A template that writes the last turn differently.
  const JinjaChatTemplate rewriting(
      {"{% for m in messages %}{% if loop.last %}LAST:{% endif %}{{ m.content }}|{% endfor %}",
       "rewrite.jinja",
       "",
       "",
       {}});
  CHECK_THROWS_WITH(
      rewriting.render({{"user", "u"}, {"assistant", "a"}, {"user", "v"}}, false, "train.jsonl:4"),
      Catch::StartsWith("train.jsonl:4: chat record: the model's chat template "
                        "(rewrite.jinja) renders the conversation before messages[1]"));
  // A template that writes an answer differently when more follows: the answer, found nowhere,
  // is refused rather than trained as nothing.
  const JinjaChatTemplate bracketing(
      {"{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[{{ m.content }}]"
       "{% else %}{{ m.content }}{% endif %}|{% endfor %}",
       "bracket.jinja",
       "",
       "",
       {}});
  CHECK_THROWS_WITH(
      bracketing.render({{"user", "u"}, {"assistant", "a"}, {"user", "v"}}, false, "train.jsonl:5"),
      Catch::StartsWith("train.jsonl:5: chat record: the model's chat template (bracket.jinja) "
                        "writes messages[1] in the whole conversation unlike when it is the last "
                        "message"));
  // A chat record under template none is refused with the fix.
  CHECK_THROWS_WITH(render(chat({{"user", "q"}, {"assistant", "a"}}), ChatTemplate::kNone, false,
                           "train.jsonl:2"),
                    Catch::StartsWith("train.jsonl:2: a chat record under data.template 'none'") &&
                        Catch::Contains("--set data.template=auto"));
}

TEST_CASE("tokenize_record with the model's template labels exactly the assistant tokens") {
  const JinjaChatTemplate t(
      fixture_template("llama-3.1-instruct", "<|begin_of_text|>", "<|eot_id|>"));
  const Record r = chat({{"user", "Hello there"}, {"assistant", "General Kenobi"}});
  const TokenizedRecord tr = tokenize_record(r, ChatTemplate::kModel, false, *llama3(), "t:1", &t);
  // The whole rendering encoded at once, without the tokenizer adding a BOS (the template has it).
  std::string full;
  for (const Segment& s : t.render(r.messages, false, "t:1")) full += s.text;
  const std::vector<int32_t> ids = llama3()->encode(full, false);
  REQUIRE(tr.ids == std::vector<int64_t>(ids.begin(), ids.end()));
  CHECK(tr.ids.front() == *llama3()->token_to_id("<|begin_of_text|>"));
  std::vector<int64_t> trained;
  for (size_t i = 0; i < tr.ids.size(); ++i)
    if (tr.labels[i] != -100) trained.push_back(tr.ids[i]);
  const std::vector<int32_t> want = llama3()->encode("General Kenobi<|eot_id|>", false);
  CHECK(trained == std::vector<int64_t>(want.begin(), want.end()));
}

TEST_CASE("JsonlSource: data.template auto uses the model's template, else the family's built-in") {
  TempDir dir;
  const std::string data = dir.write(
      "chat.jsonl",
      R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
      "\n");
  JsonlOptions o;
  o.path = data;
  o.tokenizer = llama3();
  o.chat_template = parse_chat_template("auto");
  o.seq_len = 64;
  {
    JsonlSource s(o);  // no model directory: the tokenizer's family (Llama 3's tokens)
    CHECK(s.template_used() ==
          "llama3 (built-in), chosen by data.template auto from the "
          "tokenizer's special tokens (no model directory)");
  }
  const fs::path model = dir.path / "model";
  fs::create_directories(model);
  std::ofstream(model / "chat_template.jinja")
      << read_all(kTemplates + "/templates/llama-3.1-instruct.jinja");
  std::ofstream(model / "tokenizer_config.json")
      << R"({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})";
  o.model_dir = model.string();
  JsonlSource s(o);
  CHECK(s.template_used() ==
        "the model's own chat template (" + (model / "chat_template.jinja").string() + ")");
  const Batch b = s.next();
  // The model's template writes its default system header (Llama 3.1's knowledge cutoff), which
  // the built-in llama3 template does not.
  std::vector<int32_t> row;
  for (int64_t i = 0; i < b.input_ids.size(1); ++i)
    row.push_back(static_cast<int32_t>(b.input_ids[0][i].item<int64_t>()));
  const std::string text = llama3()->decode(row, false);
  CHECK(text.find("Cutting Knowledge Date: December 2023") != std::string::npos);
}

TEST_CASE("the model's template gives transformers' apply_chat_template token ids") {
  // Each model's bos / eos, as the rendering fixtures passed them.
  std::map<std::string, std::pair<std::string, std::string>> special;
  const nlohmann::json renders =
      nlohmann::json::parse(read_all(kTemplates + "/conversations.json"));
  for (const auto& c : renders["cases"]) {
    const auto& v = c["variables"];
    special[c["template"]] = {v.value("bos_token", ""), v.value("eos_token", "")};
  }
  std::map<std::string, std::shared_ptr<const Tokenizer>> tokenizers;
  const nlohmann::json doc = nlohmann::json::parse(read_all(kTemplates + "/tokens.json"));
  size_t masked = 0;
  for (const auto& c : doc["cases"]) {
    const std::string name = c["template"], kind = c["tokenizer"];
    INFO(name << " / " << kind << " / " << c["conversation"].get<std::string>());
    if (!tokenizers.count(kind)) {
      tokenizers[kind] = std::make_shared<const Tokenizer>(
          Tokenizer::from_file(kTokenizers + "/" + kind + "/tokenizer.json"));
    }
    const Tokenizer& tok = *tokenizers[kind];
    ModelChatTemplate model = fixture_template(name, special[name].first, special[name].second);
    model.now = doc["meta"]["strftime_now_epoch"].get<std::time_t>();  // Llama 3.2 writes the date
    const JinjaChatTemplate t(model);
    std::vector<Message> msgs;
    for (const auto& m : c["messages"]) msgs.push_back({m["role"], m["content"]});
    const Record r = chat(msgs);
    const std::vector<int64_t> want = c["ids"].get<std::vector<int64_t>>();
    CHECK(tokenize_record(r, ChatTemplate::kModel, true, tok, "t:1", &t).ids == want);
    // Masked (where the template keeps earlier turns as they were): the same ids, and the
    // trained ones are the assistant turns' tokens.
    try {
      const TokenizedRecord tr = tokenize_record(r, ChatTemplate::kModel, false, tok, "t:1", &t);
      CHECK(tr.ids == want);
      ++masked;
    } catch (const ft::FormatError& e) {
      CHECK_THAT(e.what(), Catch::Contains("is not a prefix of the whole rendering") ||
                               Catch::Contains("messages[0] is an assistant turn"));
    }
  }
  CHECK(doc["cases"].size() >= 60);
  CHECK(masked >= 50);
}

TEST_CASE("the tokenized cache's key holds the model's own chat template") {
  TempDir dir;
  const std::string chat =
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]})"
      "\n";
  JsonlOptions o = options_for(dir.write("c.jsonl", chat));
  o.tokenizer_path = kTokenizers + "/llama3/tokenizer.json";
  o.chat_template = ChatTemplate::kAuto;
  const nlohmann::json builtin = JsonlSource(o).cache_key();
  CHECK_FALSE(builtin.contains("template_text"));
  CHECK(builtin["template"] == "llama3");  // the tokenizer's family
  fs::create_directories(dir.path / "model");
  const std::string text =
      "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
      "{{ m.content }}<|eot_id|>{% endfor %}";
  std::ofstream(dir.path / "model" / "tokenizer_config.json")
      << nlohmann::json{{"chat_template", text}}.dump();
  o.model_dir = (dir.path / "model").string();
  const nlohmann::json own = JsonlSource(o).cache_key();
  CHECK(own["template_text"] == text);
  CHECK(token_cache_path(o, own) != token_cache_path(o, builtin));
}

namespace {

// `text` gzip-compressed as `members` concatenated gzip members (as `cat a.gz b.gz` makes).
std::string gzip_of(const std::string& text, int members) {
  std::string out;
  const size_t part = text.size() / static_cast<size_t>(members) + 1;
  for (size_t begin = 0; begin < text.size(); begin += part) {
    const std::string piece = text.substr(begin, part);
    z_stream z{};
    REQUIRE(deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
    std::string buf(deflateBound(&z, piece.size()), '\0');
    z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(piece.data()));
    z.avail_in = static_cast<uInt>(piece.size());
    z.next_out = reinterpret_cast<Bytef*>(buf.data());
    z.avail_out = static_cast<uInt>(buf.size());
    REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
    buf.resize(z.total_out);
    deflateEnd(&z);
    out += buf;
  }
  return out;
}

// `text` as `frames` zstd frames one after the other.
std::string zstd_of(const std::string& text, int frames) {
  std::string out;
  const size_t part = text.size() / static_cast<size_t>(frames) + 1;
  for (size_t begin = 0; begin < text.size(); begin += part) {
    const std::string piece = text.substr(begin, part);
    std::string buf(ZSTD_compressBound(piece.size()), '\0');
    const size_t n = ZSTD_compress(buf.data(), buf.size(), piece.data(), piece.size(), 3);
    REQUIRE_FALSE(ZSTD_isError(n));
    out += buf.substr(0, n);
  }
  return out;
}

// The FormatError of opening `path` and reading every record, or "" when there is none.
std::string read_error(const std::string& path) {
  try {
    const auto f = open_record_file(path);
    for (int64_t i = 0; i < f->size(); ++i) (void)f->read(i);
  } catch (const ft::FormatError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE(
    "record files: gzip and zstd JSONL give the plain file's records and line numbers, in "
    "any order") {
  TempDir dir;
  // Blank lines shift line numbers; 10,000 records make three blocks of 4,096.
  std::string text = "\n";
  for (int i = 0; i < 10000; ++i) {
    text += "{\"text\": \"record " + std::to_string(i) + "\"}\n";
    if (i % 1000 == 7) text += "  \n\r\n";
  }
  const std::string plain = dir.write("d.jsonl", text);
  const auto want = open_record_file(plain);
  REQUIRE(want->size() == 10000);
  CHECK(std::string(want->kind()) == "JSONL");
  for (const auto& [name, bytes] : std::vector<std::pair<std::string, std::string>>{
           {"d.jsonl.gz", gzip_of(text, 3)}, {"d.jsonl.zst", zstd_of(text, 2)}}) {
    const std::string path = dir.write(name, bytes);
    const auto got = open_record_file(path);
    INFO(name);
    CHECK_FALSE(got->random_access());
    REQUIRE(got->size() == want->size());
    // In file order, then backwards (each block read again from the start), then a sample.
    for (int64_t i = 0; i < got->size(); ++i) {
      REQUIRE(got->read(i) == want->read(i));
      REQUIRE(got->origin(i) == path + want->origin(i).substr(plain.size()));
    }
    for (int64_t i : {9999, 5000, 4096, 4095, 0, 8191, 8192, 17})
      CHECK(got->read(i) == want->read(i));
    CHECK(got->origin(1008) == path + ":1014");  // line 1 and two pairs of lines blank
  }
}

TEST_CASE("record files: corrupt, truncated and unknown files are FormatErrors naming the file") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 3000; ++i) text += "{\"text\": \"record " + std::to_string(i) + "\"}\n";
  std::string gz = gzip_of(text, 1);
  const std::string cut = dir.write("cut.jsonl.gz", gz.substr(0, gz.size() / 2));
  CHECK_THAT(read_error(cut),
             Catch::Contains(cut + ": after line ") && Catch::Contains("the gzip data ends early"));
  for (size_t i = 40; i < 80; ++i) gz[i] = static_cast<char>(gz[i] ^ 0x5a);
  const std::string corrupt = dir.write("corrupt.jsonl.gz", gz);
  CHECK_THAT(read_error(corrupt), Catch::Contains(corrupt) && Catch::Contains("corrupt gzip data"));
  const std::string zst = zstd_of(text, 1);
  const std::string zcut = dir.write("cut.jsonl.zst", zst.substr(0, zst.size() - 9));
  CHECK_THAT(read_error(zcut), Catch::Contains(zcut) && Catch::Contains("zstd data ends early"));

  const std::string csv = dir.write("train.csv", "text\nhello\n");
  CHECK_THAT(read_error(csv), Catch::Contains(csv + ": a csv file is not a format ft reads") &&
                                  Catch::Contains("Parquet (.parquet)"));
  const std::string fake = dir.write("train.parquet", "{\"text\": \"not parquet\"}\n");
  CHECK_THAT(read_error(fake), Catch::Contains("first bytes are not that format's"));
  const std::string folder = (dir.path / "folder").string();
  fs::create_directories(folder);
  CHECK_THAT(read_error(folder), Catch::Contains(folder + " is a folder with neither state.json"));
  CHECK_THAT(read_error(dir.path / "absent.jsonl"), Catch::Contains("no such file or folder"));
}

TEST_CASE(
    "record files: ft train's source tokenizes gzip JSONL once into the cache and gives the "
    "plain file's batches") {
  TempDir dir;
  const std::string text = varied_text_records(300, 7, 50);
  JsonlOptions o;
  o.tokenizer = llama3();
  o.seq_len = 32;
  o.micro_batch = 2;
  o.path = dir.write("t.jsonl", text);
  JsonlSource plain(o);
  o.path = dir.write("t.jsonl.gz", gzip_of(text, 1));
  o.use_cache = true;
  o.prepare_cache = true;
  JsonlSource gz(o);
  CHECK(gz.cache_path().rfind((dir.path / "t.jsonl.gz.ftcache").string(), 0) == 0);
  CHECK(fs::exists(gz.cache_path()));
  for (int step = 0; step < 40; ++step) {
    const Batch a = plain.next(), b = gz.next();
    REQUIRE(at::equal(a.input_ids, b.input_ids));
    REQUIRE(at::equal(a.labels, b.labels));
  }
  // A second source reads the cache it finds.
  JsonlSource again(o);
  CHECK(again.cache_path() == gz.cache_path());
}

TEST_CASE(
    "record files: a folder of shards reads them in name order, each record named by its "
    "shard") {
  TempDir dir;
  fs::create_directories(dir.path / "shards");
  std::string a, b;
  for (int i = 0; i < 5; ++i) a += "{\"text\": \"a" + std::to_string(i) + "\"}\n";
  for (int i = 0; i < 3; ++i) b += "{\"text\": \"b" + std::to_string(i) + "\"}\n";
  const std::string second = dir.write("shards/train-00001-of-00002.jsonl.gz", gzip_of(b, 1));
  const std::string first = dir.write("shards/train-00000-of-00002.jsonl", a);
  dir.write("shards/README.md", "# not data\n");
  const auto f = open_record_file((dir.path / "shards").string());
  REQUIRE(f->size() == 8);
  CHECK(f->read(0) == "{\"text\": \"a0\"}");
  CHECK(f->read(5) == "{\"text\": \"b0\"}");
  CHECK(f->origin(4) == first + ":5");
  CHECK(f->origin(7) == second + ":3");
  CHECK_FALSE(f->random_access());  // one shard is compressed
}

// Issue 51: LLaMA-Factory's and Alpaca's .json datasets are one JSON array of records.
TEST_CASE("record files: a JSON array file reads element by element, as its JSONL would") {
  TempDir dir;
  // Pretty-printed as json.dump(indent=2) writes it, with brackets, braces and escaped quotes
  // inside strings, a BOM and CRLF line ends.
  const std::string pretty =
      "\xef\xbb\xbf[\r\n"
      "  {\r\n    \"instruction\": \"Say [hi]\",\r\n    \"input\": \"{\\\"a\\\": \\\"]\\\"}\",\r\n"
      "    \"output\": \"hi }\"\r\n  },\r\n"
      "  {\"instruction\": \"Two\", \"output\": \"2\"}\r\n"
      "]\r\n";
  const std::string path = dir.write("alpaca.json", pretty);
  const auto f = open_record_file(path);
  CHECK(std::string(f->kind()) == "JSON array");
  REQUIRE(f->size() == 2);
  CHECK(f->origin(0) == path + ":2 (element 0)");
  CHECK(f->origin(1) == path + ":7 (element 1)");
  CHECK(f->random_access());
  const Record r = parse_record(f->read(0), RecordFormat::kAuto, f->origin(0));
  CHECK(r.format == RecordFormat::kAlpaca);
  CHECK(r.instruction == "Say [hi]");
  CHECK(r.input == "{\"a\": \"]\"}");
  CHECK(r.output == "hi }");
  CHECK(f->read(1) == R"({"instruction": "Two", "output": "2"})");

  // The same records on one line, and a JSONL file of them: the same batches.
  std::string array = "[", lines;
  for (int i = 0; i < 40; ++i) {
    const std::string rec = "{\"text\": \"" + std::string(static_cast<size_t>(i % 9 + 1), 'a') +
                            " record " + std::to_string(i) + "\"}";
    array += (i ? ", " : "") + rec;
    lines += rec + "\n";
  }
  array += "]";
  JsonlOptions o = options_for(dir.write("t.jsonl", lines));
  JsonlSource plain(o);
  o.path = dir.write("t.json", array);
  JsonlSource arr(o);
  REQUIRE(arr.num_records() == 40);
  for (int step = 0; step < 30; ++step) {
    const Batch a = plain.next(), b = arr.next();
    REQUIRE(at::equal(a.input_ids, b.input_ids));
    REQUIRE(at::equal(a.labels, b.labels));
  }

  // Larger than the 1 MiB read buffer: elements across chunk boundaries.
  std::string big = "[\n";
  const std::string filler(1000, 'x');
  for (int i = 0; i < 3000; ++i)
    big += std::string(i ? ",\n" : "") + "  {\"text\": \"" + std::to_string(i) + filler + "\"}";
  big += "\n]\n";
  const auto b = open_record_file(dir.write("big.json", big));
  REQUIRE(b->size() == 3000);
  for (int i : {0, 1047, 1048, 2999})
    CHECK(b->read(i) == "{\"text\": \"" + std::to_string(i) + filler + "\"}");
  CHECK(b->origin(2999) == dir.path.string() + "/big.json:3001 (element 2999)");
  CHECK(open_record_file(dir.write("empty.json", "[ ]"))->size() == 0);
}

TEST_CASE("record files: a JSON array that is not one, or holds non-records, is refused by line") {
  TempDir dir;
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"[\n{\"text\": \"a\"}\n{\"text\": \"b\"}\n]",
       ":3: not a JSON array of records: element 0 "
       "is followed by '{', not ',' or ']'"},
      {"[{\"text\": \"a\"},\n]",
       ":2: not a JSON array of records: a ',' with no element after "
       "it, before ']'"},
      {"[{\"text\": \"a\"},,{\"text\": \"b\"}]", "an empty element"},
      {"[{\"text\": \"a\"}]\n[{\"text\": \"b\"}]\n",
       ":2: not a JSON array of records: text after "
       "the array's closing ']'"},
      {"[\n{\"text\": \"a\"},\n{\"text\": \"b",
       "the file ends inside the array (a truncated "
       "file?) after 1 element(s)"},
  };
  for (const auto& [text, says] : bad) {
    INFO(text);
    const std::string path = dir.write("bad.json", text);
    CHECK_THAT(read_error(path), Catch::StartsWith(path) && Catch::Contains(says));
  }
  // An element that is not a record: named by line and index.
  const std::string path = dir.write("nested.json", "[\n  {\"text\": \"a\"},\n  [1, 2]\n]\n");
  const auto f = open_record_file(path);
  REQUIRE(f->size() == 2);
  CHECK_THROWS_WITH(parse_record(f->read(1), RecordFormat::kAuto, f->origin(1)),
                    path + ":3 (element 1): a record must be a JSON object, got array");
  const JsonlOptions o = options_for(path);
  CHECK_THROWS_WITH(
      [&] {
        JsonlSource src(o);
        src.next();
      }(),
      Catch::StartsWith(path + ":3 (element 1): a record must be a JSON object, got array"));
}

TEST_CASE("preference records are told apart: what they are and what to do") {
  const std::string dpo = R"({"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."})";
  for (const bool detect : {true, false}) {
    INFO(detect);
    try {
      if (detect)
        detect_format(dpo, "prefs.jsonl:1");
      else
        parse_record(dpo, RecordFormat::kAuto, "prefs.jsonl:1");
      FAIL("accepted");
    } catch (const ft::FormatError& e) {
      CHECK_THAT(e.what(),
                 Catch::StartsWith("prefs.jsonl:1: cannot tell the record format: a preference "
                                   "record (keys \"prompt\", \"chosen\", \"rejected\")") &&
                     Catch::Contains("an objective of its own, which ft does not train") &&
                     Catch::Contains("as a chat record"));
    }
  }
  // Other records of no known format name the keys they have.
  CHECK_THROWS_WITH(detect_format(R"({"question": "q", "answer": "a"})", "qa.jsonl:4"),
                    Catch::StartsWith("qa.jsonl:4: cannot tell the record format") &&
                        Catch::Contains("got keys \"question\", \"answer\""));
}
