#include "core/worker_contract.h"

#include <nlohmann/json.hpp>

#include "core/json.h"

namespace ft::contract {

using nlohmann::json;

std::string to_json(const StopEstimate& e) {
  return json{{"step", e.step},
              {"step_s", e.step_s},
              {"committed_step", e.committed_step},
              {"save_s", e.save_s},
              {"save_measured", e.save_measured}}
      .dump();
}

std::optional<StopEstimate> parse_stop_estimate(const std::string& text) {
  if (json_too_deep_at(text) != std::string_view::npos) return std::nullopt;
  const json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return std::nullopt;
  // Integers must be integers and seconds numbers: nlohmann would convert silently.
  for (const char* k : {"step", "committed_step"})
    if (!j.contains(k) || !j[k].is_number_integer()) return std::nullopt;
  for (const char* k : {"step_s", "save_s"})
    if (!j.contains(k) || !j[k].is_number() || j[k].get<double>() < 0) return std::nullopt;
  if (!j.contains("save_measured") || !j["save_measured"].is_boolean()) return std::nullopt;
  StopEstimate e;
  e.step = j["step"].get<int64_t>();
  e.step_s = j["step_s"].get<double>();
  e.committed_step = j["committed_step"].get<int64_t>();
  e.save_s = j["save_s"].get<double>();
  e.save_measured = j["save_measured"].get<bool>();
  return e;
}

}  // namespace ft::contract
