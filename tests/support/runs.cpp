#include "support/runs.h"

#include <filesystem>
#include <fstream>
#include <thread>

#include "support/subprocess.h"

namespace ft::test {

std::vector<std::string> small_run_sets() {
  return {"precision.mode=fp32",         "data.seq_len=64", "model.hidden_size=64",
          "model.intermediate_size=176", "train.lr=1e-3",   "train.warmup_steps=2",
          "train.log_every=100",         "train.eps=1e-6"};
}

std::vector<std::string> ft_train_argv(const std::vector<std::string>& args,
                                       const std::vector<std::string>& sets) {
  std::vector<std::string> argv = {ft_bin(), "train"};
  argv.insert(argv.end(), args.begin(), args.end());
  for (const auto& s : sets) argv.insert(argv.end(), {"--set", s});
  return argv;
}

std::vector<std::string> ft_launch_argv(const std::vector<std::string>& launch_args,
                                        const std::vector<std::string>& program) {
  std::vector<std::string> argv = {ft_bin(), "launch"};
  argv.insert(argv.end(), launch_args.begin(), launch_args.end());
  argv.push_back("--");
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

std::vector<std::string> tiny_job_argv(int nproc, const std::string& out,
                                       const std::vector<std::string>& sets) {
  std::vector<std::string> train = ft_train_argv({"--preset", "tiny-demo", "--output", out}, sets);
  if (nproc == 1) return train;
  return ft_launch_argv(
      {"--nproc-per-node", std::to_string(nproc), "--master-port", std::to_string(free_port())},
      train);
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

std::string put_in_hub_cache(const std::string& cache, const std::string& id,
                             const std::string& commit, const std::vector<std::string>& files) {
  namespace fs = std::filesystem;
  std::string folder = "models--" + id;
  if (const size_t slash = folder.find('/'); slash != std::string::npos)
    folder.replace(slash, 1, "--");
  const fs::path repo = fs::path(cache) / folder, snapshot = repo / "snapshots" / commit;
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "refs");
  fs::create_directories(snapshot);
  for (const auto& f : files) {
    // The hub names a blob by its content's hash; any name unique in the repository will do.
    const std::string blob = commit + "-" + fs::path(f).filename().string();
    fs::copy_file(f, repo / "blobs" / blob, fs::copy_options::overwrite_existing);
    fs::create_symlink(fs::path("../../blobs") / blob, snapshot / fs::path(f).filename());
  }
  std::ofstream(repo / "refs" / "main") << commit;  // the hash alone, no newline, as the hub
  return snapshot.string();
}

std::vector<nlohmann::json> read_jsonl(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  // A line without its newline is still being written (a test polling a live run): not a record
  // yet. Every complete line must parse.
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    if (in.eof()) break;
    out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::vector<nlohmann::json> read_metrics(const std::string& run_dir) {
  return read_jsonl(run_dir + "/metrics.jsonl");
}

void wait_for_steps(const std::string& run_dir, size_t steps,
                    std::chrono::steady_clock::time_point deadline) {
  while (read_metrics(run_dir).size() < steps && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

}  // namespace ft::test
