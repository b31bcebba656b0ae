#include "io/safetensors_file.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace ft::io {

using msg::shape_str;
using msg::where_file;
using msg::where_tensor;

// A whole file mapped PROT_READ / MAP_PRIVATE; unmapped when the last tensor viewing it is gone.
class MappedFile {
 public:
  static std::shared_ptr<const MappedFile> open(const std::string& path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd == -1) throw_errno("open '" + path + "'", __FILE__, __LINE__);
    struct stat st {};
    if (::fstat(fd, &st) == -1) {
      int err = errno;
      ::close(fd);
      errno = err;
      throw_errno("fstat '" + path + "'", __FILE__, __LINE__);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw FormatError(where_file(path) + "not a regular file");
    }
    std::shared_ptr<MappedFile> m(new MappedFile());
    m->size_ = static_cast<uint64_t>(st.st_size);
    if (m->size_ > 0) {  // mmap refuses length 0; the header check reports an empty file
      void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        int err = errno;
        ::close(fd);
        errno = err;
        throw_errno("mmap '" + path + "'", __FILE__, __LINE__);
      }
      m->data_ = static_cast<const uint8_t*>(p);
    }
    m->fd_ = fd;  // kept for pread_exact
    m->path_ = path;
    return m;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    if (fd_ != -1) ::close(fd_);
  }

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  // Reads [offset, offset + len) of the file with pread, past the mapping: the bytes go through
  // the page cache, never into this process's resident set. SystemError naming the file.
  void pread_exact(uint64_t offset, uint64_t len, void* dst) const {
    auto* out = static_cast<uint8_t*>(dst);
    while (len > 0) {
      const ssize_t n =
          ::pread(fd_, out, std::min<uint64_t>(len, 1u << 30), static_cast<off_t>(offset));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_errno("read '" + path_ + "'", __FILE__, __LINE__);
      if (n == 0) throw FormatError(where_file(path_) + "ends early (truncated while open?)");
      out += n;
      offset += static_cast<uint64_t>(n);
      len -= static_cast<uint64_t>(n);
    }
  }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
  int fd_ = -1;
  std::string path_;
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;
  f.path_ = path;
  f.map_ = MappedFile::open(path);
  Header h = parse_header(path, f.map_->data(), f.map_->size());
  f.data_start_ = h.data_start;
  f.metadata_ = std::move(h.metadata);
  f.tensors_ = std::move(h.tensors);
  for (size_t i = 0; i < f.tensors_.size(); ++i) f.by_name_.emplace(f.tensors_[i].name, i);
  return f;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

const TensorInfo& SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  FT_CHECK_T(FormatError, it != by_name_.end(), where_tensor(path_, name),
             "no such tensor in the file (it holds ", tensors_.size(), ")");
  return tensors_[it->second];
}

const TensorInfo& SafetensorsFile::info(const std::string& name) const { return find(name); }

at::Tensor SafetensorsFile::view_bytes(const TensorInfo& info, uint64_t begin,
                                       at::IntArrayRef shape) const {
  const uint8_t* p = map_->data() + data_start_ + begin;
  auto options = at::TensorOptions().dtype(info.dtype).device(at::kCPU);
  if (reinterpret_cast<uintptr_t>(p) % c10::elementSize(info.dtype) != 0) {
    at::Tensor out = at::empty(shape, options);
    if (out.nbytes() > 0) std::memcpy(out.data_ptr(), p, out.nbytes());  // empty: data_ptr null
    return out;
  }
  // The deleter owns a reference to the mapping: the bytes stay mapped while any view lives.
  std::shared_ptr<const MappedFile> keep = map_;
  return at::from_blob(
      const_cast<uint8_t*>(p), shape, [keep](void*) mutable { keep.reset(); }, options);
}

at::Tensor SafetensorsFile::tensor(const std::string& name) const {
  const TensorInfo& info = find(name);
  return view_bytes(info, info.begin, info.shape);
}

at::Tensor SafetensorsFile::tensor_slice(const std::string& name, int64_t row_begin,
                                         int64_t row_end) const {
  const TensorInfo& info = find(name);
  FT_CHECK_T(FormatError, !info.shape.empty(), where_tensor(path_, name),
             "is a scalar; it has no rows to slice");
  const int64_t rows = info.shape[0];
  FT_CHECK_T(FormatError, 0 <= row_begin && row_begin <= row_end && row_end <= rows,
             where_tensor(path_, name), "rows [", row_begin, ", ", row_end,
             ") are not within its dim 0 of ", rows, " (shape ", shape_str(info.shape), ")");
  const uint64_t row_bytes = rows == 0 ? 0 : info.nbytes() / static_cast<uint64_t>(rows);
  std::vector<int64_t> shape = info.shape;
  shape[0] = row_end - row_begin;
  return view_bytes(info, info.begin + static_cast<uint64_t>(row_begin) * row_bytes, shape);
}

void SafetensorsFile::copy_to(const std::string& name, const at::Tensor& dst) const {
  const TensorInfo& info = find(name);
  FT_CHECK_T(FormatError, dst.defined(), where_tensor(path_, name),
             "copy_to was given an undefined destination");
  FT_CHECK_T(FormatError, dst.sizes() == at::IntArrayRef(info.shape), where_tensor(path_, name),
             "has shape ", shape_str(info.shape), " (", info.dtype_name,
             ") but the destination has shape ", shape_str(dst.sizes()));
  c10::NoGradGuard no_grad;
  dst.copy_(tensor(name));
}

void SafetensorsFile::read_range(const std::string& name, int64_t begin, int64_t end,
                                 const at::Tensor& dst) const {
  const TensorInfo& info = find(name);
  FT_CHECK_T(FormatError, 0 <= begin && begin <= end && end <= info.numel(),
             where_tensor(path_, name), "elements [", begin, ", ", end, ") are not within its ",
             info.numel(), " elements (shape ", shape_str(info.shape), ")");
  FT_CHECK_T(FormatError, dst.defined() && dst.numel() == end - begin, where_tensor(path_, name),
             "read_range of ", end - begin, " elements was given a destination of ",
             dst.defined() ? dst.numel() : 0, " elements");
  FT_ASSERT(dst.is_contiguous(), "read_range needs a contiguous destination");
  if (end == begin) return;
  const int64_t item = static_cast<int64_t>(c10::elementSize(info.dtype));
  const uint64_t off = data_start_ + info.begin + static_cast<uint64_t>(begin * item);
  c10::NoGradGuard no_grad;
  if (dst.is_cpu() && dst.is_contiguous() && dst.scalar_type() == info.dtype) {
    map_->pread_exact(off, static_cast<uint64_t>((end - begin) * item), dst.data_ptr());
    return;
  }
  // Another dtype or device: through a bounce buffer of at most kChunk bytes.
  constexpr int64_t kChunk = 8 << 20;
  const int64_t per = std::max<int64_t>(1, kChunk / item);
  at::Tensor flat = dst.view({-1});
  at::Tensor bounce =
      at::empty({std::min(per, end - begin)}, at::TensorOptions().dtype(info.dtype));
  for (int64_t i = 0; i < end - begin; i += per) {
    const int64_t n = std::min(per, end - begin - i);
    at::Tensor part = bounce.narrow(0, 0, n);
    map_->pread_exact(off + static_cast<uint64_t>(i * item), static_cast<uint64_t>(n * item),
                      part.data_ptr());
    flat.narrow(0, i, n).copy_(part);  // pageable host-to-device: returns once part is consumed
  }
}

}  // namespace ft::io
