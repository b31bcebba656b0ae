// Test support: the ranks of a job as threads of one process, each forming its own real c10d group
// (comm::ProcessGroup, Gloo, no mock) on a store the test hosts (the launcher's RdzvStore on
// loopback, port 0). Catch2 is not thread-safe: the rank bodies only record what they see, and the
// caller asserts on the main thread after run_rank_threads has joined them. Header-only; the tests
// that use it link ft_comm and ft_launcher.
#pragma once

#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/dist_env.h"
#include "store.h"  // launcher/: the store `ft launch` hosts for its workers

namespace ft::test {

// Long enough for a loaded 2-core machine, short enough that a rank left waiting for a peer that
// failed gives up quickly (its error is then reported beside the peer's).
constexpr std::chrono::seconds kInprocTimeout{20};

// Rank `rank` of `world` ranks, `per_node` on each node, as `ft launch` would describe it to its
// worker.
inline comm::DistEnv inproc_rank_env(int rank, int world, uint16_t port, int per_node = 0) {
  if (per_node <= 0) per_node = world;
  comm::DistEnv env;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = rank % per_node;
  env.local_world_size = per_node;
  env.node_rank = rank / per_node;
  env.nnodes = world / per_node;
  env.master_addr = "127.0.0.1";
  env.master_port = port;
  env.agent_store = true;
  return env;
}

// LibTorch 2.11's flight recorder (on by default) enters each process group into a process-wide
// map before it takes its lock (c10d FlightRecorderDetail.hpp, recordWithResetEnabled), so ranks
// that are threads of one process race there on their first collectives: the engine's in-process
// test crashed there (SIGSEGV inside the map) twice in its first few dozen runs. With one process
// per rank, as ft runs, that cannot happen; these threads run without the recorder. Set once,
// before the first group creates the recorder and before any other thread reads the environment.
inline void disable_flight_recorder() {
  static const bool set = ::setenv("TORCH_FR_BUFFER_SIZE", "0", 1) == 0;
  if (!set) throw std::runtime_error("setenv TORCH_FR_BUFFER_SIZE failed");
}

// Runs `body(rank, port)` for every rank on its own thread, the store hosted for them on `port`,
// and joins them whether they finish or throw. Returns each rank's error ("" when it finished).
inline std::vector<std::string> run_rank_threads(
    int world, const std::function<void(int rank, uint16_t port)>& body) {
  disable_flight_recorder();
  auto store = launcher::RdzvStore::host(0, kInprocTimeout);
  const uint16_t port = store->port();
  std::vector<std::string> errors(world);
  std::vector<std::thread> threads;
  auto join_all = [&] {
    for (auto& t : threads) t.join();
  };
  try {
    for (int r = 0; r < world; ++r)
      threads.emplace_back([&body, &errors, r, port] {
        try {
          body(r, port);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        } catch (...) {
          errors[r] = "an exception that is not a std::exception";
        }
      });
  } catch (...) {
    join_all();  // the ranks started give up at kInprocTimeout waiting for the others
    throw;
  }
  join_all();
  return errors;
}

// The errors of run_rank_threads as one text, "" when every rank finished.
inline std::string rank_errors(const std::vector<std::string>& errors) {
  std::string text;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) text += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  return text;
}

}  // namespace ft::test
