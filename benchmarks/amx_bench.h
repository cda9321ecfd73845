// What the standalone AMX programs in benchmarks/ share: asking Linux for the tile state
// and configuring all eight tiles as 16 rows x 64 bytes (palette 1).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>

namespace amx_bench {

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// False (and a line saying why) where Linux gives this process no AMX tile state.
inline bool start_square_tiles() {
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) != 0) {
    std::puts("no AMX tile state from Linux");
    return false;
  }
  TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  return true;
}

}  // namespace amx_bench
