#include "data/token_cache.h"

#include <ATen/Parallel.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "data/record_file.h"
#include "io/durable_file.h"

namespace ft::data {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr char kMagic[9] = "FTTOKC01";
constexpr char kEndMagic[9] = "FTTOKEND";
constexpr int kVersion = 1;
constexpr int64_t kTrailerBytes = 32;

uint64_t fnv1a(const char* p, size_t n, uint64_t h = 1469598103934665603ull) {
  for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<unsigned char>(p[i])) * 1099511628211ull;
  return h;
}

// Size and FNV-1a of a file's bytes, read 1 MiB at a time.
json file_identity(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  FT_CHECK(in.good(), "cannot read ", path);
  std::vector<char> buf(1 << 20);
  uint64_t h = 1469598103934665603ull, size = 0;
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const size_t got = static_cast<size_t>(in.gcount());
    h = fnv1a(buf.data(), got, h);
    size += got;
  }
  return {{"bytes", size}, {"fnv1a", fmt::format("{:016x}", h)}};
}

size_t pad8(size_t n) { return (n + 7) & ~size_t{7}; }

// The key at the head of a cache file; null when it has none.
json read_key(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char head[16];
  if (!in.read(head, 16) || std::memcmp(head, kMagic, 8) != 0) return nullptr;
  uint64_t len = 0;
  std::memcpy(&len, head + 8, 8);
  if (len > (1u << 20)) return nullptr;
  std::string text(len, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(len))) return nullptr;
  return json::parse(text, nullptr, /*allow_exceptions=*/false);
}

// What differs between a cache's key and the wanted one, e.g. "template none, not llama3".
std::string key_difference(const json& stored, const json& wanted) {
  std::string out;
  for (const auto& [field, value] : wanted.items()) {
    const json other = stored.is_object() && stored.contains(field) ? stored[field] : json();
    if (other == value) continue;
    out +=
        fmt::format("{}{} {}, not {}", out.empty() ? "" : "; ", field, other.dump(), value.dump());
  }
  return out;
}

}  // namespace

json token_cache_key(const JsonlOptions& o) {
  const DataIdentity id = data_identity(o.path);
  return {{"version", kVersion},
          {"data",
           {{"path", fs::absolute(o.path).lexically_normal().string()},
            {"bytes", static_cast<int64_t>(id.bytes)},
            {"mtime_ns", id.mtime_ns}}},
          {"tokenizer", o.tokenizer_path.empty() ? json(nullptr) : file_identity(o.tokenizer_path)},
          {"format", name_of(o.format)},
          {"shape", o.shape.key()},
          {"template", name_of(o.chat_template)},
          {"train_on_prompt", o.train_on_prompt}};
}

std::string token_cache_path(const JsonlOptions& o, const json& key) {
  // A folder's cache beside it, as a file's: DIR.ftcache, not DIR/.ftcache.
  const std::string data = fs::path(o.path).lexically_normal().string();
  const std::string dir =
      o.cache_dir.empty()
          ? (data.size() > 1 && data.back() == '/' ? data.substr(0, data.size() - 1) : data) +
                ".ftcache"
          : o.cache_dir;
  const std::string text = key.dump();
  return fmt::format("{}/{:016x}.tokens", dir, fnv1a(text.data(), text.size()));
}

std::unique_ptr<TokenCache> TokenCache::open(const std::string& path, const json& key,
                                             std::string* why) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd == -1) {
    *why = fmt::format("no tokenized cache {} (ft data prepare makes it)", path);
    // A cache of the same data for other inputs: say what differs.
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(fs::path(path).parent_path(), ec)) {
      if (e.path().extension() != ".tokens") continue;
      const json other = read_key(e.path().string());
      if (other.is_object() &&
          other.value("data", json()).value("path", "") == key["data"]["path"].get<std::string>())
        *why += fmt::format(
            "; {} is one for other inputs ({}): run ft data prepare with the "
            "same preset and --set as ft train",
            e.path().string(), key_difference(other, key));
    }
    return nullptr;
  }
  struct stat st {};
  const bool sized = ::fstat(fd, &st) == 0;
  const size_t size = sized ? static_cast<size_t>(st.st_size) : 0;
  void* base =
      size >= 16 + kTrailerBytes ? ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
  ::close(fd);
  std::unique_ptr<TokenCache> c(new TokenCache);
  if (base == MAP_FAILED) {
    *why =
        fmt::format("the tokenized cache {} is damaged (too short or unreadable): ignored", path);
    return nullptr;
  }
  c->base_ = base;
  c->size_ = size;
  const char* p = static_cast<const char*>(base);
  auto damaged = [&](const std::string& what) {
    *why = fmt::format(
        "the tokenized cache {} is damaged ({}): ignored; ft data prepare makes it "
        "again",
        path, what);
    return nullptr;
  };
  if (std::memcmp(p, kMagic, 8) != 0) return damaged("not a cache file");
  uint64_t key_len = 0;
  std::memcpy(&key_len, p + 8, 8);
  if (key_len > size - 16 - kTrailerBytes) return damaged("its key is cut");
  json stored;
  try {
    stored = json::parse(std::string(p + 16, key_len));
  } catch (const json::exception&) {
    return damaged("its key is not JSON");
  }
  if (stored != key) {
    *why = fmt::format(
        "the tokenized cache {} was made for other inputs (the data file, the "
        "tokenizer or the data settings changed): not used",
        path);
    return nullptr;
  }
  const size_t data_start = pad8(16 + key_len);
  const char* t = p + size - kTrailerBytes;
  int64_t n = 0, words = 0, footer = 0;
  std::memcpy(&n, t, 8);
  std::memcpy(&words, t + 8, 8);
  std::memcpy(&footer, t + 16, 8);
  if (std::memcmp(t + 24, kEndMagic, 8) != 0) return damaged("no trailer");
  const int64_t footer_bytes = static_cast<int64_t>(pad8(static_cast<size_t>(n) * 9 + 8));
  if (n < 0 || words < 0 || footer != static_cast<int64_t>(data_start) + 4 * words ||
      footer + footer_bytes + kTrailerBytes != static_cast<int64_t>(size))
    return damaged("its sizes do not add up");
  c->n_ = n;
  c->words_ = words;
  c->data_ = reinterpret_cast<const int32_t*>(p + data_start);
  c->offsets_ = reinterpret_cast<const int64_t*>(p + footer);
  c->status_ = reinterpret_cast<const uint8_t*>(p + footer + 8 * (n + 1));
  if (c->offsets_[0] != 0 || c->offsets_[n] != words) return damaged("bad offsets");
  for (int64_t i = 0; i < n; ++i) {
    const int64_t len = c->offsets_[i + 1] - c->offsets_[i];
    if (len < 0 || len % 2 != 0 || c->status_[i] > 1) return damaged("bad offsets");
  }
  return c;
}

TokenCache::~TokenCache() {
  if (base_) ::munmap(base_, size_);
}

TokenizedRecord TokenCache::record(int64_t i) const {
  const int64_t begin = offsets_[i], half = (offsets_[i + 1] - begin) / 2;
  TokenizedRecord r;
  r.ids.assign(data_ + begin, data_ + begin + half);
  r.labels.assign(data_ + begin + half, data_ + begin + 2 * half);
  return r;
}

PrepareResult write_token_cache(const JsonlSource& source, const std::string& path, const json& key,
                                const std::function<void(int64_t, int64_t)>& progress) {
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  FT_CHECK_T(SystemError, !ec, "cannot create the cache directory ",
             fs::path(path).parent_path().string(), ": ", ec.message(),
             "; give another with --cache-dir (data.cache_dir)");
  io::DurableFile out(path);
  const std::string key_text = key.dump();
  const uint64_t key_len = key_text.size();
  out.write(kMagic, 8);
  out.write(&key_len, 8);
  out.write(key_text);
  const std::string zeros(8, '\0');
  out.write(zeros.data(), pad8(16 + key_len) - 16 - key_len);

  PrepareResult r;
  r.path = path;
  r.records = source.num_records();
  std::vector<int64_t> offsets{0};
  std::vector<uint8_t> status;
  // Records tokenized at once: their ids and labels are held until written (1,024 records of
  // 2,000 tokens: 32 MB).
  constexpr int64_t kChunk = 1024;
  std::vector<TokenizedRecord> chunk;
  std::vector<char> bad;
  for (int64_t begin = 0; begin < r.records; begin += kChunk) {
    const int64_t end = std::min(r.records, begin + kChunk);
    chunk.assign(static_cast<size_t>(end - begin), {});
    bad.assign(chunk.size(), 0);
    at::parallel_for(begin, end, 16, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        try {
          chunk[static_cast<size_t>(i - begin)] = source.tokenize_whole(i);
        } catch (const FormatError&) {
          bad[static_cast<size_t>(i - begin)] = 1;
        }
      }
    });
    for (int64_t i = begin; i < end; ++i) {
      const size_t k = static_cast<size_t>(i - begin);
      // Again on this thread, so the error is the first bad record's, as training throws it.
      if (bad[k] && !source.skips_bad_records()) (void)source.tokenize_whole(i);
      std::vector<int32_t> words;
      for (const int64_t id : chunk[k].ids) words.push_back(static_cast<int32_t>(id));
      for (const int64_t l : chunk[k].labels) words.push_back(static_cast<int32_t>(l));
      out.write(words.data(), words.size() * 4);
      offsets.push_back(offsets.back() + static_cast<int64_t>(words.size()));
      status.push_back(bad[k]);
      r.malformed += bad[k];
      r.tokens += static_cast<int64_t>(chunk[k].ids.size());
    }
    if (progress) progress(end, r.records);
  }
  const int64_t words = offsets.back();
  const int64_t footer = static_cast<int64_t>(pad8(16 + key_len)) + 4 * words;
  out.write(offsets.data(), offsets.size() * 8);
  out.write(status.data(), status.size());
  out.write(zeros.data(), pad8(status.size()) - status.size());
  const int64_t trailer[3] = {r.records, words, footer};
  out.write(trailer, sizeof trailer);
  out.write(kEndMagic, 8);
  out.commit();
  r.bytes = static_cast<uint64_t>(fs::file_size(path));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

}  // namespace ft::data

namespace ft::data {
namespace {

// An exclusive flock on `path`, released (and its descriptor closed) on destruction.
class FileLock {
 public:
  explicit FileLock(const std::string& path, const std::string& waiting_for) {
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    FT_CHECK_T(SystemError, fd_ >= 0, "cannot create the lock file ", path, ": ",
               std::strerror(errno),
               "; give another cache folder with --data-cache (ft train) or "
               "--cache-dir (ft data prepare)");
    const auto start = std::chrono::steady_clock::now();
    auto last = start;
    while (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      FT_CHECK_T(SystemError, errno == EWOULDBLOCK || errno == EINTR, "flock ", path, ": ",
                 std::strerror(errno));
      const auto now = std::chrono::steady_clock::now();
      if (now - last >= std::chrono::seconds(30)) {
        fmt::print(stderr, "ft: waiting {:.0f} s for another process {} (lock {})\n",
                   std::chrono::duration<double>(now - start).count(), waiting_for, path);
        last = now;
      }
      ::usleep(200 * 1000);
    }
  }
  ~FileLock() { ::close(fd_); }  // closing releases the lock
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

std::unique_ptr<TokenCache> prepare_token_cache(const JsonlSource& source, const std::string& path,
                                                const json& key) {
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  FT_CHECK_T(SystemError, !ec, "cannot create the cache directory ",
             fs::path(path).parent_path().string(), ": ", ec.message(),
             "; give another with --data-cache (ft train) or --cache-dir (ft data prepare)");
  const std::string data = source.file().path();
  const FileLock lock(path + ".lock", "tokenizing " + data + " into " + path);
  std::string why;
  if (auto made = TokenCache::open(path, key, &why)) return made;  // another process made it
  fmt::print(stderr,
             "ft: tokenizing {} ({} records) once into {}: {} has no cheap random access, and "
             "training reads records in a shuffled order; later runs read the cache\n",
             data, source.num_records(), path, source.file().kind());
  const auto start = std::chrono::steady_clock::now();
  auto last = start;
  const PrepareResult r = write_token_cache(source, path, key, [&](int64_t done, int64_t total) {
    const auto now = std::chrono::steady_clock::now();
    if (now - last < std::chrono::seconds(10)) return;
    last = now;
    fmt::print(stderr, "ft: tokenized {} of {} records of {} ({:.0f} s)\n", done, total, data,
               std::chrono::duration<double>(now - start).count());
  });
  fmt::print(stderr, "ft: {} records, {} tokens tokenized into {} in {:.1f} s\n", r.records,
             r.tokens, path, r.seconds);
  auto made = TokenCache::open(path, key, &why);
  FT_CHECK_T(SystemError, made != nullptr,
             "the tokenized cache just written cannot be read: ", why);
  return made;
}

}  // namespace ft::data
