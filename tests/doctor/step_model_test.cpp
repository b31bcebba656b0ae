// The step-time model (doctor/step_model.h) on figures given by hand.
#include "doctor/step_model.h"

#include <algorithm>
#include <vector>

#include "config/settings.h"
#include "model/flops.h"
#include "support/catch_torch.h"
#include "train/saved_model.h"

using namespace ft::doctor;

namespace {

// A link of `bytes_per_s` with `latency_s` per call: nccl-tests' size over the time.
Curve link(double bytes_per_s, double latency_s, double factor) {
  Curve c;
  for (int64_t b = 1024; b <= (int64_t{64} << 20); b *= 4) {
    c.bytes.push_back(b);
    c.seconds.push_back(latency_s + static_cast<double>(b) * factor / bytes_per_s);
  }
  return c;
}

Curves curves(const std::string& what, int ranks, double bytes_per_s, double latency_s) {
  Curves c;
  c.what = what;
  c.ranks = ranks;
  const double n = ranks;
  c.all_reduce = link(bytes_per_s, latency_s, 2 * (n - 1) / n);
  c.all_gather = link(bytes_per_s, latency_s, (n - 1) / n);
  c.reduce_scatter = link(bytes_per_s, latency_s, (n - 1) / n);
  c.all_to_all = link(bytes_per_s, latency_s, (n - 1) / n);
  return c;
}

Job tiny(int nnodes, int nproc) {
  Job j;
  j.settings = ft::config::resolve_settings("tiny-demo", {});
  j.layout = {nnodes, nproc, false};
  return j;
}

Measured measured() {
  Measured m;
  m.probe.fwd_bwd_s = 0.030;
  m.probe.optimizer_s = 0.002;
  m.probe.trained = 410240;  // tiny-demo's parameters, all trained
  const auto s = ft::config::resolve_settings("tiny-demo", {});
  m.probe.flops_per_token =
      ft::model::training_flops(ft::train::model_config_from_preset(s.model), s.data.seq_len)
          .per_token();
  m.world = curves("the whole job (2 ranks)", 2, 25e6, 1e-3);  // 200 Mbit/s, 1 ms per call
  m.inter = m.world;
  m.intra = curves("one node (1 rank)", 1, 10e9, 1e-5);
  return m;
}

}  // namespace

TEST_CASE("curve: log-log between the sizes measured, latency below, the rate above") {
  Curve c;
  c.bytes = {1024, 4096};
  c.seconds = {1e-3, 2e-3};
  CHECK(c.time(512) == 1e-3);
  CHECK(c.time(2048) == Approx(std::sqrt(2.0) * 1e-3));
  CHECK(c.time(8192) == Approx(4e-3));
}

TEST_CASE("step model: ddp over a 200 Mbit/s link, by hand") {
  const Job job = tiny(2, 1);
  const Measured m = measured();
  const Prediction p = predict(job, m);
  // One bucket: the fp32 gradients of 410,240 parameters, 1,640,960 B, all-reduced once; with one
  // bucket nothing overlaps. Time: 1 ms + 1,640,960 x 2 x (1/2) / 25e6 s (interpolated log-log
  // between 1 MiB and 4 MiB, so within a few percent of the line).
  REQUIRE(p.comm.size() == 2);
  CHECK(p.comm[0].op == "all-reduce");
  CHECK(p.comm[0].calls == 1);
  CHECK(p.comm[0].bytes_per_call == 1640960);
  CHECK(p.comm[0].seconds == Approx(1e-3 + 1640960 / 25e6).epsilon(0.05));
  CHECK(p.comm[1].op == "scalars");
  CHECK(p.comm[1].seconds == Approx(4 * m.world.all_reduce.time(8)));
  CHECK(p.hidden_s == 0);
  CHECK(p.compute_s == Approx(0.030));
  CHECK(p.optimizer_s == Approx(0.002));
  CHECK(p.step_s == Approx(0.032 + p.comm_s));
  CHECK(p.efficiency == Approx(0.032 / p.step_s));
  CHECK(p.tokens_per_s == Approx(2 * 8 * 128 / p.step_s));
  CHECK(p.one_device_tokens_per_s == Approx(8 * 128 / 0.032));
  CHECK(p.efficiency < 0.7);

  // The alternatives: accumulation until the efficiency passes 70%, one device, LoRA, others.
  const auto alts = alternatives(job, m);
  bool accum = false, one_device = false, lora = false;
  for (const auto& a : alts) {
    if (a.what.rfind("train.grad_accum=", 0) == 0 && a.prediction.efficiency >= 0.7) accum = true;
    if (a.what.rfind("one device", 0) == 0) one_device = true;
    CHECK(a.what.rfind("one node", 0) != 0);  // (one rank per node: that is one device)
    if (a.what.rfind("lora.enabled=true", 0) == 0) {
      lora = true;
      // Only the adapters' gradients cross the link, and their compute is less.
      CHECK(a.prediction.comm_s < p.comm_s / 3);
      CHECK(a.prediction.compute_s < p.compute_s);
    }
  }
  CHECK(accum);
  // Each larger grad_accum offered raises the efficiency (a point or more) over the one before.
  double last = p.efficiency;
  std::vector<const Alternative*> accums;
  for (const auto& a : alts)
    if (a.what.rfind("train.grad_accum=", 0) == 0) accums.push_back(&a);
  std::sort(accums.begin(), accums.end(), [](const Alternative* x, const Alternative* y) {
    return x->prediction.efficiency < y->prediction.efficiency;
  });
  for (const Alternative* a : accums) {
    CHECK(a->prediction.efficiency >= last + 0.01);
    last = a->prediction.efficiency;
  }
  CHECK(one_device);
  CHECK(lora);
  // Best first.
  for (size_t i = 1; i < alts.size(); ++i)
    CHECK(alts[i - 1].prediction.tokens_per_s >= alts[i].prediction.tokens_per_s);
  const std::string text = prediction_text(job, p, alts);
  CHECK_THAT(text, Catch::Contains("warning: scaling efficiency") && Catch::Contains("what to do"));
}

TEST_CASE("step model: FULL_SHARD gathers per unit and micro-batch, and overlap hides them") {
  Job job = tiny(2, 1);
  job.layout.gpu = true;                // (on CPUs nothing is hidden)
  job.settings.strategy.kind = "fsdp";  // (zero3 keeps tiny-demo's small tensors unsharded)
  const Prediction p = predict(job, measured());
  bool gather = false, scatter = false;
  for (const auto& c : p.comm) {
    if (c.op == "all-gather") {
      gather = true;
      CHECK(c.calls == 3 + 2);  // root and 2 layers in forward, the 2 layers again in backward
    }
    if (c.op == "reduce-scatter") {
      scatter = true;
      CHECK(c.calls == 3);
    }
  }
  CHECK(gather);
  CHECK(scatter);
  CHECK(p.hidden_s > 0);
  CHECK(p.exposed_s == Approx(p.comm_s - p.hidden_s));
  job.settings.strategy.overlap_comm = false;
  CHECK(predict(job, measured()).hidden_s == 0);
  job.settings.strategy.overlap_comm = true;
  job.layout.gpu = false;
  CHECK(predict(job, measured()).hidden_s == 0);
}

TEST_CASE("step model: expert parallelism's token exchange, by hand") {
  // Qwen3-MoE's tiny fixture (1 MoE layer, top 2, hidden 32) on 2 nodes x 1, EP 2 across them.
  Job job;
  job.settings = ft::config::resolve_settings(
      "tiny-demo", {"strategy.expert_parallel=2", "data.seq_len=32", "train.micro_batch=2"});
  job.model_dir = std::string(FT_TEST_DIR) + "/model/fixtures/moe/qwen3_moe_tiny";
  job.layout = {2, 1, false};
  const Prediction p = predict(job, measured());
  const CommPart* a2a = nullptr;
  for (const auto& c : p.comm)
    if (c.op == "all-to-all") a2a = &c;
  REQUIRE(a2a != nullptr);
  // 1 micro-batch x 1 MoE layer x 4 exchanges; each 2 x 32 tokens x top 2 = 128 rows of 32 fp32
  // values (16,384 B), half of them leaving the rank, x 1.25 headroom: 10,240 B a call, at 1 ms +
  // 10,240 x (1/2) / 25e6 s (log-log between the sizes measured: within a few percent).
  CHECK(a2a->calls == 4);
  CHECK(a2a->bytes_per_call == 10240);
  CHECK(a2a->seconds == Approx(4 * (1e-3 + 10240 * 0.5 / 25e6)).epsilon(0.05));
  CHECK(a2a->group == "the whole job (2 ranks)");
  // Never hidden: all of it is in the exposed time.
  CHECK(p.exposed_s >= a2a->seconds);
}
