// `ft data show --data FILE [--preset P] [--model DIR] [--tokenizer FILE] [--set k=v ...] [-n 3]`:
// the first records as the trainer sees them (text, ids, which tokens carry the loss) and the
// statistics of the whole file under the preset's data settings.
// `ft data prepare --data FILE [same] [--cache-dir DIR]`: tokenizes the file once, on all cores,
// into the cache every rank of `ft train` then reads (data/token_cache.h).
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <limits>

#include "commands.h"
#include "config/preset.h"
#include "config/schema.h"
#include "config/settings.h"
#include "core/error.h"
#include "data/inspect.h"
#include "data/token_cache.h"
#include "model/config.h"
#include "tokenizer/tokenizer.h"
#include "train_options.h"

namespace ft::app {

Run add_data(CLI::App& app) {
  auto* cmd = app.add_subcommand("data", "Look at a dataset as the trainer reads it");
  cmd->require_subcommand(1);
  auto* show = cmd->add_subcommand(
      "show", "Print the first records as the trainer sees them, and statistics of the file");
  auto* prepare = cmd->add_subcommand(
      "prepare", "Tokenize the data once into the cache every rank of ft train reads");
  struct Options {
    std::string data, preset, model, tokenizer, cache_dir;
    std::vector<std::string> sets;
    int64_t count = 3;
    bool no_color = false;
  };
  auto o = std::make_shared<Options>();
  for (CLI::App* sub : {show, prepare}) {
    sub->add_option("--data", o->data,
                    "Data: JSONL (.jsonl, .jsonl.gz, .jsonl.zst), a JSON array (.json), Parquet, "
                    "Arrow, or a folder datasets' save_to_disk wrote")
        ->required();
    sub->add_option("--preset", o->preset, "Preset whose data.* keys say how to read the data");
    sub->add_option("--model", o->model,
                    "Model directory, or a hub id the local hub cache holds (its tokenizer.json "
                    "and vocabulary)")
        ->type_name("DIR|ORG/NAME");
    sub->add_option("--tokenizer", o->tokenizer, "tokenizer.json (default: the model's)");
    sub->add_option("--set", o->sets, "Override a preset key: --set data.seq_len=4096");
  }
  show->add_option("-n", o->count, "Records to print (file order; 0: statistics only)")
      ->check(CLI::NonNegativeNumber);
  show->add_flag("--no-color", o->no_color, "No ANSI colours even on a terminal");
  prepare->add_option("--cache-dir", o->cache_dir,
                      "Where the cache goes (default: DATA.ftcache beside the data); give ft "
                      "train the same with --data-cache");
  // Progress of a pass over every record, every 10 s.
  auto progress = [](const char* what) {
    return [what, last = std::chrono::steady_clock::now()](int64_t done, int64_t total) mutable {
      const auto now = std::chrono::steady_clock::now();
      if (now - last < std::chrono::seconds(10) || done == total) return;
      fmt::print(stderr, "ft data: {} of {} records {}\n", done, total, what);
      last = now;
    };
  };
  return [o, prepare, progress]() -> int {
    resolve_model_option(o->model, "ft data", "--model", stdout);
    nlohmann::json resolved =
        o->preset.empty() ? config::schema_defaults() : config::resolve_preset(o->preset, o->sets);
    if (o->preset.empty()) config::apply_sets(resolved, o->sets);
    config::Settings s = config::settings_from_json(resolved, "resolved preset");
    // A preset made for the synthetic task still reads a file here: its format is detected.
    if (s.data.synthetic()) s.data.format = "auto";
    data::JsonlOptions jo = data::jsonl_options(s.data);
    jo.path = o->data;
    jo.tokenizer_path = data::tokenizer_path_of(o->tokenizer, o->model);
    // The vocabulary the records are checked against: the model's, the preset's when one is
    // given (what ft train with it would use), else, with only a tokenizer, the tokenizer's own
    // (no default preset's shape stands between a user and a look at the data).
    int64_t vocab = o->model.empty()
                        ? s.model.vocab_size
                        : model::load_model_config(o->model + "/config.json").vocab_size;
    if (!jo.tokenizer_path.empty()) {
      const bool own_vocab = o->model.empty() && o->preset.empty() &&
                             std::none_of(o->sets.begin(), o->sets.end(), [](const std::string& x) {
                               return x.rfind("model.vocab_size=", 0) == 0;
                             });
      jo.tokenizer = data::open_tokenizer(
          jo.tokenizer_path, own_vocab ? std::numeric_limits<int64_t>::max() : vocab, o->model);
      if (own_vocab) vocab = static_cast<int64_t>(jo.tokenizer->vocab_size());
    }
    jo.vocab_size = vocab;
    jo.cache_dir = o->cache_dir;
    jo.model_dir = o->model;  // data.template auto: the model's own template
    if (prepare->parsed()) {
      const data::JsonlSource source(jo);
      const nlohmann::json key = source.cache_key();
      const std::string path = data::token_cache_path(jo, key);
      const data::PrepareResult r =
          data::write_token_cache(source, path, key, progress("tokenized"));
      const double mb = static_cast<double>(data::data_identity(o->data).bytes) / 1e6;
      fmt::print(
          "{}: {} records ({} malformed, skipped), {} tokens, {:.1f} MB of {} in {:.1f} "
          "s ({:.1f} MB/s, {:.0f} tokens/s); ft train --data {}{} reads it\n",
          path, r.records, r.malformed, r.tokens, mb, source.file().kind(), r.seconds,
          mb / r.seconds, static_cast<double>(r.tokens) / r.seconds, o->data,
          o->cache_dir.empty() ? "" : " --data-cache " + o->cache_dir);
      return 0;
    }
    jo.use_cache = true;  // the statistics from the cache when there is one
    data::JsonlSource source(jo);
    const bool color = !o->no_color && ::isatty(STDOUT_FILENO) == 1;
    if (!color && o->count > 0) fmt::print("(tokens that carry the loss are between ⟦ and ⟧)\n");
    for (int64_t i = 0; i < std::min<int64_t>(o->count, source.num_records()); ++i)
      fmt::print("{}", data::show_record(source, i, color));
    data::DataStats stats = data::data_stats(source, progress("tokenized"));
    stats.micro_batch = s.train.micro_batch;
    stats.grad_accum = s.train.grad_accum;
    const std::string with_sets = o->sets.empty() ? "" : " and --set";
    stats.settings_from = o->preset.empty() ? "no --preset: the defaults" + with_sets +
                                                  "; give the --preset you train with"
                                            : "preset " + o->preset + with_sets;
    fmt::print("--- {}: template {}, format {}\n{}", o->data, source.template_used(),
               data::name_of(source.format()), data::format_stats(stats));
    std::fflush(stdout);
    FT_CHECK_T(
        FormatError, stats.stopped_error.empty(), stats.stopped_error,
        "; the statistics above cover the ", stats.covered,
        " records before it. Fix that record, or read the file without such records (skipped "
        "and counted, in ft train too) with --set data.on_bad_record=skip");
    return 0;
  };
}

}  // namespace ft::app
