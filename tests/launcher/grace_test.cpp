// The wait between SIGTERM and SIGKILL (launcher/grace.h) and the StopEstimate record ft train
// publishes for it (core/worker_contract.h): the sizes, the messages, what a kill loses.
#include "grace.h"

#include <catch2/catch.hpp>
#include <string>

#include "core/worker_contract.h"

using namespace ft;
using namespace ft::launcher;
using Catch::Contains;

namespace {

// A rank that finished `step` in ~step_s seconds, with a save of ~save_s and the newest
// committed checkpoint at `committed`.
RankEstimate rank_at(int rank, int64_t step, double step_s, double save_s, int64_t committed,
                     bool measured = true) {
  contract::StopEstimate e;
  e.step = step;
  e.step_s = step_s;
  e.save_s = save_s;
  e.committed_step = committed;
  e.save_measured = measured;
  return {rank, e};
}

}  // namespace

TEST_CASE("a StopEstimate goes through the store as JSON and anything else is no estimate", "[unit]") {
  const contract::StopEstimate e = rank_at(0, 6, 28.5, 30.25, 4).estimate;
  const auto back = contract::parse_stop_estimate(contract::to_json(e));
  REQUIRE(back.has_value());
  CHECK(back->step == 6);
  CHECK(back->step_s == 28.5);
  CHECK(back->save_s == 30.25);
  CHECK(back->committed_step == 4);
  CHECK(back->save_measured);
  CHECK(contract::stop_estimate_key(3) == "ft_stop/3");
  CHECK(contract::full_stop_estimate_key(2, 3) == "/worker/attempt_2/ft_stop/3");
  for (const std::string& bad : std::vector<std::string>{
           "", "garbage", "[]", "{}",
           R"({"step":1.5,"step_s":1,"committed_step":0,"save_s":1,)"
           R"("save_measured":true})",
           R"({"step":1,"step_s":-1,"committed_step":0,"save_s":1,"save_measured":true})",
           R"({"step":1,"step_s":1,"committed_step":0,"save_s":"1","save_measured":true})",
           std::string(100000, '[')})
    CHECK_FALSE(contract::parse_stop_estimate(bad).has_value());
}

TEST_CASE("term-grace auto covers the step and its checkpoint, with margin, at least 15 s",
          "[unit]") {
  // The issue's case: steps of ~28 s, a checkpoint of ~30 s; the old fixed 15 s killed them.
  StopWait w = stop_wait(std::nullopt, {rank_at(0, 6, 28, 30, 4), rank_at(1, 6, 27, 29, -1)},
                         /*checkpointing=*/true);
  CHECK(w.needed_s == 78);  // ceil((28 + 30) x 1.25 + 5)
  CHECK(w.seconds == 78);
  CHECK(w.step == 7);
  CHECK(w.committed_step == 4);
  CHECK_FALSE(w.too_short());
  CHECK(stop_wait_text(w) ==
        "waiting up to 78 s for the workers to finish step 7 (~28 s a step) and save its "
        "checkpoint (~30 s, measured), then SIGKILL (--term-grace auto)");
  CHECK(too_short_text(w).empty());

  // Short steps: the floor.
  w = stop_wait(std::nullopt, {rank_at(0, 2, 1.5, 2, -1, /*measured=*/false)}, true);
  CHECK(w.seconds == kMinTermGrace);
  CHECK_THAT(stop_wait_text(w), Contains("(~1.5 s a step) and save its checkpoint (~2.0 s, "
                                         "estimated)"));
  // Before the first step ends its time is not known; the checkpoint's is.
  w = stop_wait(std::nullopt, {rank_at(0, 0, 0, 40, -1, false)}, true);
  CHECK(w.seconds == 55);
  CHECK_THAT(stop_wait_text(w), Contains("finish step 1 (its time not measured yet)"));
  // A failure: no checkpoint can come (it needs every rank), so no longer wait than the floor.
  CHECK(stop_wait(std::nullopt, {rank_at(0, 6, 28, 30, 4)}, false).seconds == kMinTermGrace);
  // A program that publishes nothing.
  w = stop_wait(std::nullopt, {}, true);
  CHECK(w.seconds == kMinTermGrace);
  CHECK_FALSE(w.known);
  CHECK(stop_wait_text(w) ==
        "waiting up to 15 s for the workers to exit, then SIGKILL (--term-grace auto)");
}

TEST_CASE("an explicit --term-grace is kept, and one too short says what it will cost", "[unit]") {
  StopWait w = stop_wait(5.0, {rank_at(0, 6, 28, 30, 4)}, true);
  CHECK(w.seconds == 5);
  CHECK(w.too_short());
  CHECK(too_short_text(w) ==
        "warning: --term-grace 5.0 s is shorter than the ~78 s the workers need to finish step 7 "
        "(~28 s a step) and save its checkpoint (~30 s, measured): they will likely be killed "
        "before it commits, losing 2 step(s) since the checkpoint of step 4; --term-grace 78 (or "
        "auto) would cover it");
  w = stop_wait(5.0, {rank_at(0, 6, 2, 1, -1)}, true);
  CHECK_THAT(too_short_text(w), Contains("losing the whole run (no checkpoint of it is committed"));
  // Long enough: nothing to say; and a number is kept even when it is longer than needed.
  w = stop_wait(120.0, {rank_at(0, 6, 28, 30, 4)}, true);
  CHECK(w.seconds == 120);
  CHECK(too_short_text(w).empty());
  CHECK_THAT(stop_wait_text(w), Contains("waiting up to 120 s") && Contains("(--term-grace)"));
}

TEST_CASE("a kill before the checkpoint committed says what was lost and what would have saved it",
          "[unit]") {
  const StopWait w = stop_wait(5.0, {rank_at(0, 6, 28, 30, 4)}, true);
  // Read again at the kill: step 7 finished meanwhile, its checkpoint not committed.
  CHECK(lost_text(w, {0, 1}, {rank_at(0, 7, 28, 30, 4)}, false) ==
        "ranks 0, 1 did not exit within 5.0 s of SIGTERM and got SIGKILL before their checkpoint "
        "committed: lost 3 step(s) since the checkpoint of step 4; the next start continues from "
        "step 4; --term-grace 78 would have given them time to finish step 7 (~28 s a step) and "
        "save its checkpoint (~30 s, measured) (and SLURM's KillWait or --signal must allow as "
        "much: docs/launcher.md#slurm-time-limits-and-scancel)");
  // No checkpoint at all: the whole run.
  const StopWait none = stop_wait(5.0, {rank_at(0, 6, 28, 30, -1)}, true);
  CHECK_THAT(lost_text(none, {0}, {}, false),
             Contains("rank 0 did not exit") &&
                 Contains("lost the whole run (no checkpoint of it is committed yet); the next "
                          "start begins over"));
  // Killed after the checkpoint committed: nothing lost.
  CHECK_THAT(lost_text(w, {0}, {rank_at(0, 7, 28, 30, 7)}, false),
             Contains("after the checkpoint of step 7 committed: nothing was lost"));
  // A second signal: no advice about --term-grace.
  const std::string cut = lost_text(w, {0}, {}, true);
  CHECK_THAT(cut, Contains("rank 0 killed (SIGKILL) on a second signal before its checkpoint "
                           "committed: lost 2 step(s)"));
  CHECK(cut.find("--term-grace") == std::string::npos);
  // An auto wait that ran out: the estimate fell short, twice as long is asked for.
  const StopWait automatic = stop_wait(std::nullopt, {rank_at(0, 6, 28, 30, 4)}, true);
  CHECK_THAT(lost_text(automatic, {0}, {}, false),
             Contains("did not exit within 78 s") && Contains("--term-grace 156 would have"));
  // A program that publishes nothing: only who was killed.
  CHECK(lost_text(stop_wait(1.0, {}, true), {1}, {}, false) ==
        "rank 1 did not exit within 1.0 s of SIGTERM and got SIGKILL");
}
