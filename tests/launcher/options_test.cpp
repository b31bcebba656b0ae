// Unit tests: option precedence (flag > FT_/PET_ > plain env > SLURM > default), SLURM host lists,
// validation messages.
#include "options.h"

#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>

#include "core/error.h"
#include "core/hostlist.h"
#include "worker_env.h"

using namespace ft::launcher;
using ft::expand_hostlist;

namespace {
LaunchConfig config(const std::map<std::string, std::string>& flags, const EnvMap& env,
                    int gpus = 0) {
  return make_launch_config(resolve_options(flags, env), {"true"}, gpus, 8);
}
}  // namespace

TEST_CASE("SLURM host lists expand like scontrol show hostnames", "[unit]") {
  CHECK(expand_hostlist("gpu[01-04,07],cpu5") ==
        std::vector<std::string>{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu5"});
  CHECK(expand_hostlist("node1") == std::vector<std::string>{"node1"});
  CHECK(expand_hostlist("a[8-10]") == std::vector<std::string>{"a8", "a9", "a10"});
  CHECK(expand_hostlist("r[1-2]n[01-02]") ==
        std::vector<std::string>{"r1n01", "r1n02", "r2n01", "r2n02"});
  CHECK(expand_hostlist("x[009-011]") == std::vector<std::string>{"x009", "x010", "x011"});
  CHECK_THROWS_WITH(expand_hostlist("gpu[01-04"), Catch::Contains("missing ']'"));
  CHECK_THROWS_WITH(expand_hostlist("gpu[04-01]"), Catch::Contains("range '04-01'"));
  CHECK_THROWS_AS(expand_hostlist("gpu[a-b]"), ft::ConfigError);
  // More than 100,000 hosts is refused before they are built, quickly: many large ranges in one
  // set (found by the fuzzer, which took 14 s on such a list), or groups that multiply.
  std::string many = "n[0-99998";
  for (int i = 0; i < 30; ++i) many += ",0-99998";
  many += "]";
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(expand_hostlist(many), Catch::Contains("names more than 100000 hosts"));
  CHECK_THROWS_WITH(expand_hostlist("a[0-99999]b[0-99999]"),
                    Catch::Contains("names more than 100000 hosts"));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
  for (const char* groups : {"r[0-9]c[0-9]n[0-9]x[0-9]y[0-9]z[0-9]",  // 10^6, found by the fuzzer
                             "e[0-999]v[0-999]l[0-999]"}) {
    CHECK_THROWS_WITH(expand_hostlist(groups), Catch::Contains("names more than 100000 hosts"));
  }
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(2));
  CHECK(expand_hostlist("n[0-99999]").size() == 100000);
  // 100,000 names of 100 characters: refused before 10 MB of names are built (the fuzzer's slow
  // inputs were 100,000 names of 380).
  CHECK_THROWS_WITH(expand_hostlist(std::string(95, 'h') + "[0-99999]"),
                    Catch::Contains("more than 8 MiB of host names"));
  CHECK(expand_hostlist(std::string(60, 'h') + "[0-99999]").size() == 100000);
  CHECK(expand_hostlist("n[0-49999],m[0-49999]").size() == 100000);
  CHECK_THROWS(expand_hostlist("n[0-49999],m[0-50000]"));
  CHECK(expand_hostlist("a[007,9]") == std::vector<std::string>{"a007", "a9"});
}

TEST_CASE("precedence: flag > FT_/PET_ > plain env > SLURM > default", "[unit]") {
  EnvMap env = {
      {"NNODES", "2"}, {"PET_NNODES", "3"}, {"SLURM_NNODES", "5"}, {"SLURM_JOB_ID", "77"}};
  auto r = resolve_options({}, env);
  CHECK(r["nnodes"].value == "3");
  CHECK(r["nnodes"].source == "env PET_NNODES");
  r = resolve_options({{"nnodes", "4"}}, env);
  CHECK(r["nnodes"].value == "4");
  CHECK(r["nnodes"].source == "flag --nnodes");
  env.erase("PET_NNODES");
  CHECK(resolve_options({}, env)["nnodes"].source == "env NNODES");
  env.erase("NNODES");
  CHECK(resolve_options({}, env)["nnodes"].value == "5");
  CHECK(resolve_options({}, env)["nnodes"].source == "SLURM_NNODES");
  CHECK(resolve_options({}, {})["nnodes"].source == "default");
  // FT_ beats PET_.
  CHECK(resolve_options({}, {{"FT_MASTER_PORT", "1"}, {"PET_MASTER_PORT", "2"}})["master-port"]
            .value == "1");
}

TEST_CASE("SLURM supplies nnodes, node rank, master (first host) and job id", "[unit]") {
  EnvMap env = {{"SLURM_JOB_ID", "4242"},
                {"SLURM_NNODES", "4"},
                {"SLURM_NODEID", "2"},
                {"SLURM_JOB_NODELIST", "gpu[07-08,10],gpu12"},
                {"SLURM_LAUNCH_NODE_IPADDR", "10.9.9.9"}};
  auto c = config({}, env);
  CHECK(c.max_nodes == 4);
  CHECK(c.node_rank == 2);
  CHECK(c.rdzv_host == "gpu07");  // never the submit host
  CHECK(c.rdzv_id == "4242");
  CHECK(c.sources["master-addr"].source.find("SLURM_JOB_NODELIST") != std::string::npos);
  // A plain MASTER_ADDR (e.g. from the sbatch script) wins over the node list.
  env["MASTER_ADDR"] = "10.0.0.1";
  CHECK(config({}, env).rdzv_host == "10.0.0.1");
}

TEST_CASE("an elastic --nnodes inside srun drops SLURM_NODEID, a user's --node-rank is refused",
          "[unit]") {
  const EnvMap env = {{"SLURM_JOB_ID", "4242"},
                      {"SLURM_NNODES", "2"},
                      {"SLURM_NODEID", "1"},
                      {"SLURM_JOB_NODELIST", "node[0-1]"}};
  auto c = config({{"nnodes", "1:2"}}, env);
  CHECK(c.min_nodes == 1);
  CHECK(c.max_nodes == 2);
  CHECK_FALSE(c.node_rank.has_value());  // join order
  CHECK_THAT(c.sources["node-rank"].source, Catch::Contains("SLURM_NODEID not used"));
  CHECK(c.rdzv_host == "node0");
  EnvMap user = env;
  user["NODE_RANK"] = "1";
  CHECK_THROWS_WITH(config({{"nnodes", "1:2"}}, user),
                    Catch::Contains("--node-rank cannot be combined with an elastic --nnodes"));
}

TEST_CASE("nproc-per-node auto/gpu/cpu/number", "[unit]") {
  CHECK(config({}, {}, 0).nproc_per_node == 1);
  CHECK(config({}, {}, 8).nproc_per_node == 8);
  CHECK(config({{"nproc-per-node", "cpu"}}, {}, 0).nproc_per_node == 8);
  CHECK(config({{"nproc-per-node", "3"}}, {}, 0).nproc_per_node == 3);
  CHECK_THROWS_WITH(config({{"nproc-per-node", "gpu"}}, {}, 0), Catch::Contains("sees no GPU"));
  CHECK_THROWS_WITH(config({{"nproc-per-node", "x"}}, {{"NPROC_PER_NODE", "x"}}, 0),
                    Catch::Contains("--nproc-per-node must be an integer"));
}

TEST_CASE("rdzv endpoint, standalone and nnodes ranges", "[unit]") {
  auto c = config({{"rdzv-endpoint", "10.1.2.3:1234"}, {"master-addr", "ignored"}}, {});
  CHECK(c.rdzv_host == "10.1.2.3");
  CHECK(c.rdzv_port == 1234);
  c = config({{"standalone", "1"}, {"nnodes", "3"}}, {});
  CHECK(c.max_nodes == 1);
  CHECK(c.rdzv_port == 0);
  CHECK(c.rdzv_host == "127.0.0.1");
  c = config({{"nnodes", "2:4"}}, {});
  CHECK(c.min_nodes == 2);
  CHECK(c.max_nodes == 4);
  CHECK_THROWS_WITH(config({{"nnodes", "4:2"}}, {}), Catch::Contains("MIN <= MAX"));
  CHECK_THROWS_WITH(config({{"nnodes", "2:4"}, {"node-rank", "1"}}, {}),
                    Catch::Contains("cannot be combined with an elastic"));
  CHECK_THROWS_WITH(config({{"nnodes", "2"}}, {{"NODE_RANK", "2"}}),
                    Catch::Contains("--node-rank 2 (from env NODE_RANK) must be below --nnodes 2"));
  CHECK_THROWS_WITH(config({{"nnodes", "2"}, {"master-port", "0"}}, {}),
                    Catch::Contains("only with --nnodes 1"));
  CHECK_THROWS_WITH(config({{"rdzv-endpoint", "nohostport"}}, {}), Catch::Contains("HOST:PORT"));
  CHECK_THROWS_WITH(config({{"term-grace", "-1"}}, {}), Catch::Contains("--term-grace"));
}

TEST_CASE("term-grace is auto unless a number is given", "[unit]") {
  CHECK_FALSE(config({}, {}).term_grace_s.has_value());
  CHECK(config({}, {}).sources.at("term-grace").value == "auto");
  CHECK(config({{"term-grace", "auto"}}, {}).term_grace_s == std::nullopt);
  CHECK(config({{"term-grace", "40"}}, {}).term_grace_s == 40.0);
  CHECK(config({}, {{"FT_TERM_GRACE", "0.5"}}).term_grace_s == 0.5);
  CHECK(config({{"term-grace", "auto"}}, {{"FT_TERM_GRACE", "9"}}).term_grace_s == std::nullopt);
  CHECK_THROWS_WITH(config({}, {{"FT_TERM_GRACE", "long"}}),
                    Catch::Contains("--term-grace must be a number of seconds >= 0 or auto, got "
                                    "'long' (from env FT_TERM_GRACE)"));
}

TEST_CASE("a program is required", "[unit]") {
  CHECK_THROWS_WITH(make_launch_config(resolve_options({}, {}), {}, 0, 1),
                    Catch::Contains("no program to run"));
}

TEST_CASE("the option table documents every option with its env mirrors", "[unit]") {
  std::string md = options_markdown();
  for (const auto& spec : launch_option_specs()) {
    CHECK(md.find("`--" + spec.name + "`") != std::string::npos);
    for (const auto& e : spec.env) CHECK(md.find("`" + e + "`") != std::string::npos);
  }
}

TEST_CASE("docs/launcher.md carries the generated option table", "[unit]") {
  std::ifstream in(std::string(FT_TEST_DIR) + "/../docs/launcher.md");
  std::string doc((std::istreambuf_iterator<char>(in)), {});
  REQUIRE(!doc.empty());
  INFO("regenerate with: build/bin/ft launch --print-options-md");
  CHECK(doc.find(options_markdown()) != std::string::npos);
}

TEST_CASE("ft launch --bind-cores shares: contiguous, as equal as they come, refused below one",
          "[unit]") {
  using ft::launcher::core_shares;
  using ft::launcher::cpu_list_text;
  CHECK(core_shares({0, 1, 2, 3, 4}, 2) == std::vector<std::vector<int>>{{0, 1, 2}, {3, 4}});
  CHECK(core_shares({4, 5, 8, 9}, 4) == std::vector<std::vector<int>>{{4}, {5}, {8}, {9}});
  CHECK(core_shares({0, 1, 2, 3, 4, 5, 6, 7}, 3) ==
        std::vector<std::vector<int>>{{0, 1, 2}, {3, 4, 5}, {6, 7}});
  CHECK(cpu_list_text({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11");
  CHECK(cpu_list_text({5}) == "5");
  CHECK_THROWS_WITH(core_shares({0, 1}, 3),
                    Catch::Contains("--bind-cores: 3 worker(s) per node but this launcher may run "
                                    "on 2 core(s) (0-1)"));
  // The flag and its environment mirror.
  CHECK(config({{"bind-cores", "1"}}, {}).bind_cores);
  CHECK(config({}, {{"FT_BIND_CORES", "1"}}).bind_cores);
  CHECK_FALSE(config({}, {}).bind_cores);
}

TEST_CASE("an unknown option gets the one meant: a typo, or a shortened name") {
  CHECK(suggest_option("--nproc-per-nod") == " (did you mean --nproc-per-node?)");
  CHECK(suggest_option("--nproc_per_node") == " (did you mean --nproc-per-node?)");
  CHECK(suggest_option("--nproc") == " (did you mean --nproc-per-node?)");  // issue 51
  CHECK(suggest_option("--nproc=2") == " (did you mean --nproc-per-node?)");
  CHECK(suggest_option("--foo").empty());
  CHECK(suggest_option("--no").empty());  // too short to stand for one option
}
