// Fuzzes what a launcher decodes from the rendezvous store (a TCPStore on loopback, hosted by this
// process). Every input is decoded as a node's fingerprint (compared with this node's) and as a
// failure record (and summarised). Then, by its shape: a JSON object with "hostname" is another
// node's fingerprint published in a round that this node hosts (Rendezvous::join coordinating);
// any other text that opens with '{' is the round's result read by a node that does not host
// (Rendezvous::join); anything else is the round number a late launcher reads
// (Rendezvous::first_round). Each input uses a round of its own, whose keys are deleted after it.
#include <nlohmann/json.hpp>

#include "core/json.h"
#include "failure.h"
#include "fingerprint.h"
#include "fuzz_support.h"
#include "rendezvous.h"

namespace {

using namespace ft;
using namespace ft::launcher;

// A node that does not host waits this long for a key that is not there (a member index the result
// makes up), so such inputs stay fast.
constexpr double kClientTimeoutS = 0.05;

Fingerprint reference(int node_rank, const std::string& host) {
  Fingerprint f;
  f.hostname = host;
  f.addr = "10.0.0.1";
  f.node_rank = node_rank;
  f.rdzv_id = "job";
  f.nnodes = "2";
  f.nproc = 2;
  f.ft_version = "0.1.0";
  f.ft_commit = "abc";
  f.torch_version = "2.11.0";
  f.program_hash = "0123456789abcdef";
  return f;
}

LaunchConfig config(int node_rank, uint16_t port, double timeout_s) {
  LaunchConfig c;
  c.min_nodes = c.max_nodes = 2;
  c.node_rank = node_rank;
  c.rdzv_host = "127.0.0.1";
  c.rdzv_port = port;
  c.rdzv_timeout_s = timeout_s;
  c.rdzv_last_call_s = 0;
  return c;
}

struct Nodes {
  std::unique_ptr<Rendezvous> host;    // node 0, hosting the store
  std::unique_ptr<Rendezvous> client;  // node 1
  int round = 0;                       // the next unused round
};

Nodes& nodes() {
  static Nodes n = [] {
    Nodes n;
    auto never = [] { return false; };
    n.host = std::make_unique<Rendezvous>(config(0, 0, 10), reference(0, "node0"), never);
    n.host->open();
    n.client = std::make_unique<Rendezvous>(config(1, n.host->port(), kClientTimeoutS),
                                            reference(1, "node1"), never);
    n.client->open();
    return n;
  }();
  return n;
}

void delete_round(int round) {
  RdzvStore& s = nodes().host->store();
  for (const char* k : {"joined", "result", "result_read", "fp/0", "fp/1", "fp/2", "fp/3"})
    s.delete_key(Rendezvous::key(round, k));
  s.delete_key("ft/round");
}

// Node 0 hosts a round that the input's fingerprint joined first.
void host_round(std::string_view fp) {
  Nodes& n = nodes();
  const int round = n.round++;
  RdzvStore& s = n.host->store();
  s.add(Rendezvous::key(round, "joined"), 1);
  s.set(Rendezvous::key(round, "fp/0"), std::string(fp));
  s.add(Rendezvous::key(round, "result_read"), 1);  // the other node has read the result
  fuzz::expect_ft_errors([&] { (void)n.host->join(round); });
  delete_round(round);
}

// Node 1 reads the round's result, which the input is.
void client_round(std::string_view result) {
  Nodes& n = nodes();
  const int round = n.round++;
  RdzvStore& s = n.host->store();
  s.set(Rendezvous::key(round, "result"), std::string(result));
  for (int i = 1; i <= 3; ++i)
    s.set(Rendezvous::key(round, "fp/" + std::to_string(i)), reference(i - 1, "other").to_json());
  fuzz::expect_ft_errors([&] {
    const RoundResult rr = n.client->join(round);
    fuzz::require(rr.my_node_rank >= 0 && rr.my_node_rank < rr.nnodes &&
                      static_cast<int>(rr.members.size()) == rr.nnodes,
                  "a round result this node accepts places it among the nodes");
  });
  delete_round(round);
}

void late_launcher(std::string_view round_text) {
  Nodes& n = nodes();
  n.host->store().set("ft/round", std::string(round_text));
  fuzz::expect_ft_errors([&] { (void)n.client->first_round(); });
  n.host->store().delete_key("ft/round");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)nodes();  // the store is up before the first input
  const std::string text(fuzz::as_text(data, size));
  fuzz::expect_ft_errors([&] {
    const Fingerprint fp = Fingerprint::from_json(text);
    (void)compare_fingerprints(reference(0, "node0"), fp);
  });
  fuzz::expect_ft_errors([&] {
    const Failure f = Failure::from_json(text);
    (void)summary_text(f);
    (void)restartable(f.kind);
  });

  nlohmann::json j;
  if (json_too_deep_at(text) == std::string::npos)
    j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("hostname")) {
    host_round(text);
  } else if (!text.empty() && text[0] == '{') {
    client_round(text);
  } else {
    late_launcher(text);
  }
  return 0;
}
