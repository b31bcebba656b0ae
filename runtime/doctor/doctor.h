// `ft doctor`: run under `ft launch` with the job's own layout, it measures what a job's speed
// depends on and says what limits it: each device's matrix-multiply throughput (one slow or
// throttled device stands out), host-to-device bandwidth on a GPU, the model directory's read
// throughput, the collectives the strategies use (all-reduce, all-gather, reduce-scatter from
// 1 KiB up) over the whole job, inside a node and across nodes, with nccl-tests' bus bandwidth, and
// a node-pair bandwidth matrix that names a slow link or node. With a preset it probes one
// device's step of the preset's model and runs the step-time model (doctor/step_model.h). Every
// rank calls run_doctor; rank 0 prints. Collective; not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ft::doctor {

struct DoctorOptions {
  std::string preset;  // "" = measure only
  std::vector<std::string> sets;
  std::string model_dir;          // model files to read (throughput) and plan from; "" = none
  int64_t max_bytes = 0;          // largest collective size; 0 = 256 MiB on GPUs, 64 MiB on CPUs
  double seconds_per_size = 0.1;  // time spent timing each collective size
  std::string json_path;          // rank 0 writes every figure there as JSON; "" = none
};

// Returns the exit code (0; errors are thrown as ft's typed errors).
int run_doctor(const DoctorOptions& options);

}  // namespace ft::doctor
