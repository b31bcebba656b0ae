#include "train/faults.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "core/error.h"

namespace ft::train {

double fault_delay(int rank) {
  const char* v = std::getenv("FT_FAULT_STEP_DELAY");
  if (!v || !*v) return 0;
  const std::string text(v);
  const size_t colon = text.find(':');
  try {
    FT_CHECK(colon != std::string::npos, "");
    const int r = std::stoi(text.substr(0, colon));
    const double s = std::stod(text.substr(colon + 1));
    FT_CHECK(s >= 0 && s < 3600, "");
    return r == rank ? s : 0;
  } catch (const std::exception&) {
    throw ConfigError("FT_FAULT_STEP_DELAY must be RANK:SECONDS (a test's straggler), got '" +
                      text + "'");
  }
}

int64_t fault_host_update_step() {
  const char* v = std::getenv("FT_FAULT_HOST_UPDATE");
  if (!v || !*v) return -1;
  try {
    size_t used = 0;
    const int64_t step = std::stoll(v, &used);
    FT_CHECK(used == std::strlen(v) && step >= 1, "");
    return step;
  } catch (const std::exception&) {
    throw ConfigError(fmt::format(
        "FT_FAULT_HOST_UPDATE must be an optimizer step (a test's fault), got '{}'", v));
  }
}

}  // namespace ft::train
