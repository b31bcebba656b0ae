// Test support: network namespaces as hosts (iproute2). Each node of a job is a namespace with one
// address, all on one bridge (the switch, in a namespace of its own); a node's link can be taken
// down (its switch port) or rate-limited (tc's token bucket on its side of the link). Needs root
// (CAP_NET_ADMIN); require_netns() skips the test visibly elsewhere. Not thread-safe.
#pragma once

#include <string>
#include <vector>

namespace ft::test {

struct Shell {
  int code = -1;
  std::string out;
};

// Runs `cmd` with sh; its exit code and output (stdout and stderr).
Shell sh(const std::string& cmd);
// Runs `cmd` and REQUIREs exit code 0 (its output in the failure message).
void must(const std::string& cmd);

// Skips the test (SKIP, exit 77) unless network namespaces can be made here; with `need_tc`,
// unless tc (iproute2) can shape a link too.
void require_netns(bool need_tc = false);

// `nodes` namespaces on one bridge; node i has address 10.77.0.(i+1). Removed on destruction, with
// their links.
class Network {
 public:
  explicit Network(int nodes);
  ~Network();
  Network(const Network&) = delete;
  Network& operator=(const Network&) = delete;

  std::string addr(int i) const { return "10.77.0." + std::to_string(i + 1); }
  // Node i's namespace (/run/netns/NAME), for tools that enter it themselves (nsenter).
  std::string name(int i) const { return ns(i); }
  // `argv` run on node i.
  std::vector<std::string> on(int i, const std::vector<std::string>& argv) const;
  // Node i's switch port down (its packets are dropped) or up again.
  void link(int i, bool up);
  // Node i's outgoing traffic limited to `rate` (tc's spelling: "200mbit") by a token bucket;
  // limit(i, "") removes the limit.
  void limit(int i, const std::string& rate);

 private:
  std::string ns(int i) const { return tag_ + "n" + std::to_string(i); }
  std::string sw() const { return tag_ + "sw"; }
  std::string port(int i) const { return tag_ + "p" + std::to_string(i); }
  std::string veth(int i) const { return tag_ + "e" + std::to_string(i); }
  std::string tag_;
  int nodes_;
};

}  // namespace ft::test
