// A node's fingerprint: what each launcher publishes at rendezvous so that nodes running different
// software, a different program or a different job layout are refused before any worker starts
// ("the biggest pit"). Pure data + comparison; thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ft::launcher {

struct Fingerprint {
  // Identity: may differ between nodes.
  std::string hostname;
  std::string addr;    // advertised address
  int node_rank = -1;  // requested rank, -1 = assign in join order
  // Must be equal on every node.
  std::string rdzv_id;
  std::string nnodes;  // "2" or "1:4"
  int nproc = 0;
  int max_restarts = 0;
  std::string ft_version;
  std::string ft_commit;
  std::string torch_version;
  std::string cuda_version;  // "" when not compiled in
  std::string nccl_version;
  std::string gpu_name;  // "" when none
  int gpu_count = 0;
  std::string program_hash;  // hash of the program, its arguments and the files they name

  std::string to_json() const;
  static Fingerprint from_json(const std::string& text);  // throws RendezvousError on bad input
};

struct FieldDiff {
  std::string field;
  std::string expected;  // reference node's value
  std::string actual;
};

// Fields that must match `reference` but do not (identity fields are skipped).
std::vector<FieldDiff> compare_fingerprints(const Fingerprint& reference, const Fingerprint& other);

// Stable 64-bit FNV-1a hash (hex) of a program and its arguments, plus the content of every
// argument that names a regular file up to 64 MiB (the script itself, a preset, the interpreter).
// The program is looked up on PATH like execvp does.
std::string hash_program(const std::vector<std::string>& argv);

}  // namespace ft::launcher
