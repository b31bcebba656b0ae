#include "train/tensorboard.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "ckpt/crc32c.h"
#include "core/error.h"

namespace ft::train {

namespace {

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out += static_cast<char>((v & 0x7f) | 0x80);
    v >>= 7;
  }
  out += static_cast<char>(v);
}

template <class T>
void put_le(std::string& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // (x86 and arm64 are little-endian, as the format is)
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}

// A length-delimited field (wire type 2).
void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

uint32_t masked_crc(const std::string& bytes) {
  const uint32_t crc = ckpt::crc32c(bytes.data(), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

std::string encode_event(double wall_time, int64_t step, const std::string& file_version,
                         const std::vector<std::pair<std::string, double>>& scalars) {
  std::string e;
  put_varint(e, 1 << 3 | 1);  // wall_time: fixed64
  put_le(e, wall_time);
  put_varint(e, 2 << 3 | 0);  // step: varint (two's complement for negatives, as protobuf)
  put_varint(e, static_cast<uint64_t>(step));
  if (!file_version.empty()) put_bytes(e, 3, file_version);
  if (!scalars.empty()) {
    std::string summary;
    for (const auto& [tag, value] : scalars) {
      std::string v;
      put_bytes(v, 1, tag);
      put_varint(v, 2 << 3 | 5);  // simple_value: fixed32 float
      put_le(v, static_cast<float>(value));
      put_bytes(summary, 1, v);
    }
    put_bytes(e, 5, summary);
  }
  return e;
}

std::string encode_session_start(double wall_time, int64_t step) {
  std::string e = encode_event(wall_time, step, "", {});
  put_bytes(e, 7, std::string("\x08\x01", 2));  // session_log { status: START }
  return e;
}

std::string tfrecord(const std::string& data) {
  std::string len;
  put_le(len, static_cast<uint64_t>(data.size()));
  std::string out = len;
  put_le(out, masked_crc(len));
  out += data;
  put_le(out, masked_crc(data));
  return out;
}

std::vector<std::pair<std::string, double>> tensorboard_scalars(const StepRecord& r) {
  std::vector<std::pair<std::string, double>> v = {
      {"loss", r.stats.loss},
      {"lr", r.stats.lr},
      {"tokens_per_s", r.tokens_per_s},
      {"mfu", r.mfu()},
      {"step_time_s", r.step_time_s},
      {"memory/peak_rss_bytes", static_cast<double>(r.peak_rss_bytes)}};
  if (std::isfinite(r.stats.grad_norm)) v.push_back({"grad_norm", r.stats.grad_norm});
  if (r.eval_tokens > 0) v.push_back({"eval_loss", r.eval_loss});
  if (r.memory.on_gpu)
    v.push_back({"memory/cuda_peak_allocated_bytes",
                 static_cast<double>(r.memory.gpu_peak_allocated_bytes)});
  return v;
}

EventWriter::EventWriter(const std::string& dir, int64_t first_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  FT_CHECK(!ec, "output.tensorboard: cannot create ", dir, ": ", ec.message());
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const double now = unix_seconds();
  path_ = (std::filesystem::path(dir) /
           ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host))
              .string();
  out_.open(path_, std::ios::binary | std::ios::app);
  FT_CHECK(out_.good(), "output.tensorboard: cannot write ", path_,
           "; set output.tensorboard=false or free the directory");
  out_ << tfrecord(encode_event(now, 0, "brain.Event:2", {}));
  out_ << tfrecord(encode_session_start(now, first_step));
  out_.flush();
}

void EventWriter::write(int64_t step, const std::vector<std::pair<std::string, double>>& scalars) {
  out_ << tfrecord(encode_event(unix_seconds(), step, "", scalars));
  out_.flush();
  FT_CHECK(out_.good(), "writing ", path_, " failed (disk full?)");
}

}  // namespace ft::train
