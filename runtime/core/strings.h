// Small string helpers shared by the launcher and the runtime. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <string>

namespace ft {

// Levenshtein distance, for "did you mean" suggestions on mistyped flags and preset keys.
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace ft
