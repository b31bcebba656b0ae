// Tokenizer throughput: encodes every line of a text file with ft's Tokenizer on N threads (each
// thread takes the next line, as a data loader's workers would) and prints one JSON line with
// bytes, tokens, seconds, MB/s and tokens/s. bench/tokenizer_speed.py runs it beside HF
// tokenizers' encode_batch on the same lines.
//   ft_bench_tokenizer TOKENIZER_JSON TEXT_FILE THREADS [REPEATS]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace {

std::vector<std::string> read_lines(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(std::string("cannot open ") + path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(std::move(line));
  return lines;
}

// Seconds to encode all `lines` once on `threads` threads; adds the token count to `tokens`.
double encode_all(const ft::tokenizer::Tokenizer& tok, const std::vector<std::string>& lines,
                  int threads, size_t* tokens) {
  std::atomic<size_t> next{0};
  std::atomic<size_t> count{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      size_t mine = 0;
      for (size_t i = next++; i < lines.size(); i = next++)
        mine += tok.encode(lines[i], false).size();
      count += mine;
    });
  }
  for (auto& th : pool) th.join();
  *tokens = count;
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s TOKENIZER_JSON TEXT_FILE THREADS [REPEATS]\n", argv[0]);
    return 2;
  }
  const auto tok = ft::tokenizer::Tokenizer::from_file(argv[1]);
  const auto lines = read_lines(argv[2]);
  const int threads = std::max(1, std::atoi(argv[3]));
  const int repeats = argc > 4 ? std::max(1, std::atoi(argv[4])) : 3;
  size_t bytes = 0;
  for (const auto& l : lines) bytes += l.size();
  // The best of `repeats` runs; the first also fills the word cache, as a long job's would be.
  double best = 1e30;
  size_t tokens = 0;
  for (int r = 0; r < repeats; ++r) best = std::min(best, encode_all(tok, lines, threads, &tokens));
  std::printf(
      "{\"impl\": \"ft\", \"threads\": %d, \"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.4f, "
      "\"mb_per_s\": %.2f, \"tokens_per_s\": %.0f}\n",
      threads, bytes, tokens, best, bytes / best / 1e6, tokens / best);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
