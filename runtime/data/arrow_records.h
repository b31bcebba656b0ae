// Parquet files and Arrow IPC data (an .arrow file in the file or the stream format, or the folder
// `datasets.save_to_disk` writes: dataset_info.json, state.json naming its data-*.arrow files)
// through Apache Arrow's C++ library, the one the pyarrow wheel ships. A row becomes the JSON
// object of its columns (strings, numbers, booleans, nulls, lists, structs, maps with string keys,
// dictionary-encoded values), the record a JSONL line would be. Arrow data is memory-mapped and
// read in place; Parquet is decoded a record batch at a time (streamed_records.h). Thread-safe.
#pragma once

#include <memory>
#include <string>

#include "data/record_file.h"

namespace ft::data {

// FormatError naming the file for one Arrow cannot read (truncated, not Parquet, ...).
std::unique_ptr<RecordFile> open_parquet(const std::string& path);
// `path`: an .arrow file, or a save_to_disk folder (refused, with the splits named, when it is a
// DatasetDict's).
std::unique_ptr<RecordFile> open_arrow(const std::string& path);

}  // namespace ft::data
