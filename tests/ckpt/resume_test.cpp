// Resuming from checkpoints with real `ft train` processes: killed with SIGKILL at a random step
// and restarted, a run ends bit-identical to an uninterrupted one; a checkpoint saved under one
// strategy and world size continues under others; a damaged newest checkpoint is named and the
// previous one used.
#include "support/catch_torch.h"
// (catch_torch.h first: c10 defines a CHECK macro of its own)
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "io/safetensors.h"
#include "support/numerics.h"
#include "support/runs.h"
#include "support/subprocess.h"

namespace fs = std::filesystem;
using nlohmann::json;
using namespace ft::test;

namespace {

// The job tests' small model (runs.h), 12 steps, a checkpoint every 4.
const std::vector<std::string> kBase =
    with(small_run_sets(), {"train.max_steps=12", "output.save_every=4", "output.keep_last=3"});

// `ft train --preset tiny-demo --output OUT` with the base settings, then `sets`; under
// `ft launch --nproc-per-node N` when N > 1.
std::vector<std::string> train_argv(int nproc, const std::string& out,
                                    const std::vector<std::string>& sets) {
  return tiny_job_argv(nproc, out, with(kBase, sets));
}

Finished run(const std::vector<std::string>& argv) {
  return run_to_end(argv, {}, make_temp_dir() + "/out.txt", 150);
}

std::vector<std::string> with_resume(std::vector<std::string> argv, const std::string& dir) {
  argv.insert(argv.end(), {"--resume", dir});
  return argv;
}

bool same_file(const std::string& a, const std::string& b) { return read_file(a) == read_file(b); }

// `argv` (12 steps, a checkpoint every 4) run to the end, then for each of `seeds` killed with
// SIGKILL after a random number of logged steps and restarted with the same command: the final
// weights are the same bytes and metrics.jsonl holds each step once with the same loss.
void check_killed_runs_resume(
    const std::function<std::vector<std::string>(const std::string&)>& argv,
    const std::vector<unsigned>& seeds, const std::string& weights = "model.safetensors") {
  const std::string ref = make_temp_dir() + "/ref";
  Finished r = run(argv(ref));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  REQUIRE(read_metrics(ref).size() == 12);
  for (unsigned seed : seeds) {
    std::mt19937 gen(seed);
    const size_t kill_after = 1 + gen() % 10;  // steps logged before the kill
    INFO("seed " << seed << ": SIGKILL after " << kill_after << " steps");
    const std::string out = make_temp_dir() + "/run";
    Child c = start(argv(out), {}, make_temp_dir() + "/out.txt");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    wait_for_steps(out, kill_after, deadline);
    ::kill(c.pid, SIGKILL);
    REQUIRE(wait_for(c, 30).value_or(-1) == 128 + SIGKILL);
    // Whether a checkpoint was committed before the kill: the save of step 4 is written in the
    // background and may still be in flight a few steps later. The commit is the rename of
    // .tmp-step-N (meta.json and all) to step-N, so a temporary directory that already holds its
    // meta.json is not committed.
    bool committed = false;
    if (fs::exists(out + "/checkpoints"))
      for (const auto& d : fs::directory_iterator(out + "/checkpoints"))
        committed = committed || (d.path().filename().string().rfind("step-", 0) == 0 &&
                                  fs::exists(d.path() / "meta.json"));
    // Restarted with the same command: it continues from its newest committed checkpoint.
    Finished again = run(argv(out));
    INFO(output_tail(again.output));
    REQUIRE(again.code == 0);
    if (committed) CHECK_THAT(again.output, Catch::Contains("resuming from"));
    CHECK(same_file(ref + "/final/" + weights, out + "/final/" + weights));
    // metrics.jsonl holds each step once, with the uninterrupted run's losses.
    auto a = read_metrics(ref), b = read_metrics(out);
    REQUIRE(b.size() == a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(b[i]["step"] == a[i]["step"]);
      CHECK(b[i]["loss"] == a[i]["loss"]);
    }
  }
}

}  // namespace

TEST_CASE("a run killed with SIGKILL at a random step resumes bit-identical", "[multiproc]") {
  check_killed_runs_resume([](const std::string& out) { return train_argv(1, out, {}); },
                           {1u, 2u, 3u});
}

// Gemma 3 (the model_test fixture, FAMILIES.md: sandwich norms, (1 + w) q/k norms, windows of 5 on
// 3 of its 4 layers with a local rotary theta, tied head, pad row 0), its own weights loaded with
// --model, on the synthetic task (vocab 96) with sequences of 64 tokens: the windows are active.
TEST_CASE("a Gemma 3 run killed with SIGKILL at a random step resumes bit-identical",
          "[multiproc]") {
  const std::string model = std::string(FT_TEST_DIR) + "/model/fixtures/gemma3_local_global";
  const std::vector<std::string> sets = {
      "precision.mode=fp32",  "data.seq_len=64",     "train.lr=1e-3",
      "train.warmup_steps=2", "train.log_every=100", "train.eps=1e-6",
      "train.max_steps=12",   "output.save_every=4", "output.keep_last=3"};
  check_killed_runs_resume(
      [&](const std::string& out) {
        return ft_train_argv({"--preset", "tiny-demo", "--model", model, "--output", out}, sets);
      },
      {2u});  // killed after 9 steps: past the checkpoint of step 4 (and perhaps 8)
}

// QLoRA (issue 33): LoRA on the NF4 base transformers + bitsandbytes saved
// (tests/model/fixtures/qlora), 2 ranks under zero3 with the packed weights sharded; the launcher
// killed with SIGKILL and the job started again continues to the same adapter bytes.
TEST_CASE("a QLoRA run on 2 ranks killed with SIGKILL resumes bit-identical", "[multiproc]") {
  const std::string model = std::string(FT_TEST_DIR) + "/model/fixtures/qlora/llama_nf4";
  const std::vector<std::string> sets = {"precision.mode=fp32",
                                         "data.seq_len=32",
                                         "train.lr=3e-3",
                                         "train.warmup_steps=2",
                                         "train.log_every=100",
                                         "train.eps=1e-6",
                                         "train.max_steps=12",
                                         "output.save_every=4",
                                         "output.keep_last=3",
                                         "lora.enabled=true",
                                         "lora.r=4",
                                         "lora.dropout=0",
                                         "train.micro_batch=2",
                                         "strategy.kind=zero3",
                                         "strategy.zero3.param_persistence_threshold=0"};
  check_killed_runs_resume(
      [&](const std::string& out) {
        return ft_launch_argv(
            {"--nproc-per-node", "2", "--master-port", std::to_string(free_port())},
            ft_train_argv({"--preset", "tiny-lora", "--model", model, "--output", out}, sets));
      },
      {3u}, "adapter_model.safetensors");
}

TEST_CASE("SIGTERM to the launcher: every rank checkpoints, exit 75, the same command continues",
          "[multiproc]") {
  const std::vector<std::string> fsdp = {"strategy.kind=fsdp", "train.micro_batch=4",
                                         "output.save_every=0", "train.max_steps=40"};
  const std::string ref = make_temp_dir() + "/ref";
  Finished r = run(train_argv(2, ref, fsdp));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  const std::string out = make_temp_dir() + "/run";
  const std::vector<std::string> argv = train_argv(2, out, fsdp);
  Child c = start(argv, {}, make_temp_dir() + "/out.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  wait_for_steps(out, 5, deadline);
  ::kill(c.pid, SIGTERM);
  const int code = wait_for(c, 60).value_or(-1);
  INFO(output_tail(c.output()));
  REQUIRE(code == 75);
  CHECK_THAT(c.output(), Catch::Contains("stopped after step") &&
                             Catch::Contains("every worker saved a checkpoint"));
  const size_t done = read_metrics(out).size();
  CHECK(done >= 5);
  CHECK(done < 40);
  CHECK(read_file(out + "/checkpoints/latest") ==
        "step-" + std::string(9 - std::to_string(done).size(), '0') + std::to_string(done) + "\n");
  CHECK_FALSE(fs::exists(out + "/final"));
  // Nothing of the job is left running.
  for (pid_t pid : {c.pid}) CHECK_FALSE(pid_alive(pid));
  Finished again = run(argv);
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK(same_file(ref + "/final/model.safetensors", out + "/final/model.safetensors"));
}

TEST_CASE(
    "SIGINT to the launcher: the workers say SIGINT, the step they announce is the one they save, "
    "and no empty line",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  // Rank 0 sleeps 0.2 s a step, so that the signal comes mid-run, often between two steps.
  Child c = start(train_argv(2, out, {"output.save_every=0", "train.max_steps=200"}),
                  {{"FT_FAULT_STEP_DELAY", "0:0.2"}}, make_temp_dir() + "/out.txt");
  wait_for_steps(out, 3, std::chrono::steady_clock::now() + std::chrono::seconds(120));
  ::kill(c.pid, SIGINT);
  const int code = wait_for(c, 60).value_or(-1);
  const std::string text = c.output();
  INFO(output_tail(text));
  REQUIRE(code == 75);
  CHECK_THAT(text, Catch::Contains("ft train: SIGINT: finishing step") &&
                       Catch::Contains("on SIGINT; checkpoint written"));
  CHECK_THAT(text, !Catch::Contains("ft train: SIGTERM"));
  const auto announced = lines_with(text, "SIGINT: finishing step ");
  const auto saved = lines_with(text, "stopped after step ");
  REQUIRE(announced.size() == 1);
  REQUIRE(saved.size() >= 1);
  const auto number_after = [](const std::string& line, const std::string& what) {
    return std::stoi(line.substr(line.find(what) + what.size()));
  };
  CHECK(number_after(announced[0], "finishing step ") ==
        number_after(saved[0], "stopped after step "));
  for (const auto& line : lines_with(text, "[node 0 rank "))
    CHECK(line.find("] ", line.find("[node 0 rank ")) + 2 < line.size());  // never empty
}

TEST_CASE(
    "two launchers x 2: a node that stops answering is detected by heartbeat, rejoins, "
    "and the job finishes from the checkpoint",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const int port = free_port();
  auto launcher = [&](int node) {
    return ft_launch_argv({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port", std::to_string(port),
                           "--max-restarts", "2", "--heartbeat-timeout", "3", "--term-grace", "3"},
                          ft_train_argv({"--preset", "tiny-demo", "--output", out},
                                        with(kBase, {"train.max_steps=30", "output.save_every=3",
                                                     "train.micro_batch=2"})));
  };
  Child n0 = start(launcher(0), {}, make_temp_dir() + "/n0.txt");
  Child n1 = start(launcher(1), {}, make_temp_dir() + "/n1.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  wait_for_steps(out, 8, deadline);
  REQUIRE(read_metrics(out).size() >= 8);
  // Node 1 stops answering (a hung machine: no connection is reset): launcher and workers frozen.
  std::vector<pid_t> node1 = children_of(n1.pid);
  REQUIRE(node1.size() == 2);
  node1.push_back(n1.pid);
  for (pid_t p : node1) ::kill(p, SIGSTOP);
  const auto frozen = std::chrono::steady_clock::now();
  while (n0.output().find("sent no heartbeat") == std::string::npos &&
         std::chrono::steady_clock::now() - frozen < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double detected =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - frozen).count();
  INFO(output_tail(n0.output()));
  CHECK_THAT(n0.output(), Catch::Contains("node 1") && Catch::Contains("sent no heartbeat"));
  // Within --heartbeat-timeout of the freeze (the last beat came before it), with 0.3 s for this
  // test's polling and the log line's way here; the message gives the silence it measured.
  CHECK(detected < 3 + 0.3);
  CHECK_THAT(n0.output(), Catch::Contains("(--heartbeat-timeout 3.0)"));
  // The machine is gone for good: its processes die; the same command starts it again.
  for (pid_t p : node1) ::kill(p, SIGKILL);
  CHECK(wait_for(n1, 30).has_value());
  const size_t before = read_metrics(out).size();
  Child again = start(launcher(1), {}, make_temp_dir() + "/n1b.txt");
  auto rc0 = wait_for(n0, 150), rc1 = wait_for(again, 150);
  INFO(output_tail(again.output()));
  if (!rc0) kill_and_reap(n0);
  if (!rc1) kill_and_reap(again);
  REQUIRE(rc0.value_or(-1) == 0);
  REQUIRE(rc1.value_or(-1) == 0);
  CHECK_THAT(again.output(), Catch::Contains("joining it at round 1"));
  CHECK_THAT(n0.output(), Catch::Contains("resuming from"));
  // Every step once; at most one checkpoint interval (3 steps) was redone.
  auto m = read_metrics(out);
  REQUIRE(m.size() == 30);
  for (size_t i = 0; i < m.size(); ++i) CHECK(m[i]["step"] == static_cast<int>(i + 1));
  const std::string resumed = n0.output().substr(n0.output().find("resuming from"));
  const int from = std::stoi(resumed.substr(resumed.find("(step ") + 6));
  CHECK(from + 3 >= static_cast<int>(before));
  // Nothing of node 1's first incarnation is left.
  for (pid_t p : node1) CHECK_FALSE(pid_alive(p));
}

TEST_CASE(
    "two launchers x 2: node 1's launcher killed, node 0 blames node 1, not its own ranks, "
    "its workers exit tidily with 76, and the next round names the node it waits for",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const int port = free_port();
  auto launcher = [&](int node) {
    return ft_launch_argv(
        {"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", std::to_string(port), "--max-restarts", "1",
         "--heartbeat-timeout", "3", "--term-grace", "3", "--rdzv-timeout", "7"},
        ft_train_argv(
            {"--preset", "tiny-demo", "--output", out},
            with(kBase, {"train.max_steps=400", "output.save_every=0", "train.micro_batch=2"})));
  };
  Child n0 = start(launcher(0), {}, make_temp_dir() + "/n0.txt");
  Child n1 = start(launcher(1), {}, make_temp_dir() + "/n1.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  wait_for_steps(out, 3, deadline);
  REQUIRE(read_metrics(out).size() >= 3);
  // The machine of node 1 is gone at once: its launcher dies, its workers with it (their sockets
  // close, so node 0's workers see the connection reset before any heartbeat is missed).
  const auto killed = std::chrono::steady_clock::now();
  ::kill(n1.pid, SIGKILL);
  REQUIRE(wait_for(n1, 30).has_value());
  while (n0.output().find("job stopped: node 1") == std::string::npos &&
         std::chrono::steady_clock::now() - killed < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count();
  const auto rc = wait_for(n0, 60);
  if (!rc) kill_and_reap(n0);
  const std::string o = n0.output();
  INFO(o);
  // Restarted without node 1, which never comes back: the new round's rendezvous says whom it
  // waits for while it waits, then times out.
  REQUIRE(rc.value_or(-1) == 3);
  CHECK_THAT(o, Catch::Contains("round 1: waiting for nodes to join: 1/2 nodes joined (missing "
                                "node_rank 1)"));
  // The survivors' workers said what happened and exited with the documented code.
  CHECK_THAT(o, Catch::Contains("lost the connection to another rank"));
  CHECK_THAT(o, Catch::Contains("lost its connection to another rank (exited with code 76)"));
  CHECK_THAT(o, !Catch::Contains("terminate called") && !Catch::Contains("SIGPIPE") &&
                    !Catch::Contains("SIGABRT"));
  // The summary blames node 1 and says what followed on node 0.
  CHECK_THAT(o, Catch::Contains("job stopped: node 1 (") && Catch::Contains("was lost"));
  CHECK_THAT(o, Catch::Contains("then lost its connection to it"));
  CHECK_THAT(o, !Catch::Contains("first failure on node 0"));
  // Blamed within the heartbeat timeout of the kill (with 0.5 s for this test's polling).
  CHECK(took < 3 + 0.5);
}

TEST_CASE(
    "one node x 2: a worker killed with SIGKILL is blamed, not the rank that lost its "
    "connection to it",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  Child c = start(
      ft_launch_argv({"--nproc-per-node", "2", "--master-port", std::to_string(free_port()),
                      "--max-restarts", "0", "--term-grace", "3"},
                     ft_train_argv({"--preset", "tiny-demo", "--output", out},
                                   with(kBase, {"train.max_steps=400", "output.save_every=0"}))),
      {}, make_temp_dir() + "/out.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  wait_for_steps(out, 3, deadline);
  REQUIRE(read_metrics(out).size() >= 3);
  std::vector<pid_t> workers = children_of(c.pid);
  REQUIRE(workers.size() == 2);
  // Rank 1: the worker whose environment says RANK=1.
  const pid_t rank1 = rank_of_worker(workers[0]) == 1 ? workers[0] : workers[1];
  REQUIRE(rank_of_worker(rank1) == 1);
  ::kill(rank1, SIGKILL);
  const auto rc = wait_for(c, 60);
  if (!rc) kill_and_reap(c);
  INFO(output_tail(c.output()));
  REQUIRE(rc.value_or(-1) == 1);
  CHECK_THAT(c.output(), Catch::Contains("first failure on node 0 (") &&
                             Catch::Contains("rank 1 (local rank 1): worker was killed by signal "
                                             "9 (SIGKILL)"));
  CHECK_THAT(c.output(), !Catch::Contains("terminate called"));
}

TEST_CASE(
    "node 0 (the store host) killed: the other launcher waits, and the job resumes when "
    "node 0 is started again",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const int port = free_port();
  auto launcher = [&](int node) {
    return ft_launch_argv({"--nnodes", "2", "--node-rank", std::to_string(node), "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port", std::to_string(port),
                           "--max-restarts", "2", "--rdzv-timeout", "60", "--term-grace", "3"},
                          ft_train_argv({"--preset", "tiny-demo", "--output", out},
                                        with(kBase, {"train.max_steps=24", "output.save_every=3",
                                                     "train.micro_batch=2"})));
  };
  Child n0 = start(launcher(0), {}, make_temp_dir() + "/n0.txt");
  Child n1 = start(launcher(1), {}, make_temp_dir() + "/n1.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  wait_for_steps(out, 7, deadline);
  REQUIRE(read_metrics(out).size() >= 7);
  ::kill(n0.pid, SIGKILL);  // the store goes with it; so do its workers
  REQUIRE(wait_for(n0, 30).has_value());
  while (n1.output().find("waiting up to") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  INFO(output_tail(n1.output()));
  REQUIRE_THAT(n1.output(), Catch::Contains("lost the rendezvous store"));
  CHECK_FALSE(wait_for(n1, 1).has_value());  // still there, waiting
  Child again = start(launcher(0), {}, make_temp_dir() + "/n0b.txt");
  auto rc0 = wait_for(again, 150), rc1 = wait_for(n1, 150);
  INFO(output_tail(again.output()));
  if (!rc0) kill_and_reap(again);
  if (!rc1) kill_and_reap(n1);
  REQUIRE(rc0.value_or(-1) == 0);
  REQUIRE(rc1.value_or(-1) == 0);
  CHECK_THAT(n1.output(), Catch::Contains("the rendezvous store is back"));
  CHECK_THAT(again.output(), Catch::Contains("resuming from"));
  auto m = read_metrics(out);
  REQUIRE(m.size() == 24);
  for (size_t i = 0; i < m.size(); ++i) CHECK(m[i]["step"] == static_cast<int>(i + 1));
}

TEST_CASE("elastic --nnodes 1:2: after losing a node the job continues on one node, resharded",
          "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const int port = free_port();
  // zero3 on 4 ranks, then 2: the checkpoint's shards are split differently.
  const std::vector<std::string> argv = ft_launch_argv(
      {"--nnodes", "1:2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
       std::to_string(port), "--max-restarts", "2", "--rdzv-last-call", "1", "--heartbeat-timeout",
       "3", "--term-grace", "3"},
      ft_train_argv(
          {"--preset", "tiny-demo", "--output", out},
          with(kBase, {"train.max_steps=24", "output.save_every=3", "train.micro_batch=2",
                       "strategy.kind=zero3", "strategy.zero3.param_persistence_threshold=0"})));
  Child a = start(argv, {}, make_temp_dir() + "/a.txt");
  // The second launcher starts once the first hosts the store, so the host is `a`.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (a.output().find("hosting the rendezvous store") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  Child b = start(argv, {}, make_temp_dir() + "/b.txt");
  wait_for_steps(out, 7, deadline + std::chrono::seconds(60));
  INFO(output_tail(a.output()));
  REQUIRE(read_metrics(out).size() >= 7);
  REQUIRE_THAT(a.output(), Catch::Contains("world size 4"));
  ::kill(b.pid, SIGKILL);  // its workers die with it
  REQUIRE(wait_for(b, 30).has_value());
  auto rc = wait_for(a, 150);
  if (!rc) kill_and_reap(a);
  REQUIRE(rc.value_or(-1) == 0);
  CHECK_THAT(a.output(), Catch::Contains("round 1: 1 node(s) x 2 worker(s), world size 2"));
  CHECK_THAT(a.output(), Catch::Contains("saved by 4 ranks"));
  auto m = read_metrics(out);
  REQUIRE(m.size() == 24);
  for (size_t i = 0; i < m.size(); ++i) CHECK(m[i]["step"] == static_cast<int>(i + 1));
  CHECK(m.back()["loss"].get<double>() < m.front()["loss"].get<double>());
}

TEST_CASE(
    "elastic --nnodes 1:2: a node that comes later is admitted at the next round, "
    "which continues from the checkpoint every rank wrote on SIGTERM",
    "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const int port = free_port();
  // No periodic checkpoint: the only one is the one written when the new round stops the job.
  // fsdp FULL_SHARD on 2 ranks, then on 4: the shards are split differently. Enough steps that
  // the job is still running when the second node has started (a node arriving as the job ends
  // is told so and leaves).
  const std::vector<std::string> argv =
      ft_launch_argv({"--nnodes", "1:2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                      "--master-port", std::to_string(port), "--max-restarts", "0",
                      "--rdzv-last-call", "1", "--heartbeat-timeout", "3", "--term-grace", "20"},
                     ft_train_argv({"--preset", "tiny-demo", "--output", out},
                                   with(kBase, {"train.max_steps=400", "output.save_every=0",
                                                "train.micro_batch=2", "strategy.kind=fsdp"})));
  Child a = start(argv, {}, make_temp_dir() + "/a.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  wait_for_steps(out, 5, deadline);
  INFO(output_tail(a.output()));
  REQUIRE(read_metrics(out).size() >= 5);
  REQUIRE_THAT(a.output(), Catch::Contains("round 0: 1 node(s) x 2 worker(s), world size 2"));
  const size_t before = read_metrics(out).size();
  // The second node arrives while the job runs on one (--max-restarts 0: admitting a node is not
  // a failure and uses no restart).
  Child b = start(argv, {}, make_temp_dir() + "/b.txt");
  auto rca = wait_for(a, 150), rcb = wait_for(b, 150);
  INFO(output_tail(b.output()));
  if (!rca) kill_and_reap(a);
  if (!rcb) kill_and_reap(b);
  REQUIRE(rca.value_or(-1) == 0);
  REQUIRE(rcb.value_or(-1) == 0);
  // Node ranks are assigned at each round's join: rank 0 may now be on either node.
  const std::string both = a.output() + b.output();
  CHECK_THAT(a.output(), Catch::Contains("a node is waiting to join"));
  CHECK_THAT(b.output(), Catch::Contains("the job is running; joining it at round 1"));
  CHECK_THAT(a.output(), Catch::Contains("round 1: 2 node(s) x 2 worker(s), world size 4"));
  CHECK_THAT(both, Catch::Contains("stopped after step") && Catch::Contains("on SIGTERM"));
  REQUIRE_THAT(both, Catch::Contains("saved by 2 ranks"));
  // The round continued from where the job stopped: no step was lost or done twice.
  const std::string resumed = both.substr(both.find("resuming from"));
  const int from = std::stoi(resumed.substr(resumed.find("(step ") + 6));
  CHECK(from >= static_cast<int>(before));
  auto m = read_metrics(out);
  REQUIRE(m.size() == 400);
  for (size_t i = 0; i < m.size(); ++i) CHECK(m[i]["step"] == static_cast<int>(i + 1));
  CHECK(m.back()["loss"].get<double>() < m.front()["loss"].get<double>());
}

TEST_CASE("a hung rank (no progress for --hang-timeout) gets the job restarted from the checkpoint",
          "[multiproc]") {
  const std::string out = make_temp_dir() + "/run";
  const std::vector<std::string> argv = ft_launch_argv(
      {"--nproc-per-node", "2", "--master-port", std::to_string(free_port()), "--max-restarts", "1",
       "--hang-timeout", "3", "--term-grace", "2"},
      ft_train_argv(
          {"--preset", "tiny-demo", "--output", out},
          with(kBase, {"train.max_steps=24", "output.save_every=3", "train.micro_batch=4"})));
  Child c = start(argv, {}, make_temp_dir() + "/out.txt");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  wait_for_steps(out, 7, deadline);
  REQUIRE(read_metrics(out).size() >= 7);
  std::vector<pid_t> workers = children_of(c.pid);
  REQUIRE(workers.size() == 2);
  ::kill(workers[1], SIGSTOP);  // one rank stops; the other blocks in its next collective
  const auto stopped = std::chrono::steady_clock::now();
  while (c.output().find("reported no progress") == std::string::npos &&
         std::chrono::steady_clock::now() - stopped < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const double detected =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped).count();
  auto rc = wait_for(c, 150);
  if (!rc) kill_and_reap(c);
  INFO(output_tail(c.output()));
  CHECK(detected < 3 + 1 + 1);  // the timeout, the last report's age (<= 1 s), the check period
  REQUIRE(rc.value_or(-1) == 0);
  CHECK_THAT(c.output(), Catch::Contains("hung: no progress") &&
                             Catch::Contains("restarting the job") &&
                             Catch::Contains("resuming from"));
  CHECK(read_metrics(out).size() == 24);
  CHECK_FALSE(pid_alive(workers[1]));
}

TEST_CASE("checkpoints move between strategies and world sizes: fsdp x4 -> zero3 x2 -> ddp x1",
          "[multiproc]") {
  const std::string tmp = make_temp_dir();
  // The reference: one rank, 8 sequences per step.
  Finished r = run(train_argv(1, tmp + "/ref", {"train.micro_batch=8"}));
  INFO(output_tail(r.output));
  REQUIRE(r.code == 0);
  Finished a = run(train_argv(4, tmp + "/a", {"strategy.kind=fsdp", "train.micro_batch=2"}));
  INFO(output_tail(a.output));
  REQUIRE(a.code == 0);
  Finished b = run(with_resume(train_argv(2, tmp + "/b",
                                          {"strategy.kind=zero3", "train.micro_batch=4",
                                           "strategy.zero3.param_persistence_threshold=1000"}),
                               tmp + "/a/checkpoints/step-000000004"));
  INFO(output_tail(b.output));
  REQUIRE(b.code == 0);
  CHECK_THAT(b.output, Catch::Contains("saved by 4 ranks"));
  Finished c = run(with_resume(train_argv(1, tmp + "/c", {"train.micro_batch=8"}),
                               tmp + "/b/checkpoints/step-000000008"));
  INFO(output_tail(c.output));
  REQUIRE(c.code == 0);
  // ddp x1 -> fsdp SHARD_GRAD_OP x2.
  Finished d = run(with_resume(train_argv(2, tmp + "/d",
                                          {"strategy.kind=fsdp", "train.micro_batch=4",
                                           "strategy.fsdp.sharding_strategy=SHARD_GRAD_OP"}),
                               tmp + "/ref/checkpoints/step-000000004"));
  INFO(output_tail(d.output));
  REQUIRE(d.code == 0);

  auto ref = read_metrics(tmp + "/ref");
  REQUIRE(ref.size() == 12);
  for (const auto& [dir, first] :
       std::vector<std::pair<std::string, int>>{{"/b", 5}, {"/c", 9}, {"/d", 5}}) {
    auto m = read_metrics(tmp + dir);
    INFO(dir);
    REQUIRE(m.size() == static_cast<size_t>(12 - first + 1));
    for (const auto& rec : m) {
      const int step = rec["step"];
      const double want = ref[step - 1]["loss"];
      CHECK(std::abs(rec["loss"].get<double>() - want) <= 1e-5 * want);
      CHECK(rec["tokens"] == ref[step - 1]["tokens"]);  // the same data, from where it stopped
    }
    auto fa = ft::io::SafetensorsFile::open(tmp + "/ref/final/model.safetensors");
    auto fb = ft::io::SafetensorsFile::open(tmp + dir + "/final/model.safetensors");
    for (const auto& n : fa.names()) CHECK(rel_error(fb.tensor(n), fa.tensor(n)) <= 1e-5);
  }
}

TEST_CASE("a damaged newest checkpoint is named and the previous one is used", "[multiproc]") {
  const std::string ref = make_temp_dir() + "/ref";
  Finished r = run(train_argv(1, ref, {}));
  REQUIRE(r.code == 0);
  const std::string out = make_temp_dir() + "/run";
  fs::copy(ref, out, fs::copy_options::recursive);
  fs::remove_all(out + "/checkpoints/step-000000012");
  fs::remove_all(out + "/final");
  // Flip one byte near the end of the newest checkpoint's data.
  const std::string f = out + "/checkpoints/step-000000008/rank-00000.safetensors";
  flip_bits(f, 64, 0x01);
  const std::string damaged = make_temp_dir() + "/step-000000008";
  fs::copy(f.substr(0, f.rfind('/')), damaged, fs::copy_options::recursive);
  Finished again = run(train_argv(1, out, {}));
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("rank-00000.safetensors") &&
                               Catch::Contains("checksum") && Catch::Contains("falling back") &&
                               Catch::Contains("step-000000004"));
  CHECK(same_file(ref + "/final/model.safetensors", out + "/final/model.safetensors"));

  // An explicit --resume of a damaged checkpoint is an error, not a silent fresh start.
  const std::string out2 = make_temp_dir() + "/run2";
  Finished bad = run(with_resume(train_argv(1, out2, {}), damaged));
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("unusable"));
  CHECK_FALSE(fs::exists(out2 + "/metrics.jsonl"));
}

// meta.json, the commit record, carries a CRC-32C of itself (issue 13, item 3): one digit changed
// inside it (still valid JSON) is caught before anything in it is used; a step directory that
// never committed (no meta.json) is skipped by name.
TEST_CASE("a changed meta.json is refused by its checksum, and an uncommitted step is named",
          "[multiproc]") {
  const std::string ref = make_temp_dir() + "/ref";
  Finished r = run(train_argv(1, ref, {}));
  REQUIRE(r.code == 0);
  auto prepare = [&](const std::string& out) {
    fs::copy(ref, out, fs::copy_options::recursive);
    fs::remove_all(out + "/checkpoints/step-000000012");
    fs::remove_all(out + "/final");
    return out + "/checkpoints/step-000000008/meta.json";
  };
  // One digit of the recorded step: 8 -> 9, valid JSON all the same.
  const std::string out = make_temp_dir() + "/run";
  const std::string meta = prepare(out);
  std::string text = read_file(meta);
  const auto at = text.find("\"step\": 8");
  REQUIRE(at != std::string::npos);
  text[at + 8] = '9';
  std::ofstream(meta, std::ios::trunc) << text;
  const std::string tampered = make_temp_dir() + "/step-000000008";
  fs::copy(out + "/checkpoints/step-000000008", tampered, fs::copy_options::recursive);
  Finished again = run(train_argv(1, out, {}));
  INFO(output_tail(again.output));
  REQUIRE(again.code == 0);
  CHECK_THAT(again.output, Catch::Contains("meta.json: checksum mismatch") &&
                               Catch::Contains("falling back") &&
                               Catch::Contains("step-000000004"));
  CHECK(same_file(ref + "/final/model.safetensors", out + "/final/model.safetensors"));
  // Named explicitly: refused, nothing trained.
  const std::string out2 = make_temp_dir() + "/run2";
  Finished bad = run(with_resume(train_argv(1, out2, {}), tampered));
  CHECK(bad.code == 2);
  CHECK_THAT(bad.output, Catch::Contains("checksum mismatch"));
  CHECK_FALSE(fs::exists(out2 + "/metrics.jsonl"));

  // No meta.json in the newest step directory: damage (a step directory is named only when its
  // save commits), skipped, said, and recorded for the report's timeline.
  const std::string out3 = make_temp_dir() + "/run3";
  fs::remove(prepare(out3));
  Finished skip = run(train_argv(1, out3, {}));
  INFO(output_tail(skip.output));
  REQUIRE(skip.code == 0);
  CHECK_THAT(skip.output, Catch::Contains("step-000000008 is damaged") &&
                              Catch::Contains("resuming from") &&
                              Catch::Contains("step-000000004"));
  CHECK(same_file(ref + "/final/model.safetensors", out3 + "/final/model.safetensors"));
  bool recorded = false, inputs = false;
  for (const auto& e : read_jsonl(out3 + "/events.jsonl")) {
    recorded |= e.value("event", "") == "checkpoint_damaged" && e.value("step", 0) == 8 &&
                e.value("reason", "").find("meta.json is missing") != std::string::npos;
    // Each start records what the run was given.
    inputs |= e.value("event", "") == "start" && e.contains("model") && e.contains("data") &&
              e.value("command", "").find(" train --preset tiny-demo --output " + out3) !=
                  std::string::npos;
  }
  CHECK(recorded);
  CHECK(inputs);
  CHECK_THAT(read_file(out3 + "/report.html"),
             Catch::Contains("checkpoint damaged") && Catch::Contains("meta.json is missing"));
}

// `ft train` run by itself (no launcher): a signal mid-step is answered at once with what happens
// next, the step finishes, a checkpoint is written, exit 75; a second signal stops at once and
// leaves the committed checkpoints as they were (issue 13, item 8).
TEST_CASE("ft train alone: a signal is answered at once, a second one stops at once",
          "[multiproc]") {
  // Steps of about a second on the CI machine, so that a signal lands inside one.
  const std::vector<std::string> slow = {"model.hidden_size=512", "model.intermediate_size=1408",
                                         "model.num_layers=4",    "data.seq_len=256",
                                         "model.max_seq_len=256", "train.micro_batch=8",
                                         "train.max_steps=200",   "train.log_every=1",
                                         "output.save_every=2"};
  auto argv = [&](const std::string& out) {
    return ft_train_argv({"--preset", "tiny-demo", "--output", out}, slow);
  };
  auto wait_output = [](const Child& c, const std::string& text, double seconds) {
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int>(seconds * 1000));
    while (std::chrono::steady_clock::now() < deadline) {
      if (c.output().find(text) != std::string::npos) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  };
  SECTION("one SIGTERM: the step finishes, a checkpoint, exit 75") {
    const std::string out = make_temp_dir() + "/run";
    Child c = start(argv(out), {}, make_temp_dir() + "/out.txt");
    wait_for_steps(out, 1, std::chrono::steady_clock::now() + std::chrono::seconds(120));
    ::kill(c.pid, SIGTERM);
    INFO(output_tail(c.output()));
    CHECK(wait_output(c, "SIGTERM: finishing step", 1.0));  // at once, not after the step
    CHECK(wait_output(c, "send it again to stop at once", 0.1));
    REQUIRE(wait_for(c, 120).value_or(-1) == 75);
    CHECK_THAT(c.output(), Catch::Contains("stopped after step") && Catch::Contains("on SIGTERM"));
  }
  SECTION("two SIGINTs: stopped at once, the committed checkpoint resumes") {
    const std::string out = make_temp_dir() + "/run";
    Child c = start(argv(out), {}, make_temp_dir() + "/out.txt");
    wait_for_steps(out, 3, std::chrono::steady_clock::now() + std::chrono::seconds(120));
    ::kill(c.pid, SIGINT);
    REQUIRE(wait_output(c, "SIGINT: finishing step", 1.0));
    const auto t0 = std::chrono::steady_clock::now();
    ::kill(c.pid, SIGINT);
    const auto code = wait_for(c, 30);
    INFO(output_tail(c.output()));
    CHECK(code.value_or(-1) == 128 + SIGINT);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(3));
    CHECK_THAT(c.output(), Catch::Contains("stopping now; the checkpoints already committed"));
    // The same command continues from the last committed checkpoint.
    // (It would run on; the test stops it once it has resumed.)
    Child again = start(argv(out), {}, make_temp_dir() + "/again.txt");
    CHECK(wait_output(again, "resuming from", 60));
    INFO(output_tail(again.output()));
    kill_and_reap(again);
  }
}
