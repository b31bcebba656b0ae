// events.jsonl: what happened to a run, one JSON object per line, appended by rank 0 and flushed
// as written: each start (fresh, resumed, or a launcher restart with the failure that caused it),
// a preemption, the end. `ft report` draws its timeline and environment from it
// (docs/report.md). Not thread-safe.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "comm/dist_env.h"

namespace ft::train {

// The environment variable `ft launch` sets on the workers of a restart round: the launcher's
// failure record (launcher/failure.h's JSON) of the round that ended.
inline constexpr const char* kPreviousFailureEnv = "FT_PREVIOUS_FAILURE";

// A start record: the step it starts from (0: fresh), the launcher's round, the job's shape, this
// host and build (ft, LibTorch, CUDA versions), the device, and the previous round's failure when
// the launcher restarted the job.
nlohmann::json start_event(const comm::DistEnv& env, int64_t from_step, const std::string& device,
                           const std::string& backend, const std::string& strategy);

// Appends `event` ("event", "step", ...) with "time" (Unix seconds) to `path`; "" = no file.
// Throws when the file cannot be written.
void append_event(const std::string& path, nlohmann::json event);

}  // namespace ft::train
