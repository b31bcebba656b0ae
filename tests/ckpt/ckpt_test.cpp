// The checkpoint format on its own (one process): pieces written by several "ranks" read back as
// any range, commit and pruning rules, and damage detected by checksum with the file named.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <filesystem>
#include <string>

#include "ckpt/checkpoint.h"
#include "ckpt/crc32c.h"
#include "core/error.h"
#include "support/subprocess.h"

namespace fs = std::filesystem;
using namespace ft::ckpt;
using namespace ft::test;

namespace {

// Saves `t` (a 2-D float tensor) at `step` as written by `world` ranks, each holding a contiguous
// range of the flattened tensor; ranks 1.. first, rank 0 last (it commits once all are there).
void save_split(const std::string& root, int64_t step, const at::Tensor& t, int world,
                int keep_last = 2) {
  const int64_t n = t.numel(), per = (n + world - 1) / world;
  for (int r = world - 1; r >= 0; --r) {
    SaverOptions o;
    o.root = root;
    o.rank = r;
    o.world_size = world;
    o.keep_last = keep_last;
    o.signal = [](const std::string&) {};
    o.wait_all = [](const std::vector<std::string>&) {};
    Saver s(o);
    Snapshot snap;
    snap.step = step;
    snap.state = {{"hello", "world"}};
    snap.rank_state = {{"rank", r}};
    snap.shapes["param/w"] = t.sizes().vec();
    const int64_t b = std::min(n, r * per), e = std::min(n, b + per);
    snap.pieces.push_back({"param/w", b, e, t.reshape({-1}).slice(0, b, e).clone()});
    s.save(std::move(snap), /*async=*/r % 2 == 1);
    s.wait();
  }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ft::FormatError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("crc32c matches the standard check value and continues across calls", "[unit]") {
  const std::string s = "123456789";
  CHECK(crc32c(s.data(), s.size()) == 0xE3069283u);
  CHECK(crc32c(s.data() + 4, 5, crc32c(s.data(), 4)) == 0xE3069283u);
  CHECK(crc32c(nullptr, 0) == 0u);
  std::string big(1000, 'x');
  big[500] = 'y';
  CHECK(crc32c(big.data(), big.size()) != crc32c(std::string(1000, 'x').data(), 1000));
}

TEST_CASE("pieces of 3 ranks read back as any range, with commit, latest and keep_last", "[unit]") {
  const std::string root = make_temp_dir() + "/checkpoints";
  at::Tensor w = at::randn({7, 5});
  save_split(root, 4, w, 3);
  save_split(root, 8, w * 2, 3);
  CHECK(list_committed(root) ==
        std::vector<std::string>{root + "/step-000000008", root + "/step-000000004"});
  CHECK(read_file(root + "/latest") == "step-000000008\n");
  Checkpoint c = Checkpoint::open(root + "/step-000000008");
  CHECK(c.step() == 8);
  CHECK(c.world_size() == 3);
  CHECK(c.state()["hello"] == "world");
  CHECK(c.rank_state(2)["rank"] == 2);
  CHECK(c.shape("param/w") == std::vector<int64_t>{7, 5});
  // A range across all three chunks, converted to double on the way.
  at::Tensor part = at::empty({30}, at::kDouble);
  c.read_range("param/w", 3, 33, part);
  CHECK(part.equal((w * 2).reshape({-1}).slice(0, 3, 33).to(at::kDouble)));
  at::Tensor all = at::empty({35});
  c.read_range("param/w", 0, 35, all);
  CHECK(all.equal((w * 2).reshape({-1})));
  CHECK_THAT(error_of([&] { c.read_range("param/nope", 0, 1, all.narrow(0, 0, 1)); }),
             Catch::Contains("has no param/nope"));

  // keep_last 2: a third commit removes the oldest, never the newest.
  save_split(root, 12, w * 3, 2);
  CHECK(list_committed(root) ==
        std::vector<std::string>{root + "/step-000000012", root + "/step-000000008"});
  // An unfinished save (no meta.json) is never listed, and a later commit clears it away.
  fs::create_directories(root + "/.tmp-step-000000014");
  fs::create_directories(root + "/step-000000016");  // no meta.json: never committed
  CHECK(list_committed(root).front() == root + "/step-000000012");
  save_split(root, 20, w, 1);
  CHECK_FALSE(fs::exists(root + "/.tmp-step-000000014"));
  CHECK(list_committed(root).front() == root + "/step-000000020");
}

TEST_CASE("truncated, bit-flipped, deleted and uncommitted checkpoints are named", "[unit]") {
  at::Tensor w = at::randn({64, 64});
  auto fresh = [&] {
    const std::string root = make_temp_dir() + "/checkpoints";
    save_split(root, 2, w, 2);
    return root + "/step-000000002";
  };
  auto verify = [](const std::string& dir) {
    return error_of([&] {
      Checkpoint c = Checkpoint::open(dir);
      c.verify_range("param/w", 0, 64 * 64);
    });
  };
  {
    const std::string dir = fresh();
    CHECK(verify(dir).empty());
    // One flipped bit in the data of rank 1's file.
    flip_bits(dir + "/rank-00001.safetensors", 100, 0x10);
    const std::string msg = verify(dir);
    CHECK_THAT(msg, Catch::Contains("rank-00001.safetensors") && Catch::Contains("checksum"));
    // Rank 0's chunk alone still reads.
    Checkpoint c = Checkpoint::open(dir);
    CHECK_NOTHROW(c.verify_range("param/w", 0, 100));
  }
  {
    const std::string dir = fresh();
    fs::resize_file(dir + "/rank-00000.safetensors", 1000);
    CHECK_THAT(verify(dir), Catch::Contains("rank-00000.safetensors"));
  }
  {
    const std::string dir = fresh();
    fs::remove(dir + "/rank-00001.safetensors");
    CHECK_THAT(verify(dir),
               Catch::Contains("rank-00001.safetensors") && Catch::Contains("incomplete"));
  }
  {
    const std::string dir = fresh();
    fs::remove(dir + "/meta.json");
    CHECK_THAT(verify(dir), Catch::Contains("meta.json") && Catch::Contains("never committed"));
    CHECK(list_committed(fs::path(dir).parent_path().string()).empty());
  }
}
