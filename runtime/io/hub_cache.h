// A model named by its Hugging Face hub id (`--model Qwen/Qwen3-0.6B`) found in the local hub
// cache, offline, where huggingface_hub puts it (constants.py, file_download.py) and transformers
// finds it with HF_HUB_OFFLINE=1. Reads the environment and the file system, writes nothing;
// thread-safe while nothing changes the environment.
#pragma once

#include <string>

namespace ft::io {

// The hub cache directory, with huggingface_hub's precedence: $HF_HUB_CACHE, else the legacy
// $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
// ~/.cache/huggingface/hub; `~` and `$VAR` in the value expanded as Python's expanduser and
// expandvars do.
struct HubCacheDir {
  std::string path;
  std::string from;  // how it was found, for messages: "$HF_HUB_CACHE", "$HF_HOME/hub", ...
};
HubCacheDir hub_cache_dir();

// Whether `s` is a repository id huggingface_hub accepts (utils/_validators.py validate_repo_id):
// "name" or "org/name", each part 1 to 96 of [A-Za-z0-9_.-] starting and ending with a letter,
// digit or _, no "--" or "..", not ending in ".git".
bool is_hub_repo_id(const std::string& s);

struct ModelDir {
  std::string dir;     // where to read the model: the value as given, or the cache's snapshot
  std::string hub_id;  // the id found in the hub cache; "" when the value was used as given
  std::string note;    // for a hub id: "--model ORG/NAME: DIR (the hub cache's refs/main, $FROM)"
};

// The model directory a --model (or --base-model: `option`) value names. A value that exists on
// disk, is empty, or is not a hub id is used as given (a missing directory is then refused by
// whoever reads config.json, as before). Otherwise it is looked up in hub_cache_dir():
// models--ORG--NAME/refs/main holds a commit, whose files are in snapshots/<commit>/. A hub id the
// cache does not hold is refused (ConfigError) naming the id, each path tried, and what to do.
ModelDir resolve_model_dir(const std::string& value, const std::string& option = "--model");

}  // namespace ft::io
