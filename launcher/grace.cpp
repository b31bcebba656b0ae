#include "grace.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

namespace ft::launcher {

namespace {

// "28 s", "2.5 s": whole seconds once they are many.
std::string secs(double s) {
  return s >= 10 ? fmt::format("{:.0f} s", s) : fmt::format("{:.1f} s", s);
}

std::string ranks_text(const std::vector<int>& ranks) {
  return fmt::format("{} {}", ranks.size() == 1 ? "rank" : "ranks", fmt::join(ranks, ", "));
}

// The step and checkpoint, as the messages name them.
std::string work_text(const StopWait& w) {
  const std::string step = w.step_s > 0 ? fmt::format("~{} a step", secs(w.step_s))
                                        : std::string("its time not measured yet");
  return fmt::format("finish step {} ({}) and save its checkpoint (~{}, {})", w.step, step,
                     secs(w.save_s), w.save_measured ? "measured" : "estimated");
}

// What a kill before the checkpoint loses, with the newest committed checkpoint `committed` and
// the last finished step `done`.
std::string loss_text(int64_t committed, int64_t done) {
  if (committed < 0) return "the whole run (no checkpoint of it is committed yet)";
  const int64_t n = done - committed;
  if (n <= 0) return fmt::format("the step in progress (the checkpoint of step {})", committed);
  return fmt::format("{} step(s) since the checkpoint of step {}", n, committed);
}

}  // namespace

StopWait stop_wait(std::optional<double> term_grace_s, const std::vector<RankEstimate>& ranks,
                   bool checkpointing) {
  StopWait w;
  w.given = term_grace_s.has_value();
  w.known = !ranks.empty();
  w.save_measured = w.known;
  // The ranks step together (every step ends in a collective): the slowest decides.
  for (const RankEstimate& r : ranks) {
    const contract::StopEstimate& e = r.estimate;
    w.step = std::max(w.step, e.step + 1);
    w.step_s = std::max(w.step_s, e.step_s);
    w.save_s = std::max(w.save_s, e.save_s);
    w.save_measured = w.save_measured && e.save_measured;
    w.committed_step = std::max(w.committed_step, e.committed_step);
  }
  if (w.known) w.needed_s = std::ceil((w.step_s + w.save_s) * kGraceFactor + kGraceSlack_s);
  if (w.given)
    w.seconds = *term_grace_s;
  else if (checkpointing && w.known)
    w.seconds = std::max(kMinTermGrace, w.needed_s);
  return w;
}

std::string stop_wait_text(const StopWait& w) {
  const std::string grace = w.given ? "--term-grace" : "--term-grace auto";
  // A program that publishes no estimate (not ft train): nothing more to say.
  if (!w.known)
    return fmt::format("waiting up to {} for the workers to exit, then SIGKILL ({})",
                       secs(w.seconds), grace);
  return fmt::format("waiting up to {} for the workers to {}, then SIGKILL ({})", secs(w.seconds),
                     work_text(w), grace);
}

std::string too_short_text(const StopWait& w) {
  if (!w.too_short()) return "";
  return fmt::format(
      "warning: --term-grace {} is shorter than the ~{} the workers need to {}: they will likely "
      "be killed before it commits, losing {}; --term-grace {:.0f} (or auto) would cover it",
      secs(w.seconds), secs(w.needed_s), work_text(w), loss_text(w.committed_step, w.step - 1),
      w.needed_s);
}

std::string lost_text(const StopWait& w, const std::vector<int>& killed,
                      const std::vector<RankEstimate>& now, bool cut_short) {
  const std::string who =
      cut_short ? fmt::format("{} killed (SIGKILL) on a second signal", ranks_text(killed))
                : fmt::format("{} did not exit within {} of SIGTERM and got SIGKILL",
                              ranks_text(killed), secs(w.seconds));
  if (!w.known && now.empty()) return who;
  // Read again at the kill: a checkpoint may have committed meanwhile.
  int64_t committed = w.committed_step, done = w.step - 1;
  for (const RankEstimate& r : now) {
    committed = std::max(committed, r.estimate.committed_step);
    done = std::max(done, r.estimate.step);
  }
  if (committed >= 0 && committed >= done)
    return fmt::format(
        "{}, after the checkpoint of step {} committed: nothing was lost; the next "
        "start continues from it",
        who, committed);
  std::string text =
      fmt::format("{} before {} checkpoint committed: lost {}; the next start {}", who,
                  killed.size() == 1 ? "its" : "their", loss_text(committed, done),
                  committed < 0 ? "begins over" : fmt::format("continues from step {}", committed));
  if (cut_short || !w.known) return text;
  // An auto wait that ran out was an estimate that fell short: ask for twice as long.
  const double would =
      w.given ? std::max(w.needed_s, std::ceil(w.seconds) + 1) : std::ceil(2 * w.seconds);
  return text + fmt::format(
                    "; --term-grace {:.0f} would have given them time to {} (and SLURM's "
                    "KillWait or --signal must allow as much: "
                    "docs/launcher.md#slurm-time-limits-and-scancel)",
                    would, work_text(w));
}

}  // namespace ft::launcher
