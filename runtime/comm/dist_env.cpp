#include "comm/dist_env.h"

#include <cstdlib>
#include <string>

#include "core/error.h"

namespace ft::comm {
namespace {

int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  FT_CHECK(end && *end == '\0' && x >= lo && x <= hi, "environment variable ", name, "='", v,
           "' must be an integer in [", lo, ", ", hi,
           "]; it is normally set by `ft launch` or torchrun");
  return static_cast<int>(x);
}

}  // namespace

DistEnv read_dist_env() {
  DistEnv e;
  const char* addr = std::getenv("MASTER_ADDR");
  e.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  e.rank = env_int("RANK", 0, 0, (1 << 20) - 1);
  e.local_rank = env_int("LOCAL_RANK", 0, 0, 1 << 16);
  e.local_world_size = env_int("LOCAL_WORLD_SIZE", 1, 1, 1 << 16);
  e.node_rank = env_int("GROUP_RANK", env_int("NODE_RANK", 0, 0, 1 << 20), 0, 1 << 20);
  e.nnodes = env_int("GROUP_WORLD_SIZE", env_int("NNODES", 1, 1, 1 << 20), 1, 1 << 20);
  e.restart_count = env_int("TORCHELASTIC_RESTART_COUNT", 0, 0, 1 << 30);
  e.master_port = static_cast<uint16_t>(env_int("MASTER_PORT", 0, 0, 65535));
  const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  e.agent_store = agent && std::string(agent) == "True";
  FT_CHECK(e.rank < e.world_size, "RANK=", e.rank, " must be below WORLD_SIZE=", e.world_size);
  FT_CHECK(e.local_rank < e.local_world_size, "LOCAL_RANK=", e.local_rank,
           " must be below LOCAL_WORLD_SIZE=", e.local_world_size);
  if (e.world_size > 1) {
    FT_CHECK(addr && *addr, "WORLD_SIZE=", e.world_size,
             " but MASTER_ADDR is not set: start workers with `ft launch` (or torchrun)");
    FT_CHECK(e.master_port != 0, "WORLD_SIZE=", e.world_size, " but MASTER_PORT is not set");
  }
  if (addr) e.master_addr = addr;
  return e;
}

}  // namespace ft::comm
