// Unit tests of io::resolve_model_dir: a hub id found in a real hub cache layout (blobs, symlinked
// snapshots, refs/main) under each of the places huggingface_hub looks, with the environment
// variables really set for this process; what is refused, and that a directory still wins.
#include "io/hub_cache.h"

#include <stdlib.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "core/error.h"
#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::io;
namespace fs = std::filesystem;
using ft::test::make_temp_dir;
using ft::test::put_in_hub_cache;

namespace {

using Vars = std::map<std::string, const char*>;  // name -> value; nullptr: unset

// The variables that place the hub cache, set as given (nullptr: unset) for one test case and
// restored after it; every one not named is unset, so the machine's own settings cannot leak in.
class HubEnv {
 public:
  explicit HubEnv(const Vars& set) {
    for (const char* name :
         {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HOME"}) {
      const char* old = std::getenv(name);
      saved_[name] = old ? std::optional<std::string>(old) : std::nullopt;
      put(name, set.count(name) ? set.at(name) : nullptr);
    }
  }
  ~HubEnv() {
    for (const auto& [name, value] : saved_) put(name, value ? value->c_str() : nullptr);
  }

 private:
  static void put(const std::string& name, const char* value) {
    if (value)
      ::setenv(name.c_str(), value, 1);
    else
      ::unsetenv(name.c_str());
  }
  std::map<std::string, std::optional<std::string>> saved_;
};

std::string config_fixture() {
  return ft::test::test_dir() + "/model/fixtures/llama3_gqa_tied/config.json";
}

// The message of the ConfigError resolving `id` throws; fails the test when none is thrown.
std::string refusal_of(const std::string& id) {
  try {
    resolve_model_dir(id);
  } catch (const ft::ConfigError& e) {
    return e.what();
  }
  FAIL("resolve_model_dir(\"" << id << "\") was not refused");
  return "";
}

}  // namespace

TEST_CASE("hub cache: repository ids are those huggingface_hub accepts", "[unit]") {
  for (const char* id : {"Qwen/Qwen3-0.6B", "gpt2", "meta-llama/Llama-3.1-8B", "a_b.c-d/x_1",
                         "HuggingFaceTB/SmolLM2-135M-Instruct"})
    CHECK(is_hub_repo_id(id));
  for (const char* bad : {"", "/abs/path", "./rel", "../up", "a/b/c", "org/a--b", "org/a..b",
                          "org/x.git", "-a", "a-", "org/.x", "a b", "org/", "/name", "a:b"})
    CHECK_FALSE(is_hub_repo_id(bad));
  CHECK(is_hub_repo_id(std::string(96, 'a')));
  CHECK_FALSE(is_hub_repo_id(std::string(97, 'a')));
}

TEST_CASE("hub cache: the cache directory follows huggingface_hub's precedence", "[unit]") {
  {
    HubEnv env(Vars{{"HOME", "/h"}});
    CHECK(hub_cache_dir().path == "/h/.cache/huggingface/hub");
    CHECK_THAT(hub_cache_dir().from, Catch::Contains("not set"));
  }
  {
    HubEnv env(Vars{{"HOME", "/h"}, {"XDG_CACHE_HOME", "/x"}});
    CHECK(hub_cache_dir().path == "/x/huggingface/hub");
  }
  {
    HubEnv env(Vars{{"HOME", "/h"}, {"XDG_CACHE_HOME", "/x"}, {"HF_HOME", "~/hf"}});
    CHECK(hub_cache_dir().path == "/h/hf/hub");
    CHECK(hub_cache_dir().from == "$HF_HOME/hub");
  }
  {
    HubEnv env(Vars{{"HF_HOME", "/hf"}, {"HUGGINGFACE_HUB_CACHE", "/legacy"}});
    CHECK(hub_cache_dir().path == "/legacy");
  }
  {
    HubEnv env(
        Vars{{"HF_HOME", "/hf"}, {"HUGGINGFACE_HUB_CACHE", "/legacy"}, {"HF_HUB_CACHE", "/new"}});
    CHECK(hub_cache_dir().path == "/new");
    CHECK(hub_cache_dir().from == "$HF_HUB_CACHE");
  }
  {
    // An empty variable counts as unset; $VAR and ${VAR} expand, an unset one stays as written.
    ::setenv("FT_TEST_HUB_ROOT", "/r", 1);
    HubEnv env(Vars{{"HF_HUB_CACHE", ""}, {"HF_HOME", "${FT_TEST_HUB_ROOT}/hf"}});
    CHECK(hub_cache_dir().path == "/r/hf/hub");
    HubEnv env2(Vars{{"HF_HUB_CACHE", "$FT_TEST_HUB_ROOT/c/$FT_TEST_HUB_UNSET"}});
    CHECK(hub_cache_dir().path == "/r/c/$FT_TEST_HUB_UNSET");
    ::unsetenv("FT_TEST_HUB_ROOT");
  }
}

TEST_CASE("hub cache: a hub id is found through HF_HUB_CACHE, HF_HOME and the home directory",
          "[unit]") {
  const std::string dir = make_temp_dir();
  struct Where {
    std::string cache;
    Vars env;
    std::string from;
  };
  const std::string hf_home = dir + "/hf-home", home = dir + "/home", hub = dir + "/hub";
  for (const Where& w :
       {Where{hub, {{"HF_HUB_CACHE", hub.c_str()}, {"HOME", "/nowhere"}}, "$HF_HUB_CACHE"},
        Where{hf_home + "/hub", {{"HF_HOME", hf_home.c_str()}}, "$HF_HOME/hub"},
        Where{home + "/.cache/huggingface/hub", {{"HOME", home.c_str()}}, "the default"}}) {
    const std::string snapshot =
        put_in_hub_cache(w.cache, "acme/tiny-llama", "0123abcd", {config_fixture()});
    HubEnv env(w.env);
    const ModelDir m = resolve_model_dir("acme/tiny-llama");
    CHECK(m.dir == snapshot);
    CHECK(m.hub_id == "acme/tiny-llama");
    CHECK(fs::is_regular_file(m.dir + "/config.json"));  // through the blob's symlink
    CHECK_THAT(m.note,
               Catch::Contains("--model acme/tiny-llama: " + snapshot) && Catch::Contains(w.from));
  }
  // A name without an organisation is a repository too (models--gpt2).
  const std::string snapshot = put_in_hub_cache(hub, "gpt2", "feed", {config_fixture()});
  HubEnv env(Vars{{"HF_HUB_CACHE", hub.c_str()}});
  CHECK(resolve_model_dir("gpt2").dir == snapshot);
}

TEST_CASE("hub cache: refs/main chooses the snapshot among several", "[unit]") {
  const std::string hub = make_temp_dir();
  put_in_hub_cache(hub, "acme/m", "aaaa", {config_fixture()});
  const std::string newer = put_in_hub_cache(hub, "acme/m", "bbbb", {config_fixture()});
  HubEnv env(Vars{{"HF_HUB_CACHE", hub.c_str()}});
  CHECK(resolve_model_dir("acme/m").dir == newer);
  // refs/main moved back (another download), with a newline a hand edit leaves.
  std::ofstream(hub + "/models--acme--m/refs/main") << "aaaa\n";
  CHECK(resolve_model_dir("acme/m").dir == hub + "/models--acme--m/snapshots/aaaa");
}

TEST_CASE("hub cache: a hub id the cache lacks is refused naming the id, the paths and the cure",
          "[unit]") {
  const std::string hub = make_temp_dir();
  HubEnv env(Vars{{"HF_HUB_CACHE", hub.c_str()}});
  const std::string absent = refusal_of("acme/absent");
  CHECK_THAT(absent, Catch::Contains("--model acme/absent: not a directory here") &&
                         Catch::Contains(hub + "/models--acme--absent/refs/main") &&
                         Catch::Contains("($HF_HUB_CACHE)") &&
                         Catch::Contains("hf download acme/absent") &&
                         Catch::Contains("huggingface-cli download acme/absent") &&
                         Catch::Contains("the model's directory"));

  // refs/main names a commit whose snapshot is gone.
  put_in_hub_cache(hub, "acme/partial", "c0ffee", {config_fixture()});
  fs::remove_all(hub + "/models--acme--partial/snapshots/c0ffee");
  CHECK_THAT(refusal_of("acme/partial"),
             Catch::Contains(hub + "/models--acme--partial/refs/main (names commit c0ffee)") &&
                 Catch::Contains(hub + "/models--acme--partial/snapshots/c0ffee (missing") &&
                 Catch::Contains("hf download acme/partial"));

  // Only another revision was downloaded: no refs/main; the snapshots it has are named.
  put_in_hub_cache(hub, "acme/tagged", "d00d", {config_fixture()});
  fs::remove(hub + "/models--acme--tagged/refs/main");
  CHECK_THAT(refusal_of("acme/tagged"),
             Catch::Contains("refs/main (missing; its snapshots: d00d)"));

  // An empty refs/main, or one that escapes snapshots/.
  put_in_hub_cache(hub, "acme/empty", "e0", {config_fixture()});
  std::ofstream(hub + "/models--acme--empty/refs/main", std::ios::trunc).flush();
  CHECK_THAT(refusal_of("acme/empty"), Catch::Contains("holds no commit hash"));
  std::ofstream(hub + "/models--acme--empty/refs/main", std::ios::trunc) << "../../x";
  CHECK_THAT(refusal_of("acme/empty"), Catch::Contains("holds no commit hash"));
}

TEST_CASE("hub cache: a path that exists wins, and what is no hub id is left as given", "[unit]") {
  const std::string dir = make_temp_dir();
  const std::string hub = dir + "/hub";
  put_in_hub_cache(hub, "acme/tiny", "abc", {config_fixture()});
  HubEnv env(Vars{{"HF_HUB_CACHE", hub.c_str()}});
  fs::create_directories(dir + "/work/acme/tiny");
  const fs::path cwd = fs::current_path();
  fs::current_path(dir + "/work");
  const ModelDir local = resolve_model_dir("acme/tiny");
  fs::current_path(cwd);
  CHECK(local.dir == "acme/tiny");
  CHECK(local.hub_id.empty());
  CHECK(local.note.empty());
  // Not hub ids: left to whoever reads config.json, whose error names the directory.
  for (const char* v : {"", "/no/such/dir", "runs/a/final", "./acme/tiny"})
    CHECK(resolve_model_dir(v).dir == v);
  // --base-model names itself in the refusal.
  try {
    resolve_model_dir("acme/other", "--base-model");
    FAIL("not refused");
  } catch (const ft::ConfigError& e) {
    CHECK_THAT(e.what(), Catch::StartsWith("--base-model acme/other:") &&
                             Catch::Contains("give --base-model the model's directory"));
  }
}
