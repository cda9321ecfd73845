// Turning AMX on for the process, and the tile configuration of the packed kernels (amx.h).

#include "amx.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#ifdef PAGEDLLM_AMX
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pagedllm {
namespace amx {
namespace {

// -1: not asked yet; 0: off; 1: on. `available` remembers what the CPU and Linux allow.
std::atomic<int> state{-1};
std::atomic<int> available{-1};

bool probe() {
#ifdef PAGEDLLM_AMX
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool tile = (edx >> 24) & 1, int8 = (edx >> 25) & 1;
  if (!tile || !int8) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

bool is_available() {
  int a = available.load(std::memory_order_acquire);
  if (a < 0) {
    a = probe() ? 1 : 0;
    available.store(a, std::memory_order_release);
  }
  return a == 1;
}

}  // namespace

bool enabled() {
  int s = state.load(std::memory_order_acquire);
  if (s < 0) {
    const char* off = std::getenv("PAGEDLLM_DISABLE_AMX");
    const bool wanted = off == nullptr || std::strcmp(off, "") == 0 || std::strcmp(off, "0") == 0;
    s = wanted && is_available() ? 1 : 0;
    state.store(s, std::memory_order_release);
  }
  return s == 1;
}

bool set_enabled(bool on) {
  state.store(on && is_available() ? 1 : 0, std::memory_order_release);
  return enabled();
}

bool bf16_enabled() {
#ifdef PAGEDLLM_AMX_BF16
  static const bool cpu_has_it = [] {
    unsigned eax, ebx, ecx, edx;
    return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && ((edx >> 22) & 1);
  }();
  return cpu_has_it && enabled();
#else
  return false;
#endif
}

#ifdef PAGEDLLM_AMX
namespace {
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];  // bytes per row of each tile
  uint8_t rows[16];
};

void load_config(const TileConfig& config) {
  // GCC 12's _tile_loadconfig tells the compiler it reads fewer bytes than the 64 it does,
  // so the row and column settings were dropped as dead stores: make them visible first.
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
}  // namespace

void configure_thread_square() {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  load_config(config);
}

void configure_thread(int group) {
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 2; ++t) config.rows[t] = 16, config.colsb[t] = 64;   // C: 16 x int32[16]
  for (int t = 4; t < 6; ++t) config.rows[t] = 16, config.colsb[t] = group;  // A: 16 x int8[G]
  for (int t = 6; t < 8; ++t) config.rows[t] = group / 4, config.colsb[t] = 64;  // B
  load_config(config);
}
#endif

}  // namespace amx
}  // namespace pagedllm
