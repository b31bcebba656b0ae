// Small address helpers shared by the launcher and the runtime. Never reverse-resolves an address.
// Thread-safe.
#pragma once

#include <sys/socket.h>

#include <cstdint>
#include <string>

namespace ft {

// The numeric form of an IPv4 or IPv6 socket address ("10.0.0.1", "fe80::1"); "" for another
// family.
std::string numeric_address(const sockaddr* sa);

// The local address this machine uses to reach `host` (a UDP connect: no packet is sent);
// "" when `host` does not resolve.
std::string local_addr_towards(const std::string& host, uint16_t port);

}  // namespace ft
