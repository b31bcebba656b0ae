// The checkpoint format on its own (one process): pieces written by several "ranks" read back as
// any range, commit and pruning rules, and damage detected by checksum with the file named.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <thread>

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
    o.signal = [](const std::string&, const std::string&) {};
    o.wait_all = [](const std::vector<std::string>& keys) {
      return std::vector<std::string>(keys.size());  // every rank wrote its files
    };
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

// The launcher's store as the savers of one process's "ranks" (threads) use it: a key set once,
// and a wait for keys that gives their values.
class Board {
 public:
  void set(const std::string& key, const std::string& value) {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
    cv_.notify_all();
  }
  std::vector<std::string> wait(const std::vector<std::string>& keys) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool all = cv_.wait_for(lock, std::chrono::seconds(30), [&] {
      for (const auto& k : keys)
        if (!values_.count(k)) return false;
      return true;
    });
    if (!all) throw std::runtime_error("timed out waiting for the other ranks");
    std::vector<std::string> out;
    for (const auto& k : keys) out.push_back(values_.at(k));
    return out;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::string> values_;
};

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
    CHECK_THAT(verify(dir), Catch::Contains("meta.json") && Catch::Contains("damaged"));
    CHECK(list_committed(fs::path(dir).parent_path().string()).empty());
  }
}

// A rank whose files cannot be written (here a directory is in the way of its temporary file; on a
// full disk the write fails the same way) still reports to rank 0, which commits nothing, removes
// the temporary directory and names the rank; every rank's save fails, none waits forever.
TEST_CASE("a rank that cannot write its files: nothing is committed and every rank is told",
          "[unit]") {
  const std::string root = make_temp_dir() + "/checkpoints";
  at::Tensor w = at::randn({8, 8});
  save_split(root, 2, w, 2);
  fs::create_directories(root + "/.tmp-step-000000004/rank-00001.safetensors.tmp");
  Board board;
  std::string errors[2], verdict;
  bool seen_failed[2] = {false, false};
  auto rank = [&](int r) {
    SaverOptions o;
    o.root = root;
    o.rank = r;
    o.world_size = 2;
    o.signal = [&](const std::string& key, const std::string& error) { board.set(key, error); };
    o.wait_all = [&](const std::vector<std::string>& keys) { return board.wait(keys); };
    Saver s(o);
    Snapshot snap;
    snap.step = 4;
    snap.shapes["param/w"] = w.sizes().vec();
    snap.pieces.push_back(
        {"param/w", r * 32, r * 32 + 32, w.reshape({-1}).slice(0, r * 32, r * 32 + 32)});
    s.save(std::move(snap), /*async=*/true);
    s.wait_captured();
    // The background failure shows without waiting for it.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!s.failed() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    seen_failed[r] = s.failed();
    try {
      s.wait();
    } catch (const CheckpointSaveError& e) {
      errors[r] = e.what();
    }
    if (r == 1) verdict = s.verdict(4);
  };
  std::thread t1(rank, 1), t0(rank, 0);
  t0.join();
  t1.join();
  CHECK(seen_failed[0]);
  CHECK(seen_failed[1]);
  CHECK_THAT(errors[1], Catch::Contains("rank 1") && Catch::Contains("rank-00001.safetensors"));
  CHECK_THAT(errors[0], Catch::Contains("checkpoint of step 4 not saved: rank 1: ") &&
                            Catch::Contains("rank-00001.safetensors") &&
                            Catch::Contains("was removed"));
  CHECK(verdict == errors[0]);
  CHECK(list_committed(root) == std::vector<std::string>{root + "/step-000000002"});
  CHECK_FALSE(fs::exists(root + "/.tmp-step-000000004"));
  CHECK(read_file(root + "/latest") == "step-000000002\n");
  CHECK(CheckpointSaveError("x").exit_code() == 74);
}
