#include "core/host_alloc.h"

#include <cstdlib>
#include <initializer_list>
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

}  // namespace ft::core
