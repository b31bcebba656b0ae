// A run directory holding a run, given a command with other settings (issue 51): changes of what
// the run computes are refused before anything is loaded or written, free ones are said and go
// on, --resume-changed continues on purpose and is recorded, a finished run is not trained again.
// Real ft train and ft launch processes, real directories.
#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "support/runs.h"
#include "support/subprocess.h"

using namespace ft::test;
namespace fs = std::filesystem;

namespace {

// Every file under `dir` with its bytes: a directory equal before and after was not written.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) out[fs::relative(e.path(), dir).string()] = read_file(e.path());
  return out;
}

// tiny-lora's model, small enough to run many times.
std::vector<std::string> lora_argv(const std::string& out, const std::vector<std::string>& sets) {
  return ft_train_argv({"--preset", "tiny-lora", "--output", out},
                       with({"model.hidden_size=64", "model.intermediate_size=176",
                             "data.seq_len=64", "train.micro_batch=2", "train.log_every=100"},
                            sets));
}

Finished train(const std::vector<std::string>& argv, const std::string& log) {
  return run_to_end(argv, {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}}, log, 120);
}

std::vector<nlohmann::json> events_named(const std::string& out, const std::string& name) {
  std::vector<nlohmann::json> found;
  for (const auto& e : read_jsonl(out + "/events.jsonl"))
    if (e.value("event", "") == name) found.push_back(e);
  return found;
}

}  // namespace

TEST_CASE("a changed LoRA shape is refused with its diff, never taken for damage", "[multiproc]") {
  const std::string dir = make_temp_dir(), out = dir + "/run";
  Finished a = train(lora_argv(out, {"lora.r=16", "train.max_steps=8", "output.save_every=4"}),
                     dir + "/a.log");
  INFO(output_tail(a.output));
  REQUIRE(a.code == 0);
  const auto before = snapshot(out);
  REQUIRE(before.count("checkpoints/step-000000008/meta.json") == 1);
  REQUIRE(before.count("run.json") == 1);

  Finished b = train(lora_argv(out, {"lora.r=8", "train.max_steps=8", "output.save_every=4"}),
                     dir + "/b.log");
  INFO(output_tail(b.output));
  CHECK(b.code == 2);
  CHECK_THAT(b.output, Catch::Contains("holds a run with other settings") &&
                           Catch::Contains("lora.r 16 -> 8") &&
                           Catch::Contains("[the saved state has another shape]") &&
                           Catch::Contains("another --output") &&
                           Catch::Contains("--set lora.r=16") &&
                           Catch::Contains("--resume-changed cannot continue it"));
  CHECK_THAT(b.output, !Catch::Contains("damaged") && !Catch::Contains("unusable") &&
                           !Catch::Contains("starting from the beginning"));
  // --resume-changed cannot load tensors of another shape either.
  auto forced = lora_argv(out, {"lora.r=8", "train.max_steps=8", "output.save_every=4"});
  forced.push_back("--resume-changed");
  Finished c = train(forced, dir + "/c.log");
  CHECK(c.code == 2);
  CHECK_THAT(c.output, Catch::Contains("--resume-changed cannot continue it"));
  CHECK(snapshot(out) == before);

  // A checkpoint of another LoRA shape named with --resume (into a new directory) is refused as
  // such on every rank, not passed over as damage.
  Finished d = train(with(lora_argv(dir + "/other", {"lora.r=8", "train.max_steps=12"}),
                          {"--resume", out + "/checkpoints/step-000000008"}),
                     dir + "/d.log");
  INFO(output_tail(d.output));
  CHECK(d.code == 2);
  CHECK_THAT(d.output, Catch::Contains("a checkpoint of another model or LoRA shape") &&
                           Catch::Contains("it is not damaged"));
  CHECK_FALSE(fs::exists(dir + "/other/events.jsonl"));
  CHECK(snapshot(out) == before);
}

TEST_CASE(
    "a finished run is not trained again, a longer one continues, other settings need "
    "--resume-changed, which is recorded",
    "[multiproc]") {
  const std::string dir = make_temp_dir(), out = dir + "/run";
  const std::vector<std::string> base = {"train.max_steps=4", "output.save_every=2"};
  Finished a = train(lora_argv(out, base), dir + "/a.log");
  INFO(output_tail(a.output));
  REQUIRE(a.code == 0);
  const auto finished = snapshot(out);

  // The same command, and a shorter one: nothing to do, nothing written.
  for (const char* steps : {"train.max_steps=4", "train.max_steps=3"}) {
    Finished again = train(lora_argv(out, {steps, "output.save_every=2"}), dir + "/again.log");
    INFO(output_tail(again.output));
    CHECK(again.code == 0);
    CHECK_THAT(again.output,
               Catch::Contains("already finished at step 4") && Catch::Contains("nothing to do"));
    CHECK(snapshot(out) == finished);
  }

  // A changed learning rate with a longer run: refused with the diff and every way on.
  Finished lr = train(lora_argv(out, {"train.max_steps=6", "output.save_every=2", "train.lr=1e-3"}),
                      dir + "/lr.log");
  INFO(output_tail(lr.output));
  CHECK(lr.code == 2);
  CHECK_THAT(lr.output, Catch::Contains("train.lr 0.002 -> 0.001") &&
                            Catch::Contains("nothing was loaded or written") &&
                            Catch::Contains("another --output DIR") &&
                            Catch::Contains("--set train.lr=0.002") &&
                            Catch::Contains("add --resume-changed"));
  CHECK_THAT(lr.output, !Catch::Contains("train.max_steps 4 -> 6"));  // free: not in the refusal
  CHECK(snapshot(out) == finished);

  // A longer run with a changed cadence: free, said in one line, continued from step 4.
  Finished longer =
      train(lora_argv(out, {"train.max_steps=6", "output.save_every=3"}), dir + "/longer.log");
  INFO(output_tail(longer.output));
  REQUIRE(longer.code == 0);
  CHECK_THAT(longer.output, Catch::Contains("changed since it last started") &&
                                Catch::Contains("train.max_steps 4 -> 6") &&
                                Catch::Contains("output.save_every 2 -> 3"));
  CHECK_THAT(longer.output, Catch::Contains("steps 5-6 (2 in this process, resumed after step 4)"));
  REQUIRE(read_metrics(out).size() == 6);
  auto changed = events_named(out, "settings_changed");
  REQUIRE(changed.size() == 1);
  CHECK(changed[0]["resume_changed"] == false);

  // On purpose: --resume-changed continues with the new learning rate and records it.
  auto forced = lora_argv(out, {"train.max_steps=8", "output.save_every=3", "train.lr=1e-3"});
  forced.push_back("--resume-changed");
  Finished f = train(forced, dir + "/forced.log");
  INFO(output_tail(f.output));
  REQUIRE(f.code == 0);
  CHECK_THAT(f.output, Catch::Contains("--resume-changed: recorded in events.jsonl"));
  const auto m = read_metrics(out);
  REQUIRE(m.size() == 8);
  changed = events_named(out, "settings_changed");
  REQUIRE(changed.size() == 2);
  CHECK(changed[1]["resume_changed"] == true);
  bool lr_recorded = false;
  for (const auto& c : changed[1]["changes"])
    lr_recorded = lr_recorded || (c["key"] == "train.lr" && c["effect"] == "computes" &&
                                  c["was"] == 0.002 && c["now"] == 0.001);
  CHECK(lr_recorded);
  CHECK_THAT(read_file(out + "/report.html"),
             Catch::Contains("settings changed") && Catch::Contains("with --resume-changed"));
  // --resume none on a directory that holds a run says so.
  Finished none =
      train(with(lora_argv(out, {"train.max_steps=8", "output.save_every=3", "train.lr=1e-3"}),
                 {"--resume", "none"}),
            dir + "/none.log");
  CHECK(none.code == 2);
  CHECK_THAT(none.output, Catch::Contains("--resume none starts afresh") &&
                              Catch::Contains("already holds a run"));
}

TEST_CASE("the global batch decides whether other ranks may continue a run, under ft launch too",
          "[multiproc]") {
  const std::string dir = make_temp_dir(), out = dir + "/run";
  // One rank, 2 sequences per micro-batch, 2 micro-batches: 4 sequences per step.
  Finished a =
      train(lora_argv(out, {"train.max_steps=2", "output.save_every=2", "train.grad_accum=2"}),
            dir + "/a.log");
  INFO(output_tail(a.output));
  REQUIRE(a.code == 0);
  const auto before = snapshot(out);

  // Two nodes of one rank each, with the same micro-batch: 2 x 2 x 2 = 8, refused by each node's
  // launcher before the rendezvous.
  const int port = free_port();
  auto node = [&](int rank, const std::vector<std::string>& sets) {
    std::vector<std::string> argv = {ft_bin(),           "launch",
                                     "--nnodes",         "2",
                                     "--node-rank",      std::to_string(rank),
                                     "--nproc-per-node", "1",
                                     "--master-addr",    "127.0.0.1",
                                     "--master-port",    std::to_string(port),
                                     "--rdzv-timeout",   "20",
                                     "--preset",         "tiny-lora",
                                     "--output",         out};
    for (const auto& s :
         with({"model.hidden_size=64", "model.intermediate_size=176", "data.seq_len=64",
               "train.micro_batch=2", "train.log_every=100", "output.save_every=2"},
              sets))
      argv.insert(argv.end(), {"--set", s});
    return argv;
  };
  Child n0 = start(node(0, {"train.max_steps=4", "train.grad_accum=2"}), {}, dir + "/n0.log");
  Child n1 = start(node(1, {"train.max_steps=4", "train.grad_accum=2"}), {}, dir + "/n1.log");
  CHECK(wait_for(n0, 60) == 2);
  CHECK(wait_for(n1, 60) == 2);
  for (Child* c : {&n0, &n1}) {
    INFO(output_tail(c->output()));
    CHECK_THAT(c->output(), Catch::Contains("global batch 2 x 2 x 1 = 4 -> 2 x 2 x 2 = 8"));
  }
  CHECK(snapshot(out) == before);

  // grad_accum halved keeps 4 sequences a step: the two nodes continue the run, and say why.
  Child m0 = start(node(0, {"train.max_steps=4", "train.grad_accum=1"}), {}, dir + "/m0.log");
  Child m1 = start(node(1, {"train.max_steps=4", "train.grad_accum=1"}), {}, dir + "/m1.log");
  CHECK(wait_for(m0, 120) == 0);
  CHECK(wait_for(m1, 120) == 0);
  INFO(output_tail(m0.output()));
  CHECK_THAT(m0.output(), Catch::Contains("the global batch stays 4 sequences"));
  CHECK(read_metrics(out).size() == 4);
}
