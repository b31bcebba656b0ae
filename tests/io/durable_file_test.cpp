// Unit tests of io::DurableFile, the one durable write: the target is replaced whole or not at all,
// and no temporary is left behind after a success or after any failure (a missing directory, a
// rename that cannot happen, a writer abandoned midway — as when a tensor's make() throws).
#include "io/durable_file.h"

#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <filesystem>
#include <set>
#include <stdexcept>

#include "core/error.h"
#include "io/safetensors.h"
#include "support/subprocess.h"
#include "support/tmpfs.h"

using namespace ft::io;
namespace fs = std::filesystem;
using ft::test::make_temp_dir;
using ft::test::read_file;
using ft::test::skip_test;

namespace {

// The names of the entries of `dir`.
std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

}  // namespace

TEST_CASE("durable file: the target is replaced whole at commit and no temporary remains",
          "[unit]") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/meta.json";
  write_file_durably(path, "old contents");
  CHECK(read_file(path) == "old contents");
  CHECK(entries(dir) == std::set<std::string>{"meta.json"});

  {
    DurableFile out(path);
    CHECK(out.temp_path() == path + ".tmp");
    out.write("new ");
    out.write(std::string(1 << 20, 'x'));
    // Until commit() the target is the old file; the new bytes are only in the temporary.
    CHECK(read_file(path) == "old contents");
    CHECK(entries(dir) == std::set<std::string>{"meta.json", "meta.json.tmp"});
    out.commit();
    CHECK(read_file(path) == "new " + std::string(1 << 20, 'x'));
  }
  CHECK(entries(dir) == std::set<std::string>{"meta.json"});

  // A crash's leftover temporary is reused by the next write, not piled up or read.
  write_file_durably(path + ".tmp", "half a file");
  write_file_durably(path, "third");
  CHECK(read_file(path) == "third");
  CHECK(entries(dir) == std::set<std::string>{"meta.json"});
  fs::remove_all(dir);
}

TEST_CASE("durable file: a write into a missing directory fails naming it and creates nothing",
          "[unit]") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/missing/config.json";
  CHECK_THROWS_AS(write_file_durably(path, "{}"), ft::SystemError);
  CHECK_THROWS_WITH(write_file_durably(path, "{}"), Catch::Contains(path + ".tmp"));
  CHECK(entries(dir).empty());
  CHECK_THROWS_AS(fsync_dir(dir + "/missing"), ft::SystemError);
  CHECK_THROWS_WITH(fsync_dir(dir + "/missing"), Catch::Contains(dir + "/missing"));
  fs::remove_all(dir);
}

TEST_CASE("durable file: a failed rename removes the temporary and leaves the target as it was",
          "[unit]") {
  const std::string dir = make_temp_dir();
  // A directory where the file should go: rename(2) refuses to put a file over it.
  const std::string path = dir + "/adapter_config.json";
  fs::create_directory(path);
  write_file_durably(path + "/inside", "kept");
  CHECK_THROWS_AS(write_file_durably(path, "{}"), ft::SystemError);
  CHECK_THROWS_WITH(write_file_durably(path, "{}"),
                    Catch::Contains("rename '" + path + ".tmp' to '" + path + "'"));
  CHECK(entries(dir) == std::set<std::string>{"adapter_config.json"});
  CHECK(read_file(path + "/inside") == "kept");
  fs::remove_all(dir);
}

TEST_CASE("durable file: a writer abandoned midway leaves the old target and no temporary",
          "[unit]") {
  const std::string dir = make_temp_dir();
  const std::string path = dir + "/latest";
  write_file_durably(path, "step-000000001\n");
  CHECK_THROWS_AS(
      [&] {
        DurableFile out(path);
        out.write("step-0000");
        throw std::runtime_error("the writer failed midway");
      }(),
      std::runtime_error);
  CHECK(read_file(path) == "step-000000001\n");
  CHECK(entries(dir) == std::set<std::string>{"latest"});

  // The streaming safetensors writer: a tensor whose make() throws after the header and the
  // tensors before it went out.
  write_safetensors(dir + "/model.safetensors", {{"w", at::arange(4, at::kFloat)}});
  const std::string before = read_file(dir + "/model.safetensors");
  DeferredTensors tensors = defer({{"a", at::ones({64})}, {"c", at::ones({64})}});
  tensors.push_back(
      {"b", {64}, at::kFloat, []() -> at::Tensor { throw std::runtime_error("gather failed"); }});
  CHECK_THROWS_WITH(write_sharded_deferred(dir, tensors), "gather failed");
  CHECK(read_file(dir + "/model.safetensors") == before);
  CHECK(entries(dir) == std::set<std::string>{"latest", "model.safetensors"});
  fs::remove_all(dir);
}

TEST_CASE("durable file: copies replace their target whole, a missing source writes nothing",
          "[unit]") {
  const std::string dir = make_temp_dir();
  const std::string src = dir + "/tokenizer.json";
  const std::string bytes = std::string(9 << 20, 'a') + "tail";  // more than one 8 MiB chunk
  write_file_durably(src, bytes);
  fs::create_directory(dir + "/final");
  write_file_durably(dir + "/final/tokenizer.json", "stale");
  copy_file_durably(src, dir + "/final/tokenizer.json");
  CHECK(read_file(dir + "/final/tokenizer.json") == bytes);
  CHECK(entries(dir + "/final") == std::set<std::string>{"tokenizer.json"});

  CHECK_THROWS_AS(copy_file_durably(dir + "/absent", dir + "/final/x"), ft::SystemError);
  CHECK_THROWS_WITH(copy_file_durably(dir + "/absent", dir + "/final/x"),
                    Catch::Contains(dir + "/absent"));
  CHECK(entries(dir + "/final") == std::set<std::string>{"tokenizer.json"});
  fs::remove_all(dir);
}

// A full disk (a 64 KiB tmpfs; needs root or CAP_SYS_ADMIN, else skipped visibly): the error
// names the file, the free space and the bytes the file needed, the partial temporary is gone
// (its space free again) and the target is untouched.
TEST_CASE("durable file: a full filesystem is reported with the file, the free space and the size",
          "[unit]") {
  std::string why;
  auto tmpfs = ft::test::Tmpfs::mount(64 << 10, &why);
  if (!tmpfs) skip_test(why);
  const std::string path = tmpfs->dir() + "/rank-00000.safetensors";
  write_file_durably(path, "old contents");
  const std::string bytes(200 << 10, 'x');
  std::string error;
  try {
    DurableFile out(path, bytes.size());
    out.write(bytes);
    out.commit();
  } catch (const ft::SystemError& e) {
    error = e.what();
  }
  CHECK_THAT(error, Catch::Contains("cannot write '" + path + "': No space left on device") &&
                        Catch::Contains(" free of 64.0 KiB on the filesystem of " + tmpfs->dir()) &&
                        Catch::Contains("the file needs 200.0 KiB") &&
                        Catch::Contains("the partial file was removed"));
  CHECK(entries(tmpfs->dir()) == std::set<std::string>{"rank-00000.safetensors"});
  CHECK(read_file(path) == "old contents");
  // The space is back: a file that fits is written.
  CHECK_NOTHROW(write_file_durably(path, std::string(16 << 10, 'y')));
}
