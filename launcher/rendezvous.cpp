#include "rendezvous.h"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "core/error.h"
#include "core/json.h"
#include "core/net.h"

namespace ft::launcher {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(20);
constexpr int kMaxNodes = 100000;  // the most --nnodes allows (options.cpp)
// A wait says what it waits for after this long, and again at this interval.
constexpr auto kNoteEvery = std::chrono::seconds(5);

// When a wait is due to say what it waits for: after kNoteEvery, then every kNoteEvery.
struct Notes {
  Clock::time_point next = Clock::now() + kNoteEvery;
  bool due() {
    if (Clock::now() < next) return false;
    next = Clock::now() + kNoteEvery;
    return true;
  }
};

std::string who(const Fingerprint& f) { return fmt::format("{} ({})", f.hostname, f.addr); }

}  // namespace

bool is_local_host(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  std::set<std::string> targets;
  for (auto* r = res; r; r = r->ai_next) targets.insert(numeric_address(r->ai_addr));
  ::freeaddrinfo(res);
  for (const auto& t : targets)
    if (t.rfind("127.", 0) == 0 || t == "::1") return true;
  ifaddrs* ifs = nullptr;
  if (::getifaddrs(&ifs) != 0) return false;
  bool local = false;
  for (auto* i = ifs; i && !local; i = i->ifa_next)
    if (i->ifa_addr && targets.count(numeric_address(i->ifa_addr))) local = true;
  ::freeifaddrs(ifs);
  return local;
}

bool port_accepts(const std::string& host, uint16_t port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return false;
  bool ok = false;
  for (auto* r = res; r && !ok; r = r->ai_next) {
    int fd = ::socket(r->ai_family, r->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, r->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, r->ai_addr, r->ai_addrlen) == 0) {
      ok = true;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof err;
      ok = ::poll(&p, 1, static_cast<int>(timeout.count())) == 1 &&
           ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
    }
    ::close(fd);
  }
  ::freeaddrinfo(res);
  return ok;
}

Rendezvous::Rendezvous(const LaunchConfig& cfg, Fingerprint mine, std::function<bool()> interrupted,
                       std::function<void(const std::string&)> say)
    : cfg_(cfg),
      mine_(std::move(mine)),
      interrupted_(std::move(interrupted)),
      say_(std::move(say)) {}

std::string Rendezvous::key(int round, const std::string& name) {
  return fmt::format("ft/r{}/{}", round, name);
}

void Rendezvous::open() {
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(cfg_.rdzv_timeout_s * 1000));
  if (cfg_.node_rank.value_or(-1) == 0) {
    store_ = RdzvStore::host(cfg_.rdzv_port, timeout);
    return;
  }
  if (!cfg_.node_rank && is_local_host(cfg_.rdzv_host)) {
    try {
      store_ = RdzvStore::host(cfg_.rdzv_port, timeout);
      return;
    } catch (const RendezvousError&) {
      // Another launcher on this machine hosts it already: join as a client below.
    }
  }
  // Wait for the port to accept connections with our own short probes before handing over to
  // c10d: its client backs off up to a second between refused attempts (slow when node 0 is still
  // starting), and it cannot be interrupted, while a signal (Ctrl-C, scancel) must stop a launcher
  // that is still waiting for node 0 at once.
  const auto deadline = Clock::now() + timeout;
  std::string why = "nothing listens there yet";
  while (Clock::now() < deadline) {
    if (interrupted_()) throw RendezvousError("rendezvous interrupted by a signal");
    if (!port_accepts(cfg_.rdzv_host, cfg_.rdzv_port, std::chrono::milliseconds(250))) {
      std::this_thread::sleep_for(kPollInterval);
      continue;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    try {
      store_ = RdzvStore::connect(cfg_.rdzv_host, cfg_.rdzv_port,
                                  std::min(left, std::chrono::milliseconds(1000)));
      store_->set_timeout(timeout);
      return;
    } catch (const RendezvousTimeout& e) {
      why = e.what();
    }
  }
  throw RendezvousTimeout(fmt::format(
      "could not reach the rendezvous store at {}:{} within {:.0f} s ({}). Check that node 0's "
      "launcher is running with the same --master-addr/--master-port and that the port is open "
      "between the nodes",
      cfg_.rdzv_host, cfg_.rdzv_port, cfg_.rdzv_timeout_s, why));
}

std::string Rendezvous::missing_description(int round, int64_t joined) {
  std::set<int> ranks;
  bool implicit = false;
  for (int64_t i = 0; i < joined; ++i) {
    auto fp = store_->try_get(key(round, fmt::format("fp/{}", i)));
    if (!fp) continue;
    int r = Fingerprint::from_json(*fp).node_rank;
    if (r < 0)
      implicit = true;
    else
      ranks.insert(r);
  }
  std::string s = fmt::format("{}/{} nodes joined", joined,
                              cfg_.min_nodes == cfg_.max_nodes
                                  ? std::to_string(cfg_.max_nodes)
                                  : fmt::format("{}..{}", cfg_.min_nodes, cfg_.max_nodes));
  if (!implicit) {
    std::vector<std::string> missing;
    for (int r = 0; r < cfg_.min_nodes; ++r)
      if (!ranks.count(r)) missing.push_back(std::to_string(r));
    if (!missing.empty()) s += fmt::format(" (missing node_rank {})", fmt::join(missing, ", "));
  }
  return s;
}

void Rendezvous::purge_worker_keys() {
  for (auto k : store_->list_keys()) {
    if (!k.empty() && k[0] == '/') k.erase(0, 1);
    if (k.rfind("ft/", 0) == 0) continue;
    store_->delete_key(k);
  }
}

std::string Rendezvous::coordinate(int round) {
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration<double>(cfg_.rdzv_timeout_s);
  std::optional<Clock::time_point> min_reached;
  int64_t n = 0;
  Notes notes;
  for (;;) {
    if (interrupted_()) return {};
    int64_t joined = store_->add(key(round, "joined"), 0);
    if (notes.due())
      say_(fmt::format("round {}: waiting for nodes to join: {}; {:.0f} s of --rdzv-timeout left",
                       round, missing_description(round, joined),
                       std::chrono::duration<double>(deadline - Clock::now()).count()));
    auto have_fps = [&](int64_t count) {
      for (int64_t i = 0; i < count; ++i)
        if (!store_->check(key(round, fmt::format("fp/{}", i)))) return false;
      return true;
    };
    if (joined >= cfg_.min_nodes && !min_reached) min_reached = Clock::now();
    if (joined >= cfg_.max_nodes && have_fps(cfg_.max_nodes)) {
      n = cfg_.max_nodes;
      break;
    }
    if (min_reached &&
        Clock::now() - *min_reached >= std::chrono::duration<double>(cfg_.rdzv_last_call_s) &&
        have_fps(joined)) {
      n = std::min<int64_t>(joined, cfg_.max_nodes);
      break;
    }
    if (Clock::now() >= deadline) {
      return json{{"error", fmt::format("rendezvous timed out after {:.0f} s: {}",
                                        cfg_.rdzv_timeout_s, missing_description(round, joined))}}
          .dump();
    }
    std::this_thread::sleep_for(kPollInterval);
  }

  std::vector<Fingerprint> fps;
  for (int64_t i = 0; i < n; ++i)
    fps.push_back(Fingerprint::from_json(store_->get(key(round, fmt::format("fp/{}", i)))));

  std::vector<std::string> errors;
  // Duplicate or out-of-range requested ranks.
  std::map<int, int> claimed;  // node_rank -> join index
  for (int64_t i = 0; i < n; ++i) {
    int r = fps[i].node_rank;
    if (r < 0) continue;
    if (r >= n) {
      errors.push_back(
          fmt::format("node {} asks for node_rank {} but the job has {} nodes", who(fps[i]), r, n));
    } else if (auto it = claimed.find(r); it != claimed.end()) {
      errors.push_back(
          fmt::format("duplicate node_rank {}: claimed by {} and by {}; give each node "
                      "its own --node-rank",
                      r, who(fps[it->second]), who(fps[i])));
    } else {
      claimed[r] = static_cast<int>(i);
    }
  }
  // Software, layout and program must match the reference node (node 0 if it is known).
  int ref = claimed.count(0) ? claimed[0] : 0;
  for (int64_t i = 0; i < n; ++i) {
    if (i == ref) continue;
    auto diffs = compare_fingerprints(fps[ref], fps[i]);
    if (diffs.empty()) continue;
    std::vector<std::string> parts;
    for (auto& d : diffs)
      parts.push_back(
          fmt::format("{} is '{}' there but '{}' on the reference", d.field, d.actual, d.expected));
    std::string rank_text =
        fps[i].node_rank >= 0 ? fmt::format("node_rank {} ", fps[i].node_rank) : "";
    errors.push_back(
        fmt::format("{}{} differs from {}{}: {}", rank_text, who(fps[i]),
                    fps[ref].node_rank >= 0 ? fmt::format("node_rank {} ", fps[ref].node_rank) : "",
                    who(fps[ref]), fmt::join(parts, "; ")));
  }
  if (!errors.empty()) {
    return json{{"error", fmt::format("rendezvous refused {} node(s):\n  {}", errors.size(),
                                      fmt::join(errors, "\n  "))}}
        .dump();
  }

  // Assign ranks: requested ones stay, the others fill the free ranks in join order.
  std::vector<int> rank_of(n, -1);
  std::set<int> free;
  for (int r = 0; r < n; ++r)
    if (!claimed.count(r)) free.insert(r);
  for (int64_t i = 0; i < n; ++i) {
    if (fps[i].node_rank >= 0) {
      rank_of[i] = fps[i].node_rank;
    } else {
      rank_of[i] = *free.begin();
      free.erase(free.begin());
    }
  }
  if (round > 0) purge_worker_keys();
  json members = json::array();
  for (int64_t i = 0; i < n; ++i) members.push_back({{"index", i}, {"node_rank", rank_of[i]}});
  return json{{"nnodes", n}, {"members", members}}.dump();
}

void Rendezvous::finish(int round) {
  FT_ASSERT(store_ && store_->is_host(), "finish() is the host's");
  const int next = round + 1;
  const int64_t waiting = store_->add(key(next, "joined"), 0);
  if (waiting == 0) return;
  // compare_set: a result the round already has (none is expected) is left alone.
  if (store_->check(key(next, "result"))) return;
  store_->set(key(next, "result"),
              json{{"finished",
                    "the job finished successfully before this node could join it: "
                    "nothing to do"}}
                  .dump());
  wait_count(next, "result_read", waiting, 5.0);
}

int Rendezvous::first_round() {
  FT_ASSERT(store_, "open() first");
  auto current = store_->try_get("ft/round");
  if (!current) return 0;
  // Any program can set a key of the store: a value that is not a round number is refused.
  char* end = nullptr;
  errno = 0;
  const long r = std::strtol(current->c_str(), &end, 10);
  FT_CHECK_T(RendezvousError,
             !current->empty() && end == current->c_str() + current->size() && errno == 0 &&
                 r >= 0 && r < INT32_MAX,
             "the store's ft/round is '", excerpt(*current),
             "', not a round number: is another program using this store?");
  return store_->check(key(r, "result")) ? r + 1 : r;
}

RoundResult Rendezvous::join(int round) {
  FT_ASSERT(store_, "open() first");
  store_->set("ft/round", std::to_string(round));
  const int64_t index = store_->add(key(round, "joined"), 1) - 1;
  store_->set(key(round, fmt::format("fp/{}", index)), mine_.to_json());

  std::string result_text;
  if (store_->is_host()) {
    result_text = coordinate(round);
    if (!result_text.empty()) store_->set(key(round, "result"), result_text);
  }
  // Everyone (the host too) reads the published result. Give the host a little longer than our own
  // timeout to answer, since it may have started after us.
  const auto deadline = Clock::now() + std::chrono::duration<double>(cfg_.rdzv_timeout_s +
                                                                     (store_->is_host() ? 0 : 5));
  Notes notes;
  while (result_text.empty()) {
    if (interrupted_()) throw RendezvousError("rendezvous interrupted by a signal");
    if (!store_->is_host() && notes.due())
      say_(fmt::format("round {}: waiting for node 0 ({}:{}) to start the round: {}", round,
                       cfg_.rdzv_host, cfg_.rdzv_port,
                       missing_description(round, store_->add(key(round, "joined"), 0))));
    if (auto r = store_->try_get(key(round, "result"))) {
      result_text = *r;
      break;
    }
    if (Clock::now() >= deadline) {
      int64_t joined = store_->add(key(round, "joined"), 0);
      throw RendezvousTimeout(fmt::format("rendezvous timed out after {:.0f} s: {}",
                                          cfg_.rdzv_timeout_s, missing_description(round, joined)));
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  store_->add(key(round, "result_read"), 1);

  const std::string what = "the rendezvous result in the store";
  json j = parse_json<RendezvousError>(result_text, what);
  RoundResult rr;
  // The host wrote it, but any program can set a key of the store: a result of another shape is
  // refused by name rather than thrown as a JSON error or indexed past the members.
  try {
    if (j.contains("finished")) throw JobFinished(j["finished"].get<std::string>());
    if (j.contains("error")) {
      if (store_->is_host()) {
        // Keep the store up until the others have read why they were refused.
        wait_count(round, "result_read", store_->add(key(round, "joined"), 0), 5.0);
      }
      // Text from the store: quoted short, and said to be round N's (so a text that reads like
      // one of ft's own internal errors is not taken for one).
      const std::string text = j["error"].get<std::string>();
      const std::string msg = fmt::format("round {}: {}", round, excerpt(text, 4000));
      if (text.rfind("rendezvous timed out", 0) == 0) throw RendezvousTimeout(msg);
      throw RendezvousError(msg);
    }
    rr.round = round;
    FT_CHECK_T(RendezvousError,
               j["nnodes"].is_number_integer() && j["nnodes"] >= 1 && j["nnodes"] <= kMaxNodes,
               what, " has nnodes ", excerpt_json(j["nnodes"]), ", not a node count");
    rr.nnodes = j["nnodes"];
    rr.my_node_rank = -1;
    rr.members.resize(rr.nnodes);
    for (const auto& m : j.at("members")) {
      FT_CHECK_T(RendezvousError,
                 m.at("index").is_number_integer() && m.at("node_rank").is_number_integer() &&
                     m["node_rank"] >= 0 && m["node_rank"] < rr.nnodes,
                 what, " has a member ", excerpt_json(m), " outside the job's ", rr.nnodes,
                 " nodes");
      int64_t idx = m["index"];
      int r = m["node_rank"];
      rr.members[r].node_rank = r;
      rr.members[r].fp = Fingerprint::from_json(store_->get(key(round, fmt::format("fp/{}", idx))));
      if (idx == index) rr.my_node_rank = r;
    }
  } catch (const json::exception& e) {
    throw RendezvousError(
        fmt::format("{} is unreadable ({}): {}", what, e.what(), excerpt(result_text)));
  }
  if (rr.my_node_rank < 0) {
    throw RendezvousError(fmt::format(
        "the job already has its {} nodes (--nnodes {}); this node joined as number {} and is not "
        "needed. Stop it, or raise MAX in --nnodes MIN:MAX",
        rr.nnodes, mine_.nnodes, index + 1));
  }
  return rr;
}

void Rendezvous::mark_stopped(int round, int node_rank) {
  store_->set(key(round, fmt::format("stopped/{}", node_rank)), "1");
}

bool Rendezvous::wait_stopped(int round, const std::vector<int>& nodes, double timeout_s) {
  FT_ASSERT(store_ && store_->is_host(), "wait_stopped() is the host's");
  const auto start = Clock::now();
  const auto deadline = start + std::chrono::duration<double>(timeout_s);
  Notes notes;
  notes.next = start + std::chrono::seconds(1);
  for (;;) {
    std::vector<int> missing;
    try {
      for (int n : nodes)
        if (!store_->check(key(round, fmt::format("stopped/{}", n)))) missing.push_back(n);
    } catch (const BackendError&) {
      return false;
    }
    if (missing.empty()) return true;
    if (Clock::now() >= deadline) {
      say_(
          fmt::format("node(s) {} did not report their workers stopped within {:.0f} s; going on "
                      "without them",
                      fmt::join(missing, ", "), timeout_s));
      return false;
    }
    if (notes.due())
      say_(fmt::format("waiting up to {:.0f} s more for node(s) {} to stop their workers",
                       std::chrono::duration<double>(deadline - Clock::now()).count(),
                       fmt::join(missing, ", ")));
    std::this_thread::sleep_for(kPollInterval);
  }
}

bool Rendezvous::wait_count(int round, const std::string& counter, int64_t n, double timeout_s) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (Clock::now() < deadline) {
    try {
      if (store_->add(key(round, counter), 0) >= n) return true;
    } catch (const BackendError&) {
      return false;
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  return false;
}

}  // namespace ft::launcher
