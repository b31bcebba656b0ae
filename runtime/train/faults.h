// The faults tests inject into a run through the environment (docs/training.md): a straggling
// rank, an overlapped host update that fails. Read once at start; a malformed value is a
// ConfigError naming the variable. Thread-safe (reads the environment only).
#pragma once

#include <cstdint>

namespace ft::train {

// FT_FAULT_STEP_DELAY=RANK:SECONDS: that rank sleeps SECONDS while fetching each step's data, a
// straggler for the tests; 0 for every other rank and when unset.
double fault_delay(int rank);

// FT_FAULT_HOST_UPDATE=STEP: the overlapped host update of optimizer step STEP fails partway, on
// every rank (the next forward must report it, not hang or train on); -1 when unset.
int64_t fault_host_update_step();

}  // namespace ft::train
