#include "failure.h"

#include <fmt/format.h>
#include <signal.h>

#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

#include "core/error.h"
#include "core/json.h"
#include "core/worker_contract.h"

namespace ft::launcher {

using nlohmann::json;

namespace {

constexpr FailureKind kKinds[] = {FailureKind::kWorker, FailureKind::kNode,   FailureKind::kHang,
                                  FailureKind::kRejoin, FailureKind::kSignal, FailureKind::kError};

FailureKind kind_named(const std::string& name) {
  for (FailureKind k : kKinds)
    if (name == kind_name(k)) return k;
  return FailureKind::kError;
}

}  // namespace

const char* kind_name(FailureKind kind) {
  switch (kind) {
    case FailureKind::kWorker:
      return "worker";
    case FailureKind::kNode:
      return "node";
    case FailureKind::kHang:
      return "hang";
    case FailureKind::kRejoin:
      return "rejoin";
    case FailureKind::kSignal:
      return "signal";
    case FailureKind::kError:
      return "error";
  }
  return "error";
}

bool restartable(FailureKind kind) {
  switch (kind) {
    case FailureKind::kWorker:
    case FailureKind::kNode:
    case FailureKind::kHang:
      return true;
    case FailureKind::kRejoin:
    case FailureKind::kSignal:
    case FailureKind::kError:
      return false;
  }
  return false;
}

std::string Failure::to_json() const {
  json j = {{"kind", kind_name(kind)},
            {"node_rank", node_rank},
            {"hostname", hostname},
            {"description", description}};
  if (worker) {
    j["rank"] = worker->global_rank;
    j["local_rank"] = worker->local_rank;
    j["exit_code"] = worker->exit_code;
    j["signal"] = worker->signal;
    j["elapsed_s"] = worker->elapsed_s;
    j["tail"] = worker->tail;
  }
  return j.dump();
}

Failure Failure::from_json(const std::string& text) {
  const std::string what = "a failure record in the store";
  const json j = parse_json<RendezvousError>(text, what);
  FT_CHECK_T(RendezvousError, j.is_object(), what, " is not a JSON object: ", excerpt(text));
  // Integers are checked as integers: nlohmann converts a float silently, and one out of range
  // with undefined behaviour.
  auto integer = [&](const char* key, int fallback) {
    if (!j.contains(key)) return fallback;
    FT_CHECK_T(RendezvousError, j[key].is_number_integer(), what, " has a \"", key,
               "\" that is not an integer: ", excerpt_json(j[key]));
    return j[key].get<int>();
  };
  try {
    Failure f;
    f.kind = kind_named(j.value("kind", ""));
    f.node_rank = integer("node_rank", -1);
    f.hostname = j.value("hostname", "?");
    f.description = j.value("description", "");
    if (f.kind == FailureKind::kWorker) {
      WorkerExit w;
      w.global_rank = integer("rank", -1);
      w.local_rank = integer("local_rank", -1);
      w.exit_code = integer("exit_code", 0);
      w.signal = integer("signal", 0);
      w.elapsed_s = j.value("elapsed_s", 0.0);
      w.tail = j.value("tail", std::vector<std::string>{});
      f.worker = std::move(w);
    }
    return f;
  } catch (const json::exception& e) {  // a field of another type
    throw RendezvousError(fmt::format("{} is unreadable ({}): {}", what, e.what(), excerpt(text)));
  }
}

Failure make_failure(FailureKind kind, int node_rank, std::string hostname, std::string description,
                     std::optional<WorkerExit> worker) {
  FT_ASSERT((kind == FailureKind::kWorker) == worker.has_value(),
            "a failure record carries a worker's exit exactly when it is a worker failure");
  Failure f;
  f.kind = kind;
  f.node_rank = node_rank;
  f.hostname = std::move(hostname);
  f.description = std::move(description);
  f.worker = std::move(worker);
  return f;
}

bool follows_peer_loss(const WorkerExit& w) {
  if (w.signal == SIGPIPE || (w.signal == 0 && w.exit_code == contract::kExitPeerLost)) return true;
  if (!w.failed()) return false;
  // Another program (torchrun-style): the last lines of its output say what broke.
  constexpr std::string_view kMarks[] = {"Connection reset by peer", "Connection closed by peer",
                                         "Broken pipe", "DistNetworkError"};
  const size_t from = w.tail.size() > 3 ? w.tail.size() - 3 : 0;
  for (size_t i = from; i < w.tail.size(); ++i)
    for (std::string_view mark : kMarks)
      if (w.tail[i].find(mark) != std::string::npos) return true;
  return false;
}

std::string summary_text(const Failure& f) {
  const std::string where = fmt::format("node {} ({})", f.node_rank, f.hostname);
  if (!f.worker) return fmt::format("job stopped: {} {}", where, f.description);
  const WorkerExit& w = *f.worker;
  std::string text = fmt::format(
      "job failed: first failure on {} rank {} (local rank {}): worker {} after {:.1f} s", where,
      w.global_rank, w.local_rank, f.description, w.elapsed_s);
  if (!w.tail.empty()) {
    text += fmt::format("\n  last {} line(s) of rank {}'s output:", w.tail.size(), w.global_rank);
    for (const auto& line : w.tail) text += "\n  | " + line;
  }
  return text;
}

}  // namespace ft::launcher
