#include "ckpt/checkpoint.h"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "ckpt/crc32c.h"
#include "core/build_info.h"
#include "core/error.h"
#include "core/json.h"
#include "io/durable_file.h"
#include "io/safetensors.h"
#include "io/storage.h"

namespace ft::ckpt {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string rank_file(int rank, const char* ext) { return fmt::format("rank-{:05d}{}", rank, ext); }

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// The records ft wrote (a rank's record, meta.json) are read back from storage, where they may be
// damaged. nlohmann converts a float to an integer silently, and out of range with undefined
// behaviour: integers are checked as integers, and shapes for a product that fits.
int64_t integer_of(const json& j, const std::string& where, const char* what) {
  FT_CHECK_T(FormatError, j.is_number_integer(), where, ": ", what, " must be an integer, got ",
             excerpt_json(j));
  return j.get<int64_t>();
}

// The element count of a shape: non-negative dimensions whose product fits in int64.
int64_t numel_of(const json& shape, const std::string& where) {
  FT_CHECK_T(FormatError, shape.is_array(), where, ": a shape must be a list, got ",
             excerpt_json(shape));
  int64_t n = 1;
  for (const json& d : shape) {
    const int64_t v = integer_of(d, where, "a shape dimension");
    FT_CHECK_T(FormatError, v >= 0 && (v == 0 || n <= INT64_MAX / v), where, ": shape ",
               excerpt_json(shape), " has a negative dimension or more than 2^63 elements");
    n *= v;
  }
  return n;
}

// The step of a directory name "step-<digits>" (-1 otherwise); `prefix` allows ".tmp-step-".
int64_t parse_step(const std::string& name, const std::string& prefix) {
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return -1;
  const std::string digits = name.substr(prefix.size());
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit)) return -1;
  return std::stoll(digits);
}

}  // namespace

// As dump(1) writes it: a parsed file dumps back to the same text (keys sorted, numbers
// round-trip).
uint32_t meta_checksum(json meta) {
  meta.erase("meta_crc32c");
  const std::string text = meta.dump(1);
  return crc32c(text.data(), text.size());
}

int64_t step_of_dir(const std::string& dir) {
  return parse_step(fs::path(dir).lexically_normal().filename().string(), "step-");
}

std::string step_dir_name(int64_t step) { return fmt::format("step-{:09d}", step); }

namespace {

// The step-N directories under `root`, newest first, with (true) or without (false) meta.json.
std::vector<std::string> step_dirs(const std::string& root, bool committed) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const int64_t step = parse_step(e.path().filename().string(), "step-");
    if (step >= 0 && fs::is_directory(e.path(), ec) &&
        fs::is_regular_file(e.path() / kMetaFile, ec) == committed)
      found.emplace_back(step, e.path().string());
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

}  // namespace

std::vector<std::string> list_uncommitted(const std::string& root) {
  return step_dirs(root, false);
}

std::vector<std::string> list_committed(const std::string& root) { return step_dirs(root, true); }

// ---------------------------------------------------------------------------------------------
// Saver

int64_t Snapshot::data_bytes() const {
  int64_t n = 0;
  for (const auto& p : pieces) n += static_cast<int64_t>(p.data.nbytes());
  return n;
}

struct Saver::Impl {
  SaverOptions o;
  std::thread worker;
  std::exception_ptr error;
  std::atomic<bool> finished{true};  // the background save (if any) has ended; `error` is set
  // Read by the caller's thread while a background save runs (the stop estimate).
  std::atomic<double> write_s{0};
  std::atomic<int64_t> committed{-1};  // rank 0: the step of the last checkpoint it committed
  std::mutex mu;
  std::condition_variable cv;
  bool captured = true;  // the save in flight (if any) holds its own copy of the state

  void join() {
    if (worker.joinable()) worker.join();
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu);
    captured = true;
    cv.notify_all();
  }
  void write(Snapshot& s, bool capture);
  void write_rank_files(const Snapshot& s, const std::string& tmp);
  void commit(const Snapshot& s, const std::string& tmp, const std::string& own_error);
  void write_meta(const Snapshot& s, const std::string& tmp);
  void publish(const Snapshot& s, const std::string& tmp);
  void tidy_up(const Snapshot& s);
};

Saver::Saver(SaverOptions options) : impl_(std::make_unique<Impl>()) {
  FT_CHECK(options.keep_last >= 1, "checkpoints to keep must be at least 1, got ",
           options.keep_last);
  impl_->o = std::move(options);
}

Saver::~Saver() {
  impl_->join();
  if (impl_->error) {
    try {
      std::rethrow_exception(impl_->error);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ft: checkpoint save failed: %s\n", e.what());
    }
  }
}

double Saver::last_write_s() const { return impl_->write_s.load(); }

int64_t Saver::committed_step() const { return impl_->committed.load(); }

void Saver::wait() {
  impl_->join();
  if (impl_->error) {
    std::exception_ptr e = impl_->error;
    impl_->error = nullptr;
    std::rethrow_exception(e);
  }
}

bool Saver::failed() const {
  return impl_->worker.joinable() && impl_->finished.load(std::memory_order_acquire) &&
         impl_->error != nullptr;
}

void Saver::save(Snapshot s, bool async) {
  wait();
  if (async) {
    {
      std::lock_guard<std::mutex> lock(impl_->mu);
      impl_->captured = false;
    }
    impl_->finished.store(false);
    // Nothing escapes the thread: its error is kept for wait(), and the caller is never left
    // waiting for a copy that will not come.
    impl_->worker = std::thread([impl = impl_.get(), snap = std::move(s)]() mutable {
      try {
        impl->write(snap, /*capture=*/true);
      } catch (...) {
        impl->error = std::current_exception();
      }
      impl->release();
      impl->finished.store(true, std::memory_order_release);
    });
  } else {
    impl_->write(s, /*capture=*/false);
  }
}

double Saver::wait_captured() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> lock(impl_->mu);
  impl_->cv.wait(lock, [&] { return impl_->captured; });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

namespace {
// Store keys of the save of `step`: each rank's outcome, and rank 0's verdict on the whole.
std::string done_key(int64_t step, int rank) { return fmt::format("ckpt/{}/{}", step, rank); }
std::string verdict_key(int64_t step) { return fmt::format("ckpt/{}/verdict", step); }
}  // namespace

std::string Saver::verdict(int64_t step) {
  const SaverOptions& o = impl_->o;
  FT_ASSERT(o.world_size > 1 && o.rank != 0, "only the other ranks ask rank 0 for its verdict");
  return o.wait_all({verdict_key(step)}).at(0);
}

void Saver::Impl::write(Snapshot& s, bool capture) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string tmp = (fs::path(o.root) / (".tmp-" + step_dir_name(s.step))).string();
  // Whatever becomes of this rank's files, rank 0 hears of it: a rank that stayed silent would
  // leave rank 0 waiting, and a commit must never lack a rank's pieces.
  std::string failure;
  try {
    if (capture) {
      // Private copies first (the caller goes on training meanwhile), then the write.
      for (auto& p : s.pieces) p.data = p.data.clone();
      release();
    }
    write_rank_files(s, tmp);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  if (o.world_size > 1) o.signal(done_key(s.step, o.rank), failure);
  if (o.rank == 0) commit(s, tmp, failure);
  FT_CHECK_T(CheckpointSaveError, failure.empty(), "checkpoint of step ", s.step,
             " not saved: rank ", o.rank, ": ", failure);
  write_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void Saver::Impl::write_rank_files(const Snapshot& s, const std::string& tmp) {
  std::error_code ec;
  fs::create_directories(tmp, ec);
  FT_CHECK_T(SystemError, !ec, "cannot create checkpoint directory ", tmp, ": ", ec.message(), " (",
             io::describe_space(io::space_at(o.root)), ")");
  const std::string file = rank_file(o.rank, ".safetensors");
  io::NamedTensors named;
  json chunks = json::array();
  for (const auto& p : s.pieces) {
    FT_ASSERT(p.data.is_cpu() && p.data.is_contiguous() && p.data.numel() == p.end - p.begin,
              "checkpoint piece ", p.tensor, " is not a contiguous CPU range");
    const std::string key = fmt::format("{}@{}", p.tensor, p.begin);
    named.emplace_back(key, p.data);
    chunks.push_back({{"tensor", p.tensor},
                      {"begin", p.begin},
                      {"end", p.end},
                      {"file", file},
                      {"key", key},
                      {"dtype", io::safetensors_dtype_name(p.data.scalar_type())},
                      {"crc32c", crc32c(p.data.data_ptr(), p.data.nbytes())}});
  }
  io::write_safetensors((fs::path(tmp) / file).string(), named, {{"format", "ft-checkpoint"}});
  json shapes = json::object();
  for (const auto& [t, shape] : s.shapes) shapes[t] = shape;
  json rank = {{"rank", o.rank},        {"world_size", o.world_size}, {"step", s.step},
               {"state", s.rank_state}, {"shapes", shapes},           {"chunks", chunks}};
  io::write_file_durably((fs::path(tmp) / rank_file(o.rank, ".json")).string(), rank.dump());
}

// Rank 0: once every rank has said how its files went, either commits or, when any rank failed
// (itself included) or the commit itself fails, removes the temporary directory and throws
// CheckpointSaveError naming each failure.
void Saver::Impl::commit(const Snapshot& s, const std::string& tmp, const std::string& own_error) {
  std::vector<std::string> errors = {own_error};
  if (o.world_size > 1) {
    std::vector<std::string> keys;
    for (int r = 0; r < o.world_size; ++r) keys.push_back(done_key(s.step, r));
    errors = o.wait_all(keys);
    FT_ASSERT(errors.size() == keys.size(), "wait_all returned ", errors.size(), " outcomes for ",
              keys.size(), " ranks");
  }
  std::string failed;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      failed += fmt::format("{}rank {}: {}", failed.empty() ? "" : "; ", r, errors[r]);
  if (failed.empty()) {
    try {
      write_meta(s, tmp);
      publish(s, tmp);
    } catch (const std::exception& e) {
      failed = fmt::format("rank 0, committing: {}", e.what());
    }
  }
  std::string verdict;
  if (failed.empty()) {
    committed.store(s.step);
    tidy_up(s);
  } else {
    // Every rank is done with the directory: nothing of this save is left to be mistaken for a
    // checkpoint (a .tmp- directory never is; removing it gives the space back).
    std::error_code ec;
    fs::remove_all(tmp, ec);
    verdict = fmt::format(
        "checkpoint of step {} not saved: {}; its temporary directory {} {}", s.step, failed, tmp,
        ec ? fmt::format("could not be removed ({}), and is never read", ec.message())
           : std::string("was removed"));
  }
  // The other ranks report the same error as rank 0 when the ranks find the save failed.
  if (o.world_size > 1) o.signal(verdict_key(s.step), verdict);
  FT_CHECK_T(CheckpointSaveError, verdict.empty(), verdict);
}

// meta.json from every rank's record, every element of every tensor covered exactly once.
void Saver::Impl::write_meta(const Snapshot& s, const std::string& tmp) {
  json tensors = json::object();
  json ranks = json::array();
  for (int r = 0; r < o.world_size; ++r) {
    const std::string path = (fs::path(tmp) / rank_file(r, ".json")).string();
    std::ifstream in(path);
    FT_CHECK_T(SystemError, in.good(), "rank ", r, " reported its checkpoint files written, but ",
               path, " is not there: the output directory must be on storage every node shares");
    std::stringstream text;
    text << in.rdbuf();
    json rj = parse_json<FormatError>(text.str(), path);
    try {
      ranks.push_back(rj.at("state"));
      FT_CHECK_T(FormatError, rj.at("shapes").is_object(), path, ": shapes must be an object");
      for (auto& [t, shape] : rj["shapes"].items()) {
        (void)numel_of(shape, path);
        if (!tensors.contains(t)) tensors[t] = {{"shape", shape}, {"chunks", json::array()}};
      }
      for (auto& c : rj.at("chunks")) {
        const std::string t = c.at("tensor");
        FT_CHECK_T(FormatError, tensors.contains(t), path, ": a chunk of ", t,
                   " whose shape no rank recorded");
        (void)integer_of(c.at("begin"), path, "a chunk's begin");
        (void)integer_of(c.at("end"), path, "a chunk's end");
        tensors[t]["dtype"] = c.at("dtype");
        json chunk = c;
        chunk.erase("tensor");
        chunk.erase("dtype");
        tensors[t]["chunks"].push_back(chunk);
      }
    } catch (const json::exception& e) {
      throw FormatError(fmt::format("{}: malformed ({})", path, e.what()));
    }
  }
  for (auto& [t, tj] : tensors.items()) {
    auto& chunks = tj["chunks"];
    std::sort(chunks.begin(), chunks.end(),
              [](const json& a, const json& b) { return a["begin"] < b["begin"]; });
    int64_t at = 0;
    for (const auto& c : chunks) {
      FT_CHECK_T(FormatError, c["begin"].get<int64_t>() == at, "checkpoint of step ", s.step,
                 ": tensor ", t, " has a gap or overlap at element ", at, " in the records of ",
                 tmp);
      at = c["end"];
    }
    const int64_t numel = numel_of(tj["shape"], tmp);
    FT_CHECK_T(FormatError, at == numel, "checkpoint of step ", s.step, ": tensor ", t, " covers ",
               at, " elements of ", numel, " in the records of ", tmp);
  }
  json meta = {{"format", "ft-checkpoint"},
               {"format_version", kFormatVersion},
               {"ft_version", build_info(false).ft_version},
               {"step", s.step},
               {"world_size", o.world_size},
               {"state", s.state},
               {"rank_states", ranks},
               {"tensors", tensors}};
  // The commit record checks itself: a CRC-32C of its own text without this field (data chunks
  // carry theirs), so no byte a resume reads goes unchecked.
  meta["meta_crc32c"] = meta_checksum(meta);
  io::write_file_durably((fs::path(tmp) / kMetaFile).string(), meta.dump(1));
}

// The commit itself: the temporary directory, meta.json and all, renamed to step-<N>.
void Saver::Impl::publish(const Snapshot& s, const std::string& tmp) {
  const fs::path final_dir = fs::path(o.root) / step_dir_name(s.step);
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {  // the same step saved again (a restarted run): swap
    const fs::path old = fs::path(o.root) / (".old-" + step_dir_name(s.step));
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    FT_CHECK_T(SystemError, !ec, "cannot move ", final_dir.string(), " aside: ", ec.message());
  }
  fs::rename(tmp, final_dir, ec);
  FT_CHECK_T(SystemError, !ec, "cannot rename ", tmp, " to ", final_dir.string(), ": ",
             ec.message());
}

// After the commit: `latest`, and older checkpoints beyond keep_last and temporary directories of
// saves that never finished removed. The checkpoint is committed already, so a failure here (a
// disk that filled just now) is said and fails nothing.
void Saver::Impl::tidy_up(const Snapshot& s) {
  std::error_code ec;
  try {
    io::fsync_dir(o.root);
    fs::remove_all(fs::path(o.root) / (".old-" + step_dir_name(s.step)), ec);
    io::write_file_durably((fs::path(o.root) / kLatestFile).string(), step_dir_name(s.step) + "\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ft: warning: checkpoint of step %lld is committed, but: %s\n",
                 static_cast<long long>(s.step), e.what());
  }
  const auto committed = list_committed(o.root);
  for (size_t i = static_cast<size_t>(o.keep_last); i < committed.size(); ++i)
    fs::remove_all(committed[i], ec);
  for (const auto& e : fs::directory_iterator(o.root, ec)) {
    const int64_t st = parse_step(e.path().filename().string(), ".tmp-step-");
    if (st >= 0 && st <= s.step) fs::remove_all(e.path(), ec);
  }
}

// ---------------------------------------------------------------------------------------------
// Checkpoint

namespace {
struct ChunkRef {
  int64_t begin = 0, end = 0;
  std::string file, key;
  uint32_t crc = 0;
};
struct TensorRef {
  std::vector<int64_t> shape;
  std::vector<ChunkRef> chunks;  // by begin
};
}  // namespace

struct Checkpoint::Impl {
  std::string dir;
  json meta;
  std::map<std::string, TensorRef> tensors;
  mutable std::mutex mu;
  mutable std::map<std::string, std::unique_ptr<io::SafetensorsFile>> files;
  mutable std::set<std::string> verified;  // file + "\n" + key

  const io::SafetensorsFile& file(const std::string& name) const;
  void verify(const ChunkRef& c) const;
  const TensorRef& find(const std::string& tensor) const {
    auto it = tensors.find(tensor);
    FT_CHECK_T(FormatError, it != tensors.end(), dir, "/", kMetaFile, ": the checkpoint has no ",
               tensor, " (it was saved from another model, or with LoRA on/off?)");
    return it->second;
  }
};

Checkpoint::Checkpoint() : impl_(std::make_unique<Impl>()) {}
Checkpoint::Checkpoint(Checkpoint&&) noexcept = default;
Checkpoint& Checkpoint::operator=(Checkpoint&&) noexcept = default;
Checkpoint::~Checkpoint() = default;

Checkpoint Checkpoint::open(const std::string& dir) {
  Checkpoint c;
  Impl& m = *c.impl_;
  m.dir = dir;
  const std::string path = (fs::path(dir) / kMetaFile).string();
  std::ifstream in(path);
  // A step-<N> directory gets its name by the commit's rename, meta.json already in it.
  const bool named = step_of_dir(dir) >= 0;
  FT_CHECK_T(FormatError, in.good(), path,
             named ? ": missing, though a step directory gets its name only when its save commits "
                     "(meta.json already in it): it was deleted or lost since, and the checkpoint "
                     "is damaged; use an earlier one"
                   : ": missing, so this checkpoint was never committed (a save interrupted before "
                     "every rank finished); use an earlier one");
  std::stringstream text;
  text << in.rdbuf();
  const std::string meta_text = text.str();
  const bool valid = json_too_deep_at(meta_text) == std::string_view::npos &&
                     (m.meta = json::parse(meta_text, nullptr, false), !m.meta.is_discarded());
  FT_CHECK_T(FormatError, valid && m.meta.is_object(), path,
             ": not valid JSON (damaged); use an earlier checkpoint");
  try {
    FT_CHECK_T(FormatError, m.meta.value("format", "") == "ft-checkpoint", path,
               ": not an ft checkpoint");
    const int64_t version = integer_of(m.meta.at("format_version"), path, "format_version");
    FT_CHECK_T(FormatError, version == kFormatVersion, path, ": format version ", version,
               " is not the ", kFormatVersion, " this ft reads");
    // Verified before anything in it is used.
    FT_CHECK_T(FormatError, m.meta.contains("meta_crc32c"), path,
               ": has no meta_crc32c (damaged); use an earlier checkpoint");
    const int64_t want = integer_of(m.meta.at("meta_crc32c"), path, "meta_crc32c");
    const uint32_t got = meta_checksum(m.meta);
    FT_CHECK_T(FormatError, want == got, path, ": checksum mismatch (CRC-32C ", got, ", recorded ",
               want,
               "): the file changed after the checkpoint was committed; use an earlier "
               "checkpoint");
    for (auto& [t, tj] : m.meta.at("tensors").items()) {
      TensorRef r;
      const int64_t numel = numel_of(tj.at("shape"), path);
      r.shape = tj.at("shape").get<std::vector<int64_t>>();
      for (const auto& cj : tj.at("chunks")) {
        ChunkRef ch;
        ch.begin = integer_of(cj.at("begin"), path, "a chunk's begin");
        ch.end = integer_of(cj.at("end"), path, "a chunk's end");
        FT_CHECK_T(FormatError, 0 <= ch.begin && ch.begin <= ch.end && ch.end <= numel, path,
                   ": chunk [", ch.begin, ", ", ch.end, ") of ", t, " is outside its ", numel,
                   " elements");
        ch.file = cj.at("file");
        ch.key = cj.at("key");
        const int64_t crc = integer_of(cj.at("crc32c"), path, "a chunk's crc32c");
        FT_CHECK_T(FormatError, crc >= 0 && crc <= UINT32_MAX, path, ": a chunk's crc32c ", crc,
                   " is not a CRC-32C");
        ch.crc = static_cast<uint32_t>(crc);
        FT_CHECK_T(FormatError, ch.file.find('/') == std::string::npos && ch.file != "..", path,
                   ": chunk file '", ch.file, "' is outside the checkpoint");
        r.chunks.push_back(std::move(ch));
      }
      m.tensors.emplace(t, std::move(r));
    }
    (void)integer_of(m.meta.at("step"), path, "step");
    const int64_t world_size = integer_of(m.meta.at("world_size"), path, "world_size");
    FT_CHECK_T(FormatError,
               world_size >= 1 && m.meta.at("rank_states").is_array() &&
                   m.meta["rank_states"].size() == static_cast<size_t>(world_size),
               path, ": rank_states does not have world_size entries");
  } catch (const json::exception& e) {
    throw FormatError(fmt::format("{}: malformed ({}); use an earlier checkpoint", path, e.what()));
  }
  return c;
}

const std::string& Checkpoint::dir() const { return impl_->dir; }
int64_t Checkpoint::step() const { return impl_->meta["step"]; }
int Checkpoint::world_size() const { return impl_->meta["world_size"]; }
const json& Checkpoint::state() const { return impl_->meta["state"]; }
const json& Checkpoint::rank_state(int rank) const {
  return impl_->meta["rank_states"].at(static_cast<size_t>(rank));
}
bool Checkpoint::has(const std::string& tensor) const { return impl_->tensors.count(tensor) != 0; }
std::vector<std::string> Checkpoint::tensors() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : impl_->tensors) out.push_back(name);
  return out;
}
std::vector<int64_t> Checkpoint::shape(const std::string& tensor) const {
  return impl_->find(tensor).shape;
}

const io::SafetensorsFile& Checkpoint::Impl::file(const std::string& name) const {
  auto it = files.find(name);
  if (it != files.end()) return *it->second;
  const std::string path = (fs::path(dir) / name).string();
  try {
    auto f = std::make_unique<io::SafetensorsFile>(io::SafetensorsFile::open(path));
    return *files.emplace(name, std::move(f)).first->second;
  } catch (const SystemError& e) {
    throw FormatError(
        fmt::format("{}: cannot be read ({}); the checkpoint is incomplete", path, e.what()));
  }
}

void Checkpoint::Impl::verify(const ChunkRef& c) const {
  const std::string id = c.file + "\n" + c.key;
  if (verified.count(id)) return;
  const io::SafetensorsFile& f = file(c.file);
  const std::string where = fmt::format("{}/{}: chunk {}", dir, c.file, c.key);
  FT_CHECK_T(FormatError, f.has(c.key), where, " is missing from the file");
  const io::TensorInfo& info = f.info(c.key);
  FT_CHECK_T(FormatError, info.numel() == c.end - c.begin, where, " holds ", info.numel(),
             " elements, meta.json says ", c.end - c.begin);
  constexpr int64_t kBlock = 8 << 20;  // bytes checked at a time
  const int64_t item = static_cast<int64_t>(c10::elementSize(info.dtype));
  const int64_t per = std::max<int64_t>(1, kBlock / item);
  at::Tensor buf = at::empty({std::min(per, info.numel())}, at::TensorOptions().dtype(info.dtype));
  uint32_t crc = 0;
  for (int64_t i = 0; i < info.numel(); i += per) {
    const int64_t n = std::min(per, info.numel() - i);
    at::Tensor part = buf.narrow(0, 0, n);
    f.read_range(c.key, i, i + n, part);
    crc = crc32c(part.data_ptr(), static_cast<size_t>(n * item), crc);
  }
  FT_CHECK_T(FormatError, crc == c.crc, where, ": checksum mismatch (CRC-32C ", crc,
             ", meta.json says ", c.crc, "): the file is damaged; use an earlier checkpoint");
  verified.insert(id);
}

void Checkpoint::verify_range(const std::string& tensor, int64_t begin, int64_t end) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  for (const auto& c : impl_->find(tensor).chunks)
    if (c.end > begin && c.begin < end) impl_->verify(c);
}

void Checkpoint::read_range(const std::string& tensor, int64_t begin, int64_t end,
                            const at::Tensor& dst) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  const TensorRef& t = impl_->find(tensor);
  FT_CHECK_T(FormatError, 0 <= begin && begin <= end && end <= numel_of(t.shape), impl_->dir,
             ": elements [", begin, ", ", end, ") of ", tensor, " are outside its ",
             numel_of(t.shape));
  FT_ASSERT(dst.numel() == end - begin, "read_range of ", end - begin, " elements into ",
            dst.numel());
  at::Tensor flat = dst.view({-1});
  int64_t covered = 0;
  for (const auto& c : t.chunks) {
    const int64_t lo = std::max(begin, c.begin), hi = std::min(end, c.end);
    if (hi <= lo) continue;
    impl_->verify(c);
    impl_->file(c.file).read_range(c.key, lo - c.begin, hi - c.begin,
                                   flat.narrow(0, lo - begin, hi - lo));
    covered += hi - lo;
  }
  FT_CHECK_T(FormatError, covered == end - begin, impl_->dir, "/", kMetaFile, ": the chunks of ",
             tensor, " do not cover [", begin, ", ", end, ")");
}

}  // namespace ft::ckpt
