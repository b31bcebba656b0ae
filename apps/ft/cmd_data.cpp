// `ft data show --data FILE [--preset P] [--model DIR] [--tokenizer FILE] [--set k=v ...] [-n 3]`:
// the first records as the trainer sees them (text, ids, which tokens carry the loss) and the
// statistics of the whole file under the preset's data settings.
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>

#include "commands.h"
#include "config/preset.h"
#include "config/schema.h"
#include "config/settings.h"
#include "data/inspect.h"
#include "model/config.h"

namespace ft::app {

Run add_data(CLI::App& app) {
  auto* cmd = app.add_subcommand("data", "Look at a JSONL dataset as the trainer reads it");
  cmd->require_subcommand(1);
  auto* show = cmd->add_subcommand(
      "show", "Print the first records as the trainer sees them, and statistics of the file");
  struct Options {
    std::string data, preset, model, tokenizer;
    std::vector<std::string> sets;
    int64_t count = 3;
    bool no_color = false;
  };
  auto o = std::make_shared<Options>();
  show->add_option("--data", o->data, "JSONL data")->required();
  show->add_option("--preset", o->preset, "Preset whose data.* keys say how to read the data");
  show->add_option("--model", o->model, "Model directory (its tokenizer.json and vocabulary)");
  show->add_option("--tokenizer", o->tokenizer, "tokenizer.json (default: the model's)");
  show->add_option("--set", o->sets, "Override a preset key: --set data.seq_len=4096");
  show->add_option("-n", o->count, "Records to print (file order; 0: statistics only)")
      ->check(CLI::NonNegativeNumber);
  show->add_flag("--no-color", o->no_color, "No ANSI colours even on a terminal");
  return [o]() -> int {
    nlohmann::json resolved =
        o->preset.empty() ? config::schema_defaults() : config::resolve_preset(o->preset, o->sets);
    if (o->preset.empty()) config::apply_sets(resolved, o->sets);
    config::Settings s = config::settings_from_json(resolved, "resolved preset");
    // A preset made for the synthetic task still reads a file here: its format is detected.
    if (s.data.synthetic()) s.data.format = "auto";
    data::JsonlOptions jo = data::jsonl_options(s.data);
    jo.path = o->data;
    jo.tokenizer_path = data::tokenizer_path_of(o->tokenizer, o->model);
    const int64_t vocab = o->model.empty()
                              ? s.model.vocab_size
                              : model::load_llama_config(o->model + "/config.json").vocab_size;
    if (!jo.tokenizer_path.empty())
      jo.tokenizer = data::open_tokenizer(jo.tokenizer_path, vocab, "");
    jo.vocab_size = vocab;
    data::JsonlSource source(jo);
    const bool color = !o->no_color && ::isatty(STDOUT_FILENO) == 1;
    if (!color && o->count > 0) fmt::print("(tokens that carry the loss are between ⟦ and ⟧)\n");
    for (int64_t i = 0; i < std::min<int64_t>(o->count, source.num_records()); ++i)
      fmt::print("{}", data::show_record(source, i, color));
    auto last = std::chrono::steady_clock::now();
    const data::DataStats stats = data::data_stats(source, [&](int64_t done, int64_t total) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last < std::chrono::seconds(10) || done == total) return;
      fmt::print(stderr, "ft data: {} of {} records tokenized\n", done, total);
      last = now;
    });
    fmt::print("--- {}: {} template, format {}\n{}", o->data, s.data.chat_template,
               data::name_of(source.format()), data::format_stats(stats));
    return 0;
  };
}

}  // namespace ft::app
