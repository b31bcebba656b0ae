#include "fingerprint.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json.h"

namespace ft::launcher {

using nlohmann::json;

// The store's form of a fingerprint: one JSON object, a key per field, named as the field.
NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE(Fingerprint, hostname, addr, node_rank, rdzv_id, nnodes, nproc,
                                   max_restarts, ft_version, ft_commit, torch_version, cuda_version,
                                   nccl_version, gpu_name, gpu_count, program_hash)

std::string Fingerprint::to_json() const { return json(*this).dump(); }

Fingerprint Fingerprint::from_json(const std::string& text) {
  try {
    FT_CHECK_T(RendezvousError, json_too_deep_at(text) == std::string_view::npos,
               "a node published a fingerprint nested deeper than ", kMaxJsonDepth, " levels");
    const json j = json::parse(text);
    // nlohmann converts a float to an int silently, and one out of range with undefined
    // behaviour: the integer fields are checked as integers first.
    for (const char* key : {"node_rank", "nproc", "max_restarts", "gpu_count"})
      FT_CHECK_T(RendezvousError, !j.contains(key) || j[key].is_number_integer(),
                 "a node published a fingerprint whose \"", key,
                 "\" is not an integer: ", excerpt_json(j[key]));
    return j.get<Fingerprint>();
  } catch (const json::exception& e) {
    throw RendezvousError(fmt::format(
        "a node published an unreadable fingerprint ({}); is it running a different ft version?",
        e.what()));
  }
}

std::vector<FieldDiff> compare_fingerprints(const Fingerprint& a, const Fingerprint& b) {
  std::vector<FieldDiff> d;
  auto cmp = [&](const char* field, const auto& x, const auto& y) {
    if (x != y) d.push_back({field, fmt::format("{}", x), fmt::format("{}", y)});
  };
  cmp("rdzv_id", a.rdzv_id, b.rdzv_id);
  cmp("nnodes", a.nnodes, b.nnodes);
  cmp("nproc_per_node", a.nproc, b.nproc);
  cmp("max_restarts", a.max_restarts, b.max_restarts);
  cmp("ft_version", a.ft_version, b.ft_version);
  cmp("ft_commit", a.ft_commit, b.ft_commit);
  cmp("torch_version", a.torch_version, b.torch_version);
  cmp("cuda_version", a.cuda_version, b.cuda_version);
  cmp("nccl_version", a.nccl_version, b.nccl_version);
  cmp("gpu_name", a.gpu_name, b.gpu_name);
  cmp("gpu_count", a.gpu_count, b.gpu_count);
  cmp("program_hash", a.program_hash, b.program_hash);
  return d;
}

namespace {

struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(const void* p, size_t n) {
    auto* c = static_cast<const unsigned char*>(p);
    for (size_t i = 0; i < n; ++i) {
      h ^= c[i];
      h *= 1099511628211ull;
    }
  }
  void add(const std::string& s) {
    uint64_t n = s.size();
    add(&n, sizeof n);
    add(s.data(), s.size());
  }
};

std::string which(const std::string& prog) {
  if (prog.find('/') != std::string::npos) return prog;
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  size_t start = 0;
  while (start <= p.size()) {
    size_t colon = p.find(':', start);
    std::string dir =
        p.substr(start, colon == std::string::npos ? std::string::npos : colon - start);
    std::string cand = (dir.empty() ? "." : dir) + "/" + prog;
    struct stat st {};
    if (::stat(cand.c_str(), &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0111)) return cand;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return prog;
}

void add_file(Fnv& h, const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || st.st_size > (64ll << 20)) return;
  std::ifstream in(path, std::ios::binary);
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) h.add(buf, static_cast<size_t>(in.gcount()));
}

}  // namespace

std::string hash_program(const std::vector<std::string>& argv) {
  Fnv h;
  for (size_t i = 0; i < argv.size(); ++i) {
    h.add(argv[i]);
    add_file(h, i == 0 ? which(argv[i]) : argv[i]);
  }
  return fmt::format("{:016x}", h.h);
}

}  // namespace ft::launcher
