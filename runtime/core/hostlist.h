// SLURM compressed host lists ("gpu[01-04,07],cpu5") expanded without calling scontrol.
// Pure functions; thread-safe.
#pragma once

#include <string>
#include <vector>

namespace ft {

// Expands a SLURM host list in order; throws ConfigError naming the list on malformed input.
// Supports ranges with zero padding, several bracket groups per name ("r[1-2]n[01-02]") and commas.
std::vector<std::string> expand_hostlist(const std::string& list);

}  // namespace ft
