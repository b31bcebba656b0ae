#include "core/host_alloc.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/accumulate.h>
#include <sys/mman.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <unordered_map>
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

// ---- the step pool ----

namespace {

constexpr size_t kPageBytes = 4096;

class StepPool final : public c10::Allocator {
 public:
  static StepPool& get() {
    static StepPool* pool = new StepPool();  // never destroyed: blocks may be freed at exit
    return *pool;
  }

  c10::DataPtr allocate(size_t n) override {
    if (n < kStepPoolMinBytes) {
      void* p = c10::alloc_cpu(n);
      return {p, p, &c10::free_cpu, c10::Device(c10::kCPU)};
    }
    const size_t bytes = (n + kPageBytes - 1) / kPageBytes * kPageBytes;
    const bool keep = keeping_.load(std::memory_order_relaxed);
    void* p = take(bytes, keep);
    if (!p) p = map(bytes, n, keep);
    // The context is the pointer itself, as raw_allocate() requires (oneDNN's bf16 kernels
    // allocate their scratch through it).
    return {p, p, &StepPool::give_back, c10::Device(c10::kCPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &StepPool::raw_free; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void set_keeping(bool on) { keeping_.store(on, std::memory_order_relaxed); }

  void release() {
    std::vector<std::pair<void*, size_t>> drop;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [bytes, ptrs] : idle_)
        for (void* p : ptrs) drop.emplace_back(p, bytes);
      idle_.clear();
      stats_.idle_bytes = 0;
    }
    for (const auto& [p, bytes] : drop) ::munmap(p, bytes);
  }

  StepPoolStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  void reset_peak() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.peak_bytes = stats_.live_bytes + stats_.idle_bytes;
  }

 private:
  struct Block {
    size_t bytes;
    bool keep;  // allocated inside a step: kept when freed, whenever that is
  };

  // A kept block of `bytes`, recorded as in use; null if none.
  void* take(size_t bytes, bool keep) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = idle_.find(bytes);
    if (it == idle_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    blocks_[p] = Block{bytes, keep};
    stats_.idle_bytes -= bytes;
    stats_.live_bytes += bytes;
    stats_.reused++;
    return p;
  }

  // A new mapping of `bytes`, recorded as in use.
  void* map(size_t bytes, size_t asked, bool keep) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {  // idle blocks of other sizes first, then once more
      release();
      p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    TORCH_CHECK_WITH(OutOfMemoryError, p != MAP_FAILED,
                     "ft host allocator: not enough memory: you tried to allocate ", asked,
                     " bytes (", std::strerror(errno), ")");
    std::lock_guard<std::mutex> lock(mu_);
    blocks_[p] = Block{bytes, keep};
    stats_.live_bytes += bytes;
    stats_.mapped++;
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.live_bytes + stats_.idle_bytes);
    return p;
  }

  // A pool block's deleter: kept or unmapped.
  static void give_back(void* p) {
    if (get().free_block(p)) return;
    std::fprintf(stderr, "ft: step pool: a block it never allocated was given back (%p)\n", p);
    std::abort();
  }

  // raw_deallocate()'s: a pool block, or a small one from glibc.
  static void raw_free(void* p) {
    if (!get().free_block(p)) c10::free_cpu(p);
  }

  bool free_block(void* p) {
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = blocks_.find(p);
      if (it == blocks_.end()) return false;
      const Block b = it->second;
      blocks_.erase(it);
      stats_.live_bytes -= b.bytes;
      if (b.keep) {
        idle_[b.bytes].push_back(p);
        stats_.idle_bytes += b.bytes;
        return true;
      }
      bytes = b.bytes;
    }
    ::munmap(p, bytes);
    return true;
  }

  std::mutex mu_;
  std::unordered_map<void*, Block> blocks_;              // in use
  std::unordered_map<size_t, std::vector<void*>> idle_;  // kept, by page-rounded size
  StepPoolStats stats_;
  std::atomic<bool> keeping_{false};
};

}  // namespace

void install_step_pool() { c10::SetCPUAllocator(&StepPool::get(), /*priority=*/1); }

void set_step_pool_keeping(bool on) { StepPool::get().set_keeping(on); }

void release_step_pool() { StepPool::get().release(); }

StepPoolStats step_pool_stats() { return StepPool::get().stats(); }

void reset_step_pool_peak() { StepPool::get().reset_peak(); }

void configure_host_malloc() {
  limit_malloc_arenas();
  keep_freed_heap();
  install_step_pool();
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
