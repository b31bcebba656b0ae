// Small address helpers shared by the launcher and the runtime. Never reverse-resolves an address.
// Thread-safe.
#pragma once

#include <cstdint>
#include <string>

namespace ft {

// The local address this machine uses to reach `host` (a UDP connect: no packet is sent);
// "" when `host` does not resolve.
std::string local_addr_towards(const std::string& host, uint16_t port);

}  // namespace ft
