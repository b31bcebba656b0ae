#include "core/host_alloc.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <vector>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace ft::core {

const char* limit_malloc_arenas() {
#if defined(__GLIBC__)
  if (const char* user = std::getenv("MALLOC_ARENA_MAX"); user && *user) return user;
  return mallopt(M_ARENA_MAX, 1) == 1 ? "1" : "";
#else
  return "";
#endif
}

bool keep_freed_heap() {
#if defined(__GLIBC__)
  for (const char* name : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"})
    if (const char* user = std::getenv(name); user && *user) return false;
  // Setting either fixes both (glibc stops adjusting them), so both are set.
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 && mallopt(M_TRIM_THRESHOLD, 256 << 20) == 1;
#else
  return false;
#endif
}

void configure_host_malloc() {
  limit_malloc_arenas();
  keep_freed_heap();
}

// The allocator behind HostBlockCache::empty. Each block's DataPtr holds a Block (its pointer, its
// size and the state), so a block freed after the cache is gone goes back to the C library.
struct HostBlockCache::State final : public c10::Allocator,
                                     public std::enable_shared_from_this<HostBlockCache::State> {
  struct Block {
    void* ptr;
    size_t bytes;
    std::shared_ptr<State> owner;
  };
  mutable std::mutex mu;
  std::vector<std::pair<void*, size_t>> kept;
  size_t max_blocks = 4;
  size_t reused = 0, allocated = 0;
  bool open = true;

  void free_kept_locked() {
    for (const auto& [p, n] : kept) c10::free_cpu(p);
    kept.clear();
  }

  c10::DataPtr allocate(size_t n) override {
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (size_t i = 0; i < kept.size(); ++i) {
        if (kept[i].second != n) continue;
        p = kept[i].first;
        kept.erase(kept.begin() + static_cast<std::ptrdiff_t>(i));
        ++reused;
        break;
      }
      if (!p) {
        free_kept_locked();  // of other sizes: never idle beside a new block
        ++allocated;
      }
    }
    if (!p) p = c10::alloc_cpu(n);
    auto* b = new Block{p, n, shared_from_this()};
    return {p, b, &State::give_back, c10::Device(c10::kCPU)};
  }

  static void give_back(void* ctx) {
    std::unique_ptr<Block> b(static_cast<Block*>(ctx));
    State& s = *b->owner;
    {
      std::lock_guard<std::mutex> lock(s.mu);
      if (s.open && s.max_blocks > 0) {
        if (s.kept.size() >= s.max_blocks) {
          c10::free_cpu(s.kept.front().first);
          s.kept.erase(s.kept.begin());
        }
        s.kept.emplace_back(b->ptr, b->bytes);
        return;
      }
    }
    c10::free_cpu(b->ptr);
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

HostBlockCache::HostBlockCache(size_t max_blocks, size_t min_bytes)
    : state_(std::make_shared<State>()), min_bytes_(min_bytes) {
  state_->max_blocks = max_blocks;
}

HostBlockCache::~HostBlockCache() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->open = false;
  state_->free_kept_locked();
}

at::Tensor HostBlockCache::empty(at::IntArrayRef sizes, at::ScalarType dtype) {
  if (static_cast<size_t>(c10::multiply_integers(sizes)) * c10::elementSize(dtype) < min_bytes_)
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  return at::Tensor(at::detail::empty_generic(
      sizes, state_.get(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt));
}

void HostBlockCache::release() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->free_kept_locked();
}

size_t HostBlockCache::kept_blocks() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->kept.size();
}

size_t HostBlockCache::kept_bytes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  size_t n = 0;
  for (const auto& k : state_->kept) n += k.second;
  return n;
}

size_t HostBlockCache::reused() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->reused;
}

size_t HostBlockCache::allocated() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->allocated;
}

}  // namespace ft::core
