#include "core/host_alloc.h"

#include <cstdlib>
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

}  // namespace ft::core
