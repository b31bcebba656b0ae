#include "support/netns.h"

#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>

#include "support/subprocess.h"

namespace ft::test {

namespace {
// start() runs a program by its path.
constexpr const char* kIp = "/usr/sbin/ip";
constexpr const char* kTc = "/usr/sbin/tc";
}  // namespace

Shell sh(const std::string& cmd) {
  Shell r;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[512];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

void must(const std::string& cmd) {
  const Shell r = sh(cmd);
  INFO(cmd << "\n" << output_tail(r.out));
  REQUIRE(r.code == 0);
}

void require_netns(bool need_tc) {
  std::string why;
  if (::access(kIp, X_OK) != 0) {
    why = std::string(kIp) + " not found (Debian's iproute2)";
  } else if (need_tc && ::access(kTc, X_OK) != 0) {
    why = std::string(kTc) + " not found (Debian's iproute2)";
  } else if (::geteuid() != 0) {
    why = "not root (ip netns needs CAP_NET_ADMIN)";
  } else {
    const std::string probe = "ftprobe" + std::to_string(::getpid());
    const Shell r = sh("ip netns add " + probe + " && ip netns del " + probe);
    if (r.code != 0) why = "`ip netns add` failed: " + r.out;
  }
  if (!why.empty()) skip_test("network namespaces are not available here: " + why);
}

Network::Network(int nodes) : tag_("ft" + std::to_string(::getpid())), nodes_(nodes) {
  must("ip netns add " + sw());
  must("ip -n " + sw() + " link set lo up");
  must("ip -n " + sw() + " link add br0 type bridge");
  must("ip -n " + sw() + " link set br0 up");
  for (int i = 0; i < nodes; ++i) {
    must("ip netns add " + ns(i));
    must("ip link add " + veth(i) + " netns " + ns(i) + " type veth peer name " + port(i) +
         " netns " + sw());
    must("ip -n " + sw() + " link set " + port(i) + " master br0 up");
    must("ip -n " + ns(i) + " addr add " + addr(i) + "/24 dev " + veth(i));
    must("ip -n " + ns(i) + " link set " + veth(i) + " up");
    must("ip -n " + ns(i) + " link set lo up");
  }
}

Network::~Network() {
  for (int i = 0; i < nodes_; ++i) sh("ip netns del " + ns(i));
  sh("ip netns del " + sw());
}

std::vector<std::string> Network::on(int i, const std::vector<std::string>& argv) const {
  std::vector<std::string> v = {kIp, "netns", "exec", ns(i)};
  v.insert(v.end(), argv.begin(), argv.end());
  return v;
}

void Network::link(int i, bool up) {
  must("ip -n " + sw() + " link set " + port(i) + (up ? " up" : " down"));
}

void Network::limit(int i, const std::string& rate) {
  const std::string tc = "ip netns exec " + ns(i) + " tc qdisc ";
  if (rate.empty()) {
    sh(tc + "del dev " + veth(i) + " root");
    return;
  }
  // A bucket of 256 KiB: more than the largest segment the veth hands over (64 KiB with TSO) and
  // several timer ticks' worth at 200 Mbit/s, so the rate is met without drops from the bucket.
  must(tc + "replace dev " + veth(i) + " root tbf rate " + rate + " burst 256kb latency 200ms");
}

}  // namespace ft::test
