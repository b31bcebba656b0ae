// `ft presets` lists the shipped presets and a LoRA and a full fine-tune command per model family;
// `ft presets show NAME|FILE [--set k=v ...]` prints one preset fully resolved, every default
// included.
#include <fmt/format.h>

#include "commands.h"
#include "config/family_commands.h"
#include "config/preset.h"
#include "config/schema.h"

namespace ft::app {

Run add_presets(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("presets",
                         "List the shipped training presets and the commands per model family, or "
                         "show one preset resolved");
  auto* show =
      cmd->add_subcommand("show", "Print a preset fully resolved (every key, defaults included)");
  auto name = std::make_shared<std::string>();
  auto sets = std::make_shared<std::vector<std::string>>();
  auto schema_md = std::make_shared<bool>(false);
  show->add_option("preset", *name, "Shipped preset name or a preset JSON file")->required();
  show->add_option("--set", *sets, "Override a key: --set train.lr=1e-4 (repeatable)");
  cmd->add_flag("--print-schema-md", *schema_md, "Print the preset schema as Markdown (docs)")
      ->group("");
  return [show, name, sets, schema_md]() -> int {
    if (*schema_md) {
      std::fputs(config::schema_markdown().c_str(), stdout);
      return 0;
    }
    if (show->parsed()) {
      fmt::print("{}\n", config::resolve_preset(*name, *sets).dump(2));
      return 0;
    }
    for (const auto& p : config::shipped_presets())
      fmt::print("{:<12} {}\n", p.name, config::preset_description(p.name));
    fmt::print("\n{}", config::family_commands_text());
    return 0;
  };
}

}  // namespace ft::app
