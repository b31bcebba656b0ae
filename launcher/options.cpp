#include "options.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <ctime>

#include "core/error.h"
#include "core/strings.h"

namespace ft::launcher {

const std::vector<OptionSpec>& launch_option_specs() {
  // name, value, default, help, env mirrors (FT_/PET_ first, then plain), scheduler sources
  // clang-format off
  static const std::vector<OptionSpec> specs = {
      {"nnodes", "N|MIN:MAX", "1",
       "Number of nodes, or MIN:MAX for an elastic job that starts once MIN nodes have joined.",
       {"FT_NNODES", "PET_NNODES", "NNODES"}, {"SLURM_NNODES", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}},
      {"nproc-per-node", "N|auto|gpu|cpu", "auto",
       "Workers on this node. auto/gpu: one per visible GPU (1 when there is none); cpu: one per core.",
       {"FT_NPROC_PER_NODE", "PET_NPROC_PER_NODE", "NPROC_PER_NODE"}, {}},
      {"node-rank", "R", "",
       "This node's rank in [0, nnodes). Unset: assigned in the order nodes join.",
       {"FT_NODE_RANK", "PET_NODE_RANK", "NODE_RANK"},
       {"SLURM_NODEID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"}},
      {"master-addr", "HOST", "127.0.0.1",
       "Address of node 0, which hosts the rendezvous store. Used as given, never reverse-resolved.",
       {"FT_MASTER_ADDR", "PET_MASTER_ADDR", "MASTER_ADDR"},
       {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}},
      {"master-port", "PORT", "29500",
       "Port of the rendezvous store on node 0. 0 picks a free port (single node only).",
       {"FT_MASTER_PORT", "PET_MASTER_PORT", "MASTER_PORT"}, {}},
      {"rdzv-endpoint", "HOST:PORT", "",
       "Rendezvous store endpoint; overrides --master-addr/--master-port when given.",
       {"FT_RDZV_ENDPOINT", "PET_RDZV_ENDPOINT"}, {}},
      {"rdzv-backend", "static|c10d", "static",
       "Accepted for torchrun compatibility: both mean ft's rendezvous over c10d's TCPStore.",
       {"FT_RDZV_BACKEND", "PET_RDZV_BACKEND"}, {}},
      {"rdzv-id", "ID", "none",
       "Job id every node must agree on; a node with another id is refused.",
       {"FT_RDZV_ID", "PET_RDZV_ID"}, {"SLURM_JOB_ID"}},
      {"rdzv-timeout", "SECONDS", "600",
       "How long to wait for all nodes to join (and for the store to answer).",
       {"FT_RDZV_TIMEOUT", "PET_RDZV_TIMEOUT"}, {}},
      {"rdzv-last-call", "SECONDS", "30",
       "With --nnodes MIN:MAX: after MIN nodes joined, how long to wait for more.",
       {"FT_RDZV_LAST_CALL", "PET_RDZV_LAST_CALL"}, {}},
      {"standalone", "", "",
       "Single-node job on a free local port with a fresh id; ignores master/rendezvous settings.",
       {"FT_STANDALONE", "PET_STANDALONE"}, {}},
      {"max-restarts", "K", "0",
       "Restarts of the whole job after a failure, one budget for all nodes.",
       {"FT_MAX_RESTARTS", "PET_MAX_RESTARTS"}, {}},
      {"monitor-interval", "SECONDS", "0.1", "How often workers and the store are checked.",
       {"FT_MONITOR_INTERVAL", "PET_MONITOR_INTERVAL"}, {}},
      {"log-dir", "DIR", "",
       "Also write each worker's full output to DIR/attempt_<restart>/node<N>.rank<R>.log.",
       {"FT_LOG_DIR", "PET_LOG_DIR"}, {}},
      {"advertise-addr", "ADDR", "",
       "Address other nodes should use for this node. Default: the local address that reaches the store.",
       {"FT_ADVERTISE_ADDR"}, {}},
      {"term-grace", "SECONDS|auto", "auto",
       "Seconds between SIGTERM and SIGKILL when stopping workers. auto: 15, or, when the workers "
       "are to checkpoint (a signal, a node joining), as long as ft train's workers report that "
       "finishing their step and saving a checkpoint takes, with margin.",
       {"FT_TERM_GRACE"}, {}},
      {"heartbeat-timeout", "SECONDS", "10",
       "A node whose launcher sends no heartbeat through the store for this long is declared lost: "
       "the others stop their workers and start a new round (a restart).",
       {"FT_HEARTBEAT_TIMEOUT"}, {}},
      {"hang-timeout", "SECONDS", "600",
       "A worker that reported progress (ft train does, every step) and then reports none for "
       "this long is hung: the job is stopped and restarted. 0 turns it off.",
       {"FT_HANG_TIMEOUT"}, {}},
      {"role", "NAME", "default", "Worker role name (ROLE_NAME).", {"FT_ROLE", "PET_ROLE"}, {}},
      {"bind-cores", "", "",
       "Bind each local worker to its own equal share of the cores this launcher may run on "
       "(contiguous, in order; DeepSpeed's --bind_cores_to_rank), with OMP_NUM_THREADS that many "
       "unless set: a host optimizer step then gets its cores to itself. Refused when there are "
       "fewer cores than workers.",
       {"FT_BIND_CORES"}, {}},
      {"no-python", "", "",
       "Run PROGRAM as given even when it ends in .py (otherwise a .py PROGRAM runs as "
       "`python3 -u PROGRAM`, as torchrun does).",
       {"FT_NO_PYTHON", "PET_NO_PYTHON"}, {}},
      {"dry-run", "", "",
       "Print the resolved layout, where each value came from and the worker environment; run nothing.",
       {"FT_DRY_RUN"}, {}},
  };
  // clang-format on
  return specs;
}

const OptionSpec& launch_option_spec(const std::string& name) {
  for (const auto& s : launch_option_specs())
    if (s.name == name) return s;
  FT_ASSERT(false, "unknown option ", name);
  throw;  // unreachable
}

namespace {

// The scheduler's value for an option, with a description of its source.
std::optional<Resolved> from_scheduler(const std::string& name, const sched::SchedulerNode& n) {
  const std::optional<sched::NodeValue>* v = nullptr;
  if (name == "nnodes") v = &n.nnodes;
  if (name == "node-rank") v = &n.node_rank;
  if (name == "master-addr") {
    FT_CHECK(n.master_refusal.empty(), n.master_refusal);
    v = &n.master_addr;
  }
  if (name == "rdzv-id") v = &n.job_id;
  if (!v || !*v) return {};
  return Resolved{(*v)->value, (*v)->source};
}

bool truthy(const std::string& v) {
  return v == "1" || v == "true" || v == "True" || v == "TRUE" || v == "yes" || v == "on";
}

int to_int(const Resolved& r, const std::string& name, long lo, long hi) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(r.value.c_str(), &end, 10);
  FT_CHECK(errno == 0 && end && *end == '\0' && !r.value.empty() && v >= lo && v <= hi, "--", name,
           " must be an integer in [", lo, ", ", hi, "], got '", r.value, "' (from ", r.source,
           ")");
  return static_cast<int>(v);
}

// `word`: another value the option takes besides a number ("auto"), for the message.
double to_seconds(const Resolved& r, const std::string& name, double lo,
                  const std::string& word = "") {
  char* end = nullptr;
  double v = std::strtod(r.value.c_str(), &end);
  FT_CHECK(end && *end == '\0' && !r.value.empty() && std::isfinite(v) && v >= lo, "--", name,
           " must be a number of seconds >= ", lo, word.empty() ? "" : " or " + word, ", got '",
           r.value, "' (from ", r.source, ")");
  return v;
}

}  // namespace

std::map<std::string, Resolved> resolve_options(const std::map<std::string, std::string>& flags,
                                                const EnvMap& env) {
  std::map<std::string, Resolved> out;
  const sched::SchedulerNode node = sched::scheduler_node(env);
  for (const auto& spec : launch_option_specs()) {
    Resolved r{spec.default_value, "default"};
    bool found = false;
    if (auto it = flags.find(spec.name); it != flags.end()) {
      r = {it->second, "flag --" + spec.name};
      found = true;
    }
    for (size_t i = 0; !found && i < spec.env.size(); ++i) {
      if (auto v = sched::env_value(env, spec.env[i]); !v.empty()) {
        r = {v, "env " + spec.env[i]};
        found = true;
      }
    }
    if (!found) {
      if (auto s = from_scheduler(spec.name, node)) r = *s;
    }
    if (spec.is_flag() && r.source != "default") r.value = truthy(r.value) ? "1" : "";
    out[spec.name] = r;
  }
  // Launchers that mpirun put side by side on one host would each start a worker per GPU.
  const bool node_from_mpi =
      node.tasks_on_host > 1 && node.node_rank && out["node-rank"].source == node.node_rank->source;
  FT_CHECK(!node_from_mpi || out["nproc-per-node"].source != "default", node.tasks_on_host_var, "=",
           node.tasks_on_host, ": ", node.tasks_on_host,
           " ft launch tasks run on this host, and each would start one worker per GPU "
           "(--nproc-per-node auto): run one per node (mpirun --map-by ppr:1:node) or give "
           "--nproc-per-node so that they share the host");
  return out;
}

std::pair<int, int> parse_nnodes(const std::string& text, const std::string& source) {
  size_t colon = text.find(':');
  auto num = [&](const std::string& s) { return to_int(Resolved{s, source}, "nnodes", 1, 100000); };
  if (colon == std::string::npos) {
    int n = num(text);
    return {n, n};
  }
  int lo = num(text.substr(0, colon)), hi = num(text.substr(colon + 1));
  FT_CHECK(lo <= hi, "--nnodes MIN:MAX needs MIN <= MAX, got '", text, "' (from ", source, ")");
  return {lo, hi};
}

LaunchConfig make_launch_config(const std::map<std::string, Resolved>& r,
                                std::vector<std::string> program, int visible_gpus, int cpu_cores) {
  LaunchConfig c;
  c.sources = r;
  auto get = [&](const char* name) -> const Resolved& { return r.at(name); };

  c.standalone = get("standalone").set();
  c.dry_run = get("dry-run").set();
  c.bind_cores = get("bind-cores").set();
  std::tie(c.min_nodes, c.max_nodes) = parse_nnodes(get("nnodes").value, get("nnodes").source);

  c.nproc_spec = get("nproc-per-node").value;
  if (c.nproc_spec == "auto" || c.nproc_spec == "gpu") {
    FT_CHECK(c.nproc_spec == "auto" || visible_gpus > 0,
             "--nproc-per-node gpu asks for one worker per GPU, but this node sees no GPU (from ",
             get("nproc-per-node").source, "); use a number or 'auto'");
    c.nproc_per_node = visible_gpus > 0 ? visible_gpus : 1;
  } else if (c.nproc_spec == "cpu") {
    c.nproc_per_node = std::max(1, cpu_cores);
  } else {
    c.nproc_per_node = to_int(get("nproc-per-node"), "nproc-per-node", 1, 4096);
  }

  if (get("node-rank").set()) c.node_rank = to_int(get("node-rank"), "node-rank", 0, 99999);
  // An elastic job assigns ranks in join order. A scheduler's task index (SLURM_NODEID, mpirun's
  // rank) is no request of the user's: a `--nnodes MIN:MAX` inside `srun` or `mpirun` drops it
  // rather than refusing the job.
  const auto& rank_vars = launch_option_spec("node-rank").scheduler;
  const std::string& rank_source = get("node-rank").source;
  if (c.node_rank && c.min_nodes != c.max_nodes &&
      std::find(rank_vars.begin(), rank_vars.end(), rank_source) != rank_vars.end()) {
    c.node_rank.reset();
    c.sources["node-rank"] = {"", "join order; " + rank_source + " not used with --nnodes MIN:MAX"};
  }

  std::string host = get("master-addr").value;
  int port = to_int(get("master-port"), "master-port", 0, 65535);
  if (get("rdzv-endpoint").set()) {
    const std::string& ep = get("rdzv-endpoint").value;
    size_t colon = ep.rfind(':');
    FT_CHECK(colon != std::string::npos && colon > 0, "--rdzv-endpoint must be HOST:PORT, got '",
             ep, "' (from ", get("rdzv-endpoint").source, ")");
    host = ep.substr(0, colon);
    if (host.size() > 2 && host.front() == '[' && host.back() == ']')
      host = host.substr(1, host.size() - 2);
    port = to_int(Resolved{ep.substr(colon + 1), get("rdzv-endpoint").source}, "rdzv-endpoint port",
                  0, 65535);
  }
  c.rdzv_id = get("rdzv-id").value;
  const std::string& backend = get("rdzv-backend").value;
  FT_CHECK(backend == "static" || backend == "c10d", "--rdzv-backend '", backend, "' (from ",
           get("rdzv-backend").source,
           ") is not supported: ft rendezvouses over c10d's TCPStore; use static or c10d");
  if (c.standalone) {
    // torchrun's --standalone: one node, a free port on loopback, a fresh id.
    c.min_nodes = c.max_nodes = 1;
    c.node_rank = 0;
    host = "127.0.0.1";
    port = 0;
    if (get("rdzv-id").source == "default") {
      c.rdzv_id = fmt::format("standalone-{:x}-{:x}", ::getpid(), ::time(nullptr));
      c.sources["rdzv-id"] = {c.rdzv_id, "--standalone"};
    }
    c.sources["nnodes"] = {"1", "--standalone"};
    c.sources["master-addr"] = {host, "--standalone"};
    c.sources["master-port"] = {"0", "--standalone"};
  }
  // A single-node job always hosts its own store: never join someone else's port.
  if (c.max_nodes == 1 && !c.node_rank) {
    c.node_rank = 0;
    c.sources["node-rank"] = {"0", "--nnodes 1"};
  }
  c.rdzv_host = host;
  c.rdzv_port = static_cast<uint16_t>(port);
  FT_CHECK(!c.rdzv_host.empty(), "--master-addr is empty (from ", get("master-addr").source, ")");
  FT_CHECK(port != 0 || c.max_nodes == 1,
           "--master-port 0 picks a free port that other nodes cannot know; use it only with "
           "--nnodes 1 or --standalone, or give a fixed port");

  c.rdzv_timeout_s = to_seconds(get("rdzv-timeout"), "rdzv-timeout", 0.1);
  c.rdzv_last_call_s = to_seconds(get("rdzv-last-call"), "rdzv-last-call", 0);
  c.max_restarts = to_int(get("max-restarts"), "max-restarts", 0, 1000000);
  c.monitor_interval_s = to_seconds(get("monitor-interval"), "monitor-interval", 0.001);
  if (get("term-grace").value != "auto")  // auto: grace.h sizes the wait when it comes
    c.term_grace_s = to_seconds(get("term-grace"), "term-grace", 0, "auto");
  c.heartbeat_timeout_s = to_seconds(get("heartbeat-timeout"), "heartbeat-timeout", 0.5);
  c.hang_timeout_s = to_seconds(get("hang-timeout"), "hang-timeout", 0);
  c.log_dir = get("log-dir").value;
  c.advertise_addr = get("advertise-addr").value;
  c.role = get("role").value;

  if (c.node_rank) {
    FT_CHECK(c.min_nodes == c.max_nodes, "--node-rank cannot be combined with an elastic --nnodes ",
             get("nnodes").value, ": ranks are assigned in join order there (node-rank from ",
             get("node-rank").source, ")");
    FT_CHECK(*c.node_rank < c.max_nodes, "--node-rank ", *c.node_rank, " (from ",
             get("node-rank").source, ") must be below --nnodes ", c.max_nodes, " (from ",
             get("nnodes").source, ")");
  }
  FT_CHECK(!program.empty(),
           "no program to run: ft launch [options] -- PROGRAM [ARGS...], or ft launch [options] "
           "--preset NAME --output DIR [--set key=value ...] to run ft train on every worker");
  const std::string& p0 = program.front();
  if (!get("no-python").set() && p0.size() > 3 && p0.compare(p0.size() - 3, 3, ".py") == 0) {
    program.insert(program.begin(), {"python3", "-u"});  // torchrun's default for scripts
  }
  c.program = std::move(program);
  return c;
}

std::string suggest_option(const std::string& given) {
  std::string g = given.substr(given.find_first_not_of('-') == std::string::npos
                                   ? given.size()
                                   : given.find_first_not_of('-'));
  g = g.substr(0, g.find('='));
  std::replace(g.begin(), g.end(), '_', '-');
  std::string best;
  size_t best_d = 3;  // at most two edits away
  for (const auto& spec : launch_option_specs()) {
    size_t d = edit_distance(g, spec.name);
    if (d < best_d) {
      best_d = d;
      best = spec.name;
    }
  }
  // A shortened name (--nproc, --master) is a prefix of the option meant, however many edits away.
  for (const auto& spec : launch_option_specs())
    if (best.empty() && g.size() >= 3 && spec.name.rfind(g, 0) == 0) best = spec.name;
  return best.empty() ? "" : " (did you mean --" + best + "?)";
}

namespace {
// Markdown table cells: '|' splits cells and '<...>' reads as HTML.
std::string md_escape(const std::string& text) {
  std::string out;
  for (char ch : text) {
    if (ch == '|')
      out += "\\|";
    else if (ch == '<')
      out += "&lt;";
    else if (ch == '>')
      out += "&gt;";
    else
      out += ch;
  }
  return out;
}
}  // namespace

std::string options_markdown() {
  std::string s =
      "| flag | value | default | environment | scheduler | meaning |\n|---|---|---|---|---|---|\n";
  for (const auto& o : launch_option_specs()) {
    std::string env, sched;
    for (const auto& e : o.env) env += (env.empty() ? "" : ", ") + ("`" + e + "`");
    for (const auto& e : o.scheduler) sched += (sched.empty() ? "" : ", ") + ("`" + e + "`");
    s += fmt::format("| `--{}` | {} | {} | {} | {} | {} |\n", o.name,
                     o.is_flag() ? "flag" : "`" + md_escape(o.value_name) + "`",
                     o.default_value.empty() ? "unset" : "`" + o.default_value + "`", env, sched,
                     md_escape(o.help));
  }
  return s;
}

}  // namespace ft::launcher
