// docs/architecture.md stays true: every file its "Who owns what" tables name exists, and every
// source file of runtime/, launcher/ and apps/ is named there.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

const fs::path kRoot = fs::path(FT_TEST_DIR).parent_path();

// "error.{h,cpp}" -> error.h, error.cpp; "api.h" -> api.h.
std::vector<std::string> expand_braces(const std::string& name) {
  const size_t open = name.find('{'), close = name.find('}');
  if (open == std::string::npos || close == std::string::npos) return {name};
  std::vector<std::string> out;
  std::stringstream alternatives(name.substr(open + 1, close - open - 1));
  for (std::string alt; std::getline(alternatives, alt, ',');)
    out.push_back(name.substr(0, open) + alt + name.substr(close + 1));
  return out;
}

// Every path the tables under "### `<folder>/`" headings name, relative to the repository.
std::set<std::string> files_named_in_doc() {
  std::ifstream in(kRoot / "docs" / "architecture.md");
  REQUIRE(in.good());
  const std::regex heading(R"(^### `([a-z_/]+/)`)");
  const std::regex row(R"(^\| ([^|]+) \|)");
  const std::regex code("`([^`]+)`");
  std::set<std::string> named;
  std::string folder;
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (line.rfind("## ", 0) == 0) folder.clear();
    if (std::regex_search(line, m, heading)) {
      folder = m[1];
      continue;
    }
    if (folder.empty() || !std::regex_search(line, m, row)) continue;
    const std::string cell = m[1];
    for (std::sregex_iterator it(cell.begin(), cell.end(), code), end; it != end; ++it)
      for (const auto& file : expand_braces((*it)[1])) named.insert(folder + file);
  }
  return named;
}

}  // namespace

TEST_CASE("docs/architecture.md: every file it names exists") {
  const auto named = files_named_in_doc();
  REQUIRE(named.size() > 50);
  for (const auto& file : named) {
    INFO(file << " is named in docs/architecture.md but does not exist");
    CHECK(fs::is_regular_file(kRoot / file));
  }
}

TEST_CASE("docs/architecture.md: every source file of runtime/, launcher/ and apps/ is named") {
  const auto named = files_named_in_doc();
  int sources = 0;
  for (const char* top : {"runtime", "launcher", "apps"})
    for (const auto& e : fs::recursive_directory_iterator(kRoot / top)) {
      const std::string ext = e.path().extension().string();
      if (!e.is_regular_file() || (ext != ".h" && ext != ".cpp" && ext != ".cu")) continue;
      ++sources;
      const std::string rel = fs::relative(e.path(), kRoot).generic_string();
      INFO(rel << " is not named in docs/architecture.md (add it to its room's table)");
      CHECK(named.count(rel) == 1);
    }
  CHECK(sources > 50);
}
