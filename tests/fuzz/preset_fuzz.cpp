// Fuzzes preset resolution: the input is a preset file followed by `--set` overrides, each after a
// line break and "--set " ("{...}\n--set train.lr=0.1\n--set lora.r=8"). The file is resolved as
// `ft train --preset FILE --set ...` resolves it (schema validation, "base" inheritance: a shipped
// name, or base.json, a valid preset written beside it), then turned into the typed Settings; the
// text is also read as the resolved preset a checkpoint records (settings_from_json).
#include "config/preset.h"
#include "config/schema.h"
#include "config/settings.h"
#include "core/json.h"
#include "fuzz_support.h"

namespace {

using namespace ft;

// The preset file of every input, and base.json beside it (written once).
const std::string& preset_path() {
  static const std::string path = [] {
    fuzz::write_file(fuzz::scratch_dir() + "/base.json",
                     R"({"base": "tiny-demo", "train": {"lr": 0.01, "max_steps": 5}})");
    return fuzz::scratch_dir() + "/preset.json";
  }();
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input = fuzz::as_text(data, size);
  // "base" may name any file; keep the fuzzer away from the kernel's endless or special files.
  for (const char* special : {"/proc", "/sys", "/dev"})
    if (input.find(special) != std::string_view::npos) return -1;
  const auto parts = fuzz::split(input, "\n--set ", 9);
  const std::vector<std::string> sets(parts.begin() + 1, parts.end());
  fuzz::write_file(preset_path(), parts[0]);

  fuzz::expect_ft_errors([&] {
    const config::Settings s = config::resolve_settings(preset_path(), sets);
    // The resolved preset is a checkpoint's record of the run: it reads back the same.
    const config::Settings again = config::settings_from_json(s.resolved, "recorded preset");
    fuzz::require(again.resolved == s.resolved, "a resolved preset reads back unchanged");
  });
  fuzz::expect_ft_errors([&] {
    const nlohmann::json j = parse_json<ConfigError>(parts[0], "recorded preset");
    (void)config::settings_from_json(j, "recorded preset");
  });
  return 0;
}
