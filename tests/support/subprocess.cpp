#include "support/subprocess.h"

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <thread>

extern char** environ;

namespace ft::test {

std::string Child::output() const { return read_file(out_path); }

Child start(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& out_path) {
  std::map<std::string, std::string> full;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) full[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  for (auto& [k, v] : env) {
    if (v == "\x01")
      full.erase(k);
    else
      full[k] = v;
  }
  std::vector<std::string> envs;
  for (auto& [k, v] : full) envs.push_back(k + "=" + v);
  std::vector<char*> cargv, cenv;
  for (auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (auto& e : envs) cenv.push_back(const_cast<char*>(e.c_str()));
  cenv.push_back(nullptr);
  int fd = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw std::runtime_error("cannot open " + out_path);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    int devnull = ::open("/dev/null", O_RDONLY);
    ::dup2(devnull, 0);
    ::execve(cargv[0], cargv.data(), cenv.data());
    ::_exit(127);
  }
  ::close(fd);
  return Child{pid, out_path};
}

std::optional<int> wait_for(Child& c, double timeout_s) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  for (;;) {
    int status = 0;
    pid_t r = ::waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) {
      c.pid = -1;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return 128 + WTERMSIG(status);
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void kill_and_reap(Child& c) {
  if (c.pid <= 0) return;
  ::kill(c.pid, SIGKILL);
  ::waitpid(c.pid, nullptr, 0);
  c.pid = -1;
}

Finished run_to_end(const std::vector<std::string>& argv,
                    const std::map<std::string, std::string>& env, const std::string& out_path,
                    double timeout_s) {
  Child c = start(argv, env, out_path);
  auto st = wait_for(c, timeout_s);
  if (!st) kill_and_reap(c);
  return {st.value_or(-1), c.output()};
}

namespace {

// True when nothing holds TCP `port` on any address, IPv4 or IPv6 (the launcher's store listens on
// both). A port some socket still holds in TIME_WAIT counts as taken.
bool port_is_free(int port) {
  int s = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s >= 0) {
    const int v6only = 0;
    ::setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only);
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(static_cast<uint16_t>(port));
    const bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
    ::close(s);
    return ok;
  }
  s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);  // no IPv6 here
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = s >= 0 && ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  if (s >= 0) ::close(s);
  return ok;
}

// The first port of the kernel's ephemeral range (net.ipv4.ip_local_port_range), from which it
// picks the ports of bind(0) and of outgoing connections; 32768 when unreadable.
int first_ephemeral_port() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 0;
  return in >> lo && lo > 0 ? lo : 32768;
}

}  // namespace

int free_port() {
  // Not a port from bind(0): that one is free only until the kernel hands it out again, and a
  // launcher binds it a second or more later (its start-up). Meanwhile every bind(0) and outgoing
  // connection on the machine may take it (the Gloo listeners of other tests' workers, their
  // free_port()s, their store clients), and the launcher then fails with "port in use" (exit 3),
  // or a second node joins whatever listens there. Below the ephemeral range only an explicit
  // bind takes a port: a random one there, checked free, collides only with another test that
  // drew the same port in the same second.
  constexpr int kFirst = 20000;
  const int end = first_ephemeral_port();
  if (end - kFirst >= 1000) {
    static std::mt19937 rng(std::random_device{}() ^ static_cast<unsigned>(::getpid()));
    std::uniform_int_distribution<int> pick(kFirst, end - 1);
    for (int i = 0; i < 200; ++i)
      if (const int p = pick(rng); port_is_free(p)) return p;
  }
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

int listen_on_free_port(int* port) {
  int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  if (s < 0 || ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(s, 4) != 0)
    return -1;
  socklen_t len = sizeof a;
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  *port = ntohs(a.sin_port);
  return s;
}

bool pid_alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return false;
  std::string content((std::istreambuf_iterator<char>(stat)), {});
  auto close = content.rfind(')');
  return close != std::string::npos && close + 2 < content.size() && content[close + 2] != 'Z' &&
         content[close + 2] != 'X';
}

std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == pid) out.push_back(std::stoi(name));
  }
  return out;
}

int rank_of_worker(pid_t pid) {
  const std::string env = read_file("/proc/" + std::to_string(pid) + "/environ");
  const auto at = env.find(std::string("\0RANK=", 6));
  return at == std::string::npos ? -1 : std::atoi(env.c_str() + at + 6);
}

int run_ft(const std::vector<std::string>& args, const std::string& out_path, double timeout_s) {
  std::vector<std::string> argv = {ft_bin()};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_to_end(argv, {{"WORLD_SIZE", "\x01"}, {"RANK", "\x01"}}, out_path, timeout_s).code;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void skip_test(const std::string& why) {
  std::printf("SKIP: %s\n", why.c_str());
  std::fflush(stdout);
  std::_Exit(77);
}

namespace {
// Every directory make_temp_dir() made in this process, removed at exit. Never destroyed: the exit
// handler runs after static destructors would.
std::vector<std::string>& temp_dirs() {
  static auto* dirs = new std::vector<std::string>;
  return *dirs;
}

void remove_temp_dirs() {
  const char* keep = std::getenv("FT_KEEP_TEST_DIRS");
  for (const std::string& dir : temp_dirs()) {
    if (keep && *keep && std::string(keep) != "0") {
      std::fprintf(stderr, "FT_KEEP_TEST_DIRS: kept %s\n", dir.c_str());
      continue;
    }
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
}
}  // namespace

std::string make_temp_dir() {
  std::string tmpl =
      (std::getenv("TMPDIR") ? std::string(std::getenv("TMPDIR")) : "/tmp") + "/ft-test-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
  if (temp_dirs().empty()) std::atexit(remove_temp_dirs);
  temp_dirs().push_back(buf.data());
  return buf.data();
}

void flip_bits(const std::string& path, int64_t from_end, unsigned char mask) {
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  if (!io) throw std::runtime_error("cannot open " + path);
  io.seekg(-from_end, std::ios::end);
  char c = 0;
  io.read(&c, 1);
  c ^= static_cast<char>(mask);
  io.seekp(-from_end, std::ios::end);
  io.write(&c, 1);
}

std::vector<std::string> lines_with(const std::string& text, const std::string& needle) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.find(needle) != std::string::npos) out.push_back(line);
  return out;
}

std::string output_tail(const std::string& output, size_t lines) {
  // Back from the end (a final newline ends the last line, it starts none) to the newline before
  // the lines-th line from the end.
  size_t start = output.size();
  if (start > 0 && output[start - 1] == '\n') --start;
  for (size_t n = 0; n < lines; ++n) {
    const size_t nl = start == 0 ? std::string::npos : output.rfind('\n', start - 1);
    if (nl == std::string::npos) return output;  // no more lines than that: all of it
    start = nl;
  }
  const auto left_out = std::count(output.begin(), output.begin() + static_cast<long>(start), '\n');
  return "[the first " + std::to_string(left_out + 1) + " line(s) of the output left out]\n" +
         output.substr(start + 1);
}

}  // namespace ft::test
