// Faults of the disk under real `ft train` and `ft launch` jobs (issue 13): the output directory on
// a small tmpfs that fills during a checkpoint save, and a read-only output directory. Each tmpfs
// is sized from a reference run's real checkpoint, so that the first save fits and the second
// does not. Mounting needs root (or CAP_SYS_ADMIN): without it these tests skip, visibly.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "support/runs.h"
#include "support/subprocess.h"
#include "support/tmpfs.h"

namespace fs = std::filesystem;
using namespace ft::test;

namespace {

// The job tests' small model (runs.h): 6 steps, a checkpoint every 2. The preflight only warns:
// it refuses a filesystem that cannot hold keep_last + 1 checkpoints, and such a one is the point
// here.
std::vector<std::string> disk_sets(const std::vector<std::string>& more) {
  return with(with(small_run_sets(), {"train.max_steps=6", "output.save_every=2",
                                      "output.keep_last=2", "hardware.preflight=warn"}),
              more);
}

// Room on the tmpfs besides the checkpoints: preset.json, the load and metrics records,
// checkpoints.jsonl and `latest` take a page or two each.
constexpr int64_t kSmallFiles = 64 << 10;

Finished run(const std::vector<std::string>& argv) {
  return run_to_end(argv, {}, make_temp_dir() + "/out.txt", 150);
}

std::set<std::string> entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// A job whose output is on a tmpfs with room for the small files, one checkpoint and half of
// another. The checkpoint's size is measured on a reference run of the same job on ordinary
// storage, whose final model the faulted job must end with.
struct FullDiskJob {
  std::string ref;         // the reference run's --output
  int64_t checkpoint = 0;  // bytes one checkpoint takes on a tmpfs
  std::unique_ptr<Tmpfs> tmpfs;
  std::string out;  // the job's --output, on the tmpfs
  std::vector<std::string> argv;
};

// `room(checkpoint, final)`: the tmpfs's size from the reference run's checkpoint and final/.
FullDiskJob full_disk_job(int nproc, const std::vector<std::string>& sets,
                          int64_t (*room)(int64_t checkpoint, int64_t final) = nullptr) {
  FullDiskJob job;
  job.ref = make_temp_dir() + "/ref";
  Finished r = run(tiny_job_argv(nproc, job.ref, sets));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  // The last checkpoint (keep_last may have pruned the others; all have the same size).
  job.checkpoint = tmpfs_bytes(job.ref + "/checkpoints/step-000000006");
  REQUIRE(job.checkpoint > 4 * kSmallFiles);  // the sizing relies on it
  std::string why;
  job.tmpfs = Tmpfs::mount(room ? room(job.checkpoint, tmpfs_bytes(job.ref + "/final"))
                                : kSmallFiles + job.checkpoint + job.checkpoint / 2,
                           &why);
  INFO(why);
  REQUIRE(job.tmpfs);
  job.out = job.tmpfs->dir() + "/run";
  job.argv = tiny_job_argv(nproc, job.out, sets);
  return job;
}

// Room made (the tmpfs remounted larger): the same command continues from `from` and ends with
// the reference run's model, every step recorded once. Returns its output.
std::string check_resumes_with_room(const FullDiskJob& job,
                                    const std::string& from = "step-000000002") {
  job.tmpfs->resize(8 * job.checkpoint);
  Finished again = run(job.argv);
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("resuming from " + job.out + "/checkpoints/" + from));
  const auto got = read_metrics(job.out), want = read_metrics(job.ref);
  CHECK(got.size() == 6);
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    INFO("step " << i + 1);
    CHECK(got[i]["loss"] == want[i]["loss"]);
    CHECK(got[i]["grad_norm"] == want[i]["grad_norm"]);
  }
  CHECK(read_file(job.out + "/final/model.safetensors") ==
        read_file(job.ref + "/final/model.safetensors"));
  return again.output;
}

// What the save of step 4 on a full disk leaves under `out`: nothing of it (no step-4 or
// temporary directory), step 2 committed and `latest` still at it, the failure recorded; and the
// message names the file, the free space and what to do.
void check_failed_save(const std::string& out, const std::string& output, const std::string& file) {
  CHECK_THAT(output, Catch::Contains("checkpoint of step 4 not saved") &&
                         Catch::Contains("No space left on device") && Catch::Contains(file) &&
                         Catch::Contains(" free of ") && Catch::Contains("the file needs") &&
                         Catch::Contains("was removed") &&
                         Catch::Contains("step-000000002, is intact") &&
                         Catch::Contains("--resume auto continues from it"));
  CHECK(entries(out + "/checkpoints") == std::set<std::string>{"latest", "step-000000002"});
  CHECK(read_file(out + "/checkpoints/latest") == "step-000000002\n");
  CHECK(fs::is_regular_file(out + "/checkpoints/step-000000002/meta.json"));
  CHECK_FALSE(fs::exists(out + "/final"));
  bool recorded = false;
  for (const auto& r : read_jsonl(out + "/checkpoints.jsonl"))
    recorded |= r["step"] == 4 && r.contains("error") &&
                r["error"].get<std::string>().find("No space left") != std::string::npos;
  CHECK(recorded);
}

bool can_mount(std::string* why) { return Tmpfs::mount(1 << 20, why) != nullptr; }

}  // namespace

TEST_CASE(
    "a disk that fills during a checkpoint save (sync and async): exit 74 naming the file and "
    "the free space, the last commit intact, and the same command resumes from it",
    "[multiproc]") {
  std::string why;
  if (!can_mount(&why)) skip_test(why);
  for (const bool async : {false, true}) {
    INFO("output.async_save=" << async);
    const auto sets = disk_sets({async ? "output.async_save=true" : "output.async_save=false"});
    const FullDiskJob job = full_disk_job(1, sets);
    Finished full = run(job.argv);
    INFO(output_tail(full.output));
    CHECK(full.code == 74);
    // Said before the save, from the free space (best effort), then by the write itself.
    CHECK_THAT(full.output, Catch::Contains("the checkpoint of step 4 needs about") &&
                                Catch::Contains("the save will likely fail"));
    check_failed_save(job.out, full.output,
                      job.out + "/checkpoints/.tmp-step-000000004/rank-00000.safetensors");
    CHECK(read_metrics(job.out).size() >= 4);
    check_resumes_with_room(job);
  }
}

TEST_CASE(
    "output.on_save_error=continue: a full disk is warned about, training goes on, and the next "
    "save tries again",
    "[multiproc]") {
  std::string why;
  if (!can_mount(&why)) skip_test(why);
  // keep_last 1: every later save needs room for a second checkpoint, which is not there, while
  // final/ (a third of a checkpoint) fits.
  const auto sets = disk_sets({"output.on_save_error=continue", "output.keep_last=1"});
  const FullDiskJob job = full_disk_job(1, sets);
  const std::string& out = job.out;
  Finished r = run(job.argv);
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Catch::Contains("WARNING: checkpoint of step 4 not saved") &&
                           Catch::Contains("WARNING: checkpoint of step 6 not saved") &&
                           Catch::Contains("No space left on device") &&
                           Catch::Contains("training goes on without it") &&
                           Catch::Contains("2 checkpoint save(s) failed (steps 4, 6)"));
  CHECK(read_metrics(out).size() == 6);
  CHECK(entries(out + "/checkpoints") == std::set<std::string>{"latest", "step-000000002"});
  // Training was not disturbed: the model is the uninterrupted run's.
  CHECK(read_file(out + "/final/model.safetensors") ==
        read_file(job.ref + "/final/model.safetensors"));
}

TEST_CASE(
    "ft launch, 2 ranks: a disk that fills during a save stops every rank, commits nothing "
    "without a rank's piece, and the job resumes from the last commit",
    "[multiproc]") {
  std::string why;
  if (!can_mount(&why)) skip_test(why);
  const FullDiskJob job = full_disk_job(2, disk_sets({"train.micro_batch=4"}));
  Finished full = run(job.argv);
  INFO(output_tail(full.output));
  REQUIRE(full.code != -1);  // ended: no rank was left waiting for another
  CHECK(full.code == 1);     // the launcher's "a worker failed"
  CHECK_THAT(full.output, Catch::Contains("exited with code 74"));
  // Whichever rank's file did not fit, the account names it (every rank reports rank 0's).
  check_failed_save(job.out, full.output, job.out + "/checkpoints/.tmp-step-000000004/rank-0000");
  CHECK_THAT(check_resumes_with_room(job), Catch::Contains("saved by 2 ranks"));
}

TEST_CASE(
    "a disk that fills while final/ is written (1 and 2 ranks): exit 74 naming the file, the "
    "incomplete final/ removed, the last checkpoint intact, and the same command writes final/",
    "[multiproc]") {
  std::string why;
  if (!can_mount(&why)) skip_test(why);
  for (const int nproc : {1, 2}) {
    INFO("ranks: " << nproc);
    // One checkpoint, at the last step, then final/ (a third of it), for which there is room for
    // half.
    const FullDiskJob job = full_disk_job(
        nproc, disk_sets({"output.save_every=6", "train.micro_batch=4"}),
        [](int64_t checkpoint, int64_t final) { return kSmallFiles + checkpoint + final / 2; });
    Finished full = run(job.argv);
    INFO(output_tail(full.output));
    REQUIRE(full.code != -1);  // ended: no rank was left waiting in a gather
    CHECK(full.code == (nproc == 1 ? 74 : 1));
    if (nproc > 1) CHECK_THAT(full.output, Catch::Contains("exited with code 74"));
    CHECK_THAT(full.output,
               Catch::Contains("final/ not saved") && Catch::Contains("No space left on device") &&
                   Catch::Contains(job.out + "/final/model.safetensors") &&
                   Catch::Contains(" free of ") &&
                   Catch::Contains("the incomplete " + job.out + "/final was removed") &&
                   Catch::Contains("step-000000006 (step 6 of 6), is intact") &&
                   !Catch::Contains("terminate called"));
    CHECK_FALSE(fs::exists(job.out + "/final"));
    CHECK(fs::is_regular_file(job.out + "/checkpoints/step-000000006/meta.json"));
    // Room made: the same command resumes at the last step, trains nothing and writes final/.
    check_resumes_with_room(job, "step-000000006");
  }
}

TEST_CASE("a read-only --output is refused with exit 2 before anything is loaded or written",
          "[multiproc]") {
  std::string why;
  auto tmpfs = Tmpfs::mount(1 << 20, &why);
  if (!tmpfs) skip_test(why);
  fs::create_directories(tmpfs->dir() + "/existing");
  tmpfs->make_read_only();  // root writes past permission bits, not onto a read-only mount
  const std::string existing = tmpfs->dir() + "/existing";
  const std::string nested = tmpfs->dir() + "/new/run";
  for (const auto& [out, names] : std::vector<std::pair<std::string, std::string>>{
           {existing, "--output " + existing + " is on a read-only filesystem"},
           {nested, "--output " + nested + " cannot be created: its nearest existing parent " +
                        tmpfs->dir() + " is on a read-only filesystem"}}) {
    auto check_refused = [&](const std::string& output) {
      CHECK_THAT(output, Catch::Contains(names) &&
                             Catch::Contains("give an --output on writable storage") &&
                             !Catch::Contains("preflight") && !Catch::Contains("loading"));
    };
    // ft train; ft launch given ft train's options (it refuses before starting any worker); and
    // ft launch -- ft train, whose workers refuse (exit 2), so the launcher reports a failure.
    Finished alone = run(tiny_job_argv(1, out, disk_sets({})));
    INFO(output_tail(alone.output));
    CHECK(alone.code == 2);
    check_refused(alone.output);
    std::vector<std::string> launch = {ft_bin(),   "launch",        "--nproc-per-node",
                                       "2",        "--master-port", std::to_string(free_port()),
                                       "--preset", "tiny-demo",     "--output",
                                       out};
    for (const auto& set : disk_sets({})) launch.insert(launch.end(), {"--set", set});
    Finished launcher = run(launch);
    INFO(output_tail(launcher.output));
    CHECK(launcher.code == 2);
    check_refused(launcher.output);
    CHECK_THAT(launcher.output, !Catch::Contains("round 0"));
    Finished workers = run(tiny_job_argv(2, out, disk_sets({})));
    INFO(output_tail(workers.output));
    CHECK(workers.code == 1);
    check_refused(workers.output);
    CHECK_THAT(workers.output, Catch::Contains("worker exited with code 2"));
  }
  CHECK(entries(tmpfs->dir()) == std::set<std::string>{"existing"});
  CHECK(fs::is_empty(existing));
}

TEST_CASE("an --output with a file in its path is refused with exit 2, nothing written",
          "[multiproc]") {
  const std::string dir = make_temp_dir();
  std::ofstream(dir + "/file") << "not a directory";
  const std::string out = dir + "/file/run";
  Finished r = run(tiny_job_argv(1, out, disk_sets({})));
  INFO(output_tail(r.output));
  CHECK(r.code == 2);
  CHECK_THAT(r.output, Catch::Contains("--output " + out +
                                       " cannot be created: its nearest "
                                       "existing parent " +
                                       dir + "/file is not a directory"));
  CHECK(entries(dir) == std::set<std::string>{"file"});
}
