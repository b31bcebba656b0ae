// Sharded checkpoints (docs/checkpoint-format.md). Every rank writes its share of the training
// state, as flat ranges ("pieces") of named tensors, into one safetensors file and one JSON file
// of a temporary step directory, and makes them durable (fsync). When every rank has, rank 0
// writes meta.json — each tensor's global shape and, for every chunk, file, range and CRC-32C —
// renames the directory into place (step-<N>) and moves the `latest` pointer: a directory without
// meta.json is never used. A rank that cannot write its files (a full disk) says so to rank 0
// all the same, which then commits nothing, removes the temporary directory and fails the save
// naming every rank's error. A checkpoint is read back under any world size and strategy by
// asking for ranges of tensors, which read_range() assembles from whatever chunks hold them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/worker_contract.h"

namespace ft::ckpt {

inline constexpr int kFormatVersion = 2;  // 2: meta.json carries meta_crc32c of itself
inline constexpr const char* kMetaFile = "meta.json";
inline constexpr const char* kLatestFile = "latest";

// Elements [begin, end) of a named tensor flattened in C order.
struct Piece {
  std::string tensor;  // "param/<name>", "exp_avg/<name>", "exp_avg_sq/<name>", "rng/cpu.rank<k>"
  int64_t begin = 0, end = 0;
  at::Tensor data;  // [end - begin], CPU, contiguous; owned (a copy) for an async save
};

// What one rank saves at one step.
struct Snapshot {
  int64_t step = 0;
  nlohmann::json state;       // global state; rank 0's goes into meta.json
  nlohmann::json rank_state;  // this rank's own (data position ...)
  std::map<std::string, std::vector<int64_t>>
      shapes;                 // global shape of every tensor it has pieces of
  std::vector<Piece> pieces;  // over all ranks, every element of every tensor exactly once

  int64_t data_bytes() const;  // of this rank's pieces: about the size of its file
};

// A checkpoint was not saved (a rank could not write its files, or rank 0 could not commit): the
// message names the step, the rank and the file, and the save's temporary directory is gone; the
// committed checkpoints are as they were. Its exit code tells the launcher and scripts so.
class CheckpointSaveError : public Error {
 public:
  using Error::Error;
  int exit_code() const override { return contract::kExitSaveFailed; }
};

struct SaverOptions {
  std::string root;  // where step-<N> directories go (OUTPUT/checkpoints)
  int rank = 0, world_size = 1;
  int keep_last = 2;  // committed checkpoints kept (the newest); >= 1
  // Multi-rank: `signal(key, error)` tells rank 0 this rank is done with its files: durable
  // (error "") or not (the error's text). Rank 0's `wait_all(keys)` returns every rank's error
  // (in the order of `keys`) once all have signalled (throws on timeout).
  std::function<void(const std::string& key, const std::string& error)> signal;
  std::function<std::vector<std::string>(const std::vector<std::string>& keys)> wait_all;
};

// Writes snapshots, one at a time, synchronously or on a background thread.
class Saver {
 public:
  explicit Saver(SaverOptions options);
  ~Saver();  // waits for a save in flight; an error there is printed (wait() would rethrow it)
  Saver(const Saver&) = delete;
  Saver& operator=(const Saver&) = delete;

  // Waits for the previous save (rethrowing its error), then writes `s`: in the background when
  // `async`, else before returning. Rank 0 also commits. An async save may be handed views of
  // live tensors: its thread first copies them to host memory, and the caller must call
  // wait_captured() before it next modifies them (the optimizer update), so the copy overlaps
  // whatever the caller does meanwhile (forward and backward).
  void save(Snapshot s, bool async);
  // Blocks until the save in flight has its own copy of the state; returns the seconds waited.
  double wait_captured();
  // Waits for the save in flight; rethrows its error (CheckpointSaveError naming the file; the
  // same on every rank the save failed on).
  void wait();
  // Without waiting: a background save has ended in an error, which wait() will rethrow.
  bool failed() const;
  // Ranks other than 0: rank 0's verdict on the save of `step` once it has one, "" when it
  // committed, else the error naming every rank that failed (what its wait() threw).
  std::string verdict(int64_t step);
  // Seconds the last completed write took (what a save stalls its caller is the caller's to
  // measure: the Checkpointer records it); 0 before one completed. Any thread, at any time.
  double last_write_s() const;
  // Rank 0: the step of the newest checkpoint this Saver committed, as soon as it has (a
  // background save included); -1 before one, and always on other ranks. Any thread.
  int64_t committed_step() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A committed checkpoint, opened for reading.
class Checkpoint {
 public:
  // Opens `dir` (a step-<N> directory): FormatError naming the file for a missing or malformed
  // meta.json. Shard files are opened on first use.
  static Checkpoint open(const std::string& dir);
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const std::string& dir() const;
  int64_t step() const;
  int world_size() const;  // of the run that saved it
  const nlohmann::json& state() const;
  // The rank_state saved by `rank` of the saving run.
  const nlohmann::json& rank_state(int rank) const;
  bool has(const std::string& tensor) const;
  // Every tensor's name, sorted ("param/...", "exp_avg/...", "rng/...").
  std::vector<std::string> tensors() const;
  std::vector<int64_t> shape(const std::string& tensor) const;  // FormatError when absent

  // Fills `dst` (end - begin elements, any dtype and device) with elements [begin, end) of
  // `tensor`, from the chunks that hold them. Each chunk's CRC-32C is checked the first time it
  // is touched: FormatError naming the file and tensor on a mismatch, a missing or truncated file.
  void read_range(const std::string& tensor, int64_t begin, int64_t end,
                  const at::Tensor& dst) const;
  // Checks the checksums of every chunk overlapping [begin, end) of `tensor` (what a later
  // read_range of that range needs), without copying anywhere.
  void verify_range(const std::string& tensor, int64_t begin, int64_t end) const;

 private:
  Checkpoint();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Committed checkpoints under `root` (step-<N> directories holding meta.json), newest first.
std::vector<std::string> list_committed(const std::string& root);
// The meta_crc32c of a meta.json object: the CRC-32C of its dump(1) without that field.
uint32_t meta_checksum(nlohmann::json meta);
// The step-N directories under `root` without meta.json, newest first: damaged (a step directory
// gets its name only when its save commits, meta.json in it), so resuming skips them and says so.
std::vector<std::string> list_uncommitted(const std::string& root);

// "step-000000120" for step 120.
std::string step_dir_name(int64_t step);
// The step of a step-<N> directory (its path or name), -1 for any other name.
int64_t step_of_dir(const std::string& dir);

}  // namespace ft::ckpt
