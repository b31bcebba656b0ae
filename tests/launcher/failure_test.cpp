// Unit tests: a round's failure record keeps the store's format byte for byte, reads back, and
// summarises the same way on every launcher.
#include "failure.h"

#include <catch2/catch.hpp>

using namespace ft::launcher;

namespace {
Failure worker_failure() {
  WorkerExit w;
  w.local_rank = 1;
  w.global_rank = 3;
  w.exit_code = 7;
  w.elapsed_s = 2.5;
  w.tail = {"step 1", "boom"};
  return make_failure(FailureKind::kWorker, 1, "gpu02", w.describe(), w);
}
}  // namespace

TEST_CASE("failure records keep the store's format and read back", "[unit]") {
  const Failure w = worker_failure();
  CHECK(w.to_json() ==
        R"({"description":"exited with code 7","elapsed_s":2.5,"exit_code":7,"hostname":"gpu02",)"
        R"("kind":"worker","local_rank":1,"node_rank":1,"rank":3,"signal":0,)"
        R"("tail":["step 1","boom"]})");
  const Failure h = make_failure(FailureKind::kHang, 0, "gpu01", "rank 1 hung");
  CHECK(h.to_json() ==
        R"({"description":"rank 1 hung","hostname":"gpu01","kind":"hang","node_rank":0})");

  const Failure back = Failure::from_json(w.to_json());
  CHECK(back.kind == FailureKind::kWorker);
  CHECK(back.to_json() == w.to_json());
  CHECK(Failure::from_json(h.to_json()).to_json() == h.to_json());
  for (auto kind : {FailureKind::kWorker, FailureKind::kNode, FailureKind::kHang,
                    FailureKind::kRejoin, FailureKind::kSignal, FailureKind::kError}) {
    const std::string text = std::string(R"({"kind":")") + kind_name(kind) + "\"}";
    CHECK(Failure::from_json(text).kind == kind);
  }
  // Missing fields read as the summary's placeholders; an unknown kind ends the job.
  const Failure odd = Failure::from_json(R"({"kind":"meteor"})");
  CHECK(odd.kind == FailureKind::kError);
  CHECK(odd.node_rank == -1);
  CHECK(odd.hostname == "?");
}

TEST_CASE("only worker, node and hang failures use a restart", "[unit]") {
  CHECK(restartable(FailureKind::kWorker));
  CHECK(restartable(FailureKind::kNode));
  CHECK(restartable(FailureKind::kHang));
  CHECK_FALSE(restartable(FailureKind::kRejoin));
  CHECK_FALSE(restartable(FailureKind::kSignal));
  CHECK_FALSE(restartable(FailureKind::kError));
}

TEST_CASE("the summary names the node, the worker, its exit and its output's tail", "[unit]") {
  CHECK(summary_text(worker_failure()) ==
        "job failed: first failure on node 1 (gpu02) rank 3 (local rank 1): worker exited with "
        "code 7 after 2.5 s\n  last 2 line(s) of rank 3's output:\n  | step 1\n  | boom");
  CHECK(summary_text(make_failure(FailureKind::kSignal, 0, "gpu01", "launcher received SIGTERM")) ==
        "job stopped: node 0 (gpu01) launcher received SIGTERM");
}
