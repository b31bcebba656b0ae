#include "io/hub_cache.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "core/error.h"

namespace ft::io {
namespace {
namespace fs = std::filesystem;

// An unset variable and an empty one are both "not given": `export HF_HOME=` is a user clearing
// it, not asking for the current directory (which Python's os.getenv would make of it).
std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// Python's os.path.expanduser: a leading `~` (HOME, else the password database) or `~user`;
// unchanged when the home is unknown.
std::string expand_user(const std::string& p) {
  if (p.empty() || p[0] != '~') return p;
  const size_t slash = p.find('/');
  const std::string user = p.substr(1, slash == std::string::npos ? std::string::npos : slash - 1);
  std::string home = user.empty() ? env("HOME") : "";
  if (home.empty()) {
    const passwd* pw = user.empty() ? ::getpwuid(::getuid()) : ::getpwnam(user.c_str());
    if (pw == nullptr) return p;
    home = pw->pw_dir;
  }
  while (home.size() > 1 && home.back() == '/') home.pop_back();
  return home + (slash == std::string::npos ? "" : p.substr(slash));
}

bool is_word_char(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Python's os.path.expandvars: `$NAME` and `${NAME}` replaced by the variable's value; a variable
// that is not set is left as written.
std::string expand_vars(const std::string& p) {
  std::string out;
  size_t i = 0;
  while (i < p.size()) {
    if (p[i] != '$') {
      out += p[i++];
      continue;
    }
    size_t end = i + 1;
    std::string name;
    if (end < p.size() && p[end] == '{') {
      const size_t close = p.find('}', end + 1);
      if (close != std::string::npos) {
        name = p.substr(end + 1, close - end - 1);
        end = close + 1;
      }
    } else {
      while (end < p.size() && is_word_char(p[end])) ++end;
      name = p.substr(i + 1, end - i - 1);
    }
    const char* value = name.empty() ? nullptr : std::getenv(name.c_str());
    out += value ? std::string(value) : p.substr(i, std::max(end - i, size_t{1}));
    i = std::max(end, i + 1);
  }
  return out;
}

std::string expand(const std::string& p) { return expand_vars(expand_user(p)); }

bool is_id_part(const std::string& part) {
  if (part.empty() || part.size() > 96) return false;
  for (char c : part)
    if (!is_word_char(c) && c != '-' && c != '.') return false;
  return is_word_char(part.front()) && is_word_char(part.back());
}

// The commit refs/main names: the file's text (huggingface_hub writes the hash alone; a newline
// a hand edit left is tolerated); "" when the file is empty or names no single directory.
std::string read_commit(const fs::path& ref) {
  std::ifstream in(ref);
  std::string commit;
  std::getline(in, commit);
  while (!commit.empty() && std::isspace(static_cast<unsigned char>(commit.back())))
    commit.pop_back();
  const bool one_name = commit.find('/') == std::string::npos && commit != "." && commit != "..";
  return one_name ? commit : "";
}

// The snapshots a repository's cache folder holds, for a message: "abc, def" or "none".
std::string snapshots_held(const fs::path& repo) {
  std::vector<std::string> names;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(repo / "snapshots", ec))
    names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "));
}

// The refusal of a hub id the cache lacks: the id, each path tried and why it failed, and what to
// do.
[[noreturn]] void not_in_cache(const std::string& option, const std::string& id,
                               const HubCacheDir& cache, const std::string& tried) {
  throw ConfigError(fmt::format(
      "{} {}: not a directory here, and the Hugging Face hub cache {} ({}) does not hold that "
      "model: tried {}. ft looks in the cache offline and downloads nothing: download it "
      "first with `hf download {}` (or `huggingface-cli download {}`) under the same "
      "HF_HUB_CACHE / HF_HOME, or give {} the model's directory",
      option, id, cache.path, cache.from, tried, id, id, option));
}
}  // namespace

HubCacheDir hub_cache_dir() {
  // constants.py: HF_HUB_CACHE = expand(HF_HUB_CACHE or HUGGINGFACE_HUB_CACHE or HF_HOME/hub),
  // HF_HOME = expand(HF_HOME or (XDG_CACHE_HOME or ~/.cache)/huggingface).
  for (const char* name : {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"})
    if (!env(name).empty()) return {expand(env(name)), fmt::format("${}", name)};
  if (!env("HF_HOME").empty()) return {expand(env("HF_HOME")) + "/hub", "$HF_HOME/hub"};
  if (!env("XDG_CACHE_HOME").empty())
    return {expand(env("XDG_CACHE_HOME") + "/huggingface") + "/hub",
            "$XDG_CACHE_HOME/huggingface/hub"};
  return {expand("~/.cache/huggingface") + "/hub",
          "the default: HF_HUB_CACHE, HF_HOME and XDG_CACHE_HOME are not set"};
}

bool is_hub_repo_id(const std::string& s) {
  if (std::count(s.begin(), s.end(), '/') > 1) return false;
  const size_t slash = s.find('/');
  if (slash != std::string::npos && !is_id_part(s.substr(0, slash))) return false;
  const std::string name = slash == std::string::npos ? s : s.substr(slash + 1);
  const bool git = name.size() >= 4 && name.compare(name.size() - 4, 4, ".git") == 0;
  return is_id_part(name) && s.find("--") == std::string::npos &&
         s.find("..") == std::string::npos && !git;
}

ModelDir resolve_model_dir(const std::string& value, const std::string& option) {
  std::error_code ec;
  if (value.empty() || fs::exists(value, ec) || !is_hub_repo_id(value)) return {value, "", ""};
  const HubCacheDir cache = hub_cache_dir();
  std::string folder = "models--" + value;
  if (const size_t slash = folder.find('/'); slash != std::string::npos)
    folder.replace(slash, 1, "--");
  const fs::path repo = fs::absolute(fs::path(cache.path) / folder, ec).lexically_normal();
  const fs::path ref = repo / "refs" / "main";
  const std::string here = fmt::format("{} (no such file or directory)", value);
  if (!fs::is_regular_file(ref, ec)) {
    const std::string why = fs::is_directory(repo, ec)
                                ? fmt::format("missing; its snapshots: {}", snapshots_held(repo))
                                : fmt::format("missing, as is {}", repo.string());
    not_in_cache(option, value, cache, fmt::format("{}, {} ({})", here, ref.string(), why));
  }
  const std::string commit = read_commit(ref);
  if (commit.empty())
    not_in_cache(option, value, cache,
                 fmt::format("{}, {} (holds no commit hash)", here, ref.string()));
  const fs::path snapshot = repo / "snapshots" / commit;
  if (!fs::is_directory(snapshot, ec))
    not_in_cache(option, value, cache,
                 fmt::format("{}, {} (names commit {}), {} (missing: an interrupted or deleted "
                             "download; its snapshots: {})",
                             here, ref.string(), commit, snapshot.string(), snapshots_held(repo)));
  return {snapshot.string(), value,
          fmt::format("{} {}: {} (its main revision in the Hugging Face hub cache, {})", option,
                      value, snapshot.string(), cache.from)};
}

}  // namespace ft::io
