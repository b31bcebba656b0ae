// Test support: `ft train` and `ft launch` jobs as the tests start them, and the JSON records a run
// writes (metrics.jsonl, metrics.rank<k>.jsonl). Not thread-safe; one test thread.
#pragma once

#include <chrono>
#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ft::test {

// The `--set`s over tiny-demo that the job tests share: a small fp32 model (2 layers, hidden 64)
// that equivalence and resume runs can afford many times. Adam's eps is raised from 1e-8 to 1e-6:
// with eps far below a gradient's rounding noise, Adam turns the last-bit differences of another
// summation order (2 or 4 partial sums instead of 1) in near-zero gradients into full-size steps,
// which no implementation keeps within 1e-5; the fp64 runs check the algebra itself far tighter.
// A function, not a constant: other files' constants are built from it at start-up.
std::vector<std::string> small_run_sets();

// `ft train ARGS...` followed by `--set S` for each of `sets` (this build's ft).
std::vector<std::string> ft_train_argv(const std::vector<std::string>& args,
                                       const std::vector<std::string>& sets);
// `ft launch LAUNCH_ARGS... -- PROGRAM...` (this build's ft).
std::vector<std::string> ft_launch_argv(const std::vector<std::string>& launch_args,
                                        const std::vector<std::string>& program);
// `ft train --preset tiny-demo --output OUT` with `--set S` for each of `sets`; under
// `ft launch --nproc-per-node N` (on a free port) when N > 1.
std::vector<std::string> tiny_job_argv(int nproc, const std::string& out,
                                       const std::vector<std::string>& sets);
// `a` followed by `b`: a list of settings with more settings after it.
std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b);

// A model in the Hugging Face hub cache `cache` as `hf download ID` leaves it: each of `files`
// copied into models--ORG--NAME/blobs/ and linked from snapshots/COMMIT/<its name>, and
// refs/main holding COMMIT. Returns the snapshot directory.
std::string put_in_hub_cache(const std::string& cache, const std::string& id,
                             const std::string& commit, const std::vector<std::string>& files);

// The records of a JSON-lines file, one per non-empty line; none when the file does not exist
// (yet).
std::vector<nlohmann::json> read_jsonl(const std::string& path);
// The run's metrics.jsonl (rank 0's record of each step) in its --output directory.
std::vector<nlohmann::json> read_metrics(const std::string& run_dir);
// Polls the run's metrics.jsonl every 5 ms until it holds `steps` records or `deadline` passes.
void wait_for_steps(const std::string& run_dir, size_t steps,
                    std::chrono::steady_clock::time_point deadline);

}  // namespace ft::test
