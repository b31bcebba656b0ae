// Test support: start real processes (ft launch, workers) with their output in a file, wait with a
// deadline, inspect what is left; the files tests read and damage. Not thread-safe; one test
// thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace ft::test {

struct Child {
  pid_t pid = -1;
  std::string out_path;  // stdout and stderr together
  std::string output() const;
};

// Starts argv with the current environment plus `env` (a value of "\x01" removes the variable).
Child start(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const std::string& out_path);

// Exit status as a shell reports it (code, or 128+signal); nullopt if still running at the
// deadline.
std::optional<int> wait_for(Child& c, double timeout_s);
// Ends a test case that cannot run here (no root, no tmpfs, no namespaces): prints "SKIP: why"
// and exits 77, which CTest shows as skipped for executables registered SKIPPABLE
// (tests/CMakeLists.txt). Catch2 2.x has no SKIP(); run by hand, the test fails visibly with 77.
[[noreturn]] void skip_test(const std::string& why);

// Kills (SIGKILL) and reaps a child that is still running.
void kill_and_reap(Child& c);

// A program run to its end.
struct Finished {
  int code = -1;  // exit status as wait_for gives it; -1 when it ran past its deadline
  std::string output;
};
// Starts argv as `start` does, waits up to `timeout_s` (then kills it) and reads its output.
Finished run_to_end(const std::vector<std::string>& argv,
                    const std::map<std::string, std::string>& env, const std::string& out_path,
                    double timeout_s);
// Runs this build's ft with `args` as a user runs it (one process: the launcher's WORLD_SIZE and
// RANK removed), its output in `out_path`: its exit status, or -1 when it ran past `timeout_s`
// (then it is killed).
int run_ft(const std::vector<std::string>& args, const std::string& out_path,
           double timeout_s = 240);

// A TCP port nothing holds, for a launcher to bind soon after: below the kernel's ephemeral range,
// so that no bind(0) or outgoing connection of another process takes it meanwhile.
int free_port();
// A socket listening on all addresses at a free port (a port some other program holds); -1 on
// error.
int listen_on_free_port(int* port);
// True when pid exists and is not a zombie.
bool pid_alive(pid_t pid);
// Direct children of `pid` (from /proc/<child>/stat): a launcher's workers.
std::vector<pid_t> children_of(pid_t pid);
// The RANK in a worker's environment (/proc/<pid>/environ); -1 when it has none.
int rank_of_worker(pid_t pid);
std::string read_file(const std::string& path);
// A fresh directory under $TMPDIR (or /tmp), removed with everything in it when the test process
// exits normally (a failed Catch2 assertion included); FT_KEEP_TEST_DIRS=1 keeps them and prints
// where they are.
std::string make_temp_dir();
// Fault injection: XORs `mask` into the byte `from_end` bytes before the end of the file.
void flip_bits(const std::string& path, int64_t from_end, unsigned char mask);
// All lines of `text` containing `needle`.
std::vector<std::string> lines_with(const std::string& text, const std::string& needle);
// What a failed assertion shows of a program's output: its last `lines` lines (where the error and
// a launcher's failure summary are), after a line counting those left out. A log that keeps only
// the start of a long message (CI's) then still shows the cause, not the start-up banner.
std::string output_tail(const std::string& output, size_t lines = 60);

inline std::string ft_bin() { return FT_BIN; }
inline std::string ft_python() { return FT_PYTHON; }
inline std::string test_dir() { return FT_TEST_DIR; }

}  // namespace ft::test
