// TensorBoard event files (`output.tensorboard`): scalars that TensorBoard's own reader loads, in
// its on-disk format written by hand: TFRecord framing (length, masked CRC-32C of the length, the
// record, masked CRC-32C of the record) around protobuf-encoded `Event` messages (a first one with
// file_version "brain.Event:2", then one per step with wall_time, step and a Summary of
// simple_value scalars). No maintained C++ writer is installable from Debian, and the two messages
// ft needs take a few dozen lines (docs/report.md). One writer per process (rank 0); not
// thread-safe.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "train/metrics.h"

namespace ft::train {

// The protobuf bytes of an Event: wall_time (field 1, double), step (2, int64), file_version (3,
// string; "" = absent), and a Summary (5) of (tag, simple_value) pairs (Summary.value = 1,
// Value.tag = 1, Value.simple_value = 2, a float).
std::string encode_event(double wall_time, int64_t step, const std::string& file_version,
                         const std::vector<std::pair<std::string, double>>& scalars);

// The protobuf bytes of an Event holding SessionLog{status: START} (Event field 7,
// SessionLog.status = 1, START = 1) at `step`: TensorBoard's reader then drops the events of that
// step and later that earlier files hold (a resumed run redoes the steps after its checkpoint).
std::string encode_session_start(double wall_time, int64_t step);

// One TFRecord: u64 little-endian length, masked CRC-32C of those 8 bytes, the data, masked
// CRC-32C of the data. Masking as TensorFlow's: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::string tfrecord(const std::string& data);

// A step's scalars under their metrics.jsonl names: loss, lr, grad_norm, tokens_per_s, mfu,
// step_time_s, memory/peak_rss_bytes (and memory/cuda_peak_allocated_bytes on a GPU).
std::vector<std::pair<std::string, double>> tensorboard_scalars(const StepRecord& r);

class EventWriter {
 public:
  // Creates `dir` and events.out.tfevents.<seconds>.<hostname> in it (a new file per process, as
  // TensorBoard's writers do: a resumed run adds one) and writes the file_version event and a
  // session start at `first_step`, the first step this process trains.
  EventWriter(const std::string& dir, int64_t first_step);
  // One step's scalars, flushed at once (TensorBoard follows a running job).
  void write(int64_t step, const std::vector<std::pair<std::string, double>>& scalars);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
};

}  // namespace ft::train
