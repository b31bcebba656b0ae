// JSONL compressed with gzip (zlib, concatenated members too) or zstd (libzstd, any number of
// frames). Neither has random access: opening decompresses the file once to count its records
// (a progress line on stderr every 10 s), and records are then read forward in blocks
// (streamed_records.h), from the start again for a record before the reader's position.
// Thread-safe, as every RecordFile.
#pragma once

#include <memory>
#include <string>

#include "data/record_file.h"

namespace ft::data {

enum class Compression { kGzip, kZstd };

// FormatError naming the file (and the line reached) for corrupt or truncated data.
std::unique_ptr<RecordFile> open_compressed_jsonl(const std::string& path, Compression codec);

}  // namespace ft::data
