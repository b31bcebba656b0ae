// Small string helpers shared by the launcher and the runtime. Pure functions; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ft {

// Levenshtein distance, for "did you mean" suggestions on mistyped flags and preset keys.
size_t edit_distance(const std::string& a, const std::string& b);

// Bytes for people: "512 B", "3.2 KiB", "1.5 MiB", "70.1 GiB" (binary units, one decimal).
std::string human_bytes(int64_t bytes);

// Seconds for people: "0.4 ms", "85.2 ms", "3.10 s", "12.5 min", "2.4 h".
std::string human_seconds(double seconds);

// Appends code point `cp` (at most U+10FFFF) to `out` as UTF-8.
void append_utf8(char32_t cp, std::string& out);

}  // namespace ft
