// Unit tests: node fingerprints round-trip and differ exactly where they must not.
#include "fingerprint.h"

#include <catch2/catch.hpp>
#include <fstream>

#include "core/error.h"
#include "support/subprocess.h"

using namespace ft::launcher;

namespace {
Fingerprint sample() {
  Fingerprint f;
  f.hostname = "gpu01";
  f.addr = "10.0.0.1";
  f.node_rank = 0;
  f.rdzv_id = "job7";
  f.nnodes = "2";
  f.nproc = 8;
  f.ft_version = "0.1.0";
  f.ft_commit = "abc";
  f.torch_version = "2.11.0";
  f.cuda_version = "13.0";
  f.nccl_version = "2.28.9";
  f.gpu_name = "NVIDIA H100";
  f.gpu_count = 8;
  f.program_hash = "00ff";
  return f;
}
}  // namespace

TEST_CASE("fingerprints round-trip through JSON", "[unit]") {
  Fingerprint f = sample();
  Fingerprint g = Fingerprint::from_json(f.to_json());
  CHECK(compare_fingerprints(f, g).empty());
  CHECK(g.hostname == "gpu01");
  CHECK(g.node_rank == 0);
  CHECK_THROWS_AS(Fingerprint::from_json("{\"hostname\":1}"), ft::RendezvousError);
  CHECK_THROWS_AS(Fingerprint::from_json("not json"), ft::RendezvousError);
}

TEST_CASE("identity fields may differ but software, layout and program may not", "[unit]") {
  Fingerprint a = sample(), b = sample();
  b.hostname = "gpu02";
  b.addr = "10.0.0.2";
  b.node_rank = 1;
  CHECK(compare_fingerprints(a, b).empty());
  b.torch_version = "2.10.0";
  b.nproc = 4;
  auto d = compare_fingerprints(a, b);
  REQUIRE(d.size() == 2);
  CHECK(d[0].field == "nproc_per_node");
  CHECK(d[0].expected == "8");
  CHECK(d[0].actual == "4");
  CHECK(d[1].field == "torch_version");
  for (auto mutate : std::vector<void (*)(Fingerprint&)>{
           [](Fingerprint& f) { f.rdzv_id = "other"; }, [](Fingerprint& f) { f.nnodes = "3"; },
           [](Fingerprint& f) { f.cuda_version = ""; },
           [](Fingerprint& f) { f.nccl_version = "2.21"; },
           [](Fingerprint& f) { f.gpu_name = "A100"; }, [](Fingerprint& f) { f.gpu_count = 4; },
           [](Fingerprint& f) { f.ft_commit = "def"; },
           [](Fingerprint& f) { f.program_hash = "1"; },
           [](Fingerprint& f) { f.max_restarts = 3; }}) {
    Fingerprint c = sample();
    mutate(c);
    CHECK(compare_fingerprints(a, c).size() == 1);
  }
}

TEST_CASE("the program hash covers arguments and the files they name", "[unit]") {
  std::string dir = ft::test::make_temp_dir();
  std::string script = dir + "/train.py";
  std::ofstream(script) << "print('v1')\n";
  auto h1 = hash_program({"sh", script, "--lr", "1e-4"});
  CHECK(h1 == hash_program({"sh", script, "--lr", "1e-4"}));
  CHECK(h1 != hash_program({"sh", script, "--lr", "2e-4"}));
  std::ofstream(script) << "print('v2')\n";
  CHECK(h1 != hash_program({"sh", script, "--lr", "1e-4"}));
  CHECK(h1.size() == 16);
}
