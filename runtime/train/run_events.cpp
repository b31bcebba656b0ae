#include "train/run_events.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>

#include "core/build_info.h"
#include "core/error.h"
#include "core/json.h"

namespace ft::train {

nlohmann::json start_event(const comm::DistEnv& env, int64_t from_step, const std::string& device,
                           const std::string& backend, const std::string& strategy) {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  const BuildInfo b = build_info(/*probe_devices=*/false);
  nlohmann::json e = {{"event", "start"},
                      {"step", from_step},
                      {"restart_count", env.restart_count},
                      {"world_size", env.world_size},
                      {"nnodes", env.nnodes},
                      {"local_world_size", env.local_world_size},
                      {"launched", env.launched()},
                      {"started_by", env.started_by},
                      {"hostname", host},
                      {"device", device},
                      {"backend", backend},
                      {"strategy", strategy},
                      {"ft_version", b.ft_version},
                      {"ft_commit", b.git_commit},
                      {"torch_version", b.torch_version},
                      {"cuda_version", b.cuda_version},
                      {"nccl_version", b.nccl_version}};
  // The launcher's record is outside input to this process: kept only when it is a JSON object.
  if (const char* failure = std::getenv(kPreviousFailureEnv); failure && *failure) {
    const std::string_view text(failure);
    if (json_too_deep_at(text) == std::string_view::npos) {
      auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
      if (j.is_object()) e["previous_failure"] = std::move(j);
    }
  }
  return e;
}

void append_event(const std::string& path, nlohmann::json event) {
  if (path.empty()) return;
  event["time"] =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::ofstream out(path, std::ios::app);
  out << event.dump() << '\n';
  out.flush();
  FT_CHECK(out.good(), "writing ", path, " failed (disk full?)");
}

}  // namespace ft::train
