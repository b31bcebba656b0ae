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

TEST_CASE("a worker that only lost its connection to a peer is told from a root cause", "[unit]") {
  WorkerExit w;
  w.exit_code = 76;  // ft train: lost the connection to another rank
  CHECK(follows_peer_loss(w));
  w.exit_code = 1;
  CHECK_FALSE(follows_peer_loss(w));
  w.tail = {
      "Traceback (most recent call last):", "RuntimeError: [../gloo/transport/tcp/pair.cc:534]",
      "Read error [10.0.0.2]:4711: Connection reset by peer"};
  CHECK(follows_peer_loss(w));  // another program, known by its last lines
  w.tail = {"Connection reset by peer", "line 2", "line 3", "ValueError: bad batch"};
  CHECK_FALSE(follows_peer_loss(w));  // only the last three lines count
  WorkerExit pipe;
  pipe.signal = 13;  // SIGPIPE
  CHECK(follows_peer_loss(pipe));
  WorkerExit killed;
  killed.signal = 9;
  killed.tail = {"Connection reset by peer"};
  CHECK(follows_peer_loss(killed));
  killed.tail = {"step 3"};
  CHECK_FALSE(follows_peer_loss(killed));
  WorkerExit ok;
  ok.tail = {"Connection reset by peer"};
  CHECK_FALSE(follows_peer_loss(ok));  // exited 0
}
